//! The llama forward pass on the CUDA resident path (feature `cuda`).
//!
//! Weights are uploaded once, in their stored form, when the model moves to
//! the device; the KV pages live in the device mirror ([`KvMirror`]). A step
//! uploads one small array (token ids, positions, page tables, wanted rows),
//! runs every kernel of every layer on the device with no host round trip,
//! and brings back what sampling and recording need: the wanted logits rows
//! and the step's new K/V rows, which go into the host store so that its
//! slot digests and page hashes are the CPU's.
//!
//! Decode steps (every span one token) are captured as CUDA graphs on the
//! second step of a shape and replayed from then on: the step's inputs sit at
//! fixed device addresses, so the same graph serves every later step of that
//! shape. Graphs change no bit: they replay the very launches captured.
//!
//! Invariant: every kernel is the canonical order's (kernels/cuda/), so the
//! logits and K/V rows are the CPU path's bits whatever the batch, the
//! chunking, the page size, the prefix cache or graphs on or off.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use lmrr_kernels::cuda::overlap::Overlap;
use lmrr_kernels::cuda::resident::{
    DevBuf, DevMatrix, Graph, MmOut, PageLayout, PageTable, Pinned, SplitScratch,
};
use lmrr_kernels::cuda::Gpu;
use lmrr_kernels::Threads;

use crate::kv::{KvCache, KvRun};
use crate::model::device_kv::{pack_inputs, KvMirror};
use crate::model::{gpu_err, SeqSpan};
use crate::weights::Tensor;
use crate::EngineError;

use super::{Llama, StepSplit};

/// Steps of more tokens than this never split a matmul over its chunks
/// (their tiles fill the device), so the partials' scratch stays small.
const SPLIT_MAX_TOKENS: usize = 256;

struct DevLayer {
    attn_norm: DevBuf,
    q: DevMatrix,
    k: DevMatrix,
    v: DevMatrix,
    o: DevMatrix,
    mlp_norm: DevBuf,
    gate: DevMatrix,
    up: DevMatrix,
    down: DevMatrix,
}

/// Shapes a step's device buffers are laid out for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct StepShape {
    n: usize,
    m: usize,
}

/// Device addresses of one step's activations, for `n` tokens and `m`
/// wanted rows.
struct Addrs {
    x: u64,
    h: u64,
    q: u64,
    k: u64,
    v: u64,
    att: u64,
    o: u64,
    g: u64,
    u: u64,
    a: u64,
    hx: u64,
    hn: u64,
    logits: u64,
    /// Chunk partials of split matmuls ([`Resident::part_floats`]).
    part: u64,
    part_floats: usize,
}

/// A decode shape's captured launches: all of them, or (where the step
/// copies its K/V rows back during the head, `Tuning::kv_early_min`) the
/// layers and the head apart, so that the copy goes between them.
struct StepGraph {
    layers: Graph,
    head: Option<Graph>,
}

struct State {
    mirror: Option<KvMirror<Gpu>>,
    /// Activations, sized for `cap`.
    scratch: Option<(DevBuf, StepShape)>,
    /// The step's inputs (u64), and how many it holds.
    inputs: Option<(DevBuf, usize)>,
    graphs: HashMap<StepShape, StepGraph>,
    /// Decode shapes seen once (captured on the second sight).
    seen: HashMap<StepShape, u32>,
    host_in: Vec<u64>,
    /// Page-locked: what comes back each step.
    host_logits: Option<Pinned>,
    host_kv: Option<Pinned>,
}

