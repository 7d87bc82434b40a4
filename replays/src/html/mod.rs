//! The HTML report: one self-contained page (inline SVG and CSS, a little
//! JavaScript for hover details, no network fetches) that shows a bundle's
//! session timeline, the first divergence, drift plots, the texts side by side,
//! bisect probes and the oracle's turns; and `--svg`, the drift plot alone.
//!
//! One source: everything the page draws comes from a [`ReportData`],
//! assembled from the same structures as the text report and `--json`
//! ([`Outcome`], [`BisectOutcome`], [`OracleTurn`]) plus the bundle's events
//! and the driver's [`Trace`]. It is embedded in the page as JSON
//! (`<script type="application/json" id="lmrr-data">`), and the SVG is drawn
//! from it on the Rust side; the page's script only reads it for hover details.
//!
//! Invariants: the page's size is bounded whatever the bundle's length —
//! timeline lanes merge consecutive steps of one kind into runs (at most
//! [`MAX_LANES`] lanes drawn), drift series are bucketed to at most
//! [`MAX_POINTS`] points, and texts are windowed around the first difference.
//!
//! - [`timeline`]: lanes, runs and marks from the bundle's events; the SVG.
//! - [`plot`]: drift plots, drawn with plotters' SVG backend.
//! - [`page`]: the HTML around them.

pub mod audit;
mod page;
mod pd_lanes;
pub mod plot;
pub mod timeline;

use std::collections::BTreeMap;

use serde::Serialize;

use lmrr_engine::scheduler::RequestId;
use lmrr_engine::Model;
use lmrr_recorder::{Bundle, Integrity};

use crate::bisect::BisectOutcome;
use crate::driver::{Catalog, Trace};
use crate::oracle::OracleTurn;
use crate::report::Outcome;

pub use audit::{audit_svg, AuditSeries};
pub use timeline::Timeline;

/// Timeline lanes drawn at most (all are in the data).
pub const MAX_LANES: usize = 200;
/// Points per drift series at most: longer replays are bucketed (max of
/// |Δlogit| and KL, share of agreeing rows, per bucket).
pub const MAX_POINTS: usize = 400;
/// Requests given their own drift series (the ones that drift most, the
/// divergent one first); the rest are in the "all rows" series.
pub const MAX_SERIES: usize = 6;
/// Tokens of text shown on each side of the first difference.
pub const TEXT_CONTEXT: usize = 48;

/// Errors of the HTML and SVG renderers.
#[derive(Debug, thiserror::Error)]
pub enum HtmlError {
    #[error("drawing the drift plot: {0}")]
    Plot(String),
    #[error("serializing the report data: {0}")]
    Json(String),
}

/// What a report was made by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    Inspect,
    Replay,
    Oracle,
    Bisect,
}

/// The bundle, as far as the page needs it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BundleFacts {
    pub path: String,
    pub model: String,
    /// The recording's patch set (`none` for the reference engine).
    pub recorded_patches: String,
    /// The tensor-parallel degree the session was recorded at (shown, and
    /// serialized, only above 1: it never changes a bit).
    #[serde(skip_serializing_if = "degree_one")]
    pub tp_degree: u32,
    pub steps: u64,
    pub requests: usize,
    pub bytes: u64,
    pub integrity: IntegrityFacts,
}

fn degree_one(d: &u32) -> bool {
    *d == 1
}

/// Complete, or truncated and where.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "state", rename_all = "kebab-case")]
pub enum IntegrityFacts {
    Complete,
    Truncated {
        /// Complete frames read (manifest included).
        frames: usize,
        /// Byte offset where the readable part ends.
        offset: u64,
        why: String,
        /// The last step the readable part holds (`None`: no step).
        last_step: Option<u64>,
    },
}

/// One point of a drift series (one step, or one bucket of steps).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DriftPoint {
    /// First step of the bucket.
    pub step: u64,
    /// Last step of the bucket.
    pub to: u64,
    pub rows: usize,
    pub max_abs_dlogit: f32,
    /// Max KL(P_expected ‖ P_actual) over the bucket's rows.
    pub kl: f64,
    /// Share of rows whose argmax agrees.
    pub top1_agreement: f64,
}

/// One line of the drift plots.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DriftSeries {
    /// A request's name, or `all rows`.
    pub name: String,
    pub request_id: Option<RequestId>,
    pub points: Vec<DriftPoint>,
}

