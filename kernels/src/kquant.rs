//! Every ggml block format lmrr reads, and its exact dequantization: the
//! 32-weight formats of [`crate::quant`] plus `Q5_0`, `Q5_1` and the 256-weight
//! K-quants `Q2_K`, `Q3_K`, `Q4_K`, `Q5_K`, `Q6_K`.
//!
//! Block layouts after ggml's `ggml-quants.c` and gguf-py's `quants.py`. The
//! value of each weight is the float32 expression of gguf-py's
//! `dequantize_blocks`, operation for operation (numpy evaluates each `*` and
//! `-` separately, so there is no fused multiply-add), with f16 scales widened
//! exactly:
//!
//! | format | bytes | weights | value |
//! |--------|-------|---------|-------|
//! | `Q5_0` | 22    | 32      | `d · q`, q ∈ [−16, 15] |
//! | `Q5_1` | 24    | 32      | `(d · q) + m`, q ∈ [0, 31] |
//! | `Q2_K` | 84    | 256     | `(d · sc) · q − (dmin · m)`, per 16 weights 4-bit `sc`, `m` |
//! | `Q3_K` | 110   | 256     | `(d · s) · q`, per 16 weights 6-bit `s − 32`, q ∈ [−4, 3] |
//! | `Q4_K` | 144   | 256     | `(d · sc) · q − (dmin · m)`, per 32 weights 6-bit `sc`, `m` |
//! | `Q5_K` | 176   | 256     | as `Q4_K` with q ∈ [0, 31] |
//! | `Q6_K` | 210   | 256     | `(d · s) · q`, per 16 weights i8 `s`, q ∈ [−32, 31] |
//!
//! Invariant: every code path that turns these blocks into f32 (this
//! reference, the SIMD dequantization of `Q4_K`/`Q6_K` in [`crate::x86`], a
//! matmul over stored blocks) produces these bits; `scripts/check_dequant.py`
//! holds them against gguf-py itself (fixture in `kernels/tests/fixtures/`).

use crate::quant::{f16_to_f32, QuantKind};

/// Weights per K-quant super-block.
pub const QK_K: usize = 256;

/// A ggml block format that lmrr can dequantize.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockFormat {
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
}

impl BlockFormat {
    /// All formats, in ggml type-id order.
    pub const ALL: [Self; 10] = [
        Self::Q4_0,
        Self::Q4_1,
        Self::Q5_0,
        Self::Q5_1,
        Self::Q8_0,
        Self::Q2K,
        Self::Q3K,
        Self::Q4K,
        Self::Q5K,
        Self::Q6K,
    ];

    /// The ggml name (`Q4_K`, not `Q4K`).
    pub const fn name(self) -> &'static str {
        match self {
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
            Self::Q5_0 => "Q5_0",
            Self::Q5_1 => "Q5_1",
            Self::Q8_0 => "Q8_0",
            Self::Q2K => "Q2_K",
            Self::Q3K => "Q3_K",
            Self::Q4K => "Q4_K",
            Self::Q5K => "Q5_K",
            Self::Q6K => "Q6_K",
        }
    }

    /// Parses a ggml name, case-insensitively.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|k| k.name().eq_ignore_ascii_case(s))
    }

    /// Weights per block.
    pub const fn block_weights(self) -> usize {
        match self {
            Self::Q4_0 | Self::Q4_1 | Self::Q5_0 | Self::Q5_1 | Self::Q8_0 => 32,
            _ => QK_K,
        }
    }

    /// Bytes per block.
    pub const fn block_bytes(self) -> usize {
        match self {
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q5_0 => 22,
            Self::Q5_1 => 24,
            Self::Q8_0 => 34,
            Self::Q2K => 84,
            Self::Q3K => 110,
            Self::Q4K => 144,
            Self::Q5K => 176,
            Self::Q6K => 210,
        }
    }

    /// The storage kind the kernels compute on in place, if any; the other
    /// formats are dequantized to f32 at import.
    pub const fn storage(self) -> Option<QuantKind> {
        match self {
            Self::Q4_0 => Some(QuantKind::Q4_0),
            Self::Q4_1 => Some(QuantKind::Q4_1),
            Self::Q8_0 => Some(QuantKind::Q8_0),
            Self::Q4K => Some(QuantKind::Q4K),
            Self::Q6K => Some(QuantKind::Q6K),
            _ => None,
        }
    }

    /// The format of a storage kind.
    pub const fn of(kind: QuantKind) -> Self {
        match kind {
            QuantKind::Q4_0 => Self::Q4_0,
            QuantKind::Q4_1 => Self::Q4_1,
            QuantKind::Q8_0 => Self::Q8_0,
            QuantKind::Q4K => Self::Q4K,
            QuantKind::Q6K => Self::Q6K,
        }
    }
}

