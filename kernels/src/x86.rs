//! AVX2 + FMA building blocks shared by the fast paths.
//!
//! Every function here reproduces the scalar reference order exactly: lane `i`
//! of a `__m256` accumulator is lane `i % 8` of the canonical chunk, and
//! [`hsum1`]/[`hsum8x`] join lanes with the tree of [`crate::lane_tree`].
//! All functions are `unsafe` because they require AVX2 and FMA, which the
//! callers check at run time through [`crate::use_avx2`] (the quantized-block
//! helpers also use F16C, part of the same detection).

use std::arch::x86_64::*;

use crate::quant::{QuantKind, QBLOCK};
use crate::CHUNK;

/// Element types a weight row can be stored in; all widen to f32 exactly.
pub(crate) trait Lanes: Copy + Send + Sync {
    /// Loads 8 consecutive elements as f32.
    unsafe fn load8(p: *const Self) -> __m256;
    /// Widens one element.
    fn to_f32(self) -> f32;
    /// Loads `n < 8` elements, zero-filling the rest.
    #[inline(always)]
    unsafe fn load_partial(p: *const Self, n: usize) -> __m256 {
        let mut buf = [0.0f32; 8];
        for (i, b) in buf.iter_mut().enumerate().take(n) {
            *b = (*p.add(i)).to_f32();
        }
        _mm256_loadu_ps(buf.as_ptr())
    }
}

impl Lanes for f32 {
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> __m256 {
        _mm256_loadu_ps(p)
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

/// bf16 stored as its raw `u16` bits.
impl Lanes for u16 {
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> __m256 {
        let h = _mm_loadu_si128(p as *const __m128i);
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits((self as u32) << 16)
    }
}

/// Lane tree of one accumulator.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn hsum1(a: __m256) -> f32 {
    let t = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    let u = _mm_add_ps(t, _mm_movehl_ps(t, t));
    let v = _mm_add_ss(u, _mm_shuffle_ps(u, u, 0b01));
    _mm_cvtss_f32(v)
}

/// Lane trees of 8 accumulators at once: element `e` of the result is the tree
/// of `a[e]`. Same adds as [`crate::lane_tree`], applied in parallel.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn hsum8x(a: &[__m256; 8]) -> __m256 {
    // Interleave so that the shuffles below land results in natural order.
    let b = [a[0], a[4], a[1], a[5], a[2], a[6], a[3], a[7]];
    // t[i] = l[i] + l[i+4]: lane 0 holds t of b[2j], lane 1 of b[2j+1].
    let t = |x: __m256, y: __m256| {
        _mm256_add_ps(
            _mm256_permute2f128_ps(x, y, 0x20),
            _mm256_permute2f128_ps(x, y, 0x31),
        )
    };
    let x0 = t(b[0], b[1]);
    let x1 = t(b[2], b[3]);
    let x2 = t(b[4], b[5]);
    let x3 = t(b[6], b[7]);
    // u[0] = t[0] + t[2], u[1] = t[1] + t[3].
    let u01 = _mm256_add_ps(
        _mm256_shuffle_ps(x0, x1, 0b01_00_01_00),
        _mm256_shuffle_ps(x0, x1, 0b11_10_11_10),
    );
    let u23 = _mm256_add_ps(
        _mm256_shuffle_ps(x2, x3, 0b01_00_01_00),
        _mm256_shuffle_ps(x2, x3, 0b11_10_11_10),
    );
    // v = u[0] + u[1].
    _mm256_add_ps(
        _mm256_shuffle_ps(u01, u23, 0b10_00_10_00),
        _mm256_shuffle_ps(u01, u23, 0b11_01_11_01),
    )
}

