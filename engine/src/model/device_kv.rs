//! The device mirror of a [`KvCache`] (feature `cuda`): the paged KV pool's
//! pages, resident in device memory, so that a step attends over device pages
//! and a radix-cache hit reuses the pages already there.
//!
//! The host store stays the source of truth (its slot digests, page hashes
//! and cache-state hashes are computed from its rows, as on the CPU). The
//! mirror holds, per block key ([`KvBlocks`]), a device page and the write
//! version its contents match. Before a step, every block the step reads is
//! checked: a block whose host version moved (written by someone else, freed
//! and reused, or never seen) is uploaded whole; the others are used as they
//! are. The step's kernels write the new rows into the device pages, the rows
//! come back and are written into the host store, and the mirror records the
//! versions those writes produced. No row is ever compared: versions are
//! process-unique, so equal versions mean equal contents.
//!
//! Device pages live in segments of [`SEGMENT_PAGES`] that never move (a
//! page's address is stable, as captured graphs need). When the device has
//! less than [`RESERVE_BYTES`] to spare, the least recently used pages that
//! the current step does not read are evicted (and uploaded again if a later
//! step wants them); when every page is in use, the step fails with the
//! bytes needed and free, never a hang or an abort.

// Without the `cuda` feature only the tests use the mirror.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use std::collections::HashMap;

use lmrr_kernels::paged::PageLayout;

use crate::kv::{KvCache, SeqId};
use crate::EngineError;

/// Where the mirror's pages live: device memory on the CUDA path (the
/// [`lmrr_kernels::cuda::Gpu`] impl), host memory in tests.
pub(crate) trait PageMemory {
    type Buf;
    /// `bytes` for `what`; out of memory is an error with the sizes.
    fn alloc(&self, bytes: usize, what: &str) -> Result<Self::Buf, EngineError>;
    /// Address of byte 0 of `buf`.
    fn addr(buf: &Self::Buf) -> u64;
    /// Bytes still free for more pages.
    fn free_bytes(&self) -> Result<usize, EngineError>;
    /// Copies `rows` to address `dst`.
    fn upload(&self, rows: &[f32], dst: u64) -> Result<(), EngineError>;
}

#[cfg(feature = "cuda")]
impl PageMemory for lmrr_kernels::cuda::Gpu {
    type Buf = lmrr_kernels::cuda::resident::DevBuf;
    fn alloc(&self, bytes: usize, what: &str) -> Result<Self::Buf, EngineError> {
        lmrr_kernels::cuda::Gpu::alloc(self, bytes, what).map_err(crate::model::gpu_err)
    }
    fn addr(buf: &Self::Buf) -> u64 {
        buf.ptr()
    }
    fn free_bytes(&self) -> Result<usize, EngineError> {
        self.mem_info().map(|m| m.0).map_err(crate::model::gpu_err)
    }
    fn upload(&self, rows: &[f32], dst: u64) -> Result<(), EngineError> {
        self.htod(rows, dst).map_err(crate::model::gpu_err)
    }
}

/// Device pages per allocation.
pub const SEGMENT_PAGES: usize = 32;
/// Device memory the mirror leaves to weights' neighbours (activations,
/// graphs, the driver) before it evicts instead of growing.
pub const RESERVE_BYTES: usize = 1 << 30;

struct Entry {
    slot: usize,
    version: u64,
    used: u64,
}

/// Device copies of a store's blocks.
pub(crate) struct KvMirror<M: PageMemory> {
    layout: PageLayout,
    segments: Vec<M::Buf>,
    free: Vec<usize>,
    map: HashMap<u64, Entry>,
    tick: u64,
    staging: Vec<f32>,
    /// Where a row goes that a later token of the same step overwrites (only
    /// under cache-corruption patches): the last writer wins, as on the host.
    sink: M::Buf,
    /// Pages uploaded since creation (for `lmrr bench`).
    pub uploads: u64,
}

impl<M: PageMemory> KvMirror<M> {
    pub(crate) fn new(mem: &M, layout: PageLayout) -> Result<Self, EngineError> {
        let sink = mem.alloc(layout.page_floats() * 4, "the KV sink page")?;
        Ok(Self {
            layout,
            segments: Vec::new(),
            free: Vec::new(),
            map: HashMap::new(),
            tick: 0,
            staging: Vec::new(),
            sink,
            uploads: 0,
        })
    }

