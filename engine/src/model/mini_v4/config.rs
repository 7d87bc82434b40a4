//! `config.json` of the mini-v4 family (`model_type = "mini-v4"`): parsing
//! and validation. Every inconsistent field is refused at load, naming the
//! field and both numbers.

use std::fmt::Write as _;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::config::{check_dims, parse_json, TokenIds};
use crate::model::exec::MlaShape;
use crate::EngineError;

fn default_model_type() -> String {
    "mini-v4".into()
}

fn yes() -> bool {
    true
}

/// The mini-v4 configuration (see `docs/MINI-V4.md` for each field's role).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MiniV4Config {
    #[serde(default)]
    pub architectures: Vec<String>,
    #[serde(default = "default_model_type")]
    pub model_type: String,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    /// The query's LoRA rank (`q_a_proj` → `q_a_layernorm` → `q_b_proj`),
    /// or null for a plain `q_proj`.
    #[serde(default)]
    pub q_lora_rank: Option<usize>,
    /// The compressed latent's width (what the KV store keeps, with the
    /// RoPE key and the indexer key).
    pub kv_lora_rank: usize,
    /// A head's query/key part without RoPE.
    pub qk_nope_head_dim: usize,
    /// The rotated part, its key shared by every head.
    pub qk_rope_head_dim: usize,
    /// A head's value width.
    pub v_head_dim: usize,
    /// RoPE pairs are adjacent elements (DeepSeek's layout); default true.
    #[serde(default = "yes")]
    pub rope_interleave: bool,
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f64,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    #[serde(default)]
    pub eos_token_id: Option<TokenIds>,
    #[serde(default)]
    pub torch_dtype: Option<String>,
    /// Residual streams (hyper-connections).
    pub hc_mult: usize,
    /// Sinkhorn–Knopp rounds projecting the residual mix.
    pub hc_sinkhorn_iters: usize,
    /// Routed experts per MoE layer.
    pub n_routed_experts: usize,
    /// Routed experts each token uses.
    pub num_experts_per_tok: usize,
    /// Shared experts (always used): 1.
    pub n_shared_experts: usize,
    /// Intermediate width of each expert.
    pub moe_intermediate_size: usize,
    /// Factor on the routed experts' gates after normalisation.
    pub routed_scaling_factor: f32,
    /// The first `n_hash_layers` layers route by a hash of the token id.
    pub n_hash_layers: usize,
    /// Indexer heads.
    pub index_n_heads: usize,
    /// Indexer head width (and indexer key width).
    pub index_head_dim: usize,
    /// Index blocks attention reads besides its local window.
    pub index_topk: usize,
    /// Positions per index block (a model constant, not the KV page size).
    pub index_block_size: usize,
    /// The last positions every query attends to, whatever the indexer chose.
    pub sliding_window: usize,
}

impl MiniV4Config {
    /// Parses and validates `bytes` read from `path`.
    pub fn parse(bytes: &[u8], path: &Path) -> Result<Self, EngineError> {
        let cfg: Self = parse_json(bytes, path)?;
        cfg.validate(path)?;
        Ok(cfg)
    }

