//! The sharded ops of the rank simulator ([`super::sim`]): column- and
//! row-parallel matmuls, attention over each rank's heads, and experts on
//! their ranks. Each function takes the ranks' buffers already in the
//! layouts the plan needs and leaves the outputs in the layouts it states.

use std::ops::Range;

use lmrr_kernels::{self as k, AttnShape};

use super::plan::Cut;
use super::shard::RankWeights;
use super::sim::{add_bias, attend_heads, expert, route, slice, ExpertOuts, Ranks};
use super::TpError;
use crate::kv::KvCache;
use crate::model::exec::mla;
use crate::model::exec::program::{Op, Rows, Tables};
use crate::model::exec::Step;
use crate::model::ops::Ops;
use crate::EngineError;

/// Column-parallel: each rank multiplies the whole input by its rows of
/// each job's matrix (`outs[job][rank]`), bias slice added.
pub(super) fn col_matmul(
    ranks: &mut Ranks,
    weights: &[RankWeights],
    op: &Op,
    outs: &[Vec<Range<usize>>],
    tables: &Tables,
    ops: &Ops,
    i: usize,
) -> Result<(), EngineError> {
    let Op::Matmul { x, jobs } = op else {
        return Err(not(op, i, "matmul"));
    };
    let n = ranks.rows(*x);
    for (r, w) in weights.iter().enumerate() {
        let xs = std::mem::take(&mut ranks.bufs[r][x.0 as usize]);
        let mats = jobs
            .iter()
            .zip(outs)
            .map(|(j, o)| slice(w, r, j.w, Cut::Rows(o[r].start, o[r].end), tables, i))
            .collect::<Result<Vec<_>, TpError>>()?;
        let mut ys: Vec<Vec<f32>> = jobs
            .iter()
            .zip(outs)
            .map(|(_, o)| vec![0.0; n * o[r].len()])
            .collect();
        {
            let mut work: Vec<(&k::Matrix, &mut [f32])> = mats
                .iter()
                .zip(ys.iter_mut())
                .map(|(m, y)| (m, &mut y[..]))
                .collect();
            ops.matmuls(&xs, n, &mut work)?;
        }
        for ((j, o), mut y) in jobs.iter().zip(outs).zip(ys) {
            if let Some(b) = j.bias {
                add_bias(&mut y, &tables.vecs[b.0 as usize][o[r].clone()]);
            }
            ranks.bufs[r][j.out.0 as usize] = y;
        }
        ranks.bufs[r][x.0 as usize] = xs;
    }
    Ok(())
}

/// Row-parallel: each rank computes the chunk partials of its input
/// columns (`ranges[rank]`); the partials are gathered, and every rank adds
/// them in chunk order (rank order, then each rank's chunks) from `+0.0`,
/// then the bias.
pub(super) fn row_matmul(
    ranks: &mut Ranks,
    weights: &[RankWeights],
    op: &Op,
    ranges: &[Range<usize>],
    tables: &Tables,
    i: usize,
) -> Result<(), EngineError> {
    let Op::Matmul { x, jobs } = op else {
        return Err(not(op, i, "matmul"));
    };
    let n = ranks.rows(*x);
    for j in jobs {
        let rows = tables.mats[j.w.0 as usize].shape[0];
        // partials[rank]: (n, rows, chunks of the rank's slice).
        let mut partials: Vec<(usize, Vec<f32>)> = Vec::with_capacity(weights.len());
        for (r, w) in weights.iter().enumerate() {
            let cut = Cut::Cols(ranges[r].start, ranges[r].end);
            let m = slice(w, r, j.w, cut, tables, i)?;
            let nc = k::partials::chunks_of(m.cols);
            let mut p = vec![0.0; n * rows * nc];
            k::matmul_partials(&ranks.bufs[r][x.0 as usize], n, &m, &mut p);
            partials.push((nc, p));
        }
        // The gather: every rank receives every rank's partials (a copy).
        for r in 0..weights.len() {
            let got: Vec<(usize, Vec<f32>)> = partials.clone();
            let mut y = vec![0.0; n * rows];
            for (o, yo) in y.iter_mut().enumerate() {
                *yo = k::sum_partials(
                    got.iter()
                        .flat_map(|(nc, p)| p[o * nc..(o + 1) * nc].iter().copied()),
                );
            }
            if let Some(b) = j.bias {
                add_bias(&mut y, tables.vecs[b.0 as usize]);
            }
            ranks.bufs[r][j.out.0 as usize] = y;
        }
    }
    Ok(())
}

