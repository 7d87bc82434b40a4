//! Argmax with ties to the lowest index; NaN never wins. `None` for an empty or
//! all-NaN input.

/// Scalar reference.
pub fn argmax_ref(x: &[f32]) -> Option<usize> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in x.iter().enumerate() {
        if v.is_nan() {
            continue;
        }
        match best {
            Some((_, b)) if v <= b => {}
            _ => best = Some((i, v)),
        }
    }
    best.map(|(i, _)| i)
}

/// Fast path: a vector max, then the first index holding it.
pub fn argmax(x: &[f32]) -> Option<usize> {
    #[cfg(target_arch = "x86_64")]
    if crate::use_avx2() {
        // SAFETY: AVX2+FMA detected.
        let m = unsafe { avx2_max(x) };
        return x.iter().position(|&v| v == m);
    }
    argmax_ref(x)
}

/// Largest non-NaN value (`-inf` if none). `max_ps(v, acc)` returns `acc` when
/// `v` is NaN, so NaN lanes are skipped.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2_max(x: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let mut acc = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut i = 0;
    while i + 8 <= x.len() {
        acc = _mm256_max_ps(_mm256_loadu_ps(x.as_ptr().add(i)), acc);
        i += 8;
    }
    let mut lanes = [0.0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
    let mut m = f32::NEG_INFINITY;
    for &v in lanes.iter().chain(&x[i..]) {
        if v > m {
            m = v;
        }
    }
    m
}