/// 8 canonical dot products at once: output `t * R + r` is
/// `dot(xs[t][..k], ws[r][..k])`. Requires `R * T == 8`.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn dot8<W: Lanes, const R: usize, const T: usize>(
    xs: &[*const f32; T],
    ws: &[*const W; R],
    k: usize,
) -> __m256 {
    debug_assert_eq!(R * T, 8);
    let mut tot = _mm256_setzero_ps();
    let mut c0 = 0;
    while c0 < k {
        let cend = (c0 + CHUNK).min(k);
        let mut acc = [_mm256_setzero_ps(); 8];
        let mut i = c0;
        while i + 8 <= cend {
            let mut xv = [_mm256_setzero_ps(); T];
            for t in 0..T {
                xv[t] = _mm256_loadu_ps(xs[t].add(i));
            }
            for r in 0..R {
                let wv = W::load8(ws[r].add(i));
                for t in 0..T {
                    acc[t * R + r] = _mm256_fmadd_ps(xv[t], wv, acc[t * R + r]);
                }
            }
            i += 8;
        }
        if i < cend {
            let n = cend - i;
            let mut xv = [_mm256_setzero_ps(); T];
            for t in 0..T {
                xv[t] = f32::load_partial(xs[t].add(i), n);
            }
            for r in 0..R {
                let wv = W::load_partial(ws[r].add(i), n);
                for t in 0..T {
                    acc[t * R + r] = _mm256_fmadd_ps(xv[t], wv, acc[t * R + r]);
                }
            }
        }
        tot = _mm256_add_ps(tot, hsum8x(&acc));
        c0 = cend;
    }
    tot
}

/// One canonical dot product.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
    let k = a.len();
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut total = 0.0f32;
    let mut c0 = 0;
    while c0 < k {
        let cend = (c0 + CHUNK).min(k);
        let mut acc = _mm256_setzero_ps();
        let mut i = c0;
        while i + 8 <= cend {
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc);
            i += 8;
        }
        if i < cend {
            let n = cend - i;
            acc = _mm256_fmadd_ps(
                f32::load_partial(pa.add(i), n),
                f32::load_partial(pb.add(i), n),
                acc,
            );
        }
        total += hsum1(acc);
        c0 = cend;
    }
    total
}

/// One canonical sum.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn sum(a: &[f32]) -> f32 {
    let k = a.len();
    let pa = a.as_ptr();
    let mut total = 0.0f32;
    let mut c0 = 0;
    while c0 < k {
        let cend = (c0 + CHUNK).min(k);
        let mut acc = _mm256_setzero_ps();
        let mut i = c0;
        while i + 8 <= cend {
            acc = _mm256_add_ps(acc, _mm256_loadu_ps(pa.add(i)));
            i += 8;
        }
        if i < cend {
            acc = _mm256_add_ps(acc, f32::load_partial(pa.add(i), cend - i));
        }
        total += hsum1(acc);
        c0 = cend;
    }
    total
}

/// [`crate::exp::det_exp`] on 8 lanes.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn exp8(x: __m256) -> __m256 {
    use crate::exp::{EXP_HI, EXP_LO, LN2_HI, LN2_LO, LOG2E, POLY, ROUND_MAGIC};
    let xc = _mm256_min_ps(
        _mm256_max_ps(x, _mm256_set1_ps(EXP_LO)),
        _mm256_set1_ps(EXP_HI),
    );
    let t = _mm256_mul_ps(xc, _mm256_set1_ps(LOG2E));
    let magic = _mm256_set1_ps(ROUND_MAGIC);
    let n = _mm256_sub_ps(_mm256_add_ps(t, magic), magic);
    let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_HI), xc);
    let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_LO), r);
    let mut p = _mm256_set1_ps(POLY[0]);
    for &c in &POLY[1..] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    let r2 = _mm256_mul_ps(r, r);
    let y = _mm256_add_ps(_mm256_fmadd_ps(p, r2, r), _mm256_set1_ps(1.0));
    let e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
        23,
    );
    let y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
    let y = _mm256_blendv_ps(
        y,
        _mm256_set1_ps(f32::INFINITY),
        _mm256_cmp_ps(x, _mm256_set1_ps(EXP_HI), _CMP_GT_OQ),
    );
    let y = _mm256_blendv_ps(
        y,
        _mm256_setzero_ps(),
        _mm256_cmp_ps(x, _mm256_set1_ps(EXP_LO), _CMP_LT_OQ),
    );
    _mm256_blendv_ps(y, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q))
}

