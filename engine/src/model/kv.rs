//! The KV store interface the forward pass writes to and attends over, and a
//! simple per-sequence implementation.
//!
//! A store holds, per sequence and layer, K and V rows of `kv_dim` floats for
//! positions `0..len`, and an auxiliary row of `aux_dim` floats where the
//! family keeps more or other rows per position (the MLA families: the
//! compressed latent, the rotated RoPE key and, for mini-v4, the indexer key; see
//! [`crate::model::KvLayout`]). The forward pass calls [`KvCache::prepare`] for each span
//! (the span must start exactly at `len`), writes rows (one position at a
//! time, a run of consecutive positions at once, or a whole step's runs in
//! every layer at once, spread over the engine's threads), then reads them back
//! through [`KvCache::view`] as fixed-length blocks — so a paged pool plugs in
//! behind the same trait without touching the model. A device mirror of the
//! store (the CUDA resident path) finds and checks rows through
//! [`KvCache::blocks`]: keys and write versions that say, without comparing
//! any row, whether its copy of a block is still the host's.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use lmrr_kernels::{KvView, Threads};

use crate::model::KvLayout;
use crate::EngineError;

/// Identifies a sequence in a KV store.
pub type SeqId = u64;

pub trait KvCache: Send {
    /// Positions held for `seq` (0 for an unknown sequence).
    fn len(&self, seq: SeqId) -> usize;
    /// Makes positions `start..start + n` of `seq` writable; `start` must equal
    /// `len(seq)`. Afterwards `len(seq) == start + n`.
    fn prepare(&mut self, seq: SeqId, start: usize, n: usize) -> Result<(), EngineError>;
    /// Writes the K and V rows of `seq` at `pos` in `layer`.
    fn write(&mut self, seq: SeqId, layer: usize, pos: usize, k: &[f32], v: &[f32]);
    /// Writes the K and V rows of `seq` in `layer` for the `n` positions
    /// `pos0..pos0 + n`, where `k` and `v` hold those `n` rows back to back,
    /// `(n, kv_dim)` each (`n = k.len() / kv_dim`; `n = 0` writes nothing).
    ///
    /// The end state is that of `write(seq, layer, pos0 + j, ..)` for
    /// `j = 0..n` in that order (the same rows, and, for a paged store, the
    /// same slots to digest at the end of the step), except for the block
    /// versions of [`KvCache::blocks`]: every block holding one of the
    /// positions gets a version from [`next_version`] taken during this call
    /// (one per block, not one per row, so not the value the per-row writes
    /// would have left), and no other block's version moves. That is all
    /// [`KvBlocks`] asks of versions: each is fresh (never held by another
    /// block, never handed out again), so a block written by the run no
    /// longer matches any version a mirror recorded before it.
    ///
    /// The provided method loops over [`KvCache::write`] (taking `kv_dim`
    /// from [`KvCache::view`]'s blocks of `(block_len, kv_dim)`); stores
    /// override it with one copy per contiguous piece.
    fn write_run(&mut self, seq: SeqId, layer: usize, pos0: usize, k: &[f32], v: &[f32]) {
        let d = view_kv_dim(&self.view(seq, layer));
        if d == 0 {
            return;
        }
        for (j, (k, v)) in k.chunks_exact(d).zip(v.chunks_exact(d)).enumerate() {
            self.write(seq, layer, pos0 + j, k, v);
        }
    }
    /// Writes a whole step's K and V rows in layers `0..layers`: `k` and `v`
    /// are `(layers, rows, kv_dim)` each (the step's `rows` stacked rows per
    /// layer, `rows · kv_dim = k.len() / layers`), and each [`KvRun`] puts
    /// stacked rows `row0..row0 + n` at positions `pos0..pos0 + n` of `seq`.
    ///
    /// The end state is that of the provided method: for each layer in
    /// order, [`KvCache::write_run`] of each run in `runs` order — so where
    /// two runs write one slot (a cache-corruption patch) the later one's
    /// rows stay, in every layer. Versions as [`KvCache::write_run`] says:
    /// every block holding a position of some run (with `n > 0`) gets a
    /// version from [`next_version`] taken during this call, fresh, and no
    /// other block's version moves (the provided method takes one per
    /// (layer, run, block); the stores here one per touched block for the
    /// whole step, on the calling thread).
    ///
    /// `threads` may copy layers concurrently: the stores here do, one task
    /// per (layer, K or V), each layer's rows being buffers of their own
    /// ([`SeqKvStore`], [`crate::pool::PagedKv`]), and copy on the calling
    /// thread alone below [`STEP_PARALLEL_FLOATS`]. The provided method
    /// writes on the calling thread.
    fn write_step(
        &mut self,
        runs: &[KvRun],
        layers: usize,
        k: &[f32],
        v: &[f32],
        threads: &Threads,
    ) {
        self.write_layers(runs, 0..layers, k, v, threads);
    }
    /// [`KvCache::write_step`] for layers `layers` only: `k` and `v` are
    /// `(layers.len(), rows, kv_dim)`, their first rows layer
    /// `layers.start`'s. Writing a step's layers in several calls (a device
    /// step hands each layer's rows over as its layer completes) ends in the
    /// state of one [`KvCache::write_step`] over all of them; each call takes
    /// fresh versions for the blocks it touches.
    fn write_layers(
        &mut self,
        runs: &[KvRun],
        layers: std::ops::Range<usize>,
        k: &[f32],
        v: &[f32],
        threads: &Threads,
    ) {
        let _ = threads;
        let Some(first) = runs.iter().find(|r| r.n > 0) else {
            return;
        };
        let d = view_kv_dim(&self.view(first.seq, 0));
        let per = k.len().checked_div(layers.len()).unwrap_or(0);
        if d == 0 || per == 0 {
            return;
        }
        debug_assert_eq!(k.len(), v.len(), "K and V alike");
        for (i, l) in layers.enumerate() {
            let (k, v) = (&k[i * per..(i + 1) * per], &v[i * per..(i + 1) * per]);
            for r in runs {
                let rows = r.row0 * d..(r.row0 + r.n) * d;
                self.write_run(r.seq, l, r.pos0, &k[rows.clone()], &v[rows]);
            }
        }
    }
    /// Blocks covering positions `0..len(seq)` of `layer`.
    fn view(&self, seq: SeqId, layer: usize) -> KvView<'_>;
    /// Writes the auxiliary row of `seq` at `pos` in `layer`.
    fn write_aux(&mut self, seq: SeqId, layer: usize, pos: usize, row: &[f32]);
    /// Blocks covering the auxiliary rows of positions `0..len(seq)` of `layer`.
    fn aux_view(&self, seq: SeqId, layer: usize) -> RowView<'_>;
    /// The blocks holding positions `0..len(seq)` as a device mirror tracks
    /// them (see [`KvBlocks`]).
    fn blocks(&self, seq: SeqId) -> KvBlocks;
    /// Block `block` of `seq` in `layer`, for a device mirror to upload.
    fn block_rows(&self, seq: SeqId, block: usize, layer: usize) -> BlockRows<'_>;
}

