//! Softmax: `m = max x` (sequential, NaN ignored), `e[i] = det_exp(x[i] − m)`,
//! `s` = canonical sum of `e`, `p[i] = e[i] / s`.

use crate::exp::{det_exp, exp_slice};
use crate::reduce::{sum, sum_ref};

fn max_seq(x: &[f32]) -> f32 {
    let mut m = f32::NEG_INFINITY;
    for &v in x {
        if v > m {
            m = v;
        }
    }
    m
}

/// Scalar reference.
pub fn softmax_ref(x: &[f32], out: &mut [f32]) {
    assert_eq!(x.len(), out.len(), "softmax: length mismatch");
    let m = max_seq(x);
    for (o, &v) in out.iter_mut().zip(x) {
        *o = det_exp(v - m);
    }
    let s = sum_ref(out);
    for o in out.iter_mut() {
        *o /= s;
    }
}

/// Fast path, bitwise equal to [`softmax_ref`].
pub fn softmax(x: &[f32], out: &mut [f32]) {
    assert_eq!(x.len(), out.len(), "softmax: length mismatch");
    let m = max_seq(x);
    for (o, &v) in out.iter_mut().zip(x) {
        *o = v - m;
    }
    let shifted = out.to_vec();
    exp_slice(&shifted, out);
    let s = sum(out);
    for o in out.iter_mut() {
        *o /= s;
    }
}
