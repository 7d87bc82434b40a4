//! GGUF architectures: `general.architecture` to the HF `config.json` and
//! tensor names transformers uses for it.
//!
//! - `llama` → `LlamaForCausalLM`. llama.cpp's converter permutes the rows of
//!   `attn_q`/`attn_k` for its interleaved RoPE; the plan un-permutes them.
//! - `qwen2` → `Qwen2ForCausalLM` (`model_type: "qwen2"`): llama's tensors plus
//!   q/k/v biases. The converter keeps HF's rotate-half row order (llama.cpp
//!   runs qwen2 with NEOX RoPE), so nothing is permuted.
//! - `gemma3` → `Gemma3ForCausalLM` (`model_type: "gemma3_text"`): pre- and
//!   post-norms around attention and MLP, q/k norms, no permutation. Norm
//!   weights: transformers' `Gemma3RMSNorm` computes `x·(1 + w)` and llama.cpp's
//!   converter (`convert_hf_to_gguf.py`, `Gemma3Model.modify_tensors`) stores
//!   `w + 1` for every tensor whose HF name ends in `norm.weight`, so the plan
//!   subtracts 1 in f32. `s − 1` is exact for a stored `s ≥ 0.5` (Sterbenz) and
//!   then `1 + (s − 1)` gives `s` back; below that the subtraction may round.
//!   The GGUF has no `query_pre_attn_scalar`, no local RoPE base and no layer
//!   pattern: they are written as llama.cpp assumes them for `gemma3` (the head
//!   dimension, or hidden/heads for the 62-layer 27B; base 10000; every sixth
//!   layer global, unless the file has `gemma3.attention.sliding_window_pattern`).
//!
//! Every tensor of the file must be used by the plan: one left over (such as
//! llama 3.1's `rope_freqs.weight`) carries arithmetic the importer would
//! drop, so it is refused by name.

use std::collections::BTreeMap;

use serde_json::{json, Value as Json};

use super::read::Value;

/// Architectures the importer converts.
pub const SUPPORTED_ARCHS: &str = "llama, qwen2, gemma3";

/// A GGUF `general.architecture` the importer converts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
    Gemma3,
}

type Meta = BTreeMap<String, Value>;

impl Arch {
    /// Reads `general.architecture`; an absent or unknown one is refused,
    /// naming it and the supported list.
    pub fn from_meta(meta: &Meta) -> Result<Self, String> {
        match meta.get("general.architecture").and_then(Value::as_str) {
            Some("llama") => Ok(Self::Llama),
            Some("qwen2") => Ok(Self::Qwen2),
            Some("gemma3") => Ok(Self::Gemma3),
            Some(other) => Err(format!(
                "architecture `{other}` is not supported, supported: {SUPPORTED_ARCHS}"
            )),
            None => Err(format!(
                "metadata `general.architecture` is missing, supported: {SUPPORTED_ARCHS}"
            )),
        }
    }

    /// The metadata prefix (`llama.`, `qwen2.`, `gemma3.`).
    pub fn key(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
            Self::Gemma3 => "gemma3",
        }
    }
}

/// Hyper-parameters read from `<arch>.*` metadata.
#[derive(Debug, Clone)]
pub struct Hparams {
    pub arch: Arch,
    pub hidden: usize,
    pub ff: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    /// `attention.key_length` (`value_length` must equal it).
    pub head_dim: Option<usize>,
    pub context: usize,
    pub eps: f32,
    pub theta: f64,
}

fn get_u(meta: &Meta, key: &str) -> Result<usize, String> {
    meta.get(key)
        .and_then(Value::as_u64)
        .map(|v| v as usize)
        .ok_or_else(|| format!("metadata `{key}` is missing or not an integer"))
}

fn opt_u(meta: &Meta, key: &str) -> Option<usize> {
    meta.get(key).and_then(Value::as_u64).map(|v| v as usize)
}

/// An f32 metadata value as the shortest decimal that reads back to it
/// (`1e-6`, not `9.999999974752427e-7`), as HF configs spell it.
fn f32_json(x: f64) -> Json {
    let short: f64 = (x as f32).to_string().parse().unwrap_or(x);
    json!(short)
}

