//! AVX-512 kernels over quantized weights, the same bits as [`crate::x86`]'s
//! AVX2 ones: decode of the K-quants (`Q4_K`, `Q6_K`; one token against 8
//! rows, [`dot8k`], AVX2's `dot8q`), and the prefill micro-kernel of every
//! quantized kind over rows dequantized in quads ([`prefill8`], AVX2's
//! `dot8` micro-kernels).
//!
//! In decode a 512-bit register holds two rows' 8 canonical lanes (row `r`
//! in lanes 0–7, row `r + 1` in lanes 8–15), so every lane runs exactly the
//! FMA chain of the AVX2 kernel (elements `64c + l + 8j`, `j` ascending,
//! from +0.0), and the 8 rows' chunk partials are joined by [`hsum8x`]'s
//! adds (moved by 512-bit shuffles, [`tree8`]) in chunk order. In prefill a
//! register holds 4 rows × 4 lanes of one token, lanes `0..4` and `4..8` in
//! two registers, so the tree's first level is a plain add; the chains and
//! adds are the same. What changes in decode is how a weight
//! reaches its lane:
//! - `Q4_K`: a 32-weight sub-block has only 16 distinct weights, `q = 0..15`
//!   through the reference's formula. Both rows' tables (16 floats each,
//!   built with the very operations of the reference, see
//!   [`crate::x86::KScales`]) are one two-source permute away: the nibble,
//!   with bit 4 set for the second row, is the permute's index. No
//!   conversion or scale arithmetic per weight.
//! - `Q6_K`: the 6-bit quants are assembled in bytes for both rows at once,
//!   moved to the top byte of their 32-bit lane by a byte permute (VBMI) and
//!   sign-extended by a shift; then `(d·s)·q` as the reference.
//!
//! Invariant: every weight and every FMA is the AVX2 kernel's, so the
//! output bits are equal whichever kernel runs (`LMRR_NO_AVX512=1` forces
//! the AVX2 one; the tests below compare both on random blocks whose scales
//! are random bits: subnormal, infinite and NaN included).

use std::arch::x86_64::*;

use crate::quant::QuantKind;
#[allow(unused_imports)] // the doc links
use crate::x86::hsum8x;
use crate::x86::{kscales, KScales, Q4K};
use crate::CHUNK;

/// Whether quantized matmuls take this module's kernels: the AVX2 path
/// is in use (no `LMRR_FORCE_SCALAR`), the CPU has AVX-512 F, BW, DQ and
/// VBMI, and `LMRR_NO_AVX512` is not `1`. Detected once.
pub fn use_avx512() -> bool {
    use std::sync::OnceLock;
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        crate::use_avx2()
            && std::env::var_os("LMRR_NO_AVX512").is_none_or(|v| v != "1")
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512dq")
            && is_x86_feature_detected!("avx512vbmi")
    })
}

/// Byte `4L + 3` of the result holds byte `8m + l` of the row (`l = L % 8`,
/// bytes `32..` for the second row, lanes `L ≥ 8`): quant `m` of lane `l`
/// in the top byte of a 32-bit lane, ready for an arithmetic shift. Only
/// the top bytes are kept (mask `0x8888…`).
const fn top_byte_index(m: usize) -> [u8; 64] {
    let mut idx = [0u8; 64];
    let mut lane = 0;
    while lane < 16 {
        idx[4 * lane + 3] = ((lane / 8) * 32 + 8 * m + lane % 8) as u8;
        lane += 1;
    }
    idx
}

/// Byte `4L + m` of the result holds byte `8m + l` of the row: the four
/// 8-weight groups of lane `l`, one per byte of its 32-bit lane.
const fn transpose_index() -> [u8; 64] {
    let mut idx = [0u8; 64];
    let mut i = 0;
    while i < 64 {
        let (lane, m) = (i / 4, i % 4);
        idx[i] = ((lane / 8) * 32 + 8 * m + lane % 8) as u8;
        i += 1;
    }
    idx
}

/// The byte permutes' indices, built at compile time (not per call).
static TRANSPOSE: [u8; 64] = transpose_index();
static TOPS: [[u8; 64]; 4] = [
    top_byte_index(0),
    top_byte_index(1),
    top_byte_index(2),
    top_byte_index(3),
];