/// `kv_dim` as a view shows it (blocks of `(block_len, kv_dim)`; 0 for a
/// view without blocks).
fn view_kv_dim(view: &KvView<'_>) -> usize {
    view.k
        .first()
        .and_then(|b| b.len().checked_div(view.block_len))
        .unwrap_or(0)
}

/// Rows of `d` floats in a run's `k` (and `v`, which must match): 0 when
/// `d` is 0.
pub(crate) fn run_rows(k: &[f32], v: &[f32], d: usize) -> usize {
    let n = k.len().checked_div(d).unwrap_or(0);
    debug_assert_eq!(
        (k.len(), v.len()),
        (n * d, n * d),
        "whole rows, K and V alike"
    );
    n
}

/// One run of a step's stacked rows ([`KvCache::write_step`]): rows
/// `row0..row0 + n` of each layer go to positions `pos0..pos0 + n` of `seq`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvRun {
    pub seq: SeqId,
    pub pos0: usize,
    pub row0: usize,
    pub n: usize,
}

/// Floats (K and V, all layers) below which [`KvCache::write_step`] copies
/// on the calling thread: starting a parallel region (waking parked
/// workers) and joining it costs 5-30 microseconds, about what one thread
/// takes to copy this many floats into a pool. Measured (`PagedKv`, 30
/// layers of 192 floats, decode steps of 1-512 sequences, workers parked):
/// on the H200 host 2 threads pay from 12-16 sequences (138k-184k floats),
/// 4-16 threads from 8-12 (92k-138k); on the 2-core development machine
/// 2 threads from 24-48.
pub const STEP_PARALLEL_FLOATS: usize = 1 << 17;

