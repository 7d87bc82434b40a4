//! Paged KV pool: fixed-size pages of `page_size` positions, refcounted, in a
//! bounded pool; and [`PagedKv`], the [`KvCache`] the forward pass writes to.
//!
//! Invariants: a page is free iff its refcount is 0; a free page is on the free
//! list exactly once; the free list is a LIFO stack, so allocation order is a
//! function of the sequence of alloc/free calls (no addresses, no clock).
//! Each page carries a content hash (SHA-256 over the digests of its filled
//! slots, each slot digest covering that position's K and V rows in every
//! layer). Slot digests are computed once, when the slot is written
//! ([`PagedKv::finish_step`]); a page hash is recomputed only when one of its
//! slots changed — never by rescanning the pool.

use std::collections::{BTreeMap, BTreeSet};

use lmrr_kernels::KvView;
use sha2::{Digest, Sha256};

use crate::kv::{KvCache, SeqId};
use crate::EngineError;

pub type PageId = u32;
pub type Hash = [u8; 32];

/// The pool's storage and bookkeeping.
pub struct PagePool {
    page_size: usize,
    n_pages: usize,
    layers: usize,
    kv_dim: usize,
    /// Per layer, `(n_pages, page_size, kv_dim)`.
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    refs: Vec<u32>,
    free: Vec<PageId>,
    /// Slots written per page (positions `0..filled` hold content).
    filled: Vec<u32>,
    /// `(n_pages, page_size)` slot digests.
    slot_digest: Vec<Hash>,
    page_hash: Vec<Hash>,
}

impl PagePool {
    pub fn new(
        page_size: usize,
        n_pages: usize,
        layers: usize,
        kv_dim: usize,
    ) -> Result<Self, EngineError> {
        if page_size == 0 || n_pages == 0 {
            return Err(EngineError::InvalidOption {
                name: "page_size/pool_pages",
                value: format!("{page_size}/{n_pages}"),
                why: "both must be at least 1".into(),
            });
        }
        let per_layer = n_pages
            .checked_mul(page_size)
            .and_then(|x| x.checked_mul(kv_dim))
            .filter(|&x| x.checked_mul(layers * 8).is_some_and(|b| b <= (64usize << 30)))
            .ok_or_else(|| EngineError::InvalidOption {
                name: "pool_pages",
                value: n_pages.to_string(),
                why: format!("a pool of {n_pages} pages × {page_size} positions × {layers} layers × {kv_dim} floats × K,V exceeds 64 GiB"),
            })?;
        Ok(Self {
            page_size,
            n_pages,
            layers,
            kv_dim,
            k: vec![vec![0.0; per_layer]; layers],
            v: vec![vec![0.0; per_layer]; layers],
            refs: vec![0; n_pages],
            free: (0..n_pages as PageId).rev().collect(),
            filled: vec![0; n_pages],
            slot_digest: vec![[0; 32]; n_pages * page_size],
            page_hash: vec![[0; 32]; n_pages],
        })
    }

    pub fn page_size(&self) -> usize {
        self.page_size
    }
    pub fn n_pages(&self) -> usize {
        self.n_pages
    }
    pub fn free_count(&self) -> usize {
        self.free.len()
    }
    pub fn refcount(&self, p: PageId) -> u32 {
        self.refs[p as usize]
    }
    pub fn page_hash(&self, p: PageId) -> Hash {
        self.page_hash[p as usize]
    }
    pub fn filled(&self, p: PageId) -> usize {
        self.filled[p as usize] as usize
    }

    /// Takes a free page (refcount 1, empty), or `None` if the pool is full.
    pub fn alloc(&mut self) -> Option<PageId> {
        let p = self.free.pop()?;
        self.refs[p as usize] = 1;
        self.filled[p as usize] = 0;
        self.page_hash[p as usize] = empty_page_hash();
        Some(p)
    }

    pub fn incref(&mut self, p: PageId) {
        self.refs[p as usize] += 1;
    }

    /// Drops one reference; at zero the page returns to the free list.
    pub fn decref(&mut self, p: PageId) {
        let r = &mut self.refs[p as usize];
        if *r == 0 {
            // Only reachable under a cache-corruption patch (the page was
            // force-freed while referenced); stay consistent, never panic.
            return;
        }
        *r -= 1;
        if *r == 0 {
            self.free.push(p);
        }
    }

    /// Forcibly frees a page whatever its refcount (only the
    /// `abort-frees-shared` bug class does this; kept here so that the pool's
    /// free-list invariant is maintained even then).
    pub fn force_free(&mut self, p: PageId) {
        if self.refs[p as usize] > 0 {
            self.refs[p as usize] = 0;
            self.free.push(p);
        }
    }

    fn offset(&self, p: PageId, slot: usize) -> usize {
        (p as usize * self.page_size + slot) * self.kv_dim
    }