/// Two 256-bit loads as one register: `a` in lanes 0–7, `b` in 8–15.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vbmi")]
unsafe fn pair_bytes(a: *const u8, b: *const u8) -> __m512i {
    let lo = _mm256_loadu_si256(a as *const __m256i);
    let hi = _mm256_loadu_si256(b as *const __m256i);
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}

/// The 16 weights `q = 0..15` of `Q4_K` sub-block `j` of a super-block with
/// scales `s`: `fma(dl, q, −ml)` where fused, `dl·q − ml` otherwise, the
/// reference's operations on the reference's operands.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vbmi")]
unsafe fn q4k_table(s: &KScales, j: usize, fused: bool) -> __m512 {
    let q = _mm512_setr_ps(
        0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
    );
    let (dl, ml) = (_mm512_set1_ps(s.dl[j]), _mm512_set1_ps(s.ml[j]));
    if fused {
        _mm512_fmsub_ps(dl, q, ml)
    } else {
        _mm512_sub_ps(_mm512_mul_ps(dl, q), ml)
    }
}

/// 8 canonical dot products of `x` with 8 `K`-quant rows (`ws`), `k` a
/// multiple of 256: [`crate::x86::dot8q`]'s bits. `ahead` is the byte
/// distance of the caller's next group of rows (prefetched, never read).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vbmi,avx2,fma,f16c")]
pub(crate) unsafe fn dot8k<const K: u8>(
    x: *const f32,
    ws: &[*const u8; 8],
    k: usize,
    ahead: usize,
) -> __m256 {
    let kind = if K == Q4K {
        QuantKind::Q4K
    } else {
        QuantKind::Q6K
    };
    let block_bytes = kind.block_bytes();
    let chunk_bytes = block_bytes / 4;
    let c_ = Consts::new();
    let mut tot = _mm256_setzero_ps();
    for sb in 0..k / (4 * CHUNK) {
        let p: [*const u8; 8] = std::array::from_fn(|i| ws[i].add(sb * block_bytes));
        // Named locals, not an array: each is written once and read in place.
        let (s0, s1) = (kscales::<K>(p[0]), kscales::<K>(p[1]));
        let (s2, s3) = (kscales::<K>(p[2]), kscales::<K>(p[3]));
        let (s4, s5) = (kscales::<K>(p[4]), kscales::<K>(p[5]));
        let (s6, s7) = (kscales::<K>(p[6]), kscales::<K>(p[7]));
        for cb in 0..4 {
            let c = 4 * sb + cb;
            // The same chunk of the caller's next 8 rows: a hint only.
            let pf = c * chunk_bytes + ahead;
            for &w in ws {
                _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add(pf) as *const i8);
            }
            let xc = x.add(c * CHUNK);
            let a = [
                pair_chunk::<K>(&c_, [p[0], p[1]], [&s0, &s1], cb, xc),
                pair_chunk::<K>(&c_, [p[2], p[3]], [&s2, &s3], cb, xc),
                pair_chunk::<K>(&c_, [p[4], p[5]], [&s4, &s5], cb, xc),
                pair_chunk::<K>(&c_, [p[6], p[7]], [&s6, &s7], cb, xc),
            ];
            tot = _mm256_add_ps(tot, tree8(a));
        }
    }
    tot
}

/// Tokens per call of [`prefill8`].
pub(crate) const PREFILL_TOKENS: usize = 4;

