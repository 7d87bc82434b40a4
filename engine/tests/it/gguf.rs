//! The GGUF reader on hand-built files: exact dequantization of every block
//! type against values computed independently, the RoPE row un-permutation,
//! and clear errors (with byte offsets) for malformed files; K-quant and
//! Q5_0 tensors imported end to end; every refusal of a type, of a GGUF given
//! as a model, named (type names, not ids; the path once).

use lmrr_engine::gguf::{dequantize, unpermute_rope_rows, GgmlType, Gguf, Value};
use lmrr_kernels::BlockFormat;

use crate::tiny_gguf;
use tiny_gguf::{gguf, tiny_quantized_llama};

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
    assert_eq!(t("a").ty, GgmlType::Block(BlockFormat::Q4_1));
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
    let e = parse(&b).unwrap_err();
    assert!(e.contains("`w` has type type 99 (unknown)"), "{e}");
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

/// Prefill 40 tokens in chunks of 13, then 6 decode steps, every row's logits.
fn run_logits(dir: &std::path::Path, threads: usize) -> Vec<u32> {
    use lmrr_engine::{Llama, LogitsWanted, ModelFamily, ModelFiles, SeqKvStore, SeqSpan};
    let files = ModelFiles::open_dir(dir).unwrap();
    let m = Llama::load(&files).unwrap();
    let th = lmrr_kernels::Threads::new(threads).unwrap();
    let mut kv = SeqKvStore::new(m.kv_layout());
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

/// Every file of `dir`, by name.
fn files(dir: &std::path::Path) -> std::collections::BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect()
}

#[test]
fn every_import_writes_the_same_bytes_every_time() {
    use lmrr_engine::gguf::{import, ImportDtype};
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("tiny.gguf");
    std::fs::write(&src, tiny_quantized_llama()).unwrap();
    for dtype in [ImportDtype::Keep, ImportDtype::F32, ImportDtype::Bf16] {
        // Three imports: each `HashMap` of the process has its own random
        // order, so a map reaching the file would show here.
        let runs: Vec<_> = (0..3)
            .map(|i| {
                let dir = tmp.path().join(format!("{dtype:?}-{i}"));
                import(&src, &dir, dtype).unwrap();
                files(&dir)
            })
            .collect();
        assert_eq!(
            runs[0].keys().collect::<Vec<_>>(),
            ["config.json", "model.safetensors", "tokenizer.json"],
            "{dtype:?}"
        );
        for r in &runs[1..] {
            for (name, bytes) in &runs[0] {
                assert!(
                    r[name] == *bytes,
                    "{dtype:?}: {name} differs between imports"
                );
            }
        }
    }
}