/// The drift plots' data.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Drift {
    /// Steps per point (1: no bucketing).
    pub bucket: u64,
    pub first_step: u64,
    pub last_step: u64,
    /// The divergence step to mark, if any.
    pub marker: Option<u64>,
    pub series: Vec<DriftSeries>,
    /// Requests with drift rows but no series of their own.
    pub folded: usize,
}

/// A token of a text panel.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Tok {
    pub position: usize,
    pub token: u32,
    pub text: String,
}

/// Expected and actual text of one request, windowed.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Texts {
    pub request: String,
    pub expected_label: String,
    pub actual_label: String,
    pub expected: Vec<Tok>,
    pub actual: Vec<Tok>,
    /// The position highlighted: the first whose tokens differ, else the
    /// divergence's own position.
    pub highlight: Option<usize>,
    /// Whether the tokens at `highlight` differ (else only bits moved there).
    pub tokens_differ: bool,
    /// Tokens left out before and after the window.
    pub skipped_before: usize,
    pub skipped_after: usize,
}

/// Everything the page shows.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReportData {
    pub kind: Kind,
    /// The command, as the user would type it.
    pub command: String,
    pub bundle: BundleFacts,
    /// The patch set under test (replay), the culprit set (bisect).
    pub under: Option<String>,
    /// The same structure as `--json` prints.
    pub outcome: Option<Outcome>,
    /// The text report, verbatim.
    pub outcome_text: Option<String>,
    pub bisect: Option<BisectOutcome>,
    pub bisect_text: Option<String>,
    pub oracle: Option<Vec<OracleTurn>>,
    pub timeline: Timeline,
    pub drift: Option<Drift>,
    pub texts: Option<Texts>,
}

impl ReportData {
    /// The bundle alone: timeline and facts (`lmrr inspect --html`).
    pub fn inspect(bundle: &Bundle, path: &str, command: &str) -> Self {
        let cat = Catalog::of(bundle);
        let steps = bundle.events.iter().filter(|e| e.step().is_some()).count() as u64;
        let last_step = bundle.events.iter().rev().find_map(|e| e.step());
        let m = &bundle.manifest;
        ReportData {
            kind: Kind::Inspect,
            command: command.into(),
            bundle: BundleFacts {
                path: path.into(),
                model: m.model.origin.clone(),
                recorded_patches: if m.patches.is_empty() {
                    "none".into()
                } else {
                    m.patches.join(",")
                },
                tp_degree: m.tp_degree,
                steps,
                requests: cat.order.len(),
                bytes: bundle.size,
                integrity: match &bundle.integrity {
                    Integrity::Complete { .. } => IntegrityFacts::Complete,
                    Integrity::Truncated {
                        frames,
                        offset,
                        why,
                    } => IntegrityFacts::Truncated {
                        frames: *frames,
                        offset: *offset,
                        why: why.clone(),
                        last_step,
                    },
                },
            },
            under: None,
            outcome: None,
            outcome_text: None,
            bisect: None,
            bisect_text: None,
            oracle: None,
            timeline: Timeline::of(bundle, &cat),
            drift: None,
            texts: None,
        }
    }

    /// A replay under `under`: its outcome, trace and the bundle.
    pub fn replay(
        bundle: &Bundle,
        path: &str,
        command: &str,
        model: &Model,
        under: &str,
        outcome: &Outcome,
        trace: &Trace,
    ) -> Self {
        let mut r = Self::inspect(bundle, path, command);
        r.kind = Kind::Replay;
        r.under = Some(under.into());
        r.add_outcome(bundle, model, outcome, trace);
        r
    }

