//! The rank simulator: a [`Plan`] executed by `degree` CPU ranks in one
//! process. Each rank has its own step buffers (a split buffer holds only
//! the rank's columns) and its own slices of the sharded weights
//! ([`RankWeights`], cut at load); the ranks meet only in the gathers
//! ([`Ranks::gather`]: copies, never a floating-point add), which stand for
//! NCCL's all-gather. The KV store is the serving core's one host store:
//! attention writes the K/V rows assembled from every rank's heads, and each
//! rank reads back its own heads' columns.
//!
//! Invariant: the ranks' logits are equal to one another (checked every
//! step) and to the host executor's at degree 1, bit for bit. A rank failure
//! (injected by [`TpConfig::fail`]) ends the step with
//! [`TpError::RankFailed`] before any rank touches the KV store.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use lmrr_kernels::{self as k, AttnShape, AttnTask, KvView};

use super::plan::{Action, Cut, Layout, Plan};
use super::shard::RankWeights;
use super::{TpConfig, TpError};
use crate::kv::KvCache;
use crate::model::exec::host::{self, Extras};
use crate::model::exec::program::{Buf, Op, Program, Rows, Tables};
use crate::model::exec::{mla, moe, Step};
use crate::model::ops::Ops;
use crate::model::{add_into, SeqSpan};
use crate::patches::{Patch, PatchSet};
use crate::EngineError;

/// A plan and the ranks' weight slices for it.
struct Sharded {
    prog: Arc<Program>,
    plan: Plan,
    weights: Vec<RankWeights>,
}

/// The simulator of one model: its settings, the steps it has run, and a
/// plan per program (cut on first use).
pub struct Simulator {
    cfg: TpConfig,
    steps: AtomicU64,
    sharded: Mutex<Vec<Arc<Sharded>>>,
}

impl Simulator {
    pub fn new(cfg: TpConfig) -> Result<Self, TpError> {
        if cfg.degree == 0 || cfg.degree > super::MAX_DEGREE {
            return Err(TpError::Degree(cfg.degree));
        }
        Ok(Self {
            cfg,
            steps: AtomicU64::new(0),
            sharded: Mutex::new(Vec::new()),
        })
    }

    pub fn degree(&self) -> usize {
        self.cfg.degree
    }

    /// The plan of `prog`, and the ranks' slices, made the first time.
    fn sharded(&self, prog: &Arc<Program>, tables: &Tables) -> Result<Arc<Sharded>, TpError> {
        let mut v = self.sharded.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = v.iter().find(|s| Arc::ptr_eq(&s.prog, prog)) {
            return Ok(s.clone());
        }
        let plan = Plan::new(prog, tables, self.cfg.degree)?;
        let weights = (0..plan.degree)
            .map(|r| RankWeights::load(&plan, tables, r))
            .collect();
        let s = Arc::new(Sharded {
            prog: prog.clone(),
            plan,
            weights,
        });
        v.push(s.clone());
        Ok(s)
    }

    /// Plans `prog` now (a refusal surfaces before any step runs).
    pub fn check(&self, prog: &Arc<Program>, tables: &Tables) -> Result<(), TpError> {
        self.sharded(prog, tables).map(|_| ())
    }

