//! Paged KV pool: fixed-size pages of `page_size` positions, refcounted, in a
//! bounded pool; and [`PagedKv`], the [`KvCache`] the forward pass writes to.
//!
//! Invariants: a page is free iff its refcount is 0; a free page is on the free
//! list exactly once; the free list is a LIFO stack, so allocation order is a
//! function of the sequence of alloc/free calls (no addresses, no clock).
//! Each page carries a content hash (SHA-256 over the digests of its filled
//! slots, each slot digest covering that position's K and V rows in every
//! layer, and its auxiliary row where the family keeps one). Slot digests are computed once, when the slot is written
//! ([`PagedKv::finish_step`]); a page hash is recomputed only when one of its
//! slots changed — never by rescanning the pool.
//!
//! Storage is sized lazily: a pool of `n_pages` is a promise, not an
//! allocation. Pages are handed out in the order a LIFO free list
//! initialised with `n_pages - 1, …, 1, 0` would give them (returned pages
//! first, then the lowest never-used page), and the K/V storage and
//! bookkeeping grow to the highest page ever used. A 500,000-page pool
//! serving a 4-token session holds one page. Growth that the allocator
//! refuses is an error with the numbers, never an abort.
//!
//! Each page also carries a write version from the process-wide clock
//! ([`crate::kv::next_version`]), stamped at every write to any of its rows
//! (once per page for a run of rows, [`KvCache::write_run`], or for a whole
//! step's rows in every layer, [`KvCache::write_step`]):
//! [`KvCache::blocks`] lists a sequence's pages with their versions, which is
//! how the CUDA device mirror knows, without reading a row, whether its copy
//! of a page is still this pool's.

use std::collections::{BTreeMap, BTreeSet};

use lmrr_kernels::{KvView, Threads};
use sha2::{Digest, Sha256};

use crate::kv::{
    copy_step, next_version, run_rows, BlockRows, KvBlocks, KvCache, KvRun, RowView, SeqId,
    StepPiece,
};
use crate::model::KvLayout;
use crate::EngineError;

pub type PageId = u32;
pub type Hash = [u8; 32];

/// The pool's storage and bookkeeping.
pub struct PagePool {
    page_size: usize,
    n_pages: usize,
    layers: usize,
    kv_dim: usize,
    aux_dim: usize,
    /// Bytes of storage this pool may hold, from the memory the host had
    /// available when it was made (`usize::MAX` where that is unknown).
    budget: usize,
    /// Pages ever handed out: pages `0..used` have storage; pages
    /// `used..n_pages` are free and untouched.
    used: usize,
    /// Per layer, `(used, page_size, kv_dim)`.
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    /// Per layer, `(used, page_size, aux_dim)`.
    aux: Vec<Vec<f32>>,
    /// `(used,)` refcounts.
    refs: Vec<u32>,
    /// Returned pages (a stack, popped before any never-used page).
    free: Vec<PageId>,
    /// `(used,)` slots written per page (positions `0..filled` hold content).
    filled: Vec<u32>,
    /// `(used, page_size)` slot digests.
    slot_digest: Vec<Hash>,
    /// `(used,)` page content hashes.
    page_hash: Vec<Hash>,
    /// Process-unique id of this pool (device mirror keys).
    id: u64,
    /// `(used,)` write versions ([`KvBlocks`]).
    version: Vec<u64>,
}

impl PagePool {
    pub fn new(page_size: usize, n_pages: usize, layout: KvLayout) -> Result<Self, EngineError> {
        let KvLayout {
            layers,
            kv_dim,
            aux_dim,
        } = layout;
        // Floats per position and layer, K and V and the auxiliary row.
        let row = 2 * kv_dim + aux_dim;
        if page_size == 0 || n_pages == 0 {
            return Err(EngineError::InvalidOption {
                name: "page_size/pool_pages",
                value: format!("{page_size}/{n_pages}"),
                why: "both must be at least 1".into(),
            });
        }
        // Page ids are u32; the full pool's K/V must be addressable.
        let full = n_pages
            .checked_mul(page_size)
            .and_then(|x| x.checked_mul(row))
            .and_then(|x| x.checked_mul(layers.max(1) * 4))
            .filter(|&b| b <= MAX_POOL_BYTES && n_pages <= PageId::MAX as usize);
        if full.is_none() {
            return Err(EngineError::InvalidOption {
                name: "pool_pages",
                value: n_pages.to_string(),
                why: format!(
                    "a pool of {n_pages} pages × {page_size} positions × {layers} layers × \
                     {kv_dim} floats × K,V (+ {aux_dim}) exceeds {} GiB",
                    MAX_POOL_BYTES >> 30
                ),
            });
        }
        Ok(Self {
            page_size,
            n_pages,
            layers,
            kv_dim,
            aux_dim,
            budget: available_memory().map_or(usize::MAX, |b| b / 10 * 9),
            used: 0,
            k: vec![Vec::new(); layers],
            v: vec![Vec::new(); layers],
            aux: vec![Vec::new(); layers],
            refs: Vec::new(),
            free: Vec::new(),
            filled: Vec::new(),
            slot_digest: Vec::new(),
            page_hash: Vec::new(),
            id: next_version(),
            version: Vec::new(),
        })
    }

