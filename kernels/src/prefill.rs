//! Quantized prefill on x86: several tokens against quantized rows, the
//! canonical dot products of [`crate::dot_ref`] bit for bit.
//!
//! Rows are dequantized 8 at a time into quads ([`dequant_quads`]: 4 rows'
//! 4-element blocks side by side), so that a register holds 4 lanes of
//! several rows and the first level of each chunk's lane tree (`(l, l + 4)`)
//! is a plain add between two registers; only the last two levels move
//! data. Two micro-kernels read that layout, with the same FMA chains and
//! adds as [`crate::x86`]'s `dot8` (every lane `l` of an output runs over
//! elements `64c + l + 8j`, `j` ascending, from +0.0; the chunk partials are
//! joined by `hsum8x`'s adds and added to the running total in chunk order):
//! - AVX-512 ([`crate::x86_512::prefill8`]): 8 rows × 4 tokens a call;
//! - AVX2 ([`prefill4x2`]): 4 rows × 2 tokens a call, four calls a block.
//!
//! The driver ([`rows_quant`]) walks a block of tokens against a pass of
//! row groups in segments of [`SEGMENT`] weights on chunk boundaries: each
//! segment of 8 rows is dequantized once and stays in L1 while the block's
//! tokens go over it, the block's activations for the segment stay in L2,
//! and every output's running total (an f32, exactly what the registers
//! held) waits in a buffer between segments. So the chunks of an output are
//! still added in order from +0.0, whatever the segment, block or pass.

use std::arch::x86_64::*;

use crate::quant::QuantKind;
use crate::threads::SendPtr;
use crate::x86_512::{prefill8, transpose4, PREFILL_TOKENS};
use crate::CHUNK;

/// Tokens per block: the block's activations over one segment
/// (`TOKENS × SEGMENT × 4` bytes, 256 KiB) stay in L2 while the row groups
/// of a pass go over them.
const TOKENS: usize = 128;
/// Weights per segment of a row, a multiple of every block size and of
/// [`CHUNK`]: 8 rows' segment (16 KiB) stays in L1 while the block's tokens
/// go over it.
pub(crate) const SEGMENT: usize = 512;
/// Row groups (of 8) per pass: their running totals for a token block
/// (`PASS × TOKENS × 32` bytes, 512 KiB) stay in L2 beside the segment's
/// activations.
const PASS: usize = 128;
/// Tokens per micro-kernel block (a call of `prefill8`, four of
/// `prefill4x2`).
const T: usize = PREFILL_TOKENS;

/// Dequantizes 8 rows of `k` weights in `kind` (`rows[r]`) in quads: quad
/// `q` (rows `4q..4q + 4`) holds, for each 4-element block `e` of the row,
/// 16 floats at `(q·k/4 + e)·16`: row `4q`'s elements `4e..4e + 4`, then
/// row `4q + 1`'s, and so on. `out` holds at least `8k` floats.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dequant_quads(
    kind: QuantKind,
    rows: [*const u8; 8],
    k: usize,
    out: &mut [f32],
) {
    assert!(out.len() >= 8 * k && k.is_multiple_of(8));
    for (r, &w) in rows.iter().enumerate() {
        let at = (r / 4) * 4 * k + (r % 4) * 4;
        // Group g's halves are blocks 2g and 2g + 1: 32 floats a group,
        // the upper half 16 on.
        crate::x86::dequant_groups(kind, w, k, out.as_mut_ptr().add(at), 32, 16);
    }
}

/// 4 rows (one quad of [`dequant_quads`]' layout at `w`, `len` elements,
/// `len` a multiple of 8) × 2 tokens, continuing the running totals `tot`.
/// Elements of `tot` (and of the result): `[t0 r0, t0 r2, t1 r0, t1 r2,
/// t0 r1, t0 r3, t1 r1, t1 r3]`. `len` is a multiple of [`CHUNK`] unless it
/// ends the rows.
///
/// A register holds 2 rows × 4 lanes of one token (a row a 128-bit half),
/// lanes `0..4` in one and `4..8` in another: 8 accumulators, 4 weight
/// vectors and a token's two broadcasts fit the 16 registers.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn prefill4x2(
    xs: [*const f32; 2],
    w: *const f32,
    len: usize,
    mut tot: __m256,
) -> __m256 {
    let mut c0 = 0;
    while c0 < len {
        let cend = (c0 + CHUNK).min(len);
        // acc[t][p][h]: token t, rows 2p and 2p + 1, lanes 4h..4h + 4.
        let mut acc = [[[_mm256_setzero_ps(); 2]; 2]; 2];
        let mut i = c0;
        while i < cend {
            // Block i/4 (lanes 0..4) at 4i, block i/4 + 1 (lanes 4..8) 16
            // floats on; rows 0–1 first, rows 2–3 8 floats on.
            let wv: [[__m256; 2]; 2] = std::array::from_fn(|p| {
                std::array::from_fn(|h| _mm256_loadu_ps(w.add(4 * i + 16 * h + 8 * p)))
            });
            for t in 0..2 {
                let (a, b) = (_mm_loadu_ps(xs[t].add(i)), _mm_loadu_ps(xs[t].add(i + 4)));
                let (xa, xb) = (_mm256_set_m128(a, a), _mm256_set_m128(b, b));
                for p in 0..2 {
                    acc[t][p][0] = _mm256_fmadd_ps(xa, wv[p][0], acc[t][p][0]);
                    acc[t][p][1] = _mm256_fmadd_ps(xb, wv[p][1], acc[t][p][1]);
                }
            }
            i += 8;
        }
        // (l, l + 4); then per half (a row), (0, 2) (1, 3) with rows 2–3
        // beside rows 0–1; then (0, 1) with the other token's.
        let l2: [__m256; 2] = std::array::from_fn(|t| {
            let a = _mm256_add_ps(acc[t][0][0], acc[t][0][1]);
            let b = _mm256_add_ps(acc[t][1][0], acc[t][1][1]);
            _mm256_add_ps(
                _mm256_shuffle_ps::<0b01_00_01_00>(a, b),
                _mm256_shuffle_ps::<0b11_10_11_10>(a, b),
            )
        });
        let r = _mm256_add_ps(
            _mm256_shuffle_ps::<0b10_00_10_00>(l2[0], l2[1]),
            _mm256_shuffle_ps::<0b11_01_11_01>(l2[0], l2[1]),
        );
        tot = _mm256_add_ps(tot, r);
        c0 = cend;
    }
    tot
}

