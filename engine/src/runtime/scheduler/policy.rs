//! Deciding a step (the policy in the module header of [`super`]): pending
//! interrupts, then running requests oldest first under the token budget
//! (evicting cached pages, then preempting the youngest unscheduled request
//! when pages run out), then admissions with the longest cached prefix.
//! Decisions are data; nothing here reads a clock.

use super::*;
use crate::radix::Match;
use crate::FinishReason;

impl Scheduler<'_> {
    pub(super) fn decide(
        &mut self,
        out: &mut Vec<Decision>,
        finished: &mut Vec<(RequestId, FinishReason)>,
    ) -> Result<(), EngineError> {
        let ps = self.cfg.page_size;
        for id in self.pending_interrupts.clone() {
            let d = Decision::Interrupt { id };
            self.apply(&d, finished)?;
            out.push(d);
        }
        let mut budget = self.cfg.max_batch_tokens;
        let mut scheduled: Vec<RequestId> = Vec::new();
        // Running sequences, oldest first.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let (kv_len, have) = self.table(id).map(|t| (t.len, t.pages.len()))?;
            let remaining = self.seqs[&id].tokens.len() - kv_len;
            let mut n = remaining.min(budget);
            loop {
                let need = (kv_len + n).div_ceil(ps).saturating_sub(have);
                let avail = self.kv.pool.free_count()
                    + if self.cfg.prefix_cache {
                        self.radix.evictable(&self.kv.pool, &[])
                    } else {
                        0
                    };
                if need <= avail {
                    break;
                }
                // Preempt the youngest running request not scheduled yet.
                let victim = self
                    .running
                    .iter()
                    .rev()
                    .copied()
                    .find(|&v| v != id && !scheduled.contains(&v));
                match victim {
                    Some(v) => {
                        let d = Decision::Preempt { id: v };
                        self.apply(&d, finished)?;
                        out.push(d);
                    }
                    None => {
                        n = ((have + avail) * ps).saturating_sub(kv_len).min(n);
                        break;
                    }
                }
            }
            // `running` may have shrunk behind us; find our index again.
            i = self
                .running
                .iter()
                .position(|&r| r == id)
                .map_or(i, |p| p + 1);
            if n == 0 {
                continue;
            }
            let d = Decision::Schedule {
                id,
                start: kv_len,
                len: n,
            };
            self.apply(&d, finished)?;
            out.push(d);
            scheduled.push(id);
            budget -= n;
        }
        // Admissions, FCFS; the head of the queue blocks the rest.
        while budget > 0 {
            let Some(&id) = self.waiting.front() else {
                break;
            };
            let tokens = &self.seqs[&id].tokens;
            let matched = if self.cfg.prefix_cache {
                self.radix
                    .match_prefix(&tokens[..tokens.len() - 1], ps, false)
            } else {
                Match {
                    pages: Vec::new(),
                    tokens: 0,
                }
            };
            let cached = matched.tokens;
            let avail = self.kv.pool.free_count()
                + if self.cfg.prefix_cache {
                    self.radix.evictable(&self.kv.pool, &matched.pages)
                } else {
                    0
                };
            let fit = ((matched.pages.len() + avail) * ps).saturating_sub(cached);
            let n = (tokens.len() - cached).min(budget).min(fit);
            if n == 0 {
                break;
            }
            for d in [
                Decision::Admit {
                    id,
                    cached_tokens: cached,
                },
                Decision::Schedule {
                    id,
                    start: cached,
                    len: n,
                },
            ] {
                self.apply(&d, finished)?;
                out.push(d);
            }
            budget -= n;
        }
        Ok(())
    }
}