/// Attention over each rank's heads: RoPE on the rank's q and k columns, the
/// K/V rows gathered from every rank into the store, then each rank's heads
/// over their keys.
#[allow(clippy::too_many_arguments)]
pub(super) fn head_attend(
    ranks: &mut Ranks,
    op: &Op,
    qr: &[Range<usize>],
    kvr: &[Range<usize>],
    tables: &Tables,
    step: &Step,
    kv: &mut dyn KvCache,
    ops: &Ops,
) -> Result<(), EngineError> {
    let Op::RopeKvAttend {
        layer,
        rope,
        q,
        k: kb,
        v,
        out,
        spec,
    } = op
    else {
        return Err(not(op, 0, "rope_kv_attend"));
    };
    let table = tables.ropes[*rope];
    let n = step.tok.len();
    for (r, bufs) in ranks.bufs.iter_mut().enumerate() {
        let (qd, kvd) = (qr[r].len(), kvr[r].len());
        for (i, &(_, pos)) in step.tok.iter().enumerate() {
            if qd > 0 {
                ops.rope_row(table, &mut bufs[q.0 as usize][i * qd..(i + 1) * qd], pos)?;
            }
            if kvd > 0 {
                ops.rope_row(table, &mut bufs[kb.0 as usize][i * kvd..(i + 1) * kvd], pos)?;
            }
        }
    }
    // The K/V rows of the store, gathered from the ranks' heads.
    let (ks, vs) = (ranks.gather(*kb), ranks.gather(*v));
    let full_kv = spec.shape.kv_dim();
    for (i, &(si, pos)) in step.tok.iter().enumerate() {
        let row = i * full_kv..(i + 1) * full_kv;
        kv.write(step.spans[si].seq, *layer, pos, &ks[row.clone()], &vs[row]);
    }
    let hd = spec.shape.head_dim;
    for (r, bufs) in ranks.bufs.iter_mut().enumerate() {
        let shape = AttnShape {
            n_heads: qr[r].len() / hd,
            n_kv_heads: kvr[r].len() / hd,
            head_dim: hd,
        };
        let mut o = vec![0.0; n * qr[r].len()];
        attend_heads(
            step,
            kv,
            ops,
            *layer,
            full_kv,
            &kvr[r],
            &bufs[q.0 as usize],
            &shape,
            spec,
            &mut o,
        )?;
        bufs[out.0 as usize] = o;
    }
    Ok(())
}

/// Experts on their ranks: every rank routes every row (the router is
/// replicated); rank `owner[e]` runs routed expert `e` on the rows routed to
/// it, rank 0 the shared expert; the outputs are gathered and every rank
/// combines each row in the canonical order (`moe_combine`).
pub(super) fn expert_moe(
    ranks: &mut Ranks,
    op: &Op,
    owner: &[usize],
    tables: &Tables,
    step: &Step,
    ops: &Ops,
) -> Result<(), EngineError> {
    let Op::Moe {
        x,
        out,
        router,
        experts,
        shared,
        routing,
    } = op
    else {
        return Err(not(op, 0, "moe"));
    };
    let rows = ranks.rows(*x);
    if rows == 0 {
        return Ok(());
    }
    let ids: Vec<u32> = match ranks.kind(*x) {
        Rows::Tokens => step.ids.clone(),
        Rows::Wanted => step.rows.iter().map(|&i| step.ids[i]).collect(),
    };
    let degree = ranks.bufs.len();
    let ne = experts.len();
    // Per rank: its routes, then its experts' outputs.
    let mut routes_of = Vec::with_capacity(degree);
    let mut outs_of: Vec<RankOuts> = Vec::with_capacity(degree);
    for r in 0..degree {
        let xs = &ranks.bufs[r][x.0 as usize];
        let d = xs.len() / rows;
        let mut logits = vec![0.0f32; rows * ne];
        ops.matmuls(
            xs,
            rows,
            &mut [(&tables.mats[router.0 as usize].matrix(), &mut logits)],
        )?;
        let routes: Vec<k::Route> = logits
            .chunks(ne)
            .zip(&ids)
            .map(|(l, &t)| route(routing, tables, t, l))
            .collect();
        let base = match shared {
            Some(e) if r == 0 => Some(expert(ops, tables, e, xs, rows)?),
            _ => None,
        };
        let mut mine = Vec::new();
        for (e, mats) in experts.iter().enumerate().filter(|(e, _)| owner[*e] == r) {
            let toks: Vec<usize> = (0..rows)
                .filter(|&t| routes[t].experts.contains(&e))
                .collect();
            if toks.is_empty() {
                continue;
            }
            let mut xe = Vec::with_capacity(toks.len() * d);
            for &t in &toks {
                xe.extend_from_slice(&xs[t * d..(t + 1) * d]);
            }
            mine.push((e, expert(ops, tables, mats, &xe, toks.len())?));
        }
        routes_of.push(routes);
        outs_of.push((base, mine));
    }
    // The gather: every expert's output (and the shared one) to every rank.
    let d = ranks.bufs[0][x.0 as usize].len() / rows;
    let mut all: ExpertOuts = vec![Vec::new(); ne];
    let mut base = vec![0.0; rows * d];
    for (b, mine) in &outs_of {
        if let Some(b) = b {
            base.clone_from(b);
        }
        for (e, y) in mine {
            all[*e].clone_from(y);
        }
    }
    for (r, routes) in routes_of.iter().enumerate() {
        // `slot[t]`: row t's index in each of its experts' outputs.
        let mut count = vec![0usize; ne];
        let mut o = vec![0.0; rows * d];
        for (t, rt) in routes.iter().enumerate() {
            let mut ys = Vec::with_capacity(rt.experts.len());
            for &e in &rt.experts {
                let j = count[e];
                count[e] += 1;
                ys.push(&all[e][j * d..(j + 1) * d]);
            }
            ops.moe_combine(
                &base[t * d..(t + 1) * d],
                &rt.gates,
                &ys,
                &mut o[t * d..(t + 1) * d],
            )?;
        }
        ranks.bufs[r][out.0 as usize] = o;
    }
    Ok(())
}

