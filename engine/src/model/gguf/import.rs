//! The GGUF importer: a llama GGUF file (read by [`super::read`]) to an HF
//! directory (`config.json`, `model.safetensors`, `tokenizer.json`,
//! `tokenizer_config.json`), byte-deterministic.
//!
//! llama.cpp's converter permutes the rows of `attn_q`/`attn_k` so that its
//! interleaved RoPE matches HF's rotate-half; the importer undoes that
//! permutation, so the written model uses HF conventions like every other.

use std::collections::BTreeMap;
use std::path::Path;

use super::read::{dequantize, GgmlType, Gguf, TensorInfo, Value};
use crate::EngineError;

/// Undoes llama.cpp's row permutation of `attn_q`/`attn_k` (`rows` = heads ·
/// head_dim rows of `cols` elements each — f32 values, or the bytes of a
/// quantized row): GGUF row `h·hd + 2i + j` holds HF row `h·hd + j·hd/2 + i`.
pub fn unpermute_rope_rows<T: Copy + Default>(
    w: &[T],
    heads: usize,
    rows: usize,
    cols: usize,
) -> Vec<T> {
    let hd = rows / heads;
    let mut out = vec![T::default(); w.len()];
    for h in 0..heads {
        for i in 0..hd / 2 {
            for j in 0..2 {
                let src = h * hd + 2 * i + j;
                let dst = h * hd + j * (hd / 2) + i;
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&w[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

/// Storage dtype of an imported model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImportDtype {
    /// Dequantized values, exactly.
    F32,
    /// Dequantized values rounded to bf16 (half the size; not exact).
    Bf16,
    /// Matrices in a format the kernels compute on (`Q4_0`/`Q4_1`/`Q8_0`/
    /// `Q4_K`/`Q6_K`) keep their GGUF blocks, stored as `U8` tensors of shape
    /// `(rows, row bytes)` with the format in the safetensors metadata
    /// (`lmrr.quant.<name>`); the kernels dequantize them on the fly to the
    /// same f32 values as [`ImportDtype::F32`]. Other tensors, other block
    /// formats included (`Q5_0`, `Q5_1`, `Q2_K`, `Q3_K`, `Q5_K`), are stored
    /// as exact f32, counted per type in [`ImportReport::dequantized`].
    Keep,
}

impl ImportDtype {
    /// Parses `f32`, `bf16` or `keep`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "f32" => Some(Self::F32),
            "bf16" => Some(Self::Bf16),
            "keep" => Some(Self::Keep),
            _ => None,
        }
    }
}

/// Safetensors metadata key naming the block format of a `U8` tensor.
pub fn quant_meta_key(tensor: &str) -> String {
    format!("lmrr.quant.{tensor}")
}

fn meta_u(g: &Gguf, key: &str, path: &Path) -> Result<usize, EngineError> {
    g.get(key)
        .and_then(Value::as_u64)
        .map(|v| v as usize)
        .ok_or_else(|| EngineError::Gguf {
            path: path.display().to_string(),
            offset: 0,
            msg: format!("metadata `{key}` is missing or not an integer"),
        })
}

/// What [`import`] wrote.
#[derive(Debug, Clone)]
pub struct ImportReport {
    pub tensors: usize,
    pub params: usize,
    pub vocab: usize,
    pub merges: usize,
    pub chat_template: bool,
    /// Tensors stored in their GGUF blocks, per ggml type name.
    pub kept: BTreeMap<&'static str, usize>,
    /// Tensors not of type F32 whose values were widened or dequantized to
    /// f32 (or bf16 for [`ImportDtype::Bf16`]), per ggml type name.
    pub dequantized: BTreeMap<&'static str, usize>,
}

/// Converts a llama-architecture GGUF file into an HF directory: `config.json`,
/// `model.safetensors`, `tokenizer.json` and (when the file has one)
/// `tokenizer_config.json` with the chat template.
pub fn import(path: &Path, out: &Path, dtype: ImportDtype) -> Result<ImportReport, EngineError> {
    let io = |p: &Path, source| EngineError::Io {
        path: p.into(),
        source,
    };
    let f = std::fs::File::open(path).map_err(|e| io(path, e))?;
    // SAFETY: read-only map; every offset is validated by `Gguf::parse`.
    let map = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| io(path, e))?;
    let g = Gguf::parse(&map, path)?;
    let bad = |msg: String| EngineError::Gguf {
        path: path.display().to_string(),
        offset: 0,
        msg,
    };
    let arch = g
        .get("general.architecture")
        .and_then(Value::as_str)
        .unwrap_or("");
    if arch != "llama" {
        return Err(bad(format!(
            "architecture `{arch}`, only `llama` is supported"
        )));
    }
    let hidden = meta_u(&g, "llama.embedding_length", path)?;
    let heads = meta_u(&g, "llama.attention.head_count", path)?;
    let kv_heads = g
        .get("llama.attention.head_count_kv")
        .and_then(Value::as_u64)
        .map_or(heads, |v| v as usize);
    let layers = meta_u(&g, "llama.block_count", path)?;
    let tokens: Vec<String> = match g.get("tokenizer.ggml.tokens") {
        Some(Value::Array(v)) => v
            .iter()
            .map(|x| x.as_str().unwrap_or("").to_string())
            .collect(),
        _ => return Err(bad("metadata `tokenizer.ggml.tokens` is missing".into())),
    };
    let vocab = g
        .get("llama.vocab_size")
        .and_then(Value::as_u64)
        .map_or(tokens.len(), |v| v as usize);
    let by_name: BTreeMap<&str, &TensorInfo> =
        g.tensors.iter().map(|t| (t.name.as_str(), t)).collect();
    let tied = !by_name.contains_key("output.weight");
    let cfg = crate::LlamaConfig {
        architectures: vec!["LlamaForCausalLM".into()],
        model_type: "llama".into(),
        hidden_size: hidden,
        intermediate_size: meta_u(&g, "llama.feed_forward_length", path)?,
        num_hidden_layers: layers,
        num_attention_heads: heads,
        num_key_value_heads: Some(kv_heads),
        head_dim: None,
        vocab_size: vocab,
        max_position_embeddings: meta_u(&g, "llama.context_length", path)?,
        rms_norm_eps: g
            .get("llama.attention.layer_norm_rms_epsilon")
            .and_then(Value::as_f64)
            .unwrap_or(1e-5) as f32,
        rope_theta: g
            .get("llama.rope.freq_base")
            .and_then(Value::as_f64)
            .unwrap_or(10_000.0),
        tie_word_embeddings: tied,
        hidden_act: "silu".into(),
        bos_token_id: g
            .get("tokenizer.ggml.bos_token_id")
            .and_then(Value::as_u64)
            .map(|v| v as u32),
        eos_token_id: g
            .get("tokenizer.ggml.eos_token_id")
            .and_then(Value::as_u64)
            .map(|v| crate::config::TokenIds::One(v as u32)),
        rope_scaling: None,
        attention_bias: false,
        mlp_bias: false,
        torch_dtype: Some(match dtype {
            ImportDtype::F32 => "float32".into(),
            ImportDtype::Bf16 => "bfloat16".into(),
            ImportDtype::Keep => "gguf".into(),
        }),
    };
    // GGUF name → (HF name, rope heads to un-permute).
    let mut plan: Vec<(String, String, Option<usize>)> = vec![
        (
            "token_embd.weight".into(),
            "model.embed_tokens.weight".into(),
            None,
        ),
        (
            "output_norm.weight".into(),
            "model.norm.weight".into(),
            None,
        ),
    ];
    if !tied {
        plan.push(("output.weight".into(), "lm_head.weight".into(), None));
    }
    for i in 0..layers {
        let (b, h) = (format!("blk.{i}"), format!("model.layers.{i}"));
        plan.extend([
            (
                format!("{b}.attn_norm.weight"),
                format!("{h}.input_layernorm.weight"),
                None,
            ),
            (
                format!("{b}.attn_q.weight"),
                format!("{h}.self_attn.q_proj.weight"),
                Some(heads),
            ),
            (
                format!("{b}.attn_k.weight"),
                format!("{h}.self_attn.k_proj.weight"),
                Some(kv_heads),
            ),
            (
                format!("{b}.attn_v.weight"),
                format!("{h}.self_attn.v_proj.weight"),
                None,
            ),
            (
                format!("{b}.attn_output.weight"),
                format!("{h}.self_attn.o_proj.weight"),
                None,
            ),
            (
                format!("{b}.ffn_norm.weight"),
                format!("{h}.post_attention_layernorm.weight"),
                None,
            ),
            (
                format!("{b}.ffn_gate.weight"),
                format!("{h}.mlp.gate_proj.weight"),
                None,
            ),
            (
                format!("{b}.ffn_up.weight"),
                format!("{h}.mlp.up_proj.weight"),
                None,
            ),
            (
                format!("{b}.ffn_down.weight"),
                format!("{h}.mlp.down_proj.weight"),
                None,
            ),
        ]);
    }
    let mut data: Vec<crate::weights::TensorBytes> = Vec::with_capacity(plan.len());
    // Sorted: the file's bytes depend only on the GGUF (see `write_safetensors`).
    let mut quant_meta = BTreeMap::new();
    let mut params = 0;
    let (mut kept, mut dequantized) = (BTreeMap::new(), BTreeMap::new());
    for (src, dst, rope) in plan {
        let t = by_name
            .get(src.as_str())
            .ok_or_else(|| bad(format!("tensor `{src}` is missing")))?;
        let mut shape: Vec<usize> = t.dims.iter().rev().map(|&d| d as usize).collect();
        if shape.len() == 2 && shape[0] == 1 {
            shape.remove(0);
        }
        params += t.elements();
        if let (ImportDtype::Keep, Some(kind), [rows, cols]) = (dtype, t.ty.quant(), &shape[..]) {
            let (rows, rb) = (*rows, kind.row_bytes(*cols));
            let mut b = map[t.start..t.start + t.len].to_vec();
            if let Some(h) = rope {
                b = unpermute_rope_rows(&b, h, rows, rb);
            }
            quant_meta.insert(quant_meta_key(&dst), kind.name().to_string());
            data.push((dst, safetensors::Dtype::U8, vec![rows, rb], b));
            *kept.entry(t.ty.name()).or_insert(0) += 1;
            continue;
        }
        if t.ty != GgmlType::F32 {
            *dequantized.entry(t.ty.name()).or_insert(0) += 1;
        }
        let mut v = dequantize(t, &map);
        if let (Some(h), [rows, cols]) = (rope, shape.as_slice()) {
            v = unpermute_rope_rows(&v, h, *rows, *cols);
        }
        let (st_dtype, bytes): (_, Vec<u8>) = match dtype {
            ImportDtype::F32 | ImportDtype::Keep => (
                safetensors::Dtype::F32,
                v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            ),
            ImportDtype::Bf16 => (
                safetensors::Dtype::BF16,
                v.iter()
                    .flat_map(|&x| crate::synth::f32_to_bf16(x).to_le_bytes())
                    .collect(),
            ),
        };
        data.push((dst, st_dtype, shape, bytes));
    }
    let st = crate::weights::write_safetensors(&data, &quant_meta).map_err(bad)?;
    // Tokenizer.
    let merges: Vec<String> = match g.get("tokenizer.ggml.merges") {
        Some(Value::Array(v)) => v
            .iter()
            .map(|x| x.as_str().unwrap_or("").to_string())
            .collect(),
        _ => Vec::new(),
    };
    let types: Vec<u64> = match g.get("tokenizer.ggml.token_type") {
        Some(Value::Array(v)) => v.iter().map(|x| x.as_u64().unwrap_or(1)).collect(),
        _ => vec![1; tokens.len()],
    };
    let pre = g
        .get("tokenizer.ggml.pre")
        .and_then(Value::as_str)
        .unwrap_or("default");
    let tok_json = tokenizer_json(&tokens, &types, &merges, pre);
    let template = g.get("tokenizer.chat_template").and_then(Value::as_str);
    std::fs::create_dir_all(out).map_err(|e| io(out, e))?;
    let write = |name: &str, bytes: &[u8]| {
        let p = out.join(name);
        std::fs::write(&p, bytes).map_err(|e| io(&p, e))
    };
    write(
        "config.json",
        &serde_json::to_vec_pretty(&cfg).expect("config serialises"),
    )?;
    write("model.safetensors", &st)?;
    write("tokenizer.json", tok_json.as_bytes())?;
    if let Some(t) = template {
        let name = |k: &str| {
            g.get(k)
                .and_then(Value::as_u64)
                .and_then(|i| tokens.get(i as usize))
                .cloned()
        };
        let tc = serde_json::json!({
            "chat_template": t,
            "bos_token": name("tokenizer.ggml.bos_token_id"),
            "eos_token": name("tokenizer.ggml.eos_token_id"),
            "add_bos_token": g.get("tokenizer.ggml.add_bos_token").is_some_and(|v| *v == Value::Bool(true)),
        });
        write(
            "tokenizer_config.json",
            &serde_json::to_vec_pretty(&tc).expect("json"),
        )?;
    }
    Ok(ImportReport {
        tensors: data.len(),
        params,
        vocab: tokens.len(),
        merges: merges.len(),
        chat_template: template.is_some(),
        kept,
        dequantized,
    })
}

/// A `tokenizer.json` for a GGUF `gpt2`-model (byte-level BPE) vocabulary.
/// Control (type 3) and user-defined (type 4) tokens become added tokens,
/// control ones special. The `smollm` pre-tokenizer (llama.cpp's name) splits
/// digits individually before the GPT-2 byte-level regex, as HF's does.
fn tokenizer_json(tokens: &[String], types: &[u64], merges: &[String], pre: &str) -> String {
    use serde_json::json;
    let vocab: serde_json::Map<String, serde_json::Value> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), json!(i)))
        .collect();
    let added: Vec<_> = tokens
        .iter()
        .enumerate()
        .filter(|(i, _)| matches!(types.get(*i), Some(3) | Some(4)))
        .map(|(i, t)| {
            json!({"id": i, "content": t, "single_word": false, "lstrip": false, "rstrip": false,
                   "normalized": false, "special": types.get(i) == Some(&3)})
        })
        .collect();
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    let pre_tokenizer = match pre {
        "smollm" | "starcoder" | "refact" => {
            json!({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": true}, byte_level]})
        }
        _ => byte_level,
    };
    let v = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": merges}
    });
    serde_json::to_string(&v).expect("json of strings and numbers serialises")
}
