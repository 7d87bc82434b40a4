//! GGUF architectures and vocabularies on hand-built files: a qwen2 and a
//! gemma3 file import to the `config.json` fields and tensor names
//! transformers uses (Gemma's stored `1 + w` norms back to `w`, qwen2's
//! biases, no RoPE permutation), an unknown architecture or a tensor with no
//! place is refused by name, and both vocabulary kinds (byte-level BPE with
//! Qwen2's split, SentencePiece BPE with byte fallback) convert to a
//! `tokenizer.json` whose ids round-trip.

use std::collections::BTreeMap;
use std::path::Path;

use lmrr_engine::gguf::{import, vocab::GgufVocab, ImportDtype};

use crate::tiny_gguf;
use tiny_gguf::{gguf, meta_str, meta_strs, meta_u32};

fn meta_f32(v: f32) -> (u32, Vec<u8>) {
    (6, v.to_le_bytes().to_vec())
}
fn meta_bool(v: bool) -> (u32, Vec<u8>) {
    (7, vec![v as u8])
}
/// An array of i32 (`tokenizer.ggml.token_type`).
fn meta_i32s(v: &[i32]) -> (u32, Vec<u8>) {
    let mut b = 5u32.to_le_bytes().to_vec();
    b.extend((v.len() as u64).to_le_bytes());
    b.extend(v.iter().flat_map(|x| x.to_le_bytes()));
    (9, b)
}
fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}
/// F16 bits of small integers / 8 (exact in f16).
fn f16s(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|&x| {
            let h = if x == 0.0 {
                0u16
            } else {
                // x = m · 2^e with |m| in [1, 2): enough for the values below.
                let (s, a) = ((x < 0.0) as u16, x.abs());
                let e = a.log2().floor() as i32;
                let m = ((a / 2f32.powi(e) - 1.0) * 1024.0).round() as u16;
                (s << 15) | (((e + 15) as u16) << 10) | m
            };
            h.to_le_bytes()
        })
        .collect()
}

type Tensor = (String, Vec<u64>, u32, Vec<u8>);

/// A value pattern distinct per tensor and element.
fn vals(seed: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((seed * 7 + i * 3) % 17) as f32 / 8.0 - 1.0)
        .collect()
}

fn build(meta: Vec<(&str, (u32, Vec<u8>))>, tensors: &[Tensor]) -> Vec<u8> {
    let meta: Vec<(&str, u32, Vec<u8>)> = meta.into_iter().map(|(k, (t, v))| (k, t, v)).collect();
    let t: Vec<(&str, Vec<u64>, u32, Vec<u8>)> = tensors
        .iter()
        .map(|(n, d, ty, b)| (n.as_str(), d.clone(), *ty, b.clone()))
        .collect();
    gguf(&meta, &t)
}

/// A matrix of `rows × cols` (ggml dims `[cols, rows]`), F16 for odd seeds.
fn mat(name: String, rows: u64, cols: u64, seed: usize) -> Tensor {
    let v = vals(seed, (rows * cols) as usize);
    if seed % 2 == 1 {
        (name, vec![cols, rows], 1, f16s(&v))
    } else {
        (name, vec![cols, rows], 0, f32s(&v))
    }
}
fn vec1(name: String, v: &[f32]) -> Tensor {
    (name, vec![v.len() as u64], 0, f32s(v))
}

/// The safetensors of an import: name → (shape, f32 values).
fn tensors(dir: &Path) -> BTreeMap<String, (Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, v)| {
            assert_eq!(v.dtype(), safetensors::Dtype::F32, "{n}");
            let f = v
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            (n, (v.shape().to_vec(), f))
        })
        .collect()
}

fn json(dir: &Path, name: &str) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(dir.join(name)).unwrap()).unwrap()
}

// ---- qwen2 ----------------------------------------------------------------

