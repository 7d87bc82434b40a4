//! The fast CPU replay of [`SM90_BF16`] GEMMs: what [`super::tc_matmul`]
//! runs when the model is sm_90's. Owns the decoded operand layouts and the
//! kernels (portable, and AVX2 with run-time detection) that chain the
//! 16-product steps over them.
//!
//! Invariant: every output is bitwise `tc_dot(&SM90_BF16, xb, w_row)`, for
//! every input (zeros of both signs, subnormals, extreme exponents, ±∞,
//! NaN). Blocks with an infinity or a NaN among their inputs (x, w or the
//! running addend) are not computed here: they go through [`mma_dot`], which
//! is the model itself. Finite blocks are the model's step rewritten as
//! integer arithmetic on operands decoded once (not once per product):
//! - a bf16 becomes a signed significand `s` (hidden bit included) and its
//!   biased exponent field `f = max(e, 1)`; a zero gets [`ZERO_FIELD`], far
//!   below any real field, so that it never sets the alignment and its
//!   product (0) is cut to nothing;
//! - product `k` is `s_x·s_w·2^(f_x + f_w - 254 - 14)`; with the addend's
//!   field `f_c` in the same units (`max(e_c, 1) + 127`, or 0 for a zero
//!   addend, which is below every product and keeps the quantum in range),
//!   `emax = max(f_c, f_x + f_w over k)` and the quantum is `2^q`,
//!   `q = emax - 279`;
//! - a product's cut is `(|s_x·s_w|·2^11) >> (emax - f_x - f_w)` with its
//!   sign (a shift of 32 or more leaves 0); 16 of them sum in an `i32`
//!   exactly (`16·255²·2^11 < 2^31`); the addend's is `trunc(c·2^-q)`;
//! - the result is `(P + A)·2^q` cut toward zero to 24 significant bits and
//!   to a multiple of `2^-149`, an f32 (`∞` past the range) — every step of
//!   which is exact in f64 (see [`finish`]).
//!
//! The layout of the AVX2 kernel: rows in groups of [`GROUP`], a block's
//! 16 k as 8 pairs `(k, k + 8)`; a vector holds 4 rows at `k` and the same
//! 4 rows at `k + 8`, so one group-block is 16 vectors; the halves are
//! joined after each pass (max, then sum). No decoding, tiling, grouping or
//! thread count changes a bit: each output's arithmetic is its own.

use super::{mma_dot, MMA_K, SM90_BF16};
use crate::threads::{SendPtr, Threads};

/// The field of a zero operand: a product with a zero factor has a field
/// below 0, under every nonzero term's (≥ 2) and the floor a zero addend
/// sets (0), so it never moves the alignment.
const ZERO_FIELD: i32 = -2048;
/// Rows per group in the AVX2 kernel.
const GROUP: usize = 8;
/// Tokens decoded at once (bounds the decoded activations' memory).
const TOKEN_TILE: usize = 32;
/// Blocks of a W group decoded at once, then used by every token of the
/// tile while in cache.
const CHUNK_BLOCKS: usize = 16;

/// `2^e` as an f64; `e` in f64's normal range.
#[inline(always)]
fn pow2(e: i32) -> f64 {
    f64::from_bits(((e + 1023) as u64) << 52)
}

/// Low 29 bits of an f64's significand: what an f32 does not keep.
const BELOW_F32: u64 = (1 << 29) - 1;

/// A bf16 as `(signed significand, biased field)`; any value for an
/// infinity or a NaN (their blocks do not come here).
#[inline(always)]
fn decode(b: u16) -> (i32, i32) {
    let e = ((b >> 7) & 0xff) as i32;
    let sig = (b & 0x7f) as i32 | if e != 0 { 0x80 } else { 0 };
    let f = if sig == 0 { ZERO_FIELD } else { e.max(1) };
    (if b & 0x8000 != 0 { -sig } else { sig }, f)
}

fn is_special(b: u16) -> bool {
    b & 0x7f80 == 0x7f80
}

/// The addend's field in product units (`0` for a zero).
#[inline(always)]
fn addend_field(c: f32) -> i32 {
    let b = c.to_bits();
    if b & 0x7fff_ffff == 0 {
        0
    } else {
        (((b >> 23) & 0xff) as i32).max(1) + 127
    }
}

/// The step's f32 from the products' cut sum `p`, the addend `c` and the
/// alignment field `emax` (all finite): `A = trunc(c·2^-q)` (|A| < 2^26),
/// `P + A` exact in f64, scaled to units of `2^-149`, cut to 24 significant
/// bits (the significand mask) and to an integer (`trunc`), scaled back and
/// narrowed: exact for every f32, `±∞` from 2^128 up, `-0` for a negative
/// sum below 2^-149 (as [`super::to_f32`] gives).
#[inline(always)]
fn finish(p: i32, c: f32, emax: i32) -> f32 {
    let a = (c as f64 * pow2(279 - emax)).trunc();
    let s = (p as f64 + a) * pow2(emax - 130);
    let t = f64::from_bits(s.to_bits() & !BELOW_F32).trunc();
    (t * pow2(-149)) as f32
}