    fn validate(&self, path: &Path) -> Result<(), EngineError> {
        let bad = |field: &'static str, value: String, why: String| EngineError::ConfigValue {
            path: path.into(),
            field,
            value,
            why,
        };
        if self.model_type != "mini-v4" {
            return Err(bad(
                "model_type",
                self.model_type.clone(),
                "a mini-v4 config has model_type \"mini-v4\"".into(),
            ));
        }
        check_dims(
            path,
            &[
                ("hidden_size", self.hidden_size),
                ("num_hidden_layers", self.num_hidden_layers),
                ("num_attention_heads", self.num_attention_heads),
                ("kv_lora_rank", self.kv_lora_rank),
                ("qk_nope_head_dim", self.qk_nope_head_dim),
                ("qk_rope_head_dim", self.qk_rope_head_dim),
                ("v_head_dim", self.v_head_dim),
                ("vocab_size", self.vocab_size),
                ("max_position_embeddings", self.max_position_embeddings),
                ("n_routed_experts", self.n_routed_experts),
                ("num_experts_per_tok", self.num_experts_per_tok),
                ("moe_intermediate_size", self.moe_intermediate_size),
                ("index_n_heads", self.index_n_heads),
                ("index_head_dim", self.index_head_dim),
                ("index_topk", self.index_topk),
                ("index_block_size", self.index_block_size),
                ("sliding_window", self.sliding_window),
            ],
        )?;
        if self.hc_mult == 0 || self.hc_mult > 16 {
            return Err(bad(
                "hc_mult",
                self.hc_mult.to_string(),
                "the number of residual streams must be in 1..=16".into(),
            ));
        }
        if self.hc_sinkhorn_iters == 0 || self.hc_sinkhorn_iters > 1000 {
            return Err(bad(
                "hc_sinkhorn_iters",
                self.hc_sinkhorn_iters.to_string(),
                "must be in 1..=1000".into(),
            ));
        }
        if self.num_experts_per_tok > self.n_routed_experts {
            return Err(bad(
                "num_experts_per_tok",
                self.num_experts_per_tok.to_string(),
                format!(
                    "top-k above the expert count: a token cannot use {} of n_routed_experts = {}",
                    self.num_experts_per_tok, self.n_routed_experts
                ),
            ));
        }
        if self.n_shared_experts != 1 {
            return Err(bad(
                "n_shared_experts",
                self.n_shared_experts.to_string(),
                "mini-v4 has exactly one shared expert".into(),
            ));
        }
        if self.n_hash_layers > self.num_hidden_layers {
            return Err(bad(
                "n_hash_layers",
                self.n_hash_layers.to_string(),
                format!(
                    "more hash-routed layers than num_hidden_layers = {}",
                    self.num_hidden_layers
                ),
            ));
        }
        if self.q_lora_rank == Some(0) {
            return Err(bad(
                "q_lora_rank",
                "0".into(),
                "a query LoRA rank must be at least 1 (null: a plain q_proj)".into(),
            ));
        }
        if !self.qk_rope_head_dim.is_multiple_of(2) || self.qk_rope_head_dim > 4096 {
            return Err(bad(
                "qk_rope_head_dim",
                self.qk_rope_head_dim.to_string(),
                "RoPE rotates pairs: must be even, in 2..=4096".into(),
            ));
        }
        if self.index_block_size > self.max_position_embeddings {
            return Err(bad(
                "index_block_size",
                self.index_block_size.to_string(),
                format!(
                    "larger than max_position_embeddings = {}",
                    self.max_position_embeddings
                ),
            ));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(bad(
                "rms_norm_eps",
                self.rms_norm_eps.to_string(),
                "must be finite and > 0".into(),
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 1.0) {
            return Err(bad(
                "rope_theta",
                self.rope_theta.to_string(),
                "must be finite and > 1".into(),
            ));
        }
        if !(self.routed_scaling_factor.is_finite() && self.routed_scaling_factor > 0.0) {
            return Err(bad(
                "routed_scaling_factor",
                self.routed_scaling_factor.to_string(),
                "must be finite and > 0".into(),
            ));
        }
        Ok(())
    }

    /// The attention's shape.
    pub fn mla(&self) -> MlaShape {
        MlaShape {
            heads: self.num_attention_heads,
            nope: self.qk_nope_head_dim,
            rope: self.qk_rope_head_dim,
            v: self.v_head_dim,
            latent: self.kv_lora_rank,
            interleave: self.rope_interleave,
        }
    }

    /// `1/√(qk_nope_head_dim + qk_rope_head_dim)` (no YaRN in mini-v4).
    pub fn softmax_scale(&self) -> f32 {
        ((self.qk_nope_head_dim + self.qk_rope_head_dim) as f64).powf(-0.5) as f32
    }

    /// Whether `id` ends generation.
    pub fn is_eos(&self, id: u32) -> bool {
        self.eos_token_id.as_ref().is_some_and(|e| e.contains(id))
    }

    /// The canonical text the config digest is taken over (see
    /// [`crate::identity`]).
    pub fn config_text(&self) -> String {
        let eos = TokenIds::canonical(self.eos_token_id.as_ref());
        let mut t = String::from("lmrr-config-v1\nfamily=mini-v4\nattention=mla\n");
        let mut line = |k: &str, v: &dyn std::fmt::Display| {
            // Writing to a String cannot fail.
            let _ = writeln!(t, "{k}={v}");
        };
        line("hidden_size", &self.hidden_size);
        line("num_hidden_layers", &self.num_hidden_layers);
        line("num_attention_heads", &self.num_attention_heads);
        crate::model::deepseek_v3::attention::config_lines(
            &mut line,
            self.q_lora_rank,
            &self.mla(),
        );
        line("vocab_size", &self.vocab_size);
        line("max_position_embeddings", &self.max_position_embeddings);
        line(
            "rms_norm_eps",
            &format_args!("f32:{:08x}", self.rms_norm_eps.to_bits()),
        );
        line(
            "rope_theta",
            &format_args!("f64:{:016x}", self.rope_theta.to_bits()),
        );
        line("tie_word_embeddings", &self.tie_word_embeddings);
        line("hc_mult", &self.hc_mult);
        line("hc_sinkhorn_iters", &self.hc_sinkhorn_iters);
        line("n_routed_experts", &self.n_routed_experts);
        line("num_experts_per_tok", &self.num_experts_per_tok);
        line("n_shared_experts", &self.n_shared_experts);
        line("moe_intermediate_size", &self.moe_intermediate_size);
        line(
            "routed_scaling_factor",
            &format_args!("f32:{:08x}", self.routed_scaling_factor.to_bits()),
        );
        line("n_hash_layers", &self.n_hash_layers);
        line("index_n_heads", &self.index_n_heads);
        line("index_head_dim", &self.index_head_dim);
        line("index_topk", &self.index_topk);
        line("index_block_size", &self.index_block_size);
        line("sliding_window", &self.sliding_window);
        line(
            "bos_token_id",
            &self.bos_token_id.map_or("none".into(), |b| b.to_string()),
        );
        line("eos_token_ids", &format_args!("{eos:?}"));
        t
    }
}
