//! SiLU and SwiGLU: `silu(x) = x / (1 + det_exp(−x))`, `swiglu(g, u) = silu(g)·u`.
//! IEEE division, the deterministic exp, one rounding per written operation.

use crate::exp::det_exp;

/// Scalar SiLU of one value.
#[inline]
pub fn silu_scalar(x: f32) -> f32 {
    x / (1.0 + det_exp(-x))
}

/// `out[i] = silu(x[i])`, scalar reference.
pub fn silu_ref(x: &[f32], out: &mut [f32]) {
    assert_eq!(x.len(), out.len(), "silu: length mismatch");
    for (o, &v) in out.iter_mut().zip(x) {
        *o = silu_scalar(v);
    }
}

/// `out[i] = silu(g[i]) * u[i]`, scalar reference.
pub fn swiglu_ref(g: &[f32], u: &[f32], out: &mut [f32]) {
    assert!(
        g.len() == u.len() && g.len() == out.len(),
        "swiglu: length mismatch"
    );
    for ((o, &a), &b) in out.iter_mut().zip(g).zip(u) {
        *o = silu_scalar(a) * b;
    }
}

/// Fast SiLU, bitwise equal to [`silu_ref`].
pub fn silu(x: &[f32], out: &mut [f32]) {
    assert_eq!(x.len(), out.len(), "silu: length mismatch");
    #[cfg(target_arch = "x86_64")]
    if crate::use_avx2() {
        // SAFETY: AVX2+FMA detected; lengths checked above.
        unsafe { avx2::silu(x, out) };
        return;
    }
    silu_ref(x, out)
}

/// Fast SwiGLU, bitwise equal to [`swiglu_ref`].
pub fn swiglu(g: &[f32], u: &[f32], out: &mut [f32]) {
    assert!(
        g.len() == u.len() && g.len() == out.len(),
        "swiglu: length mismatch"
    );
    #[cfg(target_arch = "x86_64")]
    if crate::use_avx2() {
        // SAFETY: AVX2+FMA detected; lengths checked above.
        unsafe { avx2::swiglu(g, u, out) };
        return;
    }
    swiglu_ref(g, u, out)
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use crate::x86::{exp8, map8, zip8};
    use std::arch::x86_64::*;

    #[inline(always)]
    unsafe fn silu8(x: __m256) -> __m256 {
        let neg = _mm256_xor_ps(x, _mm256_set1_ps(-0.0));
        _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0), exp8(neg)))
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn silu(x: &[f32], out: &mut [f32]) {
        map8(x, out, |v| silu8(v));
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn swiglu(g: &[f32], u: &[f32], out: &mut [f32]) {
        zip8(g, u, out, |a, b| _mm256_mul_ps(silu8(a), b));
    }
}