impl Hparams {
    pub fn read(arch: Arch, meta: &Meta) -> Result<Self, String> {
        let k = |s: &str| format!("{}.{s}", arch.key());
        let heads = get_u(meta, &k("attention.head_count"))?;
        let head_dim = opt_u(meta, &k("attention.key_length"));
        if let (Some(kl), Some(vl)) = (head_dim, opt_u(meta, &k("attention.value_length"))) {
            if kl != vl {
                return Err(format!(
                    "metadata `{}` = {kl} and `{}` = {vl} differ: supported are equal key and value head dimensions",
                    k("attention.key_length"),
                    k("attention.value_length")
                ));
            }
        }
        let defaults = match arch {
            Arch::Llama => (1e-5, 10_000.0),
            Arch::Qwen2 | Arch::Gemma3 => (1e-6, 1_000_000.0),
        };
        let hp = Self {
            arch,
            hidden: get_u(meta, &k("embedding_length"))?,
            ff: get_u(meta, &k("feed_forward_length"))?,
            layers: get_u(meta, &k("block_count"))?,
            heads,
            kv_heads: opt_u(meta, &k("attention.head_count_kv")).unwrap_or(heads),
            head_dim,
            context: get_u(meta, &k("context_length"))?,
            eps: meta
                .get(&k("attention.layer_norm_rms_epsilon"))
                .and_then(Value::as_f64)
                .unwrap_or(defaults.0) as f32,
            theta: meta
                .get(&k("rope.freq_base"))
                .and_then(Value::as_f64)
                .unwrap_or(defaults.1),
        };
        if arch != Arch::Gemma3 {
            if let Some(hd) = hp.head_dim.filter(|&hd| hd * hp.heads != hp.hidden) {
                return Err(format!(
                    "metadata `{}` = {hd} is not hidden/heads = {}/{}: supported for {} only as that",
                    k("attention.key_length"),
                    hp.hidden,
                    hp.heads,
                    arch.key()
                ));
            }
        }
        Ok(hp)
    }
}

/// HF `rope_scaling` from `<arch>.rope.scaling.*`: `None` when absent or
/// `none`; `linear` and `yarn` as transformers spells them; other types refused.
pub fn rope_scaling(arch: Arch, meta: &Meta) -> Result<Option<Json>, String> {
    let k = |s: &str| format!("{}.rope.scaling.{s}", arch.key());
    let Some(ty) = meta.get(&k("type")).and_then(Value::as_str) else {
        return Ok(None);
    };
    let factor = || {
        meta.get(&k("factor"))
            .and_then(Value::as_f64)
            .map(f32_json)
            .ok_or_else(|| format!("metadata `{}` is missing", k("factor")))
    };
    match ty {
        "none" => Ok(None),
        "linear" => Ok(Some(json!({"rope_type": "linear", "factor": factor()?}))),
        "yarn" => Ok(Some(json!({
            "rope_type": "yarn",
            "factor": factor()?,
            "original_max_position_embeddings": get_u(meta, &k("original_context_length"))?,
        }))),
        other => Err(format!(
            "metadata `{}` = `{other}`, supported: none, linear, yarn",
            k("type")
        )),
    }
}

/// A token id from `tokenizer.ggml.<key>`.
fn token_id(meta: &Meta, key: &str) -> Option<u32> {
    meta.get(&format!("tokenizer.ggml.{key}"))
        .and_then(Value::as_u64)
        .map(|v| v as u32)
}

/// `generation_config.json`'s EOS list: the file's EOS (and EOT/EOM) ids,
/// then the end-of-turn and end-of-text tokens of the architecture's chat
/// format that the vocabulary holds (Qwen's `<|im_end|>` and
/// `<|endoftext|>`, Gemma's `<end_of_turn>`), each once, in that order.
pub fn eos_ids(arch: Arch, meta: &Meta, tokens: &[String]) -> Vec<u32> {
    let mut ids: Vec<u32> = ["eos_token_id", "eot_token_id", "eom_token_id"]
        .iter()
        .filter_map(|k| token_id(meta, k))
        .collect();
    let names: &[&str] = match arch {
        Arch::Llama => &[],
        Arch::Qwen2 => &["<|im_end|>", "<|endoftext|>"],
        Arch::Gemma3 => &["<end_of_turn>"],
    };
    for n in names {
        if let Some(i) = tokens.iter().position(|t| t == n) {
            ids.push(i as u32);
        }
    }
    let mut seen = std::collections::BTreeSet::new();
    ids.retain(|i| seen.insert(*i));
    ids
}

/// The `generation_config.json` of a qwen2 or gemma3 import.
pub fn generation_config(arch: Arch, meta: &Meta, tokens: &[String]) -> Json {
    json!({
        "bos_token_id": token_id(meta, "bos_token_id"),
        "eos_token_id": eos_ids(arch, meta, tokens),
        "pad_token_id": token_id(meta, "padding_token_id"),
    })
}