/// A rank's shared-expert output (rank 0) and its routed experts' outputs.
type RankOuts = (Option<Vec<f32>>, Vec<(usize, Vec<f32>)>);

/// Multi-head Latent Attention by heads ([`super::plan::Action::MlaHeads`]):
/// rank 0 stores the step's latent rows before any rank attends; each rank
/// runs its heads with its blocks of `k_absorb` and `v_up`; the output
/// columns are gathered (copies) into the whole output on every rank.
#[allow(clippy::too_many_arguments)]
pub(super) fn mla_heads(
    ranks: &mut Ranks,
    weights: &[RankWeights],
    op: &Op,
    heads: &[Range<usize>],
    tables: &Tables,
    step: &Step,
    kv: &mut dyn KvCache,
    ops: &Ops,
    i: usize,
) -> Result<(), EngineError> {
    let Op::MlaAttend {
        q,
        ckv,
        out,
        k_absorb,
        v_up,
        mla,
        ..
    } = op
    else {
        return Err(not(op, i, "mla_attend"));
    };
    let n = ranks.rows(*out);
    let vd = mla.v;
    let mut parts: Vec<Vec<f32>> = Vec::with_capacity(heads.len());
    for (r, (w, h)) in weights.iter().zip(heads).enumerate() {
        let rows = |per: usize| Cut::Rows(h.start * per, h.end * per);
        let part = mla::Heads {
            count: h.len(),
            absorb: slice(w, r, *k_absorb, rows(mla.latent), tables, i)?,
            up: slice(w, r, *v_up, rows(vd), tables, i)?,
            write: r == 0,
        };
        let mut o = vec![0.0; n * h.len() * vd];
        mla::attend(
            op,
            tables,
            step,
            kv,
            ops,
            &part,
            &ranks.bufs[r][q.0 as usize],
            &ranks.bufs[r][ckv.0 as usize],
            None,
            &mut o,
            None,
        )?;
        parts.push(o);
    }
    // The gather: every rank receives every rank's output columns.
    let width = mla.heads * vd;
    let mut full = vec![0.0; n * width];
    for (h, p) in heads.iter().zip(&parts) {
        let (a, len) = (h.start * vd, h.len() * vd);
        for t in 0..n {
            full[t * width + a..t * width + a + len].copy_from_slice(&p[t * len..(t + 1) * len]);
        }
    }
    for bufs in ranks.bufs.iter_mut() {
        bufs[out.0 as usize] = full.clone();
    }
    Ok(())
}

fn not(op: &Op, i: usize, want: &str) -> EngineError {
    TpError::Program {
        op: i,
        name: op.name(),
        msg: format!("planned as {want}"),
    }
    .into()
}