    /// One step after `begin_step`: `prog` over the ranks; the logits split
    /// per span.
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &self,
        ops: &Ops,
        kv: &mut dyn KvCache,
        spans: &[SeqSpan],
        vocab: usize,
        prog: &Arc<Program>,
        tables: &Tables,
        mut extras: Extras,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        let sh = self.sharded(prog, tables)?;
        let step_no = self.steps.fetch_add(1, Ordering::Relaxed);
        let degree = sh.plan.degree;
        if let Some((rank, step)) = self.cfg.fail {
            if step == step_no && rank < degree {
                return Err(TpError::RankFailed { rank, degree, step }.into());
            }
        }
        let step = Step::new(spans);
        let mut ranks = Ranks::new(prog, &step, degree);
        for ((i, op), stage) in prog.ops.iter().enumerate().zip(&sh.plan.stages) {
            for (b, l) in &stage.need {
                ranks.convert(*b, l);
            }
            let t0 = std::time::Instant::now();
            match &stage.action {
                Action::Replicated => {
                    for bufs in ranks.bufs.iter_mut() {
                        host::exec(op, prog, tables, &step, kv, ops, bufs)?;
                    }
                }
                Action::Once => {
                    let bufs0 = &mut ranks.bufs[0];
                    if let Op::MlaAttend { .. } = op {
                        mla::exec(
                            op,
                            tables,
                            &step,
                            kv,
                            ops,
                            bufs0,
                            extras.trace.as_deref_mut(),
                        )?;
                    } else {
                        host::exec(op, prog, tables, &step, kv, ops, bufs0)?;
                    }
                    for b in op.writes() {
                        let v = ranks.bufs[0][b.0 as usize].clone();
                        for bufs in ranks.bufs.iter_mut().skip(1) {
                            bufs[b.0 as usize] = v.clone();
                        }
                    }
                }
                Action::Split => {
                    for bufs in ranks.bufs.iter_mut() {
                        host::exec(op, prog, tables, &step, kv, ops, bufs)?;
                    }
                }
                Action::ColMatmul { outs } => {
                    super::sim_ops::col_matmul(&mut ranks, &sh.weights, op, outs, tables, ops, i)?
                }
                Action::RowMatmul { ranges } => {
                    super::sim_ops::row_matmul(&mut ranks, &sh.weights, op, ranges, tables, i)?
                }
                Action::HeadAttend { q, kv: kvr } => {
                    super::sim_ops::head_attend(&mut ranks, op, q, kvr, tables, &step, kv, ops)?
                }
                Action::ExpertMoe { owner } => {
                    super::sim_ops::expert_moe(&mut ranks, op, owner, tables, &step, ops)?
                }
                Action::MlaHeads { heads } => super::sim_ops::mla_heads(
                    &mut ranks,
                    &sh.weights,
                    op,
                    heads,
                    tables,
                    &step,
                    kv,
                    ops,
                    i,
                )?,
            }
            for (b, l) in &stage.after {
                ranks.lay[b.0 as usize] = l.clone();
            }
            if let Some(p) = extras.profile {
                p.add(op.name(), t0.elapsed().as_secs_f64());
            }
        }
        ranks.convert(prog.logits, &Layout::Full);
        let li = prog.logits.0 as usize;
        for (r, bufs) in ranks.bufs.iter().enumerate().skip(1) {
            let same = bufs[li]
                .iter()
                .zip(&ranks.bufs[0][li])
                .all(|(a, b)| a.to_bits() == b.to_bits());
            if !same {
                return Err(EngineError::Device(format!(
                    "tensor parallelism: rank {r}'s logits differ from rank 0's"
                )));
            }
        }
        let logits = std::mem::take(&mut ranks.bufs[0][li]);
        Ok(crate::model::split_rows(spans, &logits, vocab, ops.threads))
    }
}

/// The ranks' step buffers and the layout of each buffer.
pub(super) struct Ranks<'p> {
    prog: &'p Program,
    tokens: usize,
    wanted: usize,
    /// `bufs[rank][buf]`: a whole buffer, or the rank's columns of it.
    pub(super) bufs: Vec<Vec<Vec<f32>>>,
    pub(super) lay: Vec<Layout>,
}

impl<'p> Ranks<'p> {
    fn new(prog: &'p Program, step: &Step, degree: usize) -> Self {
        let (tokens, wanted) = (step.tok.len(), step.rows.len());
        let one: Vec<Vec<f32>> = prog
            .bufs
            .iter()
            .map(|d| {
                let rows = match d.rows {
                    Rows::Tokens => tokens,
                    Rows::Wanted => wanted,
                };
                vec![0.0; rows * d.width]
            })
            .collect();
        Self {
            prog,
            tokens,
            wanted,
            bufs: vec![one; degree],
            lay: vec![Layout::Full; prog.bufs.len()],
        }
    }

    /// Which rows `b` holds.
    pub(super) fn kind(&self, b: Buf) -> Rows {
        self.prog.decl(b).rows
    }

    /// Rows of `b` in this step.
    pub(super) fn rows(&self, b: Buf) -> usize {
        match self.prog.decl(b).rows {
            Rows::Tokens => self.tokens,
            Rows::Wanted => self.wanted,
        }
    }

    /// The whole of `b` assembled from the ranks' columns (an all-gather:
    /// copies only).
    pub(super) fn gather(&self, b: Buf) -> Vec<f32> {
        let i = b.0 as usize;
        match &self.lay[i] {
            Layout::Full => self.bufs[0][i].clone(),
            Layout::Split(ranges) => {
                let (rows, w) = (self.rows(b), self.prog.decl(b).width);
                let mut full = vec![0.0; rows * w];
                for (r, range) in ranges.iter().enumerate() {
                    let len = range.len();
                    for t in 0..rows {
                        full[t * w + range.start..t * w + range.end]
                            .copy_from_slice(&self.bufs[r][i][t * len..(t + 1) * len]);
                    }
                }
                full
            }
        }
    }