    pub(crate) fn layout(&self) -> PageLayout {
        self.layout
    }

    /// Address of the sink page.
    pub(crate) fn sink(&self) -> u64 {
        M::addr(&self.sink)
    }

    /// Device pages held.
    pub(crate) fn pages(&self) -> usize {
        self.map.len()
    }

    fn page_bytes(&self) -> usize {
        self.layout.page_floats() * 4
    }

    fn slot_ptr(&self, slot: usize) -> u64 {
        let seg = &self.segments[slot / SEGMENT_PAGES];
        M::addr(seg) + ((slot % SEGMENT_PAGES) * self.page_bytes()) as u64
    }

    /// Starts a step: pages touched from now on are not evicted in it.
    pub(crate) fn begin_step(&mut self) {
        self.tick += 1;
    }

    fn take_slot(&mut self, mem: &M) -> Result<usize, EngineError> {
        if let Some(s) = self.free.pop() {
            return Ok(s);
        }
        let seg_bytes = SEGMENT_PAGES * self.page_bytes();
        let free = mem.free_bytes()?;
        if free >= seg_bytes + RESERVE_BYTES {
            let what = format!(
                "KV pages {}..{} ({} positions × {} layers each)",
                self.segments.len() * SEGMENT_PAGES,
                (self.segments.len() + 1) * SEGMENT_PAGES,
                self.layout.page_len,
                self.layout.layers
            );
            let seg = mem.alloc(seg_bytes, &what)?;
            let base = self.segments.len() * SEGMENT_PAGES;
            self.segments.push(seg);
            self.free.extend((base..base + SEGMENT_PAGES).rev());
            return self
                .free
                .pop()
                .ok_or(EngineError::Device("no KV slot".into()));
        }
        // Evict the older half of the pages this step does not read.
        let mut idle: Vec<(u64, u64)> = self
            .map
            .iter()
            .filter(|(_, e)| e.used < self.tick)
            .map(|(&k, e)| (e.used, k))
            .collect();
        if idle.is_empty() {
            return Err(EngineError::Device(format!(
                "out of device memory for KV pages: this step reads all {} held ({} bytes each) and needs {seg_bytes} bytes more; {free} bytes free on the device, {RESERVE_BYTES} kept in reserve",
                self.map.len(),
                self.page_bytes()
            )));
        }
        idle.sort_unstable();
        for &(_, k) in &idle[..idle.len().div_ceil(2)] {
            if let Some(e) = self.map.remove(&k) {
                self.free.push(e.slot);
            }
        }
        self.free
            .pop()
            .ok_or(EngineError::Device("no KV slot".into()))
    }

    /// Makes every block of `seq` current on the device; returns their page
    /// addresses in position order.
    pub(crate) fn sync_seq(
        &mut self,
        mem: &M,
        kv: &dyn KvCache,
        seq: SeqId,
    ) -> Result<Vec<u64>, EngineError> {
        let blocks = kv.blocks(seq);
        let mut out = Vec::with_capacity(blocks.blocks.len());
        for (b, &(key, version)) in blocks.blocks.iter().enumerate() {
            let tick = self.tick;
            let have = self.map.get_mut(&key).map(|e| {
                e.used = tick;
                (e.slot, e.version)
            });
            let slot = match have {
                Some((slot, v)) if v == version => slot,
                Some((slot, _)) => {
                    self.upload(mem, kv, seq, b, slot)?;
                    slot
                }
                None => {
                    let slot = self.take_slot(mem)?;
                    if version != 0 {
                        self.upload(mem, kv, seq, b, slot)?;
                    }
                    slot
                }
            };
            self.map.insert(
                key,
                Entry {
                    slot,
                    version,
                    used: tick,
                },
            );
            out.push(self.slot_ptr(slot));
        }
        Ok(out)
    }

