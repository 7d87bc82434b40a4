//! The session timeline: one lane per request on a shared step axis, built
//! from the bundle's events (arrivals, interrupts, and each step's decisions,
//! spans and finishes), and its hand-written SVG (lanes, runs and marks are a
//! layout no plotting library draws well).
//!
//! Invariant: a lane's size does not grow with the session's length but with
//! what happens to the request — consecutive steps of one kind (prefill
//! chunks, decode steps) merge into one [`Run`].

use serde::Serialize;

use lmrr_engine::scheduler::{Decision, RequestId};
use lmrr_recorder::{Bundle, Event};

use super::page::esc;
use crate::driver::Catalog;
use crate::report::Divergence;

/// What a run of steps did for a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum RunKind {
    /// Prompt (or recomputed) positions, in chunks.
    Prefill,
    /// One sampled token per step.
    Decode,
    /// K/V carried from the prefill engine into the decode engine's pages
    /// (a disaggregated deployment's decode lane).
    Transfer,
    /// K/V written into decode pages after its request was aborted and the
    /// pages freed (`pd-abort-reuses-pages`).
    OrphanTransfer,
}

/// Consecutive steps of one kind.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Run {
    pub kind: RunKind,
    pub from: u64,
    pub to: u64,
    /// Steps in the run (prefill chunks, decode steps).
    pub steps: u64,
    /// Positions computed.
    pub positions: usize,
}

/// A point event on a lane.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Mark {
    /// Arrives at the boundary before `step`.
    Arrival {
        step: u64,
        prompt_tokens: usize,
    },
    /// Admitted in `step`, with `cached` prompt tokens served from the prefix cache.
    Admit {
        step: u64,
        cached: usize,
    },
    Interrupt {
        step: u64,
    },
    Preempt {
        step: u64,
    },
    Finish {
        step: u64,
        reason: String,
    },
}

impl Mark {
    pub fn step(&self) -> u64 {
        match self {
            Mark::Arrival { step, .. }
            | Mark::Admit { step, .. }
            | Mark::Interrupt { step }
            | Mark::Preempt { step }
            | Mark::Finish { step, .. } => *step,
        }
    }
}

/// One request's lane.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Lane {
    pub request: String,
    pub request_id: RequestId,
    pub turn: usize,
    /// The engine of a disaggregated deployment the lane shows (`prefill`,
    /// `decode`); absent for a colocated engine's single lane.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub engine: Option<String>,
    pub runs: Vec<Run>,
    pub marks: Vec<Mark>,
}

/// The first divergence, as placed on the timeline.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Marker {
    pub step: u64,
    pub signal: String,
    pub request_id: Option<RequestId>,
    pub position: Option<usize>,
}

/// All lanes on the step axis `0..=last_step`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Timeline {
    pub last_step: u64,
    pub lanes: Vec<Lane>,
    pub divergence: Option<Marker>,
}

impl Timeline {
    /// Lanes in arrival order.
    pub(crate) fn of(bundle: &Bundle, cat: &Catalog) -> Self {
        if crate::pd::pd_config(bundle).is_some() {
            return super::pd_lanes::of(bundle, cat);
        }
        let mut lanes: Vec<Lane> = cat
            .order
            .iter()
            .map(|&id| Lane {
                request: cat.name(id),
                request_id: id,
                turn: cat.turn(id),
                engine: None,
                runs: Vec::new(),
                marks: Vec::new(),
            })
            .collect();
        let index: std::collections::BTreeMap<RequestId, usize> = cat
            .order
            .iter()
            .enumerate()
            .map(|(i, &id)| (id, i))
            .collect();
        let mut last_step = 0;
        for e in &bundle.events {
            match e {
                Event::Arrival { step, request, .. } => {
                    if let Some(&i) = index.get(&request.id) {
                        lanes[i].marks.push(Mark::Arrival {
                            step: *step,
                            prompt_tokens: request.prompt.len(),
                        });
                    }
                }
                Event::Interrupt { step, id, .. } => {
                    if let Some(&i) = index.get(id) {
                        lanes[i].marks.push(Mark::Interrupt { step: *step });
                    }
                }
                Event::Disaggregated(_) | Event::PdStep(_) => {}
                Event::Step(r) => {
                    last_step = last_step.max(r.step);
                    add_decisions(&mut lanes, &index, r);
                    for (id, reason) in &r.finished {
                        if let Some(&i) = index.get(id) {
                            lanes[i].marks.push(Mark::Finish {
                                step: r.step,
                                reason: format!("{reason:?}").to_lowercase(),
                            });
                        }
                    }
                }
            }
        }
        Timeline {
            last_step,
            lanes,
            divergence: None,
        }
    }

    pub(crate) fn mark_divergence(&mut self, d: &Divergence) {
        self.divergence = Some(Marker {
            step: d.step,
            signal: d.signal.to_string(),
            request_id: d.request_id,
            position: d.position,
        });
    }
}

