//! `det_exp`: a deterministic single-precision exp built from fma/mul/add.
//!
//! Cephes-style: `n = round(x·log2 e)` (by the 1.5·2²³ trick, so no rounding-mode
//! instruction), `r = x − n·ln2` in two fma steps (hi/lo split of ln 2), a
//! degree-5 polynomial in Horner form with fma, then scaling by `2ⁿ` built from
//! the exponent bits. Domain: `x > 88` gives `+inf`, `x < −87` gives `+0` (no
//! subnormal results), NaN is returned unchanged. Max error about 2 ulp over the
//! domain; what matters here is that the scalar and SIMD forms (and the CUDA
//! mirror) execute the same IEEE operations, so they agree bit for bit.

/// Above this, `det_exp` returns `+inf` (keeps `n ≤ 127`).
pub const EXP_HI: f32 = 88.0;
/// Below this, `det_exp` returns `+0` (keeps the result normal).
pub const EXP_LO: f32 = -87.0;
pub(crate) const LOG2E: f32 = std::f32::consts::LOG2_E;
pub(crate) const LN2_HI: f32 = 0.693_359_4;
pub(crate) const LN2_LO: f32 = -2.121_944_4e-4;
pub(crate) const ROUND_MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23
/// Horner coefficients, highest degree first.
pub(crate) const POLY: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];

/// Deterministic exp (see module docs). Scalar reference for all exp uses.
#[inline]
pub fn det_exp(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    if x > EXP_HI {
        return f32::INFINITY;
    }
    if x < EXP_LO {
        return 0.0;
    }
    let t = x * LOG2E;
    let n = (t + ROUND_MAGIC) - ROUND_MAGIC;
    let r = n.mul_add(-LN2_HI, x);
    let r = n.mul_add(-LN2_LO, r);
    let mut p = POLY[0];
    for &c in &POLY[1..] {
        p = p.mul_add(r, c);
    }
    let y = p.mul_add(r * r, r) + 1.0;
    let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
    y * scale
}

/// `out[i] = det_exp(x[i])`, scalar.
pub fn exp_slice_ref(x: &[f32], out: &mut [f32]) {
    assert_eq!(x.len(), out.len(), "exp: length mismatch");
    for (o, &v) in out.iter_mut().zip(x) {
        *o = det_exp(v);
    }
}

/// `out[i] = det_exp(x[i])`, fast path.
pub fn exp_slice(x: &[f32], out: &mut [f32]) {
    assert_eq!(x.len(), out.len(), "exp: length mismatch");
    #[cfg(target_arch = "x86_64")]
    if crate::use_avx2() {
        // SAFETY: AVX2+FMA detected; lengths checked above.
        unsafe { avx2(x, out) };
        return;
    }
    exp_slice_ref(x, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2(x: &[f32], out: &mut [f32]) {
    crate::x86::map8(x, out, |v| crate::x86::exp8(v));
}