/// The layer pattern of a gemma3 file: `gemma3.attention.sliding_window_pattern`
/// as a period (an integer) or one bool a layer (true: sliding), else llama.cpp's
/// period 6. Returns HF `layer_types` and the period when there is one.
fn gemma3_layers(hp: &Hparams, meta: &Meta) -> Result<(Vec<&'static str>, Option<usize>), String> {
    let key = "gemma3.attention.sliding_window_pattern";
    let kind = |sliding: bool| {
        if sliding {
            "sliding_attention"
        } else {
            "full_attention"
        }
    };
    match meta.get(key) {
        None => Ok(((0..hp.layers).map(|i| kind((i + 1) % 6 != 0)).collect(), Some(6))),
        Some(Value::Array(v)) if v.len() == hp.layers => v
            .iter()
            .map(|b| match b {
                Value::Bool(s) => Ok(kind(*s)),
                _ => Err(format!("metadata `{key}` holds a value that is not a bool")),
            })
            .collect::<Result<_, _>>()
            .map(|t| (t, None)),
        Some(v) => match v.as_u64() {
            Some(p) if p > 0 => Ok((
                (0..hp.layers)
                    .map(|i| kind((i + 1) % p as usize != 0))
                    .collect(),
                Some(p as usize),
            )),
            _ => Err(format!(
                "metadata `{key}` is neither a positive period nor one bool for each of the {} layers",
                hp.layers
            )),
        },
    }
}

/// The `config.json` of a qwen2 or gemma3 import (llama's is `LlamaConfig`'s).
pub fn config_json(
    hp: &Hparams,
    meta: &Meta,
    vocab: usize,
    tied: bool,
    torch_dtype: &str,
) -> Result<Json, String> {
    let rope_scaling = rope_scaling(hp.arch, meta)?;
    let bos = token_id(meta, "bos_token_id");
    let eos = token_id(meta, "eos_token_id");
    let pad = token_id(meta, "padding_token_id");
    match hp.arch {
        Arch::Llama => Err("a llama config is written as `LlamaConfig`".into()),
        Arch::Qwen2 => Ok(json!({
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "hidden_size": hp.hidden,
            "intermediate_size": hp.ff,
            "num_hidden_layers": hp.layers,
            "num_attention_heads": hp.heads,
            "num_key_value_heads": hp.kv_heads,
            "hidden_act": "silu",
            "max_position_embeddings": hp.context,
            "rms_norm_eps": f32_json(hp.eps as f64),
            "rope_theta": f32_json(hp.theta),
            "rope_scaling": rope_scaling,
            "use_sliding_window": false,
            "sliding_window": null,
            "max_window_layers": hp.layers,
            "attention_dropout": 0.0,
            "tie_word_embeddings": tied,
            "vocab_size": vocab,
            "bos_token_id": bos,
            "eos_token_id": eos,
            "pad_token_id": pad,
            "torch_dtype": torch_dtype,
        })),
        Arch::Gemma3 => {
            let head_dim = hp
                .head_dim
                .ok_or("metadata `gemma3.attention.key_length` (the head dimension) is missing")?;
            let window = get_u(meta, "gemma3.attention.sliding_window")?;
            let (layer_types, pattern) = gemma3_layers(hp, meta)?;
            let softcap = |k: &str| {
                meta.get(&format!("gemma3.{k}"))
                    .and_then(Value::as_f64)
                    .map(f32_json)
            };
            // llama.cpp's gemma3 attention scale: 1/sqrt(hidden/heads) for the
            // 27B (62 layers), 1/sqrt(head_dim) otherwise.
            let scalar = if hp.layers == 62 {
                hp.hidden / hp.heads
            } else {
                head_dim
            };
            Ok(json!({
                "architectures": ["Gemma3ForCausalLM"],
                "model_type": "gemma3_text",
                "hidden_size": hp.hidden,
                "intermediate_size": hp.ff,
                "num_hidden_layers": hp.layers,
                "num_attention_heads": hp.heads,
                "num_key_value_heads": hp.kv_heads,
                "head_dim": head_dim,
                "hidden_activation": "gelu_pytorch_tanh",
                "max_position_embeddings": hp.context,
                "rms_norm_eps": f32_json(hp.eps as f64),
                "rope_theta": f32_json(hp.theta),
                "rope_local_base_freq": 10000.0,
                "rope_scaling": rope_scaling,
                "sliding_window": window,
                "sliding_window_pattern": pattern,
                "layer_types": layer_types,
                "query_pre_attn_scalar": scalar,
                "final_logit_softcapping": softcap("final_logit_softcapping"),
                "attn_logit_softcapping": softcap("attn_logit_softcapping"),
                "attention_bias": false,
                "attention_dropout": 0.0,
                "use_bidirectional_attention": false,
                "tie_word_embeddings": tied,
                "vocab_size": vocab,
                "bos_token_id": bos,
                "eos_token_id": eos,
                "pad_token_id": pad,
                "torch_dtype": torch_dtype,
            }))
        }
    }
}

