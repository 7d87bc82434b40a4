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
    use crate::x86::{dequant_row, dot8, dot8q, Lanes, Q4K, Q4_0, Q4_1, Q6K, Q8_0};
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
        if crate::x86_512::use_avx512() {
            return wide::rows_quant(x, n, kind, w, k, rows, range, y);
        }
        // Several tokens: dequantize GROUP rows once per token block, then run
        // the f32 micro-kernels on the buffer, 4 rows × 2 tokens per call: the
        // four buffered rows stay in L1 while x streams from L2, two loads of
        // x per 8 FMAs instead of the 2 × 4 shape's four.
        const GROUP: usize = 8;
        let mut buf = vec![0.0f32; GROUP * k];
        let mut t0 = 0;
        while t0 < n {
            let t1 = (t0 + TOKEN_BLOCK).min(n);
            let mut g0 = range.start;
            while g0 < range.end {
                let g1 = (g0 + GROUP).min(range.end);
                for o in g0..g1 {
                    let dst = &mut buf[(o - g0) * k..(o - g0 + 1) * k];
                    dequant_row(kind, wp.add(o * rb), dst);
                }
                let bp = buf.as_ptr();
                let row = |o: usize| bp.add((o - g0) * k);
                if t1 - t0 >= 2 {
                    block::<f32, 4, 2>(x.as_ptr(), &row, k, rows, t0, t1, g0..g1, y);
                } else {
                    tokens(x, k, rows, t0, t1, g0..g1, row, y);
                }
                g0 = g1;
            }
            t0 = t1;
        }
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

    /// Quantized prefill with AVX-512: [`crate::x86_512::prefill8`] over 8
    /// rows dequantized in quads, 4 tokens a call.
    mod wide {
        use super::SendPtr;
        use crate::quant::QuantKind;
        use crate::x86_512::{dequant_quads, prefill8, transpose4, PREFILL_TOKENS};
        use crate::CHUNK;
        use std::arch::x86_64::*;

        /// Tokens per block: the block's activations over one segment
        /// (`TOKENS × SEGMENT × 4` bytes, 256 KiB) stay in L2 while the
        /// row groups of a pass go over them.
        const TOKENS: usize = 128;
        /// Weights per segment of a row, a multiple of every block size and
        /// of [`CHUNK`]: 8 rows' segment (16 KiB) stays in L1 while the
        /// block's tokens go over it.
        const SEGMENT: usize = 512;
        /// Row groups (of 8) per pass: their running totals for a token
        /// block (`PASS × TOKENS × 32` bytes, 512 KiB) stay in L2 beside
        /// the segment's activations.
        const PASS: usize = 128;

        /// Outputs `o ∈ range` for all `n` tokens. For each block of tokens
        /// and pass of row groups, the rows are walked in segments on chunk
        /// boundaries, each segment dequantized once and run against every
        /// token of the block; an output's running total (an f32, as in the
        /// registers) waits in `tot` between segments, so its chunks are
        /// still added in order from +0.0.
        #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vbmi,avx2,fma,f16c")]
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
            const T: usize = PREFILL_TOKENS;
            debug_assert!(SEGMENT.is_multiple_of(kind.block_weights()));
            debug_assert!(SEGMENT.is_multiple_of(CHUNK));
            let rb = kind.row_bytes(k);
            let wp = w.as_ptr();
            let groups = range.len().div_ceil(8);
            let calls = n.min(TOKENS).div_ceil(T);
            let mut quads = vec![0.0f32; 8 * SEGMENT.min(k)];
            // tot[(c·pass + g)·T/2 + p]: call c, pass group g, in the
            // order of `transpose4` (so a token's outputs are contiguous).
            let pass = groups.min(PASS);
            let mut tot = vec![_mm512_setzero_ps(); pass * calls * T / 2];
            let mut t0 = 0;
            while t0 < n {
                let t1 = (t0 + TOKENS).min(n);
                let mut p0 = 0;
                while p0 < groups {
                    let p1 = (p0 + PASS).min(groups);
                    tot.fill(_mm512_setzero_ps());
                    let mut lo = 0;
                    while lo < k {
                        let hi = (lo + SEGMENT).min(k);
                        let skip = kind.row_bytes(lo);
                        for g in p0..p1 {
                            let o0 = range.start + 8 * g;
                            let last = (o0 + 8).min(range.end) - 1;
                            // Rows past the range repeat its last one.
                            let ws =
                                std::array::from_fn(|r| wp.add((o0 + r).min(last) * rb + skip));
                            dequant_quads(kind, ws, hi - lo, &mut quads);
                            let mut t = t0;
                            let mut at = (g - p0) * T / 2;
                            while t < t1 {
                                let xs = std::array::from_fn(|j| {
                                    x.as_ptr().add((t + j).min(t1 - 1) * k + lo)
                                });
                                let sums = std::array::from_fn(|p| tot[at + p]);
                                let sums = prefill8(xs, quads.as_ptr(), hi - lo, sums);
                                for (d, v) in tot[at..at + T / 2].iter_mut().zip(sums) {
                                    *d = v;
                                }
                                at += pass * T / 2;
                                t += T;
                            }
                        }
                        lo = hi;
                    }
                    for t in t0..t1 {
                        let (c, j) = ((t - t0) / T, (t - t0) % T);
                        for g in p0..p1 {
                            let o0 = range.start + 8 * g;
                            let valid = (range.end - o0).min(8);
                            let both = transpose4(tot[(c * pass + g - p0) * T / 2 + j / 2]);
                            let v = if j % 2 == 0 {
                                _mm512_castps512_ps256(both)
                            } else {
                                _mm512_extractf32x8_ps::<1>(both)
                            };
                            let dst = y.0.add(t * rows + o0);
                            if valid == 8 {
                                _mm256_storeu_ps(dst, v);
                            } else {
                                let mut out = [0.0f32; 8];
                                _mm256_storeu_ps(out.as_mut_ptr(), v);
                                for (r, &val) in out.iter().enumerate().take(valid) {
                                    *dst.add(r) = val;
                                }
                            }
                        }
                    }
                    p0 = p1;
                }
                t0 = t1;
            }
        }
    }
}