/// One contiguous copy of a step's write: `len` floats from offset `src` of
/// a layer's stacked rows to offset `dst` of destination buffer `buf` of
/// that layer (the same offsets in every layer, K and V alike).
#[derive(Debug, Clone, Copy)]
pub(crate) struct StepPiece {
    pub buf: usize,
    pub src: usize,
    pub dst: usize,
    pub len: usize,
}

/// Copies `pieces` in every layer: `dst[2l]` are layer `l`'s K buffers and
/// `dst[2l + 1]` its V buffers (indexed by [`StepPiece::buf`]), `k` and `v`
/// hold `per` floats per layer. Each (layer, K or V) is one task and runs
/// its pieces in order, so of two pieces writing one place the later one
/// stays, whatever the thread count; tasks touch disjoint buffers, so the
/// result is the same on any number of threads.
pub(crate) fn copy_step(
    dst: Vec<Vec<&mut [f32]>>,
    k: &[f32],
    v: &[f32],
    per: usize,
    pieces: &[StepPiece],
    threads: &Threads,
) {
    let task = |t: usize, bufs: &mut [&mut [f32]]| {
        let src = if t.is_multiple_of(2) { k } else { v };
        let src = &src[t / 2 * per..(t / 2 + 1) * per];
        for p in pieces {
            bufs[p.buf][p.dst..p.dst + p.len].copy_from_slice(&src[p.src..p.src + p.len]);
        }
    };
    let floats = dst.len() * pieces.iter().map(|p| p.len).sum::<usize>();
    if threads.count() == 1 || floats < STEP_PARALLEL_FLOATS {
        for (t, mut bufs) in dst.into_iter().enumerate() {
            task(t, &mut bufs);
        }
        return;
    }
    // One lock per task, taken once by the thread that runs it: the safe
    // way to hand each task its own `&mut` buffers through a `Fn` closure.
    let cells: Vec<Mutex<Vec<&mut [f32]>>> = dst.into_iter().map(Mutex::new).collect();
    threads.for_ranges(cells.len(), 1, |ts| {
        for t in ts {
            let mut bufs = cells[t].lock().unwrap_or_else(PoisonError::into_inner);
            task(t, &mut bufs);
        }
    });
}

/// A sequence's storage as a device mirror sees it: blocks of `block_len`
/// positions covering `0..len`, each `(key, version)`. The key names the
/// block's storage for as long as it lives (a page id, a sequence's block);
/// the version is taken from one process-wide clock ([`next_version`]) at
/// each write to any row of the block, so two blocks never share a version
/// and a version never returns: a mirror that holds a block at version `v`
/// holds exactly the host's rows whenever the host's version is still `v`.
/// Version 0: never written (nothing in it is read before it is written).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KvBlocks {
    pub block_len: usize,
    pub blocks: Vec<(u64, u64)>,
}

/// One block's rows in one layer: K, V and auxiliary rows of up to
/// `block_len` positions (fewer where the store's buffer ends).
#[derive(Debug, Clone, Copy)]
pub struct BlockRows<'a> {
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub aux: &'a [f32],
}

static CLOCK: AtomicU64 = AtomicU64::new(1);

