//! Hyper-connection and MoE arithmetic of the mini-v4 family: the sigmoid,
//! the coefficients of the residual-stream mix (Sinkhorn–Knopp projection to a
//! doubly stochastic matrix), the stream mixes and the expert combine.
//!
//! Canonical order, one rounding per written operation:
//! - `sigmoid(x) = 1 / (1 + det_exp(−x))`;
//! - the coefficients of one token from its `2h + h²` raw values: `pre[i] =
//!   sigmoid(raw[i])`, `post[i] = 2·sigmoid(raw[h + i])`, and the residual mix
//!   `M[i][j] = det_exp(raw[2h + i·h + j] − max) + HC_EPS` (max over the h²
//!   raw values, exact), then `iters` Sinkhorn–Knopp rounds, each dividing
//!   every row by its sum and then every column by its sum (sums sequential
//!   from `+0.0` in index order, IEEE division);
//! - every weighted sum over streams or experts is an fma chain in index order
//!   (streams `0..h`, experts ascending), starting from `+0.0` or from the
//!   value it adds to.
//!
//! Everything is per token, so a token's result never depends on its
//! batch-mates (I2). The CUDA mirror executes the same operations.

use crate::exp::det_exp;

/// Added to every entry of the residual mix before Sinkhorn, so that no row
/// or column sums to zero when its raw values underflow.
pub const HC_EPS: f32 = 1e-6;

/// `1 / (1 + det_exp(−x))`.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + det_exp(-x))
}

/// Raw values per token for `h` streams: pre (h), post (h), residual (h²).
pub fn hc_raw_width(h: usize) -> usize {
    2 * h + h * h
}

/// Coefficients of `n` tokens from `raw` `(n, 2h + h²)`: `pre` `(n, h)`,
/// `post` `(n, h)`, `res` `(n, h, h)` doubly stochastic after `iters` rounds.
pub fn hc_coeffs(
    raw: &[f32],
    h: usize,
    iters: usize,
    pre: &mut [f32],
    post: &mut [f32],
    res: &mut [f32],
) {
    let w = hc_raw_width(h);
    let n = raw.len() / w.max(1);
    assert!(
        raw.len() == n * w && pre.len() == n * h && post.len() == n * h && res.len() == n * h * h,
        "hc_coeffs: shapes"
    );
    for t in 0..n {
        let r = &raw[t * w..(t + 1) * w];
        for i in 0..h {
            pre[t * h + i] = sigmoid(r[i]);
            post[t * h + i] = 2.0 * sigmoid(r[h + i]);
        }
        let m = &mut res[t * h * h..(t + 1) * h * h];
        sinkhorn(&r[2 * h..], h, iters, m);
    }
}

/// The Sinkhorn–Knopp projection of one `h × h` block of raw values.
pub fn sinkhorn(raw: &[f32], h: usize, iters: usize, m: &mut [f32]) {
    let mut mx = f32::NEG_INFINITY;
    for &v in raw {
        if v > mx {
            mx = v;
        }
    }
    for (o, &v) in m.iter_mut().zip(raw) {
        *o = det_exp(v - mx) + HC_EPS;
    }
    for _ in 0..iters {
        for i in 0..h {
            let mut s = 0.0f32;
            for j in 0..h {
                s += m[i * h + j];
            }
            for j in 0..h {
                m[i * h + j] /= s;
            }
        }
        for j in 0..h {
            let mut s = 0.0f32;
            for i in 0..h {
                s += m[i * h + j];
            }
            for i in 0..h {
                m[i * h + j] /= s;
            }
        }
    }
}

/// Block input of `n` tokens: `out[t][c] = Σ_i pre[t][i]·x[t][i][c]`, `x`
/// `(n, h, d)`, `out` `(n, d)`.
pub fn hc_pre(x: &[f32], pre: &[f32], h: usize, d: usize, out: &mut [f32]) {
    let n = out.len() / d.max(1);
    assert!(
        x.len() == n * h * d && pre.len() == n * h && out.len() == n * d,
        "hc_pre: shapes"
    );
    for t in 0..n {
        for c in 0..d {
            let mut acc = 0.0f32;
            for i in 0..h {
                acc = pre[t * h + i].mul_add(x[(t * h + i) * d + c], acc);
            }
            out[t * d + c] = acc;
        }
    }
}

/// New streams of `n` tokens: `out[t][i][c] = Σ_j res[t][i][j]·x[t][j][c]`
/// then `+ post[t][i]·y[t][c]`, one fma chain.
pub fn hc_post(
    x: &[f32],
    res: &[f32],
    post: &[f32],
    y: &[f32],
    h: usize,
    d: usize,
    out: &mut [f32],
) {
    let n = y.len() / d.max(1);
    assert!(
        x.len() == n * h * d
            && res.len() == n * h * h
            && post.len() == n * h
            && y.len() == n * d
            && out.len() == n * h * d,
        "hc_post: shapes"
    );
    for t in 0..n {
        for i in 0..h {
            for c in 0..d {
                let mut acc = 0.0f32;
                for j in 0..h {
                    acc = res[(t * h + i) * h + j].mul_add(x[(t * h + j) * d + c], acc);
                }
                out[(t * h + i) * d + c] = post[t * h + i].mul_add(y[t * d + c], acc);
            }
        }
    }
}

/// Expert combine of one token: `out[c] = base[c] + Σ_e gate[e]·y_e[c]`, an
/// fma chain from `base` over the experts in the order given (ascending
/// expert index, by the caller's contract).
pub fn moe_combine(base: &[f32], gates: &[f32], ys: &[&[f32]], out: &mut [f32]) {
    assert!(
        gates.len() == ys.len()
            && base.len() == out.len()
            && ys.iter().all(|y| y.len() == out.len()),
        "moe_combine: shapes"
    );
    for c in 0..out.len() {
        let mut acc = base[c];
        for (g, y) in gates.iter().zip(ys) {
            acc = g.mul_add(y[c], acc);
        }
        out[c] = acc;
    }
}

/// Sparse-attention indexer scores of one query against `keys`:
/// `out[s] = Σ_h w[h]·relu(dot(q_h, keys[s]))`, `q` `(heads, dim)`, the dot
/// canonical ([`crate::dot`]), the head sum an fma chain from `+0.0` in head
/// order.
pub fn index_scores(q: &[f32], w: &[f32], dim: usize, keys: &[&[f32]], out: &mut [f32]) {
    let heads = w.len();
    assert!(
        q.len() == heads * dim && out.len() == keys.len() && keys.iter().all(|k| k.len() == dim),
        "index_scores: shapes"
    );
    for (o, k) in out.iter_mut().zip(keys) {
        let mut acc = 0.0f32;
        for hh in 0..heads {
            let s = crate::dot(&q[hh * dim..(hh + 1) * dim], k);
            let r = if s > 0.0 { s } else { 0.0 };
            acc = w[hh].mul_add(r, acc);
        }
        *o = acc;
    }
}