/// The resident device state of a llama model.
pub(crate) struct Resident {
    gpu: Arc<Gpu>,
    embed: DevMatrix,
    head: Option<DevMatrix>,
    norm: DevBuf,
    layers: Vec<DevLayer>,
    rope: (DevBuf, DevBuf),
    graphs_on: AtomicBool,
    /// `LMRR_CUDA_PROFILE=1`: every part synchronized and timed (graphs
    /// off), for `lmrr bench`'s breakdown; measurement only.
    profiling: bool,
    prof: Mutex<Vec<(&'static str, f64)>>,
    /// Measurement (`lmrr bench`): each step's kernels timed by events
    /// around them and the host's parts by its clock (no sync added inside
    /// the step), kept in `step_device`.
    step_timing: AtomicBool,
    step_device: Mutex<Vec<StepSplit>>,
    state: Mutex<State>,
}

fn up(gpu: &Gpu, t: &Tensor) -> Result<DevMatrix, EngineError> {
    gpu.upload_matrix(&t.matrix(), &t.name).map_err(gpu_err)
}

fn upv(gpu: &Gpu, v: &[f32], what: &str) -> Result<DevBuf, EngineError> {
    gpu.upload(v, what).map_err(gpu_err)
}

/// Graph capture can be turned off (`LMRR_CUDA_GRAPHS=0`) to compare.
fn graphs_default() -> bool {
    std::env::var("LMRR_CUDA_GRAPHS").map_or(true, |v| v != "0")
}

impl Resident {
    /// Uploads every weight of `m`.
    pub(crate) fn new(gpu: Arc<Gpu>, m: &Llama) -> Result<Self, EngineError> {
        let g = &gpu;
        let mut layers = Vec::with_capacity(m.layers.len());
        for (i, l) in m.layers.iter().enumerate() {
            layers.push(DevLayer {
                attn_norm: upv(g, &l.attn_norm, &format!("layer {i} input_layernorm"))?,
                q: up(g, &l.q)?,
                k: up(g, &l.k)?,
                v: up(g, &l.v)?,
                o: up(g, &l.o)?,
                mlp_norm: upv(
                    g,
                    &l.mlp_norm,
                    &format!("layer {i} post_attention_layernorm"),
                )?,
                gate: up(g, &l.gate)?,
                up: up(g, &l.up)?,
                down: up(g, &l.down)?,
            });
        }
        let (cos, sin) = m.rope.tables();
        Ok(Self {
            embed: up(g, &m.embed)?,
            head: m.lm_head.as_ref().map(|t| up(g, t)).transpose()?,
            norm: upv(g, &m.norm, "model.norm")?,
            rope: (upv(g, cos, "RoPE cos")?, upv(g, sin, "RoPE sin")?),
            layers,
            graphs_on: AtomicBool::new(graphs_default()),
            profiling: std::env::var("LMRR_CUDA_PROFILE").is_ok_and(|v| v == "1"),
            prof: Mutex::new(Vec::new()),
            step_timing: AtomicBool::new(false),
            step_device: Mutex::new(Vec::new()),
            state: Mutex::new(State {
                mirror: None,
                scratch: None,
                inputs: None,
                graphs: HashMap::new(),
                seen: HashMap::new(),
                host_in: Vec::new(),
                host_logits: None,
                host_kv: None,
            }),
            gpu,
        })
    }

    /// Turns decode-step graphs on or off (for measurement; bits are equal).
    pub(crate) fn set_graphs(&self, on: bool) {
        self.graphs_on.store(on, Ordering::Relaxed);
        if let Ok(mut st) = self.state.lock() {
            st.graphs.clear();
            st.seen.clear();
        }
    }

    /// Turns step timing on or off (measurement): while on, each step's
    /// kernels are timed on the device by events recorded before its first
    /// launch and after its last.
    pub(crate) fn set_step_timing(&self, on: bool) {
        self.step_timing.store(on, Ordering::Relaxed);
    }

    /// Each step timed since the last call.
    pub(crate) fn take_step_device(&self) -> Vec<StepSplit> {
        self.step_device
            .lock()
            .map(|mut v| std::mem::take(&mut *v))
            .unwrap_or_default()
    }

    /// Seconds per part since the last reset (empty unless profiling).
    pub(crate) fn profile(&self) -> Vec<(&'static str, f64)> {
        self.prof.lock().map(|p| p.clone()).unwrap_or_default()
    }

    pub(crate) fn reset_profile(&self) {
        if let Ok(mut p) = self.prof.lock() {
            p.clear();
        }
    }

    fn add_time(&self, part: &'static str, secs: f64) {
        if let Ok(mut p) = self.prof.lock() {
            match p.iter_mut().find(|e| e.0 == part) {
                Some(e) => e.1 += secs,
                None => p.push((part, secs)),
            }
        }
    }

    /// Runs `f`; when profiling, synchronized and timed as `part`.
    fn timed<T>(
        &self,
        part: &'static str,
        f: impl FnOnce() -> Result<T, EngineError>,
    ) -> Result<T, EngineError> {
        if !self.profiling {
            return f();
        }
        self.gpu.sync().map_err(gpu_err)?;
        let t0 = std::time::Instant::now();
        let r = f()?;
        self.gpu.sync().map_err(gpu_err)?;
        self.add_time(part, t0.elapsed().as_secs_f64());
        Ok(r)
    }

    /// KV pages the device mirror holds, and pages uploaded so far.
    pub(crate) fn kv_stats(&self) -> (usize, u64) {
        self.state
            .lock()
            .ok()
            .and_then(|st| st.mirror.as_ref().map(|m| (m.pages(), m.uploads)))
            .unwrap_or((0, 0))
    }

