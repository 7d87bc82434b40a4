//! `config.json` of the HF family `deepseek_v3`: parsing and validation.
//!
//! DeepSeek-V3 as transformers defines it (`DeepseekV3Config`): Multi-head
//! Latent Attention (`q_lora_rank`, or a plain `q_proj` when it is null;
//! `kv_lora_rank`, `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`;
//! `rope_interleave`), RoPE of `qk_rope_head_dim` dimensions with YaRN
//! scaling (its `mscale_all_dim` folded into the softmax scale), the first
//! `first_k_dense_replace` layers with a dense SwiGLU MLP and the rest a
//! mixture of `n_routed_experts` experts (sigmoid scores, group-limited top-k
//! with `e_score_correction_bias`, `norm_topk_prob`, `routed_scaling_factor`)
//! plus `n_shared_experts` shared experts as one MLP.
//!
//! Invariant: a field that changes the arithmetic is implemented exactly or
//! refused by name with its value (`attention_bias`, an activation other than
//! SiLU, a RoPE object this family does not read); inconsistent dimensions
//! (a group count that does not split the experts, a zero width) are refused
//! with the numbers. The multi-token-prediction layers
//! (`num_nextn_predict_layers`) are not part of the forward pass and are
//! not read.

use std::fmt::Write as _;
use std::path::Path;

use lmrr_kernels::{GroupTopK, RopeTable};
use serde::Deserialize;
use serde_json::Value;

use crate::hf_config::{self, RopeParams};
use crate::model::exec::MlaShape;
use crate::{EngineError, ModelFiles};

#[derive(Deserialize)]
struct Raw {
    model_type: String,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    moe_intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    #[serde(default)]
    num_key_value_heads: Option<usize>,
    #[serde(default)]
    hidden_act: Option<String>,
    max_position_embeddings: usize,
    rms_norm_eps: f32,
    #[serde(default)]
    tie_word_embeddings: bool,
    kv_lora_rank: usize,
    qk_nope_head_dim: usize,
    qk_rope_head_dim: usize,
    v_head_dim: usize,
    #[serde(default)]
    rope_interleave: Option<bool>,
    n_routed_experts: usize,
    #[serde(default)]
    n_shared_experts: Option<usize>,
    num_experts_per_tok: usize,
    #[serde(default)]
    n_group: Option<usize>,
    #[serde(default)]
    topk_group: Option<usize>,
    #[serde(default)]
    first_k_dense_replace: Option<usize>,
    #[serde(default)]
    norm_topk_prob: Option<bool>,
    #[serde(default)]
    routed_scaling_factor: Option<f32>,
    #[serde(default)]
    bos_token_id: Option<u32>,
}

