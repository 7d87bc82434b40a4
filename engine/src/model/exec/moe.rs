//! The host executor's [`Op::Moe`](super::Op::Moe): router logits for every
//! row in one matmul, each row's route on the host (`lmrr_kernels::moe`, a
//! function of that row's logits alone), each expert over the rows routed to
//! it (gathered in row order: a matmul row does not depend on the others),
//! the shared experts over every row, and the combine per row
//! (`lmrr_kernels::moe_combine`: shared output or `+0.0` first, then one fma
//! per chosen expert, ascending). Every device computes the same bits: the
//! routing runs on the host for all of them.

use lmrr_kernels::{self as k, GroupTopK, Route};

use super::program::{ExpertMats, Mat, RoutingSpec, Tables};
use crate::model::ops::Ops;
use crate::EngineError;

/// One expert over `rows` rows of `x` (`rows × d`) → `rows × d`.
pub(super) fn expert(
    ops: &Ops,
    tables: &Tables,
    e: &ExpertMats,
    x: &[f32],
    rows: usize,
) -> Result<Vec<f32>, EngineError> {
    let m = |w: Mat| tables.mats[w.0 as usize];
    let (f, d) = (m(e.gate).shape[0], m(e.down).shape[0]);
    let (mut g, mut u) = (vec![0.0; rows * f], vec![0.0; rows * f]);
    ops.matmuls(
        x,
        rows,
        &mut [(&m(e.gate).matrix(), &mut g), (&m(e.up).matrix(), &mut u)],
    )?;
    let mut a = vec![0.0; rows * f];
    ops.swiglu(&g, &u, &mut a)?;
    let mut y = vec![0.0; rows * d];
    ops.matmuls(&a, rows, &mut [(&m(e.down).matrix(), &mut y)])?;
    Ok(y)
}

/// The route of one row (of token id `token`) from its router logits.
pub fn route(routing: &RoutingSpec, tables: &Tables, token: u32, logits: &[f32]) -> Route {
    match *routing {
        RoutingSpec::V4 {
            k,
            scale_bits,
            hash_layer,
            scale_before_norm,
        } => {
            let r = super::routing_v4::Routing {
                n_experts: logits.len(),
                top_k: k,
                scale: f32::from_bits(scale_bits),
                hash_layer,
                scale_before_norm,
            }
            .route(token, logits);
            Route {
                experts: r.experts,
                gates: r.gates,
            }
        }
        RoutingSpec::SoftmaxTopK { k, norm_topk_prob } => {
            k::softmax_topk(logits, k, norm_topk_prob)
        }
        RoutingSpec::SigmoidGroupTopK {
            k,
            n_group,
            topk_group,
            bias,
            norm_topk_prob,
            scale_bits,
        } => k::sigmoid_group_topk(
            logits,
            tables.vecs[bias.0 as usize],
            &GroupTopK {
                k,
                n_group,
                topk_group,
                norm_topk_prob,
                routed_scaling_factor: f32::from_bits(scale_bits),
            },
        ),
    }
}

/// The mixture of experts of `rows` rows of `x` (`rows × d`, row `t` of
/// token id `ids[t]`) into `out`.
#[allow(clippy::too_many_arguments)]
pub fn run(
    ops: &Ops,
    tables: &Tables,
    x: &[f32],
    ids: &[u32],
    rows: usize,
    router: Mat,
    experts: &[ExpertMats],
    shared: Option<&ExpertMats>,
    routing: &RoutingSpec,
    out: &mut [f32],
) -> Result<(), EngineError> {
    if rows == 0 {
        return Ok(());
    }
    let d = x.len() / rows;
    let ne = experts.len();
    let mut logits = vec![0.0f32; rows * ne];
    ops.matmuls(
        x,
        rows,
        &mut [(&tables.mats[router.0 as usize].matrix(), &mut logits)],
    )?;
    let routes: Vec<Route> = logits
        .chunks(ne)
        .zip(ids)
        .map(|(l, &t)| route(routing, tables, t, l))
        .collect();
    let base = match shared {
        Some(e) => expert(ops, tables, e, x, rows)?,
        None => vec![0.0; rows * d],
    };
    // Per expert, the rows routed to it (in row order) and their outputs;
    // `slot[t]` is row t's index in each of its experts' outputs, in the
    // order of its route.
    let mut outs: Vec<Vec<f32>> = vec![Vec::new(); ne];
    let mut slot: Vec<Vec<usize>> = vec![Vec::new(); rows];
    for (e, mats) in experts.iter().enumerate() {
        let toks: Vec<usize> = (0..rows)
            .filter(|&t| routes[t].experts.contains(&e))
            .collect();
        if toks.is_empty() {
            continue;
        }
        let mut xe = Vec::with_capacity(toks.len() * d);
        for (j, &t) in toks.iter().enumerate() {
            xe.extend_from_slice(&x[t * d..(t + 1) * d]);
            slot[t].push(j);
        }
        outs[e] = expert(ops, tables, mats, &xe, toks.len())?;
    }
    for t in 0..rows {
        let r = &routes[t];
        let ys: Vec<&[f32]> = r
            .experts
            .iter()
            .zip(&slot[t])
            .map(|(&e, &j)| &outs[e][j * d..(j + 1) * d])
            .collect();
        ops.moe_combine(
            &base[t * d..(t + 1) * d],
            &r.gates,
            &ys,
            &mut out[t * d..(t + 1) * d],
        )?;
    }
    Ok(())
}
