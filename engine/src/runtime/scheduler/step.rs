//! Executing a decided step: one forward pass over every scheduled span,
//! sampling, finish reasons, and the per-step hashes (slot digests, page
//! hashes, radix and cache-state hashes) that bundles record.

use super::*;
use crate::model::{LogitsWanted, SeqSpan};
use crate::pool::Hash;
use crate::sampling::sample;
use crate::FinishReason;
use sha2::{Digest, Sha256};

impl Scheduler<'_> {
    pub(super) fn execute(
        &mut self,
        decisions: Vec<Decision>,
        mut finished: Vec<(RequestId, FinishReason)>,
    ) -> Result<StepReport, EngineError> {
        let sched: Vec<(RequestId, usize, usize)> = decisions
            .iter()
            .filter_map(|d| match *d {
                Decision::Schedule { id, start, len } => Some((id, start, len)),
                _ => None,
            })
            .collect();
        let spans: Vec<SeqSpan> = sched
            .iter()
            .map(|&(id, start, len)| {
                let toks = &self.seqs[&id].tokens;
                SeqSpan {
                    seq: id,
                    start,
                    tokens: &toks[start..start + len],
                    logits: if start + len == toks.len() {
                        LogitsWanted::Last
                    } else {
                        LogitsWanted::None
                    },
                }
            })
            .collect();
        let logits = if spans.is_empty() {
            Vec::new()
        } else {
            self.model
                .forward_patched(&mut self.kv, &spans, &self.threads, &self.patches)?
        };
        let th = std::time::Instant::now();
        self.kv.finish_step_on(&self.threads);
        let mut hash_time = th.elapsed();
        self.last_rows.clear();
        let rows = self.sample_rows(&sched, &logits, &mut hash_time);
        let mut seqs = Vec::with_capacity(sched.len());
        for ((&(id, start, len), row), out) in sched.iter().zip(logits).zip(rows) {
            let mut rep = SeqReport {
                id,
                start,
                len,
                sampled: None,
                logits_digest: None,
                top_logprobs: Vec::new(),
                finish: None,
            };
            if let Some(out) = out {
                let context = self.model.context();
                let seq = self.seqs.get_mut(&id).expect("scheduled request exists");
                seq.hasher = out.hasher;
                seq.tokens.push(out.next);
                let next = out.next;
                rep.sampled = Some(out.tok);
                rep.logits_digest = Some(out.digest);
                rep.top_logprobs = out.top;
                if self.keep_rows {
                    self.last_rows.push((id, row.clone()));
                }
                let n_gen = seq.tokens.len() - seq.req.prompt.len();
                rep.finish = if seq.req.stop_at_eos && self.model.is_eos(next) {
                    Some(FinishReason::Eos)
                } else if n_gen >= seq.req.max_tokens {
                    Some(FinishReason::Length)
                } else if seq.tokens.len() > context {
                    Some(FinishReason::Context)
                } else {
                    None
                };
            }
            if let Some(r) = rep.finish {
                if self.hold_finished {
                    self.hold(id);
                } else {
                    self.release(id, true);
                }
                self.finish(id, r);
                finished.push((id, r));
            }
            seqs.push(rep);
        }
        let th = std::time::Instant::now();
        let mut h = Sha256::new();
        h.update(self.radix.structure_hash(&self.kv.pool, true));
        let mut lh = Sha256::new();
        lh.update(self.radix.structure_hash(&self.kv.pool, false));
        for (p, refs, content) in self.kv.pool.in_use() {
            h.update(p.to_le_bytes());
            h.update(refs.to_le_bytes());
            h.update(content);
            lh.update(p.to_le_bytes());
            lh.update(refs.to_le_bytes());
        }
        hash_time += th.elapsed();
        self.timings.hashing += hash_time;
        let report = StepReport {
            step: self.step,
            decisions,
            seqs,
            finished,
            cache_layout: lh.finalize().into(),
            cache_state: h.finalize().into(),
        };
        self.step += 1;
        let progress = !report.finished.is_empty()
            || report.seqs.iter().any(|q| q.sampled.is_some())
            || report
                .decisions
                .iter()
                .any(|d| matches!(d, Decision::Interrupt { .. }));
        self.stalled = if progress || self.is_idle() {
            0
        } else {
            self.stalled + 1
        };
        Ok(report)
    }
}

/// `ln Σ exp(row)` over the non-NaN entries, as [`top_logprobs`] computes it
/// (canonical `det_exp` and sum, one f64 `ln`), so that a token's
/// log-probability `row[t] − lse` has the same bits wherever it is computed —
/// in the server's response or in `lmrr audit`'s reference. `None` for a row
/// with no finite-or-infinite entry.
pub fn log_sum_exp(row: &[f32]) -> Option<f64> {
    let m = row
        .iter()
        .filter(|v| !v.is_nan())
        .fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    if row.iter().all(|v| v.is_nan()) {
        return None;
    }
    let shifted: Vec<f32> = row
        .iter()
        .map(|&v| if v.is_nan() { f32::NEG_INFINITY } else { v - m })
        .collect();
    let mut e = vec![0.0f32; row.len()];
    lmrr_kernels::exp_slice(&shifted, &mut e);
    Some(m as f64 + libm::log(lmrr_kernels::sum(&e) as f64))
}

