//! Lockstep re-execution of a bundle.
//!
//! Inputs come from the bundle: arrivals (full requests), and for every step the
//! recorded decisions (interrupts included) and sampled tokens. The engine under
//! test executes each step's decisions, samples on its own (compared with the
//! recording) and then continues on the recorded token, so every step sees the
//! recorded inputs and one divergence does not cascade into noise. When the
//! patch set under test differs from the recording's, a second engine with the
//! recording's patches runs alongside to supply the expected logits rows for
//! drift statistics. Signals are compared in this order per step: decision
//! feasibility, cache-state hash, then per sampled row the logits digest and
//! the token.

use std::collections::BTreeMap;

use lmrr_engine::scheduler::{Decision, RequestId, StepReport};
use lmrr_engine::{EngineError, Model, ModelIdentity, PatchSet, Scheduler};
use lmrr_kernels::tensor_core::Numerics;
use lmrr_kernels::Threads;
use lmrr_recorder::{Bundle, Event, Integrity};

use crate::report::{Divergence, DriftRow, Outcome, Signal, TokenInfo};

/// What counts as a divergence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Criterion {
    /// Any bit: cache contents, logits, tokens, decisions (the contract).
    Bits,
    /// Behaviour only: decisions, what is cached or referenced, sampled
    /// tokens. Numerical drift that changes no token is not counted.
    Behaviour,
    /// What the user sees: sampled tokens (and decisions that can no longer
    /// be executed). Cache changes that alter no token are not counted.
    Tokens,
}

/// How to replay.
#[derive(Debug, Clone)]
pub struct ReplayOptions {
    pub patches: PatchSet,
    pub criterion: Criterion,
    pub threads: Threads,
    /// Steps of drift statistics gathered after the first divergence.
    pub drift_steps: usize,
    /// Steps the replay goes on after the first divergence to fill the
    /// [`Trace`] (for plots); the report's own drift stays `drift_steps` long.
    pub trace_steps: u64,
    /// Stop at the first divergence (bisect probes).
    pub stop_at_first: bool,
    /// The command line that reproduces this replay, for the report.
    pub repro: String,
}