    /// The recompute oracle's outcome and its turns.
    pub fn oracle(
        bundle: &Bundle,
        path: &str,
        command: &str,
        model: &Model,
        outcome: &Outcome,
        turns: &[OracleTurn],
    ) -> Self {
        let mut r = Self::inspect(bundle, path, command);
        r.kind = Kind::Oracle;
        r.under = Some(r.bundle.recorded_patches.clone());
        r.oracle = Some(turns.to_vec());
        r.outcome = Some(outcome.clone());
        r.outcome_text = Some(outcome.to_string());
        if let Some(d) = outcome.divergence() {
            r.timeline.mark_divergence(d);
            // The recorded tokens against the recomputation's choice at the
            // first difference (the recomputation goes no further).
            let cat = Catalog::of(bundle);
            if let (Some(id), Some(pos), Some(e)) = (d.request_id, d.position, &d.expected) {
                let recorded = recorded_tokens(bundle, id);
                let mut expected: Vec<Tok> = recorded
                    .iter()
                    .filter(|t| t.0 <= pos)
                    .map(tok(model))
                    .collect();
                if let Some(last) = expected.last_mut().filter(|t| t.position == pos) {
                    last.token = e.token;
                    last.text = e.text.clone();
                }
                let actual: Vec<Tok> = recorded.iter().map(tok(model)).collect();
                r.texts = Some(texts(
                    cat.name(id),
                    "recomputed (cache off, batch of one)",
                    "recorded",
                    expected,
                    actual,
                    pos,
                ));
            }
        }
        r
    }

    /// A bisect's probes; with the replay under the culprit set, its
    /// divergence, drift and texts too.
    #[allow(clippy::too_many_arguments)]
    pub fn bisect(
        bundle: &Bundle,
        path: &str,
        command: &str,
        model: &Model,
        res: &BisectOutcome,
        culprit: Option<(&str, &Outcome, &Trace)>,
    ) -> Self {
        let mut r = Self::inspect(bundle, path, command);
        r.kind = Kind::Bisect;
        r.bisect = Some(res.clone());
        r.bisect_text = Some(res.to_string());
        if let Some((under, outcome, trace)) = culprit {
            r.under = Some(under.into());
            r.add_outcome(bundle, model, outcome, trace);
        }
        r
    }

    fn add_outcome(&mut self, bundle: &Bundle, model: &Model, outcome: &Outcome, trace: &Trace) {
        let cat = Catalog::of(bundle);
        self.outcome = Some(outcome.clone());
        self.outcome_text = Some(outcome.to_string());
        let d = outcome.divergence();
        if let Some(d) = d {
            self.timeline.mark_divergence(d);
        }
        self.drift = drift(trace, &cat, d.map(|d| d.step), d.and_then(|d| d.request_id));
        let Some(d) = d else { return };
        let Some(id) = d.request_id else { return };
        let recorded = recorded_tokens(bundle, id);
        let actual: Vec<(usize, u32)> = trace
            .sampled
            .get(&id)
            .map(|v| v.iter().map(|s| (s.position, s.token)).collect())
            .unwrap_or_default();
        let fallback = d.position.unwrap_or(0);
        self.texts = Some(texts(
            cat.name(id),
            "expected (recorded)",
            "actual (engine under test, fed the recorded tokens)",
            recorded.iter().map(tok(model)).collect(),
            actual.iter().map(tok(model)).collect(),
            fallback,
        ));
    }

    /// The page.
    pub fn to_html(&self) -> Result<String, HtmlError> {
        page::render(self)
    }

    /// The drift plot alone, as a standalone SVG document.
    pub fn drift_svg(&self) -> Result<String, HtmlError> {
        Ok(plot::drift_svg(self.drift.as_ref(), plot::SVG_WIDTH)?.svg)
    }

    /// The JSON embedded in the page.
    pub fn to_json(&self) -> Result<String, HtmlError> {
        serde_json::to_string_pretty(self).map_err(|e| HtmlError::Json(e.to_string()))
    }
}

/// `(position, token)` of a request's recorded samples, in order.
fn recorded_tokens(bundle: &Bundle, id: RequestId) -> Vec<(usize, u32)> {
    let mut out = Vec::new();
    for e in &bundle.events {
        for r in e.reports() {
            for s in r.seqs.iter().filter(|s| s.id == id) {
                if let Some(t) = s.sampled {
                    out.push((s.start.saturating_add(s.len), t));
                }
            }
        }
    }
    out
}

fn tok(model: &Model) -> impl Fn(&(usize, u32)) -> Tok + '_ {
    move |&(position, token)| Tok {
        position,
        token,
        text: model
            .tokenizer
            .decode(&[token])
            .unwrap_or_else(|_| format!("<{token}>")),
    }
}

