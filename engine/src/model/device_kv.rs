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

use std::collections::HashMap;

use lmrr_kernels::cuda::resident::{DevBuf, PageLayout};
use lmrr_kernels::cuda::Gpu;

use crate::kv::{KvCache, SeqId};
use crate::model::gpu_err;
use crate::EngineError;

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
pub(crate) struct KvMirror {
    layout: PageLayout,
    segments: Vec<DevBuf>,
    free: Vec<usize>,
    map: HashMap<u64, Entry>,
    tick: u64,
    staging: Vec<f32>,
    /// Where a row goes that a later token of the same step overwrites (only
    /// under cache-corruption patches): the last writer wins, as on the host.
    sink: DevBuf,
    /// Pages uploaded since creation (for `lmrr bench`).
    pub uploads: u64,
}

impl KvMirror {
    pub(crate) fn new(gpu: &Gpu, layout: PageLayout) -> Result<Self, EngineError> {
        let sink = gpu
            .alloc(layout.page_floats() * 4, "the KV sink page")
            .map_err(gpu_err)?;
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
        self.sink.ptr()
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
        seg.ptr() + ((slot % SEGMENT_PAGES) * self.page_bytes()) as u64
    }

    /// Starts a step: pages touched from now on are not evicted in it.
    pub(crate) fn begin_step(&mut self) {
        self.tick += 1;
    }

    fn take_slot(&mut self, gpu: &Gpu) -> Result<usize, EngineError> {
        if let Some(s) = self.free.pop() {
            return Ok(s);
        }
        let seg_bytes = SEGMENT_PAGES * self.page_bytes();
        let (free, _) = gpu.mem_info().map_err(gpu_err)?;
        if free >= seg_bytes + RESERVE_BYTES {
            let what = format!(
                "KV pages {}..{} ({} positions × {} layers each)",
                self.segments.len() * SEGMENT_PAGES,
                (self.segments.len() + 1) * SEGMENT_PAGES,
                self.layout.page_len,
                self.layout.layers
            );
            let seg = gpu.alloc(seg_bytes, &what).map_err(gpu_err)?;
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
        gpu: &Gpu,
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
                    self.upload(gpu, kv, seq, b, slot)?;
                    slot
                }
                None => {
                    let slot = self.take_slot(gpu)?;
                    if version != 0 {
                        self.upload(gpu, kv, seq, b, slot)?;
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
        gpu: &Gpu,
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
        gpu.htod(&self.staging, self.slot_ptr(slot))
            .map_err(gpu_err)?;
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
