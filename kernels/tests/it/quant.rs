//! Quantized weights: hand-computed dequantized values, SIMD dequantization ≡
//! reference on every kind of scale (normal, subnormal, zero, inf, NaN), and a
//! matmul over quantized storage ≡ the canonical matmul over the dequantized f32
//! copy, bit for bit, for decode and prefill shapes at 1, 2 and 3 threads;
//! and every block format's dequantization ≡ gguf-py's, bit for bit, on the
//! fixture `scripts/check_dequant.py --write-fixture` made with it.

#![allow(clippy::needless_range_loop)]

use lmrr_kernels::*;

type Rng = SplitMix64;

/// `n` random bytes.
fn bytes(r: &mut Rng, n: usize) -> Vec<u8> {
    (0..n).map(|_| r.next_u64() as u8).collect()
}

const KINDS: [QuantKind; 5] = QuantKind::ALL;

/// Byte offsets of a block's f16 scales: `d`, then `m`/`dmin` where present.
fn scale_offsets(kind: QuantKind) -> &'static [usize] {
    match kind {
        QuantKind::Q4_0 | QuantKind::Q8_0 => &[0],
        QuantKind::Q4_1 | QuantKind::Q4K => &[0, 2],
        QuantKind::Q6K => &[208],
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// f16 bits of a value exactly representable in f16 (test inputs only).
fn h(x: f32) -> [u8; 2] {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xff) as i32 - 127 + 15;
    assert!(
        (1..31).contains(&exp) && b & 0x1fff == 0,
        "{x} is not a normal f16"
    );
    (sign | ((exp as u16) << 10) | ((b >> 13) & 0x3ff) as u16).to_le_bytes()
}

/// Random blocks whose f16 scales are realistic (|d| ~ 1e-3…1e-1), so the
/// matmul outputs are ordinary numbers.
pub(crate) fn realistic(r: &mut Rng, kind: QuantKind, blocks: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(blocks * kind.block_bytes());
    for _ in 0..blocks {
        let mut b = bytes(r, kind.block_bytes());
        // K-quants multiply d by 6-bit (Q4_K) or 8-bit (Q6_K) sub-scales.
        let d = match kind {
            QuantKind::Q4K => 0.002,
            QuantKind::Q6K => 0.0005,
            _ => 0.05,
        };
        for (i, &o) in scale_offsets(kind).iter().enumerate() {
            let v = if i == 0 {
                d
            } else {
                0.2 / kind.block_weights() as f32
            };
            b[o..o + 2].copy_from_slice(&f16_bits_near(r.uniform(v)));
        }
        out.extend(b);
    }
    out
}

/// f16 bits of a normal f16 close to `x` (truncating its mantissa).
fn f16_bits_near(x: f32) -> [u8; 2] {
    let x = if x.abs() < 1e-4 { 1e-4 } else { x };
    h(f32::from_bits(x.to_bits() & !0x1fff))
}

#[test]
fn dequantized_values_match_hand_computation() {
    // Q8_0: d = 0.5, quants 0..31 as signed bytes alternating sign.
    let mut b = h(0.5).to_vec();
    b.extend((0..32).map(|j: i32| (if j % 2 == 0 { j } else { -j }) as i8 as u8));
    let mut out = [0.0f32; 32];
    dequant_ref(QuantKind::Q8_0, &b, &mut out);
    for j in 0..32 {
        let q = if j % 2 == 0 { j as f32 } else { -(j as f32) };
        assert_eq!(out[j], 0.5 * q, "Q8_0 weight {j}");
    }
    // Q4_0: d = -2, byte j = (hi << 4) | lo with lo = j, hi = 15 - j.
    let mut b = h(-2.0).to_vec();
    b.extend((0..16u8).map(|j| ((15 - j) << 4) | j));
    dequant_ref(QuantKind::Q4_0, &b, &mut out);
    for j in 0..16 {
        assert_eq!(out[j], -2.0 * (j as f32 - 8.0), "Q4_0 low {j}");
        assert_eq!(out[j + 16], -2.0 * (7.0 - j as f32), "Q4_0 high {j}");
    }
    // Q4_1: d = 0.25, m = -1.5: weights -1.5 + 0.25·q.
    let mut b = h(0.25).to_vec();
    b.extend(h(-1.5));
    b.extend((0..16u8).map(|j| (j << 4) | (15 - j)));
    dequant_ref(QuantKind::Q4_1, &b, &mut out);
    for j in 0..16 {
        assert_eq!(out[j], -1.5 + 0.25 * (15 - j) as f32, "Q4_1 low {j}");
        assert_eq!(out[j + 16], -1.5 + 0.25 * j as f32, "Q4_1 high {j}");
    }
    // Q4_1 rounds once: d·q + m with d·q = 15·(1 + 2⁻¹⁰) exact, m = 2¹¹.
    let mut b = h(1.0 + 2f32.powi(-10)).to_vec();
    b.extend(h(2048.0));
    b.extend([0x0f; 16]);
    dequant_ref(QuantKind::Q4_1, &b, &mut out);
    let exact = 2048.0f64 + 15.0 * (1.0 + 2f64.powi(-10));
    assert_eq!(out[0], exact as f32, "Q4_1 single rounding");
}

