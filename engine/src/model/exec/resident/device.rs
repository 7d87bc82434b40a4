//! The resident executor's device state and its step: the tables on the
//! device, the KV mirror, the step's inputs and arena, graphs, and the
//! copies back to the host store.
//!
//! Invariant: a step either completes (its K/V rows in the host store, the
//! mirror's versions moved with them) or fails with the mirror cleared, so
//! that no device page is trusted that the host does not hold.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use lmrr_kernels::cuda::overlap::Overlap;
use lmrr_kernels::cuda::resident::{
    DevBuf, DevMatrix, Graph, Mark, PageLayout, PageTable, Pinned, SplitKv,
};
use lmrr_kernels::cuda::Gpu;
use lmrr_kernels::tensor_core::Numerics;
use lmrr_kernels::Threads;

use super::launch::{Addrs, Runner};
use super::plan::{arena, Plan};
use crate::kv::{KvCache, KvRun};
use crate::model::device_kv::{pack_inputs, KvMirror};
use crate::model::exec::{Op, Program, StepSplit, Tables};
use crate::model::{gpu_err, stacked_tokens, wanted_rows, SeqSpan};
use crate::EngineError;

mod choice;
use choice::Choice;

/// Steps of more tokens than this never split a matmul over its chunks
/// (their tiles fill the device), so the partials' scratch stays small.
const SPLIT_MAX_TOKENS: usize = 256;

/// Graphs kept at most (one per program and decode shape).
const MAX_GRAPHS: usize = 64;

/// A graph's key: the program (by its address; [`State::plans`] keeps it
/// alive), the step's token and wanted-row counts, and the tiles a row of
/// the split decode attention's scratch holds (0: not split; a power of
/// two, so that one graph serves a context growing up to it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Shape {
    prog: usize,
    n: usize,
    m: usize,
    split: usize,
}

/// What staging the step's inputs left in `State::host_in`: where the page
/// lists start (`fixed`), where the prefill groups start and how many, the
/// step's page addresses and the mirror's sink page.
struct Staged {
    fixed: usize,
    groups_at: usize,
    n_groups: usize,
    pages: Vec<u64>,
    sink: u64,
}

/// What a plain download gives: the logits per span, the event after the
/// copies (when timing), and when the wait ended.
type Downloaded = (Vec<Vec<f32>>, Option<Mark>, std::time::Instant);

/// A step's sizes: wanted rows, vocabulary, KV row widths and layers.
#[derive(Debug, Clone, Copy)]
struct Dims {
    w: usize,
    vocab: usize,
    kvd: usize,
    adim: usize,
    layers: usize,
}

/// What the launch needs of the step's set-up.
struct Launched {
    shape: Shape,
    cut: usize,
    growth: f64,
    entered: std::time::Instant,
}

struct StepGraph {
    layers: Graph,
    head: Option<Graph>,
}

#[derive(Default)]
struct State {
    mirror: Option<KvMirror<Gpu>>,
    /// The arena, and its bytes.
    scratch: Option<(DevBuf, usize)>,
    /// The step's inputs (u64), and how many it holds.
    inputs: Option<(DevBuf, usize)>,
    graphs: HashMap<Shape, StepGraph>,
    /// Decode shapes seen once (captured on the second sight).
    seen: HashMap<Shape, u32>,
    host_in: Vec<u64>,
    /// Page-locked: what comes back each step.
    host_logits: Option<Pinned>,
    host_kv: Option<Pinned>,
    /// Every program run so far with its plan (kept, so that a program's
    /// address stays its own).
    plans: Vec<(Arc<Program>, Arc<Plan>)>,
    /// The MoE op's device scratch (router logits, expert rows), and bytes.
    moe: Option<(DevBuf, usize)>,
}

/// The tables of a family on the device, by their index in [`Tables`].
pub(super) struct DevTables {
    pub mats: Vec<DevMatrix>,
    pub vecs: Vec<DevBuf>,
    pub ropes: Vec<(DevBuf, DevBuf)>,
}