/// 8 rows × [`PREFILL_TOKENS`] tokens of canonical dot products over the
/// `len` elements of dequantized rows laid out by
/// [`crate::prefill::dequant_quads`] (`w`,
/// `len` a multiple of 8), continuing the running totals `tot` (in the
/// order of [`transpose4`]; `len` is a multiple of [`CHUNK`] unless it
/// ends the rows): every output's lane `l` runs the chain of
/// [`crate::x86`]'s `dot8` (elements `64c + l + 8j`, `j` ascending, from
/// +0.0), its chunk partials joined by [`hsum8x`]'s adds and added to the
/// total in chunk order: the AVX2 micro-kernels' bits, whether the rows
/// come in one call or in several.
///
/// A register holds 4 rows × 4 lanes of one token: lanes `0..4` in one,
/// `4..8` in another, so the tree's first level, `(l, l + 4)`, is a plain
/// add and only its last two levels move data (12 shuffles per chunk for
/// 32 outputs, against 36 for a register of 2 rows × 8 lanes).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vbmi,avx2,fma,f16c")]
pub(crate) unsafe fn prefill8(
    xs: [*const f32; PREFILL_TOKENS],
    w: *const f32,
    len: usize,
    mut tot: [__m512; PREFILL_TOKENS / 2],
) -> [__m512; PREFILL_TOKENS / 2] {
    const T: usize = PREFILL_TOKENS;
    let quad = 4 * len;
    let mut c0 = 0;
    while c0 < len {
        let cend = (c0 + CHUNK).min(len);
        // acc[t][q][h]: token t, rows 4q..4q + 4, lanes 4h..4h + 4.
        let mut acc = [[[_mm512_setzero_ps(); 2]; 2]; T];
        let mut i = c0;
        while i < cend {
            let wv: [[__m512; 2]; 2] = std::array::from_fn(|q| {
                std::array::from_fn(|h| _mm512_loadu_ps(w.add(q * quad + 4 * i + 16 * h)))
            });
            for t in 0..T {
                let xa = _mm512_broadcast_f32x4(_mm_loadu_ps(xs[t].add(i)));
                let xb = _mm512_broadcast_f32x4(_mm_loadu_ps(xs[t].add(i + 4)));
                for q in 0..2 {
                    acc[t][q][0] = _mm512_fmadd_ps(xa, wv[q][0], acc[t][q][0]);
                    acc[t][q][1] = _mm512_fmadd_ps(xb, wv[q][1], acc[t][q][1]);
                }
            }
            i += 8;
        }
        // (l, l + 4); then, per 128-bit block (a row), (0, 2) (1, 3) with
        // quad 1's row beside quad 0's; then (0, 1) with the next token's.
        let l2: [__m512; T] = std::array::from_fn(|t| {
            let a = _mm512_add_ps(acc[t][0][0], acc[t][0][1]);
            let b = _mm512_add_ps(acc[t][1][0], acc[t][1][1]);
            _mm512_add_ps(
                _mm512_shuffle_ps::<0b01_00_01_00>(a, b),
                _mm512_shuffle_ps::<0b11_10_11_10>(a, b),
            )
        });
        for p in 0..T / 2 {
            let (a, b) = (l2[2 * p], l2[2 * p + 1]);
            let r = _mm512_add_ps(
                _mm512_shuffle_ps::<0b10_00_10_00>(a, b),
                _mm512_shuffle_ps::<0b11_01_11_01>(a, b),
            );
            tot[p] = _mm512_add_ps(tot[p], r);
        }
        c0 = cend;
    }
    tot
}

/// Between two tokens' 8 outputs each, `[u0..u7, v0..v7]`, and the order of
/// [`prefill8`]'s totals, element `4b` holding `u[b]`, `4b + 1` `u[4 + b]`,
/// `4b + 2` `v[b]` and `4b + 3` `v[4 + b]`: a 4 × 4 transpose, so the same
/// permute goes both ways.
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn transpose4(v: __m512) -> __m512 {
    let idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_permutexvar_ps(idx, v)
}

/// The lane trees of 8 rows' chunk partials, `a[i]` holding rows `2i` and
/// `2i + 1`: element `e` of the result is row `e`'s tree, the adds of
/// [`hsum8x`] ((0,4) (1,5) (2,6) (3,7), then (0,2) (1,3), then (0,1)), with
/// the rows moved by whole 128-bit blocks and in-block shuffles instead.
#[inline]
#[target_feature(enable = "avx512f,avx512dq")]
unsafe fn tree8(a: [__m512; 4]) -> __m256 {
    // Blocks of x: rows 0–3, lanes l + lanes l + 4 (l = 0..3); y: rows 4–7.
    let t = |u: __m512, v: __m512| {
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(u, v),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(u, v),
        )
    };
    let (x, y) = (t(a[0], a[1]), t(a[2], a[3]));
    // Block k: [t0 + t2, t1 + t3] of row k, then of row 4 + k.
    let u = _mm512_add_ps(
        _mm512_shuffle_ps::<0b01_00_01_00>(x, y),
        _mm512_shuffle_ps::<0b11_10_11_10>(x, y),
    );
    // Block k: the tree of row k, then of row 4 + k.
    let v = _mm512_add_ps(
        _mm512_shuffle_ps::<0b10_00_10_00>(u, u),
        _mm512_shuffle_ps::<0b11_01_11_01>(u, u),
    );
    let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm512_castps512_ps256(_mm512_permutexvar_ps(order, v))
}