/// (token, row) of element `e` of [`prefill4x2`]'s totals.
const ORDER_4X2: [(usize, usize); 8] = [
    (0, 0),
    (0, 2),
    (1, 0),
    (1, 2),
    (0, 1),
    (0, 3),
    (1, 1),
    (1, 3),
];

/// 8 rows in quads (`w`, `len` elements) × [`T`] tokens by four calls of
/// [`prefill4x2`], the running totals in `tot` (token `t`, row `r` at
/// `8t + r`) before and after.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn block_avx2(xs: [*const f32; T], w: *const f32, len: usize, tot: &mut [f32; 32]) {
    for q in 0..2 {
        for tp in 0..T / 2 {
            let at = |e: usize| {
                let (t, r) = ORDER_4X2[e];
                (2 * tp + t) * 8 + 4 * q + r
            };
            let mut v = [0.0f32; 8];
            for (e, x) in v.iter_mut().enumerate() {
                *x = tot[at(e)];
            }
            let x2 = [xs[2 * tp], xs[2 * tp + 1]];
            let r = prefill4x2(x2, w.add(q * 4 * len), len, _mm256_loadu_ps(v.as_ptr()));
            _mm256_storeu_ps(v.as_mut_ptr(), r);
            for (e, x) in v.iter().enumerate() {
                tot[at(e)] = *x;
            }
        }
    }
}

/// [`block_avx2`] by one call of [`prefill8`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vbmi,avx2,fma,f16c")]
unsafe fn block_avx512(xs: [*const f32; T], w: *const f32, len: usize, tot: &mut [f32; 32]) {
    let p = tot.as_mut_ptr();
    let sums = std::array::from_fn(|h| transpose4(_mm512_loadu_ps(p.add(16 * h))));
    let sums = prefill8(xs, w, len, sums);
    for (h, s) in sums.iter().enumerate() {
        _mm512_storeu_ps(p.add(16 * h), transpose4(*s));
    }
}

/// Outputs `o ∈ range` of `y` (`n × rows`) for all `n` tokens of `x`
/// (`n × k`) against quantized rows of `kind` (module docs). `wide` picks
/// the AVX-512 micro-kernel (the caller checked the CPU).
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn rows_quant(
    wide: bool,
    x: &[f32],
    n: usize,
    kind: QuantKind,
    w: &[u8],
    k: usize,
    rows: usize,
    range: std::ops::Range<usize>,
    y: SendPtr<f32>,
) {
    if wide {
        drive512(x, n, kind, w, k, rows, range, y)
    } else {
        drive::<false>(x, n, kind, w, k, rows, range, y)
    }
}

/// [`drive`] compiled for AVX-512, so that its micro-kernel inlines.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vbmi,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn drive512(
    x: &[f32],
    n: usize,
    kind: QuantKind,
    w: &[u8],
    k: usize,
    rows: usize,
    range: std::ops::Range<usize>,
    y: SendPtr<f32>,
) {
    drive::<true>(x, n, kind, w, k, rows, range, y)
}

