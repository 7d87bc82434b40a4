//! Attention variants used by engine patches (see `lmrr_engine::patches`):
//! split-K decode merged as a tree, and an approximate exp. These are the
//! *non*-canonical paths replay exists to catch; they are scalar and slow on
//! purpose (clarity over speed), and never used by the reference engine.
//!
//! With `splits == 1` and the deterministic exp, [`attention_variant`] is
//! bitwise [`crate::attention_ref`] (same tiles, same merges): a patch only
//! changes bits where it claims to.

use crate::attention::{AttnShape, AttnTask};
use crate::exp::{det_exp, LN2_HI, LN2_LO, LOG2E, ROUND_MAGIC};
use crate::threads::{SendPtr, Threads};
use crate::ATTN_TILE;

/// Which exp the softmax uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpKind {
    Det,
    /// Same range reduction as `det_exp`, degree-3 Taylor polynomial
    /// (relative error up to ~6e-4).
    Fast,
}

/// Approximate exp (the `fast-exp` patch).
pub fn fast_exp(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    if x > crate::exp::EXP_HI {
        return f32::INFINITY;
    }
    if x < crate::exp::EXP_LO {
        return 0.0;
    }
    let t = x * LOG2E;
    let n = (t + ROUND_MAGIC) - ROUND_MAGIC;
    let r = n.mul_add(-LN2_HI, x);
    let r = n.mul_add(-LN2_LO, r);
    let p = (1.0f32 / 6.0)
        .mul_add(r, 0.5)
        .mul_add(r, 1.0)
        .mul_add(r, 1.0);
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

fn exp_of(kind: ExpKind) -> fn(f32) -> f32 {
    match kind {
        ExpKind::Det => det_exp,
        ExpKind::Fast => fast_exp,
    }
}

/// Online-softmax state over a key range.
struct State {
    m: f32,
    l: f32,
    acc: Vec<f32>,
}

/// Tile-ordered state over keys `j0..j1` (tiles at absolute positions).
fn partial(
    task: &AttnTask,
    h: usize,
    shape: &AttnShape,
    scale: f32,
    j0: usize,
    j1: usize,
    exp: fn(f32) -> f32,
) -> State {
    let (hd, kvd) = (shape.head_dim, shape.kv_dim());
    let kvh = h / (shape.n_heads / shape.n_kv_heads);
    let q = &task.q[h * hd..(h + 1) * hd];
    let mut st = State {
        m: f32::NEG_INFINITY,
        l: 0.0,
        acc: vec![0.0; hd],
    };
    let mut a = j0;
    while a < j1 {
        let b = ((a / ATTN_TILE + 1) * ATTN_TILE).min(j1);
        let s: Vec<f32> = (a..b)
            .map(|j| crate::dot_ref(q, &task.kv.key(j, kvd)[kvh * hd..(kvh + 1) * hd]) * scale)
            .collect();
        let mut mt = f32::NEG_INFINITY;
        for &v in &s {
            if v > mt {
                mt = v;
            }
        }
        let m_new = if mt > st.m { mt } else { st.m };
        let alpha = exp(st.m - m_new);
        let p: Vec<f32> = s.iter().map(|&v| exp(v - m_new)).collect();
        let mut lt = 0.0f32;
        for &v in &p {
            lt += v;
        }
        let mut acc_t = vec![0.0f32; hd];
        for (j, &pj) in (a..b).zip(&p) {
            let vr = &task.kv.value(j, kvd)[kvh * hd..(kvh + 1) * hd];
            for d in 0..hd {
                acc_t[d] = pj.mul_add(vr[d], acc_t[d]);
            }
        }
        st.l = st.l * alpha + lt;
        for d in 0..hd {
            st.acc[d] = st.acc[d] * alpha + acc_t[d];
        }
        st.m = m_new;
        a = b;
    }
    st
}

fn merge(x: State, y: State, exp: fn(f32) -> f32) -> State {
    let m = if y.m > x.m { y.m } else { x.m };
    let (ax, ay) = (exp(x.m - m), exp(y.m - m));
    State {
        m,
        l: x.l * ax + y.l * ay,
        acc: x
            .acc
            .iter()
            .zip(&y.acc)
            .map(|(&a, &b)| a * ax + b * ay)
            .collect(),
    }
}

/// Attention with `splits[i]` key splits for task `i`, merged pairwise as a
/// tree, and the chosen exp.
pub fn attention_variant(
    threads: &Threads,
    tasks: &[AttnTask],
    splits: &[usize],
    shape: &AttnShape,
    scale: f32,
    exp: ExpKind,
    out: &mut [f32],
) {
    assert_eq!(
        splits.len(),
        tasks.len(),
        "attention_variant: one split count per task"
    );
    assert_eq!(
        out.len(),
        tasks.len() * shape.q_dim(),
        "attention_variant: out is not (tasks, q_dim)"
    );
    let (hd, nh) = (shape.head_dim, shape.n_heads);
    let e = exp_of(exp);
    let items = tasks.len() * nh;
    let op = SendPtr(out.as_mut_ptr());
    threads.for_ranges(items, threads.grain(items, 1), |range| {
        for item in range {
            let (ti, h) = (item / nh, item % nh);
            let task = &tasks[ti];
            let n = task.pos + 1;
            let s = splits[ti].clamp(1, n);
            let mut states: Vec<State> = (0..s)
                .map(|i| partial(task, h, shape, scale, i * n / s, (i + 1) * n / s, e))
                .collect();
            while states.len() > 1 {
                let mut next = Vec::with_capacity(states.len().div_ceil(2));
                let mut it = states.into_iter();
                while let Some(x) = it.next() {
                    next.push(match it.next() {
                        Some(y) => merge(x, y, e),
                        None => x,
                    });
                }
                states = next;
            }
            let st = states.pop().expect("at least one split");
            // SAFETY: item `(ti, h)` owns `out[item·hd .. (item+1)·hd]` exclusively.
            let o = unsafe { std::slice::from_raw_parts_mut(op.get().add(item * hd), hd) };
            for d in 0..hd {
                o[d] = st.acc[d] / st.l;
            }
        }
    });
}
