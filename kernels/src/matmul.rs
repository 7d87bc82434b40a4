//! Matmul `y[t][o] = dot(x[t], W[o])` with `W` row-major `(rows, cols)` as HF
//! `Linear` weights are stored: f32, bf16 (widened exactly in registers, so a
//! memory-mapped bf16 checkpoint is used in place) or GGUF blocks
//! (`Q4_0`/`Q4_1`/`Q8_0`/`Q4_K`/`Q6_K`, dequantized exactly, see
//! [`crate::quant`]; a K-quant super-block is four canonical chunks). Each
//! output is one canonical dot (see [`crate::dot_ref`]) over the exact f32
//! weights, so every storage of the same values gives the same bits.
//!
//! Fast path: 8 outputs per micro-kernel call — 8 rows × 1 token (decode), 4 × 2
//! or 2 × 4 (prefill) — sharing loads, joined by [`crate::x86`]'s `hsum8x`.
//! Quantized rows are dequantized in registers for decode (`dot8q`), and into
//! a small per-task f32 buffer of 8 rows for several tokens, which then runs
//! the f32 micro-kernels.
//! Threads split the rows; a row's outputs are computed by the same instruction
//! sequence whichever block or thread it falls in, so neither the batch nor the
//! thread count changes a bit.

use crate::quant::QuantKind;
use crate::threads::{SendPtr, Threads};

/// Storage of a weight matrix. bf16 is kept as raw `u16` bits; quantized rows
/// as their GGUF blocks, `kind.row_bytes(cols)` bytes per row.
#[derive(Debug, Clone, Copy)]
pub enum Weights<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
    Quant(QuantKind, &'a [u8]),
}

/// A row-major `(rows, cols)` weight matrix.
#[derive(Debug, Clone, Copy)]
pub struct Matrix<'a> {
    pub w: Weights<'a>,
    pub rows: usize,
    pub cols: usize,
}

impl<'a> Matrix<'a> {
    /// Wraps storage; `None` if its length does not hold `rows × cols` weights
    /// (for quantized storage, `cols` must also be a multiple of the block:
    /// 32 weights, or 256 for the K-quants).
    pub fn new(w: Weights<'a>, rows: usize, cols: usize) -> Option<Self> {
        let ok = match w {
            Weights::F32(s) => rows.checked_mul(cols) == Some(s.len()),
            Weights::Bf16(s) => rows.checked_mul(cols) == Some(s.len()),
            Weights::Quant(kind, s) => {
                cols.is_multiple_of(kind.block_weights())
                    && rows.checked_mul(kind.row_bytes(cols)) == Some(s.len())
            }
        };
        ok.then_some(Self { w, rows, cols })
    }

    /// Row `r` widened to f32 (reference conversions).
    pub fn row_f32(&self, r: usize) -> Vec<f32> {
        let mut out = vec![0.0; self.cols];
        self.row_into(r, &mut out, false);
        out
    }

    /// Row `r` widened to f32 into `out` (`cols` long); `fast` picks the SIMD
    /// dequantization, which gives the same bits.
    pub fn row_into(&self, r: usize, out: &mut [f32], fast: bool) {
        let c = self.cols;
        match self.w {
            Weights::F32(s) => out.copy_from_slice(&s[r * c..(r + 1) * c]),
            Weights::Bf16(s) => {
                for (o, &b) in out.iter_mut().zip(&s[r * c..(r + 1) * c]) {
                    *o = bf16_to_f32(b);
                }
            }
            Weights::Quant(kind, s) => {
                let rb = kind.row_bytes(c);
                let bytes = &s[r * rb..(r + 1) * rb];
                if fast {
                    crate::quant::dequant(kind, bytes, out)
                } else {
                    crate::quant::dequant_ref(kind, bytes, out)
                }
            }
        }
    }

