//! `config.json` of HF `gemma3_text`: parsing, defaults, validation.
//!
//! Defaults are transformers' `Gemma3TextConfig`'s (`head_dim` 256,
//! `num_key_value_heads` 4, `query_pre_attn_scalar` 256, `sliding_window`
//! 4096, a sliding pattern of 6, global RoPE base 1e6 and local 1e4, tied
//! embeddings). The layer kinds come from `layer_types`, else from
//! `sliding_window_pattern` (layer `i` slides unless `(i + 1) % pattern == 0`).
//! RoPE is read in either spelling: `rope_parameters` nested by layer type
//! (transformers v5), or `rope_theta` + `rope_scaling` for the global layers
//! and `rope_local_base_freq` for the sliding ones.
//!
//! Invariant: a field that would change the arithmetic and is not
//! implemented (logit soft-capping, bidirectional attention, another
//! activation, a partial rotary factor) is refused naming it and its value.
//! Design source: transformers' `configuration_gemma3.py`.

use std::fmt::Write;
use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use crate::config::{check_dims, parse_json, TokenIds};
use crate::hf_config::{self, RopeParams};
use crate::{EngineError, ModelFiles};

fn d_kv() -> usize {
    4
}
fn d_head_dim() -> usize {
    256
}
fn d_ctx() -> usize {
    131_072
}
fn d_eps() -> f32 {
    1e-6
}
fn d_scalar() -> f64 {
    256.0
}
fn d_true() -> bool {
    true
}
fn d_act() -> String {
    "gelu_pytorch_tanh".into()
}

/// The fields read by serde; the rest are resolved in [`Gemma3Config::parse`].
#[derive(Debug, Clone, Deserialize)]
struct Raw {
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    #[serde(default = "d_kv")]
    num_key_value_heads: usize,
    #[serde(default = "d_head_dim")]
    head_dim: usize,
    vocab_size: usize,
    #[serde(default = "d_ctx")]
    max_position_embeddings: usize,
    #[serde(default = "d_eps")]
    rms_norm_eps: f32,
    #[serde(default = "d_scalar")]
    query_pre_attn_scalar: f64,
    #[serde(default = "d_true")]
    tie_word_embeddings: bool,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default = "d_act")]
    hidden_activation: String,
    #[serde(default)]
    bos_token_id: Option<u32>,
    #[serde(default)]
    layer_types: Option<Vec<String>>,
    #[serde(default)]
    sliding_window_pattern: Option<usize>,
}