    fn upload(
        &mut self,
        mem: &M,
        kv: &dyn KvCache,
        seq: SeqId,
        block: usize,
        slot: usize,
    ) -> Result<(), EngineError> {
        let PageLayout {
            page_len,
            layers,
            kv_dim,
            aux_dim,
        } = self.layout;
        let lf = self.layout.layer_floats();
        self.staging.clear();
        self.staging.resize(layers * lf, 0.0);
        for l in 0..layers {
            let r = kv.block_rows(seq, block, l);
            let base = l * lf;
            let put = |dst: &mut [f32], src: &[f32]| {
                let n = src.len().min(dst.len());
                dst[..n].copy_from_slice(&src[..n]);
            };
            put(&mut self.staging[base..base + page_len * kv_dim], r.k);
            put(
                &mut self.staging[base + page_len * kv_dim..base + 2 * page_len * kv_dim],
                r.v,
            );
            put(
                &mut self.staging[base + 2 * page_len * kv_dim..base + lf],
                r.aux,
            );
            debug_assert!(aux_dim > 0 || r.aux.is_empty());
        }
        mem.upload(&self.staging, self.slot_ptr(slot))?;
        self.uploads += 1;
        Ok(())
    }

    /// After the step's rows are in the host store: the device pages of
    /// `seq` hold what the host's now do.
    pub(crate) fn mark_written(&mut self, kv: &dyn KvCache, seq: SeqId) {
        for (key, version) in kv.blocks(seq).blocks {
            if let Some(e) = self.map.get_mut(&key) {
                e.version = version;
            }
        }
    }

    /// Forgets every page (after a failed step, whose device writes may not
    /// have reached the host).
    pub(crate) fn clear(&mut self) {
        for (_, e) in self.map.drain() {
            self.free.push(e.slot);
        }
    }
}

/// Packs a resident step's inputs into `out` (one upload) and returns where
/// the page addresses start: per stacked token `i` (n of them), its token id
/// at `i`, position at `n + i`, the offset of its sequence's page list at
/// `2n + i`, the page address its K/V rows go to at `3n + i` and the slot in
/// that page at `4n + i`; the wanted rows at `5n ..`; then every sequence's
/// page addresses (`span_pages`, in span order; `span_off[s]` is span s's
/// first). A slot that two tokens of the step write (only under a
/// cache-corruption patch) keeps the last token's rows, as on the host: the
/// earlier token writes to `sink` instead.
#[allow(clippy::too_many_arguments)]
pub(crate) fn pack_inputs(
    out: &mut Vec<u64>,
    spans: &[crate::model::SeqSpan],
    tok: &[(usize, usize)],
    rows: &[usize],
    span_off: &[usize],
    pages: &[u64],
    block_len: usize,
    sink: u64,
) -> usize {
    let n = tok.len();
    out.clear();
    out.extend(
        spans
            .iter()
            .flat_map(|s| s.tokens.iter().map(|&t| t as u64)),
    );
    out.extend(tok.iter().map(|&(_, p)| p as u64));
    out.extend(tok.iter().map(|&(si, _)| span_off[si] as u64));
    let dst: Vec<(u64, u64)> = tok
        .iter()
        .map(|&(si, p)| (pages[span_off[si] + p / block_len], (p % block_len) as u64))
        .collect();
    let mut seen = std::collections::HashSet::new();
    let mut dst_ptr = vec![0u64; n];
    for (i, &(page, slot)) in dst.iter().enumerate().rev() {
        dst_ptr[i] = if seen.insert((page, slot)) {
            page
        } else {
            sink
        };
    }
    out.extend(&dst_ptr);
    out.extend(dst.iter().map(|&(_, s)| s));
    out.extend(rows.iter().map(|&r| r as u64));
    let fixed = out.len();
    out.extend(pages);
    fixed
}

#[cfg(test)]
mod tests {
    use std::cell::{Cell, RefCell};

    use super::*;
    use crate::kv::SeqKvStore;
    use crate::model::KvLayout;
    use crate::pool::{BlockTable, PagePool, PagedKv};

    /// Host memory posing as the device: buffer `i` at address `(i+1) << 32`;
    /// every upload is kept, and `free` says what the "device" has left.
    #[derive(Default)]
    struct HostPages {
        bufs: RefCell<Vec<Vec<f32>>>,
        uploads: RefCell<Vec<u64>>,
        free: Cell<usize>,
    }