impl ReplayOptions {
    pub fn new(patches: PatchSet, threads: Threads) -> Self {
        Self {
            patches,
            criterion: Criterion::Bits,
            threads,
            drift_steps: 8,
            trace_steps: 0,
            stop_at_first: false,
            repro: String::new(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error(
        "model mismatch: the bundle was recorded on\n  {expected}\nbut the model given is\n  {found}\n\
         (differs in: {differs}; full weights digests {} vs {})",
        expected.weights_sha256,
        found.weights_sha256
    )]
    ModelMismatch {
        expected: Box<ModelIdentity>,
        found: Box<ModelIdentity>,
        /// Which of config, weights and tokenizer differ.
        differs: String,
    },
    #[error(
        "the bundle was recorded under arithmetic contract v{found}; this lmrr implements v{supported}. \
         Its hashes cannot match: re-record it with `lmrr rerecord`"
    )]
    Contract { found: u32, supported: u32 },
    #[error("the bundle names a patch this lmrr does not know: {0}")]
    UnknownPatch(String),
    #[error(
        "the bundle was recorded under `{recorded}` numerics, which this lmrr does not know \
         (it has canonical, tensor-core-sm90)"
    )]
    UnknownNumerics { recorded: String },
    #[error(
        "the bundle was recorded under `{recorded}` numerics and the model runs `{running}`: \
         set the recorded mode first (`set_recorded_numerics`)"
    )]
    NumericsMismatch { recorded: String, running: String },
    #[error("the bundle's own patch set cannot re-execute step {step}: {source}")]
    Baseline {
        step: u64,
        #[source]
        source: EngineError,
    },
    #[error(transparent)]
    Invalid(#[from] crate::validate::Invalid),
    #[error(transparent)]
    Engine(#[from] EngineError),
}

/// Requests seen in a bundle: names, prompts, recorded outputs.
pub(crate) struct Catalog {
    pub names: BTreeMap<RequestId, String>,
    pub prompts: BTreeMap<RequestId, Vec<u32>>,
    pub outputs: BTreeMap<RequestId, Vec<u32>>,
    pub order: Vec<RequestId>,
    /// Per request, how many earlier histories its prompt continues.
    continued: BTreeMap<RequestId, usize>,
}

impl Catalog {
    pub fn of(b: &Bundle) -> Self {
        let mut c = Catalog {
            names: BTreeMap::new(),
            prompts: BTreeMap::new(),
            outputs: BTreeMap::new(),
            order: Vec::new(),
            continued: BTreeMap::new(),
        };
        for e in &b.events {
            match e {
                Event::Arrival { name, request, .. } => {
                    c.names.insert(request.id, name.clone());
                    c.prompts.insert(request.id, request.prompt.clone());
                    c.order.push(request.id);
                }
                Event::Step(_) | Event::PdStep(_) => {
                    for r in e.reports() {
                        for s in &r.seqs {
                            if let Some(t) = s.sampled {
                                c.outputs.entry(s.id).or_default().push(t);
                            }
                        }
                    }
                }
                Event::Interrupt { .. } | Event::Disaggregated(_) => {}
            }
        }
        c.continued = lmrr_recorder::summary::continued_histories(&c.order, &c.prompts, &c.outputs);
        c
    }

    pub fn name(&self, id: RequestId) -> String {
        self.names
            .get(&id)
            .cloned()
            .unwrap_or_else(|| format!("#{id}"))
    }

    /// 1-based turn: one more than the number of earlier requests whose prompt
    /// and recorded output this request's prompt continues.
    pub fn turn(&self, id: RequestId) -> usize {
        1 + self.continued.get(&id).copied().unwrap_or(0)
    }
}

/// Puts `model`'s matmuls under the numerics `bundle` was recorded in
/// (replay re-executes in that arithmetic, on whichever device); the mode
/// it set. A mode this lmrr lacks, or one the model cannot run (the
/// tensor-core mode on non-bf16 weights), is refused.
pub fn set_recorded_numerics(model: &mut Model, bundle: &Bundle) -> Result<Numerics, ReplayError> {
    let recorded = &bundle.manifest.numerics;
    let n = Numerics::parse(recorded).ok_or_else(|| ReplayError::UnknownNumerics {
        recorded: recorded.clone(),
    })?;
    model.net.set_numerics(n)?;
    Ok(n)
}

pub(crate) fn check_bundle(bundle: &Bundle, model: &Model) -> Result<PatchSet, ReplayError> {
    let m = &bundle.manifest;
    if m.numerics != model.net.numerics().name() {
        return Err(ReplayError::NumericsMismatch {
            recorded: m.numerics.clone(),
            running: model.net.numerics().name().into(),
        });
    }
    if m.contract_version != lmrr_kernels::CONTRACT_VERSION {
        return Err(ReplayError::Contract {
            found: m.contract_version,
            supported: lmrr_kernels::CONTRACT_VERSION,
        });
    }
    let found = model.identity();
    let want = m.model.identity;
    if found != want {
        let differs: Vec<&str> = [
            ("config", want.config_sha256 != found.config_sha256),
            ("weights", want.weights_sha256 != found.weights_sha256),
            ("tokenizer", want.tokenizer_sha256 != found.tokenizer_sha256),
        ]
        .into_iter()
        .filter_map(|(n, d)| d.then_some(n))
        .collect();
        return Err(ReplayError::ModelMismatch {
            expected: Box::new(want),
            found: Box::new(found),
            differs: differs.join(", "),
        });
    }
    let patches = PatchSet::parse(&m.patches.join(",")).map_err(ReplayError::UnknownPatch)?;
    crate::validate::validate(bundle, model)?;
    Ok(patches)
}

pub(crate) fn token_info(model: &Model, token: u32, top: &[(u32, f32)]) -> TokenInfo {
    let text = |t: u32| {
        model
            .tokenizer
            .decode(&[t])
            .unwrap_or_else(|_| format!("<{t}>"))
    };
    TokenInfo {
        token,
        text: text(token),
        top: top.iter().map(|&(t, lp)| (t, text(t), lp)).collect(),
    }
}

fn short(h: &[u8; 32]) -> String {
    lmrr_engine::digest::hex(&h[..6])
}

/// Drift between two logits rows: (max |Δ|, KL(P_expected ‖ P_actual), argmax equal).
/// f64 sums in index order with `exp`/`log` from the pure-Rust `libm`, so the
/// KL printed in reports and snapshots has the same digits on every platform.
pub fn drift(expected: &[f32], actual: &[f32]) -> (f32, f64, bool) {
    let max = expected
        .iter()
        .zip(actual)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    let lsm = |r: &[f32]| {
        let m = r.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let lse = m + libm::log(r.iter().map(|&v| libm::exp(v as f64 - m)).sum::<f64>());
        r.iter().map(move |&v| v as f64 - lse).collect::<Vec<f64>>()
    };
    let (p, q) = (lsm(expected), lsm(actual));
    let kl = p
        .iter()
        .zip(&q)
        .map(|(&lp, &lq)| libm::exp(lp) * (lp - lq))
        .sum::<f64>()
        .max(0.0);
    let arg = |r: &[f32]| lmrr_kernels::argmax(r);
    (max, kl, arg(expected) == arg(actual))
}

/// The request a step's cache change is attributed to: the first admission,
/// else the first interrupt, else the first scheduled span.
pub(crate) fn attribute(decisions: &[Decision]) -> Option<(RequestId, Option<usize>)> {
    let admit = decisions.iter().find_map(|d| match d {
        Decision::Admit { id, cached_tokens } => Some((*id, Some(*cached_tokens))),
        _ => None,
    });
    admit
        .or_else(|| {
            decisions.iter().find_map(|d| {
                if let Decision::Interrupt { id } = d {
                    Some((*id, None))
                } else {
                    None
                }
            })
        })
        .or_else(|| {
            decisions.iter().find_map(|d| {
                if let Decision::Schedule { id, start, .. } = d {
                    Some((*id, Some(*start)))
                } else {
                    None
                }
            })
        })
}

/// One-line descriptions of the bundle's events for steps `lo..=hi`.
pub(crate) fn window(
    bundle: &Bundle,
    cat: &Catalog,
    model: &Model,
    lo: u64,
    hi: u64,
) -> Vec<String> {
    let text = |t: u32| model.tokenizer.decode(&[t]).unwrap_or_default();
    let mut out = Vec::new();
    for e in &bundle.events {
        match e {
            Event::Arrival {
                step,
                name,
                request,
            } if (lo..=hi).contains(step) => out.push(format!(
                "before step {step}: `{name}` arrives ({} prompt tokens)",
                request.prompt.len()
            )),
            Event::Interrupt { step, name, .. } if (lo..=hi).contains(step) => {
                out.push(format!("before step {step}: `{name}` is interrupted"))
            }
            Event::PdStep(p) if (lo..=hi).contains(&p.step) => {
                out.extend(crate::pd::step_lines(p, cat, |r| step_parts(r, cat, &text)));
            }
            Event::Step(r) if (lo..=hi).contains(&r.step) => {
                out.push(format!("step {}: {}", r.step, step_parts(r, cat, &text)));
            }
            _ => {}
        }
    }
    out
}

/// A step's decisions in one line (`idle` when it has none).
fn step_parts(r: &StepReport, cat: &Catalog, text: &dyn Fn(u32) -> String) -> String {
    let mut parts = Vec::new();
    for d in &r.decisions {
        parts.push(match d {
            Decision::Interrupt { id } => format!("abort {}", cat.name(*id)),
            Decision::Preempt { id } => format!("preempt {}", cat.name(*id)),
            Decision::Admit { id, cached_tokens } => {
                format!("admit {} ({cached_tokens} cached)", cat.name(*id))
            }
            Decision::Schedule { id, start, len } => {
                match r.seqs.iter().find(|s| s.id == *id).and_then(|s| s.sampled) {
                    Some(t) => format!(
                        "{} @{} → {t} {:?}",
                        cat.name(*id),
                        start.saturating_add(*len),
                        text(t)
                    ),
                    None => format!(
                        "{} prefill {start}..{}",
                        cat.name(*id),
                        start.saturating_add(*len)
                    ),
                }
            }
        });
    }
    if parts.is_empty() {
        "idle".into()
    } else {
        parts.join(" · ")
    }
}

/// Drift of one request's logits row in one step (expected: the recording's
/// patch set run alongside; actual: the set under test).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RowDrift {
    pub step: u64,
    pub request: RequestId,
    pub max_abs_dlogit: f32,
    pub kl: f64,
    pub top1_agrees: bool,
}