/// The resident device state of a model: its tables, uploaded once, and
/// the state steps keep.
pub struct Resident {
    gpu: Arc<Gpu>,
    pub(super) dev: DevTables,
    graphs_on: AtomicBool,
    /// `LMRR_CUDA_PROFILE=1`: every op synchronized and timed (graphs off),
    /// for `lmrr bench`'s breakdown; measurement only.
    pub(super) profiling: bool,
    prof: Mutex<Vec<(&'static str, f64)>>,
    /// Measurement (`lmrr bench`): each step's kernels timed by events
    /// around them and the host's parts by its clock (no sync added inside
    /// the step), kept in `step_device`.
    step_timing: AtomicBool,
    step_device: Mutex<Vec<StepSplit>>,
    state: Mutex<State>,
    /// The matmuls' numerics: the canonical kernels, or the tensor-core
    /// GEMM (`Gpu::tc_mm`) under `TensorCoreSm90`.
    pub(super) numerics: Numerics,
}

fn graphs_default() -> bool {
    std::env::var("LMRR_CUDA_GRAPHS").map_or(true, |v| v != "0")
}

impl Resident {
    /// Uploads every table of `tables`.
    pub fn new(gpu: Arc<Gpu>, tables: &Tables) -> Result<Self, EngineError> {
        let g = &*gpu;
        let mats = tables
            .mats
            .iter()
            .map(|t| g.upload_matrix(&t.matrix(), &t.name).map_err(gpu_err))
            .collect::<Result<Vec<_>, _>>()?;
        let vecs = tables
            .vecs
            .iter()
            .enumerate()
            .map(|(i, v)| {
                // A zero-byte allocation is an error: an empty vector is
                // never read, one float stands in.
                let v: &[f32] = if v.is_empty() { &[0.0] } else { v };
                g.upload(v, &format!("vector {i}")).map_err(gpu_err)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let ropes = tables
            .ropes
            .iter()
            .map(|r| {
                let (cos, sin) = r.tables();
                Ok((
                    g.upload(cos, "RoPE cos").map_err(gpu_err)?,
                    g.upload(sin, "RoPE sin").map_err(gpu_err)?,
                ))
            })
            .collect::<Result<Vec<_>, EngineError>>()?;
        Ok(Self {
            dev: DevTables { mats, vecs, ropes },
            graphs_on: AtomicBool::new(graphs_default()),
            profiling: std::env::var("LMRR_CUDA_PROFILE").is_ok_and(|v| v == "1"),
            prof: Mutex::new(Vec::new()),
            step_timing: AtomicBool::new(false),
            step_device: Mutex::new(Vec::new()),
            state: Mutex::new(State::default()),
            numerics: Numerics::Canonical,
            gpu,
        })
    }

    pub(super) fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Turns decode-step graphs on or off (for measurement; bits are equal).
    /// Switches the matmuls to `numerics`; the tensor-core module is built
    /// here, so a device without tensor cores refuses at once. Graphs
    /// captured under the other mode are dropped.
    pub fn set_numerics(&mut self, numerics: Numerics) -> Result<(), EngineError> {
        if numerics.model().is_some() {
            self.gpu.tensor_cores().map_err(gpu_err)?;
        }
        self.numerics = numerics;
        if let Ok(mut st) = self.state.lock() {
            st.graphs.clear();
            st.seen.clear();
        }
        Ok(())
    }

    pub fn set_graphs(&self, on: bool) {
        self.graphs_on.store(on, Ordering::Relaxed);
        if let Ok(mut st) = self.state.lock() {
            st.graphs.clear();
            st.seen.clear();
        }
    }

    /// Turns step timing on or off (measurement): while on, each step's
    /// kernels are timed on the device by events recorded before its first
    /// launch and after its last.
    pub fn set_step_timing(&self, on: bool) {
        self.step_timing.store(on, Ordering::Relaxed);
    }

    /// Each step timed since the last call.
    pub fn take_step_device(&self) -> Vec<StepSplit> {
        self.step_device
            .lock()
            .map(|mut v| std::mem::take(&mut *v))
            .unwrap_or_default()
    }

    /// Seconds per op since the last reset (empty unless profiling).
    pub fn profile(&self) -> Vec<(&'static str, f64)> {
        self.prof.lock().map(|p| p.clone()).unwrap_or_default()
    }

    pub fn reset_profile(&self) {
        if let Ok(mut p) = self.prof.lock() {
            p.clear();
        }
    }

    pub(super) fn add_time(&self, part: &'static str, secs: f64) {
        if let Ok(mut p) = self.prof.lock() {
            match p.iter_mut().find(|e| e.0 == part) {
                Some(e) => e.1 += secs,
                None => p.push((part, secs)),
            }
        }
    }

    /// Runs `f`; when profiling, synchronized and timed as `part`.
    pub(super) fn timed<T>(
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
    pub fn kv_stats(&self) -> (usize, u64) {
        self.state
            .lock()
            .ok()
            .and_then(|st| st.mirror.as_ref().map(|m| (m.pages(), m.uploads)))
            .unwrap_or((0, 0))
    }

    /// One step of `prog` over `spans` (already checked and prepared in
    /// `kv`; `tables` the host tables the device ones were made from).
    /// Returns each span's logits rows.
    pub fn forward(
        &self,
        prog: &Arc<Program>,
        tables: &Tables,
        kv: &mut dyn KvCache,
        spans: &[SeqSpan],
        threads: &Threads,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        let mut guard = self
            .state
            .lock()
            .map_err(|_| EngineError::Device("the device state lock was poisoned".into()))?;
        let st = &mut *guard;
        self.gpu.bind().map_err(gpu_err)?;
        let plan = plan_of(st, prog, tables)?;
        let tok = stacked_tokens(spans);
        let vocab = prog.decl(prog.logits).width;
        if tok.is_empty() {
            return Ok(crate::model::split_rows(spans, &[], vocab, threads));
        }
        let rows = wanted_rows(spans);
        let t0 = std::time::Instant::now();
        let out = self.step(prog, &plan, tables, st, kv, spans, &tok, &rows, threads);
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
        prog: &Arc<Program>,
        plan: &Plan,
        tables: &Tables,
        st: &mut State,
        kv: &mut dyn KvCache,
        spans: &[SeqSpan],
        tok: &[(usize, usize)],
        rows: &[usize],
        threads: &Threads,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        let entered = std::time::Instant::now();
        let (n, w) = (tok.len(), rows.len());
        let mut shape = Shape {
            prog: Arc::as_ptr(prog) as usize,
            n,
            m: w,
            split: 0,
        };
        let geom = plan.kv;
        let block_len = spans
            .first()
            .map_or(1, |s| kv.blocks(s.seq).block_len.max(1));
        let layout = PageLayout {
            page_len: block_len,
            layers: geom.layers.max(1),
            kv_dim: geom.kv_dim,
            aux_dim: geom.aux_dim,
        };
        let staged = self.stage_inputs(st, kv, spans, tok, rows, layout)?;
        shape.split = self.split_tiles(st, plan, spans, n);
        let (a, growth) = self.place(st, prog, plan, n, w, &staged, shape.split)?;
        let c = self.choose(st, plan, spans, rows, n, w, &staged, shape.split);
        // The ops up to the last attention, then the rest.
        let cut = plan.attends.last().map_or(0, |&(j, _)| j + 1);
        let runner = || {
            Runner::new(
                self,
                prog,
                plan,
                tables,
                &a,
                layout,
                n,
                w,
                c.rope_attn,
                c.direct,
                spans,
            )
        };
        if c.graphs && !st.graphs.contains_key(&shape) {
            self.capture(st, shape, prog.ops.len(), cut, c.early, &mut runner())?;
        }
        let step = Launched {
            shape,
            cut,
            growth,
            entered,
        };
        self.launch_and_bring_back(st, kv, spans, tok, threads, &a, &mut runner(), c, step)
    }

    /// Makes the mirror current for the step's sequences and packs the
    /// step's inputs into `st.host_in` (uploaded by [`Resident::place`]).
    #[allow(clippy::too_many_arguments)]
    fn stage_inputs(
        &self,
        st: &mut State,
        kv: &mut dyn KvCache,
        spans: &[SeqSpan],
        tok: &[(usize, usize)],
        rows: &[usize],
        layout: PageLayout,
    ) -> Result<Staged, EngineError> {
        let gpu = &*self.gpu;
        let (n, block_len) = (tok.len(), layout.page_len);
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

        Ok(Staged {
            fixed,
            groups_at,
            n_groups,
            pages,
            sink,
        })
    }

    /// Grows the step's device buffers (dropping the graphs that name the
    /// old ones), uploads its inputs, and lays out its addresses; returns
    /// them and the seconds spent growing.
    #[allow(clippy::too_many_arguments)]
    fn place(
        &self,
        st: &mut State,
        prog: &Program,
        plan: &Plan,
        n: usize,
        w: usize,
        staged: &Staged,
        split_tiles: usize,
    ) -> Result<(Addrs, f64), EngineError> {
        let gpu = &*self.gpu;
        let (kvd, adim, layers) = (plan.kv.kv_dim, plan.kv.aux_dim, plan.kv.layers);
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
        let (own, arena_floats) = arena(prog, n, w);
        let part_floats = n.min(SPLIT_MAX_TOKENS) * plan.part_per_token;
        let stage = layers * n * kvd;
        // Tensor-core numerics: a matmul's input rounded to bf16 (two a float).
        let xb_floats = match self.numerics.model() {
            Some(_) => (n * plan.max_cols).div_ceil(2),
            None => 0,
        };
        let regions = [
            arena_floats,
            part_floats,
            n * kvd,
            stage,
            stage,
            layers * n * adim,
            xb_floats,
            n * split_tiles * plan.split_per_tile,
        ];
        let bytes: usize = regions.iter().map(|&f| (f * 4).div_ceil(256) * 256).sum();
        if st.scratch.as_ref().is_none_or(|(_, b)| *b < bytes) {
            st.graphs.clear();
            st.scratch = None;
            let cap = bytes.next_power_of_two().max(1 << 20);
            let b = gpu
                .alloc(cap, &format!("activations of a {n}-token step"))
                .map_err(gpu_err)?;
            st.scratch = Some((b, cap));
        }
        let growth = grown.elapsed().as_secs_f64();
        let inb = st.inputs.as_ref().map(|(b, _)| b.ptr()).unwrap_or(0);
        let sb = st.scratch.as_ref().map(|(b, _)| b.ptr()).unwrap_or(0);
        self.timed("step inputs upload", || {
            gpu.htod(&st.host_in, inb).map_err(gpu_err)
        })?;
        let at = |i: usize| inb + 8 * (i as u64);
        let mut region = [0u64; 8];
        let mut off = sb;
        for (r, &f) in region.iter_mut().zip(&regions) {
            *r = off;
            off += ((f * 4) as u64).div_ceil(256) * 256;
        }
        let a = Addrs {
            own: own.iter().map(|&o| region[0] + 4 * o as u64).collect(),
            part: region[1],
            part_floats,
            kraw: region[2],
            k: region[3],
            v: region[4],
            aux: region[5],
            xb: region[6],
            ids: at(0),
            table: PageTable {
                pages: at(staged.fixed),
                seq_off: at(2 * n),
                pos: at(n),
                groups: at(staged.groups_at),
                n_groups: staged.n_groups,
            },
            dst: at(3 * n),
            slot: at(4 * n),
            rows: at(5 * n),
            split: (split_tiles > 0).then_some(SplitKv {
                addr: region[7],
                cap_tiles: split_tiles,
            }),
        };

        Ok((a, growth))
    }

    /// On the second sight of a decode shape, captures its launches as a
    /// graph (two, the part after the last attention apart, when the K/V
    /// rows are copied back early).
    fn capture(
        &self,
        st: &mut State,
        shape: Shape,
        ops: usize,
        cut: usize,
        early: bool,
        runner: &mut Runner,
    ) -> Result<(), EngineError> {
        let gpu = &*self.gpu;
        let seen = st.seen.entry(shape).or_insert(0);
        *seen += 1;
        if *seen >= 2 && st.graphs.len() < MAX_GRAPHS {
            let mut moe = st.moe.take();
            gpu.begin_capture().map_err(gpu_err)?;
            let r = if early {
                runner.run(0..cut, None, &mut moe)
            } else {
                runner.run(0..ops, None, &mut moe)
            };
            let g = gpu.end_capture().map_err(gpu_err)?;
            r?;
            let head = if early {
                gpu.begin_capture().map_err(gpu_err)?;
                let r = runner.run(cut..ops, None, &mut moe);
                let h = gpu.end_capture().map_err(gpu_err)?;
                r?;
                h
            } else {
                None
            };
            st.moe = moe;
            if let Some(layers) = g {
                if !early || head.is_some() {
                    st.graphs.insert(shape, StepGraph { layers, head });
                }
            }
        }
        Ok(())
    }

    /// Launches the step (its graph, or op by op), brings back the logits
    /// rows and the step's K/V rows into the host store (overlapped with the
    /// launch where the choices say), and records the step's timing.
    #[allow(clippy::too_many_arguments)]
    fn launch_and_bring_back(
        &self,
        st: &mut State,
        kv: &mut dyn KvCache,
        spans: &[SeqSpan],
        tok: &[(usize, usize)],
        threads: &Threads,
        a: &Addrs,
        runner: &mut Runner,
        c: Choice,
        step: Launched,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        let gpu = &*self.gpu;
        let Launched {
            shape,
            cut,
            growth,
            entered,
        } = step;
        let Choice {
            graphs,
            per_layer,
            early,
            ..
        } = c;
        let prog = runner.prog;
        let (n, w) = (runner.n, runner.m);
        let vocab = prog.decl(prog.logits).width;
        let (kvd, adim, layers) = (
            runner.plan.kv.kv_dim,
            runner.plan.kv.aux_dim,
            runner.plan.kv.layers,
        );
        let dims = Dims {
            w,
            vocab,
            kvd,
            adim,
            layers,
        };
        // Back: logits rows and the step's K/V rows, `(layers, n, kvd)` each,
        // then the indexer keys `(layers, n, adim)`.
        let per = layers * n * kvd;
        let per_aux = layers * n * adim;
        let grow = |buf: &mut Option<Pinned>, len: usize| -> Result<(), EngineError> {
            if buf.as_ref().is_none_or(|b| b.len() < len) {
                *buf = None;
                *buf = Some(
                    gpu.alloc_pinned(len.next_power_of_two().max(1))
                        .map_err(gpu_err)?,
                );
            }
            Ok(())
        };
        let grown = std::time::Instant::now();
        grow(&mut st.host_logits, w * vocab)?;
        grow(&mut st.host_kv, 2 * per + per_aux)?;
        let growth = growth + grown.elapsed().as_secs_f64();
        if self.profiling {
            // Device and pinned host buffers grown for this step's shape
            // (once per larger shape; the rest of "other" is host work).
            self.add_time("buffer growth", growth);
        }
        let runs = step_runs(spans);
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
        // last attention and before the rest.
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
                let mut moe = st.moe.take();
                let per_layer_copy = overlap.as_mut().filter(|_| per_layer);
                let r = runner.run(0..cut, per_layer_copy, &mut moe);
                let r = r.and_then(|_| copy_all(&mut overlap));
                let r = r.and_then(|_| runner.run(cut..prog.ops.len(), None, &mut moe));
                st.moe = moe;
                r?;
            }
        }
        let end = timing.then(|| gpu.mark()).transpose().map_err(gpu_err)?;
        let launched = std::time::Instant::now();
        let logits_at = runner.logits_addr();
        let mut waited = launched;
        let mut copied = None;
        let rows_per = n * kvd;
        // Layer by layer (a slot a layer), or all at once (one slot); a step
        // whose launch queued neither (the fused form) downloads after it
        // (an Overlap waits for any copies it queued when dropped). The
        // logits rows follow the K/V rows on the copy stream, queued after
        // the rest, so they come back while the host writes the K/V rows.
        let host_logits = &mut st.host_logits;
        let overlapped = overlap
            .filter(|o| o.queued() == if per_layer { layers } else { 1 })
            .map(|mut ov| -> Result<Vec<Vec<f32>>, EngineError> {
                let hl = host_logits
                    .as_mut()
                    .ok_or(EngineError::Device("no host buffers".into()))?;
                let mut lo = gpu.overlap(hl).map_err(gpu_err)?;
                lo.queue(&[(logits_at, 0, w * vocab)]).map_err(gpu_err)?;
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
                let (out, c, t) = self
                    .download_and_write(st, kv, spans, tok, threads, a, logits_at, timing, dims)?;
                copied = c;
                waited = t;
                out
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

    /// The plain download after the launch: the logits rows, the K/V rows
    /// and indexer keys in one wait, then the host store's writes; returns
    /// the logits per span, the event after the copies (when timing) and
    /// when the wait ended.
    #[allow(clippy::too_many_arguments)]
    fn download_and_write(
        &self,
        st: &mut State,
        kv: &mut dyn KvCache,
        spans: &[SeqSpan],
        tok: &[(usize, usize)],
        threads: &Threads,
        a: &Addrs,
        logits_at: u64,
        timing: bool,
        dims: Dims,
    ) -> Result<Downloaded, EngineError> {
        let gpu = &*self.gpu;
        let n = tok.len();
        let Dims {
            w,
            vocab,
            kvd,
            adim,
            layers,
        } = dims;
        let (per, per_aux) = (layers * n * kvd, layers * n * adim);
        let runs = step_runs(spans);
        let mut copied = None;
        let (Some(hl), Some(hkv)) = (st.host_logits.as_mut(), st.host_kv.as_mut()) else {
            return Err(EngineError::Device("no host buffers".into()));
        };
        self.timed("download (logits, K/V rows)", || {
            // One copy each, one wait.
            let l = hl.as_mut_slice().map_err(gpu_err)?;
            let s = hkv.as_mut_slice().map_err(gpu_err)?;
            let (hk, rest) = s.split_at_mut(per);
            let (hv, hx) = rest.split_at_mut(per);
            let mut copies: Vec<(u64, &mut [f32])> = vec![
                (logits_at, &mut l[..w * vocab]),
                (a.k, &mut hk[..]),
                (a.v, &mut hv[..]),
            ];
            if per_aux > 0 {
                copies.push((a.aux, &mut hx[..per_aux]));
            }
            copied = gpu.dtoh_many(&mut copies, timing).map_err(gpu_err)?;
            Ok(())
        })?;
        let waited = std::time::Instant::now();
        let s = hkv.as_slice().map_err(gpu_err)?;
        let (hk, rest) = s.split_at(per);
        let (hv, hx) = rest.split_at(per);
        self.timed("host K/V writes", || {
            // `write_step` copies the layers across `threads`.
            kv.write_step(&runs, layers, hk, hv, threads);
            if per_aux > 0 {
                for li in 0..layers {
                    for (i, &(si, pos)) in tok.iter().enumerate() {
                        let r = (li * n + i) * adim;
                        kv.write_aux(spans[si].seq, li, pos, &hx[r..r + adim]);
                    }
                }
            }
            Ok(())
        })?;
        let logits = hl.as_slice().map_err(gpu_err)?;
        let out = self.timed("logits rows into per-span vectors", || {
            Ok(crate::model::split_rows(
                spans,
                &logits[..w * vocab],
                vocab,
                threads,
            ))
        })?;
        Ok((out, copied, waited))
    }

    /// The device scratch of a MoE op, at least `floats` (kept across steps).
    pub(super) fn moe_scratch(
        &self,
        slot: &mut Option<(DevBuf, usize)>,
        floats: usize,
    ) -> Result<u64, EngineError> {
        let bytes = floats * 4;
        if slot.as_ref().is_none_or(|(_, b)| *b < bytes) {
            *slot = None;
            let cap = bytes.next_power_of_two().max(1 << 16);
            let b = self
                .gpu
                .alloc(cap, "the experts' rows of a step")
                .map_err(gpu_err)?;
            *slot = Some((b, cap));
        }
        Ok(slot.as_ref().map_or(0, |(b, _)| b.ptr()))
    }
}

/// The plan of `prog` (made once per program, kept with it).
fn plan_of(st: &mut State, prog: &Arc<Program>, tables: &Tables) -> Result<Arc<Plan>, EngineError> {
    if let Some((_, p)) = st.plans.iter().find(|(q, _)| Arc::ptr_eq(q, prog)) {
        return Ok(p.clone());
    }
    let plan = Plan::new(prog, tables).map_err(|e| {
        EngineError::Device(format!("the step's program cannot run on the device: {e}"))
    })?;
    let patched = |o: &&Op| matches!(o, Op::RopeKvAttend { spec, .. } if spec.patched());
    if let Some(op) = prog.ops.iter().find(patched) {
        let what = op.name();
        return Err(EngineError::Device(format!(
            "the op {what} with an attention patch has no device kernel"
        )));
    }
    let plan = Arc::new(plan);
    st.plans.push((prog.clone(), plan.clone()));
    Ok(plan)
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