/// A fresh write version (see [`KvBlocks`]); also hands out store ids.
pub fn next_version() -> u64 {
    CLOCK.fetch_add(1, Ordering::Relaxed)
}

/// Positions per mirror block of a [`SeqKvStore`].
pub const SEQ_BLOCK: usize = 64;

/// Rows of one sequence in one layer: block `b` holds positions
/// `[b·block_len, (b+1)·block_len)`, each a row of `width` floats.
#[derive(Debug, Clone)]
pub struct RowView<'a> {
    pub block_len: usize,
    pub width: usize,
    pub blocks: Vec<&'a [f32]>,
}

impl RowView<'_> {
    /// The row of position `pos`.
    pub fn row(&self, pos: usize) -> &[f32] {
        let b = self.blocks[pos / self.block_len];
        let off = (pos % self.block_len) * self.width;
        &b[off..off + self.width]
    }
}

/// One contiguous, growable buffer per (sequence, layer).
///
/// A removed sequence's buffers are kept for the next new sequence
/// ([`SeqKvStore::remove`]): a store that serves one sequence after another
/// allocates and zero-fills its memory once (a 512-token prompt of the
/// `small` preset is 23.6 MB of K/V: its `prepare` + `write_step` took
/// 1.9-2.4 ms in a fresh store on a 2-core host, 3.6 ms the first time in
/// the process, 1.0-1.1 ms in a removed sequence's buffers; `lmrr bench`).
/// Rows past a sequence's length are never read
/// as its rows: a recycled buffer's old rows there are as inert as the
/// zeros of a fresh one. On the device the kept buffers keep their mirror
/// pages: a block's key and version still name rows the device holds.
#[derive(Debug)]
pub struct SeqKvStore {
    layers: usize,
    kv_dim: usize,
    aux_dim: usize,
    seqs: HashMap<SeqId, SeqKv>,
    /// Buffers of removed sequences, for new ones.
    spare: Vec<SeqKv>,
}

#[derive(Debug, Default)]
struct SeqKv {
    /// Process-unique id of this sequence's storage (mirror keys).
    uid: u64,
    /// Per [`SEQ_BLOCK`] positions, the version of its last write.
    versions: Vec<u64>,
    len: usize,
    cap: usize,
    /// Per layer, `(cap, kv_dim)`.
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    /// Per layer, `(cap, aux_dim)`.
    aux: Vec<Vec<f32>>,
}

impl SeqKvStore {
    pub fn new(layout: KvLayout) -> Self {
        Self {
            layers: layout.layers,
            kv_dim: layout.kv_dim,
            aux_dim: layout.aux_dim,
            seqs: HashMap::new(),
            spare: Vec::new(),
        }
    }

    /// Drops a sequence's KV. Its buffers are kept for a sequence this
    /// store has not seen, with their storage uid and block versions (the
    /// keys and versions name the buffers' rows, which are unchanged, as a
    /// serving pool's page ids and versions do a freed page's);
    /// [`SeqKvStore::trim`] frees them.
    pub fn remove(&mut self, seq: SeqId) {
        if let Some(s) = self.seqs.remove(&seq) {
            if s.cap > 0 {
                self.spare.push(s);
            }
        }
    }

    /// Frees the buffers kept from removed sequences.
    pub fn trim(&mut self) {
        self.spare = Vec::new();
    }

    /// Bytes held, kept buffers included.
    pub fn bytes(&self) -> usize {
        self.seqs
            .values()
            .chain(&self.spare)
            .map(|s| s.cap * (self.kv_dim * 2 + self.aux_dim) * 4 * self.layers)
            .sum()
    }
}

impl KvCache for SeqKvStore {
    fn len(&self, seq: SeqId) -> usize {
        self.seqs.get(&seq).map_or(0, |s| s.len)
    }