#[test]
fn imports_with_bit_identical_logits_share_one_content_identity() {
    use lmrr_engine::gguf::{import, ImportDtype};
    use lmrr_engine::Model;
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("tiny.gguf");
    std::fs::write(&src, tiny_quantized_llama()).unwrap();
    let load = |name: &str, dtype| {
        let dir = tmp.path().join(name);
        import(&src, &dir, dtype).unwrap();
        Model::load_dir(&dir).unwrap().identity()
    };
    let keep = load("keep", ImportDtype::Keep);
    let keep2 = load("keep2", ImportDtype::Keep);
    let f32 = load("f32", ImportDtype::F32);
    let bf16 = load("bf16", ImportDtype::Bf16);
    // Different files (Q8_0/Q4 blocks in U8 tensors vs f32, `torch_dtype`
    // "gguf" vs "float32"), same logits (the test above): one identity.
    assert_eq!(keep, keep2);
    assert_eq!(keep, f32);
    // Rounded to bf16: other values, other logits, another weights digest;
    // config and tokenizer are the same.
    assert_ne!(keep.weights_sha256, bf16.weights_sha256);
    assert_eq!(
        (keep.config_sha256, keep.tokenizer_sha256),
        (bf16.config_sha256, bf16.tokenizer_sha256)
    );
    // One weight value changed by one ulp is another model.
    let dir = tmp.path().join("f32");
    let mut st = std::fs::read(dir.join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(st[..8].try_into().unwrap()) as usize;
    let at = 8 + n; // the first element of the first tensor
    st[at] ^= 1;
    std::fs::write(dir.join("model.safetensors"), &st).unwrap();
    let moved = Model::load_dir(&dir).unwrap().identity();
    assert_ne!(moved.weights_sha256, f32.weights_sha256);
    assert_eq!(moved.config_sha256, f32.config_sha256);
}

#[test]
fn unsupported_types_are_refused_by_name_with_the_supported_list() {
    // IQ2_XS (17) and an id ggml never had: named, counted, the list given.
    let b = gguf(
        &[],
        &[
            ("output.weight", vec![256], 17, vec![0; 74]),
            ("blk.0.ffn_up.weight", vec![256], 17, vec![0; 74]),
            ("blk.0.ffn_down.weight", vec![32], 99, vec![0; 18]),
            ("token_embd.weight", vec![256], 14, vec![0; 210]),
        ],
    );
    let e = parse(&b).unwrap_err();
    assert!(e.contains("tensor `output.weight` has type IQ2_XS"), "{e}");
    assert!(e.contains("2 more tensors of unsupported types"), "{e}");
    assert!(e.contains("IQ2_XS, type 99 (unknown)"), "{e}");
    assert!(
        e.contains(
            "supported: F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, BF16"
        ),
        "{e}"
    );
    assert!(
        !e.contains(" 14") && !e.contains(" 17,"),
        "ids are not names: {e}"
    );
    // The refusal of an import names the file once.
    let tmp = tempfile::tempdir().unwrap();
    let mut llama = tiny_quantized_llama();
    // Retype the first tensor's info entry (token_embd, Q8_0) to IQ2_XS.
    let name = b"token_embd.weight";
    let at = llama.windows(name.len()).position(|w| w == name).unwrap() + name.len();
    let ty_at = at + 4 + 2 * 8;
    assert_eq!(llama[ty_at], 8);
    llama[ty_at] = 17;
    let src = tmp.path().join("requant.gguf");
    std::fs::write(&src, &llama).unwrap();
    let e = lmrr_engine::gguf::import(
        &src,
        &tmp.path().join("o"),
        lmrr_engine::gguf::ImportDtype::Keep,
    )
    .unwrap_err()
    .to_string();
    assert_eq!(e.matches("requant.gguf").count(), 1, "{e}");
    assert!(e.contains("`token_embd.weight` has type IQ2_XS"), "{e}");
}

#[test]
fn the_architecture_is_refused_before_the_tensor_types() {
    let b = gguf(
        &[(
            "general.architecture",
            8,
            [6u64.to_le_bytes().to_vec(), b"falcon".to_vec()].concat(),
        )],
        &[("w", vec![256], 17, vec![0; 74])],
    );
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("f.gguf");
    std::fs::write(&src, &b).unwrap();
    let e = lmrr_engine::gguf::import(
        &src,
        &tmp.path().join("o"),
        lmrr_engine::gguf::ImportDtype::Keep,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("falcon"), "{e}");
    assert!(!e.contains("IQ2_XS"), "{e}");
}

#[test]
fn a_gguf_given_as_a_model_points_to_import_gguf() {
    let tmp = tempfile::tempdir().unwrap();
    for name in ["m.gguf", "no-extension"] {
        let src = tmp.path().join(name);
        std::fs::write(&src, tiny_quantized_llama()).unwrap();
        let e = lmrr_engine::ModelFiles::open_dir(&src)
            .err()
            .expect("a GGUF is not a model directory")
            .to_string();
        assert!(
            e.contains("is a GGUF file") && e.contains("lmrr import-gguf"),
            "{e}"
        );
    }
}

/// A 1-layer llama GGUF with 256-wide rows whose matrices are Q4_K, Q6_K and
/// Q5_0 (the embedding Q6_K, as Q4_K_M files have it).
fn tiny_k_quant_llama() -> Vec<u8> {
    use tiny_gguf::{blocks, meta_str, meta_strs, meta_u32};
    let (d, ff, vocab) = (256u64, 256u64, 96usize);
    let kv = d / 2;
    let mut seed = 11u64;
    let tokens: Vec<String> = (33u8..=126)
        .map(|b| (b as char).to_string())
        .chain(["Ġ".to_string(), "Ċ".to_string()])
        .collect();
    let meta = [
        ("general.architecture", meta_str("llama")),
        ("llama.embedding_length", meta_u32(d as u32)),
        ("llama.feed_forward_length", meta_u32(ff as u32)),
        ("llama.attention.head_count", meta_u32(4)),
        ("llama.attention.head_count_kv", meta_u32(2)),
        ("llama.block_count", meta_u32(1)),
        ("llama.context_length", meta_u32(256)),
        ("tokenizer.ggml.tokens", meta_strs(&tokens)),
    ];
    let meta: Vec<(&str, u32, Vec<u8>)> = meta.into_iter().map(|(k, (t, v))| (k, t, v)).collect();
    let norm: Vec<u8> = (0..d)
        .flat_map(|i| (1.0 + i as f32 / 256.0).to_le_bytes())
        .collect();
    let mut t: Vec<(String, Vec<u64>, u32, Vec<u8>)> = vec![
        (
            "token_embd.weight".into(),
            vec![d, vocab as u64],
            14,
            blocks(&mut seed, 14, d as usize * vocab),
        ),
        ("output_norm.weight".into(), vec![d], 0, norm.clone()),
        ("blk.0.attn_norm.weight".into(), vec![d], 0, norm.clone()),
        ("blk.0.ffn_norm.weight".into(), vec![d], 0, norm),
    ];
    for (n, dims, ty) in [
        ("attn_q", [d, d], 12),
        ("attn_k", [d, kv], 14),
        ("attn_v", [d, kv], 6),
        ("attn_output", [d, d], 12),
        ("ffn_gate", [d, ff], 12),
        ("ffn_up", [d, ff], 14),
        ("ffn_down", [ff, d], 6),
    ] {
        let data = blocks(&mut seed, ty, (dims[0] * dims[1]) as usize);
        t.push((format!("blk.0.{n}.weight"), dims.to_vec(), ty, data));
    }
    let t: Vec<(&str, Vec<u64>, u32, Vec<u8>)> = t
        .iter()
        .map(|(n, dims, ty, data)| (n.as_str(), dims.clone(), *ty, data.clone()))
        .collect();
    gguf(&meta, &t)
}

#[test]
fn k_quant_and_q5_0_tensors_import_end_to_end() {
    use lmrr_engine::gguf::{import, ImportDtype};
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("kq.gguf");
    std::fs::write(&src, tiny_k_quant_llama()).unwrap();
    let (f32_dir, keep_dir) = (tmp.path().join("f32"), tmp.path().join("keep"));
    import(&src, &f32_dir, ImportDtype::F32).unwrap();
    let r = import(&src, &keep_dir, ImportDtype::Keep).unwrap();
    // Q4_K and Q6_K kept as blocks; Q5_0 has no kept kernel: f32.
    assert_eq!(r.kept.get("Q4_K"), Some(&3));
    assert_eq!(r.kept.get("Q6_K"), Some(&3));
    assert_eq!(r.dequantized.get("Q5_0"), Some(&2));
    assert!(!r.dequantized.contains_key("F32"));
    let st = std::fs::read(keep_dir.join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(st[..8].try_into().unwrap()) as usize;
    let header = std::str::from_utf8(&st[8..8 + n]).unwrap();
    assert!(
        header.contains(r#""lmrr.quant.model.layers.0.self_attn.q_proj.weight":"Q4_K""#),
        "{header}"
    );
    assert!(
        header.contains(r#""lmrr.quant.model.embed_tokens.weight":"Q6_K""#),
        "{header}"
    );
    // The dequantized copy equals gguf-py's reference definition through the
    // kernels, so logits over kept blocks equal those over the f32 import.
    let want = run_logits(&f32_dir, 1);
    assert!(want.iter().all(|&b| f32::from_bits(b).is_finite()));
    for threads in [1, 2, 3] {
        assert!(
            run_logits(&keep_dir, threads) == want,
            "keep vs f32, {threads} threads"
        );
    }
}