/// Both sides windowed around the first position whose tokens differ (else
/// around `fallback`, the divergence's position).
fn texts(
    request: String,
    expected_label: &str,
    actual_label: &str,
    expected: Vec<Tok>,
    actual: Vec<Tok>,
    fallback: usize,
) -> Texts {
    let act: BTreeMap<usize, u32> = actual.iter().map(|t| (t.position, t.token)).collect();
    let first = expected
        .iter()
        .find(|t| act.get(&t.position).is_some_and(|&a| a != t.token))
        .map(|t| t.position);
    // Where the tokens all agree: the divergence's position if it is a
    // sampled one, else the start of the output.
    let at = first
        .or_else(|| {
            expected
                .iter()
                .any(|t| t.position == fallback)
                .then_some(fallback)
        })
        .or_else(|| expected.first().map(|t| t.position + TEXT_CONTEXT))
        .unwrap_or(fallback);
    let shown_at = first.or_else(|| (at == fallback).then_some(fallback));
    let lo = at.saturating_sub(TEXT_CONTEXT);
    let hi = at.saturating_add(TEXT_CONTEXT);
    let keep = |v: Vec<Tok>| -> (Vec<Tok>, usize, usize) {
        let before = v.iter().filter(|t| t.position < lo).count();
        let after = v.iter().filter(|t| t.position > hi).count();
        (
            v.into_iter()
                .filter(|t| (lo..=hi).contains(&t.position))
                .collect(),
            before,
            after,
        )
    };
    let (expected, b1, a1) = keep(expected);
    let (actual, b2, a2) = keep(actual);
    Texts {
        request,
        expected_label: expected_label.into(),
        actual_label: actual_label.into(),
        expected,
        actual,
        highlight: shown_at,
        tokens_differ: first.is_some(),
        skipped_before: b1.max(b2),
        skipped_after: a1.max(a2),
    }
}

/// Buckets the trace's drift rows into series: all rows, then the requests
/// that drift most (the divergent one first).
fn drift(
    trace: &Trace,
    cat: &Catalog,
    marker: Option<u64>,
    divergent: Option<RequestId>,
) -> Option<Drift> {
    let first_step = trace.drift.first()?.step;
    let last_step = trace.drift.last()?.step.max(marker.unwrap_or(0));
    let span = last_step - first_step + 1;
    let bucket = span.div_ceil(MAX_POINTS as u64).max(1);
    let points = |rows: &mut dyn Iterator<Item = &crate::driver::RowDrift>| {
        let mut out: Vec<DriftPoint> = Vec::new();
        for r in rows {
            let b = first_step + (r.step - first_step) / bucket * bucket;
            let agree = if r.top1_agrees { 1.0 } else { 0.0 };
            match out.last_mut() {
                Some(p) if p.step == b => {
                    p.to = p.to.max(r.step);
                    p.max_abs_dlogit = p.max_abs_dlogit.max(r.max_abs_dlogit);
                    p.kl = p.kl.max(r.kl);
                    p.top1_agreement =
                        (p.top1_agreement * p.rows as f64 + agree) / (p.rows + 1) as f64;
                    p.rows += 1;
                }
                _ => out.push(DriftPoint {
                    step: b,
                    to: r.step,
                    rows: 1,
                    max_abs_dlogit: r.max_abs_dlogit,
                    kl: r.kl,
                    top1_agreement: agree,
                }),
            }
        }
        out
    };
    let mut series = vec![DriftSeries {
        name: "all rows".into(),
        request_id: None,
        points: points(&mut trace.drift.iter()),
    }];
    // Requests by their largest drift, the divergent one first.
    let mut worst: BTreeMap<RequestId, f32> = BTreeMap::new();
    for r in &trace.drift {
        let w = worst.entry(r.request).or_insert(0.0);
        *w = w.max(r.max_abs_dlogit);
    }
    let mut ids: Vec<(RequestId, f32)> = worst.into_iter().collect();
    ids.sort_by(|a, b| {
        let key = |x: &(RequestId, f32)| Some(x.0) == divergent;
        key(b)
            .cmp(&key(a))
            .then(b.1.total_cmp(&a.1))
            .then(a.0.cmp(&b.0))
    });
    let folded = ids.len().saturating_sub(MAX_SERIES);
    for (id, _) in ids.into_iter().take(MAX_SERIES) {
        series.push(DriftSeries {
            name: cat.name(id),
            request_id: Some(id),
            points: points(&mut trace.drift.iter().filter(|r| r.request == id)),
        });
    }
    Some(Drift {
        bucket,
        first_step,
        last_step,
        marker,
        series,
        folded,
    })
}