/// [`rows_quant`] with the micro-kernel chosen at compile time; inlined
/// into a caller compiled for that micro-kernel's instructions.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn drive<const WIDE: bool>(
    x: &[f32],
    n: usize,
    kind: QuantKind,
    w: &[u8],
    k: usize,
    rows: usize,
    range: std::ops::Range<usize>,
    y: SendPtr<f32>,
) {
    debug_assert!(SEGMENT.is_multiple_of(kind.block_weights()));
    debug_assert!(SEGMENT.is_multiple_of(CHUNK));
    let rb = kind.row_bytes(k);
    let wp = w.as_ptr();
    let groups = range.len().div_ceil(8);
    let calls = n.min(TOKENS).div_ceil(T);
    let pass = groups.min(PASS);
    let mut quads = vec![0.0f32; 8 * SEGMENT.min(k)];
    // The running totals of call c (tokens 4c..4c + 4 of the block) and
    // pass group g at (c·pass + g)·32: token t's 8 rows at 8t.
    let mut tot = vec![0.0f32; pass * calls * 32];
    let mut t0 = 0;
    while t0 < n {
        let t1 = (t0 + TOKENS).min(n);
        let mut p0 = 0;
        while p0 < groups {
            let p1 = (p0 + PASS).min(groups);
            tot.fill(0.0);
            let mut lo = 0;
            while lo < k {
                let hi = (lo + SEGMENT).min(k);
                let skip = kind.row_bytes(lo);
                for g in p0..p1 {
                    let o0 = range.start + 8 * g;
                    let last = (o0 + 8).min(range.end) - 1;
                    // Rows past the range repeat its last one.
                    let ws = std::array::from_fn(|r| wp.add((o0 + r).min(last) * rb + skip));
                    dequant_quads(kind, ws, hi - lo, &mut quads);
                    let mut t = t0;
                    let mut c = 0;
                    while t < t1 {
                        // A short token edge repeats the last token.
                        let xs =
                            std::array::from_fn(|j| x.as_ptr().add((t + j).min(t1 - 1) * k + lo));
                        let at = (c * pass + g - p0) * 32;
                        let sums: &mut [f32; 32] = (&mut tot[at..at + 32])
                            .try_into()
                            .expect("32 totals a call");
                        if WIDE {
                            block_avx512(xs, quads.as_ptr(), hi - lo, sums);
                        } else {
                            block_avx2(xs, quads.as_ptr(), hi - lo, sums);
                        }
                        c += 1;
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
                    let at = (c * pass + g - p0) * 32 + 8 * j;
                    std::ptr::copy_nonoverlapping(
                        tot.as_ptr().add(at),
                        y.0.add(t * rows + o0),
                        valid,
                    );
                }
            }
            p0 = p1;
        }
        t0 = t1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::splitmix::SplitMix64;

    /// The AVX2 micro-kernel against the reference dot, in one call and
    /// split at a chunk boundary with the totals carried, over rows with
    /// infinities, signed zeros and subnormals.
    #[test]
    fn prefill4x2_equals_the_reference_dot() {
        if !crate::use_avx2() {
            eprintln!("SKIPPED: no AVX2/FMA on this CPU, or LMRR_FORCE_SCALAR=1");
            return;
        }
        let mut r = SplitMix64(78);
        for k in [8usize, 64, 96, 256, 1544] {
            let rows: Vec<Vec<f32>> = (0..4)
                .map(|i| {
                    (0..k)
                        .map(|j| match (i, j % 97) {
                            (1, 5) => f32::INFINITY,
                            (2, 11) => -0.0,
                            (3, 13) => f32::from_bits(1),
                            _ => r.uniform(1.0),
                        })
                        .collect()
                })
                .collect();
            let x: Vec<Vec<f32>> = (0..2)
                .map(|_| (0..k).map(|_| r.uniform(3.0)).collect())
                .collect();
            let quad = |lo: usize, hi: usize| {
                let mut buf = vec![0f32; 4 * (hi - lo)];
                for (i, row) in rows.iter().enumerate() {
                    for e in 0..(hi - lo) / 4 {
                        let o = e * 16 + i * 4;
                        buf[o..o + 4].copy_from_slice(&row[lo + 4 * e..lo + 4 * e + 4]);
                    }
                }
                buf
            };
            let cut = (k / 2 / CHUNK) * CHUNK;
            let (all, head, tail) = (quad(0, k), quad(0, cut), quad(cut, k));
            let xs = [x[0].as_ptr(), x[1].as_ptr()];
            // SAFETY: AVX2 and FMA are present (checked above); every row
            // and token holds `k` elements.
            let (whole, split) = unsafe {
                let z = _mm256_setzero_ps();
                let h = prefill4x2(xs, head.as_ptr(), cut, z);
                (
                    prefill4x2(xs, all.as_ptr(), k, z),
                    prefill4x2(xs.map(|p| p.add(cut)), tail.as_ptr(), k - cut, h),
                )
            };
            let (mut a, mut b) = ([0f32; 8], [0f32; 8]);
            // SAFETY: as above.
            unsafe {
                _mm256_storeu_ps(a.as_mut_ptr(), whole);
                _mm256_storeu_ps(b.as_mut_ptr(), split);
            }
            for (e, &(t, i)) in ORDER_4X2.iter().enumerate() {
                let want = crate::dot_ref(&x[t], &rows[i]).to_bits();
                assert_eq!(a[e].to_bits(), want, "k={k} token {t} row {i}");
                assert_eq!(
                    b[e].to_bits(),
                    want,
                    "k={k} split at {cut}, token {t} row {i}"
                );
            }
        }
    }
}
