//! The identity the fast `Q4_K` dequantization rests on: for a finite f16 `d`
//! and `dmin`, 6-bit `sc`, `m` and a 4-bit `q`, with `dl = d·sc` and
//! `ml = dmin·m` rounded to f32, `fma(dl, q, −ml)` equals the reference's
//! `(dl·q) − ml` bit for bit (because `dl·q` is exact). Checked exhaustively
//! over `sc`, `m`, `q` for many `d`/`dmin` (subnormal, extreme, zero, signed),
//! over every finite f16 `d` for every `sc` and `q`, and end to end through
//! the SIMD dequantization on blocks built with those scales.

use lmrr_kernels::quant::{dequant, dequant_ref, f16_to_f32, QuantKind};

/// Every finite f16 bit pattern, both signs.
fn finite_f16() -> impl Iterator<Item = u16> {
    (0u16..=0xffff).filter(|h| h & 0x7c00 != 0x7c00)
}

/// Scales worth naming: zeros, the smallest and largest subnormals, the
/// smallest normal, one, values with all 11 significant bits set, the largest
/// finite, and their negations; plus a spread of others.
fn named_f16() -> Vec<u16> {
    let mut v = vec![
        0x0000, 0x0001, 0x0002, 0x0155, 0x03ff, 0x0400, 0x07ff, 0x3c00, 0x3bff, 0x3fff, 0x1234,
        0x2e66, 0x5555, 0x7bfe, 0x7bff,
    ];
    v.extend((0..64u16).map(|i| i.wrapping_mul(0x9e37) % 0x7c00));
    let neg: Vec<u16> = v.iter().map(|h| h | 0x8000).collect();
    v.extend(neg);
    v
}

fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits()
}

#[test]
fn fused_q4k_weight_equals_multiply_then_subtract() {
    let named = named_f16();
    for &dh in &named {
        for &mh in named.iter().step_by(3) {
            let (d, dmin) = (f16_to_f32(dh), f16_to_f32(mh));
            for sc in 0..64u8 {
                let dl = d * sc as f32;
                for m in 0..64u8 {
                    let ml = dmin * m as f32;
                    for q in 0..16u8 {
                        let qf = q as f32;
                        let want = dl * qf - ml;
                        let got = dl.mul_add(qf, -ml);
                        assert!(
                            same(got, want),
                            "d={dh:#06x} dmin={mh:#06x} sc={sc} m={m} q={q}: {got:e} vs {want:e}"
                        );
                    }
                }
            }
        }
    }
    // Every finite d, against a few minima (zero, subnormal, large, negative).
    let mins = [
        0x0000u16, 0x8000, 0x0001, 0x03ff, 0x3c00, 0x7bff, 0xfbff, 0x2e66,
    ];
    for dh in finite_f16() {
        let d = f16_to_f32(dh);
        for sc in 0..64u8 {
            let dl = d * sc as f32;
            for &mh in &mins {
                for m in [0u8, 1, 31, 63] {
                    let ml = f16_to_f32(mh) * m as f32;
                    for q in 0..16u8 {
                        let qf = q as f32;
                        assert!(
                            same(dl.mul_add(qf, -ml), dl * qf - ml),
                            "d={dh:#06x} dmin={mh:#06x} sc={sc} m={m} q={q}"
                        );
                    }
                }
            }
        }
    }
}

/// A `Q4_K` super-block with the given `d`, `dmin`, the same 6-bit scale and
/// min bytes for all eight sub-blocks, and quant bytes `qs`.
fn q4k_block(dh: u16, mh: u16, sc: u8, m: u8, qs: &[u8; 128]) -> Vec<u8> {
    let mut b = Vec::with_capacity(144);
    b.extend(dh.to_le_bytes());
    b.extend(mh.to_le_bytes());
    // get_scale_min_k4: j < 4 from the low 6 bits of bytes j, j + 4; j ≥ 4
    // from the nibbles of bytes j + 4 and the top 2 bits of bytes j − 4, j.
    let mut s = [0u8; 12];
    for j in 0..4 {
        s[j] = (sc & 63) | ((sc >> 4) << 6);
        s[j + 4] = (m & 63) | ((m >> 4) << 6);
        s[j + 8] = (sc & 0xf) | ((m & 0xf) << 4);
    }
    b.extend(s);
    b.extend(qs);
    b
}

#[test]
fn simd_q4k_dequant_equals_reference_on_swept_scales() {
    // Every quant value in every sub-block: byte i holds nibbles i % 16 and
    // 15 − i % 16.
    let mut qs = [0u8; 128];
    for (i, q) in qs.iter_mut().enumerate() {
        *q = (i % 16) as u8 | ((15 - (i % 16) as u8) << 4);
    }
    let named = named_f16();
    let specials = [0x7c00u16, 0xfc00, 0x7e00, 0x7e01, 0xfe00];
    let heads: Vec<u16> = named.iter().copied().chain(specials).collect();
    let mut bytes = Vec::new();
    for (i, &dh) in heads.iter().enumerate() {
        for (j, &mh) in heads.iter().enumerate().step_by(5) {
            let (sc, m) = (((i * 7 + j) % 64) as u8, ((i + 3 * j) % 64) as u8);
            bytes.extend(q4k_block(dh, mh, sc, m, &qs));
        }
    }
    for sc in 0..64u8 {
        for m in 0..64u8 {
            bytes.extend(q4k_block(0x03ff, 0x2e66, sc, m, &qs));
            bytes.extend(q4k_block(0xfbff, 0x7bff, sc, m, &qs));
        }
    }
    let n = bytes.len() / 144 * 256;
    let (mut want, mut got) = (vec![0.0f32; n], vec![0.0f32; n]);
    dequant_ref(QuantKind::Q4K, &bytes, &mut want);
    dequant(QuantKind::Q4K, &bytes, &mut got);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            same(*g, *w),
            "weight {i} (block {}): {g:e} vs {w:e}",
            i / 256
        );
    }
}