    fn prepare(&mut self, seq: SeqId, start: usize, n: usize) -> Result<(), EngineError> {
        let (layers, kv_dim, aux_dim) = (self.layers, self.kv_dim, self.aux_dim);
        let spare = &mut self.spare;
        let s = self.seqs.entry(seq).or_insert_with(|| match spare.pop() {
            // The buffers keep their uid and block versions: their rows
            // are what they were, so a device page that matched them
            // still does (a prepared block not yet written holds the old
            // rows on both sides), and a prefill into them uploads nothing.
            Some(old) => SeqKv { len: 0, ..old },
            None => SeqKv {
                uid: next_version(),
                k: vec![Vec::new(); layers],
                v: vec![Vec::new(); layers],
                aux: vec![Vec::new(); layers],
                ..Default::default()
            },
        });
        if start != s.len {
            return Err(EngineError::KvPosition {
                seq,
                start,
                held: s.len,
            });
        }
        let need = start + n;
        if need > s.cap {
            let cap = need.max(s.cap * 2).max(16);
            for buf in s.k.iter_mut().chain(s.v.iter_mut()) {
                buf.resize(cap * kv_dim, 0.0);
            }
            for buf in s.aux.iter_mut() {
                buf.resize(cap * aux_dim, 0.0);
            }
            s.cap = cap;
        }
        s.len = need;
        s.versions.resize(need.div_ceil(SEQ_BLOCK), 0);
        Ok(())
    }

    fn write(&mut self, seq: SeqId, layer: usize, pos: usize, k: &[f32], v: &[f32]) {
        let d = self.kv_dim;
        let s = self.seqs.get_mut(&seq).expect("write after prepare");
        s.k[layer][pos * d..(pos + 1) * d].copy_from_slice(k);
        s.v[layer][pos * d..(pos + 1) * d].copy_from_slice(v);
        s.versions[pos / SEQ_BLOCK] = next_version();
    }

    /// One lookup, one copy of the run's K rows and one of its V rows (a
    /// sequence's layer is one buffer), one version per touched block.
    fn write_run(&mut self, seq: SeqId, layer: usize, pos0: usize, k: &[f32], v: &[f32]) {
        let d = self.kv_dim;
        let n = run_rows(k, v, d);
        if n == 0 {
            return;
        }
        let s = self.seqs.get_mut(&seq).expect("write after prepare");
        let (a, b) = (pos0 * d, (pos0 + n) * d);
        s.k[layer][a..b].copy_from_slice(&k[..n * d]);
        s.v[layer][a..b].copy_from_slice(&v[..n * d]);
        for ver in &mut s.versions[pos0 / SEQ_BLOCK..(pos0 + n).div_ceil(SEQ_BLOCK)] {
            *ver = next_version();
        }
    }