    /// Floats of split-matmul partials a step of `n` tokens holds: every
    /// layer matmul's chunks × rows for up to [`SPLIT_MAX_TOKENS`] tokens
    /// (larger steps split only the matmuls whose partials fit; the head is
    /// never split: its rows fill the device alone). The matmuls of one input
    /// (q, k, v; gate, up) hold their partials at once.
    fn part_floats(m: &Llama, n: usize) -> usize {
        let c = &m.cfg;
        let (d, ff) = (c.hidden_size, c.intermediate_size);
        let (qd, kvd) = (m.shape.q_dim(), m.shape.kv_dim());
        let ch = |cols: usize| cols.div_ceil(64);
        let widest = (qd + 2 * kvd).max(2 * ff);
        let per = (ch(d) * widest).max(ch(qd) * d).max(ch(ff) * d);
        n.min(SPLIT_MAX_TOKENS) * per
    }

    fn floats(m: &Llama, s: StepShape) -> [usize; 14] {
        let c = &m.cfg;
        let (d, ff, vocab) = (c.hidden_size, c.intermediate_size, c.vocab_size);
        let (qd, kvd, layers) = (m.shape.q_dim(), m.shape.kv_dim(), m.layers.len());
        let StepShape { n, m: w } = s;
        [
            n * d,
            n * d,
            n * qd,
            layers * n * kvd,
            layers * n * kvd,
            n * qd,
            n * d,
            n * ff,
            n * ff,
            n * ff,
            w * d,
            w * d,
            w * vocab,
            Self::part_floats(m, n),
        ]
    }

    fn addrs(m: &Llama, base: u64, s: StepShape) -> Addrs {
        let f = Self::floats(m, s);
        let mut at = [0u64; 14];
        let mut off = 0u64;
        for (a, &n) in at.iter_mut().zip(&f) {
            *a = base + off;
            // 256-byte aligned regions.
            off += ((n * 4) as u64).div_ceil(256) * 256;
        }
        Addrs {
            x: at[0],
            h: at[1],
            q: at[2],
            k: at[3],
            v: at[4],
            att: at[5],
            o: at[6],
            g: at[7],
            u: at[8],
            a: at[9],
            hx: at[10],
            hn: at[11],
            logits: at[12],
            part: at[13],
            part_floats: f[13],
        }
    }

    fn scratch_bytes(m: &Llama, s: StepShape) -> usize {
        Self::floats(m, s)
            .iter()
            .map(|&n| (n * 4).div_ceil(256) * 256)
            .sum()
    }

    /// One step over `spans` (already checked and prepared in `kv`):
    /// `tok[i]` is stacked token i's (span, position), `rows` the stacked
    /// indices of the wanted logits rows. Returns each span's logits rows.
    pub(crate) fn forward(
        &self,
        m: &Llama,
        kv: &mut dyn KvCache,
        spans: &[SeqSpan],
        tok: &[(usize, usize)],
        rows: &[usize],
        threads: &Threads,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        let mut guard = self
            .state
            .lock()
            .map_err(|_| EngineError::Device("the device state lock was poisoned".into()))?;
        let st = &mut *guard;
        self.gpu.bind().map_err(gpu_err)?;
        let t0 = std::time::Instant::now();
        let out = self.step(m, st, kv, spans, tok, rows, threads);
        if self.profiling {
            self.add_time("step", t0.elapsed().as_secs_f64());
        }
        if out.is_err() {
            // The device pages may hold rows the host never got.
            if let Some(mi) = st.mirror.as_mut() {
                mi.clear();
            }
            st.graphs.clear();
            let _ = self.gpu.sync();
        }
        out
    }

