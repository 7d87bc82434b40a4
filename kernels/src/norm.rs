//! RMSNorm: `y[i] = (x[i] · inv) · w[i]` with `inv = 1 / sqrt(ss / n + eps)` and
//! `ss` the canonical dot of `x` with itself (chunk rule). Rows are normalised
//! independently.

use crate::reduce::{dot, dot_ref};

#[inline]
fn inv_rms(ss: f32, n: usize, eps: f32) -> f32 {
    1.0 / (ss / n as f32 + eps).sqrt()
}

fn check(x: &[f32], w: &[f32], out: &[f32]) {
    assert!(!w.is_empty(), "rms_norm: empty weight");
    assert_eq!(
        x.len() % w.len(),
        0,
        "rms_norm: input not a whole number of rows"
    );
    assert_eq!(x.len(), out.len(), "rms_norm: output length mismatch");
}

/// Scalar reference over rows of `w.len()` elements.
pub fn rms_norm_ref(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    check(x, w, out);
    let d = w.len();
    for (xr, or) in x.chunks(d).zip(out.chunks_mut(d)) {
        let inv = inv_rms(dot_ref(xr, xr), d, eps);
        for ((o, &v), &g) in or.iter_mut().zip(xr).zip(w) {
            *o = (v * inv) * g;
        }
    }
}

/// Fast path, bitwise equal to [`rms_norm_ref`].
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    check(x, w, out);
    let d = w.len();
    for (xr, or) in x.chunks(d).zip(out.chunks_mut(d)) {
        let inv = inv_rms(dot(xr, xr), d, eps);
        #[cfg(target_arch = "x86_64")]
        if crate::use_avx2() {
            // SAFETY: AVX2+FMA detected; `xr`, `w`, `or` have length `d`.
            unsafe { avx2(xr, w, inv, or) };
            continue;
        }
        for ((o, &v), &g) in or.iter_mut().zip(xr).zip(w) {
            *o = (v * inv) * g;
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2(x: &[f32], w: &[f32], inv: f32, out: &mut [f32]) {
    use std::arch::x86_64::*;
    let iv = _mm256_set1_ps(inv);
    crate::x86::zip8(x, w, out, |a, g| _mm256_mul_ps(_mm256_mul_ps(a, iv), g));
}