/// Loads `n <= 8` f32s (zero-filled) and stores back only `n`.
#[inline(always)]
pub(crate) unsafe fn store_partial(p: *mut f32, v: __m256, n: usize) {
    let mut buf = [0.0f32; 8];
    _mm256_storeu_ps(buf.as_mut_ptr(), v);
    std::ptr::copy_nonoverlapping(buf.as_ptr(), p, n);
}

/// Applies an 8-lane map `f` over `x` into `out` (same length), tail included.
#[inline(always)]
pub(crate) unsafe fn map8(x: &[f32], out: &mut [f32], f: impl Fn(__m256) -> __m256) {
    let n = x.len();
    let mut i = 0;
    while i + 8 <= n {
        _mm256_storeu_ps(
            out.as_mut_ptr().add(i),
            f(_mm256_loadu_ps(x.as_ptr().add(i))),
        );
        i += 8;
    }
    if i < n {
        let v = f(f32::load_partial(x.as_ptr().add(i), n - i));
        store_partial(out.as_mut_ptr().add(i), v, n - i);
    }
}

/// Applies an 8-lane binary map over `a`, `b` into `out` (same lengths).
#[inline(always)]
pub(crate) unsafe fn zip8(
    a: &[f32],
    b: &[f32],
    out: &mut [f32],
    f: impl Fn(__m256, __m256) -> __m256,
) {
    let n = a.len();
    let mut i = 0;
    while i + 8 <= n {
        let v = f(
            _mm256_loadu_ps(a.as_ptr().add(i)),
            _mm256_loadu_ps(b.as_ptr().add(i)),
        );
        _mm256_storeu_ps(out.as_mut_ptr().add(i), v);
        i += 8;
    }
    if i < n {
        let v = f(
            f32::load_partial(a.as_ptr().add(i), n - i),
            f32::load_partial(b.as_ptr().add(i), n - i),
        );
        store_partial(out.as_mut_ptr().add(i), v, n - i);
    }
}

/// One quantized block as 4 × 8 f32 lanes (weights 0–7, 8–15, 16–23, 24–31),
/// each equal bit for bit to [`crate::quant::dequant_block_ref`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn qblock<const K: u8>(p: *const u8) -> [__m256; 4] {
    // Both f16 header words at once (the second is `m` for Q4_1, quants else).
    let hdr = _mm_cvtph_ps(_mm_cvtsi32_si128((p as *const i32).read_unaligned()));
    let d = _mm256_broadcastss_ps(hdr);
    match kind_of::<K>() {
        QuantKind::Q8_0 => [
            _mm256_mul_ps(d, i8x8(_mm_loadl_epi64(p.add(2) as *const __m128i))),
            _mm256_mul_ps(d, i8x8(_mm_loadl_epi64(p.add(10) as *const __m128i))),
            _mm256_mul_ps(d, i8x8(_mm_loadl_epi64(p.add(18) as *const __m128i))),
            _mm256_mul_ps(d, i8x8(_mm_loadl_epi64(p.add(26) as *const __m128i))),
        ],
        QuantKind::Q4_0 => {
            // Bytes widened straight from memory, then the nibbles masked
            // and shifted in 32-bit lanes (cheaper than byte shuffles).
            let (lo, hi) = nibbles(p.add(2));
            let eight = _mm256_set1_epi32(8);
            [
                _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(lo[0], eight))),
                _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(lo[1], eight))),
                _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(hi[0], eight))),
                _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(hi[1], eight))),
            ]
        }
        QuantKind::Q4_1 => {
            let m = _mm256_broadcastss_ps(_mm_movehdup_ps(hdr));
            let (lo, hi) = nibbles(p.add(4));
            // d·q is exact, so the fused multiply-add rounds once, like `d * q + m`.
            [
                _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(lo[0]), m),
                _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(lo[1]), m),
                _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(hi[0]), m),
                _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(hi[1]), m),
            ]
        }
        QuantKind::Q4K | QuantKind::Q6K => unreachable!("K-quants are read by `kchunk_in`"),
    }
}