/// A validated `deepseek_v3` config.
#[derive(Debug, Clone)]
pub struct DeepseekV3Config {
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// The dense layers' MLP width.
    pub intermediate_size: usize,
    /// One routed expert's width (the shared MLP is `n_shared_experts` times it).
    pub moe_intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f32,
    pub tie_word_embeddings: bool,
    /// `None`: q comes from one `q_proj`.
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    /// RoPE pairs are adjacent elements `(2i, 2i+1)` (DeepSeek's layout),
    /// not halves.
    pub rope_interleave: bool,
    pub n_routed_experts: usize,
    pub n_shared_experts: usize,
    pub num_experts_per_tok: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub first_k_dense_replace: usize,
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f32,
    pub rope: RopeParams,
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

impl DeepseekV3Config {
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
        if raw.model_type != "deepseek_v3" {
            return Err(bad(
                path,
                "model_type",
                &raw.model_type,
                "expected deepseek_v3",
            ));
        }
        hf_config::refuse_unimplemented(&v, path, &[])?;
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
                "deepseek_v3 rotates all qk_rope_head_dim dimensions",
            ));
        }
        let heads = raw.num_attention_heads;
        // MLA has no separate K/V heads: every head reads the one latent.
        // transformers' num_key_value_heads only repeats its decompressed
        // K/V, which already has a row per head.
        if let Some(kvh) = raw.num_key_value_heads {
            if kvh == 0 || !heads.is_multiple_of(kvh) {
                return Err(bad(
                    path,
                    "num_key_value_heads",
                    kvh,
                    format!("must divide num_attention_heads = {heads}"),
                ));
            }
        }
        for (field, x) in [
            ("vocab_size", raw.vocab_size),
            ("hidden_size", raw.hidden_size),
            ("intermediate_size", raw.intermediate_size),
            ("moe_intermediate_size", raw.moe_intermediate_size),
            ("num_hidden_layers", raw.num_hidden_layers),
            ("num_attention_heads", heads),
            ("max_position_embeddings", raw.max_position_embeddings),
            ("kv_lora_rank", raw.kv_lora_rank),
            ("qk_nope_head_dim", raw.qk_nope_head_dim),
            ("qk_rope_head_dim", raw.qk_rope_head_dim),
            ("v_head_dim", raw.v_head_dim),
        ] {
            if x == 0 {
                return Err(bad(path, "dimension", field, "must be positive"));
            }
        }
        if !raw.qk_rope_head_dim.is_multiple_of(2) {
            return Err(bad(
                path,
                "qk_rope_head_dim",
                raw.qk_rope_head_dim,
                "RoPE needs an even dimension",
            ));
        }
        // Absent fields take transformers' defaults (`DeepseekV3Config`);
        // `q_lora_rank: null` means a plain `q_proj`.
        let q_lora_rank = match v.get("q_lora_rank") {
            None => Some(1536),
            Some(Value::Null) => None,
            Some(x) => Some(
                x.as_u64()
                    .and_then(|r| usize::try_from(r).ok())
                    .filter(|&r| r > 0)
                    .ok_or_else(|| {
                        bad(path, "q_lora_rank", x, "must be a positive integer or null")
                    })?,
            ),
        };
        let first_k = raw.first_k_dense_replace.unwrap_or(3);
        let n_group = raw.n_group.unwrap_or(8);
        let topk_group = raw.topk_group.unwrap_or(4);
        let cfg = Self {
            vocab_size: raw.vocab_size,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            moe_intermediate_size: raw.moe_intermediate_size,
            num_hidden_layers: raw.num_hidden_layers,
            num_attention_heads: heads,
            max_position_embeddings: raw.max_position_embeddings,
            rms_norm_eps: raw.rms_norm_eps,
            tie_word_embeddings: raw.tie_word_embeddings,
            q_lora_rank,
            kv_lora_rank: raw.kv_lora_rank,
            qk_nope_head_dim: raw.qk_nope_head_dim,
            qk_rope_head_dim: raw.qk_rope_head_dim,
            v_head_dim: raw.v_head_dim,
            rope_interleave: raw.rope_interleave.unwrap_or(true),
            n_routed_experts: raw.n_routed_experts,
            n_shared_experts: raw.n_shared_experts.unwrap_or(1),
            num_experts_per_tok: raw.num_experts_per_tok,
            n_group,
            topk_group,
            first_k_dense_replace: first_k,
            norm_topk_prob: raw.norm_topk_prob.unwrap_or(true),
            routed_scaling_factor: raw.routed_scaling_factor.unwrap_or(2.5),
            rope,
            bos_token_id: raw.bos_token_id,
            eos_token_ids: hf_config::eos_token_ids(
                &v,
                path,
                files
                    .generation_config
                    .as_ref()
                    .map(|(b, p)| (&b[..], p.as_path())),
            )?,
        };
        if cfg.has_moe() {
            cfg.routing_shape()
                .check(cfg.n_routed_experts)
                .map_err(|why| bad(path, "n_group", n_group, why))?;
        }
        if !cfg.routed_scaling_factor.is_finite() {
            return Err(bad(
                path,
                "routed_scaling_factor",
                cfg.routed_scaling_factor,
                "must be finite",
            ));
        }
        Ok(cfg)
    }

    /// Whether layer `i` is a mixture of experts (transformers:
    /// `layer_idx >= first_k_dense_replace`).
    pub fn is_moe(&self, i: usize) -> bool {
        i >= self.first_k_dense_replace
    }

    /// Whether any layer is a mixture of experts.
    pub fn has_moe(&self) -> bool {
        self.first_k_dense_replace < self.num_hidden_layers
    }

    /// The routing of the MoE layers.
    pub fn routing_shape(&self) -> GroupTopK {
        GroupTopK {
            k: self.num_experts_per_tok,
            n_group: self.n_group,
            topk_group: self.topk_group,
            norm_topk_prob: self.norm_topk_prob,
            routed_scaling_factor: self.routed_scaling_factor,
        }
    }

    /// Width of a query/key head: `qk_nope_head_dim + qk_rope_head_dim`.
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// The softmax scale: `qk_head_dim^(−1/2)` times YaRN's `mscale²` where
    /// `mscale_all_dim` is set (transformers' `yarn_apply_mscale`), in f64,
    /// rounded once to f32.
    pub fn softmax_scale(&self) -> f32 {
        ((self.qk_head_dim() as f64).powf(-0.5) * self.rope.yarn_softmax_mscale()) as f32
    }

    /// The RoPE table of the rotated part of a head, every position of the
    /// context.
    pub fn rope_table(&self) -> RopeTable {
        self.rope
            .table(self.qk_rope_head_dim, self.max_position_embeddings)
    }

    /// The attention's shape.
    pub fn mla_shape(&self) -> MlaShape {
        MlaShape {
            heads: self.num_attention_heads,
            nope: self.qk_nope_head_dim,
            rope: self.qk_rope_head_dim,
            v: self.v_head_dim,
            latent: self.kv_lora_rank,
            interleave: self.rope_interleave,
        }
    }

    /// The canonical `key=value` text of every field that changes the
    /// arithmetic (floats as their bits), for the model identity.
    pub fn config_text(&self) -> String {
        let mut t = "lmrr-config-v1\nfamily=deepseek_v3\n".to_string();
        let mut line = |k: &str, v: &dyn std::fmt::Display| {
            // Writing to a String cannot fail.
            let _ = writeln!(t, "{k}={v}");
        };
        line("hidden_size", &self.hidden_size);
        line("intermediate_size", &self.intermediate_size);
        line("moe_intermediate_size", &self.moe_intermediate_size);
        line("num_hidden_layers", &self.num_hidden_layers);
        line("num_attention_heads", &self.num_attention_heads);
        super::attention::config_lines(&mut line, self.q_lora_rank, &self.mla_shape());
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
        line("n_routed_experts", &self.n_routed_experts);
        line("n_shared_experts", &self.n_shared_experts);
        line("num_experts_per_tok", &self.num_experts_per_tok);
        line("n_group", &self.n_group);
        line("topk_group", &self.topk_group);
        line("first_k_dense_replace", &self.first_k_dense_replace);
        line("norm_topk_prob", &self.norm_topk_prob);
        line(
            "routed_scaling_factor",
            &format_args!("f32:{:08x}", self.routed_scaling_factor.to_bits()),
        );
        line(
            "bos_token_id",
            &self.bos_token_id.map_or("none".into(), |b| b.to_string()),
        );
        line("eos_token_ids", &format_args!("{:?}", self.eos_token_ids));
        t
    }
}