    impl HostPages {
        fn new() -> Self {
            let h = Self::default();
            h.free.set(usize::MAX / 2);
            h
        }
        fn read(&self, addr: u64, n: usize) -> Vec<f32> {
            let b = self.bufs.borrow();
            let (i, off) = ((addr >> 32) as usize - 1, (addr & 0xffff_ffff) as usize / 4);
            b[i][off..off + n].to_vec()
        }
    }

    impl PageMemory for HostPages {
        type Buf = u64;
        fn alloc(&self, bytes: usize, _what: &str) -> Result<u64, EngineError> {
            let mut b = self.bufs.borrow_mut();
            b.push(vec![f32::NAN; bytes / 4]);
            Ok((b.len() as u64) << 32)
        }
        fn addr(buf: &u64) -> u64 {
            *buf
        }
        fn free_bytes(&self) -> Result<usize, EngineError> {
            Ok(self.free.get())
        }
        fn upload(&self, rows: &[f32], dst: u64) -> Result<(), EngineError> {
            let mut b = self.bufs.borrow_mut();
            let (i, off) = ((dst >> 32) as usize - 1, (dst & 0xffff_ffff) as usize / 4);
            b[i][off..off + rows.len()].copy_from_slice(rows);
            self.uploads.borrow_mut().push(dst);
            Ok(())
        }
    }

    const KV: KvLayout = KvLayout {
        layers: 2,
        kv_dim: 3,
        aux_dim: 0,
    };

    fn layout(page_len: usize) -> PageLayout {
        PageLayout {
            page_len,
            layers: KV.layers,
            kv_dim: KV.kv_dim,
            aux_dim: 0,
        }
    }

    fn fill(kv: &mut dyn KvCache, seq: SeqId, from: usize, to: usize) {
        for p in from..to {
            for l in 0..KV.layers {
                let x = (seq * 1000 + p as u64 * 10 + l as u64) as f32;
                kv.write(seq, l, p, &[x, x + 0.25, -x], &[-x, x * 2.0, 1.0]);
            }
        }
    }

    #[test]
    fn step_inputs_are_laid_out_as_the_kernels_read_them() {
        use crate::model::{LogitsWanted, SeqSpan};
        // Span 0: sequence 4 prefills 3 tokens at 5..8 (pages of 4: its pages
        // 100, 101); span 1: sequence 9 decodes at 2 (page 200).
        let (t0, t1) = ([11u32, 12, 13], [21u32]);
        let spans = [
            SeqSpan {
                seq: 4,
                start: 5,
                tokens: &t0,
                logits: LogitsWanted::All,
            },
            SeqSpan {
                seq: 9,
                start: 2,
                tokens: &t1,
                logits: LogitsWanted::Last,
            },
        ];
        let tok = [(0, 5), (0, 6), (0, 7), (1, 2)];
        let rows = [0, 1, 2, 3];
        let pages = [100, 101, 200];
        let mut out = Vec::new();
        let fixed = pack_inputs(&mut out, &spans, &tok, &rows, &[0, 2], &pages, 4, 999);
        let n = 4;
        assert_eq!(&out[..n], &[11, 12, 13, 21]);
        assert_eq!(&out[n..2 * n], &[5, 6, 7, 2]);
        assert_eq!(&out[2 * n..3 * n], &[0, 0, 0, 2]);
        assert_eq!(&out[3 * n..4 * n], &[101, 101, 101, 200]);
        assert_eq!(&out[4 * n..5 * n], &[1, 2, 3, 2]);
        assert_eq!(&out[5 * n..fixed], &[0, 1, 2, 3]);
        assert_eq!(&out[fixed..], &pages);
        // Two tokens writing one slot (sequence 9 pointed at sequence 4's
        // page by a corrupted table): the earlier one goes to the sink.
        let pages = [100, 101, 101];
        pack_inputs(
            &mut out,
            &spans,
            &[(0, 5), (0, 6), (0, 7), (1, 3)],
            &rows,
            &[0, 2],
            &pages,
            4,
            999,
        );
        assert_eq!(&out[3 * n..4 * n], &[101, 101, 999, 101]);
    }