/// The 32 nibbles of the 16 bytes at `q` as 32-bit lanes: low nibbles of
/// bytes 0–7 and 8–15 (quants 0–15), then high nibbles (quants 16–31).
/// Bytes are widened straight from memory and the nibbles masked and shifted
/// in 32-bit lanes, which costs fewer shuffles than splitting bytes first.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn nibbles(q: *const u8) -> ([__m256i; 2], [__m256i; 2]) {
    let a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(q as *const __m128i));
    let b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(q.add(8) as *const __m128i));
    let mask = _mm256_set1_epi32(0x0f);
    (
        [_mm256_and_si256(a, mask), _mm256_and_si256(b, mask)],
        [_mm256_srli_epi32(a, 4), _mm256_srli_epi32(b, 4)],
    )
}

/// Block formats as const-generic tags, so each kernel is compiled per format.
pub(crate) const Q4_0: u8 = 0;
pub(crate) const Q4_1: u8 = 1;
pub(crate) const Q8_0: u8 = 2;
pub(crate) const Q4K: u8 = 3;
pub(crate) const Q6K: u8 = 4;

#[inline(always)]
const fn kind_of<const K: u8>() -> QuantKind {
    match K {
        Q4_0 => QuantKind::Q4_0,
        Q4_1 => QuantKind::Q4_1,
        Q4K => QuantKind::Q4K,
        Q6K => QuantKind::Q6K,
        _ => QuantKind::Q8_0,
    }
}

/// Whether format `K` is a 256-weight K-quant, read a chunk at a time.
#[inline(always)]
const fn is_k<const K: u8>() -> bool {
    K == Q4K || K == Q6K
}

/// The low 8 bytes of `v`, signed, as 8 f32s.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn i8x8(v: __m128i) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))
}

/// Dequantizes `out.len() / 32` blocks starting at `p`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dequant_row(kind: QuantKind, p: *const u8, out: &mut [f32]) {
    dequant_groups(kind, p, out.len(), out.as_mut_ptr(), 8, 4);
}

/// Dequantizes `n / 32` blocks starting at `p` (`n` weights), writing the
/// row's 8-weight group `g` at `out + g·step`, its first 4 weights there
/// and its last 4 at `out + g·step + hi` (`step` ≥ 8 and `hi` = 4 is the
/// plain row). The caller owns `out` up to the last group written.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dequant_groups(
    kind: QuantKind,
    p: *const u8,
    n: usize,
    out: *mut f32,
    step: usize,
    hi: usize,
) {
    match kind {
        QuantKind::Q4_0 => dequant_row_k::<Q4_0>(p, n, out, step, hi),
        QuantKind::Q4_1 => dequant_row_k::<Q4_1>(p, n, out, step, hi),
        QuantKind::Q8_0 => dequant_row_k::<Q8_0>(p, n, out, step, hi),
        QuantKind::Q4K => dequant_row_k::<Q4K>(p, n, out, step, hi),
        QuantKind::Q6K => dequant_row_k::<Q6K>(p, n, out, step, hi),
    }
}

