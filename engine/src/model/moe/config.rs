//! `config.json` of the HF MoE families `mixtral` and `qwen3_moe`: parsing
//! and validation.
//!
//! Both are llama-shaped decoders (GQA, RoPE, RMSNorm, SwiGLU) whose MLP is
//! a mixture of experts with softmax top-k routing; qwen3_moe adds per-head
//! q/k RMSNorm, optional renormalisation of the top-k (`norm_topk_prob`,
//! mixtral always renormalises) and dense layers (`mlp_only_layers`, and
//! every layer `i` with `(i + 1) % decoder_sparse_step != 0`). Unknown fields
//! are ignored; fields that change the arithmetic and are not implemented
//! (biases, sliding windows, an activation other than SiLU, an unknown RoPE
//! type) are refused by name ([`crate::hf_config`]).

use std::fmt::Write as _;
use std::path::Path;

use lmrr_kernels::RopeTable;
use serde::Deserialize;
use serde_json::Value;

use crate::hf_config::{self, RopeParams};
use crate::{EngineError, ModelFiles};

/// Which of the two families.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoeKind {
    Mixtral,
    Qwen3Moe,
}

#[derive(Deserialize)]
struct Raw {
    model_type: String,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    #[serde(default)]
    num_key_value_heads: Option<usize>,
    #[serde(default)]
    head_dim: Option<usize>,
    #[serde(default)]
    hidden_act: Option<String>,
    max_position_embeddings: usize,
    rms_norm_eps: f32,
    #[serde(default)]
    tie_word_embeddings: bool,
    #[serde(default)]
    sliding_window: Option<usize>,
    #[serde(default)]
    num_local_experts: Option<usize>,
    #[serde(default)]
    num_experts: Option<usize>,
    num_experts_per_tok: usize,
    #[serde(default)]
    moe_intermediate_size: Option<usize>,
    #[serde(default)]
    decoder_sparse_step: Option<usize>,
    #[serde(default)]
    mlp_only_layers: Option<Vec<usize>>,
    #[serde(default)]
    norm_topk_prob: Option<bool>,
    #[serde(default)]
    bos_token_id: Option<u32>,
}