/// Byte-level tokens of the 94 printable ASCII characters, space (`Ġ`) and
/// newline (`Ċ`),
/// merges `H e`, `He l`, `Hel l`, `Hell o`, `Ġ w`, then Qwen's three
/// control tokens.
fn qwen_vocab() -> (Vec<String>, Vec<i32>, Vec<String>) {
    let mut tokens: Vec<String> = (33u8..=126).map(|b| (b as char).to_string()).collect();
    tokens.extend(["Ġ".into(), "Ċ".into()]);
    let merges = ["H e", "He l", "Hel l", "Hell o", "Ġ w"];
    for m in merges {
        tokens.push(m.replace(' ', ""));
    }
    let mut types = vec![1; tokens.len()];
    for s in ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] {
        tokens.push(s.into());
        types.push(3);
    }
    (
        tokens,
        types,
        merges.iter().map(|m| m.to_string()).collect(),
    )
}

const QWEN_TEMPLATE: &str =
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}";

fn tiny_qwen2() -> Vec<u8> {
    let (d, ff, heads, kv_heads, layers) = (8u64, 16u64, 2u32, 1u32, 2);
    let kv = d / heads as u64 * kv_heads as u64;
    let (tokens, types, merges) = qwen_vocab();
    let n = tokens.len() as u64;
    let eot = tokens.iter().position(|t| t == "<|endoftext|>").unwrap() as u32;
    let meta = vec![
        ("general.architecture", meta_str("qwen2")),
        ("qwen2.embedding_length", meta_u32(d as u32)),
        ("qwen2.feed_forward_length", meta_u32(ff as u32)),
        ("qwen2.attention.head_count", meta_u32(heads)),
        ("qwen2.attention.head_count_kv", meta_u32(kv_heads)),
        ("qwen2.block_count", meta_u32(layers)),
        ("qwen2.context_length", meta_u32(512)),
        ("qwen2.rope.freq_base", meta_f32(1_000_000.0)),
        ("qwen2.attention.layer_norm_rms_epsilon", meta_f32(1e-6)),
        ("tokenizer.ggml.model", meta_str("gpt2")),
        ("tokenizer.ggml.pre", meta_str("qwen2")),
        ("tokenizer.ggml.tokens", meta_strs(&tokens)),
        ("tokenizer.ggml.token_type", meta_i32s(&types)),
        ("tokenizer.ggml.merges", meta_strs(&merges)),
        ("tokenizer.ggml.eos_token_id", meta_u32(eot + 2)),
        ("tokenizer.ggml.bos_token_id", meta_u32(eot)),
        ("tokenizer.ggml.padding_token_id", meta_u32(eot)),
        ("tokenizer.ggml.add_bos_token", meta_bool(false)),
        ("tokenizer.chat_template", meta_str(QWEN_TEMPLATE)),
    ];
    let mut t = vec![
        mat("token_embd.weight".into(), n, d, 1),
        mat("output.weight".into(), n, d, 2),
        vec1("output_norm.weight".into(), &vals(3, d as usize)),
    ];
    for l in 0..layers as usize {
        let s = 10 * (l + 1);
        t.extend([
            vec1(format!("blk.{l}.attn_norm.weight"), &vals(s, d as usize)),
            mat(format!("blk.{l}.attn_q.weight"), d, d, s + 1),
            vec1(format!("blk.{l}.attn_q.bias"), &vals(s + 2, d as usize)),
            mat(format!("blk.{l}.attn_k.weight"), kv, d, s + 3),
            vec1(format!("blk.{l}.attn_k.bias"), &vals(s + 4, kv as usize)),
            mat(format!("blk.{l}.attn_v.weight"), kv, d, s + 5),
            vec1(format!("blk.{l}.attn_v.bias"), &vals(s + 6, kv as usize)),
            mat(format!("blk.{l}.attn_output.weight"), d, d, s + 7),
            vec1(format!("blk.{l}.ffn_norm.weight"), &vals(s + 8, d as usize)),
            mat(format!("blk.{l}.ffn_gate.weight"), ff, d, s + 9),
            mat(format!("blk.{l}.ffn_up.weight"), ff, d, s + 10),
            mat(format!("blk.{l}.ffn_down.weight"), d, ff, s + 11),
        ]);
    }
    build(meta, &t)
}