/// One 8-weight group of [`dequant_groups`] at `dst`, its upper half `hi`
/// floats on.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn store_group(dst: *mut f32, hi: usize, v: __m256) {
    if hi == 4 {
        _mm256_storeu_ps(dst, v);
    } else {
        _mm_storeu_ps(dst, _mm256_castps256_ps128(v));
        _mm_storeu_ps(dst.add(hi), _mm256_extractf128_ps::<1>(v));
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dequant_row_k<const K: u8>(
    p: *const u8,
    n: usize,
    out: *mut f32,
    step: usize,
    hi: usize,
) {
    let bb = kind_of::<K>().block_bytes();
    if is_k::<K>() {
        for sb in 0..n / (4 * CHUNK) {
            let b = p.add(sb * bb);
            let scales = kscales::<K>(b);
            for cb in 0..4 {
                let v = kchunk_in::<K>(b, cb, &scales);
                let g0 = (4 * sb + cb) * (CHUNK / 8);
                for (j, x) in v.iter().enumerate() {
                    store_group(out.add((g0 + j) * step), hi, *x);
                }
            }
        }
        return;
    }
    for b in 0..n / QBLOCK {
        let v = qblock::<K>(p.add(b * bb));
        for (j, x) in v.iter().enumerate() {
            store_group(out.add((b * (QBLOCK / 8) + j) * step), hi, *x);
        }
    }
}

/// Chunks per window of parked accumulators (8 × 16 × 32 B = 4 KiB).
pub(crate) const WINDOW: usize = 16;

/// 8 canonical dot products of one activation row `x` with 8 quantized rows
/// of `k` weights (`k` a multiple of 32) in format `K`: output `r` is
/// `dot(x, W[r])`. Weights are dequantized in registers; each lane's FMA chain
/// is the one of [`dot8`] over the dequantized copy.
///
/// Rows are walked one at a time (a chunk's accumulator, four weight vectors
/// and `x` from L1 fit in registers; chunks are independent chains, so
/// out-of-order execution overlaps them), and the per-chunk accumulators of
/// the 8 rows are parked in a small buffer and joined by [`hsum8x`] in chunk
/// order — the same adds as [`dot8`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot8q<const K: u8>(
    x: *const f32,
    ws: &[*const u8; 8],
    k: usize,
    ahead: usize,
) -> __m256 {
    if is_k::<K>() {
        return dot8k::<K>(x, ws, k, ahead);
    }
    let bb = kind_of::<K>().block_bytes();
    let per_chunk = CHUNK / QBLOCK;
    // Every slot read below is written first (rows 0..8 × chunks w0..w1), so
    // the buffer is left uninitialised instead of zeroing 4 KiB per call.
    let mut parked = std::mem::MaybeUninit::<[[__m256; 8]; WINDOW]>::uninit();
    let slots = parked.as_mut_ptr() as *mut [__m256; 8];
    let mut tot = _mm256_setzero_ps();
    let chunks = k.div_ceil(CHUNK);
    let mut w0 = 0;
    while w0 < chunks {
        let w1 = (w0 + WINDOW).min(chunks);
        // Two rows at a time: two independent FMA chains share each `x` load.
        for r in (0..8).step_by(2) {
            for c in w0..w1 {
                let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                let b1 = ((c + 1) * per_chunk).min(k / QBLOCK);
                for b in c * per_chunk..b1 {
                    // The same block of the rows 8 further on (the caller's
                    // next group): a hint only, never dereferenced.
                    _mm_prefetch::<_MM_HINT_T0>(ws[r].wrapping_add(b * bb + ahead) as *const i8);
                    _mm_prefetch::<_MM_HINT_T0>(ws[r + 1].wrapping_add(b * bb + ahead) as *const i8);
                    let wa = qblock::<K>(ws[r].add(b * bb));
                    let wb = qblock::<K>(ws[r + 1].add(b * bb));
                    let xb = x.add(b * QBLOCK);
                    for j in 0..4 {
                        let xv = _mm256_loadu_ps(xb.add(8 * j));
                        a0 = _mm256_fmadd_ps(xv, wa[j], a0);
                        a1 = _mm256_fmadd_ps(xv, wb[j], a1);
                    }
                }
                (*slots.add(c - w0))[r] = a0;
                (*slots.add(c - w0))[r + 1] = a1;
            }
        }
        for c in 0..w1 - w0 {
            tot = _mm256_add_ps(tot, hsum8x(&*slots.add(c)));
        }
        w0 = w1;
    }
    tot
}