    #[allow(clippy::too_many_arguments)]
    fn step(
        &self,
        m: &Llama,
        st: &mut State,
        kv: &mut dyn KvCache,
        spans: &[SeqSpan],
        tok: &[(usize, usize)],
        rows: &[usize],
        threads: &Threads,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        let gpu = &*self.gpu;
        let entered = std::time::Instant::now();
        let (n, w) = (tok.len(), rows.len());
        let shape = StepShape { n, m: w };
        let vocab = m.cfg.vocab_size;
        let (kvd, layers) = (m.shape.kv_dim(), m.layers.len());
        let block_len = spans
            .first()
            .map_or(1, |s| kv.blocks(s.seq).block_len.max(1));
        let layout = PageLayout {
            page_len: block_len,
            layers,
            kv_dim: kvd,
            aux_dim: 0,
        };
        if st.mirror.as_ref().map(|mi| mi.layout()) != Some(layout) {
            st.mirror = None;
            st.graphs.clear();
            st.mirror = Some(KvMirror::new(gpu, layout)?);
        }
        let mirror = st
            .mirror
            .as_mut()
            .ok_or(EngineError::Device("no mirror".into()))?;
        mirror.begin_step();

        // Inputs: ids, pos, seq_off, dst, slot (n each), rows (m), pages.
        let mut pages: Vec<u64> = Vec::new();
        let mut span_off = Vec::with_capacity(spans.len());
        self.timed("KV page check and upload", || {
            for s in spans {
                span_off.push(pages.len());
                let held = mirror.sync_seq(gpu, kv, s.seq)?;
                let need = (s.start + s.tokens.len()).div_ceil(block_len);
                if held.len() < need {
                    return Err(EngineError::Device(format!(
                        "sequence {}: the KV store lists {} blocks of {block_len} positions, the step needs {need}",
                        s.seq,
                        held.len()
                    )));
                }
                pages.extend(held);
            }
            Ok(())
        })?;
        let sink = mirror.sink();
        let fixed = pack_inputs(
            &mut st.host_in,
            spans,
            tok,
            rows,
            &span_off,
            &pages,
            block_len,
            sink,
        );
        // attention_prefill's groups (steps of long spans), after the pages.
        let groups_at = st.host_in.len();
        let n_groups = match lmrr_kernels::cuda::resident::prefill_groups(
            spans.iter().map(|s| s.tokens.len()),
            lmrr_kernels::cuda::resident::PF_TQ,
        ) {
            Some(mut g) => {
                // Longest first, so no long group waits for a second wave.
                // Positions are the inputs' second n (pack_inputs).
                let pos = st.host_in.get(n..2 * n).unwrap_or(&[]);
                lmrr_kernels::cuda::resident::longest_first(&mut g, pos);
                st.host_in.extend(&g);
                g.len()
            }
            None => 0,
        };

        // Buffers: grow (and drop the graphs that name the old ones).
        let grown = std::time::Instant::now();
        let need_in = st.host_in.len();
        if st.inputs.as_ref().is_none_or(|(_, cap)| *cap < need_in) {
            st.graphs.clear();
            st.inputs = None;
            let cap = need_in.next_power_of_two().max(1024);
            let b = gpu.alloc(cap * 8, "the step's inputs").map_err(gpu_err)?;
            st.inputs = Some((b, cap));
        }
        let fits = st
            .scratch
            .as_ref()
            .is_some_and(|(_, c)| c.n >= n && c.m >= w);
        if !fits {
            st.graphs.clear();
            st.scratch = None;
            let cap = StepShape {
                n: n.next_power_of_two().max(8),
                m: w.next_power_of_two().max(8),
            };
            let b = gpu
                .alloc(
                    Self::scratch_bytes(m, cap),
                    &format!("activations of a {}-token step", cap.n),
                )
                .map_err(gpu_err)?;
            st.scratch = Some((b, cap));
        }
        let mut growth = grown.elapsed().as_secs_f64();
        let inb = st.inputs.as_ref().map(|(b, _)| b.ptr()).unwrap_or(0);
        let sb = st.scratch.as_ref().map(|(b, _)| b.ptr()).unwrap_or(0);
        self.timed("step inputs upload", || {
            gpu.htod(&st.host_in, inb).map_err(gpu_err)
        })?;
        let at = |i: usize| inb + 8 * (i as u64);
        let ids = at(0);
        let table = PageTable {
            pages: at(fixed),
            seq_off: at(2 * n),
            pos: at(n),
            groups: at(groups_at),
            n_groups,
        };
        let (dstp, slotp, rowp) = (at(3 * n), at(4 * n), at(5 * n));
        let a = Self::addrs(m, sb, shape);

        let decode = spans.iter().all(|s| s.tokens.len() == 1);
        // Every token's logits row wanted, in stacked order (every decode
        // step whose spans all want their row; so a decode graph, keyed by
        // (n, m), serves only steps of the same choice: m == n is this).
        let direct = w == n && rows.iter().enumerate().all(|(i, &r)| r == i);
        debug_assert!(
            !decode || direct == (w == n),
            "a decode step's wanted rows are its spans' own, in order"
        );
        // A decode step has its attention blocks make
        // RoPE and the page writes only where no block can read a row that
        // another block writes: every token's page is in no other span's
        // page list (a shared page is a prefix, never written; only
        // cache-corruption patches write one, or send a token to the sink
        // page). A step that fails this is launched without graphs, so that
        // no graph captured from a fused step replays for it.
        let crossed = decode && {
            let dsts = &st.host_in[3 * n..4 * n];
            let mut refs: std::collections::HashMap<u64, usize> = std::collections::HashMap::new();
            for p in &pages {
                *refs.entry(*p).or_insert(0) += 1;
            }
            dsts.iter()
                .any(|d| *d == sink || refs.get(d).copied().unwrap_or(0) != 1)
        };
        let rope_attn = {
            let t = gpu.tuning();
            let c = &m.cfg;
            decode
                && !crossed
                && n_groups == 0
                && n * m.shape.n_heads <= t.attn_decode_max
                && n < t.gemm_min.max(1)
                && m.shape.kv_dim() <= c.intermediate_size
        };
        let graphs =
            self.graphs_on.load(Ordering::Relaxed) && decode && !self.profiling && !crossed;
        // A long step not replayed from a graph (Tuning::kv_overlap_min)
        // copies its K/V rows back layer by layer, and the host writes layer
        // l while the device runs the layers after it. Otherwise
        // (Tuning::kv_early_min) a step of that many tokens copies them back
        // after its last layer, and the host writes them while the head runs
        // and its logits come back (graphs capture the layers and the head
        // apart for it). The same bytes as one download after the step.
        let (per_layer, early) = {
            let t = gpu.tuning();
            let on = |min: usize| min > 0 && n >= min && !self.profiling;
            let per_layer = on(t.kv_overlap_min) && !graphs;
            (per_layer, on(t.kv_early_min) && !per_layer)
        };
        if graphs && !st.graphs.contains_key(&shape) {
            let seen = st.seen.entry(shape).or_insert(0);
            *seen += 1;
            if *seen >= 2 && st.graphs.len() < 64 {
                gpu.begin_capture().map_err(gpu_err)?;
                let r =
                    self.launch_layers(m, &a, ids, table, dstp, slotp, layout, n, rope_attn, None);
                let r = match r {
                    Ok(mlp) if !early => self
                        .launch_head(m, &a, rowp, n, w, direct, mlp)
                        .map(|_| None),
                    r => r.map(Some),
                };
                let g = gpu.end_capture().map_err(gpu_err)?;
                let head_pending = r?;
                let head = match head_pending {
                    Some(mlp) => {
                        gpu.begin_capture().map_err(gpu_err)?;
                        let r = self.launch_head(m, &a, rowp, n, w, direct, mlp);
                        let h = gpu.end_capture().map_err(gpu_err)?;
                        r?;
                        h
                    }
                    None => None,
                };
                if let Some(layers) = g {
                    if head_pending.is_none() || head.is_some() {
                        st.graphs.insert(shape, StepGraph { layers, head });
                    }
                }
            }
        }
        // Back: logits rows and the step's K/V rows, `(layers, n, kvd)` each.
        let per = layers * n * kvd;
        let grow = |buf: &mut Option<Pinned>, len: usize| -> Result<(), EngineError> {
            if buf.as_ref().is_none_or(|b| b.len() < len) {
                *buf = None;
                *buf = Some(gpu.alloc_pinned(len.next_power_of_two()).map_err(gpu_err)?);
            }
            Ok(())
        };
        let grown = std::time::Instant::now();
        grow(&mut st.host_logits, w * vocab)?;
        grow(&mut st.host_kv, 2 * per)?;
        growth += grown.elapsed().as_secs_f64();
        if self.profiling {
            // Device and pinned host buffers grown for this step's shape
            // (once per larger shape; the rest of "other" is host work).
            self.add_time("buffer growth", growth);
        }
        let runs = step_runs(spans);
        debug_assert_eq!(
            runs.iter().map(|r| r.n).sum::<usize>(),
            n,
            "the spans stack the step's tokens"
        );
        let mut overlap = if per_layer || early {
            let hkv = st
                .host_kv
                .as_mut()
                .ok_or(EngineError::Device("no host buffers".into()))?;
            Some(gpu.overlap(hkv).map_err(gpu_err)?)
        } else {
            None
        };
        // Queues the copy of every layer's K/V rows (one slot), after the
        // layers and before the head.
        let copy_all = |ov: &mut Option<Overlap<'_>>| -> Result<(), EngineError> {
            if let Some(ov) = ov.as_mut().filter(|_| early) {
                ov.queue(&[(a.k, 0, per), (a.v, per, per)])
                    .map_err(gpu_err)?;
            }
            Ok(())
        };
        let timing = self.step_timing.load(Ordering::Relaxed);
        let launching = std::time::Instant::now();
        let start = timing.then(|| gpu.mark()).transpose().map_err(gpu_err)?;
        match st.graphs.get(&shape).filter(|_| graphs) {
            Some(g) => {
                g.layers.launch().map_err(gpu_err)?;
                if let Some(h) = &g.head {
                    copy_all(&mut overlap)?;
                    h.launch().map_err(gpu_err)?;
                }
            }
            None => {
                let per_layer_copy = overlap.as_mut().filter(|_| per_layer);
                let mlp = self.launch_layers(
                    m,
                    &a,
                    ids,
                    table,
                    dstp,
                    slotp,
                    layout,
                    n,
                    rope_attn,
                    per_layer_copy,
                )?;
                copy_all(&mut overlap)?;
                self.launch_head(m, &a, rowp, n, w, direct, mlp)?;
            }
        }
        let end = timing.then(|| gpu.mark()).transpose().map_err(gpu_err)?;
        let launched = std::time::Instant::now();
        // When the downloads were done (timing), and the event after them.
        let mut waited = launched;
        let mut copied = None;
        let rows_per = n * kvd;
        // Layer by layer (a slot a layer), or all at once (one slot); a step
        // whose launch queued neither (the fused form) downloads after it
        // (an Overlap waits for any copies it queued when dropped). The
        // logits rows follow the K/V rows on the copy stream, queued after
        // the head, so they come back while the host writes the K/V rows.
        let host_logits = &mut st.host_logits;
        let overlapped = overlap
            .filter(|o| o.queued() == if per_layer { layers } else { 1 })
            .map(|mut ov| -> Result<Vec<Vec<f32>>, EngineError> {
                let hl = host_logits
                    .as_mut()
                    .ok_or(EngineError::Device("no host buffers".into()))?;
                let mut lo = gpu.overlap(hl).map_err(gpu_err)?;
                lo.queue(&[(a.logits, 0, w * vocab)]).map_err(gpu_err)?;
                if per_layer {
                    for li in 0..layers {
                        ov.wait(li).map_err(gpu_err)?;
                        let hk = ov.region(li * rows_per, rows_per).map_err(gpu_err)?;
                        let hv = ov.region(per + li * rows_per, rows_per).map_err(gpu_err)?;
                        kv.write_layers(&runs, li..li + 1, hk, hv, threads);
                    }
                } else {
                    ov.wait(0).map_err(gpu_err)?;
                    let hk = ov.region(0, per).map_err(gpu_err)?;
                    let hv = ov.region(per, per).map_err(gpu_err)?;
                    kv.write_step(&runs, layers, hk, hv, threads);
                }
                drop(ov);
                lo.wait(0).map_err(gpu_err)?;
                waited = std::time::Instant::now();
                let logits = lo.region(0, w * vocab).map_err(gpu_err)?;
                Ok(crate::model::split_rows(spans, logits, vocab, threads))
            })
            .transpose()?;
        let out = match overlapped {
            Some(out) => out,
            None => {
                let (Some(hl), Some(hkv)) = (st.host_logits.as_mut(), st.host_kv.as_mut()) else {
                    return Err(EngineError::Device("no host buffers".into()));
                };
                self.timed("download (logits, K/V rows)", || {
                    // Three copies, one wait.
                    let l = hl.as_mut_slice().map_err(gpu_err)?;
                    let s = hkv.as_mut_slice().map_err(gpu_err)?;
                    let (hk, hv) = s.split_at_mut(per);
                    copied = gpu
                        .dtoh_many(
                            &mut [
                                (a.logits, &mut l[..w * vocab]),
                                (a.k, &mut hk[..per]),
                                (a.v, &mut hv[..per]),
                            ],
                            timing,
                        )
                        .map_err(gpu_err)?;
                    Ok(())
                })?;
                waited = std::time::Instant::now();
                let s = hkv.as_slice().map_err(gpu_err)?;
                let (hk, hv) = s.split_at(per);
                self.timed("host K/V writes", || {
                    // `write_step` copies the layers across `threads`.
                    kv.write_step(&runs, layers, &hk[..per], &hv[..per], threads);
                    Ok(())
                })?;
                let logits = hl.as_slice().map_err(gpu_err)?;
                self.timed("logits rows into per-span vectors", || {
                    Ok(crate::model::split_rows(
                        spans,
                        &logits[..w * vocab],
                        vocab,
                        threads,
                    ))
                })?
            }
        };
        let mirror = st
            .mirror
            .as_mut()
            .ok_or(EngineError::Device("no mirror".into()))?;
        for s in spans {
            mirror.mark_written(kv, s.seq);
        }
        if let (Some(s0), Some(s1)) = (start, end) {
            let secs = |a: std::time::Instant, b: std::time::Instant| (b - a).as_secs_f64();
            let split = StepSplit {
                kernels: s0.secs_to(&s1).map_err(gpu_err)?,
                copies: copied
                    .map(|c| s1.secs_to(&c))
                    .transpose()
                    .map_err(gpu_err)?
                    .unwrap_or(0.0),
                before: secs(entered, launching),
                launch: secs(launching, launched),
                wait: secs(launched, waited),
                after: secs(waited, std::time::Instant::now()),
            };
            if let Ok(mut v) = self.step_device.lock() {
                v.push(split);
            }
        }
        Ok(out)
    }