/// Constants of the kernel, built once per call.
struct Consts {
    trans: __m512i,
    tops: [__m512i; 4],
    /// Bit 4 of the second row's nibbles: its table in the two-source permute.
    row_bit: __m512i,
    nib: __m512i,
    /// Lanes 8–15 of a scale index pick from the second row's 16 scales.
    upper: __m512i,
}

impl Consts {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vbmi")]
    unsafe fn new() -> Self {
        Self {
            trans: _mm512_loadu_si512(TRANSPOSE.as_ptr() as *const _),
            tops: [0, 1, 2, 3].map(|m| _mm512_loadu_si512(TOPS[m].as_ptr() as *const _)),
            row_bit: _mm512_mask_set1_epi8(_mm512_setzero_si512(), !0u64 << 32, 0x10),
            nib: _mm512_set1_epi8(0x0f),
            upper: _mm512_mask_set1_epi32(_mm512_setzero_si512(), 0xff00, 16),
        }
    }
}

/// Chunk `cb` of the super-blocks at `p` (two rows, scales `s`) against the
/// chunk's 64 inputs at `xc`: both rows' 8 lane partials, the first row in
/// lanes 0–7.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vbmi,avx2,fma,f16c")]
unsafe fn pair_chunk<const K: u8>(
    c_: &Consts,
    p: [*const u8; 2],
    s: [&KScales; 2],
    cb: usize,
    xc: *const f32,
) -> __m512 {
    let [pa, pb] = p;
    let [sa, sb] = s;
    let xv = |j: usize| _mm512_broadcast_f32x8(_mm256_loadu_ps(xc.add(8 * j)));
    let mut acc = _mm512_setzero_ps();
    if K == Q4K {
        // Groups 0–3: low nibbles of bytes 8m..8m+8 (sub-block 2cb);
        // groups 4–7: their high nibbles (2cb + 1).
        let v = _mm512_permutexvar_epi8(
            c_.trans,
            pair_bytes(pa.add(16 + 32 * cb), pb.add(16 + 32 * cb)),
        );
        // (v & 0x0f) | row_bit, per byte.
        let lo = _mm512_ternarylogic_epi32::<0xEA>(v, c_.nib, c_.row_bit);
        let hi = _mm512_ternarylogic_epi32::<0xEA>(_mm512_srli_epi32::<4>(v), c_.nib, c_.row_bit);
        let fused = sa.fused && sb.fused;
        for (half, src) in [lo, hi].into_iter().enumerate() {
            let j = 2 * cb + half;
            let (ta, tb) = (q4k_table(sa, j, fused), q4k_table(sb, j, fused));
            // Index bits 0–4 of byte m (the permute reads no more).
            let idx = [
                src,
                _mm512_srli_epi32::<8>(src),
                _mm512_srli_epi32::<16>(src),
                _mm512_srli_epi32::<24>(src),
            ];
            for (m, &i) in idx.iter().enumerate() {
                let w = _mm512_permutex2var_ps(ta, i, tb);
                acc = _mm512_fmadd_ps(xv(4 * half + m), w, acc);
            }
        }
    } else {
        // Q6_K chunk cb: half cb / 2 of the super-block, the low (even cb)
        // or high (odd) nibbles of its ql bytes, bit pairs 4·(cb % 2) and
        // 4·(cb % 2) + 2 of its qh.
        let (half, odd) = (cb / 2, (cb % 2) as i32);
        let shift = _mm_cvtsi32_si128(4 * odd);
        let (m30, off) = (_mm512_set1_epi8(0x30), _mm512_set1_epi8(32));
        let h = _mm512_srl_epi16(
            pair_bytes(pa.add(128 + 32 * half), pb.add(128 + 32 * half)),
            shift,
        );
        let hi = [
            _mm512_and_si512(_mm512_slli_epi16::<4>(h), m30),
            _mm512_and_si512(_mm512_slli_epi16::<2>(h), m30),
        ];
        // Each half from its own 256-bit store in `kscales` (a 512-bit load
        // over two stores would wait for them instead of forwarding).
        let dl16 = |s: &KScales| {
            let lo = _mm256_loadu_ps(s.dl.as_ptr());
            _mm512_insertf32x8::<1>(
                _mm512_castps256_ps512(lo),
                _mm256_loadu_ps(s.dl.as_ptr().add(8)),
            )
        };
        let (da, db) = (dl16(sa), dl16(sb));
        for (g, &hg) in hi.iter().enumerate() {
            let lq = pair_bytes(pa.add(64 * half + 32 * g), pb.add(64 * half + 32 * g));
            let lo = _mm512_and_si512(_mm512_srl_epi16(lq, shift), c_.nib);
            // Weights 32g..32g+32 of the chunk, as i8 in [−32, 31].
            let q = _mm512_sub_epi8(_mm512_or_si512(lo, hg), off);
            for (m, &t) in c_.tops.iter().enumerate() {
                let qi = _mm512_srai_epi32::<24>(_mm512_maskz_permutexvar_epi8(
                    0x8888_8888_8888_8888,
                    t,
                    q,
                ));
                let si =
                    _mm512_or_si512(_mm512_set1_epi32((4 * cb + 2 * g + m / 2) as i32), c_.upper);
                let dl = _mm512_permutex2var_ps(da, si, db);
                let w = _mm512_mul_ps(dl, _mm512_cvtepi32_ps(qi));
                acc = _mm512_fmadd_ps(xv(4 * g + m), w, acc);
            }
        }
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::splitmix::SplitMix64;
    use crate::x86::{dot8q, Q6K};

    /// Random super-blocks; with `wild`, every scale is random bits
    /// (subnormals, infinities, NaNs), else a trained model's magnitude.
    fn blocks(r: &mut SplitMix64, bb: usize, n: usize, wild: bool) -> Vec<u8> {
        let mut out: Vec<u8> = (0..n * bb).map(|_| r.next_u64() as u8).collect();
        if !wild {
            for b in out.chunks_exact_mut(bb) {
                let offs: &[usize] = if bb == 144 { &[0, 2] } else { &[208] };
                for &o in offs {
                    // Exponent 8..11 of f16 (about 1e-3), random mantissa and sign.
                    let h = (r.next_u64() as u16 & 0x83ff) | ((8 + r.next_u64() as u16 % 4) << 10);
                    b[o..o + 2].copy_from_slice(&h.to_le_bytes());
                }
            }
        }
        out
    }

    fn check<const K: u8>(bb: usize) {
        if !use_avx512() {
            eprintln!("SKIPPED: no AVX-512 (F, BW, DQ, VBMI) on this CPU, or LMRR_NO_AVX512=1");
            return;
        }
        let mut r = SplitMix64(K as u64 + 40);
        for &(k, wild) in &[
            (256usize, false),
            (1536, false),
            (256 * 21, false),
            (1536, true),
            (512, true),
        ] {
            let sbs = k / 256;
            let mut w = blocks(&mut r, bb, 8 * sbs, wild);
            if wild {
                // Pairs whose rows differ in the Q4_K table's form: row 1 with
                // an infinite d, row 2 with a NaN dmin (Q6_K: d), row 5 with a
                // subnormal one, in their first super-block.
                let d = if bb == 144 {
                    [0usize, 2, 0]
                } else {
                    [208, 208, 208]
                };
                for (row, (&o, h)) in [1usize, 2, 5]
                    .iter()
                    .zip(d.iter().zip([0x7c00u16, 0x7e01, 0x0003]))
                {
                    let at = row * sbs * bb + o;
                    w[at..at + 2].copy_from_slice(&h.to_le_bytes());
                }
            }
            let ws: [*const u8; 8] = std::array::from_fn(|i| w[i * sbs * bb..].as_ptr());
            for scale in [1.0f32, 1e-30, 1e30] {
                let x: Vec<f32> = (0..k).map(|_| r.uniform(2.0) * scale).collect();
                let (mut a, mut b) = ([0f32; 8], [0f32; 8]);
                // SAFETY: AVX-512 and AVX2 are present (checked above); every
                // row holds `k` weights.
                unsafe {
                    _mm256_storeu_ps(a.as_mut_ptr(), dot8k::<K>(x.as_ptr(), &ws, k, 0));
                    _mm256_storeu_ps(b.as_mut_ptr(), dot8q::<K>(x.as_ptr(), &ws, k, 0));
                }
                let (a, b) = (a.map(f32::to_bits), b.map(f32::to_bits));
                assert_eq!(a, b, "K={K} k={k} wild={wild} x scale {scale}");
            }
        }
    }

    #[test]
    fn q4k_avx512_equals_avx2() {
        check::<Q4K>(144);
    }

    #[test]
    fn q6k_avx512_equals_avx2() {
        check::<Q6K>(210);
    }

    /// The prefill micro-kernel against the scalar reference dot over the
    /// same rows, for chunked and ragged `k` and rows with wild values.
    #[test]
    fn prefill8_equals_the_reference_dot() {
        if !use_avx512() {
            eprintln!("SKIPPED: no AVX-512 (F, BW, DQ, VBMI) on this CPU, or LMRR_NO_AVX512=1");
            return;
        }
        let mut r = SplitMix64(77);
        for k in [8usize, 64, 96, 256, 1544] {
            let rows: Vec<Vec<f32>> = (0..8)
                .map(|i| {
                    (0..k)
                        .map(|j| match (i, j % 97) {
                            (3, 5) => f32::INFINITY,
                            (6, 11) => -0.0,
                            (7, 13) => f32::from_bits(1),
                            _ => r.uniform(1.0),
                        })
                        .collect()
                })
                .collect();
            let x: Vec<Vec<f32>> = (0..PREFILL_TOKENS)
                .map(|_| (0..k).map(|_| r.uniform(3.0)).collect())
                .collect();
            // The quad layout of `prefill::dequant_quads`, from f32 rows.
            let mut buf = vec![0f32; 8 * k];
            for (i, row) in rows.iter().enumerate() {
                for e in 0..k / 4 {
                    let o = ((i / 4) * (k / 4) + e) * 16 + (i % 4) * 4;
                    buf[o..o + 4].copy_from_slice(&row[4 * e..4 * e + 4]);
                }
            }
            // SAFETY: AVX-512 is present (checked above); every row and
            // token holds `k` elements.
            let xs = std::array::from_fn(|t| x[t].as_ptr());
            let zero = [unsafe { _mm512_setzero_ps() }; PREFILL_TOKENS / 2];
            // SAFETY: AVX-512 is present (checked above); every row and
            // token holds `k` elements.
            let whole = unsafe { prefill8(xs, buf.as_ptr(), k, zero) };
            // The same rows in two calls, split at a chunk boundary, the
            // first call's totals carried into the second.
            let cut = (k / 2 / CHUNK) * CHUNK;
            let mut head = vec![0f32; 8 * cut];
            let mut tail = vec![0f32; 8 * (k - cut)];
            for (i, row) in rows.iter().enumerate() {
                for e in 0..k / 4 {
                    let (dst, e2, len) = if 4 * e < cut {
                        (&mut head, e, cut)
                    } else {
                        (&mut tail, e - cut / 4, k - cut)
                    };
                    let o = ((i / 4) * (len / 4) + e2) * 16 + (i % 4) * 4;
                    dst[o..o + 4].copy_from_slice(&row[4 * e..4 * e + 4]);
                }
            }
            // SAFETY: as above; the tail pointers stay inside each token.
            let split = unsafe {
                let t = prefill8(xs, head.as_ptr(), cut, zero);
                prefill8(xs.map(|p| p.add(cut)), tail.as_ptr(), k - cut, t)
            };
            for (p, (a, b)) in whole.iter().zip(&split).enumerate() {
                let mut out = [0f32; 16];
                let mut two = [0f32; 16];
                // SAFETY: as above.
                unsafe {
                    _mm512_storeu_ps(out.as_mut_ptr(), transpose4(*a));
                    _mm512_storeu_ps(two.as_mut_ptr(), transpose4(*b));
                }
                for (j, (o, s)) in out.iter().zip(&two).enumerate() {
                    let (t, i) = (2 * p + j / 8, j % 8);
                    let want = crate::dot_ref(&x[t], &rows[i]);
                    assert_eq!(o.to_bits(), want.to_bits(), "k={k} token {t} row {i}");
                    assert_eq!(
                        s.to_bits(),
                        want.to_bits(),
                        "k={k} split at {cut}, token {t} row {i}"
                    );
                }
            }
        }
    }

    #[test]
    fn indices_pick_the_lane_groups() {
        let t = transpose_index();
        assert_eq!(&t[..8], &[0, 8, 16, 24, 1, 9, 17, 25]);
        assert_eq!(&t[32..36], &[32, 40, 48, 56]);
        let top = top_byte_index(2);
        assert_eq!((top[3], top[7], top[35], top[63]), (16, 17, 48, 55));
    }
}