/// A step's admissions, preemptions and scheduled spans on the lanes `index`
/// maps its requests to (consecutive spans of one kind merge into a run).
pub(super) fn add_decisions(
    lanes: &mut [Lane],
    index: &std::collections::BTreeMap<RequestId, usize>,
    r: &lmrr_engine::StepReport,
) {
    for d in &r.decisions {
        match d {
            Decision::Admit { id, cached_tokens } => {
                if let Some(&i) = index.get(id) {
                    lanes[i].marks.push(Mark::Admit {
                        step: r.step,
                        cached: *cached_tokens,
                    });
                }
            }
            Decision::Preempt { id } => {
                if let Some(&i) = index.get(id) {
                    lanes[i].marks.push(Mark::Preempt { step: r.step });
                }
            }
            Decision::Schedule { id, len, .. } => {
                let Some(&i) = index.get(id) else { continue };
                let sampled = r.seqs.iter().any(|s| s.id == *id && s.sampled.is_some());
                let kind = if *len == 1 && sampled {
                    RunKind::Decode
                } else {
                    RunKind::Prefill
                };
                let runs = &mut lanes[i].runs;
                match runs.last_mut() {
                    Some(run) if run.kind == kind && run.to + 1 == r.step => {
                        run.to = r.step;
                        run.steps += 1;
                        run.positions += len;
                    }
                    _ => runs.push(Run {
                        kind,
                        from: r.step,
                        to: r.step,
                        steps: 1,
                        positions: *len,
                    }),
                }
            }
            Decision::Interrupt { .. } => {}
        }
    }
}

/// Extends the lane's last run of `kind` if it ended the step before, or
/// starts one.
pub(super) fn add_run(lane: &mut Lane, kind: RunKind, step: u64, positions: usize) {
    match lane.runs.last_mut() {
        Some(run) if run.kind == kind && run.to + 1 >= step => {
            if run.to != step {
                run.steps += 1;
            }
            run.to = step;
            run.positions += positions;
        }
        _ => lane.runs.push(Run {
            kind,
            from: step,
            to: step,
            steps: 1,
            positions,
        }),
    }
}

const LABEL_W: f64 = 150.0;
const PLOT_W: f64 = 1000.0;
const LANE_H: f64 = 22.0;
const AXIS_H: f64 = 26.0;