/// A validated config of either family.
#[derive(Debug, Clone)]
pub struct MoeConfig {
    pub kind: MoeKind,
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// The dense MLP's width (qwen3_moe's dense layers).
    pub intermediate_size: usize,
    /// One routed expert's width.
    pub expert_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f32,
    pub tie_word_embeddings: bool,
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub norm_topk_prob: bool,
    /// Per layer: whether its MLP is the mixture of experts.
    pub sparse: Vec<bool>,
    pub rope: RopeParams,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

fn bad(path: &Path, field: &'static str, value: impl ToString, why: &str) -> EngineError {
    EngineError::ConfigValue {
        path: path.into(),
        field,
        value: value.to_string(),
        why: why.into(),
    }
}

impl MoeConfig {
    /// Parses and validates a model's `config.json`, with the EOS ids of its
    /// `generation_config.json` merged in.
    pub fn load(files: &ModelFiles) -> Result<Self, EngineError> {
        let path = &files.config_path;
        let v: Value = serde_json::from_slice(&files.config).map_err(|e| EngineError::Config {
            path: path.clone(),
            msg: e.to_string(),
        })?;
        let raw: Raw = serde_json::from_value(v.clone()).map_err(|e| EngineError::Config {
            path: path.clone(),
            msg: e.to_string(),
        })?;
        let kind = match raw.model_type.as_str() {
            "mixtral" => MoeKind::Mixtral,
            "qwen3_moe" => MoeKind::Qwen3Moe,
            other => {
                return Err(bad(
                    path,
                    "model_type",
                    other,
                    "expected mixtral or qwen3_moe",
                ))
            }
        };
        hf_config::refuse_unimplemented(&v, path, &[])?;
        if let Some(w) = raw.sliding_window {
            let used = kind == MoeKind::Mixtral && w < raw.max_position_embeddings;
            if used {
                return Err(bad(
                    path,
                    "sliding_window",
                    w,
                    "a sliding window shorter than the context is not implemented for mixtral",
                ));
            }
        }
        let act = raw.hidden_act.as_deref().unwrap_or("silu");
        if act != "silu" {
            return Err(bad(path, "hidden_act", act, "only silu is supported"));
        }
        let rope = RopeParams::from_config(&v, path, 10000.0)?;
        if rope.partial_rotary_factor != 1.0 {
            return Err(bad(
                path,
                "partial_rotary_factor",
                rope.partial_rotary_factor,
                "these families rotate whole heads",
            ));
        }
        let num_experts = match kind {
            MoeKind::Mixtral => raw.num_local_experts.or(raw.num_experts),
            MoeKind::Qwen3Moe => raw.num_experts.or(raw.num_local_experts),
        }
        .ok_or_else(|| {
            bad(
                path,
                "num_local_experts",
                "missing",
                "the expert count is required",
            )
        })?;
        let (expert_size, norm_topk_prob) = match kind {
            MoeKind::Mixtral => (raw.intermediate_size, true),
            MoeKind::Qwen3Moe => (
                raw.moe_intermediate_size.ok_or_else(|| {
                    bad(
                        path,
                        "moe_intermediate_size",
                        "missing",
                        "qwen3_moe needs it",
                    )
                })?,
                raw.norm_topk_prob.unwrap_or(false),
            ),
        };
        let step = raw.decoder_sparse_step.unwrap_or(1);
        let only = raw.mlp_only_layers.clone().unwrap_or_default();
        let sparse: Vec<bool> = (0..raw.num_hidden_layers)
            .map(|i| match kind {
                MoeKind::Mixtral => true,
                MoeKind::Qwen3Moe => {
                    !only.contains(&i) && num_experts > 0 && step > 0 && (i + 1) % step == 0
                }
            })
            .collect();
        let heads = raw.num_attention_heads;
        let kv_heads = raw.num_key_value_heads.unwrap_or(heads);
        let head_dim = raw
            .head_dim
            .unwrap_or(raw.hidden_size.checked_div(heads).unwrap_or(0));
        for (field, x) in [
            ("vocab_size", raw.vocab_size),
            ("hidden_size", raw.hidden_size),
            ("num_hidden_layers", raw.num_hidden_layers),
            ("num_attention_heads", heads),
            ("num_key_value_heads", kv_heads),
            ("head_dim", head_dim),
            ("max_position_embeddings", raw.max_position_embeddings),
            ("num_experts_per_tok", raw.num_experts_per_tok),
            ("expert intermediate size", expert_size),
        ] {
            if x == 0 {
                return Err(bad(path, "dimension", field, "must be positive"));
            }
        }
        if !heads.is_multiple_of(kv_heads) {
            return Err(bad(
                path,
                "num_key_value_heads",
                kv_heads,
                "must divide num_attention_heads",
            ));
        }
        if !head_dim.is_multiple_of(2) {
            return Err(bad(
                path,
                "head_dim",
                head_dim,
                "RoPE needs an even head_dim",
            ));
        }
        if sparse.iter().any(|&s| s) && raw.num_experts_per_tok > num_experts {
            return Err(bad(
                path,
                "num_experts_per_tok",
                raw.num_experts_per_tok,
                "more experts per token than experts",
            ));
        }
        let eos_token_ids = hf_config::eos_token_ids(
            &v,
            path,
            files
                .generation_config
                .as_ref()
                .map(|(b, p)| (&b[..], p.as_path())),
        )?;
        Ok(Self {
            kind,
            vocab_size: raw.vocab_size,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            expert_size,
            num_hidden_layers: raw.num_hidden_layers,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim,
            max_position_embeddings: raw.max_position_embeddings,
            rms_norm_eps: raw.rms_norm_eps,
            tie_word_embeddings: raw.tie_word_embeddings,
            num_experts,
            num_experts_per_tok: raw.num_experts_per_tok,
            norm_topk_prob,
            sparse,
            rope,
            bos_token_id: raw.bos_token_id,
            eos_token_ids,
        })
    }

    /// The `model_type` this config is of.
    pub fn model_type(&self) -> &'static str {
        match self.kind {
            MoeKind::Mixtral => "mixtral",
            MoeKind::Qwen3Moe => "qwen3_moe",
        }
    }

    /// The RoPE table for every position of the context.
    pub fn rope_table(&self) -> RopeTable {
        self.rope.table(self.head_dim, self.max_position_embeddings)
    }

    /// The canonical `key=value` text of every field that changes the
    /// arithmetic (floats as their bits), for the model identity.
    pub fn config_text(&self) -> String {
        let mut t = format!("lmrr-config-v1\nfamily={}\n", self.model_type());
        let mut line = |k: &str, v: &dyn std::fmt::Display| {
            // Writing to a String cannot fail.
            let _ = writeln!(t, "{k}={v}");
        };
        line("hidden_size", &self.hidden_size);
        line("intermediate_size", &self.intermediate_size);
        line("expert_intermediate_size", &self.expert_size);
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
        line(
            "rope_theta",
            &format_args!("f64:{:016x}", self.rope.theta.to_bits()),
        );
        line("rope_scaling", &self.rope.scaling_text().replace('\n', ";"));
        line("tie_word_embeddings", &self.tie_word_embeddings);
        line("num_experts", &self.num_experts);
        line("num_experts_per_tok", &self.num_experts_per_tok);
        line("norm_topk_prob", &self.norm_topk_prob);
        let sparse: Vec<usize> = (0..self.sparse.len()).filter(|&i| self.sparse[i]).collect();
        line("moe_layers", &format_args!("{sparse:?}"));
        line(
            "bos_token_id",
            &self.bos_token_id.map_or("none".into(), |b| b.to_string()),
        );
        line("eos_token_ids", &format_args!("{:?}", self.eos_token_ids));
        t
    }
}