    /// Gives page `used` its storage (zeroed).
    fn grow(&mut self) -> Result<(), EngineError> {
        let span = self.page_size * self.kv_dim;
        let oom = |bytes: usize, have: usize, n: usize| EngineError::OutOfMemory {
            what: format!("KV page {have} of a {n}-page pool"),
            bytes,
            budget: None,
        };
        let (have, n) = (self.used, self.n_pages);
        let aux_span = self.page_size * self.aux_dim;
        let page_bytes = (2 * span + aux_span) * 4 * self.layers + self.page_size * 32;
        let after = self
            .storage_bytes()
            .saturating_add(self.used * self.page_size * 32)
            .saturating_add(page_bytes);
        if after > self.budget {
            return Err(EngineError::OutOfMemory {
                what: format!(
                    "KV page {have} of a {n}-page pool ({} positions × {} layers × {} floats × K,V per page)",
                    self.page_size, self.layers, self.kv_dim
                ),
                bytes: after,
                budget: Some(self.budget),
            });
        }
        for buf in self.k.iter_mut().chain(self.v.iter_mut()) {
            buf.try_reserve(span)
                .map_err(|_| oom((have + 1) * span * 4, have, n))?;
            buf.resize(buf.len() + span, 0.0);
        }
        for buf in self.aux.iter_mut() {
            buf.try_reserve(aux_span)
                .map_err(|_| oom((have + 1) * aux_span * 4, have, n))?;
            buf.resize(buf.len() + aux_span, 0.0);
        }
        self.slot_digest
            .try_reserve(self.page_size)
            .map_err(|_| oom((have + 1) * self.page_size * 32, have, n))?;
        self.slot_digest
            .resize(self.slot_digest.len() + self.page_size, [0; 32]);
        self.refs.push(0);
        self.filled.push(0);
        self.page_hash.push([0; 32]);
        self.version.push(0);
        self.used += 1;
        Ok(())
    }

    pub fn page_size(&self) -> usize {
        self.page_size
    }
    pub fn n_pages(&self) -> usize {
        self.n_pages
    }
    pub fn free_count(&self) -> usize {
        self.free.len() + (self.n_pages - self.used)
    }
    /// Pages that have ever been handed out (the storage held).
    pub fn used_pages(&self) -> usize {
        self.used
    }
    /// Bytes of K/V storage held (grows with the pages ever used).
    pub fn storage_bytes(&self) -> usize {
        self.used * self.page_size * (self.kv_dim * 2 + self.aux_dim) * 4 * self.layers
    }
    pub fn refcount(&self, p: PageId) -> u32 {
        self.refs.get(p as usize).copied().unwrap_or(0)
    }
    pub fn page_hash(&self, p: PageId) -> Hash {
        self.page_hash[p as usize]
    }
    /// The digest of slot `slot` of page `p` (all zeros until written).
    pub fn slot_digest(&self, p: PageId, slot: usize) -> Hash {
        self.slot_digest[p as usize * self.page_size + slot]
    }
    pub fn filled(&self, p: PageId) -> usize {
        self.filled[p as usize] as usize
    }