    /// The embedding and every layer of a step, queued on the stream; the
    /// last layer's MLP output for [`Resident::launch_head`]. `rope_attn`:
    /// the step qualifies for `attention_decode_rope` (decode, distinct
    /// slots, no split matmul), whose blocks make RoPE and the page writes:
    /// the k matmul then writes its unrotated rows to `a.g` (free until
    /// gate), and the kernel the rotated ones to the step's K rows. With
    /// `kv_copy`, each layer's K/V rows are queued for the host as soon as
    /// the layer has made them.
    #[allow(clippy::too_many_arguments)]
    fn launch_layers(
        &self,
        m: &Llama,
        a: &Addrs,
        ids: u64,
        table: PageTable,
        dst: u64,
        slot: u64,
        layout: PageLayout,
        n: usize,
        rope_attn: bool,
        mut kv_copy: Option<&mut Overlap<'_>>,
    ) -> Result<Option<MmOut>, EngineError> {
        let g = &*self.gpu;
        let c = &m.cfg;
        let (d, ff, eps) = (c.hidden_size, c.intermediate_size, c.rms_norm_eps);
        let kvd = m.shape.kv_dim();
        let e = gpu_err;
        let t = |part, f: &dyn Fn() -> Result<(), lmrr_kernels::cuda::GpuError>| {
            self.timed(part, || f().map_err(e))
        };
        t("embedding", &|| g.embed(&self.embed, ids, n, a.x))?;
        let sp = SplitScratch {
            addr: a.part,
            floats: a.part_floats,
        };
        // A split matmul's output stays partials (`MmOut`) until the next
        // kernel, which sums them as it reads.
        let fold = true;
        // The MLP output of the layer before, added to the residual by the
        // next norm (or, after the last layer, by the head's add).
        let mut mlp_out: Option<MmOut> = None;
        for (li, l) in self.layers.iter().enumerate() {
            let (k, v) = (
                a.k + 4 * (li * n * kvd) as u64,
                a.v + 4 * (li * n * kvd) as u64,
            );
            t("norms (with residual adds)", &|| match mlp_out {
                None => g.norm_rows(a.x, &l.attn_norm, n, d, eps, a.h),
                Some(o) => g.add_norm(a.x, o, &l.attn_norm, n, d, eps, a.h),
            })?;
            let kraw = if rope_attn { a.g } else { k };
            let qkv = self.timed("matmul q, k, v", || {
                g.mm_outs(a.h, n, &[(&l.q, a.q), (&l.k, kraw), (&l.v, v)], sp, fold)
                    .map_err(e)
            })?;
            let qkv = [qkv[0], qkv[1], qkv[2]];
            self.attend(
                m,
                a,
                qkv,
                (kraw, k),
                (table, dst, slot),
                n,
                layout,
                li,
                rope_attn,
            )?;
            if let Some(ov) = kv_copy.as_deref_mut() {
                // This layer's K and V rows are final: copy them back while
                // the next layers run (`(layers, n, kvd)` K, then V).
                let (rows, per) = (n * kvd, self.layers.len() * n * kvd);
                ov.queue(&[(k, li * rows, rows), (v, per + li * rows, rows)])
                    .map_err(e)?;
            }
            let o = self.timed("matmul o", || {
                g.mm_outs(a.att, n, &[(&l.o, a.o)], sp, fold).map_err(e)
            })?;
            t("norms (with residual adds)", &|| {
                g.add_norm(a.x, o[0], &l.mlp_norm, n, d, eps, a.h)
            })?;
            let gu = self.timed("matmul gate, up", || {
                g.mm_outs(a.h, n, &[(&l.gate, a.g), (&l.up, a.u)], sp, fold)
                    .map_err(e)
            })?;
            t("swiglu", &|| g.swiglu_out(gu[0], gu[1], a.a, n * ff))?;
            let down = self.timed("matmul down", || {
                g.mm_outs(a.a, n, &[(&l.down, a.o)], sp, fold).map_err(e)
            })?;
            mlp_out = Some(down[0]);
        }
        Ok(mlp_out)
    }