    /// Bytes of storage streamed to read the matrix once.
    pub fn storage_bytes(&self) -> usize {
        match self.w {
            Weights::F32(s) => s.len() * 4,
            Weights::Bf16(s) => s.len() * 2,
            Weights::Quant(_, s) => s.len(),
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
    matmul_many(threads, x, n, &mut [(w, y)]);
}

/// Several matmuls of the same activations `x` (`(n, cols)`, one `cols` for
/// all matrices) in one parallel region: `jobs[j].1 = x · jobs[j].0ᵀ`. Each
/// output is the canonical dot of [`matmul`], so fusing changes no bit; it only
/// saves the synchronisation of one region per matrix (q/k/v, gate/up).
pub fn matmul_many(threads: &Threads, x: &[f32], n: usize, jobs: &mut [(&Matrix, &mut [f32])]) {
    for (w, y) in jobs.iter() {
        check(x, n, w, y);
    }
    if n == 0 {
        return;
    }
    // Concatenated row space: matrix j owns rows starts[j]..starts[j + 1].
    let mut starts = vec![0usize];
    for (w, _) in jobs.iter() {
        starts.push(starts[starts.len() - 1] + w.rows);
    }
    let total = starts[jobs.len()];
    if total == 0 {
        return;
    }
    let outs: Vec<(&Matrix, SendPtr<f32>)> = jobs
        .iter_mut()
        .map(|(w, y)| (*w, SendPtr(y.as_mut_ptr())))
        .collect();
    let grain = threads.grain(total, 16);
    threads.for_ranges(total, grain, |range| {
        for (j, &(w, yp)) in outs.iter().enumerate() {
            let lo = range.start.max(starts[j]);
            let hi = range.end.min(starts[j + 1]);
            if lo < hi {
                rows_of(x, n, w, lo - starts[j]..hi - starts[j], yp);
            }
        }
    });
}

/// Outputs `o ∈ range` of one matrix for all `n` tokens, written to
/// `y[t * rows + o]`; the caller guarantees no other worker writes them.
fn rows_of(x: &[f32], n: usize, w: &Matrix, range: std::ops::Range<usize>, yp: SendPtr<f32>) {
    let rows = w.rows;
    #[cfg(target_arch = "x86_64")]
    if crate::use_avx2() {
        // SAFETY: AVX2+FMA+F16C detected; `range` lies within `0..rows`; the
        // caller owns `y[t * rows + o]` for `o` in `range`.
        unsafe {
            match w.w {
                Weights::F32(s) => avx2::rows(x, n, s, w.cols, rows, range, yp),
                Weights::Bf16(s) => avx2::rows(x, n, s, w.cols, rows, range, yp),
                Weights::Quant(kind, s) => avx2::rows_quant(x, n, kind, s, w.cols, rows, range, yp),
            }
        }
        return;
    }
    scalar_rows(x, n, w, range, yp);
}

/// Portable fast path: streams each row once for all tokens.
fn scalar_rows(x: &[f32], n: usize, w: &Matrix, range: std::ops::Range<usize>, yp: SendPtr<f32>) {
    let k = w.cols;
    let mut row = vec![0.0; k];
    for o in range {
        w.row_into(o, &mut row, true);
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
    use crate::quant::QuantKind;
    use crate::x86::{dot8, dot8q, Lanes, Q4K, Q4_0, Q4_1, Q6K, Q8_0};
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
        let wp = w.as_ptr();
        let mut t0 = 0;
        while t0 < n {
            let t1 = (t0 + TOKEN_BLOCK).min(n);
            tokens(x, k, rows, t0, t1, range.clone(), |o| wp.add(o * k), y);
            t0 = t1;
        }
    }

    /// All tokens `t0..t1` against rows `range`, whose weights start at `row(o)`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tokens<W: Lanes>(
        x: &[f32],
        k: usize,
        rows: usize,
        t0: usize,
        t1: usize,
        range: std::ops::Range<usize>,
        row: impl Fn(usize) -> *const W,
        y: SendPtr<f32>,
    ) {
        let xp = x.as_ptr();
        match t1 - t0 {
            1 => block::<W, 8, 1>(xp, &row, k, rows, t0, t1, range, y),
            2 | 3 => block::<W, 4, 2>(xp, &row, k, rows, t0, t1, range, y),
            _ => block::<W, 2, 4>(xp, &row, k, rows, t0, t1, range, y),
        }
    }

    /// [`rows`] over quantized rows of `kind.row_bytes(k)` bytes.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn rows_quant(
        x: &[f32],
        n: usize,
        kind: QuantKind,
        w: &[u8],
        k: usize,
        rows: usize,
        range: std::ops::Range<usize>,
        y: SendPtr<f32>,
    ) {
        let rb = kind.row_bytes(k);
        let wp = w.as_ptr();
        if n == 1 {
            match kind {
                QuantKind::Q4_0 => decode_quant::<Q4_0>(x, wp, rb, k, range, y),
                QuantKind::Q4_1 => decode_quant::<Q4_1>(x, wp, rb, k, range, y),
                QuantKind::Q8_0 => decode_quant::<Q8_0>(x, wp, rb, k, range, y),
                QuantKind::Q4K => decode_quant::<Q4K>(x, wp, rb, k, range, y),
                QuantKind::Q6K => decode_quant::<Q6K>(x, wp, rb, k, range, y),
            }
            return;
        }
        // Several tokens: rows dequantized in quads, walked in segments
        // (`crate::prefill`).
        let wide = crate::x86_512::use_avx512();
        crate::prefill::rows_quant(wide, x, n, kind, w, k, rows, range, y);
    }

    /// Decode (one token): dequantize in registers, 8 rows per call. Not
    /// inlined, so profiles show each format's share of decode time.
    #[inline(never)]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn decode_quant<const K: u8>(
        x: &[f32],
        wp: *const u8,
        rb: usize,
        k: usize,
        range: std::ops::Range<usize>,
        y: SendPtr<f32>,
    ) {
        let wide = (K == Q4K || K == Q6K) && crate::x86_512::use_avx512();
        let mut o = range.start;
        while o < range.end {
            let mut ws = [wp; 8];
            for (r, p) in ws.iter_mut().enumerate() {
                *p = wp.add((o + r).min(range.end - 1) * rb);
            }
            let v = if wide {
                crate::x86_512::dot8k::<K>(x.as_ptr(), &ws, k, 8 * rb)
            } else {
                dot8q::<K>(x.as_ptr(), &ws, k, 8 * rb)
            };
            let mut out = [0.0f32; 8];
            _mm256_storeu_ps(out.as_mut_ptr(), v);
            for (r, &val) in out.iter().enumerate().take(range.end - o) {
                *y.get().add(o + r) = val;
            }
            o += 8;
        }
    }

    /// R rows × T tokens per micro-kernel call. Short edges repeat the last
    /// valid row/token pointer and discard those outputs.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn block<W: Lanes, const R: usize, const T: usize>(
        xp: *const f32,
        row: &impl Fn(usize) -> *const W,
        k: usize,
        rows: usize,
        t0: usize,
        t1: usize,
        range: std::ops::Range<usize>,
        y: SendPtr<f32>,
    ) {
        let mut o = range.start;
        while o < range.end {
            let mut ws = [row(o); R];
            for (r, p) in ws.iter_mut().enumerate() {
                *p = row((o + r).min(range.end - 1));
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