/// The f32 scales of one K-quant super-block, decoded once for its four
/// chunks: `Q4_K` sub-block `j`'s `dl[j] = d·sc` and `ml[j] = dmin·m`; `Q6_K`
/// 16-weight group `i`'s `dl[i] = d·s`. Each is the reference's product.
pub(crate) struct KScales {
    pub(crate) dl: [f32; 16],
    pub(crate) ml: [f32; 8],
    /// `Q4_K`: `d` and `dmin` finite, so the fused form is exact (see
    /// [`q4k_chunk`]).
    pub(crate) fused: bool,
}

/// [`KScales`] of the super-block at `b`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn kscales<const K: u8>(b: *const u8) -> KScales {
    let mut s = KScales {
        dl: [0.0; 16],
        ml: [0.0; 8],
        fused: false,
    };
    if K == Q4K {
        let raw = (b as *const u32).read_unaligned();
        let hdr = _mm_cvtph_ps(_mm_cvtsi32_si128(raw as i32));
        let d = _mm256_broadcastss_ps(hdr);
        let dmin = _mm256_broadcastss_ps(_mm_movehdup_ps(hdr));
        // ggml's `get_scale_min_k4` for all eight sub-blocks at once, four
        // bytes per word: scales 0–3, 4–7 and mins 0–3, 4–7.
        let u = |i: usize| (b.add(4 + 4 * i) as *const u32).read_unaligned();
        let (u0, u1, u2) = (u(0), u(1), u(2));
        let (k1, k2, k3) = (0x3f3f_3f3fu32, 0x0f0f_0f0fu32, 0x0303_0303u32);
        let sc = [u0 & k1, (u2 & k2) | (((u0 >> 6) & k3) << 4)];
        let m = [u1 & k1, ((u2 >> 4) & k2) | (((u1 >> 6) & k3) << 4)];
        let widen = |w: [u32; 2]| {
            let v = _mm_cvtsi64_si128((w[0] as u64 | (w[1] as u64) << 32) as i64);
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v))
        };
        _mm256_storeu_ps(s.dl.as_mut_ptr(), _mm256_mul_ps(d, widen(sc)));
        _mm256_storeu_ps(s.ml.as_mut_ptr(), _mm256_mul_ps(dmin, widen(m)));
        s.fused = raw & 0x7c00 != 0x7c00 && raw & 0x7c00_0000 != 0x7c00_0000;
    } else {
        let h = (b.add(208) as *const u16).read_unaligned();
        let d = _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)));
        let sc = _mm_loadu_si128(b.add(192) as *const __m128i);
        let lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc));
        let hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(sc, sc)));
        _mm256_storeu_ps(s.dl.as_mut_ptr(), _mm256_mul_ps(d, lo));
        _mm256_storeu_ps(s.dl.as_mut_ptr().add(8), _mm256_mul_ps(d, hi));
    }
    s
}

/// Chunk `cb` (0..4), weights `64cb..64cb + 64`, of the K-quant super-block
/// at `b` whose scales are `s`, as 8 × 8 f32 lanes equal bit for bit to
/// [`crate::quant::dequant_block_ref`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn kchunk_in<const K: u8>(b: *const u8, cb: usize, s: &KScales) -> [__m256; 8] {
    if K == Q4K {
        q4k_chunk(b, cb, s)
    } else {
        q6k_chunk(b, cb, s)
    }
}

