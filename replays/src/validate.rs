//! Semantic validation of a decoded bundle against its manifest and the model,
//! before any scheduler sees it.
//!
//! The reader's checksums prove only that the bytes are the writer's, and a
//! bundle can be written by anyone. Every number a replay or the oracle will
//! use as an index, a length or a position is checked here, with checked
//! arithmetic, against the model (vocabulary, context) and the events before it
//! (known request ids, monotone steps). Invariant: a bundle that passes cannot
//! make the replay driver, the oracle or the scheduler index out of bounds or
//! overflow; whatever the engine then refuses (a decision that the cache state
//! cannot execute) is a divergence report, not a crash.

use std::collections::BTreeSet;

use lmrr_engine::scheduler::{Decision, RequestId};
use lmrr_engine::Model;
use lmrr_recorder::{Bundle, Event};

/// Most top-logprobs a bundle may record per token (the recorder's own
/// `--top-logprobs` is at most this).
pub const MAX_TOP_LOGPROBS: u32 = 64;

/// One thing wrong with a bundle: which event, and what.
#[derive(Debug, thiserror::Error)]
#[error("invalid bundle: {at}: {what}")]
pub struct Invalid {
    /// `manifest`, or `event 12 (step 7)`.
    pub at: String,
    pub what: String,
}

fn bad(at: impl Into<String>, what: impl Into<String>) -> Invalid {
    Invalid {
        at: at.into(),
        what: what.into(),
    }
}

/// `start..start + len` inside `0..limit`, with checked arithmetic.
fn span_end(start: usize, len: usize, limit: usize, what: &str) -> Result<usize, String> {
    match start.checked_add(len) {
        Some(end) if end <= limit => Ok(end),
        Some(end) => Err(format!(
            "{what} {start}..{end} goes past the model's context of {limit}"
        )),
        None => Err(format!("{what} {start} + {len} overflows")),
    }
}