    /// Brings `b` to layout `to` on every rank.
    pub(super) fn convert(&mut self, b: Buf, to: &Layout) {
        let i = b.0 as usize;
        if self.lay[i] == *to {
            return;
        }
        let full = self.gather(b);
        let (rows, w) = (self.rows(b), self.prog.decl(b).width);
        for (r, bufs) in self.bufs.iter_mut().enumerate() {
            bufs[i] = match to {
                Layout::Full => full.clone(),
                Layout::Split(ranges) => columns(&full, rows, w, &ranges[r]),
            };
        }
        self.lay[i] = to.clone();
    }
}

/// Columns `range` of every row of a `rows × w` buffer.
pub(super) fn columns(full: &[f32], rows: usize, w: usize, range: &Range<usize>) -> Vec<f32> {
    (0..rows)
        .flat_map(|t| full[t * w + range.start..t * w + range.end].iter().copied())
        .collect()
}

/// A rank's slice of a sharded matrix, or the error that it does not hold it.
pub(super) fn slice<'w>(
    weights: &'w RankWeights,
    rank: usize,
    m: crate::model::exec::program::Mat,
    cut: Cut,
    tables: &Tables,
    op: usize,
) -> Result<k::Matrix<'w>, TpError> {
    weights
        .get(m, cut)
        .and_then(|s| s.matrix())
        .ok_or_else(|| TpError::Program {
            op,
            name: "matmul",
            msg: format!(
                "rank {rank} holds no slice {cut:?} of `{}`",
                tables.mats[m.0 as usize].name
            ),
        })
}

/// Attention's patch set from its spec.
pub(super) fn attn_patches(fast_exp: bool, splitk: bool) -> PatchSet {
    [
        fast_exp.then_some(Patch::FastExp),
        splitk.then_some(Patch::SplitkDecode),
    ]
    .into_iter()
    .flatten()
    .collect()
}

/// One rank's attention over its heads: K/V columns `kv` of each position
/// copied out of the store into a one-block view per span.
#[allow(clippy::too_many_arguments)]
pub(super) fn attend_heads(
    step: &Step,
    kv: &dyn KvCache,
    ops: &Ops,
    layer: usize,
    full_kv: usize,
    cols: &Range<usize>,
    q: &[f32],
    shape: &AttnShape,
    spec: &crate::model::exec::program::AttnSpec,
    out: &mut [f32],
) -> Result<(), EngineError> {
    let w = cols.len();
    let copies: Vec<(Vec<f32>, Vec<f32>, usize)> = step
        .spans
        .iter()
        .map(|s| {
            let len = s.start + s.tokens.len();
            let view = kv.view(s.seq, layer);
            let (mut kc, mut vc) = (Vec::with_capacity(len * w), Vec::with_capacity(len * w));
            for p in 0..len {
                kc.extend_from_slice(&view.key(p, full_kv)[cols.clone()]);
                vc.extend_from_slice(&view.value(p, full_kv)[cols.clone()]);
            }
            (kc, vc, len.max(1))
        })
        .collect();
    let views: Vec<KvView> = copies
        .iter()
        .map(|(kc, vc, len)| KvView {
            block_len: *len,
            k: vec![&kc[..]],
            v: vec![&vc[..]],
        })
        .collect();
    let qd = shape.q_dim();
    let tasks: Vec<AttnTask> = step
        .tok
        .iter()
        .enumerate()
        .map(|(i, &(si, pos))| AttnTask {
            q: &q[i * qd..(i + 1) * qd],
            kv: &views[si],
            pos,
        })
        .collect();
    if let Some(win) = spec.window {
        if spec.patched() {
            return Err(EngineError::Device(
                "the attention patches fast-exp and splitk-decode have no sliding-window form"
                    .into(),
            ));
        }
        ops.attend_window(&tasks, shape, spec.scale(), win as usize, out)
    } else {
        let patches = attn_patches(spec.fast_exp, spec.splitk_decode);
        ops.attend_patched(
            &tasks,
            step.spans,
            &step.tok,
            &patches,
            shape,
            spec.scale(),
            out,
        )
    }
}

/// Every expert's output rows, as [`moe::run`] keeps them.
pub(super) type ExpertOuts = Vec<Vec<f32>>;

/// Adds `b` (a bias slice) to each row of `o`.
pub(super) fn add_bias(o: &mut [f32], b: &[f32]) {
    if b.is_empty() {
        return;
    }
    for row in o.chunks_mut(b.len()) {
        add_into(row, b);
    }
}

pub(super) use moe::{expert, route};