#[test]
fn fast_dequant_matches_reference_for_every_kind_of_scale() {
    let mut r = SplitMix64(11);
    // Scales: random bits (covers subnormal, inf, NaN, negative zero) and the
    // edge cases named explicitly.
    let special: [u16; 8] = [
        0x0000, 0x8000, 0x0001, 0x03ff, 0x7bff, 0x7c00, 0xfc00, 0x7e01,
    ];
    for kind in KINDS {
        let bb = kind.block_bytes();
        let blocks = 600 * QBLOCK / kind.block_weights();
        let mut bytes = bytes(&mut r, blocks * bb);
        for (i, _) in special.iter().enumerate() {
            for (j, &o) in scale_offsets(kind).iter().enumerate() {
                let s = special[(i + 3 * j) % special.len()];
                bytes[i * bb + o..i * bb + o + 2].copy_from_slice(&s.to_le_bytes());
            }
        }
        let mut want = vec![0.0f32; blocks * kind.block_weights()];
        let mut got = vec![0.0f32; blocks * kind.block_weights()];
        dequant_ref(kind, &bytes, &mut want);
        dequant(kind, &bytes, &mut got);
        assert_eq!(bits(&got), bits(&want), "{kind:?}");
    }
}

#[test]
fn quantized_matmul_equals_matmul_over_the_dequantized_copy() {
    let mut r = SplitMix64(12);
    let pools: Vec<Threads> = (1..=3).map(|n| Threads::new(n).unwrap()).collect();
    for kind in KINDS {
        for &(rows, cols) in &[
            (1usize, 32usize),
            (7, 96),
            (13, 64),
            (37, 576),
            (9, 160),
            (1037, 32),
        ] {
            // The same shapes in blocks: 256-weight super-blocks for K-quants.
            let cols = cols / QBLOCK * kind.block_weights();
            let q = realistic(&mut r, kind, rows * cols / kind.block_weights());
            let mut deq = vec![0.0f32; rows * cols];
            dequant_ref(kind, &q, &mut deq);
            let mq = Matrix::new(Weights::Quant(kind, &q), rows, cols).unwrap();
            let mf = Matrix::new(Weights::F32(&deq), rows, cols).unwrap();
            for &n in &[1usize, 2, 3, 5, 9, 65, 70, 131] {
                let x: Vec<f32> = (0..n * cols).map(|_| r.uniform(2.0)).collect();
                let mut want = vec![0.0; n * rows];
                matmul_ref(&x, n, &mf, &mut want);
                let mut via_ref = vec![0.0; n * rows];
                matmul_ref(&x, n, &mq, &mut via_ref);
                assert_eq!(
                    bits(&via_ref),
                    bits(&want),
                    "{kind:?} ref {rows}x{cols} n={n}"
                );
                for th in &pools {
                    let mut got = vec![f32::NAN; n * rows];
                    matmul(th, &x, n, &mq, &mut got);
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "{kind:?} rows={rows} cols={cols} n={n} threads={}",
                        th.count()
                    );
                }
            }
        }
    }
}

#[test]
fn quantized_matrix_shapes_are_checked() {
    let q = vec![0u8; 2 * QuantKind::Q4_1.row_bytes(64)];
    assert!(Matrix::new(Weights::Quant(QuantKind::Q4_1, &q), 2, 64).is_some());
    assert!(Matrix::new(Weights::Quant(QuantKind::Q4_1, &q), 3, 64).is_none());
    assert!(Matrix::new(Weights::Quant(QuantKind::Q4_1, &q), 1, 128).is_some());
    // Columns must be whole blocks.
    let q = vec![0u8; 40];
    assert!(Matrix::new(Weights::Quant(QuantKind::Q4_1, &q), 1, 48).is_none());
    assert_eq!(QuantKind::parse("q8_0"), Some(QuantKind::Q8_0));
    assert_eq!(QuantKind::parse("Q5_K"), None);
    assert_eq!(QuantKind::parse("Q6_K"), Some(QuantKind::Q6K));
    // K-quant rows are whole 256-weight super-blocks.
    let q = vec![0u8; 2 * QuantKind::Q4K.row_bytes(512)];
    assert_eq!(q.len(), 2 * 2 * 144);
    assert!(Matrix::new(Weights::Quant(QuantKind::Q4K, &q), 2, 512).is_some());
    assert!(Matrix::new(Weights::Quant(QuantKind::Q4K, &q[..288]), 1, 512).is_some());
    assert!(Matrix::new(Weights::Quant(QuantKind::Q4K, &q[..288]), 2, 256).is_some());
    assert!(Matrix::new(Weights::Quant(QuantKind::Q4K, &q[..144]), 1, 128).is_none());
}