    #[test]
    fn stale_blocks_are_uploaded_once_and_land_where_the_kernels_read() {
        let mem = HostPages::new();
        let mut kv = SeqKvStore::new(KV);
        kv.prepare(3, 0, 100).unwrap();
        fill(&mut kv, 3, 0, 100);
        let mut m = KvMirror::new(&mem, layout(crate::kv::SEQ_BLOCK)).unwrap();
        m.begin_step();
        let pages = m.sync_seq(&mem, &kv, 3).unwrap();
        assert_eq!(pages.len(), 2);
        assert_eq!(
            mem.uploads.borrow().len(),
            2,
            "both blocks were written on the host"
        );
        // Page layout (kernels/cuda/common.cuh kv_row): layer l at l·page_len·(2·kv_dim),
        // K rows, then V rows; position 70 is block 1, slot 6.
        let (pl, kvd) = (crate::kv::SEQ_BLOCK, KV.kv_dim);
        let k = mem.read(pages[1] + 4 * (pl * 2 * kvd + 6 * kvd) as u64, kvd);
        let v = mem.read(
            pages[1] + 4 * (pl * 2 * kvd + pl * kvd + 6 * kvd) as u64,
            kvd,
        );
        let x = (3 * 1000 + 70 * 10 + 1) as f32;
        assert_eq!(k, vec![x, x + 0.25, -x]);
        assert_eq!(v, vec![-x, x * 2.0, 1.0]);
        // Nothing moved: nothing is uploaded again.
        m.begin_step();
        assert_eq!(m.sync_seq(&mem, &kv, 3).unwrap(), pages);
        assert_eq!(mem.uploads.borrow().len(), 2);
        // A host write the device did not make: that block only, again.
        kv.write(3, 0, 99, &[7.0; 3], &[8.0; 3]);
        m.begin_step();
        m.sync_seq(&mem, &kv, 3).unwrap();
        assert_eq!(mem.uploads.borrow().len(), 3);
        assert_eq!(mem.uploads.borrow()[2], pages[1]);
        // Rows the device wrote itself and the host then stored: recorded,
        // not uploaded.
        kv.prepare(3, 100, 1).unwrap();
        m.begin_step();
        m.sync_seq(&mem, &kv, 3).unwrap();
        fill(&mut kv, 3, 100, 101);
        m.mark_written(&kv, 3);
        m.begin_step();
        m.sync_seq(&mem, &kv, 3).unwrap();
        assert_eq!(mem.uploads.borrow().len(), 3);
        // After a failed step everything is fetched again.
        m.clear();
        m.begin_step();
        m.sync_seq(&mem, &kv, 3).unwrap();
        assert_eq!(mem.uploads.borrow().len(), 5);
    }

    #[test]
    fn a_new_sequence_in_a_removed_ones_buffers_keeps_its_device_pages() {
        let mem = HostPages::new();
        let mut kv = SeqKvStore::new(KV);
        kv.prepare(3, 0, 100).unwrap();
        fill(&mut kv, 3, 0, 100);
        let mut m = KvMirror::new(&mem, layout(crate::kv::SEQ_BLOCK)).unwrap();
        m.begin_step();
        let pages = m.sync_seq(&mem, &kv, 3).unwrap();
        assert_eq!(mem.uploads.borrow().len(), 2);
        // Sequence 5 takes sequence 3's buffers: the same device pages,
        // nothing uploaded, no page added (its rows are the old ones on
        // both sides until it writes).
        kv.remove(3);
        kv.prepare(5, 0, 90).unwrap();
        m.begin_step();
        assert_eq!(m.sync_seq(&mem, &kv, 5).unwrap(), pages);
        assert_eq!(mem.uploads.borrow().len(), 2);
        assert_eq!(m.pages(), 2);
        // Its own rows, as a step leaves them (device first, then the
        // host's store and mark_written): still nothing uploaded, and the
        // host's rows are sequence 5's.
        fill(&mut kv, 5, 0, 90);
        m.mark_written(&kv, 5);
        m.begin_step();
        assert_eq!(m.sync_seq(&mem, &kv, 5).unwrap(), pages);
        assert_eq!(mem.uploads.borrow().len(), 2);
        let x = (5 * 1000 + 70 * 10 + 1) as f32;
        assert_eq!(&kv.block_rows(5, 1, 1).k[6 * 3..7 * 3], &[x, x + 0.25, -x]);
        // A host write the mirror did not see is uploaded, as for any store.
        kv.write(5, 0, 3, &[7.0; 3], &[8.0; 3]);
        m.begin_step();
        m.sync_seq(&mem, &kv, 5).unwrap();
        assert_eq!(mem.uploads.borrow().len(), 3);
    }

