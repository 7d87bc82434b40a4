//! Canonical reductions: dot product and sum in the chunked lane order.
//!
//! `dot_ref`/`sum_ref` define the order (see the crate header); `dot`/`sum`
//! are the fast paths. A lane starts at `+0.0` and can never become `-0.0`, so
//! padding a short tail with zeros equals skipping it: the SIMD code pads.

use crate::{CHUNK, LANES};

/// Joins the 8 lanes of a chunk: `t[i] = l[i] + l[i+4]`, `u[i] = t[i] + t[i+2]`,
/// result `u[0] + u[1]`.
#[inline]
pub fn lane_tree(l: &[f32; LANES]) -> f32 {
    let t = [l[0] + l[4], l[1] + l[5], l[2] + l[6], l[3] + l[7]];
    let u = [t[0] + t[2], t[1] + t[3]];
    u[0] + u[1]
}

/// Reference dot product in the canonical order. Panics if lengths differ.
pub fn dot_ref(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot: length mismatch");
    let mut total = 0.0f32;
    for (ca, cb) in a.chunks(CHUNK).zip(b.chunks(CHUNK)) {
        let mut lanes = [0.0f32; LANES];
        for (i, (&x, &y)) in ca.iter().zip(cb).enumerate() {
            lanes[i % LANES] = x.mul_add(y, lanes[i % LANES]);
        }
        total += lane_tree(&lanes);
    }
    total
}

/// Reference sum in the canonical order (lanes add instead of fma; `fma(x, 1,
/// acc)` would give the same bits).
pub fn sum_ref(a: &[f32]) -> f32 {
    let mut total = 0.0f32;
    for c in a.chunks(CHUNK) {
        let mut lanes = [0.0f32; LANES];
        for (i, &x) in c.iter().enumerate() {
            lanes[i % LANES] += x;
        }
        total += lane_tree(&lanes);
    }
    total
}

/// Fast dot product, bitwise equal to [`dot_ref`].
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot: length mismatch");
    #[cfg(target_arch = "x86_64")]
    if crate::use_avx2() {
        // SAFETY: AVX2 and FMA were detected at run time; lengths are equal.
        return unsafe { crate::x86::dot(a, b) };
    }
    dot_ref(a, b)
}

/// Fast sum, bitwise equal to [`sum_ref`].
pub fn sum(a: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if crate::use_avx2() {
        // SAFETY: AVX2 and FMA were detected at run time.
        return unsafe { crate::x86::sum(a) };
    }
    sum_ref(a)
}