/// One format's records in the gguf-py fixture: (name, blocks, expected bits).
fn fixture() -> Vec<(String, Vec<u8>, Vec<u32>)> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/dequant_gguf_py.bin"
    );
    let b = std::fs::read(path).expect("fixture (scripts/check_dequant.py --write-fixture)");
    let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap()) as usize;
    let (mut out, mut i) = (Vec::new(), 0);
    while i < b.len() {
        let n = b[i] as usize;
        let name = String::from_utf8(b[i + 1..i + 1 + n].to_vec()).unwrap();
        i += 1 + n;
        let (blocks, bb, bw) = (u32_at(i), u32_at(i + 4), u32_at(i + 8));
        i += 12;
        let data = b[i..i + blocks * bb].to_vec();
        i += blocks * bb;
        let want = (0..blocks * bw).map(|j| u32_at(i + 4 * j) as u32).collect();
        i += 4 * blocks * bw;
        out.push((name, data, want));
    }
    out
}

#[test]
fn dequant_matches_gguf_py_fixture() {
    let recs = fixture();
    let names: Vec<&str> = recs.iter().map(|r| r.0.as_str()).collect();
    let all: Vec<&str> = BlockFormat::ALL.iter().map(|f| f.name()).collect();
    assert_eq!(names, all, "the fixture covers every format");
    let mut nans = 0;
    for (name, data, want) in &recs {
        let fmt = BlockFormat::parse(name).unwrap();
        assert_eq!(
            data.len() / fmt.block_bytes() * fmt.block_weights(),
            want.len()
        );
        let mut got = vec![0.0f32; want.len()];
        dequant_format_ref(fmt, data, &mut got);
        assert_eq!(bits(&got), *want, "{name}: reference vs gguf-py");
        let mut fast = vec![0.0f32; want.len()];
        dequant_format(fmt, data, &mut fast);
        assert_eq!(bits(&fast), *want, "{name}: fast path vs gguf-py");
        if let Some(kind) = fmt.storage() {
            dequant_ref(kind, data, &mut got);
            assert_eq!(bits(&got), *want, "{name}: storage reference vs gguf-py");
        }
        nans += got.iter().filter(|x| x.is_nan()).count();
    }
    assert!(nans > 0, "the fixture exercises NaN scales");
}

#[test]
fn fused_matmuls_equal_separate_ones() {
    // matmul_many over a mix of storages (as q/k/v or gate/up share x) gives
    // each matrix exactly what matmul_ref gives it alone.
    let mut r = SplitMix64(13);
    let cols = 96;
    let wf: Vec<f32> = (0..11 * cols).map(|_| r.uniform(0.5)).collect();
    let q41 = realistic(&mut r, QuantKind::Q4_1, 29 * cols / QBLOCK);
    let q80 = realistic(&mut r, QuantKind::Q8_0, 5 * cols / QBLOCK);
    let mats = [
        Matrix::new(Weights::Quant(QuantKind::Q4_1, &q41), 29, cols).unwrap(),
        Matrix::new(Weights::F32(&wf), 11, cols).unwrap(),
        Matrix::new(Weights::Quant(QuantKind::Q8_0, &q80), 5, cols).unwrap(),
    ];
    for n in [1usize, 4, 33] {
        let x: Vec<f32> = (0..n * cols).map(|_| r.uniform(1.0)).collect();
        for threads in 1..=3 {
            let th = Threads::new(threads).unwrap();
            let mut ys: Vec<Vec<f32>> = mats.iter().map(|m| vec![f32::NAN; n * m.rows]).collect();
            {
                let mut jobs: Vec<(&Matrix, &mut [f32])> = mats
                    .iter()
                    .zip(ys.iter_mut())
                    .map(|(m, y)| (m, y.as_mut_slice()))
                    .collect();
                matmul_many(&th, &x, n, &mut jobs);
            }
            for (m, y) in mats.iter().zip(&ys) {
                let mut want = vec![0.0; n * m.rows];
                matmul_ref(&x, n, m, &mut want);
                assert_eq!(
                    bits(y),
                    bits(&want),
                    "rows={} n={n} threads={threads}",
                    m.rows
                );
            }
        }
    }
}
