//! The GGUF reader on hand-built files: exact dequantization of every block
//! type against values computed independently, the RoPE row un-permutation,
//! and clear errors (with byte offsets) for malformed files.

use lmrr_engine::gguf::{dequantize, unpermute_rope_rows, GgmlType, Gguf, Value};

/// Builds a GGUF v3 file: metadata `(key, type, raw value bytes)` and tensors
/// `(name, dims, ggml type id, data)`.
fn gguf(meta: &[(&str, u32, Vec<u8>)], tensors: &[(&str, Vec<u64>, u32, Vec<u8>)]) -> Vec<u8> {
    let s = |v: &str| {
        [
            (v.len() as u64).to_le_bytes().to_vec(),
            v.as_bytes().to_vec(),
        ]
        .concat()
    };
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend((tensors.len() as u64).to_le_bytes());
    b.extend((meta.len() as u64).to_le_bytes());
    for (k, t, v) in meta {
        b.extend(s(k));
        b.extend(t.to_le_bytes());
        b.extend(v);
    }
    let mut off = 0u64;
    for (name, dims, ty, data) in tensors {
        b.extend(s(name));
        b.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            b.extend(d.to_le_bytes());
        }
        b.extend(ty.to_le_bytes());
        b.extend(off.to_le_bytes());
        off += (data.len() as u64).div_ceil(32) * 32;
    }
    while b.len() % 32 != 0 {
        b.push(0);
    }
    for (_, _, _, data) in tensors {
        b.extend(data);
        while b.len() % 32 != 0 {
            b.push(0);
        }
    }
    b
}

fn parse(b: &[u8]) -> Result<Gguf, String> {
    Gguf::parse(b, std::path::Path::new("t.gguf")).map_err(|e| e.to_string())
}

#[test]
fn every_block_type_dequantizes_exactly() {
    // Q4_1: d = 0.5 (f16 0x3800), m = -1.0 (0xbc00); byte i holds q = i (low) and 15 - i (high).
    let mut q41 = vec![0x00, 0x38, 0x00, 0xbc];
    q41.extend((0..16u8).map(|i| i | ((15 - i) << 4)));
    // Q8_0: d = 0.25 (0x3400), q = -16..16.
    let mut q80 = vec![0x00, 0x34];
    q80.extend((-16i8..16).map(|q| q as u8));
    // Q4_0: d = 2.0 (0x4000); byte i holds (i, i).
    let mut q40 = vec![0x00, 0x40];
    q40.extend((0..16u8).map(|i| i | (i << 4)));
    // F16 and BF16: 1.5 and -2.0.
    let f16 = [0x3e00u16, 0xc000]
        .iter()
        .flat_map(|h| h.to_le_bytes())
        .collect::<Vec<u8>>();
    let bf16 = [0x3fc0u16, 0xc000]
        .iter()
        .flat_map(|h| h.to_le_bytes())
        .collect::<Vec<u8>>();
    let b = gguf(
        &[(
            "general.architecture",
            8,
            [5u64.to_le_bytes().to_vec(), b"llama".to_vec()].concat(),
        )],
        &[
            ("a", vec![32], 3, q41),
            ("b", vec![32], 8, q80),
            ("c", vec![32], 2, q40),
            ("d", vec![2], 1, f16),
            ("e", vec![2], 30, bf16),
        ],
    );
    let g = parse(&b).unwrap();
    let t = |n: &str| g.tensors.iter().find(|t| t.name == n).unwrap();
    assert_eq!(t("a").ty, GgmlType::Q4_1);
    let want_a: Vec<f32> = (0..16)
        .map(|i| 0.5 * i as f32 - 1.0)
        .chain((0..16).map(|i| 0.5 * (15 - i) as f32 - 1.0))
        .collect();
    assert_eq!(dequantize(t("a"), &b), want_a);
    let want_b: Vec<f32> = (-16..16).map(|q| 0.25 * q as f32).collect();
    assert_eq!(dequantize(t("b"), &b), want_b);
    let want_c: Vec<f32> = (0..16).chain(0..16).map(|i| 2.0 * (i - 8) as f32).collect();
    assert_eq!(dequantize(t("c"), &b), want_c);
    assert_eq!(dequantize(t("d"), &b), vec![1.5, -2.0]);
    assert_eq!(dequantize(t("e"), &b), vec![1.5, -2.0]);
    assert_eq!(
        g.get("general.architecture"),
        Some(&Value::Str("llama".into()))
    );
}

#[test]
fn rope_rows_are_unpermuted_to_rotate_half_order() {
    // One head of dim 4, one column: GGUF rows [r0, r1, r2, r3] hold HF rows
    // [0, 2, 1, 3] (pairs interleaved).
    let w = vec![10.0, 12.0, 11.0, 13.0];
    assert_eq!(
        unpermute_rope_rows(&w, 1, 4, 1),
        vec![10.0, 11.0, 12.0, 13.0]
    );
    // Two heads of dim 2: nothing to swap within a pair of one.
    assert_eq!(
        unpermute_rope_rows(&[1.0, 2.0, 3.0, 4.0], 2, 4, 1),
        vec![1.0, 2.0, 3.0, 4.0]
    );
}

#[test]
fn malformed_files_are_errors_with_offsets() {
    let e = parse(b"GGML\x03\0\0\0").unwrap_err();
    assert!(e.contains("bad magic"), "{e}");
    let mut v1 = b"GGUF".to_vec();
    v1.extend(1u32.to_le_bytes());
    assert!(parse(&v1).unwrap_err().contains("version 1"));
    let mut huge = b"GGUF".to_vec();
    huge.extend(3u32.to_le_bytes());
    huge.extend(u64::MAX.to_le_bytes());
    let e = parse(&huge).unwrap_err();
    assert!(
        e.contains("tensor count") && e.contains("limit") && e.contains("byte 16"),
        "{e}"
    );
    // A string claiming more bytes than the limit.
    let b = gguf(&[("k", 8, u64::MAX.to_le_bytes().to_vec())], &[]);
    assert!(parse(&b).unwrap_err().contains("string length"));
    // Tensor data past the end of the file.
    let mut b = gguf(&[], &[("w", vec![32], 8, vec![0; 34])]);
    b.truncate(b.len() - 40);
    let e = parse(&b).unwrap_err();
    assert!(e.contains("`w`") && e.contains("outside the file"), "{e}");
    // Unknown ggml type.
    let b = gguf(&[], &[("w", vec![32], 99, vec![0; 34])]);
    assert!(parse(&b).unwrap_err().contains("ggml type 99"));
    // A block type with a size that is not a whole number of blocks.
    let b = gguf(&[], &[("w", vec![33], 8, vec![0; 68])]);
    assert!(parse(&b).unwrap_err().contains("bad dimensions"));
    // Truncated anywhere: never a panic.
    let full = gguf(
        &[(
            "general.architecture",
            8,
            [5u64.to_le_bytes().to_vec(), b"llama".to_vec()].concat(),
        )],
        &[("w", vec![32], 3, vec![1; 20])],
    );
    for cut in 0..full.len() {
        let _ = parse(&full[..cut]);
    }
}