    /// One copy per run and layer (K and V), the layers spread over
    /// `threads` (`copy_step`); then, on the calling thread, one version
    /// per touched block.
    fn write_layers(
        &mut self,
        runs: &[KvRun],
        layers: std::ops::Range<usize>,
        k: &[f32],
        v: &[f32],
        threads: &Threads,
    ) {
        let d = self.kv_dim;
        let per = k.len().checked_div(layers.len()).unwrap_or(0);
        if per == 0 || d == 0 {
            return;
        }
        debug_assert_eq!(k.len(), v.len(), "K and V alike");
        debug_assert!(
            layers.end <= self.layers,
            "layers {layers:?} of {}",
            self.layers
        );
        // The touched sequences, numbered in order of first appearance.
        let mut at: HashMap<SeqId, usize> = HashMap::new();
        let mut pieces = Vec::with_capacity(runs.len());
        for r in runs.iter().filter(|r| r.n > 0) {
            let next = at.len();
            let buf = *at.entry(r.seq).or_insert(next);
            pieces.push(StepPiece {
                buf,
                src: r.row0 * d,
                dst: r.pos0 * d,
                len: r.n * d,
            });
        }
        // Per (layer, K or V) the touched sequences' buffers, by number.
        let mut dst: Vec<Vec<Option<&mut [f32]>>> = (0..2 * layers.len())
            .map(|_| (0..at.len()).map(|_| None).collect())
            .collect();
        let mut versions: Vec<Option<&mut Vec<u64>>> = (0..at.len()).map(|_| None).collect();
        for (seq, s) in self.seqs.iter_mut() {
            let Some(&i) = at.get(seq) else {
                continue;
            };
            let SeqKv {
                k: sk,
                v: sv,
                versions: sver,
                ..
            } = s;
            let mine = sk.iter_mut().zip(sv.iter_mut());
            for (l, (bk, bv)) in mine.skip(layers.start).take(layers.len()).enumerate() {
                dst[2 * l][i] = Some(bk);
                dst[2 * l + 1][i] = Some(bv);
            }
            versions[i] = Some(sver);
        }
        let dst = dst
            .into_iter()
            .map(|bufs| {
                bufs.into_iter()
                    .map(|b| b.expect("write after prepare"))
                    .collect()
            })
            .collect();
        copy_step(dst, k, &v[..k.len()], per, &pieces, threads);
        let mut touched: Vec<(usize, usize)> = pieces
            .iter()
            .flat_map(|p| {
                let (a, b) = (p.dst / d, (p.dst + p.len) / d);
                (a / SEQ_BLOCK..b.div_ceil(SEQ_BLOCK)).map(move |blk| (p.buf, blk))
            })
            .collect();
        touched.sort_unstable();
        touched.dedup();
        for (i, blk) in touched {
            if let Some(ver) = versions[i].as_mut() {
                ver[blk] = next_version();
            }
        }
    }

    fn view(&self, seq: SeqId, layer: usize) -> KvView<'_> {
        match self.seqs.get(&seq) {
            Some(s) if s.cap > 0 => KvView {
                block_len: s.cap,
                k: vec![&s.k[layer]],
                v: vec![&s.v[layer]],
            },
            _ => KvView {
                block_len: 1,
                k: Vec::new(),
                v: Vec::new(),
            },
        }
    }

    fn write_aux(&mut self, seq: SeqId, layer: usize, pos: usize, row: &[f32]) {
        let d = self.aux_dim;
        let s = self.seqs.get_mut(&seq).expect("write after prepare");
        s.aux[layer][pos * d..(pos + 1) * d].copy_from_slice(row);
        s.versions[pos / SEQ_BLOCK] = next_version();
    }

    fn aux_view(&self, seq: SeqId, layer: usize) -> RowView<'_> {
        match self.seqs.get(&seq) {
            Some(s) if s.cap > 0 => RowView {
                block_len: s.cap,
                width: self.aux_dim,
                blocks: vec![&s.aux[layer]],
            },
            _ => RowView {
                block_len: 1,
                width: self.aux_dim,
                blocks: Vec::new(),
            },
        }
    }

    fn blocks(&self, seq: SeqId) -> KvBlocks {
        let Some(s) = self.seqs.get(&seq) else {
            return KvBlocks {
                block_len: SEQ_BLOCK,
                blocks: Vec::new(),
            };
        };
        KvBlocks {
            block_len: SEQ_BLOCK,
            blocks: s
                .versions
                .iter()
                .enumerate()
                .map(|(b, &v)| ((s.uid << 24) | b as u64, v))
                .collect(),
        }
    }

    fn block_rows(&self, seq: SeqId, block: usize, layer: usize) -> BlockRows<'_> {
        fn rows(buf: &[f32], w: usize, block: usize) -> &[f32] {
            let a = (block * SEQ_BLOCK * w).min(buf.len());
            let b = ((block + 1) * SEQ_BLOCK * w).min(buf.len());
            &buf[a..b]
        }
        match self.seqs.get(&seq) {
            Some(s) => BlockRows {
                k: rows(&s.k[layer], self.kv_dim, block),
                v: rows(&s.v[layer], self.kv_dim, block),
                aux: rows(&s.aux[layer], self.aux_dim, block),
            },
            None => BlockRows {
                k: &[],
                v: &[],
                aux: &[],
            },
        }
    }
}
