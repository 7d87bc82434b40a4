//! What a disaggregated deployment ([`crate::disagg`]) asks of each side's
//! scheduler, beside its own step loop.
//!
//! Prefill side: with [`Scheduler::set_hold_finished`], a request that
//! finishes (its first token sampled) keeps its block table, so its K/V
//! stays readable ([`Scheduler::held_rows`]) until the coordinator calls
//! [`Scheduler::release_held`], which does what a finish does: full pages
//! into the radix cache, every reference dropped.
//!
//! Decode side: [`Scheduler::reserve`] takes pages for a request that is
//! not in any queue yet (a block table of length 0), [`Scheduler::write_rows`]
//! writes K/V rows into pages by id (a transfer writes where it was told,
//! whoever holds the page now), [`Scheduler::unreserve`] drops the
//! reservation, and [`Scheduler::admit_prefilled`] starts the request as a
//! running one holding its prompt's K/V, its first token already drawn.
//!
//! Invariant: every page reference taken here is given back here, or stays
//! with a block table [`Scheduler::check_accounting`] sees.

use super::*;
use crate::pool::{BlockTable, PageId};
use sha2::Digest;

impl Scheduler<'_> {
    /// Prefill side: finished requests keep their pages until released.
    pub fn set_hold_finished(&mut self, hold: bool) {
        self.hold_finished = hold;
    }

    /// Takes a finished request out of the running set, keeping its pages.
    pub(super) fn hold(&mut self, id: RequestId) {
        self.running.retain(|&r| r != id);
        if let Some(seq) = self.seqs.get(&id) {
            self.held.insert(id, seq.tokens.clone());
        }
    }

    /// Whether a finished request's pages are held.
    pub fn is_held(&self, id: RequestId) -> bool {
        self.held.contains_key(&id)
    }

    /// The K/V rows of positions `start..start + len` of a held request,
    /// `(len, layers, 2·kv_dim + aux_dim)` floats.
    pub fn held_rows(
        &self,
        id: RequestId,
        start: usize,
        len: usize,
    ) -> Result<Vec<f32>, EngineError> {
        let t = self.table(id)?;
        let end = start.checked_add(len).filter(|&e| e <= t.len);
        let Some(end) = end.filter(|_| self.held.contains_key(&id)) else {
            return Err(infeasible(format!(
                "reading positions {start}..{start}+{len} of request {id}, which holds {} and is {}held",
                t.len,
                if self.held.contains_key(&id) { "" } else { "not " }
            )));
        };
        let ps = self.cfg.page_size;
        let mut out = Vec::with_capacity(len * self.kv.slot_width());
        for pos in start..end {
            self.kv.read_slot(t.pages[pos / ps], pos % ps, &mut out);
        }
        Ok(out)
    }

    /// Releases a held request as a finish would have: its full pages enter
    /// the prefix cache, every reference is dropped. `false` if not held.
    pub fn release_held(&mut self, id: RequestId) -> bool {
        let Some(tokens) = self.held.remove(&id) else {
            return false;
        };
        let Some(t) = self.kv.tables.remove(&id) else {
            return false;
        };
        let ps = self.cfg.page_size;
        if self.cfg.prefix_cache {
            let full = t.len / ps;
            self.radix
                .insert(&tokens[..full * ps], &t.pages[..full], &mut self.kv.pool);
        }
        for p in t.pages {
            self.kv.pool.decref(p);
        }
        true
    }

    /// Requests whose pages are held, ascending.
    pub fn held(&self) -> impl Iterator<Item = RequestId> + '_ {
        self.held.keys().copied()
    }

    /// Decode side: reserves the pages `positions` positions need for a
    /// request no queue knows yet, evicting cached pages if it must. `None`
    /// when the pool cannot give them now.
    pub fn reserve(
        &mut self,
        id: RequestId,
        positions: usize,
    ) -> Result<Option<Vec<PageId>>, EngineError> {
        if self.kv.tables.contains_key(&id) || self.seqs.contains_key(&id) {
            return Err(infeasible(format!(
                "reservation for request {id}, which this engine already holds"
            )));
        }
        let need = positions.div_ceil(self.cfg.page_size);
        let avail = self.kv.pool.free_count()
            + if self.cfg.prefix_cache {
                self.radix.evictable(&self.kv.pool, &[])
            } else {
                0
            };
        if need > avail {
            return Ok(None);
        }
        let mut pages = Vec::with_capacity(need);
        for _ in 0..need {
            let p = match self.kv.pool.alloc()? {
                Some(p) => p,
                None => {
                    self.radix.evict(1, &mut self.kv.pool);
                    match self.kv.pool.alloc()? {
                        Some(p) => p,
                        None => {
                            for p in pages {
                                self.kv.pool.decref(p);
                            }
                            return Ok(None);
                        }
                    }
                }
            };
            pages.push(p);
        }
        self.kv.tables.insert(
            id,
            BlockTable {
                pages: pages.clone(),
                len: 0,
            },
        );
        Ok(Some(pages))
    }

    /// Writes rows for positions `start..` (`(n, slot width)` floats) into
    /// `pages` (the positions' pages, by id, in position order), whoever
    /// holds them now.
    pub fn write_rows(
        &mut self,
        pages: &[PageId],
        start: usize,
        rows: &[f32],
    ) -> Result<(), EngineError> {
        let w = self.kv.slot_width();
        let ps = self.cfg.page_size;
        if w == 0 || !rows.len().is_multiple_of(w) {
            return Err(infeasible(format!(
                "K/V rows of {} floats, not a multiple of a slot's {w}",
                rows.len()
            )));
        }
        for (i, r) in rows.chunks_exact(w).enumerate() {
            let pos = start + i;
            let Some(&p) = pages.get(pos / ps) else {
                return Err(infeasible(format!(
                    "K/V row for position {pos}, past the {} pages reserved",
                    pages.len()
                )));
            };
            if !self.kv.write_slot(p, pos % ps, r) {
                return Err(infeasible(format!(
                    "K/V row for position {pos} into page {p}, which this pool never handed out"
                )));
            }
        }
        Ok(())
    }

    /// Drops a reservation (its pages' references). `false` if none.
    pub fn unreserve(&mut self, id: RequestId) -> bool {
        if self.seqs.contains_key(&id) {
            return false;
        }
        let Some(t) = self.kv.tables.remove(&id) else {
            return false;
        };
        for p in t.pages {
            self.kv.pool.decref(p);
        }
        true
    }

    /// Whether `id` holds a reservation (reserved, not admitted).
    pub fn is_reserved(&self, id: RequestId) -> bool {
        self.kv.tables.contains_key(&id) && !self.seqs.contains_key(&id)
    }

    /// Starts a request prefilled by another engine: its reservation now
    /// holds the K/V of its `positions` prompt positions, its first token
    /// `first` was drawn from `row` there. It runs from the next step, the
    /// token at position `positions` being its next span, exactly as if
    /// this engine had prefilled it (its digest chains on from `row`).
    pub fn admit_prefilled(
        &mut self,
        req: Request,
        first: u32,
        row: &[f32],
    ) -> Result<(), EngineError> {
        let id = req.id;
        let positions = req.prompt.len();
        if self.seqs.contains_key(&id) || self.done.contains_key(&id) {
            return Err(infeasible(format!(
                "admission of prefilled request {id}, which this engine already knows"
            )));
        }
        let ps = self.cfg.page_size;
        let Some(t) = self.kv.tables.get_mut(&id) else {
            return Err(infeasible(format!(
                "admission of prefilled request {id}, which holds no reservation"
            )));
        };
        if t.pages.len() < positions.div_ceil(ps) {
            return Err(infeasible(format!(
                "admission of prefilled request {id}: {positions} positions need {} pages, it reserved {}",
                positions.div_ceil(ps),
                t.pages.len()
            )));
        }
        t.len = positions;
        let mut hasher = Sha256::new();
        hasher.update(crate::digest::row_bytes(row));
        hasher.update(first.to_le_bytes());
        let mut tokens = req.prompt.clone();
        tokens.push(first);
        let order = self.next_order;
        self.next_order += 1;
        self.seqs.insert(
            id,
            Seq {
                req,
                tokens,
                order,
                hasher,
                cached_tokens: Some(0),
                preemptions: 0,
                shared_pages: Vec::new(),
            },
        );
        self.running.push(id);
        Ok(())
    }

    /// The logits row sampled for `id` in the latest step (with
    /// [`Self::set_keep_rows`]).
    pub fn last_row(&self, id: RequestId) -> Option<&[f32]> {
        self.last_rows
            .iter()
            .find(|(r, _)| *r == id)
            .map(|(_, row)| row.as_slice())
    }

    /// Describes the pool for a livelock or exhaustion report.
    pub fn pool_summary(&self) -> String {
        let pool = &self.kv.pool;
        format!(
            "{} of {} pages free, {} cached in the prefix tree, {} held by requests (page size {})",
            pool.free_count(),
            pool.n_pages(),
            self.radix.len(),
            self.pages_held_by_requests(),
            self.cfg.page_size
        )
    }

    /// Whether `id` waits in this engine's queue (not admitted, or preempted).
    pub fn is_waiting(&self, id: RequestId) -> bool {
        self.waiting.contains(&id)
    }

    /// Pages a reservation or admission could have now: free ones, plus
    /// cached ones no request references when the prefix cache is on.
    pub fn available_pages(&self) -> usize {
        self.kv.pool.free_count()
            + if self.cfg.prefix_cache {
                self.radix.evictable(&self.kv.pool, &[])
            } else {
                0
            }
    }

    /// Pages of request `id`'s block table (reserved, running or held).
    pub fn pages_of(&self, id: RequestId) -> usize {
        self.kv.tables.get(&id).map_or(0, |t| t.pages.len())
    }
}