fn import_bytes(bytes: &[u8], dtype: ImportDtype) -> (tempfile::TempDir, std::path::PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("m.gguf");
    std::fs::write(&src, bytes).unwrap();
    let out = tmp.path().join("out");
    import(&src, &out, dtype).unwrap();
    (tmp, out)
}

#[test]
fn qwen2_imports_to_transformers_config_and_tensor_names() {
    let (_tmp, dir) = import_bytes(&tiny_qwen2(), ImportDtype::Keep);
    let c = json(&dir, "config.json");
    let (tokens, _, _) = qwen_vocab();
    let id = |s: &str| tokens.iter().position(|t| t == s).unwrap() as u64;
    for (k, want) in [
        ("model_type", serde_json::json!("qwen2")),
        ("architectures", serde_json::json!(["Qwen2ForCausalLM"])),
        ("hidden_size", 8.into()),
        ("intermediate_size", 16.into()),
        ("num_hidden_layers", 2.into()),
        ("num_attention_heads", 2.into()),
        ("num_key_value_heads", 1.into()),
        ("max_position_embeddings", 512.into()),
        ("rope_theta", 1_000_000.0.into()),
        ("rms_norm_eps", 1e-6.into()),
        ("hidden_act", "silu".into()),
        ("tie_word_embeddings", false.into()),
        ("use_sliding_window", false.into()),
        ("rope_scaling", serde_json::Value::Null),
        ("vocab_size", (tokens.len() as u64).into()),
        ("bos_token_id", id("<|endoftext|>").into()),
        ("eos_token_id", id("<|im_end|>").into()),
    ] {
        assert_eq!(c[k], want, "config.json `{k}`");
    }
    let g = json(&dir, "generation_config.json");
    assert_eq!(
        g["eos_token_id"],
        serde_json::json!([id("<|im_end|>"), id("<|endoftext|>")])
    );
    let tc = json(&dir, "tokenizer_config.json");
    assert_eq!(tc["chat_template"], QWEN_TEMPLATE);
    assert_eq!(tc["eos_token"], "<|im_end|>");
    assert_eq!(tc["add_bos_token"], false);
    let t = tensors(&dir);
    let mut want: Vec<String> = [
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
    ]
    .map(String::from)
    .to_vec();
    for l in 0..2 {
        for n in [
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
            "self_attn.q_proj.weight",
            "self_attn.q_proj.bias",
            "self_attn.k_proj.weight",
            "self_attn.k_proj.bias",
            "self_attn.v_proj.weight",
            "self_attn.v_proj.bias",
            "self_attn.o_proj.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
        ] {
            want.push(format!("model.layers.{l}.{n}"));
        }
    }
    want.sort();
    assert_eq!(t.keys().cloned().collect::<Vec<_>>(), want);
    // No RoPE permutation for qwen2: rows in the file's order, F16 widened.
    let (shape, q) = &t["model.layers.0.self_attn.q_proj.weight"];
    assert_eq!(shape, &[8, 8]);
    assert_eq!(q, &vals(11, 64));
    assert_eq!(
        t["model.layers.0.self_attn.k_proj.bias"],
        (vec![4], vals(14, 4))
    );
    assert_eq!(t["model.layers.1.mlp.down_proj.weight"].0, vec![8, 16]);
}

// ---- gemma3 ---------------------------------------------------------------

/// `<pad> <eos> <bos> <unk>`, the 256 byte tokens, then pieces; `  ` (two
/// real spaces) and `\n` user-defined, `<end_of_turn>` control.
fn spm_vocab() -> (Vec<String>, Vec<i32>) {
    let mut tokens: Vec<String> = ["<pad>", "<eos>", "<bos>", "<unk>"]
        .map(String::from)
        .to_vec();
    let mut types = vec![3, 3, 3, 2];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
    }
    for (p, ty) in [
        ("<end_of_turn>", 3),
        ("\n", 4),
        ("  ", 4),
        ("▁", 1),
        ("a", 1),
        ("b", 1),
        ("ab", 1),
        ("▁a", 1),
        ("▁ab", 1),
        ("c", 1),
        ("▁c", 1),
        ("▁ab▁c", 1),
    ] {
        tokens.push(p.into());
        types.push(ty);
    }
    (tokens, types)
}

