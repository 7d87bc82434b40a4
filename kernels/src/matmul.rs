//! Matmul `y[t][o] = dot(x[t], W[o])` with `W` row-major `(rows, cols)` as HF
//! `Linear` weights are stored, f32 or bf16 (widened exactly in registers, so a
//! memory-mapped bf16 checkpoint is used in place). Each output is one canonical
//! dot (see [`crate::dot_ref`]).
//!
//! Fast path: 8 outputs per micro-kernel call — 8 rows × 1 token (decode), 4 × 2
//! or 2 × 4 (prefill) — sharing loads, joined by [`crate::x86`]'s `hsum8x`.
//! Threads split the rows; a row's outputs are computed by the same instruction
//! sequence whichever block or thread it falls in, so neither the batch nor the
//! thread count changes a bit.

use crate::threads::{SendPtr, Threads};

/// Storage of a weight matrix. bf16 is kept as raw `u16` bits.
#[derive(Debug, Clone, Copy)]
pub enum Weights<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
}

/// A row-major `(rows, cols)` weight matrix.
#[derive(Debug, Clone, Copy)]
pub struct Matrix<'a> {
    pub w: Weights<'a>,
    pub rows: usize,
    pub cols: usize,
}

impl<'a> Matrix<'a> {
    /// Wraps storage; `None` if its length is not `rows * cols`.
    pub fn new(w: Weights<'a>, rows: usize, cols: usize) -> Option<Self> {
        let len = match w {
            Weights::F32(s) => s.len(),
            Weights::Bf16(s) => s.len(),
        };
        (rows.checked_mul(cols) == Some(len)).then_some(Self { w, rows, cols })
    }

    /// Row `r` widened to f32.
    pub fn row_f32(&self, r: usize) -> Vec<f32> {
        let span = r * self.cols..(r + 1) * self.cols;
        match self.w {
            Weights::F32(s) => s[span].to_vec(),
            Weights::Bf16(s) => s[span].iter().map(|&b| bf16_to_f32(b)).collect(),
        }
    }
}

/// Exact bf16 → f32.
#[inline]
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

fn check(x: &[f32], n: usize, w: &Matrix, y: &[f32]) {
    assert_eq!(x.len(), n * w.cols, "matmul: x is not (n, cols)");
    assert_eq!(y.len(), n * w.rows, "matmul: y is not (n, rows)");
}

/// Scalar reference: one canonical dot per output.
pub fn matmul_ref(x: &[f32], n: usize, w: &Matrix, y: &mut [f32]) {
    check(x, n, w, y);
    for o in 0..w.rows {
        let row = w.row_f32(o);
        for t in 0..n {
            y[t * w.rows + o] = crate::dot_ref(&x[t * w.cols..(t + 1) * w.cols], &row);
        }
    }
}

/// Fast matmul, bitwise equal to [`matmul_ref`] for any thread count.
pub fn matmul(threads: &Threads, x: &[f32], n: usize, w: &Matrix, y: &mut [f32]) {
    check(x, n, w, y);
    if n == 0 || w.rows == 0 {
        return;
    }
    let rows = w.rows;
    let yp = SendPtr(y.as_mut_ptr());
    let grain = threads.grain(rows, 16);
    let avx = crate::use_avx2();
    threads.for_ranges(rows, grain, |range| {
        #[cfg(target_arch = "x86_64")]
        if avx {
            // SAFETY: AVX2+FMA detected; `range` lies within `0..rows`; every
            // worker writes only `y[t * rows + o]` for `o` in its own range.
            unsafe {
                match w.w {
                    Weights::F32(s) => avx2::rows(x, n, s, w.cols, rows, range, yp),
                    Weights::Bf16(s) => avx2::rows(x, n, s, w.cols, rows, range, yp),
                }
            }
            return;
        }
        let _ = avx;
        scalar_rows(x, n, w, range, yp);
    });
}

/// Portable fast path: streams each row once for all tokens.
fn scalar_rows(x: &[f32], n: usize, w: &Matrix, range: std::ops::Range<usize>, yp: SendPtr<f32>) {
    let k = w.cols;
    for o in range {
        let row = w.row_f32(o);
        for t in 0..n {
            let total = crate::dot_ref(&x[t * k..(t + 1) * k], &row);
            // SAFETY: `t * rows + o` is inside `y` and owned by this worker.
            unsafe { *yp.0.add(t * w.rows + o) = total };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::SendPtr;
    use crate::x86::{dot8, Lanes};
    use std::arch::x86_64::*;

    /// Tokens per L2-resident block of activations.
    const TOKEN_BLOCK: usize = 64;

    /// Computes outputs `o ∈ range` for all `n` tokens.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn rows<W: Lanes>(
        x: &[f32],
        n: usize,
        w: &[W],
        k: usize,
        rows: usize,
        range: std::ops::Range<usize>,
        y: SendPtr<f32>,
    ) {
        let xp = x.as_ptr();
        let wp = w.as_ptr();
        let mut t0 = 0;
        while t0 < n {
            let t1 = (t0 + TOKEN_BLOCK).min(n);
            match t1 - t0 {
                1 => block::<W, 8, 1>(xp, wp, k, rows, t0, t1, range.clone(), y),
                2 | 3 => block::<W, 4, 2>(xp, wp, k, rows, t0, t1, range.clone(), y),
                _ => block::<W, 2, 4>(xp, wp, k, rows, t0, t1, range.clone(), y),
            }
            t0 = t1;
        }
    }

    /// R rows × T tokens per micro-kernel call. Short edges repeat the last
    /// valid row/token pointer and discard those outputs.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn block<W: Lanes, const R: usize, const T: usize>(
        xp: *const f32,
        wp: *const W,
        k: usize,
        rows: usize,
        t0: usize,
        t1: usize,
        range: std::ops::Range<usize>,
        y: SendPtr<f32>,
    ) {
        let mut o = range.start;
        while o < range.end {
            let mut ws = [wp; R];
            for (r, p) in ws.iter_mut().enumerate() {
                *p = wp.add((o + r).min(range.end - 1) * k);
            }
            let mut t = t0;
            while t < t1 {
                let mut xs = [xp; T];
                for (j, p) in xs.iter_mut().enumerate() {
                    *p = xp.add((t + j).min(t1 - 1) * k);
                }
                let v = dot8::<W, R, T>(&xs, &ws, k);
                let mut out = [0.0f32; 8];
                _mm256_storeu_ps(out.as_mut_ptr(), v);
                for j in 0..T.min(t1 - t) {
                    for r in 0..R.min(range.end - o) {
                        *y.0.add((t + j) * rows + o + r) = out[j * R + r];
                    }
                }
                t += T;
            }
            o += R;
        }
    }
}