    /// Per page id ascending: `(refcount, content hash)` of pages in use.
    pub fn in_use(&self) -> impl Iterator<Item = (PageId, u32, Hash)> + '_ {
        (0..self.n_pages as PageId)
            .filter(|&p| self.refs[p as usize] > 0)
            .map(|p| (p, self.refs[p as usize], self.page_hash[p as usize]))
    }

    /// Sum of refcounts.
    pub fn total_refs(&self) -> u64 {
        self.refs.iter().map(|&r| r as u64).sum()
    }
}

fn empty_page_hash() -> Hash {
    Sha256::digest(0u32.to_le_bytes()).into()
}

/// One sequence's pages and the positions it holds.
#[derive(Debug, Clone, Default)]
pub struct BlockTable {
    pub pages: Vec<PageId>,
    pub len: usize,
}

/// The pool plus per-sequence block tables: the serving core's KV store.
pub struct PagedKv {
    pub pool: PagePool,
    pub tables: BTreeMap<SeqId, BlockTable>,
    /// `(page, slot)` written since the last `finish_step`.
    written: BTreeSet<(PageId, usize)>,
}

impl PagedKv {
    pub fn new(pool: PagePool) -> Self {
        Self {
            pool,
            tables: BTreeMap::new(),
            written: BTreeSet::new(),
        }
    }

    /// Computes digests of slots written this step and the hashes of the pages
    /// they belong to.
    pub fn finish_step(&mut self) {
        let written = std::mem::take(&mut self.written);
        let mut pages = BTreeSet::new();
        let pool = &mut self.pool;
        let mut buf = Vec::with_capacity(pool.kv_dim * 4);
        let mut h_row = |h: &mut Sha256, row: &[f32]| {
            buf.clear();
            buf.extend(row.iter().flat_map(|x| x.to_bits().to_le_bytes()));
            h.update(&buf);
        };
        for &(p, slot) in &written {
            let off = pool.offset(p, slot);
            let mut h = Sha256::new();
            for l in 0..pool.layers {
                h_row(&mut h, &pool.k[l][off..off + pool.kv_dim]);
                h_row(&mut h, &pool.v[l][off..off + pool.kv_dim]);
            }
            pool.slot_digest[p as usize * pool.page_size + slot] = h.finalize().into();
            let f = &mut pool.filled[p as usize];
            *f = (*f).max(slot as u32 + 1);
            pages.insert(p);
        }
        for p in pages {
            let n = pool.filled[p as usize] as usize;
            let base = p as usize * pool.page_size;
            let mut h = Sha256::new();
            h.update((n as u32).to_le_bytes());
            for d in &pool.slot_digest[base..base + n] {
                h.update(d);
            }
            pool.page_hash[p as usize] = h.finalize().into();
        }
    }
}

impl KvCache for PagedKv {
    fn len(&self, seq: SeqId) -> usize {
        self.tables.get(&seq).map_or(0, |t| t.len)
    }

    fn prepare(&mut self, seq: SeqId, start: usize, n: usize) -> Result<(), EngineError> {
        let ps = self.pool.page_size;
        let t = self.tables.get_mut(&seq).ok_or(EngineError::KvPosition {
            seq,
            start,
            held: 0,
        })?;
        if t.len != start {
            return Err(EngineError::KvPosition {
                seq,
                start,
                held: t.len,
            });
        }
        let need = (start + n).div_ceil(ps);
        if t.pages.len() < need {
            return Err(EngineError::PoolExhausted {
                seq,
                need_pages: need,
                have_pages: t.pages.len(),
            });
        }
        t.len = start + n;
        Ok(())
    }

    fn write(&mut self, seq: SeqId, layer: usize, pos: usize, k: &[f32], v: &[f32]) {
        let ps = self.pool.page_size;
        let p = self.tables[&seq].pages[pos / ps];
        let off = self.pool.offset(p, pos % ps);
        let d = self.pool.kv_dim;
        self.pool.k[layer][off..off + d].copy_from_slice(k);
        self.pool.v[layer][off..off + d].copy_from_slice(v);
        self.written.insert((p, pos % ps));
    }

    fn view(&self, seq: SeqId, layer: usize) -> KvView<'_> {
        let ps = self.pool.page_size;
        let span = ps * self.pool.kv_dim;
        let pages = self
            .tables
            .get(&seq)
            .map(|t| t.pages.as_slice())
            .unwrap_or(&[]);
        KvView {
            block_len: ps,
            k: pages
                .iter()
                .map(|&p| &self.pool.k[layer][p as usize * span..(p as usize + 1) * span])
                .collect(),
            v: pages
                .iter()
                .map(|&p| &self.pool.v[layer][p as usize * span..(p as usize + 1) * span])
                .collect(),
        }
    }
}