/// Chunk `cb` of a `Q4_K` super-block at `b`: its sub-blocks `2cb` and
/// `2cb + 1` are the low and high nibbles of the 32 quant bytes `32cb..`.
///
/// The reference value of a weight is `(dl·q) − ml` with `dl = d·sc` and
/// `ml = dmin·m` (each product rounded to f32). When `d` and `dmin` are finite
/// the fused `fma(dl, q, −ml)` gives the same bits, one instruction fewer:
/// - `d` is an f16 widened exactly: at most 11 significant bits, magnitude in
///   [2⁻²⁴, 65504]; `sc`, `m` ≤ 63 have 6 bits, so `dl` and `ml` have at most
///   17 significant bits and lie in [2⁻²⁴, 2²²] (or are ±0): both exact in f32.
/// - `q` ≤ 15 has 4 bits, so `dl·q` has at most 21 significant bits and
///   magnitude below 2²⁶: exact too, no overflow, no underflow.
/// - So `dl·q − ml` and `fma(dl, q, −ml)` are one rounding of the same exact
///   real; signed zeros agree as well (`x − y` is `x + (−y)` in IEEE 754,
///   and the exact product carries the sign `dl·q` rounds to).
///
/// An infinite or NaN `d`/`dmin` (never in a real model, but representable)
/// takes the reference's multiply-then-subtract, so even the NaN bits agree.
/// `kernels/tests/kquant_fma.rs` checks the identity over every `sc`, `m`,
/// `q` and many `d`/`dmin` (subnormals and extremes included), and over every
/// finite `d`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4k_chunk(b: *const u8, cb: usize, s: &KScales) -> [__m256; 8] {
    let (dl0, ml0) = (
        _mm256_broadcast_ss(&s.dl[2 * cb]),
        _mm256_broadcast_ss(&s.ml[2 * cb]),
    );
    let (dl1, ml1) = (
        _mm256_broadcast_ss(&s.dl[2 * cb + 1]),
        _mm256_broadcast_ss(&s.ml[2 * cb + 1]),
    );
    let q = b.add(16 + 32 * cb);
    let (lo_a, hi_a) = nibbles(q);
    let (lo_b, hi_b) = nibbles(q.add(16));
    // Spelled out per weight formula so both arms inline fully.
    macro_rules! all {
        ($w:expr) => {
            [
                $w(dl0, ml0, lo_a[0]),
                $w(dl0, ml0, lo_a[1]),
                $w(dl0, ml0, lo_b[0]),
                $w(dl0, ml0, lo_b[1]),
                $w(dl1, ml1, hi_a[0]),
                $w(dl1, ml1, hi_a[1]),
                $w(dl1, ml1, hi_b[0]),
                $w(dl1, ml1, hi_b[1]),
            ]
        };
    }
    if s.fused {
        all!(|dl, ml, v| _mm256_fmsub_ps(dl, _mm256_cvtepi32_ps(v), ml))
    } else {
        all!(|dl, ml, v| _mm256_sub_ps(_mm256_mul_ps(dl, _mm256_cvtepi32_ps(v)), ml))
    }
}

/// Chunk `cb` of a `Q6_K` super-block at `b` (layout in
/// [`crate::kquant::q6`]): half `cb / 2`, the low (even `cb`) or high (odd)
/// nibbles of its 64 `ql` bytes, and the bit pairs `4·(cb % 2) + 2·(l / 32)`
/// of its 32 `qh` bytes. Each weight is `(d·s)·q`: `d·s` is exact (11 × 8
/// significant bits) but the product with `q` rounds, so it stays a multiply
/// of the rounded `dl`, as the reference.
///
/// The 6-bit quants of 32 weights are assembled in bytes with 256-bit
/// operations (one nibble shift and mask, one bit-pair shift and mask, or,
/// −32) and only then widened 8 at a time for the conversion to f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6k_chunk(b: *const u8, cb: usize, s: &KScales) -> [__m256; 8] {
    let (half, odd) = (cb / 2, (cb % 2) as i32);
    let ql = b.add(64 * half);
    let qh = b.add(128 + 32 * half);
    let shift = _mm_cvtsi32_si128(4 * odd);
    let (m4, m30, off) = (
        _mm256_set1_epi8(0x0f),
        _mm256_set1_epi8(0x30),
        _mm256_set1_epi8(32),
    );
    // Bit pairs 4·odd (weights 0–31) and 4·odd + 2 (32–63) moved to bits 0–3;
    // 16-bit shifts are fine since the masks drop what crosses bytes.
    let h = _mm256_srl_epi16(_mm256_loadu_si256(qh as *const __m256i), shift);
    let hi = [
        _mm256_and_si256(_mm256_slli_epi16(h, 4), m30),
        _mm256_and_si256(_mm256_slli_epi16(h, 2), m30),
    ];
    let mut out = [_mm256_setzero_ps(); 8];
    for g in 0..2 {
        // Weights l = 32g .. 32g + 32 of the chunk, as i8 in [−32, 31].
        let lq = _mm256_loadu_si256(ql.add(32 * g) as *const __m256i);
        let lo = _mm256_and_si256(_mm256_srl_epi16(lq, shift), m4);
        let q = _mm256_sub_epi8(_mm256_or_si256(lo, hi[g]), off);
        let (q0, q1) = (_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
        let parts = [
            q0,
            _mm_unpackhi_epi64(q0, q0),
            q1,
            _mm_unpackhi_epi64(q1, q1),
        ];
        for (v, &p) in parts.iter().enumerate() {
            let dl = _mm256_broadcast_ss(&s.dl[4 * cb + 2 * g + v / 2]);
            let qf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(p));
            out[4 * g + v] = _mm256_mul_ps(dl, qf);
        }
    }
    out
}