/// The timeline's SVG (at most [`super::MAX_LANES`] lanes; the page says how
/// many more the data holds). `truncated_at`: the last step of a truncated
/// bundle, drawn as the end of the readable part.
pub fn svg(t: &Timeline, truncated_at: Option<u64>) -> String {
    let lanes = &t.lanes[..t.lanes.len().min(super::MAX_LANES)];
    let span = (t.last_step + 1) as f64;
    let x = |step: u64| LABEL_W + PLOT_W * step as f64 / span;
    let w = |from: u64, to: u64| (PLOT_W * (to + 1 - from) as f64 / span).max(1.0);
    let height = AXIS_H + LANE_H * lanes.len() as f64 + 8.0;
    let width = LABEL_W + PLOT_W + 20.0;
    let mut s = format!(
        r#"<svg id="timeline" class="timeline" viewBox="0 0 {width} {height}" width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg" role="img" aria-label="session timeline">"#
    );
    // Axis: about ten ticks at round step counts.
    let raw = span / 10.0;
    let mag = 10f64.powf(raw.log10().floor());
    let tick = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|v| *v >= raw)
        .unwrap_or(mag * 10.0)
        .max(1.0) as u64;
    let mut st = 0;
    while st <= t.last_step {
        let xx = x(st);
        s += &format!(
            r#"<line class="tick" x1="{xx:.1}" y1="{}" x2="{xx:.1}" y2="{height}"/><text class="axis" x="{xx:.1}" y="14">{st}</text>"#,
            AXIS_H - 6.0
        );
        st += tick;
    }
    s += &format!(
        r#"<text class="axis" x="{}" y="14" text-anchor="end">step</text>"#,
        LABEL_W - 8.0
    );
    for (i, lane) in lanes.iter().enumerate() {
        let y = AXIS_H + LANE_H * i as f64;
        let mid = y + LANE_H / 2.0;
        let divergent = t
            .divergence
            .as_ref()
            .is_some_and(|d| d.request_id == Some(lane.request_id));
        s += &format!(
            r#"<g class="lane{}" data-request="{}"><text class="lane-label" x="{}" y="{:.1}" text-anchor="end">{} · turn {}{}</text>"#,
            if divergent { " divergent" } else { "" },
            lane.request_id,
            LABEL_W - 8.0,
            mid + 4.0,
            esc(&lane.request),
            lane.turn,
            lane.engine
                .as_deref()
                .map(|e| format!(" · {e}"))
                .unwrap_or_default()
        );
        // The life line, arrival to finish.
        let arrival = lane.marks.iter().map(Mark::step).min().unwrap_or(0);
        let end = lane
            .marks
            .iter()
            .filter(|m| matches!(m, Mark::Finish { .. }))
            .map(Mark::step)
            .max()
            .unwrap_or(t.last_step);
        s += &format!(
            r#"<line class="life" x1="{:.1}" y1="{mid:.1}" x2="{:.1}" y2="{mid:.1}"/>"#,
            x(arrival),
            x(end) + w(end, end)
        );
        for r in &lane.runs {
            let kind = match r.kind {
                RunKind::Prefill => "prefill",
                RunKind::Decode => "decode",
                RunKind::Transfer => "transfer",
                RunKind::OrphanTransfer => "orphan-transfer",
            };
            s += &format!(
                r#"<rect class="{kind}" x="{:.1}" y="{:.1}" width="{:.1}" height="{:.1}"><title>{}: {kind} steps {}..={} ({} steps, {} positions)</title></rect>"#,
                x(r.from),
                y + 4.0,
                w(r.from, r.to),
                LANE_H - 8.0,
                esc(&lane.request),
                r.from,
                r.to,
                r.steps,
                r.positions
            );
        }
        for m in &lane.marks {
            let xx = x(m.step());
            let (class, shape, title) = match m {
                Mark::Arrival {
                    step,
                    prompt_tokens,
                } => (
                    "arrival",
                    format!(
                        r#"<path d="M{xx:.1} {:.1} l5 5 l-5 5 z"/>"#,
                        y + 1.0
                    ),
                    format!("arrives before step {step} ({prompt_tokens} prompt tokens)"),
                ),
                Mark::Admit { step, cached } if *cached > 0 => (
                    "cached",
                    format!(
                        r#"<rect x="{:.1}" y="{:.1}" width="7" height="{:.1}"/><text class="cached-label" x="{:.1}" y="{:.1}" text-anchor="end">{cached} cached</text>"#,
                        xx - 7.0,
                        y + 3.0,
                        LANE_H - 6.0,
                        xx - 9.0,
                        y + 9.0
                    ),
                    format!("admitted in step {step}: {cached} prompt tokens served from the prefix cache"),
                ),
                Mark::Admit { .. } => continue,
                Mark::Interrupt { step } => (
                    "interrupt",
                    format!(
                        r#"<path d="M{:.1} {:.1} l8 8 m0 -8 l-8 8"/>"#,
                        xx - 4.0,
                        mid - 4.0
                    ),
                    format!("interrupted before step {step}"),
                ),
                Mark::Preempt { step } => (
                    "preempt",
                    format!(
                        r#"<path d="M{:.1} {:.1} l-4 -7 h8 z"/>"#,
                        xx,
                        mid + 3.0
                    ),
                    format!("preempted in step {step}: pages released, recomputed later"),
                ),
                Mark::Finish { step, reason } => (
                    "finish",
                    format!(
                        r#"<rect x="{:.1}" y="{:.1}" width="3" height="{:.1}"/>"#,
                        xx + w(*step, *step),
                        y + 2.0,
                        LANE_H - 4.0
                    ),
                    format!("finished in step {step} ({reason})"),
                ),
            };
            s += &format!(
                r#"<g class="mark {class}">{shape}<title>{}: {}</title></g>"#,
                esc(&lane.request),
                esc(&title)
            );
        }
        s += "</g>";
    }
    if let Some(d) = &t.divergence {
        let xx = x(d.step);
        let row = lanes
            .iter()
            .position(|l| Some(l.request_id) == d.request_id);
        s += &format!(
            r#"<g id="divergence-marker" class="divergence"><line x1="{xx:.1}" y1="{}" x2="{xx:.1}" y2="{height}"/><text x="{:.1}" y="{}">first divergence · step {} · {}</text>"#,
            AXIS_H - 6.0,
            xx + 4.0,
            AXIS_H - 8.0,
            d.step,
            esc(&d.signal)
        );
        if let Some(i) = row {
            s += &format!(
                r#"<circle cx="{xx:.1}" cy="{:.1}" r="6"/>"#,
                AXIS_H + LANE_H * i as f64 + LANE_H / 2.0
            );
        }
        s += &format!(
            "<title>first divergence at step {} ({}){}</title></g>",
            d.step,
            esc(&d.signal),
            d.position
                .map(|p| format!(", position {p}"))
                .unwrap_or_default()
        );
    }
    if let Some(end) = truncated_at {
        let xx = x(end) + w(end, end);
        s += &format!(
            r#"<g class="truncated"><line x1="{xx:.1}" y1="{}" x2="{xx:.1}" y2="{height}"/><text x="{:.1}" y="{}" text-anchor="end">bundle truncated after step {end}</text></g>"#,
            AXIS_H - 6.0,
            xx - 4.0,
            height - 2.0
        );
    }
    s += "</svg>";
    s
}
