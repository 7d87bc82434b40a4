//! SiLU and SwiGLU: `silu(x) = x / (1 + det_exp(−x))`, `swiglu(g, u) = silu(g)·u`.
//! GeLU with the tanh approximation and GeGLU: `gelu_tanh(x) = 0.5·x·(1 +
//! tanh(u))` with `u = c·(x + a·x³)`, `c = √(2/π)`, `a = 0.044715` (PyTorch's
//! `gelu(approximate="tanh")`, transformers' `gelu_pytorch_tanh`), evaluated as
//! `x / (1 + det_exp(−2u))` (the same function: `(1 + tanh u)/2 = 1/(1 + e^{−2u})`)
//! so that no libm call and no cancellation near `u = 0` enters; `geglu(g, u)
//! = gelu_tanh(g)·u`.
//! IEEE division, the deterministic exp, one rounding per written operation.

use crate::exp::det_exp;

/// Scalar SiLU of one value.
#[inline]
pub fn silu_scalar(x: f32) -> f32 {
    x / (1.0 + det_exp(-x))
}

/// `√(2/π)` rounded to f32.
const GELU_C: f32 = 0.797_884_6;
/// The cubic coefficient of the tanh approximation (public: the device's
/// `geglu` takes it from the host, so that it is these bits).
pub const GELU_A: f32 = 0.044_715;
/// `−2·√(2/π)` (exact: a power of two times [`GELU_C`]; public, as
/// [`GELU_A`]).
pub const GELU_NEG_2C: f32 = -2.0 * GELU_C;

/// Scalar GeLU (tanh approximation) of one value: `x2 = x·x`, `v = fma(a·x2,
/// x, x)`, `x / (1 + det_exp(v·(−2c)))`.
#[inline]
pub fn gelu_tanh_scalar(x: f32) -> f32 {
    let x2 = x * x;
    let v = (GELU_A * x2).mul_add(x, x);
    x / (1.0 + det_exp(v * GELU_NEG_2C))
}

/// `out[i] = gelu_tanh(g[i]) * u[i]`, scalar reference.
pub fn geglu_ref(g: &[f32], u: &[f32], out: &mut [f32]) {
    assert!(
        g.len() == u.len() && g.len() == out.len(),
        "geglu: length mismatch"
    );
    for ((o, &a), &b) in out.iter_mut().zip(g).zip(u) {
        *o = gelu_tanh_scalar(a) * b;
    }
}

/// Fast GeGLU, bitwise equal to [`geglu_ref`].
pub fn geglu(g: &[f32], u: &[f32], out: &mut [f32]) {
    assert!(
        g.len() == u.len() && g.len() == out.len(),
        "geglu: length mismatch"
    );
    #[cfg(target_arch = "x86_64")]
    if crate::use_avx2() {
        // SAFETY: AVX2+FMA detected; lengths checked above.
        unsafe { avx2::geglu(g, u, out) };
        return;
    }
    geglu_ref(g, u, out)
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

    #[inline(always)]
    unsafe fn gelu8(x: __m256) -> __m256 {
        let x2 = _mm256_mul_ps(x, x);
        let ax2 = _mm256_mul_ps(_mm256_set1_ps(super::GELU_A), x2);
        let v = _mm256_fmadd_ps(ax2, x, x);
        let e = exp8(_mm256_mul_ps(v, _mm256_set1_ps(super::GELU_NEG_2C)));
        _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0), e))
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn geglu(g: &[f32], u: &[f32], out: &mut [f32]) {
        zip8(g, u, out, |a, b| _mm256_mul_ps(gelu8(a), b));
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn swiglu(g: &[f32], u: &[f32], out: &mut [f32]) {
        zip8(g, u, out, |a, b| _mm256_mul_ps(silu8(a), b));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SplitMix64;

    #[test]
    fn geglu_fast_path_is_the_reference_bit_for_bit() {
        let mut r = SplitMix64(43);
        let mut g = r.uniform_vec(1003, 12.0);
        g.extend([
            0.0,
            -0.0,
            1e-30,
            -1e-30,
            40.0,
            -40.0,
            1e20,
            -1e20,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::MAX,
            f32::MIN,
        ]);
        let u = r.uniform_vec(g.len(), 2.0);
        let (mut a, mut b) = (vec![0.0; g.len()], vec![0.0; g.len()]);
        geglu_ref(&g, &u, &mut a);
        geglu(&g, &u, &mut b);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&a), bits(&b));
    }

    #[test]
    fn gelu_tanh_is_pytorchs_formula_within_rounding() {
        for i in -4000..=4000 {
            let x = i as f32 / 400.0;
            let xd = x as f64;
            let c = (2.0 / std::f64::consts::PI).sqrt();
            let want = 0.5 * xd * (1.0 + (c * (xd + 0.044715 * xd * xd * xd)).tanh());
            let got = gelu_tanh_scalar(x) as f64;
            assert!(
                (got - want).abs() <= 1e-6 * (1.0 + want.abs()),
                "x {x}: {got} against {want}"
            );
        }
        assert_eq!(gelu_tanh_scalar(1e20), 1e20);
        assert_eq!(gelu_tanh_scalar(-1e20), 0.0);
        assert!(gelu_tanh_scalar(f32::NAN).is_nan());
    }
}
