//! The GGUF importer: a GGUF file (read by [`super::read`]) of an
//! architecture [`super::arch`] knows to an HF directory (`config.json`,
//! `model.safetensors`, `tokenizer.json` from [`super::vocab`],
//! `tokenizer_config.json`, `generation_config.json`), byte-deterministic.
//!
//! The architecture is checked first, from the metadata alone, before the
//! tensor table is read. What llama.cpp's converter changed in the tensors
//! (llama's permuted q/k rows, Gemma's `+1` on norms) is undone, so the
//! written model uses HF conventions like every other. A llama import writes
//! the same files as before the other architectures existed (a tokenizer
//! config only with a chat template, no generation config).

use std::collections::BTreeMap;
use std::path::Path;

use super::arch::{self, Arch, Hparams};
use super::read::{dequantize, GgmlType, Gguf, TensorInfo, Value};
use super::vocab::GgufVocab;
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

/// Converts a GGUF file of a supported architecture ([`arch::SUPPORTED_ARCHS`])
/// into an HF directory: `config.json`, `model.safetensors`, `tokenizer.json`,
/// `tokenizer_config.json` (with the chat template when the file has one;
/// for llama only then) and, for qwen2 and gemma3, `generation_config.json`.
pub fn import(path: &Path, out: &Path, dtype: ImportDtype) -> Result<ImportReport, EngineError> {
    let io = |p: &Path, source| EngineError::Io {
        path: p.into(),
        source,
    };
    let f = std::fs::File::open(path).map_err(|e| io(path, e))?;
    // SAFETY: read-only map; every offset is validated by `Gguf::parse`.
    let map = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| io(path, e))?;
    let bad = |msg: String| EngineError::Gguf {
        path: path.display().to_string(),
        offset: 0,
        msg,
    };
    // The architecture first, from the metadata alone: a tensor type the
    // reader refuses must not hide that the model is not supported anyway.
    let arch = Arch::from_meta(&Gguf::parse_metadata(&map, path)?).map_err(bad)?;
    let g = Gguf::parse(&map, path)?;
    let hp = Hparams::read(arch, &g.meta).map_err(bad)?;
    let tokens: Vec<String> = match g.get("tokenizer.ggml.tokens") {
        Some(Value::Array(v)) => v
            .iter()
            .map(|x| x.as_str().unwrap_or("").to_string())
            .collect(),
        _ => return Err(bad("metadata `tokenizer.ggml.tokens` is missing".into())),
    };
    let vocab = g
        .get(&format!("{}.vocab_size", arch.key()))
        .and_then(Value::as_u64)
        .map_or(tokens.len(), |v| v as usize);
    let by_name: BTreeMap<&str, &TensorInfo> =
        g.tensors.iter().map(|t| (t.name.as_str(), t)).collect();
    let tied = !by_name.contains_key("output.weight");
    let torch_dtype = match dtype {
        ImportDtype::F32 => "float32",
        ImportDtype::Bf16 => "bfloat16",
        ImportDtype::Keep => "gguf",
    };
    let config = match arch {
        Arch::Llama => {
            let mut cfg = llama_config(&hp, &g, vocab, tied, torch_dtype);
            cfg.rope_scaling = arch::rope_scaling(arch, &g.meta).map_err(bad)?;
            serde_json::to_vec_pretty(&cfg).expect("config serialises")
        }
        Arch::Qwen2 | Arch::Gemma3 => serde_json::to_vec_pretty(
            &arch::config_json(&hp, &g.meta, vocab, tied, torch_dtype).map_err(bad)?,
        )
        .expect("json serialises"),
    };
    let plan = arch::plan(&hp, tied);
    if let Some(extra) = arch::unplanned(&plan, g.tensors.iter().map(|t| t.name.as_str())) {
        return Err(bad(format!(
            "tensor `{extra}` has no place in a {} model: it would be dropped, so the file is refused",
            arch.key()
        )));
    }
    // The tokenizer before the tensors: a vocabulary it cannot convert stops
    // the import before the long part.
    let voc = gguf_vocab(&g, &tokens);
    let tok_json = voc.tokenizer_json().map_err(bad)?;
    let mut data: Vec<crate::weights::TensorBytes> = Vec::with_capacity(plan.len());
    // Sorted: the file's bytes depend only on the GGUF (see `write_safetensors`).
    let mut quant_meta = BTreeMap::new();
    let mut params = 0;
    let (mut kept, mut dequantized) = (BTreeMap::new(), BTreeMap::new());
    for arch::TensorPlan {
        src,
        dst,
        rope_heads: rope,
        shift,
    } in plan
    {
        let t = by_name
            .get(src.as_str())
            .ok_or_else(|| bad(format!("tensor `{src}` is missing")))?;
        let mut shape: Vec<usize> = t.dims.iter().rev().map(|&d| d as usize).collect();
        if shape.len() == 2 && shape[0] == 1 {
            shape.remove(0);
        }
        params += t.elements();
        if let (ImportDtype::Keep, Some(kind), [rows, cols], 0.0) =
            (dtype, t.ty.quant(), &shape[..], shift)
        {
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
        if shift != 0.0 {
            v.iter_mut().for_each(|x| *x += shift);
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
    let template = g.get("tokenizer.chat_template").and_then(Value::as_str);
    std::fs::create_dir_all(out).map_err(|e| io(out, e))?;
    let write = |name: &str, bytes: &[u8]| {
        let p = out.join(name);
        std::fs::write(&p, bytes).map_err(|e| io(&p, e))
    };
    write("config.json", &config)?;
    write("model.safetensors", &st)?;
    write("tokenizer.json", tok_json.as_bytes())?;
    // llama: only with a template, as before (its files' bytes are pinned).
    if template.is_some() || arch != Arch::Llama {
        let name = |k: &str| {
            g.get(k)
                .and_then(Value::as_u64)
                .and_then(|i| tokens.get(i as usize))
                .cloned()
        };
        let mut tc = serde_json::json!({
            "bos_token": name("tokenizer.ggml.bos_token_id"),
            "eos_token": name("tokenizer.ggml.eos_token_id"),
            "add_bos_token": voc.add_bos,
        });
        if let Some(t) = template {
            tc["chat_template"] = t.into();
        }
        write(
            "tokenizer_config.json",
            &serde_json::to_vec_pretty(&tc).expect("json"),
        )?;
    }
    if arch != Arch::Llama {
        let gc = arch::generation_config(arch, &g.meta, &tokens);
        write(
            "generation_config.json",
            &serde_json::to_vec_pretty(&gc).expect("json"),
        )?;
    }
    Ok(ImportReport {
        tensors: data.len(),
        params,
        vocab: tokens.len(),
        merges: voc.merges.len(),
        chat_template: template.is_some(),
        kept,
        dequantized,
    })
}

/// The `tokenizer.ggml.*` metadata [`super::vocab`] converts. A `llama`
/// (SentencePiece) vocabulary adds BOS unless the file says otherwise, as
/// llama.cpp and transformers read it.
fn gguf_vocab(g: &Gguf, tokens: &[String]) -> GgufVocab {
    let s = |k: &str| g.get(k).and_then(Value::as_str).map(str::to_string);
    let b = |k: &str| match g.get(k) {
        Some(Value::Bool(v)) => Some(*v),
        _ => None,
    };
    let id = |k: &str| g.get(k).and_then(Value::as_u64).map(|v| v as u32);
    let model = s("tokenizer.ggml.model").unwrap_or_else(|| "gpt2".into());
    GgufVocab {
        add_bos: b("tokenizer.ggml.add_bos_token").unwrap_or(model == "llama"),
        add_space_prefix: b("tokenizer.ggml.add_space_prefix").unwrap_or(false),
        model,
        pre: s("tokenizer.ggml.pre").unwrap_or_else(|| "default".into()),
        tokens: tokens.to_vec(),
        types: match g.get("tokenizer.ggml.token_type") {
            Some(Value::Array(v)) => v.iter().map(|x| x.as_u64().unwrap_or(1)).collect(),
            _ => vec![1; tokens.len()],
        },
        merges: match g.get("tokenizer.ggml.merges") {
            Some(Value::Array(v)) => v
                .iter()
                .map(|x| x.as_str().unwrap_or("").to_string())
                .collect(),
            _ => Vec::new(),
        },
        bos: id("tokenizer.ggml.bos_token_id"),
        unk: id("tokenizer.ggml.unknown_token_id"),
    }
}

/// A llama file's `config.json`, as `LlamaConfig` writes it.
fn llama_config(
    hp: &Hparams,
    g: &Gguf,
    vocab: usize,
    tied: bool,
    torch_dtype: &str,
) -> crate::LlamaConfig {
    crate::LlamaConfig {
        architectures: vec!["LlamaForCausalLM".into()],
        model_type: "llama".into(),
        hidden_size: hp.hidden,
        intermediate_size: hp.ff,
        num_hidden_layers: hp.layers,
        num_attention_heads: hp.heads,
        num_key_value_heads: Some(hp.kv_heads),
        head_dim: None,
        vocab_size: vocab,
        max_position_embeddings: hp.context,
        rms_norm_eps: hp.eps,
        rope_theta: hp.theta,
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
        torch_dtype: Some(torch_dtype.into()),
    }
}