    /// A layer's RoPE, K/V page writes and attention into `a.att`: by
    /// `attention_decode_rope` where `rope_attn` (`k`: the k matmul left its
    /// rows unrotated at `k.0`; the rotated ones go to the layer's K rows
    /// `k.1`), else `rope_kv` then attention on `qkv` (the q, k and v
    /// matmuls' outputs, split partials summed as they are read; k's at
    /// `k.1`). `pages`: the step's page table, and its destination pages
    /// and slots.
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &self,
        m: &Llama,
        a: &Addrs,
        qkv: [MmOut; 3],
        k: (u64, u64),
        pages: (PageTable, u64, u64),
        n: usize,
        layout: PageLayout,
        li: usize,
        rope_attn: bool,
    ) -> Result<(), EngineError> {
        let g = &*self.gpu;
        let (table, dst, slot) = pages;
        let scale = 1.0 / (m.shape.head_dim as f32).sqrt();
        let t = |part, f: &dyn Fn() -> Result<(), lmrr_kernels::cuda::GpuError>| {
            self.timed(part, || f().map_err(gpu_err))
        };
        if rope_attn {
            if qkv.iter().any(|o| o.is_split()) {
                // Never (no matmul splits below gemm_min, which the step
                // checked): the unrotated K rows are not where rope_kv
                // reads them.
                return Err(EngineError::Device(
                    "a fused RoPE step got split q/k/v matmuls".into(),
                ));
            }
            return t("attention (with rope, KV write)", &|| {
                g.attention_decode_rope(
                    (qkv[0].y, k.0, qkv[2].y),
                    k.1,
                    (&self.rope.0, &self.rope.1),
                    table,
                    dst,
                    slot,
                    n,
                    &m.shape,
                    layout,
                    li,
                    scale,
                    a.att,
                )
            });
        }
        t("rope, KV write", &|| {
            g.rope_kv(
                (qkv[0], qkv[1], qkv[2]),
                (&self.rope.0, &self.rope.1),
                table.pos,
                dst,
                slot,
                n,
                m.shape.q_dim(),
                m.shape.head_dim,
                layout,
                li,
            )
        })?;
        t("attention", &|| {
            g.attention_paged(qkv[0].y, table, n, &m.shape, layout, li, scale, a.att)
        })
    }

    /// The head of a step whose layers [`Resident::launch_layers`] queued:
    /// the last MLP output added to the residual, the wanted rows gathered,
    /// normed and multiplied by the output matrix into the logits.
    /// `direct`: the wanted rows are every token's, in order (`rows` is `0..n`), so
    /// the head reads the residual rows where they are.
    #[allow(clippy::too_many_arguments)]
    fn launch_head(
        &self,
        m: &Llama,
        a: &Addrs,
        rows: u64,
        n: usize,
        w: usize,
        direct: bool,
        mlp_out: Option<MmOut>,
    ) -> Result<(), EngineError> {
        let g = &*self.gpu;
        let c = &m.cfg;
        let (d, eps) = (c.hidden_size, c.rms_norm_eps);
        let head = || -> Result<(), lmrr_kernels::cuda::GpuError> {
            if direct {
                // Every row wanted, in order: the residual add and the
                // final norm in one launch, no gather (the same values:
                // add_rows' sums, then the norm of each row).
                match mlp_out {
                    Some(o) => g.add_norm(a.x, o, &self.norm, n, d, eps, a.hn)?,
                    None => g.norm_rows(a.x, &self.norm, n, d, eps, a.hn)?,
                }
            } else {
                if let Some(o) = mlp_out {
                    g.add_out(a.x, o, n * d)?;
                }
                g.gather(a.x, rows, w, d, a.hx)?;
                g.norm_rows(a.hx, &self.norm, w, d, eps, a.hn)?;
            }
            let head = self.head.as_ref().unwrap_or(&self.embed);
            g.mm(a.hn, w, head, a.logits)
        };
        self.timed("output head", || head().map_err(gpu_err))
    }
}

/// The step's K/V writes: each span is one run of consecutive stacked rows
/// at consecutive positions (`stacked_tokens`), in stacked order, so that a
/// slot two tokens write (a cache-corruption patch) keeps the last one's
/// rows, as on the device (`pack_inputs`).
fn step_runs(spans: &[SeqSpan]) -> Vec<KvRun> {
    let mut row0 = 0;
    spans
        .iter()
        .map(|s| {
            let r = KvRun {
                seq: s.seq,
                pos0: s.start,
                row0,
                n: s.tokens.len(),
            };
            row0 += r.n;
            r
        })
        .collect()
}