#[inline]
fn le16(b: &[u8], i: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[i], b[i + 1]]))
}

/// Dequantizes a run of whole blocks of `fmt` (`bytes.len() / block_bytes`
/// blocks) into `out` (`block_weights` f32s per block) — the reference.
///
/// Panics if `bytes` and `out` do not hold the same number of whole blocks.
pub fn dequant_format_ref(fmt: BlockFormat, bytes: &[u8], out: &mut [f32]) {
    let (bw, bb) = (fmt.block_weights(), fmt.block_bytes());
    assert!(
        bytes.len().is_multiple_of(bb) && bytes.len() / bb * bw == out.len(),
        "dequant: {} bytes of {} do not fill {} weights",
        bytes.len(),
        fmt.name(),
        out.len()
    );
    for (b, o) in bytes.chunks_exact(bb).zip(out.chunks_exact_mut(bw)) {
        match fmt {
            BlockFormat::Q4_0 | BlockFormat::Q4_1 | BlockFormat::Q8_0 => {
                let kind = fmt.storage().expect("32-weight storage kind");
                crate::quant::dequant_block_ref(kind, b, o)
            }
            BlockFormat::Q5_0 => q5_0(b, o),
            BlockFormat::Q5_1 => q5_1(b, o),
            BlockFormat::Q2K => q2_k(b, o),
            BlockFormat::Q3K => q3_k(b, o),
            BlockFormat::Q4K => q4_k(b, o),
            BlockFormat::Q5K => q5_k(b, o),
            BlockFormat::Q6K => q6_k(b, o),
        }
    }
}

/// [`dequant_format_ref`], with the SIMD dequantization for the formats the
/// kernels keep as storage (same bits).
pub fn dequant_format(fmt: BlockFormat, bytes: &[u8], out: &mut [f32]) {
    match fmt.storage() {
        Some(kind) => crate::quant::dequant(kind, bytes, out),
        None => dequant_format_ref(fmt, bytes, out),
    }
}

/// The 5-bit quant `j` of a `Q5_0`/`Q5_1` block: low nibble of byte `j`
/// (`j < 16`) or high nibble of byte `j − 16`, bit `j` of `qh` on top.
#[inline]
fn q5(qh: u32, qs: &[u8], j: usize) -> u8 {
    let lo = if j < 16 { qs[j] & 0xf } else { qs[j - 16] >> 4 };
    lo | ((((qh >> j) & 1) as u8) << 4)
}