fn spm_meta() -> Vec<(&'static str, (u32, Vec<u8>))> {
    let (tokens, types) = spm_vocab();
    vec![
        ("tokenizer.ggml.model", meta_str("llama")),
        ("tokenizer.ggml.pre", meta_str("default")),
        ("tokenizer.ggml.tokens", meta_strs(&tokens)),
        ("tokenizer.ggml.token_type", meta_i32s(&types)),
        ("tokenizer.ggml.bos_token_id", meta_u32(2)),
        ("tokenizer.ggml.eos_token_id", meta_u32(1)),
        ("tokenizer.ggml.unknown_token_id", meta_u32(3)),
        ("tokenizer.ggml.padding_token_id", meta_u32(0)),
        ("tokenizer.ggml.add_bos_token", meta_bool(true)),
        ("tokenizer.ggml.add_space_prefix", meta_bool(false)),
    ]
}

/// A 6-layer gemma3 (so layer 5 is the global one) with a head dimension of
/// 4 that is not hidden/heads, norms stored as `1 + w`, tied embeddings.
fn tiny_gemma3() -> Vec<u8> {
    tiny_gemma3_with(Vec::new())
}

/// [`tiny_gemma3`] with more metadata.
fn tiny_gemma3_with(extra: Vec<(&'static str, (u32, Vec<u8>))>) -> Vec<u8> {
    let (d, ff, heads, kv_heads, hd, layers) = (8u64, 16u64, 4u32, 1u32, 4u64, 6);
    let (tokens, _) = spm_vocab();
    let n = tokens.len() as u64;
    let mut meta = vec![
        ("general.architecture", meta_str("gemma3")),
        ("gemma3.embedding_length", meta_u32(d as u32)),
        ("gemma3.feed_forward_length", meta_u32(ff as u32)),
        ("gemma3.attention.head_count", meta_u32(heads)),
        ("gemma3.attention.head_count_kv", meta_u32(kv_heads)),
        ("gemma3.attention.key_length", meta_u32(hd as u32)),
        ("gemma3.attention.value_length", meta_u32(hd as u32)),
        ("gemma3.attention.sliding_window", meta_u32(16)),
        ("gemma3.block_count", meta_u32(layers)),
        ("gemma3.context_length", meta_u32(1024)),
        ("gemma3.rope.freq_base", meta_f32(1_000_000.0)),
        ("gemma3.attention.layer_norm_rms_epsilon", meta_f32(1e-6)),
    ];
    meta.extend(spm_meta());
    meta.extend(extra);
    // Norms as llama.cpp's converter stores them: 1 + w.
    let norm = |seed: usize, n: u64| -> Vec<f32> {
        vals(seed, n as usize).iter().map(|w| 1.0 + w).collect()
    };
    let mut t = vec![
        mat("token_embd.weight".into(), n, d, 1),
        vec1("output_norm.weight".into(), &norm(3, d)),
    ];
    for l in 0..layers as usize {
        let s = 20 * (l + 1);
        t.extend([
            vec1(format!("blk.{l}.attn_norm.weight"), &norm(s, d)),
            mat(
                format!("blk.{l}.attn_q.weight"),
                heads as u64 * hd,
                d,
                s + 1,
            ),
            mat(
                format!("blk.{l}.attn_k.weight"),
                kv_heads as u64 * hd,
                d,
                s + 2,
            ),
            mat(
                format!("blk.{l}.attn_v.weight"),
                kv_heads as u64 * hd,
                d,
                s + 3,
            ),
            mat(
                format!("blk.{l}.attn_output.weight"),
                d,
                heads as u64 * hd,
                s + 4,
            ),
            vec1(format!("blk.{l}.attn_q_norm.weight"), &norm(s + 5, hd)),
            vec1(format!("blk.{l}.attn_k_norm.weight"), &norm(s + 6, hd)),
            vec1(
                format!("blk.{l}.post_attention_norm.weight"),
                &norm(s + 7, d),
            ),
            vec1(format!("blk.{l}.ffn_norm.weight"), &norm(s + 8, d)),
            mat(format!("blk.{l}.ffn_gate.weight"), ff, d, s + 9),
            mat(format!("blk.{l}.ffn_up.weight"), ff, d, s + 10),
            mat(format!("blk.{l}.ffn_down.weight"), d, ff, s + 11),
            vec1(format!("blk.{l}.post_ffw_norm.weight"), &norm(s + 12, d)),
        ]);
    }
    build(meta, &t)
}

#[test]
fn gemma3_imports_to_transformers_config_with_norms_shifted_back() {
    let (_tmp, dir) = import_bytes(&tiny_gemma3(), ImportDtype::F32);
    let c = json(&dir, "config.json");
    let full = |i: usize| {
        if i == 5 {
            "full_attention"
        } else {
            "sliding_attention"
        }
    };
    for (k, want) in [
        ("model_type", serde_json::json!("gemma3_text")),
        ("architectures", serde_json::json!(["Gemma3ForCausalLM"])),
        ("hidden_size", 8.into()),
        ("head_dim", 4.into()),
        ("num_attention_heads", 4.into()),
        ("num_key_value_heads", 1.into()),
        ("num_hidden_layers", 6.into()),
        ("sliding_window", 16.into()),
        ("sliding_window_pattern", 6.into()),
        (
            "layer_types",
            serde_json::json!((0..6).map(full).collect::<Vec<_>>()),
        ),
        ("rope_theta", 1_000_000.0.into()),
        ("rope_local_base_freq", 10_000.0.into()),
        ("query_pre_attn_scalar", 4.into()),
        ("hidden_activation", "gelu_pytorch_tanh".into()),
        ("final_logit_softcapping", serde_json::Value::Null),
        ("attn_logit_softcapping", serde_json::Value::Null),
        ("rms_norm_eps", 1e-6.into()),
        ("tie_word_embeddings", true.into()),
        ("bos_token_id", 2.into()),
        ("eos_token_id", 1.into()),
        ("pad_token_id", 0.into()),
    ] {
        assert_eq!(c[k], want, "config.json `{k}`");
    }
    let (tokens, _) = spm_vocab();
    let eot = tokens.iter().position(|t| t == "<end_of_turn>").unwrap() as u64;
    assert_eq!(
        json(&dir, "generation_config.json")["eos_token_id"],
        serde_json::json!([1, eot])
    );
    // No chat template in the file: none written, BOS added.
    let tc = json(&dir, "tokenizer_config.json");
    assert!(tc.get("chat_template").is_none());
    assert_eq!(tc["add_bos_token"], true);
    let t = tensors(&dir);
    assert!(!t.contains_key("lm_head.weight"));
    for (hf, seed, n) in [
        ("model.norm.weight", 3, 8),
        ("model.layers.0.input_layernorm.weight", 20, 8),
        ("model.layers.0.self_attn.q_norm.weight", 25, 4),
        ("model.layers.0.self_attn.k_norm.weight", 26, 4),
        ("model.layers.0.post_attention_layernorm.weight", 27, 8),
        ("model.layers.0.pre_feedforward_layernorm.weight", 28, 8),
        ("model.layers.0.post_feedforward_layernorm.weight", 32, 8),
    ] {
        // (1 + w) − 1 is w exactly for these w (|w| ≤ 1, multiples of 1/8).
        assert_eq!(t[hf].1, vals(seed, n), "{hf}");
    }
    assert_eq!(t["model.layers.0.self_attn.q_proj.weight"].0, vec![16, 8]);
    assert_eq!(t["model.layers.0.self_attn.q_proj.weight"].1, vals(21, 128));
    assert_eq!(t["model.layers.5.self_attn.o_proj.weight"].0, vec![8, 16]);
    assert_eq!(t.len(), 2 + 6 * 13);
}

#[test]
fn gemma3_sliding_window_pattern_from_the_file_wins() {
    // One bool a layer, true for sliding: layers 0 and 3 global.
    let pattern = [false, true, true, false, true, true];
    let mut raw = 7u32.to_le_bytes().to_vec();
    raw.extend((pattern.len() as u64).to_le_bytes());
    raw.extend(pattern.iter().map(|&p| p as u8));
    let bytes = tiny_gemma3_with(vec![("gemma3.attention.sliding_window_pattern", (9, raw))]);
    let (_tmp, dir) = import_bytes(&bytes, ImportDtype::F32);
    let c = json(&dir, "config.json");
    assert_eq!(c["sliding_window_pattern"], serde_json::Value::Null);
    let types: Vec<&str> = (0..6)
        .map(|i| c["layer_types"][i].as_str().unwrap())
        .collect();
    assert_eq!(
        types,
        [
            "full_attention",
            "sliding_attention",
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "sliding_attention"
        ]
    );
}

// ---- refusals ---------------------------------------------------------------

fn import_err(bytes: &[u8]) -> String {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("m.gguf");
    std::fs::write(&src, bytes).unwrap();
    import(&src, &tmp.path().join("out"), ImportDtype::Keep)
        .expect_err("import must fail")
        .to_string()
}

#[test]
fn an_unknown_architecture_is_refused_before_its_tensor_types() {
    // A tensor of a type the reader does not know (99): the architecture
    // is what the message names.
    let b = build(
        vec![("general.architecture", meta_str("mamba"))],
        &[("w".into(), vec![32], 99, vec![0; 34])],
    );
    let e = import_err(&b);
    assert!(
        e.contains("architecture `mamba`") && e.contains("llama, qwen2, gemma3"),
        "{e}"
    );
    assert!(!e.contains("ggml type"), "{e}");
    let e = import_err(&build(vec![], &[]));
    assert!(e.contains("`general.architecture` is missing"), "{e}");
}

#[test]
fn a_tensor_with_no_place_is_refused_by_name() {
    // llama 3.1's RoPE frequencies would be dropped: refused.
    let (d, ff) = (8u64, 16u64);
    let mut t = vec![
        mat("token_embd.weight".into(), 4, d, 1),
        vec1("output_norm.weight".into(), &vals(2, d as usize)),
        vec1("rope_freqs.weight".into(), &[1.0; 4]),
    ];
    for (n, rows, cols) in [
        ("attn_q", d, d),
        ("attn_k", d, d),
        ("attn_v", d, d),
        ("attn_output", d, d),
        ("ffn_gate", ff, d),
        ("ffn_up", ff, d),
        ("ffn_down", d, ff),
    ] {
        t.push(mat(format!("blk.0.{n}.weight"), rows, cols, 3));
    }
    for n in ["attn_norm", "ffn_norm"] {
        t.push(vec1(format!("blk.0.{n}.weight"), &vals(4, d as usize)));
    }
    let tokens: Vec<String> = ["a", "b", "c", "d"].map(String::from).to_vec();
    let meta = vec![
        ("general.architecture", meta_str("llama")),
        ("llama.embedding_length", meta_u32(d as u32)),
        ("llama.feed_forward_length", meta_u32(ff as u32)),
        ("llama.attention.head_count", meta_u32(2)),
        ("llama.block_count", meta_u32(1)),
        ("llama.context_length", meta_u32(64)),
        ("tokenizer.ggml.tokens", meta_strs(&tokens)),
    ];
    let e = import_err(&build(meta.clone(), &t));
    assert!(
        e.contains("`rope_freqs.weight`") && e.contains("llama"),
        "{e}"
    );
    // Without it the same file imports.
    t.retain(|x| x.0 != "rope_freqs.weight");
    let _ok = import_bytes(&build(meta, &t), ImportDtype::F32);
}

#[test]
fn an_unknown_pre_tokenizer_is_refused() {
    let v = GgufVocab {
        model: "gpt2".into(),
        pre: "deepseek-coder".into(),
        tokens: vec!["a".into()],
        ..Default::default()
    };
    let e = v.tokenizer_json().unwrap_err();
    assert!(e.contains("`deepseek-coder`") && e.contains("qwen2"), "{e}");
    let v = GgufVocab {
        model: "rwkv".into(),
        ..Default::default()
    };
    let e = v.tokenizer_json().unwrap_err();
    assert!(e.contains("`rwkv`") && e.contains("gpt2"), "{e}");
}

// ---- tokenizers -------------------------------------------------------------

fn tokenizer(v: &GgufVocab) -> tokenizers::Tokenizer {
    tokenizers::Tokenizer::from_bytes(v.tokenizer_json().unwrap().as_bytes()).unwrap()
}

fn ids(t: &tokenizers::Tokenizer, s: &str) -> Vec<u32> {
    t.encode(s, false).unwrap().get_ids().to_vec()
}

#[test]
fn qwen2_byte_level_vocabulary_round_trips() {
    let (tokens, types, merges) = qwen_vocab();
    let v = GgufVocab {
        model: "gpt2".into(),
        pre: "qwen2".into(),
        types: types.iter().map(|&t| t as u64).collect(),
        tokens: tokens.clone(),
        merges,
        ..Default::default()
    };
    let t = tokenizer(&v);
    let id = |s: &str| tokens.iter().position(|t| t == s).unwrap() as u32;
    assert_eq!(
        ids(&t, "Hello world<|im_end|>"),
        [
            id("Hello"),
            id("Ġw"),
            id("o"),
            id("r"),
            id("l"),
            id("d"),
            id("<|im_end|>")
        ]
    );
    // Qwen2's split: digits one by one, never merged with letters.
    assert_eq!(ids(&t, "a123"), [id("a"), id("1"), id("2"), id("3")]);
    for s in [
        "Hello world",
        "x = f(1, 2) # ok",
        "<|im_start|>user\n",
        "  two  spaces",
    ] {
        let e = ids(&t, s);
        assert_eq!(t.decode(&e, false).unwrap(), s, "{e:?}");
    }
}

#[test]
fn sentencepiece_vocabulary_round_trips_with_byte_fallback() {
    let (tokens, types) = spm_vocab();
    let v = GgufVocab {
        model: "llama".into(),
        pre: "default".into(),
        types: types.iter().map(|&t| t as u64).collect(),
        tokens: tokens.clone(),
        bos: Some(2),
        unk: Some(3),
        add_bos: true,
        ..Default::default()
    };
    let t = tokenizer(&v);
    let id = |s: &str| tokens.iter().position(|t| t == s).unwrap() as u32;
    // Spaces become ▁ (no prefix space): "ab ab c" → ab ▁ab ▁c; merges in
    // vocabulary order make `▁ab▁c` from `▁ab` + `▁c`.
    assert_eq!(ids(&t, "ab ab c"), [id("ab"), id("▁ab▁c")]);
    assert_eq!(ids(&t, "ab ab"), [id("ab"), id("▁ab")]);
    // A run of spaces is its token (spelled `▁▁` under the file's id).
    assert_eq!(ids(&t, "a  b"), [id("a"), id("  "), id("b")]);
    // Characters outside the vocabulary fall back to their UTF-8 bytes.
    assert_eq!(ids(&t, "é"), [id("<0xC3>"), id("<0xA9>")]);
    // User-defined and control tokens are matched whole.
    assert_eq!(
        ids(&t, "a\n<end_of_turn>"),
        [id("a"), id("\n"), id("<end_of_turn>")]
    );
    // BOS by the post-processor, when special tokens are asked for.
    assert_eq!(t.encode("a", true).unwrap().get_ids(), [2, id("a")]);
    for s in [
        "ab ab c",
        "a  b",
        "é ü ß 日本",
        "a\nb\n<end_of_turn>",
        " lead",
        "tail ",
    ] {
        let e = ids(&t, s);
        assert_eq!(t.decode(&e, false).unwrap(), s, "{e:?}");
    }
}

#[test]
fn sentencepiece_with_a_prefix_space_is_refused() {
    let (tokens, _) = spm_vocab();
    let v = GgufVocab {
        model: "llama".into(),
        tokens,
        add_space_prefix: true,
        ..Default::default()
    };
    let e = v.tokenizer_json().unwrap_err();
    assert!(e.contains("add_space_prefix"), "{e}");
}
