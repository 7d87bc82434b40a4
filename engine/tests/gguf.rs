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

/// Metadata value bytes.
fn meta_u32(v: u32) -> (u32, Vec<u8>) {
    (4, v.to_le_bytes().to_vec())
}
fn meta_str(v: &str) -> (u32, Vec<u8>) {
    (
        8,
        [
            (v.len() as u64).to_le_bytes().to_vec(),
            v.as_bytes().to_vec(),
        ]
        .concat(),
    )
}
fn meta_strs(v: &[String]) -> (u32, Vec<u8>) {
    let mut b = 8u32.to_le_bytes().to_vec();
    b.extend((v.len() as u64).to_le_bytes());
    for s in v {
        b.extend((s.len() as u64).to_le_bytes());
        b.extend(s.as_bytes());
    }
    (9, b)
}

/// Random blocks of `kind` (ggml type id `ty`) with realistic f16 scales.
fn blocks(seed: &mut u64, ty: u32, elements: usize) -> Vec<u8> {
    let mut next = || {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (*seed >> 33) as u32
    };
    let (bb, hdr) = match ty {
        2 => (18, 1),
        3 => (20, 2),
        8 => (34, 1),
        _ => unreachable!(),
    };
    let mut out = Vec::new();
    for _ in 0..elements / 32 {
        // f16 scales in [2^-8, 2^-5): exponent 7..9, random mantissa and sign.
        for _ in 0..hdr {
            let h = ((next() & 1) << 15) | ((7 + next() % 3) << 10) | (next() & 0x3ff);
            out.extend((h as u16).to_le_bytes());
        }
        out.extend((0..bb - 2 * hdr).map(|_| next() as u8));
    }
    out
}

/// A 2-layer llama GGUF whose matrices use all three block types (and F32
/// norms), with a byte-level vocabulary.
fn tiny_quantized_llama() -> Vec<u8> {
    let (d, ff, heads, kv_heads, vocab) = (64u64, 128u64, 4u32, 2u32, 96usize);
    let kv = d / heads as u64 * kv_heads as u64;
    let mut seed = 7u64;
    let tokens: Vec<String> = (0..vocab).map(|i| format!("t{i}")).collect();
    let meta = [
        ("general.architecture", meta_str("llama")),
        ("llama.embedding_length", meta_u32(d as u32)),
        ("llama.feed_forward_length", meta_u32(ff as u32)),
        ("llama.attention.head_count", meta_u32(heads)),
        ("llama.attention.head_count_kv", meta_u32(kv_heads)),
        ("llama.block_count", meta_u32(2)),
        ("llama.context_length", meta_u32(256)),
        ("tokenizer.ggml.tokens", meta_strs(&tokens)),
    ];
    let meta: Vec<(&str, u32, Vec<u8>)> = meta.into_iter().map(|(k, (t, v))| (k, t, v)).collect();
    let norm = |n: u64| -> Vec<u8> {
        (0..n)
            .flat_map(|i| (1.0 + i as f32 / 64.0).to_le_bytes())
            .collect()
    };
    let mut t: Vec<(String, Vec<u64>, u32, Vec<u8>)> = vec![
        (
            "token_embd.weight".into(),
            vec![d, vocab as u64],
            8,
            blocks(&mut seed, 8, d as usize * vocab),
        ),
        ("output_norm.weight".into(), vec![d], 0, norm(d)),
    ];
    for l in 0..2 {
        // (name, ggml dims, type): every block type appears in every layer.
        let mats = [
            ("attn_q", [d, d], 3),
            ("attn_k", [d, kv], 2),
            ("attn_v", [d, kv], 8),
            ("attn_output", [d, d], 3),
            ("ffn_gate", [d, ff], 2),
            ("ffn_up", [d, ff], 3),
            ("ffn_down", [ff, d], 8),
        ];
        for n in ["attn_norm", "ffn_norm"] {
            t.push((format!("blk.{l}.{n}.weight"), vec![d], 0, norm(d)));
        }
        for (n, dims, ty) in mats {
            let data = blocks(&mut seed, ty, (dims[0] * dims[1]) as usize);
            t.push((format!("blk.{l}.{n}.weight"), dims.to_vec(), ty, data));
        }
    }
    let t: Vec<(&str, Vec<u64>, u32, Vec<u8>)> = t
        .iter()
        .map(|(n, dims, ty, data)| (n.as_str(), dims.clone(), *ty, data.clone()))
        .collect();
    gguf(&meta, &t)
}

