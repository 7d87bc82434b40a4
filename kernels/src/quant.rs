//! GGUF block-quantized weights kept as storage (`Q4_0`, `Q4_1`, `Q8_0`,
//! `Q4_K`, `Q6_K`) and their exact dequantization.
//!
//! A block of the first three holds 32 consecutive weights of one row: an f16
//! scale `d` (and for `Q4_1` an f16 offset `m`) followed by the quants. The
//! K-quants hold 256 weights (one super-block, four canonical chunks) and are
//! defined in [`crate::kquant`], with the formats that are only dequantized at
//! import. The dequantized value of each weight is one fixed IEEE expression
//! (contract, BRIEF §4):
//!
//! | kind   | bytes | value                 | rounding                             |
//! |--------|-------|-----------------------|--------------------------------------|
//! | `Q8_0` | 34    | `d · q`, q ∈ [−128, 127] | exact (11-bit × 8-bit fits in 24 bits) |
//! | `Q4_0` | 18    | `d · (q − 8)`, q ∈ [0, 15] | exact                            |
//! | `Q4_1` | 20    | `d · q + m`, q ∈ [0, 15]   | one rounding (the product is exact, so `fma(d, q, m)` is the same number) |
//! | `Q4_K` | 144 per 256 | `(d · sc) · q − (dmin · m)` | one rounding (see [`crate::kquant`]) |
//! | `Q6_K` | 210 per 256 | `(d · s) · q`               | exact |
//!
//! Quant `j < 16` of a 4-bit block is the low nibble of byte `j`; quant
//! `j + 16` its high nibble (ggml's layout). Since every weight becomes the
//! same f32 whichever code dequantizes it, a matmul over quantized storage is
//! bit-identical to the canonical matmul over the dequantized f32 copy; the
//! SIMD kernels in [`crate::matmul`] dequantize in registers.

/// Weights per block of `Q4_0`, `Q4_1` and `Q8_0` (the K-quants hold
/// [`crate::kquant::QK_K`]; see [`QuantKind::block_weights`]).
pub const QBLOCK: usize = 32;

/// A block-quantized storage format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuantKind {
    Q4_0,
    Q4_1,
    Q8_0,
    /// ggml's `Q4_K` (256-weight super-blocks).
    Q4K,
    /// ggml's `Q6_K` (256-weight super-blocks).
    Q6K,
}

impl QuantKind {
    /// Every storage kind.
    pub const ALL: [Self; 5] = [Self::Q4_0, Self::Q4_1, Self::Q8_0, Self::Q4K, Self::Q6K];

    /// Weights per block: [`QBLOCK`], or 256 for the K-quants.
    pub const fn block_weights(self) -> usize {
        crate::kquant::BlockFormat::of(self).block_weights()
    }

    /// Bytes of one block of [`QuantKind::block_weights`] weights.
    pub const fn block_bytes(self) -> usize {
        crate::kquant::BlockFormat::of(self).block_bytes()
    }

    /// Bytes of a row of `cols` weights (`cols` a multiple of
    /// [`QuantKind::block_weights`]).
    pub const fn row_bytes(self, cols: usize) -> usize {
        cols / self.block_weights() * self.block_bytes()
    }

    /// Weights held by `bytes` bytes of whole blocks.
    pub const fn weights_in(self, bytes: usize) -> usize {
        bytes / self.block_bytes() * self.block_weights()
    }

    /// The ggml name (`Q4_0`, `Q4_1`, `Q8_0`, `Q4_K`, `Q6_K`).
    pub const fn name(self) -> &'static str {
        crate::kquant::BlockFormat::of(self).name()
    }

    /// Parses a ggml name, case-insensitively.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|k| k.name().eq_ignore_ascii_case(s))
    }
}

/// Exact f16 → f32. NaNs come out quiet (payload kept), as the x86 F16C
/// conversion used by the SIMD kernels produces them.
#[inline]
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h >> 15) as u32) << 31;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    let bits = match (exp, man) {
        (0, 0) => sign,
        (0, m) => {
            // Subnormal: normalise.
            let shift = m.leading_zeros() - 21;
            let m = (m << shift) & 0x3ff;
            sign | ((127 - 15 + 1 - shift) << 23) | (m << 13)
        }
        (0x1f, 0) => sign | 0x7f80_0000,
        (0x1f, m) => sign | 0x7fc0_0000 | (m << 13),
        (e, m) => sign | ((e + 127 - 15) << 23) | (m << 13),
    };
    f32::from_bits(bits)
}

#[inline]
fn le16(b: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([b[i], b[i + 1]])
}

/// Dequantizes one block (`kind.block_bytes()` bytes) into
/// `kind.block_weights()` f32s — the reference every other dequantization
/// equals bit for bit.
pub fn dequant_block_ref(kind: QuantKind, b: &[u8], out: &mut [f32]) {
    let d = f16_to_f32(le16(b, 0));
    match kind {
        QuantKind::Q4K | QuantKind::Q6K => crate::kquant::dequant_superblock_ref(kind, b, out),
        QuantKind::Q8_0 => {
            for (o, &q) in out.iter_mut().zip(&b[2..34]) {
                *o = d * (q as i8) as f32;
            }
        }
        QuantKind::Q4_0 => {
            for (j, &q) in b[2..18].iter().enumerate() {
                out[j] = d * ((q & 0xf) as i32 - 8) as f32;
                out[j + 16] = d * ((q >> 4) as i32 - 8) as f32;
            }
        }
        QuantKind::Q4_1 => {
            let m = f16_to_f32(le16(b, 2));
            for (j, &q) in b[4..20].iter().enumerate() {
                out[j] = d * (q & 0xf) as f32 + m;
                out[j + 16] = d * (q >> 4) as f32 + m;
            }
        }
    }
}

/// Dequantizes a whole row (or any run of blocks) into `out`
/// (`out.len() / kind.block_weights()` blocks).
pub fn dequant_ref(kind: QuantKind, bytes: &[u8], out: &mut [f32]) {
    for (b, o) in bytes
        .chunks_exact(kind.block_bytes())
        .zip(out.chunks_exact_mut(kind.block_weights()))
    {
        dequant_block_ref(kind, b, o);
    }
}

/// Fast row dequantization, bitwise equal to [`dequant_ref`].
pub fn dequant(kind: QuantKind, bytes: &[u8], out: &mut [f32]) {
    assert_eq!(
        kind.weights_in(bytes.len()),
        out.len(),
        "dequant: {} bytes of {} do not fill {} weights",
        bytes.len(),
        kind.name(),
        out.len()
    );
    #[cfg(target_arch = "x86_64")]
    if crate::use_avx2() {
        // SAFETY: AVX2, FMA and F16C were detected at run time; `bytes` holds
        // the whole blocks of `out.len()` weights (checked above).
        unsafe { crate::x86::dequant_row(kind, bytes.as_ptr(), out) };
        return;
    }
    dequant_ref(kind, bytes, out);
}