/// One finite step from decoded operands (`xs`, `xf`, `ws`, `wf`: 16
/// each); the portable kernel and the AVX2 kernel's specification.
#[inline(always)]
fn step_decoded(c: f32, xs: &[i32], xf: &[i32], ws: &[i32], wf: &[i32]) -> f32 {
    let mut emax = addend_field(c);
    for k in 0..MMA_K {
        emax = emax.max(xf[k] + wf[k]);
    }
    let mut p = 0i32;
    for k in 0..MMA_K {
        let prod = xs[k] * ws[k];
        let d = (emax - xf[k] - wf[k]) as u32;
        let v = (prod.unsigned_abs() << 11).checked_shr(d).unwrap_or(0) as i32;
        p += if prod < 0 { -v } else { v };
    }
    finish(p, c, emax)
}

/// Block `b` of `row` (16 values, zero-padded past its end).
fn block_of(row: &[u16], b: usize) -> [u16; MMA_K] {
    let mut out = [0u16; MMA_K];
    let lo = (b * MMA_K).min(row.len());
    let hi = ((b + 1) * MMA_K).min(row.len());
    out[..hi - lo].copy_from_slice(&row[lo..hi]);
    out
}

/// The model's own step on block `b`: for blocks with a special.
fn model_block(c: f32, x: &[u16], w: &[u16], b: usize) -> f32 {
    mma_dot(&SM90_BF16, c, &block_of(x, b), &block_of(w, b))
}

/// `y = x · Wᵀ` under [`SM90_BF16`] (shapes as [`super::tc_matmul`], which
/// checked them), on the fastest kernel this CPU has.
#[allow(clippy::too_many_arguments)]
pub(super) fn matmul(
    threads: &Threads,
    xb: &[u16],
    n: usize,
    w: &[u16],
    rows: usize,
    cols: usize,
    y: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if crate::use_avx2() {
        return avx2::matmul(threads, xb, n, w, rows, cols, y);
    }
    matmul_portable(threads, xb, n, w, rows, cols, y)
}

/// The portable kernel: a row decoded once, every token of a tile chained
/// over it.
#[allow(clippy::too_many_arguments)]
pub(super) fn matmul_portable(
    threads: &Threads,
    xb: &[u16],
    n: usize,
    w: &[u16],
    rows: usize,
    cols: usize,
    y: &mut [f32],
) {
    let nb = cols.div_ceil(MMA_K);
    let kp = nb * MMA_K;
    let (mut xs, mut xf) = (vec![0i32; n * kp], vec![ZERO_FIELD; n * kp]);
    let mut xspecial = vec![false; n * nb];
    for t in 0..n {
        for (k, &v) in xb[t * cols..(t + 1) * cols].iter().enumerate() {
            (xs[t * kp + k], xf[t * kp + k]) = decode(v);
            xspecial[t * nb + k / MMA_K] |= is_special(v);
        }
    }
    let yp = SendPtr(y.as_mut_ptr());
    let grain = threads.grain(rows, GROUP);
    threads.for_ranges(rows, grain, |range| {
        let (mut ws, mut wf) = (vec![0i32; kp], vec![ZERO_FIELD; kp]);
        let mut wspecial = vec![false; nb];
        for o in range {
            let wr = &w[o * cols..(o + 1) * cols];
            wspecial.fill(false);
            for (k, &v) in wr.iter().enumerate() {
                (ws[k], wf[k]) = decode(v);
                wspecial[k / MMA_K] |= is_special(v);
            }
            for t in 0..n {
                let xr = &xb[t * cols..(t + 1) * cols];
                let mut c = 0.0f32;
                for b in 0..nb {
                    let r = b * MMA_K..(b + 1) * MMA_K;
                    let x0 = t * kp + b * MMA_K;
                    c = if wspecial[b] || xspecial[t * nb + b] || !c.is_finite() {
                        model_block(c, xr, wr, b)
                    } else {
                        step_decoded(
                            c,
                            &xs[x0..x0 + MMA_K],
                            &xf[x0..x0 + MMA_K],
                            &ws[r.clone()],
                            &wf[r],
                        )
                    };
                }
                // SAFETY: each worker owns outputs `o` of its range for every
                // token; `t * rows + o < n * rows = y.len()`.
                unsafe { *yp.get().add(t * rows + o) = c };
            }
        }
    });
}

#[cfg(target_arch = "x86_64")]
pub(super) mod avx2 {
    //! The AVX2 kernel (see the parent module for the layout). Callers check
    //! AVX2 at run time ([`crate::use_avx2`]).

    use super::*;
    use std::arch::x86_64::*;

    /// i32 lanes per decoded (k, k + 8) pair vector.
    const L: usize = 8;
    /// i32s per group-block of W: 8 pairs × 2 half-groups × 8 lanes.
    const WBLOCK: usize = 8 * 2 * L;
    /// i32s per token-block of X: 8 pairs × (significands, fields) × 8 lanes.
    const XBLOCK: usize = 8 * 2 * L;

    /// Activations decoded for the AVX2 kernel: per token and block, for
    /// pair `j`, a vector of `s·2^7` (low 16 bits, for `madd` against W's
    /// `s·2^4`) and one of fields, each `[k = j] × 4, [k = j + 8] × 4`.
    struct XDec {
        v: Vec<i32>,
        special: Vec<bool>,
        nb: usize,
    }