    #[test]
    fn a_prefix_cache_hit_reuses_the_device_page() {
        let mem = HostPages::new();
        let pool = PagePool::new(4, 16, KV).unwrap();
        let mut kv = PagedKv::new(pool);
        let (p0, p1, p2) = (
            kv.pool.alloc().unwrap().unwrap(),
            kv.pool.alloc().unwrap().unwrap(),
            kv.pool.alloc().unwrap().unwrap(),
        );
        kv.tables.insert(
            1,
            BlockTable {
                pages: vec![p0, p1],
                len: 0,
            },
        );
        kv.prepare(1, 0, 8).unwrap();
        fill(&mut kv, 1, 0, 8);
        let mut m = KvMirror::new(&mem, layout(4)).unwrap();
        m.begin_step();
        let a = m.sync_seq(&mem, &kv, 1).unwrap();
        assert_eq!(mem.uploads.borrow().len(), 2);
        // Sequence 2 shares page p0 (its first 4 positions) and grows into p2.
        kv.pool.incref(p0);
        kv.tables.insert(
            2,
            BlockTable {
                pages: vec![p0, p2],
                len: 4,
            },
        );
        kv.prepare(2, 4, 1).unwrap();
        m.begin_step();
        let b = m.sync_seq(&mem, &kv, 2).unwrap();
        assert_eq!(b[0], a[0], "the shared page is the same device page");
        assert_ne!(b[1], a[1]);
        assert_eq!(
            mem.uploads.borrow().len(),
            2,
            "p0 is current and p2 was never written: no upload"
        );
    }

    #[test]
    fn idle_pages_are_evicted_when_the_device_is_full_and_a_full_step_is_an_error() {
        let mem = HostPages::new();
        let mut kv = SeqKvStore::new(KV);
        let mut m = KvMirror::new(&mem, layout(crate::kv::SEQ_BLOCK)).unwrap();
        // One segment's worth of sequences, then the device "fills up".
        for s in 0..SEGMENT_PAGES as u64 {
            kv.prepare(s, 0, 1).unwrap();
            fill(&mut kv, s, 0, 1);
            m.begin_step();
            m.sync_seq(&mem, &kv, s).unwrap();
        }
        assert_eq!(m.pages(), SEGMENT_PAGES);
        mem.free.set(0);
        let s = SEGMENT_PAGES as u64;
        kv.prepare(s, 0, 1).unwrap();
        fill(&mut kv, s, 0, 1);
        m.begin_step();
        m.sync_seq(&mem, &kv, s).unwrap();
        assert_eq!(
            mem.bufs.borrow().len(),
            2,
            "the sink and one segment: no new one"
        );
        assert!(
            m.pages() <= SEGMENT_PAGES / 2 + 1,
            "the older half was evicted"
        );
        // An evicted page comes back by upload when a later step wants it.
        let before = mem.uploads.borrow().len();
        m.begin_step();
        m.sync_seq(&mem, &kv, 0).unwrap();
        assert_eq!(mem.uploads.borrow().len(), before + 1);
        // A step that reads more pages than the device holds fails with the
        // sizes instead of evicting its own pages.
        let big = 999;
        kv.prepare(big, 0, (SEGMENT_PAGES + 1) * crate::kv::SEQ_BLOCK)
            .unwrap();
        fill(&mut kv, big, 0, (SEGMENT_PAGES + 1) * crate::kv::SEQ_BLOCK);
        m.begin_step();
        let err = m.sync_seq(&mem, &kv, big).unwrap_err().to_string();
        assert!(
            err.contains("out of device memory") && err.contains("bytes"),
            "{err}"
        );
    }
}