fn q5_0(b: &[u8], out: &mut [f32]) {
    let d = le16(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    for (j, o) in out.iter_mut().enumerate() {
        *o = d * (q5(qh, &b[6..22], j) as i32 - 16) as f32;
    }
}

fn q5_1(b: &[u8], out: &mut [f32]) {
    let (d, m) = (le16(b, 0), le16(b, 2));
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    for (j, o) in out.iter_mut().enumerate() {
        let prod = d * q5(qh, &b[8..24], j) as f32;
        *o = prod + m;
    }
}

/// `Q2_K`/`Q3_K` 2-bit quant of weight `w`: super-block halves of 128
/// weights share 32 bytes, four 32-weight groups taking bit pairs 0, 2, 4, 6.
#[inline]
fn q2(qs: &[u8], w: usize) -> u8 {
    let (half, within) = (w / 128, w % 128);
    (qs[half * 32 + within % 32] >> (2 * (within / 32))) & 3
}

fn q2_k(b: &[u8], out: &mut [f32]) {
    let (scales, qs) = (&b[0..16], &b[16..80]);
    let (d, dmin) = (le16(b, 80), le16(b, 82));
    for (w, o) in out.iter_mut().enumerate() {
        let s = scales[w / 16];
        let dl = d * (s & 0xf) as f32;
        let ml = dmin * (s >> 4) as f32;
        let prod = dl * q2(qs, w) as f32;
        *o = prod - ml;
    }
}

/// The 6-bit scale `i` (0..16) of a `Q3_K` block, minus 32.
#[inline]
fn q3_scale(s: &[u8], i: usize) -> i32 {
    let lo = if i < 8 { s[i] & 0xf } else { s[i - 8] >> 4 };
    let hi = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
    (lo | (hi << 4)) as i32 - 32
}

fn q3_k(b: &[u8], out: &mut [f32]) {
    let (hmask, qs, scales) = (&b[0..32], &b[32..96], &b[96..108]);
    let d = le16(b, 108);
    for (w, o) in out.iter_mut().enumerate() {
        let dl = d * q3_scale(scales, w / 16) as f32;
        // The high bit is set when the quant is not offset by −4.
        let high = (hmask[w % 32] >> (w / 32)) & 1;
        let q = q2(qs, w) as i32 - if high == 1 { 0 } else { 4 };
        *o = dl * q as f32;
    }
}

/// Scale and min (6 bits each) of sub-block `j` (0..8) of a `Q4_K`/`Q5_K`
/// block, from its 12 packed bytes (ggml's `get_scale_min_k4`).
#[inline]
pub(crate) fn scale_min_k4(s: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

fn q4_k(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (le16(b, 0), le16(b, 2));
    let (scales, qs) = (&b[4..16], &b[16..144]);
    for (w, o) in out.iter_mut().enumerate() {
        let j = w / 32;
        let (sc, m) = scale_min_k4(scales, j);
        let dl = d * sc as f32;
        let ml = dmin * m as f32;
        let byte = qs[(j / 2) * 32 + w % 32];
        let q = if j % 2 == 0 { byte & 0xf } else { byte >> 4 };
        let prod = dl * q as f32;
        *o = prod - ml;
    }
}

fn q5_k(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (le16(b, 0), le16(b, 2));
    let (scales, qh, qs) = (&b[4..16], &b[16..48], &b[48..176]);
    for (w, o) in out.iter_mut().enumerate() {
        let j = w / 32;
        let (sc, m) = scale_min_k4(scales, j);
        let dl = d * sc as f32;
        let ml = dmin * m as f32;
        let byte = qs[(j / 2) * 32 + w % 32];
        let lo = if j % 2 == 0 { byte & 0xf } else { byte >> 4 };
        let q = lo | (((qh[w % 32] >> j) & 1) << 4);
        let prod = dl * q as f32;
        *o = prod - ml;
    }
}

/// The quant of weight `w` of a `Q6_K` block (`ql` 128 bytes, `qh` 64), in
/// [−32, 31]: halves of 128 weights; in a half, weights `l` and `l + 64` share
/// the nibbles of `ql[l]`, and the four 32-weight groups take the bit pairs
/// 0, 2, 4, 6 of `qh[l % 32]`.
#[inline]
pub(crate) fn q6(ql: &[u8], qh: &[u8], w: usize) -> i32 {
    let (half, within) = (w / 128, w % 128);
    let byte = ql[half * 64 + within % 64];
    let lo = if within < 64 { byte & 0xf } else { byte >> 4 };
    let hi = (qh[half * 32 + within % 32] >> (2 * (within / 32))) & 3;
    (lo | (hi << 4)) as i32 - 32
}

fn q6_k(b: &[u8], out: &mut [f32]) {
    let (ql, qh, scales) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = le16(b, 208);
    for (w, o) in out.iter_mut().enumerate() {
        let dl = d * (scales[w / 16] as i8) as f32;
        *o = dl * q6(ql, qh, w) as f32;
    }
}

/// Dequantizes one `Q4_K` or `Q6_K` super-block (the reference for
/// [`crate::quant::dequant_block_ref`]).
pub(crate) fn dequant_superblock_ref(kind: QuantKind, b: &[u8], out: &mut [f32]) {
    match kind {
        QuantKind::Q4K => q4_k(b, out),
        QuantKind::Q6K => q6_k(b, out),
        other => unreachable!("{} is not a K-quant", other.name()),
    }
}