    /// Takes a free page (refcount 1, empty), or `None` if the pool is full;
    /// an error only if the storage for a never-used page cannot be had.
    pub fn alloc(&mut self) -> Result<Option<PageId>, EngineError> {
        let p = match self.free.pop() {
            Some(p) => p,
            None if self.used < self.n_pages => {
                self.grow()?;
                (self.used - 1) as PageId
            }
            None => return Ok(None),
        };
        self.refs[p as usize] = 1;
        self.filled[p as usize] = 0;
        self.page_hash[p as usize] = empty_page_hash();
        Ok(Some(p))
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
        (0..self.used as PageId)
            .filter(|&p| self.refs[p as usize] > 0)
            .map(|p| (p, self.refs[p as usize], self.page_hash[p as usize]))
    }

    /// Sum of refcounts.
    pub fn total_refs(&self) -> u64 {
        self.refs.iter().map(|&r| r as u64).sum()
    }
}

/// Cap on a pool's full K/V size (what it could grow to), whatever the
/// host: a bundle or a flag asking for more is refused before anything runs.
pub const MAX_POOL_BYTES: usize = 64 << 30;

/// `MemAvailable` of `/proc/meminfo`, in bytes (Linux; `None` elsewhere).
fn available_memory() -> Option<usize> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    kb.checked_mul(1024)
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
    written: Written,
}

/// The slots written since the last `finish_step`: each listed once, in the
/// order first written, with a flag per slot (at `page · page_size + slot`,
/// grown to the highest page written) saying whether it is listed, so that
/// marking a row is one flag test where a set would search.
#[derive(Default)]
struct Written {
    slots: Vec<(PageId, usize)>,
    listed: Vec<bool>,
}

impl Written {
    /// Lists slots `slots` of page `p` (pages of `page_size`).
    fn mark(&mut self, p: PageId, slots: std::ops::Range<usize>, page_size: usize) {
        let base = p as usize * page_size;
        if self.listed.len() < base + page_size {
            self.listed.resize(base + page_size, false);
        }
        for slot in slots {
            let listed = &mut self.listed[base + slot];
            if !*listed {
                *listed = true;
                self.slots.push((p, slot));
            }
        }
    }

    /// The listed slots in `(page, slot)` order; the list starts empty again.
    fn take_sorted(&mut self, page_size: usize) -> Vec<(PageId, usize)> {
        let mut slots = std::mem::take(&mut self.slots);
        slots.sort_unstable();
        for &(p, slot) in &slots {
            self.listed[p as usize * page_size + slot] = false;
        }
        slots
    }
}

impl PagedKv {
    pub fn new(pool: PagePool) -> Self {
        Self {
            pool,
            tables: BTreeMap::new(),
            written: Written::default(),
        }
    }

    /// Computes digests of slots written this step and the hashes of the pages
    /// they belong to (one thread; [`PagedKv::finish_step_on`]).
    pub fn finish_step(&mut self) {
        self.finish_step_on(&Threads::single());
    }