    fn decode_x(xb: &[u16], n: usize, cols: usize) -> XDec {
        let nb = cols.div_ceil(MMA_K);
        let mut v = vec![0i32; n * nb * XBLOCK];
        let mut special = vec![false; n * nb];
        for t in 0..n {
            let xr = &xb[t * cols..(t + 1) * cols];
            for b in 0..nb {
                let blk = block_of(xr, b);
                special[t * nb + b] = blk.iter().any(|&x| is_special(x));
                let out = &mut v[(t * nb + b) * XBLOCK..(t * nb + b + 1) * XBLOCK];
                for j in 0..8 {
                    for (h, &x) in [blk[j], blk[j + 8]].iter().enumerate() {
                        let (s, f) = decode(x);
                        let s = ((s << 7) as i16 as u16) as i32;
                        for l in 0..4 {
                            out[j * 2 * L + h * 4 + l] = s;
                            out[j * 2 * L + L + h * 4 + l] = f;
                        }
                    }
                }
            }
        }
        XDec { v, special, nb }
    }

    /// Decodes block `b` of rows `rows` (at most [`GROUP`]; absent rows
    /// are zeros) into `out` (`WBLOCK` i32s): for pair `j`, half-group `g`,
    /// lane `h·4 + l` holds row `4g + l` at `k = j + 8h` as
    /// `field << 16 | (s·2^4) as u16`. Returns whether the block holds an
    /// infinity or a NaN.
    #[target_feature(enable = "avx2")]
    unsafe fn decode_w_block(
        w: &[u16],
        cols: usize,
        rows: std::ops::Range<usize>,
        b: usize,
        out: &mut [i32],
    ) -> bool {
        debug_assert!(out.len() >= WBLOCK && rows.len() <= GROUP);
        let full = (b + 1) * MMA_K <= cols;
        let mut r = [_mm256_setzero_si256(); GROUP];
        for (i, o) in rows.clone().enumerate() {
            let row = &w[o * cols..(o + 1) * cols];
            r[i] = if full {
                // SAFETY: `(b + 1)·16 ≤ cols`: 16 u16 in the row.
                _mm256_loadu_si256(row.as_ptr().add(b * MMA_K) as *const __m256i)
            } else {
                let blk = block_of(row, b);
                _mm256_loadu_si256(blk.as_ptr() as *const __m256i)
            };
        }
        // 8×8 transpose of u16 within each 128-bit half: c[j] holds rows
        // 0..8 at k = j (low half) and k = j + 8 (high half).
        let a0 = _mm256_unpacklo_epi16(r[0], r[1]);
        let a1 = _mm256_unpackhi_epi16(r[0], r[1]);
        let a2 = _mm256_unpacklo_epi16(r[2], r[3]);
        let a3 = _mm256_unpackhi_epi16(r[2], r[3]);
        let a4 = _mm256_unpacklo_epi16(r[4], r[5]);
        let a5 = _mm256_unpackhi_epi16(r[4], r[5]);
        let a6 = _mm256_unpacklo_epi16(r[6], r[7]);
        let a7 = _mm256_unpackhi_epi16(r[6], r[7]);
        let b0 = _mm256_unpacklo_epi32(a0, a2);
        let b1 = _mm256_unpackhi_epi32(a0, a2);
        let b2 = _mm256_unpacklo_epi32(a1, a3);
        let b3 = _mm256_unpackhi_epi32(a1, a3);
        let b4 = _mm256_unpacklo_epi32(a4, a6);
        let b5 = _mm256_unpackhi_epi32(a4, a6);
        let b6 = _mm256_unpacklo_epi32(a5, a7);
        let b7 = _mm256_unpackhi_epi32(a5, a7);
        let c = [
            _mm256_unpacklo_epi64(b0, b4),
            _mm256_unpackhi_epi64(b0, b4),
            _mm256_unpacklo_epi64(b1, b5),
            _mm256_unpackhi_epi64(b1, b5),
            _mm256_unpacklo_epi64(b2, b6),
            _mm256_unpackhi_epi64(b2, b6),
            _mm256_unpacklo_epi64(b3, b7),
            _mm256_unpackhi_epi64(b3, b7),
        ];
        let (ff, one, zero) = (
            _mm256_set1_epi16(0xff),
            _mm256_set1_epi16(1),
            _mm256_setzero_si256(),
        );
        let mut special = zero;
        for (j, &v) in c.iter().enumerate() {
            let e = _mm256_and_si256(_mm256_srli_epi16(v, 7), ff);
            let ez = _mm256_cmpeq_epi16(e, zero);
            let sig = _mm256_or_si256(
                _mm256_and_si256(_mm256_slli_epi16(v, 4), _mm256_set1_epi16(0x7f0)),
                _mm256_andnot_si256(ez, _mm256_set1_epi16(0x800)),
            );
            let is_zero = _mm256_cmpeq_epi16(sig, zero);
            // max(e, 1), or ZERO_FIELD (1 - 2049) for a zero.
            let f = _mm256_sub_epi16(
                _mm256_max_epi16(e, one),
                _mm256_and_si256(is_zero, _mm256_set1_epi16((1 - ZERO_FIELD) as i16)),
            );
            let s = _mm256_sign_epi16(sig, v);
            special = _mm256_or_si256(special, _mm256_cmpeq_epi16(e, ff));
            let p = out.as_mut_ptr().add(j * 2 * L) as *mut __m256i;
            // SAFETY: `out` holds WBLOCK = 16 vectors; j < 8.
            _mm256_storeu_si256(p, _mm256_unpacklo_epi16(s, f));
            _mm256_storeu_si256(p.add(1), _mm256_unpackhi_epi16(s, f));
        }
        _mm256_movemask_epi8(special) != 0
    }