/// A token the engine under test sampled (it then goes on with the recorded
/// token, so each is a one-step-ahead prediction on the recorded history).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Sampled {
    pub step: u64,
    pub position: usize,
    pub token: u32,
}

/// What a replay saw step by step, beyond the report: the raw material of the
/// HTML report's plots and texts. Drift rows exist only when a second engine
/// ran alongside (the set under test differs from the recording's).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Trace {
    /// Every compared row, in step order, from step 0.
    pub drift: Vec<RowDrift>,
    /// Per request, the engine under test's own samples, in step order.
    pub sampled: BTreeMap<RequestId, Vec<Sampled>>,
    /// The last step replayed (`None`: none).
    pub last_step: Option<u64>,
}

/// Re-executes `bundle` on `model` under `opts.patches`.
pub fn replay(
    bundle: &Bundle,
    model: &Model,
    opts: &ReplayOptions,
) -> Result<Outcome, ReplayError> {
    replay_traced(bundle, model, opts).map(|(o, _)| o)
}

/// [`replay`], also returning the step-by-step [`Trace`]; with
/// `opts.trace_steps` it goes on that many steps past the first divergence.
/// The [`Outcome`] is the same as [`replay`]'s whatever `trace_steps`.
pub fn replay_traced(
    bundle: &Bundle,
    model: &Model,
    opts: &ReplayOptions,
) -> Result<(Outcome, Trace), ReplayError> {
    let mut trace = Trace::default();
    let recorded = check_bundle(bundle, model)?;
    if let Some(cfg) = crate::pd::pd_config(bundle) {
        return crate::pd::replay_pd(bundle, model, opts, recorded, cfg);
    }
    let m = &bundle.manifest;
    let cat = Catalog::of(bundle);
    let mut b = Scheduler::with_patches(
        model.net(),
        m.engine,
        opts.threads.clone(),
        opts.patches.clone(),
    )?;
    b.set_top_logprobs(m.top_logprobs as usize);
    b.set_keep_rows(true);
    let mut a = if opts.patches != recorded {
        let mut a = Scheduler::with_patches(model.net(), m.engine, opts.threads.clone(), recorded)?;
        a.set_keep_rows(true);
        Some(a)
    } else {
        None
    };
    let mut first: Option<Divergence> = None;
    // Under a behaviour or tokens criterion: where the bits first moved, so a
    // clean verdict never claims bit-exactness it does not have.
    let mut first_bits: Option<(u64, Signal)> = None;
    let mut drift_rows: Vec<DriftRow> = Vec::new();
    let (mut steps, mut tokens) = (0u64, 0u64);
    for e in &bundle.events {
        let rec: &StepReport = match e {
            Event::Arrival { request, .. } => {
                match b.submit(request.clone()) {
                    // Past the first divergence (a trace going on for the
                    // plots), an engine that can no longer take the request
                    // ends the trace, not the report.
                    Err(_) if first.is_some() => break,
                    r => r?,
                }
                if let Some(a) = a.as_mut() {
                    a.submit(request.clone())?;
                }
                continue;
            }
            Event::Interrupt { .. } | Event::Disaggregated(_) | Event::PdStep(_) => continue,
            Event::Step(r) => r,
        };
        let forced: BTreeMap<RequestId, u32> = rec
            .seqs
            .iter()
            .filter_map(|s| s.sampled.map(|t| (s.id, t)))
            .collect();
        if let Some(a) = a.as_mut() {
            a.step_replay(rec.decisions.clone(), forced.clone())
                .map_err(|source| ReplayError::Baseline {
                    step: rec.step,
                    source,
                })?;
        }
        let got = match b.step_replay(rec.decisions.clone(), forced.clone()) {
            Ok(g) => g,
            Err(err) => {
                if first.is_none() {
                    let who = attribute(&rec.decisions);
                    first = Some(divergence(
                        rec.step,
                        Signal::Decision,
                        err.to_string(),
                        who,
                        &cat,
                        opts,
                    ));
                }
                break;
            }
        };
        trace.last_step = Some(rec.step);
        for s in &got.seqs {
            if let Some(token) = s.sampled {
                trace.sampled.entry(s.id).or_default().push(Sampled {
                    step: rec.step,
                    position: s.start.saturating_add(s.len),
                    token,
                });
            }
        }
        if let Some(a) = &a {
            let exp: BTreeMap<RequestId, &Vec<f32>> =
                a.last_rows().iter().map(|(id, r)| (*id, r)).collect();
            for (id, r) in b.last_rows() {
                if let Some(e) = exp.get(id) {
                    let (max_abs_dlogit, kl, top1_agrees) = drift(e, r);
                    trace.drift.push(RowDrift {
                        step: rec.step,
                        request: *id,
                        max_abs_dlogit,
                        kl,
                        top1_agrees,
                    });
                }
            }
        }
        steps += 1;
        tokens += forced.len() as u64;
        if first.is_none() {
            first = compare(rec, &got, &cat, model, opts, opts.criterion);
        }
        if first_bits.is_none() && opts.criterion != Criterion::Bits {
            first_bits =
                compare(rec, &got, &cat, model, opts, Criterion::Bits).map(|d| (d.step, d.signal));
        }
        if let Some(d) = &first {
            let in_report = rec.step <= d.step + opts.drift_steps as u64;
            if let (Some(a), true) = (&a, in_report) {
                let exp: BTreeMap<RequestId, &Vec<f32>> =
                    a.last_rows().iter().map(|(id, r)| (*id, r)).collect();
                let pairs: Vec<(String, f32, f64, bool)> = b
                    .last_rows()
                    .iter()
                    .filter_map(|(id, r)| {
                        exp.get(id).map(|e| {
                            let (d, kl, top1) = drift(e, r);
                            (cat.name(*id), d, kl, top1)
                        })
                    })
                    .collect();
                drift_rows.extend(DriftRow::of(rec.step, &pairs));
            }
            let go_on = (opts.drift_steps as u64).max(opts.trace_steps);
            if opts.stop_at_first || rec.step >= d.step.saturating_add(go_on) {
                break;
            }
        }
    }
    let truncated = matches!(bundle.integrity, Integrity::Truncated { .. });
    let outcome = match (first, first_bits) {
        (None, None) => Outcome::BitExact {
            steps,
            tokens,
            truncated,
        },
        (None, Some((bits_from, bits_signal))) => Outcome::SameBehaviour {
            steps,
            tokens,
            truncated,
            criterion: opts.criterion,
            bits_from,
            bits_signal,
        },
        (Some(mut d), _) => {
            d.drift = drift_rows;
            d.window = window(bundle, &cat, model, d.step.saturating_sub(3), d.step + 2);
            Outcome::Diverged(Box::new(d))
        }
    };
    Ok((outcome, trace))
}