    /// [`PagedKv::finish_step`] with the slots' digests spread over
    /// `threads` (each slot's digest is a function of its rows alone, so
    /// the values are the same whichever thread hashes it; a batch-64 step
    /// of the `small` preset hashes 2.9 MB of rows). Page hashes follow in
    /// page order.
    pub fn finish_step_on(&mut self, threads: &Threads) {
        let written = self.written.take_sorted(self.pool.page_size);
        let pool = &self.pool;
        let slot_hash = |p: PageId, slot: usize| -> Hash {
            let off = pool.offset(p, slot);
            let mut buf = Vec::with_capacity(pool.kv_dim.max(pool.aux_dim) * 4);
            let mut h = Sha256::new();
            let mut row = |row: &[f32]| {
                buf.clear();
                buf.extend(row.iter().flat_map(|x| x.to_bits().to_le_bytes()));
                h.update(&buf);
            };
            for l in 0..pool.layers {
                row(&pool.k[l][off..off + pool.kv_dim]);
                row(&pool.v[l][off..off + pool.kv_dim]);
                if pool.aux_dim > 0 {
                    let a = (p as usize * pool.page_size + slot) * pool.aux_dim;
                    row(&pool.aux[l][a..a + pool.aux_dim]);
                }
            }
            h.finalize().into()
        };
        let digests: Vec<std::sync::Mutex<Hash>> = written
            .iter()
            .map(|_| std::sync::Mutex::new([0u8; 32]))
            .collect();
        threads.for_ranges(written.len(), threads.grain(written.len(), 1), |rs| {
            for i in rs {
                let (p, slot) = written[i];
                let d = slot_hash(p, slot);
                if let Ok(mut g) = digests[i].lock() {
                    *g = d;
                }
            }
        });
        let pool = &mut self.pool;
        let mut pages = BTreeSet::new();
        for (&(p, slot), d) in written.iter().zip(digests) {
            pool.slot_digest[p as usize * pool.page_size + slot] =
                d.into_inner().unwrap_or_else(|e| e.into_inner());
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

/// Whole slots, for moving K/V between two pools (a disaggregated
/// deployment's transfer): a slot's rows are its K, V and auxiliary rows in
/// every layer, `(layers, 2·kv_dim + aux_dim)` floats.
impl PagedKv {
    /// Floats one slot's rows take: `layers · (2·kv_dim + aux_dim)`.
    pub fn slot_width(&self) -> usize {
        self.pool.layers * (2 * self.pool.kv_dim + self.pool.aux_dim)
    }

    /// Appends slot `slot` of page `p`'s rows to `out`.
    pub fn read_slot(&self, p: PageId, slot: usize, out: &mut Vec<f32>) {
        let pool = &self.pool;
        let off = pool.offset(p, slot);
        let a = (p as usize * pool.page_size + slot) * pool.aux_dim;
        for l in 0..pool.layers {
            out.extend_from_slice(&pool.k[l][off..off + pool.kv_dim]);
            out.extend_from_slice(&pool.v[l][off..off + pool.kv_dim]);
            out.extend_from_slice(&pool.aux[l][a..a + pool.aux_dim]);
        }
    }

    /// Writes `rows` (one slot's, [`Self::slot_width`] floats) into slot
    /// `slot` of page `p`, whoever holds the page: a transfer writes where it
    /// was told to. The slot is marked written (digested at the next
    /// `finish_step`) and the page gets a fresh version. `false` if the page
    /// has never been handed out or the rows have the wrong width.
    pub fn write_slot(&mut self, p: PageId, slot: usize, rows: &[f32]) -> bool {
        if p as usize >= self.pool.used
            || slot >= self.pool.page_size
            || rows.len() != self.slot_width()
        {
            return false;
        }
        let pool = &mut self.pool;
        let off = pool.offset(p, slot);
        let a = (p as usize * pool.page_size + slot) * pool.aux_dim;
        let (d, ad) = (pool.kv_dim, pool.aux_dim);
        for (l, r) in rows.chunks_exact(2 * d + ad).enumerate() {
            pool.k[l][off..off + d].copy_from_slice(&r[..d]);
            pool.v[l][off..off + d].copy_from_slice(&r[d..2 * d]);
            pool.aux[l][a..a + ad].copy_from_slice(&r[2 * d..]);
        }
        pool.version[p as usize] = next_version();
        let ps = pool.page_size;
        self.written.mark(p, slot..slot + 1, ps);
        true
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
        self.pool.version[p as usize] = next_version();
        self.written.mark(p, pos % ps..pos % ps + 1, ps);
    }

    /// The run split at page boundaries: per page piece one copy of its K
    /// rows, one of its V rows, one fresh version, and its slots marked
    /// written (the same slots, so the same digests, as per-row writes).
    fn write_run(&mut self, seq: SeqId, layer: usize, pos0: usize, k: &[f32], v: &[f32]) {
        let (ps, d) = (self.pool.page_size, self.pool.kv_dim);
        let n = run_rows(k, v, d);
        if n == 0 {
            return;
        }
        let pages = &self.tables[&seq].pages;
        let end = pos0 + n;
        let mut pos = pos0;
        while pos < end {
            let slot = pos % ps;
            let m = (ps - slot).min(end - pos);
            let p = pages[pos / ps];
            let off = self.pool.offset(p, slot);
            let src = (pos - pos0) * d..(pos - pos0 + m) * d;
            self.pool.k[layer][off..off + m * d].copy_from_slice(&k[src.clone()]);
            self.pool.v[layer][off..off + m * d].copy_from_slice(&v[src]);
            self.pool.version[p as usize] = next_version();
            self.written.mark(p, slot..slot + m, ps);
            pos += m;
        }
    }

    /// The runs split at page boundaries once for all layers; per layer one
    /// copy of each page piece's K rows and one of its V rows, the layers
    /// spread over `threads` (`copy_step`); then, on the calling thread,
    /// each piece's slots marked written and one fresh version per touched
    /// page (the same slots, so the same digests, as per-row writes).
    fn write_layers(
        &mut self,
        runs: &[KvRun],
        layers: std::ops::Range<usize>,
        k: &[f32],
        v: &[f32],
        threads: &Threads,
    ) {
        let (ps, d) = (self.pool.page_size, self.pool.kv_dim);
        let per = k.len().checked_div(layers.len()).unwrap_or(0);
        if per == 0 || d == 0 {
            return;
        }
        debug_assert_eq!(k.len(), v.len(), "K and V alike");
        debug_assert!(
            layers.end <= self.pool.layers,
            "layers {layers:?} of {}",
            self.pool.layers
        );
        let mut pieces = Vec::with_capacity(runs.len());
        let mut touched = Vec::with_capacity(runs.len());
        for r in runs.iter().filter(|r| r.n > 0) {
            let pages = &self.tables[&r.seq].pages;
            let end = r.pos0 + r.n;
            let mut pos = r.pos0;
            while pos < end {
                let slot = pos % ps;
                let m = (ps - slot).min(end - pos);
                let p = pages[pos / ps];
                pieces.push(StepPiece {
                    buf: 0,
                    src: (r.row0 + pos - r.pos0) * d,
                    dst: self.pool.offset(p, slot),
                    len: m * d,
                });
                self.written.mark(p, slot..slot + m, ps);
                touched.push(p);
                pos += m;
            }
        }
        let pool = &mut self.pool;
        let dst = pool
            .k
            .iter_mut()
            .zip(pool.v.iter_mut())
            .skip(layers.start)
            .take(layers.len())
            .flat_map(|(bk, bv)| [vec![bk.as_mut_slice()], vec![bv.as_mut_slice()]])
            .collect();
        copy_step(dst, k, &v[..k.len()], per, &pieces, threads);
        touched.sort_unstable();
        touched.dedup();
        for p in touched {
            pool.version[p as usize] = next_version();
        }
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

    fn write_aux(&mut self, seq: SeqId, layer: usize, pos: usize, row: &[f32]) {
        let ps = self.pool.page_size;
        let p = self.tables[&seq].pages[pos / ps];
        let d = self.pool.aux_dim;
        let off = (p as usize * ps + pos % ps) * d;
        self.pool.aux[layer][off..off + d].copy_from_slice(row);
        self.pool.version[p as usize] = next_version();
        self.written.mark(p, pos % ps..pos % ps + 1, ps);
    }

    fn aux_view(&self, seq: SeqId, layer: usize) -> RowView<'_> {
        let ps = self.pool.page_size;
        let span = ps * self.pool.aux_dim;
        let pages = self
            .tables
            .get(&seq)
            .map(|t| t.pages.as_slice())
            .unwrap_or(&[]);
        RowView {
            block_len: ps,
            width: self.pool.aux_dim,
            blocks: pages
                .iter()
                .map(|&p| &self.pool.aux[layer][p as usize * span..(p as usize + 1) * span])
                .collect(),
        }
    }

    fn blocks(&self, seq: SeqId) -> KvBlocks {
        let pages = self
            .tables
            .get(&seq)
            .map(|t| t.pages.as_slice())
            .unwrap_or(&[]);
        let (ps, len) = (self.pool.page_size, self.len(seq));
        KvBlocks {
            block_len: ps,
            blocks: pages[..len.div_ceil(ps).min(pages.len())]
                .iter()
                .map(|&p| {
                    (
                        (self.pool.id << 32) | p as u64,
                        self.pool.version[p as usize],
                    )
                })
                .collect(),
        }
    }

    fn block_rows(&self, seq: SeqId, block: usize, layer: usize) -> BlockRows<'_> {
        let Some(&p) = self.tables.get(&seq).and_then(|t| t.pages.get(block)) else {
            return BlockRows {
                k: &[],
                v: &[],
                aux: &[],
            };
        };
        let (ps, p) = (self.pool.page_size, p as usize);
        let (kvs, auxs) = (ps * self.pool.kv_dim, ps * self.pool.aux_dim);
        BlockRows {
            k: &self.pool.k[layer][p * kvs..(p + 1) * kvs],
            v: &self.pool.v[layer][p * kvs..(p + 1) * kvs],
            aux: &self.pool.aux[layer][p * auxs..(p + 1) * auxs],
        }
    }
}