/// A resolved `gemma3_text` config.
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma3Config {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f32,
    pub query_pre_attn_scalar: f64,
    pub tie_word_embeddings: bool,
    pub attention_bias: bool,
    /// Per layer: whether it attends over the sliding window.
    pub sliding: Vec<bool>,
    /// The window of the sliding layers; `None` when null or covering the
    /// whole context (the same arithmetic as full attention).
    pub sliding_window: Option<usize>,
    /// RoPE of the sliding layers and of the global ones.
    pub rope_local: RopeParams,
    pub rope_global: RopeParams,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

fn bad(path: &Path, field: &'static str, value: impl ToString, why: impl ToString) -> EngineError {
    EngineError::ConfigValue {
        path: path.into(),
        field,
        value: value.to_string(),
        why: why.to_string(),
    }
}

impl Gemma3Config {
    /// The config of a model's files, with `generation_config.json`'s EOS ids.
    pub fn load(files: &ModelFiles) -> Result<Self, EngineError> {
        let gen = files
            .generation_config
            .as_ref()
            .map(|(b, p)| (&b[..], p.as_path()));
        Self::parse(&files.config, &files.config_path, gen)
    }

    /// Parses and validates `bytes` read from `path`.
    pub fn parse(
        bytes: &[u8],
        path: &Path,
        generation_config: Option<(&[u8], &Path)>,
    ) -> Result<Self, EngineError> {
        let v: Value = parse_json(bytes, path)?;
        let raw: Raw = serde_json::from_value(v.clone()).map_err(|e| EngineError::Config {
            path: path.into(),
            msg: e.to_string(),
        })?;
        hf_config::refuse_unimplemented(
            &v,
            path,
            &["query_pre_attn_scalar", "attention_bias", "layer_types"],
        )?;
        if let Some(x) = v
            .get("use_bidirectional_attention")
            .filter(|x| !x.is_null())
        {
            if *x != Value::Bool(false) {
                return Err(bad(
                    path,
                    "use_bidirectional_attention",
                    x,
                    "only causal attention is implemented",
                ));
            }
        }
        if raw.hidden_activation != "gelu_pytorch_tanh" {
            return Err(bad(
                path,
                "hidden_activation",
                &raw.hidden_activation,
                "only gelu_pytorch_tanh is implemented",
            ));
        }
        check_dims(
            path,
            &[
                ("hidden_size", raw.hidden_size),
                ("intermediate_size", raw.intermediate_size),
                ("num_hidden_layers", raw.num_hidden_layers),
                ("num_attention_heads", raw.num_attention_heads),
                ("num_key_value_heads", raw.num_key_value_heads),
                ("head_dim", raw.head_dim),
                ("vocab_size", raw.vocab_size),
                ("max_position_embeddings", raw.max_position_embeddings),
            ],
        )?;
        if !raw
            .num_attention_heads
            .is_multiple_of(raw.num_key_value_heads)
        {
            return Err(bad(
                path,
                "num_key_value_heads",
                raw.num_key_value_heads,
                format!(
                    "must divide num_attention_heads = {}",
                    raw.num_attention_heads
                ),
            ));
        }
        if !raw.head_dim.is_multiple_of(2) || raw.head_dim > 4096 {
            return Err(bad(
                path,
                "head_dim",
                raw.head_dim,
                "must be even, in 2..=4096",
            ));
        }
        if !(raw.rms_norm_eps.is_finite() && raw.rms_norm_eps > 0.0) {
            return Err(bad(
                path,
                "rms_norm_eps",
                raw.rms_norm_eps,
                "must be finite and > 0",
            ));
        }
        if !(raw.query_pre_attn_scalar.is_finite() && raw.query_pre_attn_scalar > 0.0) {
            return Err(bad(
                path,
                "query_pre_attn_scalar",
                raw.query_pre_attn_scalar,
                "must be finite and > 0",
            ));
        }
        let sliding = layer_kinds(&raw, path)?;
        let sliding_window = match v.get("sliding_window") {
            None => Some(4096),
            Some(Value::Null) => None,
            Some(x) => Some(
                x.as_u64()
                    .filter(|&w| w >= 1 && w <= u32::MAX as u64)
                    .ok_or_else(|| {
                        bad(
                            path,
                            "sliding_window",
                            x,
                            "must be a positive integer or null",
                        )
                    })? as usize,
            ),
        }
        .filter(|&w| w < raw.max_position_embeddings);
        let (rope_local, rope_global) = ropes(&v, path)?;
        for (field, r) in [("rope_local", &rope_local), ("rope_global", &rope_global)] {
            if r.partial_rotary_factor != 1.0 {
                return Err(bad(
                    path,
                    "partial_rotary_factor",
                    r.partial_rotary_factor,
                    format!("{field}: gemma3 rotates whole heads"),
                ));
            }
        }
        Ok(Self {
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_hidden_layers: raw.num_hidden_layers,
            num_attention_heads: raw.num_attention_heads,
            num_key_value_heads: raw.num_key_value_heads,
            head_dim: raw.head_dim,
            vocab_size: raw.vocab_size,
            max_position_embeddings: raw.max_position_embeddings,
            rms_norm_eps: raw.rms_norm_eps,
            query_pre_attn_scalar: raw.query_pre_attn_scalar,
            tie_word_embeddings: raw.tie_word_embeddings,
            attention_bias: raw.attention_bias,
            sliding,
            sliding_window,
            rope_local,
            rope_global,
            bos_token_id: raw.bos_token_id,
            eos_token_ids: hf_config::eos_token_ids(&v, path, generation_config)?,
        })
    }

    /// The attention scale `query_pre_attn_scalar^(−1/2)`, rounded to f32
    /// once (transformers multiplies f32 scores by this Python float).
    pub fn attn_scale(&self) -> f32 {
        (1.0 / self.query_pre_attn_scalar.sqrt()) as f32
    }

    /// The canonical text the config digest is taken over (see
    /// [`crate::identity`]): every field that changes the arithmetic.
    pub fn config_text(&self) -> String {
        let mut t = String::from("lmrr-config-v1\nfamily=gemma3_text\n");
        let mut line = |k: &str, v: &dyn std::fmt::Display| {
            // Writing to a String cannot fail.
            let _ = writeln!(t, "{k}={v}");
        };
        let f64b = |x: f64| format!("f64:{:016x}", x.to_bits());
        line("hidden_size", &self.hidden_size);
        line("intermediate_size", &self.intermediate_size);
        line("num_hidden_layers", &self.num_hidden_layers);
        line("num_attention_heads", &self.num_attention_heads);
        line("num_key_value_heads", &self.num_key_value_heads);
        line("head_dim", &self.head_dim);
        line("vocab_size", &self.vocab_size);
        line("max_position_embeddings", &self.max_position_embeddings);
        line(
            "rms_norm_eps",
            &format_args!("f32:{:08x}", self.rms_norm_eps.to_bits()),
        );
        line("query_pre_attn_scalar", &f64b(self.query_pre_attn_scalar));
        line("tie_word_embeddings", &self.tie_word_embeddings);
        line("attention_bias", &self.attention_bias);
        line("hidden_activation", &"gelu_pytorch_tanh");
        let kinds: String = self
            .sliding
            .iter()
            .map(|&s| if s { 'S' } else { 'F' })
            .collect();
        line("layer_kinds", &kinds);
        line(
            "sliding_window",
            &self.sliding_window.map_or("none".into(), |w| w.to_string()),
        );
        for (name, r) in [("local", &self.rope_local), ("global", &self.rope_global)] {
            line(&format!("rope_{name}_theta"), &f64b(r.theta));
            for l in r.scaling_text().lines() {
                line(&format!("rope_{name}"), &l);
            }
        }
        line(
            "bos_token_id",
            &self.bos_token_id.map_or("none".into(), |b| b.to_string()),
        );
        line("eos_token_ids", &format_args!("{:?}", self.eos_token_ids));
        t
    }

    /// Whether `id` ends generation.
    pub fn is_eos(&self, id: u32) -> bool {
        self.eos_token_ids.contains(&id)
    }

    /// The EOS ids as [`TokenIds`].
    pub fn eos(&self) -> TokenIds {
        TokenIds::Many(self.eos_token_ids.clone())
    }
}

/// Per layer, whether it is a sliding one.
fn layer_kinds(raw: &Raw, path: &Path) -> Result<Vec<bool>, EngineError> {
    let n = raw.num_hidden_layers;
    if let Some(types) = &raw.layer_types {
        if types.len() != n {
            return Err(bad(
                path,
                "layer_types",
                types.len(),
                format!("entries, one per layer of num_hidden_layers = {n}"),
            ));
        }
        return types
            .iter()
            .map(|t| match t.as_str() {
                "sliding_attention" => Ok(true),
                "full_attention" => Ok(false),
                other => Err(bad(
                    path,
                    "layer_types",
                    other,
                    "neither sliding_attention nor full_attention",
                )),
            })
            .collect();
    }
    let pattern = raw.sliding_window_pattern.unwrap_or(6);
    if pattern == 0 {
        return Err(bad(path, "sliding_window_pattern", 0, "must be > 0"));
    }
    Ok((0..n).map(|i| (i + 1) % pattern != 0).collect())
}

/// The RoPE of the sliding layers and of the global ones.
fn ropes(v: &Value, path: &Path) -> Result<(RopeParams, RopeParams), EngineError> {
    let nested = v
        .get("rope_parameters")
        .and_then(Value::as_object)
        .is_some_and(|o| o.contains_key("sliding_attention") || o.contains_key("full_attention"));
    if nested {
        // The nested objects carry their own bases; a top-level `rope_theta`
        // beside them is transformers' legacy copy of the global one.
        let mut inner = v.clone();
        if let Some(o) = inner.as_object_mut() {
            o.remove("rope_theta");
            o.remove("rope_scaling");
        }
        let local = RopeParams::for_layer_type(&inner, path, "sliding_attention", 10_000.0)?;
        let global = RopeParams::for_layer_type(&inner, path, "full_attention", 1_000_000.0)?;
        return Ok((local, global));
    }
    let global = RopeParams::from_config(v, path, 1_000_000.0)?;
    let local_theta = match v.get("rope_local_base_freq").filter(|x| !x.is_null()) {
        None => 10_000.0,
        Some(x) => x
            .as_f64()
            .ok_or_else(|| bad(path, "rope_local_base_freq", x, "must be a number"))?,
    };
    let local = RopeParams::from_config(
        &serde_json::json!({ "rope_theta": local_theta }),
        path,
        10_000.0,
    )?;
    Ok((local, global))
}
