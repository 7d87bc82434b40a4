//! The host executor's DeepSeek-V4-class ops: hyper-connection streams
//! ([`Op::Repeat`](super::Op::Repeat), [`Op::HcSinkhorn`](super::Op::HcSinkhorn),
//! [`Op::HcPre`](super::Op::HcPre), [`Op::HcPost`](super::Op::HcPost),
//! [`Op::StreamMean`](super::Op::StreamMean)), the bf16 rounding of the
//! `mhc-bf16` patch, and attention over the positions the sparse indexer
//! selects ([`Op::SparseAttend`](super::Op::SparseAttend)).
//!
//! Invariant: every row is computed from its own token's values alone (the
//! stream mixes and the selection are per token; the indexer's blocks are
//! absolute positions), so results do not depend on batch-mates, chunking or
//! the KV page size.

use lmrr_kernels::{self as k, AttnTask, KvView};

use super::indexer::{IndexerShape, Selection};
use super::program::{AttnSpec, Tables};
use super::Step;
use crate::kv::KvCache;
use crate::model::ops::Ops;
use crate::patches::{Patch, PatchSet};
use crate::synth::f32_to_bf16;
use crate::EngineError;

/// The indexer's choices of one traced token, per layer (for `explain`).
#[derive(Debug, Clone, Default)]
pub struct Trace {
    /// The stacked token whose selections are kept.
    pub token: usize,
    pub chosen: Vec<(usize, Selection)>,
}

/// Rounds to bf16 (nearest, ties to even) and widens back, exactly.
pub fn bf16_round(x: f32) -> f32 {
    f32::from_bits(u32::from(f32_to_bf16(x)) << 16)
}

/// Each row of `x` (width `d`) repeated across the row of `out`.
pub fn repeat(x: &[f32], d: usize, out: &mut [f32]) {
    if d == 0 {
        return;
    }
    let copies = out.len() / x.len().max(1);
    for (xr, or) in x.chunks(d).zip(out.chunks_mut(d * copies)) {
        for c in or.chunks_mut(d) {
            c.copy_from_slice(xr);
        }
    }
}

/// The mean of each row's `streams` pieces of width `d`: a sequential sum
/// from `+0.0` in stream order, then one multiply by `1/streams`.
pub fn stream_mean(x: &[f32], streams: usize, d: usize, out: &mut [f32]) {
    let inv = 1.0 / streams as f32;
    for (xr, or) in x.chunks(streams * d).zip(out.chunks_mut(d)) {
        for (c, o) in or.iter_mut().enumerate() {
            let mut acc = 0.0f32;
            for s in 0..streams {
                acc += xr[s * d + c];
            }
            *o = acc * inv;
        }
    }
}

/// The buffers of one [`Op::SparseAttend`](super::Op::SparseAttend).
pub struct SparseIo<'b> {
    pub q: &'b mut [f32],
    pub k: &'b mut [f32],
    pub v: &'b [f32],
    pub iq: &'b [f32],
    pub ik: &'b [f32],
    pub iw: &'b mut [f32],
    pub out: &'b mut [f32],
}