/// Checks `bundle`'s manifest and events against `model`.
pub fn validate(bundle: &Bundle, model: &Model) -> Result<(), Invalid> {
    let m = &bundle.manifest;
    let cfg = &m.engine;
    let context = model.net.context();
    let vocab = model.net.vocab_size();
    if cfg.page_size == 0 || cfg.pool_pages == 0 || cfg.max_batch_tokens == 0 {
        return Err(bad(
            "manifest",
            format!(
                "engine page_size {}, pool_pages {}, max_batch_tokens {}: each must be at least 1",
                cfg.page_size, cfg.pool_pages, cfg.max_batch_tokens
            ),
        ));
    }
    if m.top_logprobs > MAX_TOP_LOGPROBS {
        return Err(bad(
            "manifest",
            format!(
                "top_logprobs {} exceeds the limit of {MAX_TOP_LOGPROBS}",
                m.top_logprobs
            ),
        ));
    }
    let mut known: BTreeSet<RequestId> = BTreeSet::new();
    // Arrivals and interrupts happen before step `next_step`.
    let mut next_step = 0u64;
    let mut disaggregated = false;
    for (i, e) in bundle.events.iter().enumerate() {
        let at = |step: u64| format!("event {i} (step {step})");
        let token = |t: u32, what: &str, step: u64| {
            if (t as usize) < vocab {
                Ok(())
            } else {
                Err(bad(
                    at(step),
                    format!("{what} token {t} is outside the vocabulary of {vocab}"),
                ))
            }
        };
        let known_id = |id: RequestId, what: &str, step: u64| {
            if known.contains(&id) {
                Ok(())
            } else {
                Err(bad(
                    at(step),
                    format!("{what} names request {id}, which has not arrived"),
                ))
            }
        };
        let monotone = |step: u64, what: &str| {
            if step < next_step {
                Err(bad(
                    at(step),
                    format!(
                        "{what} at step {step}, after step {} was recorded",
                        next_step - 1
                    ),
                ))
            } else {
                Ok(())
            }
        };
        match e {
            Event::Arrival { step, request, .. } => {
                monotone(*step, "arrival")?;
                if !known.insert(request.id) {
                    return Err(bad(
                        at(*step),
                        format!("request {} arrives twice", request.id),
                    ));
                }
                let n = request.prompt.len();
                if n == 0 || n > context {
                    return Err(bad(
                        at(*step),
                        format!(
                            "request {} has a prompt of {n} tokens; it must hold 1 to {context} (the model's context)",
                            request.id
                        ),
                    ));
                }
                for &t in &request.prompt {
                    token(t, "prompt", *step)?;
                }
                request
                    .sampling
                    .validate()
                    .map_err(|e| bad(at(*step), format!("request {}: {e}", request.id)))?;
            }
            Event::Interrupt { step, id, .. } => {
                monotone(*step, "interrupt")?;
                known_id(*id, "interrupt", *step)?;
            }
            Event::Disaggregated(c) => {
                let d = &c.decode;
                if i != 0 {
                    return Err(bad(
                        at(next_step),
                        "the disaggregated deployment's configuration is not the first event",
                    ));
                }
                if d.page_size == 0
                    || d.pool_pages == 0
                    || d.max_batch_tokens == 0
                    || c.transfer_pages_per_step == 0
                {
                    return Err(bad(
                        at(0),
                        format!(
                            "decode engine page_size {}, pool_pages {}, max_batch_tokens {}, link {} pages per step: each must be at least 1",
                            d.page_size, d.pool_pages, d.max_batch_tokens, c.transfer_pages_per_step
                        ),
                    ));
                }
                disaggregated = true;
            }
            Event::Step(_) | Event::PdStep(_) => {
                let step = e.step().unwrap_or(0);
                match e {
                    Event::PdStep(p) => {
                        if !disaggregated {
                            return Err(bad(
                                at(step),
                                "a disaggregated step in a bundle with no disaggregated deployment",
                            ));
                        }
                        if p.prefill.step != step || p.decode.step != step {
                            return Err(bad(
                                at(step),
                                format!(
                                    "the engines' reports say steps {} and {}",
                                    p.prefill.step, p.decode.step
                                ),
                            ));
                        }
                        for &(id, _) in &p.finished {
                            known_id(id, "a finish", step)?;
                        }
                    }
                    _ if disaggregated => {
                        return Err(bad(at(step), "a colocated step in a disaggregated bundle"));
                    }
                    _ => {}
                }
                if step != next_step {
                    return Err(bad(
                        at(step),
                        format!("step {step} recorded where step {next_step} was due (steps are consecutive from 0)"),
                    ));
                }
                next_step = step
                    .checked_add(1)
                    .ok_or_else(|| bad(at(step), "step counter overflows"))?;
                for r in e.reports() {
                    for d in &r.decisions {
                        match *d {
                            Decision::Interrupt { id } | Decision::Preempt { id } => {
                                known_id(id, "a decision", step)?
                            }
                            Decision::Admit { id, cached_tokens } => {
                                known_id(id, "an admission", step)?;
                                if cached_tokens >= context {
                                    return Err(bad(
                                    at(step),
                                    format!("admission of request {id} with {cached_tokens} cached tokens, at or past the context of {context}"),
                                ));
                                }
                            }
                            Decision::Schedule { id, start, len } => {
                                known_id(id, "a schedule", step)?;
                                span_end(start, len, context, "schedule of positions")
                                    .map_err(|w| bad(at(step), format!("request {id}: {w}")))?;
                            }
                        }
                    }
                    for s in &r.seqs {
                        known_id(s.id, "a sequence report", step)?;
                        span_end(s.start, s.len, context, "sequence report of positions")
                            .map_err(|w| bad(at(step), format!("request {}: {w}", s.id)))?;
                        if let Some(t) = s.sampled {
                            token(t, "sampled", step)?;
                            if s.len == 0 {
                                return Err(bad(
                                    at(step),
                                    format!("request {} samples a token from an empty span", s.id),
                                ));
                            }
                        }
                        if s.top_logprobs.len() > m.top_logprobs as usize {
                            return Err(bad(
                                at(step),
                                format!(
                                    "request {} records {} top logprobs, the manifest says {}",
                                    s.id,
                                    s.top_logprobs.len(),
                                    m.top_logprobs
                                ),
                            ));
                        }
                        for &(t, _) in &s.top_logprobs {
                            token(t, "top-logprob", step)?;
                        }
                    }
                    for &(id, _) in &r.finished {
                        known_id(id, "a finish", step)?;
                    }
                }
            }
        }
    }
    Ok(())
}
