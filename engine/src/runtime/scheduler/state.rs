//! Applying decisions to the scheduler's state: admission with a cached
//! prefix, preemption, interrupts, and releasing a request's pages into the
//! radix cache (or, under a cache-corruption patch, the buggy abort paths).
//! Every page reference taken here is given back here.

use super::*;
use crate::patches::Patch;
use crate::pool::BlockTable;
use crate::radix::Match;
use crate::FinishReason;
use sha2::Digest;

impl Scheduler<'_> {
    pub(super) fn table(&self, id: RequestId) -> Result<&BlockTable, EngineError> {
        self.kv
            .tables
            .get(&id)
            .ok_or_else(|| infeasible(format!("request {id} has no KV (not running)")))
    }

    /// Applies one decision to the scheduler state.
    pub(super) fn apply(
        &mut self,
        d: &Decision,
        finished: &mut Vec<(RequestId, FinishReason)>,
    ) -> Result<(), EngineError> {
        let ps = self.cfg.page_size;
        match *d {
            Decision::Interrupt { id } => {
                self.pending_interrupts.retain(|&x| x != id);
                if let Some(pos) = self.waiting.iter().position(|&x| x == id) {
                    self.waiting.remove(pos);
                } else if self.running.contains(&id) {
                    self.release_as(id, true, true);
                } else {
                    return Err(infeasible(format!(
                        "interrupt of request {id}, which is neither waiting nor running"
                    )));
                }
                self.finish(id, FinishReason::Interrupted);
                finished.push((id, FinishReason::Interrupted));
            }
            Decision::Preempt { id } => {
                if !self.running.contains(&id) {
                    return Err(infeasible(format!(
                        "preemption of request {id}, which is not running"
                    )));
                }
                self.release(id, true);
                let seq = self.seqs.get_mut(&id).expect("running request exists");
                seq.preemptions += 1;
                let order = seq.order;
                let at = self
                    .waiting
                    .iter()
                    .position(|w| self.seqs[w].order > order)
                    .unwrap_or(self.waiting.len());
                self.waiting.insert(at, id);
            }
            Decision::Admit { id, cached_tokens } => {
                let Some(pos) = self.waiting.iter().position(|&x| x == id) else {
                    return Err(infeasible(format!(
                        "admission of request {id}, which is not waiting"
                    )));
                };
                if cached_tokens > 0 && !self.cfg.prefix_cache {
                    return Err(infeasible(format!(
                        "admission of request {id} with {cached_tokens} cached tokens, the prefix cache is off"
                    )));
                }
                let seq = &self.seqs[&id];
                let probe = &seq.tokens[..seq.tokens.len() - 1];
                let m = if cached_tokens > 0 {
                    self.radix.match_prefix(probe, ps, true)
                } else {
                    Match {
                        pages: Vec::new(),
                        tokens: 0,
                    }
                };
                // A cut inside a page is only possible at the end of a partial match.
                if m.tokens < cached_tokens
                    || (cached_tokens % ps != 0 && cached_tokens != m.tokens)
                {
                    return Err(infeasible(format!(
                        "admission of request {id} expects {cached_tokens} cached tokens, the cache holds {}",
                        m.tokens
                    )));
                }
                let pages: Vec<_> = m
                    .pages
                    .into_iter()
                    .take(cached_tokens.div_ceil(ps))
                    .collect();
                for &p in &pages {
                    self.kv.pool.incref(p);
                }
                let shared = pages.clone();
                self.waiting.remove(pos);
                self.kv.tables.insert(
                    id,
                    BlockTable {
                        pages,
                        len: cached_tokens,
                    },
                );
                let seq = self.seqs.get_mut(&id).expect("waiting request exists");
                seq.cached_tokens.get_or_insert(cached_tokens);
                seq.shared_pages = shared;
                let order = seq.order;
                let at = self
                    .running
                    .iter()
                    .position(|r| self.seqs[r].order > order)
                    .unwrap_or(self.running.len());
                self.running.insert(at, id);
            }
            Decision::Schedule { id, start, len } => {
                let t = self.table(id)?;
                let total = self.seqs[&id].tokens.len();
                let end = start.checked_add(len).filter(|&e| e <= total);
                let Some(end) = end.filter(|_| start == t.len && len > 0) else {
                    return Err(infeasible(format!(
                        "schedule of request {id} positions {start}..{start}+{len} (it holds {} of {total} tokens)",
                        t.len
                    )));
                };
                let need = end.div_ceil(ps).saturating_sub(t.pages.len());
                for _ in 0..need {
                    let page = match self.kv.pool.alloc()? {
                        Some(p) => p,
                        None => {
                            self.radix.evict(1, &mut self.kv.pool);
                            self.kv.pool.alloc()?.ok_or_else(|| {
                                infeasible(format!(
                                    "schedule of request {id}: the pool has no free page"
                                ))
                            })?
                        }
                    };
                    self.kv
                        .tables
                        .get_mut(&id)
                        .expect("table checked")
                        .pages
                        .push(page);
                }
            }
        }
        Ok(())
    }

    /// Releases a running request's pages; with `cache`, its full computed
    /// pages enter the prefix cache first.
    pub(super) fn release(&mut self, id: RequestId, cache: bool) {
        self.release_as(id, cache, false);
    }

    /// Releases a request; `interrupted` selects the abort path, where the
    /// cache-corruption patches act.
    pub(super) fn release_as(&mut self, id: RequestId, cache: bool, interrupted: bool) {
        self.running.retain(|&r| r != id);
        let Some(t) = self.kv.tables.remove(&id) else {
            return;
        };
        let ps = self.cfg.page_size;
        if cache && self.cfg.prefix_cache {
            let full = t.len / ps;
            let tokens = &self.seqs[&id].tokens;
            self.radix
                .insert(&tokens[..full * ps], &t.pages[..full], &mut self.kv.pool);
            if interrupted && self.patches.contains(Patch::AbortInsertsPartial) && t.len % ps != 0 {
                // The bug: the unfinished page goes in too, keyed by every token
                // it covers — including the last sampled one, never computed.
                let key = &tokens[full * ps..tokens.len().min((full + 1) * ps)];
                self.radix.insert_partial(
                    &tokens[..full * ps],
                    key,
                    t.pages[full],
                    &mut self.kv.pool,
                );
            }
        }
        for p in t.pages {
            self.kv.pool.decref(p);
        }
        if interrupted && self.patches.contains(Patch::AbortFreesShared) {
            // The bug: pages shared with the tree are freed as if exclusive.
            let shared = std::mem::take(
                &mut self
                    .seqs
                    .get_mut(&id)
                    .expect("released request exists")
                    .shared_pages,
            );
            for p in shared {
                self.kv.pool.force_free(p);
            }
        }
    }

    pub(super) fn finish(&mut self, id: RequestId, reason: FinishReason) {
        let Some(seq) = self.seqs.remove(&id) else {
            return;
        };
        let out = RequestOutput {
            id,
            prompt_len: seq.req.prompt.len(),
            tokens: seq.generated().to_vec(),
            finish: reason,
            digest: seq.hasher.finalize().into(),
            cached_tokens: seq.cached_tokens.unwrap_or(0),
            preemptions: seq.preemptions,
        };
        self.done.insert(id, out);
    }
}