/// RoPE on q and k, the K/V rows and indexer keys into the KV store at
/// `layer`, the indexer's selection per token (head weights through a
/// sigmoid first: never negative), and attention over the selected
/// positions (gathered in ascending order) or, while dense, the whole
/// sequence.
#[allow(clippy::too_many_arguments)]
pub fn sparse_attend(
    ops: &Ops,
    tables: &Tables,
    step: &Step,
    kv: &mut dyn KvCache,
    layer: usize,
    rope: usize,
    spec: &AttnSpec,
    index: &IndexerShape,
    early_exit: bool,
    io: SparseIo,
    mut trace: Option<&mut Trace>,
) -> Result<(), EngineError> {
    let (qd, kvd) = (spec.shape.q_dim(), spec.shape.kv_dim());
    let (ih, idim) = (index.heads, index.dim);
    let table = tables.ropes[rope];
    for w in io.iw.iter_mut() {
        *w = k::sigmoid(*w);
    }
    for (i, &(si, pos)) in step.tok.iter().enumerate() {
        ops.rope_row(table, &mut io.q[i * qd..(i + 1) * qd], pos)?;
        ops.rope_row(table, &mut io.k[i * kvd..(i + 1) * kvd], pos)?;
        let r = i * kvd..(i + 1) * kvd;
        let seq = step.spans[si].seq;
        kv.write(seq, layer, pos, &io.k[r.clone()], &io.v[r]);
        kv.write_aux(seq, layer, pos, &io.ik[i * idim..(i + 1) * idim]);
    }
    let views: Vec<_> = step.spans.iter().map(|s| kv.view(s.seq, layer)).collect();
    let keys: Vec<_> = step
        .spans
        .iter()
        .map(|s| kv.aux_view(s.seq, layer))
        .collect();
    // Per token: the selection, and for a sparse one its gathered K/V.
    let mut gathered: Vec<Option<(Vec<f32>, Vec<f32>)>> = Vec::with_capacity(step.tok.len());
    for (i, &(si, pos)) in step.tok.iter().enumerate() {
        let sel = index.select(
            ops,
            &io.iq[i * ih * idim..(i + 1) * ih * idim],
            &io.iw[i * ih..(i + 1) * ih],
            &keys[si],
            pos,
            early_exit,
        )?;
        if let Some(t) = trace.as_mut() {
            if t.token == i {
                t.chosen.push((layer, sel.clone()));
            }
        }
        gathered.push(match sel {
            Selection::Dense => None,
            Selection::Sparse { .. } => {
                let at = index.positions(&sel, pos);
                let mut gk = Vec::with_capacity(at.len() * kvd);
                let mut gv = Vec::with_capacity(at.len() * kvd);
                for &p in &at {
                    gk.extend_from_slice(views[si].key(p, kvd));
                    gv.extend_from_slice(views[si].value(p, kvd));
                }
                Some((gk, gv))
            }
        });
    }
    let sparse_views: Vec<Option<KvView>> = gathered
        .iter()
        .map(|g| {
            g.as_ref().map(|(gk, gv)| KvView {
                block_len: gk.len() / kvd,
                k: vec![&gk[..]],
                v: vec![&gv[..]],
            })
        })
        .collect();
    let tasks: Vec<AttnTask> = step
        .tok
        .iter()
        .enumerate()
        .map(|(i, &(si, pos))| match &sparse_views[i] {
            Some(view) => AttnTask {
                q: &io.q[i * qd..(i + 1) * qd],
                kv: view,
                pos: view.block_len - 1,
            },
            None => AttnTask {
                q: &io.q[i * qd..(i + 1) * qd],
                kv: &views[si],
                pos,
            },
        })
        .collect();
    let patches: PatchSet = [
        spec.fast_exp.then_some(Patch::FastExp),
        spec.splitk_decode.then_some(Patch::SplitkDecode),
    ]
    .into_iter()
    .flatten()
    .collect();
    ops.attend_patched(
        &tasks,
        step.spans,
        &step.tok,
        &patches,
        &spec.shape,
        spec.scale(),
        io.out,
    )
}

/// Runs an [`Op::SparseAttend`](super::Op::SparseAttend) over the step's
/// host buffers (any other op: nothing).
pub(super) fn exec(
    op: &super::Op,
    tables: &Tables,
    step: &Step,
    kv: &mut dyn KvCache,
    ops: &Ops,
    bufs: &mut [Vec<f32>],
    trace: Option<&mut Trace>,
) -> Result<(), EngineError> {
    let super::Op::SparseAttend {
        layer,
        rope,
        q,
        k,
        v,
        iq,
        ik,
        iw,
        out,
        spec,
        index,
        early_exit,
    } = op
    else {
        return Ok(());
    };
    let ids = [*q, *k, *v, *iq, *ik, *iw, *out];
    let mut taken: Vec<Vec<f32>> = ids
        .iter()
        .map(|b| std::mem::take(&mut bufs[b.0 as usize]))
        .collect();
    let r = {
        let [qb, kb, vb, iqb, ikb, iwb, ob] = &mut taken[..] else {
            unreachable!("seven buffers taken")
        };
        sparse_attend(
            ops,
            tables,
            step,
            kv,
            *layer,
            *rope,
            spec,
            index,
            *early_exit,
            SparseIo {
                q: qb,
                k: kb,
                v: vb,
                iq: iqb,
                ik: ikb,
                iw: iwb,
                out: ob,
            },
            trace,
        )
    };
    for (b, t) in ids.iter().zip(taken) {
        bufs[b.0 as usize] = t;
    }
    r
}