/// One tensor to convert.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorPlan {
    /// GGUF name.
    pub src: String,
    /// HF name.
    pub dst: String,
    /// Heads whose RoPE rows llama.cpp's converter permuted (llama q/k).
    pub rope_heads: Option<usize>,
    /// Added to every value after dequantization (−1 for Gemma norms);
    /// a tensor with a shift is never kept as quantized blocks.
    pub shift: f32,
}

/// The tensors of `hp.arch`, GGUF name → HF name, in a fixed order.
pub fn plan(hp: &Hparams, tied: bool) -> Vec<TensorPlan> {
    let gemma = hp.arch == Arch::Gemma3;
    let norm_shift = if gemma { -1.0 } else { 0.0 };
    let t = |src: String, dst: String, rope_heads: Option<usize>, shift: f32| TensorPlan {
        src,
        dst,
        rope_heads,
        shift,
    };
    let mut p = vec![
        t(
            "token_embd.weight".into(),
            "model.embed_tokens.weight".into(),
            None,
            0.0,
        ),
        t(
            "output_norm.weight".into(),
            "model.norm.weight".into(),
            None,
            norm_shift,
        ),
    ];
    if !tied {
        p.push(t(
            "output.weight".into(),
            "lm_head.weight".into(),
            None,
            0.0,
        ));
    }
    let permute = hp.arch == Arch::Llama;
    for i in 0..hp.layers {
        let (b, h) = (format!("blk.{i}"), format!("model.layers.{i}"));
        let mut add = |g: &str, hf: &str, rope: Option<usize>, shift: f32| {
            p.push(t(format!("{b}.{g}"), format!("{h}.{hf}"), rope, shift));
        };
        add(
            "attn_norm.weight",
            "input_layernorm.weight",
            None,
            norm_shift,
        );
        add(
            "attn_q.weight",
            "self_attn.q_proj.weight",
            permute.then_some(hp.heads),
            0.0,
        );
        add(
            "attn_k.weight",
            "self_attn.k_proj.weight",
            permute.then_some(hp.kv_heads),
            0.0,
        );
        add("attn_v.weight", "self_attn.v_proj.weight", None, 0.0);
        add("attn_output.weight", "self_attn.o_proj.weight", None, 0.0);
        if hp.arch == Arch::Qwen2 {
            for x in ["q", "k", "v"] {
                add(
                    &format!("attn_{x}.bias"),
                    &format!("self_attn.{x}_proj.bias"),
                    None,
                    0.0,
                );
            }
        }
        if gemma {
            add("attn_q_norm.weight", "self_attn.q_norm.weight", None, -1.0);
            add("attn_k_norm.weight", "self_attn.k_norm.weight", None, -1.0);
            add(
                "post_attention_norm.weight",
                "post_attention_layernorm.weight",
                None,
                -1.0,
            );
            add(
                "ffn_norm.weight",
                "pre_feedforward_layernorm.weight",
                None,
                -1.0,
            );
            add(
                "post_ffw_norm.weight",
                "post_feedforward_layernorm.weight",
                None,
                -1.0,
            );
        } else {
            add(
                "ffn_norm.weight",
                "post_attention_layernorm.weight",
                None,
                0.0,
            );
        }
        add("ffn_gate.weight", "mlp.gate_proj.weight", None, 0.0);
        add("ffn_up.weight", "mlp.up_proj.weight", None, 0.0);
        add("ffn_down.weight", "mlp.down_proj.weight", None, 0.0);
    }
    p
}

/// The first tensor of the file the plan does not use, if any.
pub fn unplanned<'a>(
    plan: &[TensorPlan],
    names: impl IntoIterator<Item = &'a str>,
) -> Option<&'a str> {
    let used: std::collections::BTreeSet<&str> = plan.iter().map(|t| t.src.as_str()).collect();
    names.into_iter().find(|n| !used.contains(n))
}