/// A divergence at `step` attributed to `who` (request, position), without
/// token details, drift or window (filled in by the caller).
pub(crate) fn divergence(
    step: u64,
    signal: Signal,
    detail: String,
    who: Option<(RequestId, Option<usize>)>,
    cat: &Catalog,
    opts: &ReplayOptions,
) -> Divergence {
    Divergence {
        step,
        signal,
        detail,
        request: who.map(|(id, _)| cat.name(id)),
        request_id: who.map(|(id, _)| id),
        turn: who.map(|(id, _)| cat.turn(id)),
        position: who.and_then(|(_, p)| p),
        expected: None,
        actual: None,
        drift: Vec::new(),
        window: Vec::new(),
        repro: opts.repro.clone(),
    }
}

/// Compares one step; returns the first divergent signal.
pub(crate) fn compare(
    rec: &StepReport,
    got: &StepReport,
    cat: &Catalog,
    model: &Model,
    opts: &ReplayOptions,
    criterion: Criterion,
) -> Option<Divergence> {
    let base = |signal, detail: String, who| divergence(rec.step, signal, detail, who, cat, opts);
    let behaviour = criterion != Criterion::Bits;
    let layout_differs = criterion != Criterion::Tokens && got.cache_layout != rec.cache_layout;
    let logits_differ = rec.seqs.iter().any(|s| {
        s.sampled.is_some()
            && got
                .seqs
                .iter()
                .find(|g| g.id == s.id)
                .is_some_and(|g| g.logits_digest != s.logits_digest)
    });
    // The cache comes first when what is cached changed, or when only the cache
    // changed; K/V contents drifting with the logits is reported as logits.
    if layout_differs || (!behaviour && got.cache_state != rec.cache_state && !logits_differ) {
        let what = if layout_differs {
            "what is cached or referenced differs (radix tree, pages or refcounts)"
        } else {
            "same pages and tree, different K/V contents"
        };
        return Some(base(
            Signal::CacheState,
            format!(
                "cache_state expected {}…, got {}…: {what}",
                short(&rec.cache_state),
                short(&got.cache_state)
            ),
            attribute(&rec.decisions),
        ));
    }
    for s in &rec.seqs {
        let Some(exp_tok) = s.sampled else { continue };
        let Some(g) = got.seqs.iter().find(|g| g.id == s.id) else {
            return Some(base(
                Signal::Decision,
                format!("request {} produced no row", cat.name(s.id)),
                Some((s.id, None)),
            ));
        };
        let act_tok = g.sampled.unwrap_or(u32::MAX);
        let pos = s.start.saturating_add(s.len);
        let signal = if g.logits_digest != s.logits_digest && (!behaviour || act_tok != exp_tok) {
            if behaviour {
                Signal::Token
            } else {
                Signal::Logits
            }
        } else if act_tok != exp_tok {
            Signal::Token
        } else {
            continue;
        };
        let mut d = base(
            signal,
            match signal {
                Signal::Logits if act_tok == exp_tok => {
                    let also = if got.cache_state != rec.cache_state {
                        " (K/V page contents differ too)"
                    } else {
                        ""
                    };
                    format!("logits bits differ; the sampled token is the same{also}")
                }
                Signal::Logits => "logits bits differ and the sampled token changed".into(),
                Signal::Token if g.logits_digest != s.logits_digest => {
                    "the sampled token changed (logits differ)".into()
                }
                _ => "same logits digest, different token (sampler changed)".into(),
            },
            Some((s.id, Some(pos))),
        );
        d.expected = Some(token_info(model, exp_tok, &s.top_logprobs));
        d.actual = Some(token_info(model, act_tok, &g.top_logprobs));
        return Some(d);
    }
    None
}