/// Log-probability of token `t` in `row` (the bits [`top_logprobs`] gives it).
pub fn token_logprob(row: &[f32], t: u32) -> Option<f32> {
    let v = *row.get(t as usize)?;
    if v.is_nan() {
        return None;
    }
    Some((v as f64 - log_sum_exp(row)?) as f32)
}

/// What one sampled logits row gives: the sampled token, the token that
/// goes on (a forced one in replay), the row's digest, its top logprobs, and
/// the sequence's session hasher with the row and that token added.
struct RowOut {
    tok: u32,
    next: u32,
    digest: Hash,
    top: Vec<(u32, f32)>,
    hasher: Sha256,
}

impl Scheduler<'_> {
    /// The per-row work of a step for every span that wants a row, run
    /// across the pool's threads: each row's is a pure function of the row,
    /// its request and its position (and updates its own sequence's hasher
    /// only), so the results are the same whatever thread runs them; they
    /// are applied in schedule order by the caller. Adds to `hash_time` the
    /// share of the region's wall time its tasks spent hashing.
    fn sample_rows(
        &mut self,
        sched: &[(RequestId, usize, usize)],
        logits: &[Vec<f32>],
        hash_time: &mut std::time::Duration,
    ) -> Vec<Option<RowOut>> {
        type Task = (crate::SamplingParams, u64, Option<u32>, Sha256);
        let k = self.top_logprobs;
        let mut tasks: Vec<std::sync::Mutex<Option<Task>>> = Vec::with_capacity(sched.len());
        for (&(id, _, _), row) in sched.iter().zip(logits) {
            let task = if row.is_empty() {
                None
            } else {
                let seq = self.seqs.get_mut(&id).expect("scheduled request exists");
                let hasher = std::mem::take(&mut seq.hasher);
                let forced = self.force_tokens.get(&id).copied();
                Some((seq.req.sampling, seq.tokens.len() as u64, forced, hasher))
            };
            tasks.push(std::sync::Mutex::new(task));
        }
        let outs: Vec<std::sync::Mutex<Option<RowOut>>> = (0..tasks.len())
            .map(|_| std::sync::Mutex::new(None))
            .collect();
        let busy = std::sync::Mutex::new((std::time::Duration::ZERO, std::time::Duration::ZERO));
        let t0 = std::time::Instant::now();
        self.threads.for_ranges(tasks.len(), 1, |r| {
            for i in r {
                let Some((params, pos, forced, mut hasher)) =
                    tasks[i].lock().ok().and_then(|mut t| t.take())
                else {
                    continue;
                };
                let row = &logits[i];
                let ts = std::time::Instant::now();
                let tok = sample(row, &params, pos);
                let th = std::time::Instant::now();
                let bytes = crate::digest::row_bytes(row);
                let next = forced.unwrap_or(tok);
                hasher.update(&bytes);
                hasher.update(next.to_le_bytes());
                let digest: Hash = crate::digest::bytes_digest(&bytes);
                let hashed = th.elapsed();
                let top = top_logprobs(row, k);
                let all = ts.elapsed();
                if let Ok(mut b) = busy.lock() {
                    b.0 += hashed;
                    b.1 += all;
                }
                if let Ok(mut o) = outs[i].lock() {
                    *o = Some(RowOut {
                        tok,
                        next,
                        digest,
                        top,
                        hasher,
                    });
                }
            }
        });
        let wall = t0.elapsed();
        if let Ok((hashed, all)) = busy.into_inner() {
            if !all.is_zero() {
                *hash_time += wall.mul_f64(hashed.as_secs_f64() / all.as_secs_f64());
            }
        }
        outs.into_iter()
            .map(|o| o.into_inner().ok().flatten())
            .collect()
    }
}

/// The `k` largest logits (ties to the lowest id) as `(token, log-probability)`.
/// For reports only, but still deterministic: the log-sum-exp uses the
/// canonical `det_exp` and sum, and one f64 `ln` from the pure-Rust `libm`
/// (the same bits on every platform; recorded logprobs are in bundles).
pub fn top_logprobs(row: &[f32], k: usize) -> Vec<(u32, f32)> {
    let mut idx: Vec<u32> = (0..row.len() as u32)
        .filter(|&i| !row[i as usize].is_nan())
        .collect();
    let k = k.min(idx.len());
    if k == 0 {
        return Vec::new();
    }
    let Some(lse) = log_sum_exp(row) else {
        return Vec::new();
    };
    let order = |a: &u32, b: &u32| row[*b as usize].total_cmp(&row[*a as usize]).then(a.cmp(b));
    if k < idx.len() {
        idx.select_nth_unstable_by(k - 1, order);
        idx.truncate(k);
    }
    idx.sort_unstable_by(order);
    idx.into_iter()
        .map(|i| (i, (row[i as usize] as f64 - lse) as f32))
        .collect()
}