/// [`dot8q`] for the K-quants: one canonical chunk (64 weights) of a row is
/// dequantized in registers at a time, with the chunk's scales read once.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot8k<const K: u8>(x: *const f32, ws: &[*const u8; 8], k: usize, ahead: usize) -> __m256 {
    let block_bytes = kind_of::<K>().block_bytes();
    let chunk_bytes = block_bytes / 4;
    const { assert!(WINDOW.is_multiple_of(4)) };
    // Every slot read below is written first (rows 0..8 × chunks w0..w1).
    let mut parked = std::mem::MaybeUninit::<[[__m256; 8]; WINDOW]>::uninit();
    let slots = parked.as_mut_ptr() as *mut [__m256; 8];
    let mut tot = _mm256_setzero_ps();
    let chunks = k / CHUNK;
    let mut w0 = 0;
    while w0 < chunks {
        let w1 = (w0 + WINDOW).min(chunks);
        for r in (0..8).step_by(2) {
            // Windows start on super-block boundaries (`WINDOW` and the
            // chunks of a row are multiples of 4): each super-block's scales
            // are decoded once for its four chunks.
            for sb in (w0 / 4)..(w1 / 4) {
                let (pa, pb) = (ws[r].add(sb * block_bytes), ws[r + 1].add(sb * block_bytes));
                let (sa, sb_) = (kscales::<K>(pa), kscales::<K>(pb));
                for cb in 0..4 {
                    let c = 4 * sb + cb;
                    // The same chunk of the rows 8 further on: a hint only.
                    let pf = c * chunk_bytes + ahead;
                    _mm_prefetch::<_MM_HINT_T0>(ws[r].wrapping_add(pf) as *const i8);
                    _mm_prefetch::<_MM_HINT_T0>(ws[r + 1].wrapping_add(pf) as *const i8);
                    let wa = kchunk_in::<K>(pa, cb, &sa);
                    let wb = kchunk_in::<K>(pb, cb, &sb_);
                    let xc = x.add(c * CHUNK);
                    let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                    for j in 0..8 {
                        let xv = _mm256_loadu_ps(xc.add(8 * j));
                        a0 = _mm256_fmadd_ps(xv, wa[j], a0);
                        a1 = _mm256_fmadd_ps(xv, wb[j], a1);
                    }
                    (*slots.add(c - w0))[r] = a0;
                    (*slots.add(c - w0))[r + 1] = a1;
                }
            }
        }
        for c in 0..w1 - w0 {
            tot = _mm256_add_ps(tot, hsum8x(&*slots.add(c)));
        }
        w0 = w1;
    }
    tot
}