    /// The addend's field in product units per lane (0 for a zero), and
    /// whether any lane is an infinity or a NaN.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn addend_fields(c: __m256) -> (__m256i, bool) {
        let cb = _mm256_castps_si256(c);
        let e = _mm256_and_si256(_mm256_srli_epi32(cb, 23), _mm256_set1_epi32(0xff));
        let f = _mm256_add_epi32(
            _mm256_max_epi32(e, _mm256_set1_epi32(1)),
            _mm256_set1_epi32(127),
        );
        let z = _mm256_cmpeq_epi32(
            _mm256_and_si256(cb, _mm256_set1_epi32(0x7fff_ffff)),
            _mm256_setzero_si256(),
        );
        let special = _mm256_cmpeq_epi32(e, _mm256_set1_epi32(0xff));
        (
            _mm256_andnot_si256(z, f),
            _mm256_movemask_epi8(special) != 0,
        )
    }

    /// 4 lanes of [`finish`]: `2^e` per lane from a field vector.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn pow2x4(e: __m128i) -> __m256d {
        let b = _mm256_cvtepi32_epi64(_mm_add_epi32(e, _mm_set1_epi32(1023)));
        _mm256_castsi256_pd(_mm256_slli_epi64(b, 52))
    }

    /// [`finish`] on 4 lanes.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn finish4(p: __m128i, c: __m128, emax: __m128i) -> __m128 {
        const TZ: i32 = _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC;
        let a = _mm256_round_pd::<TZ>(_mm256_mul_pd(
            _mm256_cvtps_pd(c),
            pow2x4(_mm_sub_epi32(_mm_set1_epi32(279), emax)),
        ));
        let s = _mm256_mul_pd(
            _mm256_add_pd(_mm256_cvtepi32_pd(p), a),
            pow2x4(_mm_sub_epi32(emax, _mm_set1_epi32(130))),
        );
        let keep = _mm256_castsi256_pd(_mm256_set1_epi64x(!BELOW_F32 as i64));
        let t = _mm256_round_pd::<TZ>(_mm256_and_pd(s, keep));
        _mm256_cvtpd_ps(_mm256_mul_pd(t, _mm256_set1_pd(pow2(-149))))
    }

    /// One finite step for a group of 8 rows: `c` the rows' addends, `wb`
    /// the group-block ([`decode_w_block`]), `xbk` the token-block.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn step8(c: __m256, cf: __m256i, wb: *const i32, xbk: *const i32) -> __m256 {
        let w = wb as *const __m256i;
        let x = xbk as *const __m256i;
        // The addends' fields of rows 0..4 and 4..8, in both halves.
        let mut m0 = _mm256_permute2x128_si256(cf, cf, 0x00);
        let mut m1 = _mm256_permute2x128_si256(cf, cf, 0x11);
        let mut f0 = [_mm256_setzero_si256(); 8];
        let mut f1 = [_mm256_setzero_si256(); 8];
        for j in 0..8 {
            let xf = _mm256_loadu_si256(x.add(2 * j + 1));
            f0[j] = _mm256_add_epi32(_mm256_srai_epi32(_mm256_loadu_si256(w.add(2 * j)), 16), xf);
            f1[j] = _mm256_add_epi32(
                _mm256_srai_epi32(_mm256_loadu_si256(w.add(2 * j + 1)), 16),
                xf,
            );
            m0 = _mm256_max_epi32(m0, f0[j]);
            m1 = _mm256_max_epi32(m1, f1[j]);
        }
        // Join the k and k + 8 halves.
        m0 = _mm256_max_epi32(m0, _mm256_permute2x128_si256(m0, m0, 0x01));
        m1 = _mm256_max_epi32(m1, _mm256_permute2x128_si256(m1, m1, 0x01));
        let mut s0 = _mm256_setzero_si256();
        let mut s1 = _mm256_setzero_si256();
        for j in 0..8 {
            let xs = _mm256_loadu_si256(x.add(2 * j));
            let p0 = _mm256_madd_epi16(_mm256_loadu_si256(w.add(2 * j)), xs);
            let p1 = _mm256_madd_epi16(_mm256_loadu_si256(w.add(2 * j + 1)), xs);
            let v0 = _mm256_srlv_epi32(_mm256_abs_epi32(p0), _mm256_sub_epi32(m0, f0[j]));
            let v1 = _mm256_srlv_epi32(_mm256_abs_epi32(p1), _mm256_sub_epi32(m1, f1[j]));
            s0 = _mm256_add_epi32(s0, _mm256_sign_epi32(v0, p0));
            s1 = _mm256_add_epi32(s1, _mm256_sign_epi32(v1, p1));
        }
        s0 = _mm256_add_epi32(s0, _mm256_permute2x128_si256(s0, s0, 0x01));
        s1 = _mm256_add_epi32(s1, _mm256_permute2x128_si256(s1, s1, 0x01));
        let lo = finish4(
            _mm256_castsi256_si128(s0),
            _mm256_castps256_ps128(c),
            _mm256_castsi256_si128(m0),
        );
        let hi = finish4(
            _mm256_castsi256_si128(s1),
            _mm256_extractf128_ps(c, 1),
            _mm256_castsi256_si128(m1),
        );
        _mm256_set_m128(hi, lo)
    }

    /// [`step8`] against [`mma_dot`] on one probe tile: its 8 `b` columns
    /// a group of rows, each `a` row a token, the tile's addends.
    #[cfg(test)]
    pub(super) fn check_tile(t: &super::super::probe::Tile, what: &str) {
        let xd = decode_x(&t.a, 16, MMA_K);
        let mut wb = vec![0i32; WBLOCK];
        // SAFETY (all below): the test runs this only where AVX2 is present.
        let wspecial = unsafe { decode_w_block(&t.b, MMA_K, 0..GROUP, 0, &mut wb) };
        for i in 0..16 {
            let c = &t.c[i * 8..(i + 1) * 8];
            let got = unsafe {
                let cv = _mm256_loadu_ps(c.as_ptr());
                let (cf, c_special) = addend_fields(cv);
                if c_special || wspecial || xd.special[i] {
                    continue;
                }
                let mut out = [0.0f32; GROUP];
                _mm256_storeu_ps(
                    out.as_mut_ptr(),
                    step8(cv, cf, wb.as_ptr(), xd.v.as_ptr().add(i * XBLOCK)),
                );
                out
            };
            for j in 0..8 {
                let want = mma_dot(
                    &SM90_BF16,
                    c[j],
                    &t.a[i * MMA_K..(i + 1) * MMA_K],
                    &t.b[j * MMA_K..(j + 1) * MMA_K],
                );
                assert_eq!(
                    got[j].to_bits(),
                    want.to_bits(),
                    "avx2 step, {what}: c {:e}",
                    c[j]
                );
            }
        }
    }

    /// `y = x · Wᵀ` under [`SM90_BF16`] on AVX2 (see [`super::matmul`]).
    #[allow(clippy::too_many_arguments)]
    pub(in super::super) fn matmul(
        threads: &Threads,
        xb: &[u16],
        n: usize,
        w: &[u16],
        rows: usize,
        cols: usize,
        y: &mut [f32],
    ) {
        debug_assert!(crate::use_avx2());
        let yp = SendPtr(y.as_mut_ptr());
        let grain = threads.grain(rows, GROUP);
        for t0 in (0..n).step_by(TOKEN_TILE) {
            let tn = TOKEN_TILE.min(n - t0);
            let xt = &xb[t0 * cols..(t0 + tn) * cols];
            let xd = decode_x(xt, tn, cols);
            threads.for_ranges(rows, grain, |range| {
                // SAFETY: the caller checked AVX2 (`use_avx2`).
                unsafe { run_rows(&xd, xt, tn, w, cols, range, rows, t0, yp) }
            });
        }
    }

    /// Rows `range` for the `tn` tokens of a tile starting at token `t0`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2")]
    unsafe fn run_rows(
        xd: &XDec,
        xt: &[u16],
        tn: usize,
        w: &[u16],
        cols: usize,
        range: std::ops::Range<usize>,
        rows: usize,
        t0: usize,
        yp: SendPtr<f32>,
    ) {
        let nb = xd.nb;
        let mut wbuf = vec![0i32; CHUNK_BLOCKS * WBLOCK];
        let mut wspecial = [false; CHUNK_BLOCKS];
        let mut acc = vec![[0.0f32; GROUP]; tn];
        for g0 in range.clone().step_by(GROUP) {
            let g = g0..(g0 + GROUP).min(range.end);
            acc.iter_mut().for_each(|a| *a = [0.0; GROUP]);
            for b0 in (0..nb).step_by(CHUNK_BLOCKS) {
                let bn = CHUNK_BLOCKS.min(nb - b0);
                for i in 0..bn {
                    wspecial[i] = decode_w_block(
                        w,
                        cols,
                        g.clone(),
                        b0 + i,
                        &mut wbuf[i * WBLOCK..(i + 1) * WBLOCK],
                    );
                }
                for (t, a) in acc.iter_mut().enumerate() {
                    let mut c = _mm256_loadu_ps(a.as_ptr());
                    for i in 0..bn {
                        let b = b0 + i;
                        let (cf, c_special) = addend_fields(c);
                        if wspecial[i] || xd.special[t * nb + b] || c_special {
                            let mut lanes = [0.0f32; GROUP];
                            _mm256_storeu_ps(lanes.as_mut_ptr(), c);
                            let xr = &xt[t * cols..(t + 1) * cols];
                            for (l, o) in g.clone().enumerate() {
                                lanes[l] =
                                    model_block(lanes[l], xr, &w[o * cols..(o + 1) * cols], b);
                            }
                            c = _mm256_loadu_ps(lanes.as_ptr());
                        } else {
                            c = step8(
                                c,
                                cf,
                                wbuf.as_ptr().add(i * WBLOCK),
                                xd.v.as_ptr().add((t * nb + b) * XBLOCK),
                            );
                        }
                    }
                    _mm256_storeu_ps(a.as_mut_ptr(), c);
                }
            }
            for (t, a) in acc.iter().enumerate() {
                for (l, o) in g.clone().enumerate() {
                    // SAFETY: each worker owns outputs `o` of its range for
                    // every token; `(t0 + t) * rows + o < n * rows`.
                    *yp.get().add((t0 + t) * rows + o) = a[l];
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::gemm::general_matmul;
    use super::super::probe::{tiles, Class, Tile, OUTPUTS};
    use super::super::{negative_controls, tc_dot, TcModel};
    use super::*;
    use crate::splitmix::SplitMix64;

    /// `f32::to_bits` of a slice.
    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// `rows` bf16 rows of `cols`, block by block from tiles of the class
    /// `class(b)` (`a` rows for activations, `b` columns for weights), so
    /// that a class's within-block structure (cancelling pairs) survives.
    fn matrix(
        seed: u64,
        rows: usize,
        cols: usize,
        weights: bool,
        class: impl Fn(usize) -> Class,
    ) -> Vec<u16> {
        let nb = cols.div_ceil(MMA_K);
        let mut out = vec![0u16; rows * cols];
        let mut r = SplitMix64(seed);
        for b in 0..nb {
            let ts = tiles(class(b), seed.wrapping_add(b as u64), rows.div_ceil(8));
            for o in 0..rows {
                let t = &ts[o / 8];
                let pick = (r.next_u64() % 8) as usize;
                let src = if weights {
                    &t.b[pick * MMA_K..(pick + 1) * MMA_K]
                } else {
                    &t.a[(o % 8 + 8 * (pick % 2)) * MMA_K..][..MMA_K]
                };
                let hi = ((b + 1) * MMA_K).min(cols);
                out[o * cols + b * MMA_K..o * cols + hi].copy_from_slice(&src[..hi - b * MMA_K]);
            }
        }
        out
    }

    /// Every fast kernel (portable, AVX2 where present; one and three
    /// threads) against `tc_dot` per output, bit for bit.
    fn check(xb: &[u16], n: usize, w: &[u16], rows: usize, cols: usize, what: &str) -> Vec<f32> {
        let mut want = vec![0.0f32; n * rows];
        for t in 0..n {
            for o in 0..rows {
                want[t * rows + o] = tc_dot(
                    &SM90_BF16,
                    &xb[t * cols..(t + 1) * cols],
                    &w[o * cols..(o + 1) * cols],
                );
            }
        }
        for th in [Threads::single(), Threads::new(3).expect("threads")] {
            let mut got = vec![f32::NAN; n * rows];
            matmul_portable(&th, xb, n, w, rows, cols, &mut got);
            assert_eq!(bits(&got), bits(&want), "portable, {what}");
            #[cfg(target_arch = "x86_64")]
            if crate::use_avx2() {
                let mut got = vec![f32::NAN; n * rows];
                avx2::matmul(&th, xb, n, w, rows, cols, &mut got);
                assert_eq!(bits(&got), bits(&want), "avx2, {what}");
            }
        }
        want
    }

    /// (n, rows, cols): k not a multiple of 16, partial row groups, one
    /// token, a token tile and a W chunk crossed.
    const SHAPES: [(usize, usize, usize); 8] = [
        (1, 1, 16),
        (1, 13, 37),
        (3, 8, 16),
        (5, 37, 70),
        (9, 20, 200),
        (34, 9, 40),
        (2, 17, 300),
        (1, 3, 5),
    ];

    #[test]
    fn every_class_matches_tc_dot_bit_for_bit() {
        // Both ways round: the probe's `a` and `b` sides differ (subnormal
        // `b` beside tiny `a`, say), and x and w are decoded by different
        // code.
        for (ci, class) in Class::ALL.into_iter().enumerate() {
            for (si, &(n, rows, cols)) in SHAPES.iter().enumerate() {
                for swap in [false, true] {
                    let seed = (ci * 100 + si) as u64;
                    let xb = matrix(seed, n, cols, swap, |_| class);
                    let w = matrix(seed + 7, rows, cols, !swap, |_| class);
                    check(
                        &xb,
                        n,
                        &w,
                        rows,
                        cols,
                        &format!("{} {n}x{rows}x{cols} {swap}", class.name()),
                    );
                }
            }
        }
    }

    /// A finite bf16 with its exponent field uniform in `[lo, hi]` (0:
    /// subnormal or zero), random sign and mantissa.
    fn bf16_in(r: &mut SplitMix64, lo: u64, hi: u64) -> u16 {
        let v = r.next_u64();
        let e = lo + v % (hi - lo + 1);
        ((v >> 20) & 0x8000) as u16 | (e as u16) << 7 | ((v >> 40) & 0x7f) as u16
    }

    #[test]
    fn the_whole_exponent_range_matches_tc_dot() {
        // Per row, operands from a random window of exponent fields (the
        // whole range, or 12 wide somewhere in it, or low, where products
        // and sums fall among f32's subnormals and below 2^-149), with
        // zeros and subnormals mixed in.
        let (n, rows, cols) = (7, 29, 96);
        let mut r = SplitMix64(77);
        for round in 0..12 {
            let fill = |len: usize, r: &mut SplitMix64| -> Vec<u16> {
                let mut v = vec![0u16; len];
                for row in v.chunks_mut(cols) {
                    let (lo, hi) = match r.next_u64() % 4 {
                        0 => (0, 254),
                        1 => {
                            let lo = r.next_u64() % 243;
                            (lo, lo + 12)
                        }
                        2 => (0, 40),
                        _ => (0, 3),
                    };
                    for x in row.iter_mut() {
                        *x = match r.next_u64() % 16 {
                            0 => (r.next_u64() & 0x807f) as u16,
                            1 => (r.next_u64() & 0x8000) as u16,
                            _ => bf16_in(r, lo, hi),
                        };
                    }
                }
                v
            };
            let xb = fill(n * cols, &mut r);
            let w = fill(rows * cols, &mut r);
            check(&xb, n, &w, rows, cols, &format!("range round {round}"));
        }
    }

    #[test]
    fn crafted_edges_match_tc_dot() {
        // One step each (x = a, w = b), every kernel: a negative sum below
        // 2^-149 (the model's -0), a sum at f32's least subnormal, past
        // f32::MAX to +-inf, just under 2^128, subnormal weights under a
        // huge activation and the reverse, exact cancellation to +0, a zero
        // beside a huge factor (which must not set the alignment).
        let p = |e: i32| super::super::f32_to_bf16(2f32.powi(e));
        let neg = |b: u16| b ^ 0x8000;
        let sub = 0x0001u16; // 2^-133
        let cases: Vec<(Vec<u16>, Vec<u16>)> = vec![
            (vec![neg(p(-100))], vec![p(-60)]),
            (vec![neg(p(-100)), p(-70)], vec![p(-60), p(-80)]),
            (vec![p(-100)], vec![p(-49)]),
            (vec![neg(p(-75)), p(-75)], vec![p(-75), p(-74)]),
            (vec![p(127); 4], vec![p(127); 4]),
            (vec![neg(p(127)); 2], vec![p(1); 2]),
            (vec![0x7f7f, 0x7f7f], vec![0x3f80, 0x3f80]),
            (vec![0x7f7f], vec![0x3fff]),
            (vec![p(127), sub, neg(sub)], vec![sub, p(127), p(127)]),
            (vec![sub; 16], vec![p(120); 16]),
            (vec![p(3), neg(p(3)), 0x8000], vec![p(2), p(2), p(5)]),
            (vec![0x8000; 3], vec![0x8000; 3]),
            (vec![p(127), p(-100)], vec![0x8000, p(-40)]),
            (vec![0, p(-100)], vec![p(127), p(-40)]),
            (vec![p(127), neg(p(-126))], vec![0, p(-100)]),
            (vec![0x8000, neg(p(-126))], vec![p(127), p(-100)]),
        ];
        // Each case alone (n = 1, one row), then all of them as the rows
        // of one matrix against each case as a token.
        let cols = 16;
        let rows_of = |v: &[u16]| {
            let mut row = v.to_vec();
            row.resize(cols, 0);
            row
        };
        let mut w = Vec::new();
        let mut xb = Vec::new();
        for (a, b) in &cases {
            check(
                &rows_of(a),
                1,
                &rows_of(b),
                1,
                cols,
                &format!("{a:x?} {b:x?}"),
            );
            xb.extend(rows_of(a));
            w.extend(rows_of(b));
        }
        let want = check(&xb, cases.len(), &w, cases.len(), cols, "all crafted");
        // The first is the model's negative zero (and the kernels agree).
        assert_eq!(want[0].to_bits(), 0x8000_0000);
    }

    #[test]
    fn mixed_classes_match_tc_dot_bit_for_bit() {
        // Blocks of different classes in one chain: huge addends beside
        // tiny products, subnormal ones beside cancellation, and a special
        // late in the chain.
        for (si, &(n, rows, cols)) in SHAPES.iter().enumerate() {
            for seed in 0..4u64 {
                let s = seed * 1000 + si as u64;
                let pick = |b: usize| Class::ALL[(s as usize * 7 + b * 3 + b * b) % 5];
                let xb = matrix(s, n, cols, false, pick);
                let mut w = matrix(s + 1, rows, cols, true, |b| {
                    Class::ALL[(s as usize + b * 5) % 5]
                });
                if seed == 3 {
                    // One infinity in the last block of row 0.
                    w[cols - 1] = 0x7f80;
                }
                check(
                    &xb,
                    n,
                    &w,
                    rows,
                    cols,
                    &format!("mixed {s} {n}x{rows}x{cols}"),
                );
            }
        }
    }

    #[test]
    fn uniform_data_and_f32_inputs_match() {
        // The common case: activations and weights as a model has them,
        // through the public entry (f32 activations rounded to bf16).
        let (n, rows, cols) = (4, 45, 333);
        let mut r = SplitMix64(11);
        let mut x = r.uniform_vec(n * cols, 3.0);
        x[5] = f32::NAN;
        x[cols + 17] = 1e-40;
        x[2 * cols + 3] = -0.0;
        let w: Vec<u16> = r
            .uniform_vec(rows * cols, 0.05)
            .into_iter()
            .map(super::super::f32_to_bf16)
            .collect();
        let xb: Vec<u16> = x.iter().map(|&v| super::super::f32_to_bf16(v)).collect();
        let want = check(&xb, n, &w, rows, cols, "uniform");
        let mut got = vec![0.0; n * rows];
        super::super::tc_matmul(
            &Threads::new(2).expect("threads"),
            &SM90_BF16,
            &x,
            n,
            &w,
            rows,
            cols,
            &mut got,
        );
        assert_eq!(bits(&got), bits(&want));
    }

    /// Outputs of tile `t`: `(token row i, weight column j, c)`.
    fn tile_outputs(t: &Tile) -> impl Iterator<Item = (&[u16], &[u16], f32)> {
        (0..OUTPUTS).map(|o| {
            let (i, j) = (o / 8, o % 8);
            (
                &t.a[i * MMA_K..(i + 1) * MMA_K],
                &t.b[j * MMA_K..(j + 1) * MMA_K],
                t.c[o],
            )
        })
    }

    #[test]
    fn one_step_matches_mma_dot_for_any_addend() {
        // The chains above start from +0; here the addend is the class's
        // own (subnormal, huge, zero of either sign).
        for class in Class::ALL {
            for t in tiles(class, 5, 64) {
                for (a, b, c) in tile_outputs(&t) {
                    if !c.is_finite() || a.iter().chain(b).any(|&v| is_special(v)) {
                        continue;
                    }
                    let (xs, xf): (Vec<i32>, Vec<i32>) = a.iter().map(|&v| decode(v)).unzip();
                    let (ws, wf): (Vec<i32>, Vec<i32>) = b.iter().map(|&v| decode(v)).unzip();
                    let want = mma_dot(&SM90_BF16, c, a, b);
                    let got = step_decoded(c, &xs, &xf, &ws, &wf);
                    assert_eq!(got.to_bits(), want.to_bits(), "{}: c {c:e}", class.name());
                }
                #[cfg(target_arch = "x86_64")]
                if crate::use_avx2() {
                    avx2::check_tile(&t, class.name());
                }
            }
        }
    }

    #[test]
    fn the_checks_can_fail() {
        // The comparisons above would see a kernel that computed a
        // neighbouring design: on the same inputs, each negative control
        // differs from the fast result somewhere.
        let (n, rows, cols) = (6, 24, 64);
        let mut fast_all = Vec::new();
        let mut inputs = Vec::new();
        for (ci, class) in Class::ALL.into_iter().enumerate().take(5) {
            let xb = matrix(ci as u64, n, cols, false, |_| class);
            let w = matrix(ci as u64 + 50, rows, cols, true, |_| class);
            let mut y = vec![0.0; n * rows];
            matmul(&Threads::single(), &xb, n, &w, rows, cols, &mut y);
            fast_all.extend(bits(&y));
            inputs.push((xb, w));
        }
        let control = |m: &TcModel| {
            let mut all = Vec::new();
            for (xb, w) in &inputs {
                let mut y = vec![0.0; n * rows];
                general_matmul(&Threads::single(), m, xb, n, w, rows, cols, &mut y);
                all.extend(bits(&y));
            }
            all
        };
        assert_eq!(control(&SM90_BF16), fast_all);
        for (name, m) in negative_controls(SM90_BF16) {
            assert_ne!(control(&m), fast_all, "{name} is not told apart");
        }
        // And a one-bit change of one weight changes an output.
        let (xb, mut w) = inputs.swap_remove(0);
        let mut before = vec![0.0; n * rows];
        matmul(&Threads::single(), &xb, n, &w, rows, cols, &mut before);
        w[3] ^= 1 << 6;
        let mut after = vec![0.0; n * rows];
        matmul(&Threads::single(), &xb, n, &w, rows, cols, &mut after);
        assert_ne!(bits(&before), bits(&after));
    }

    /// Wall time of `f`, best of `reps`, in ms.
    fn time_ms(reps: usize, mut f: impl FnMut()) -> f64 {
        (0..reps)
            .map(|_| {
                let t = std::time::Instant::now();
                f();
                t.elapsed().as_secs_f64() * 1e3
            })
            .fold(f64::INFINITY, f64::min)
    }

    #[test]
    #[ignore = "timing; run with --release -- --ignored --nocapture"]
    fn timing_against_the_general_path() {
        let th = Threads::new(2).expect("threads");
        for (n, rows, cols) in [
            (8, 576, 576),
            (8, 1536, 576),
            (8, 576, 1536),
            (1, 4096, 4096),
        ] {
            let mut r = SplitMix64(1);
            let xb: Vec<u16> = r
                .uniform_vec(n * cols, 2.0)
                .into_iter()
                .map(super::super::f32_to_bf16)
                .collect();
            let w: Vec<u16> = r
                .uniform_vec(rows * cols, 0.05)
                .into_iter()
                .map(super::super::f32_to_bf16)
                .collect();
            let mut y0 = vec![0.0; n * rows];
            let mut y1 = vec![0.0; n * rows];
            let mut y2 = vec![0.0; n * rows];
            let general = time_ms(2, || {
                general_matmul(&th, &SM90_BF16, &xb, n, &w, rows, cols, &mut y0)
            });
            let portable = time_ms(3, || matmul_portable(&th, &xb, n, &w, rows, cols, &mut y1));
            let fast = time_ms(5, || matmul(&th, &xb, n, &w, rows, cols, &mut y2));
            assert_eq!(bits(&y0), bits(&y1));
            assert_eq!(bits(&y0), bits(&y2));
            println!(
                "n={n} rows={rows} cols={cols} (2 threads): general {general:.2} ms, portable {portable:.2} ms ({:.1}x), fast {fast:.2} ms ({:.1}x)",
                general / portable,
                general / fast
            );
        }
    }
}