/// Prefill 40 tokens in chunks of 13, then 6 decode steps, every row's logits.
fn run_logits(dir: &std::path::Path, threads: usize) -> Vec<u32> {
    use lmrr_engine::{Llama, LogitsWanted, ModelFiles, SeqKvStore, SeqSpan};
    let files = ModelFiles::open_dir(dir).unwrap();
    let m = Llama::load(&files).unwrap();
    let th = lmrr_kernels::Threads::new(threads).unwrap();
    let cfg = m.config();
    let mut kv = SeqKvStore::new(cfg.num_hidden_layers, m.attn_shape().kv_dim());
    let prompt: Vec<u32> = (0..46).map(|i| (i * 37 % 96) as u32).collect();
    let mut out = Vec::new();
    let mut pos = 0;
    for piece in prompt[..40].chunks(13).chain(prompt[40..].chunks(1)) {
        let span = SeqSpan {
            seq: 0,
            start: pos,
            tokens: piece,
            logits: LogitsWanted::All,
        };
        let rows = m.forward(&mut kv, &[span], &th).unwrap();
        out.extend(rows[0].iter().map(|x| x.to_bits()));
        pos += piece.len();
    }
    out
}

#[test]
fn keep_import_is_bit_identical_to_the_dequantized_copy() {
    use lmrr_engine::gguf::{import, ImportDtype};
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("tiny.gguf");
    std::fs::write(&src, tiny_quantized_llama()).unwrap();
    let (f32_dir, keep_dir, bf16_dir) = (
        tmp.path().join("f32"),
        tmp.path().join("keep"),
        tmp.path().join("bf16"),
    );
    import(&src, &f32_dir, ImportDtype::F32).unwrap();
    import(&src, &keep_dir, ImportDtype::Keep).unwrap();
    import(&src, &bf16_dir, ImportDtype::Bf16).unwrap();
    // Quantized storage really is smaller: 5/32 of f32 for Q4_1 rows, etc.
    let size = |d: &std::path::Path| {
        std::fs::metadata(d.join("model.safetensors"))
            .unwrap()
            .len()
    };
    assert!(
        size(&keep_dir) * 3 < size(&f32_dir),
        "{} vs {}",
        size(&keep_dir),
        size(&f32_dir)
    );
    let want = run_logits(&f32_dir, 1);
    assert!(want.iter().all(|&b| f32::from_bits(b).is_finite()));
    for threads in [1, 2, 3] {
        assert!(
            run_logits(&keep_dir, threads) == want,
            "keep vs f32, {threads} threads"
        );
    }
    // Control: rounding the same weights to bf16 does change the bits.
    assert!(run_logits(&bf16_dir, 1) != want);
}

#[test]
fn keep_import_with_a_missing_block_format_is_a_clear_error() {
    use lmrr_engine::gguf::{import, ImportDtype};
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("tiny.gguf");
    std::fs::write(&src, tiny_quantized_llama()).unwrap();
    let dir = tmp.path().join("keep");
    import(&src, &dir, ImportDtype::Keep).unwrap();
    // Strip the metadata naming the block formats: U8 tensors become unreadable.
    let st = std::fs::read(dir.join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(st[..8].try_into().unwrap()) as usize;
    let header = std::str::from_utf8(&st[8..8 + n]).unwrap();
    let stripped = header.replace("lmrr.quant.", "lmrr.qXXnt.");
    let mut out = st[..8].to_vec();
    out.extend(stripped.as_bytes());
    out.extend(&st[8 + n..]);
    std::fs::write(dir.join("model.safetensors"), out).unwrap();
    let files = lmrr_engine::ModelFiles::open_dir(&dir).unwrap();
    let err = lmrr_engine::Llama::load(&files)
        .err()
        .expect("load must fail")
        .to_string();
    assert!(err.contains("U8 without a block format"), "{err}");
    assert!(err.contains("lmrr.quant.model."), "{err}");
}
