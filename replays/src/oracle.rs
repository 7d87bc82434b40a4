//! The recompute oracle: for every sampled token in a bundle, recompute its
//! logits from scratch — no cache, batch of one, the whole sequence in one
//! prefill — and compare the bits with the recorded digest. By the contract
//! (I2, I3, I4) they must be equal, so any mismatch is a cache or batching bug,
//! found with no golden recording. Numerical patches of the recording are
//! applied to the recomputation too (they change the arithmetic, not caching).

use std::collections::BTreeMap;

use lmrr_engine::scheduler::RequestId;
use lmrr_engine::{sample, KvCache, LogitsWanted, Model, SeqKvStore, SeqSpan};
use lmrr_recorder::{Bundle, Event, Integrity};

use crate::driver::{check_bundle, token_info, window, Catalog, ReplayError, ReplayOptions};
use crate::report::{Divergence, Outcome, Signal};

struct Sampled {
    step: u64,
    position: usize,
    token: u32,
    digest: [u8; 32],
    top: Vec<(u32, f32)>,
}

/// What the oracle did with one request (one turn of a conversation).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct OracleTurn {
    pub request: String,
    pub request_id: RequestId,
    /// 1-based turn in its conversation.
    pub turn: usize,
    /// Sampled tokens whose logits were recomputed and compared.
    pub checked: usize,
    /// The first token whose recorded logits differ: `(step, position)`.
    pub first_difference: Option<(u64, usize)>,
}

/// Runs the oracle over every sampled token of `bundle`.
pub fn oracle(
    bundle: &Bundle,
    model: &Model,
    opts: &ReplayOptions,
) -> Result<Outcome, ReplayError> {
    oracle_traced(bundle, model, opts).map(|(o, _)| o)
}

/// [`oracle`], also saying per request how many tokens were recomputed and
/// where its first difference is (each request is checked up to its own
/// first difference).
pub fn oracle_traced(
    bundle: &Bundle,
    model: &Model,
    opts: &ReplayOptions,
) -> Result<(Outcome, Vec<OracleTurn>), ReplayError> {
    let mut turns = Vec::new();
    let patches = check_bundle(bundle, model)?;
    let cat = Catalog::of(bundle);
    let mut params = BTreeMap::new();
    let mut sampled: BTreeMap<RequestId, Vec<Sampled>> = BTreeMap::new();
    for e in &bundle.events {
        match e {
            Event::Arrival { request, .. } => {
                params.insert(request.id, request.sampling);
            }
            Event::Step(_) | Event::PdStep(_) => {
                for r in e.reports() {
                    for s in &r.seqs {
                        if let (Some(token), Some(digest)) = (s.sampled, s.logits_digest) {
                            sampled.entry(s.id).or_default().push(Sampled {
                                step: r.step,
                                position: s.start + s.len,
                                token,
                                digest,
                                top: s.top_logprobs.clone(),
                            });
                        }
                    }
                }
            }
            Event::Interrupt { .. } | Event::Disaggregated(_) => {}
        }
    }
    let vocab = model.net.vocab_size();
    let mut first: Option<(u64, Divergence)> = None;
    let mut tokens = 0u64;
    for (&id, samples) in &sampled {
        let Some(prompt) = cat.prompts.get(&id) else {
            continue;
        };
        let mut seq = prompt.clone();
        seq.extend(samples.iter().map(|s| s.token));
        // Rows for positions prompt_len-1 .. len-2: the rows each token was drawn from.
        let fed = &seq[..seq.len() - 1];
        let mut kv = SeqKvStore::new(model.net.kv_layout());
        let span = SeqSpan {
            seq: id,
            start: kv.len(id),
            tokens: fed,
            logits: LogitsWanted::All,
        };
        let rows = model
            .net
            .forward_patched(&mut kv, &[span], &opts.threads, &patches)?
            .remove(0);
        let mut turn = OracleTurn {
            request: cat.name(id),
            request_id: id,
            turn: cat.turn(id),
            checked: 0,
            first_difference: None,
        };
        for s in samples {
            tokens += 1;
            let r = s.position - 1;
            if r >= fed.len() {
                continue;
            }
            turn.checked += 1;
            let row = &rows[r * vocab..(r + 1) * vocab];
            let digest = lmrr_engine::digest::logits_digest(row);
            if digest == s.digest {
                continue;
            }
            turn.first_difference = Some((s.step, s.position));
            if first.as_ref().is_some_and(|(st, _)| *st <= s.step) {
                break;
            }
            let params = params.get(&id).copied().unwrap_or_default();
            let want = sample(row, &params, s.position as u64);
            let top = lmrr_engine::scheduler::top_logprobs(row, s.top.len().max(5));
            first = Some((
                s.step,
                Divergence {
                    step: s.step,
                    signal: Signal::Logits,
                    detail: format!(
                        "recorded logits differ from a cache-off, batch-of-one recomputation{}",
                        if want == s.token {
                            "; the sampled token is the same"
                        } else {
                            "; the recomputation samples another token"
                        }
                    ),
                    request: Some(cat.name(id)),
                    request_id: Some(id),
                    turn: Some(cat.turn(id)),
                    position: Some(s.position),
                    expected: Some(token_info(model, want, &top)),
                    actual: Some(token_info(model, s.token, &s.top)),
                    drift: Vec::new(),
                    window: Vec::new(),
                    repro: opts.repro.clone(),
                },
            ));
            break;
        }
        turns.push(turn);
    }
    let outcome = match first {
        None => Outcome::BitExact {
            steps: bundle
                .events
                .iter()
                .filter(|e| matches!(e, Event::Step(_)))
                .count() as u64,
            tokens,
            truncated: matches!(bundle.integrity, Integrity::Truncated { .. }),
        },
        Some((_, mut d)) => {
            d.window = window(bundle, &cat, model, d.step.saturating_sub(3), d.step + 2);
            Outcome::Diverged(Box::new(d))
        }
    };
    Ok((outcome, turns))
}
