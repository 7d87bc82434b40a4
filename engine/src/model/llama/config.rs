//! `config.json` of the HF llama family: parsing and validation.
//!
//! Unknown fields are ignored (real configs carry many); fields that would
//! change the arithmetic and that this engine does not implement (attention/MLP
//! biases, an activation other than SiLU, logit soft-capping, a partial rotary
//! factor, sliding-window layers, an unknown RoPE type) are refused by name,
//! through the checks every HF family shares ([`crate::hf_config`]).
//!
//! RoPE is read in either spelling (`rope_theta` + `rope_scaling`, or
//! `rope_parameters`) and stored resolved: `rope_theta` holds the base and
//! `rope_scaling` the scaling object with every value written out
//! ([`RopeParams::scaling_json`]), so the config text and digest see the whole
//! arithmetic. [`LlamaConfig::load`] also merges `generation_config.json`'s
//! EOS ids into `eos_token_id`.

use std::path::Path;

use lmrr_kernels::RopeTable;

use serde::{Deserialize, Serialize};

use crate::hf_config::{self, RopeParams};
use crate::{EngineError, ModelFiles};

/// `eos_token_id` is an integer or a list in the wild.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TokenIds {
    One(u32),
    Many(Vec<u32>),
}

impl TokenIds {
    /// The ids, sorted and deduplicated (for canonical config texts).
    pub fn canonical(ids: Option<&Self>) -> Vec<u32> {
        let mut v = match ids {
            None => Vec::new(),
            Some(Self::One(x)) => vec![*x],
            Some(Self::Many(v)) => v.clone(),
        };
        v.sort_unstable();
        v.dedup();
        v
    }

    pub fn contains(&self, id: u32) -> bool {
        match self {
            Self::One(x) => *x == id,
            Self::Many(v) => v.contains(&id),
        }
    }
}

fn default_theta() -> f64 {
    10_000.0
}
fn default_eps() -> f32 {
    1e-6
}
fn default_act() -> String {
    "silu".into()
}
fn default_model_type() -> String {
    "llama".into()
}

/// The subset of HF `LlamaConfig` this engine reads.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LlamaConfig {
    #[serde(default)]
    pub architectures: Vec<String>,
    #[serde(default = "default_model_type")]
    pub model_type: String,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    #[serde(default)]
    pub head_dim: Option<usize>,
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f32,
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default = "default_act")]
    pub hidden_act: String,
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    #[serde(default)]
    pub eos_token_id: Option<TokenIds>,
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub mlp_bias: bool,
    #[serde(default)]
    pub torch_dtype: Option<String>,
}

/// Largest dimension accepted from a config (guards allocation sizes).
pub(crate) const MAX_DIM: usize = 1 << 20;

/// Parses a `config.json` read from `path` (fields not validated yet).
pub(crate) fn parse_json<T: serde::de::DeserializeOwned>(
    bytes: &[u8],
    path: &Path,
) -> Result<T, EngineError> {
    serde_json::from_slice(bytes).map_err(|e| EngineError::Config {
        path: path.into(),
        msg: e.to_string(),
    })
}

/// Refuses the first dimension outside `1..=MAX_DIM`, naming it.
pub(crate) fn check_dims(path: &Path, dims: &[(&'static str, usize)]) -> Result<(), EngineError> {
    match dims.iter().find(|(_, v)| *v == 0 || *v > MAX_DIM) {
        Some(&(field, v)) => Err(EngineError::ConfigValue {
            path: path.into(),
            field,
            value: v.to_string(),
            why: format!("must be in 1..={MAX_DIM}"),
        }),
        None => Ok(()),
    }
}

impl LlamaConfig {
    /// Parses and validates `bytes` read from `path`. A RoPE scaling other
    /// than the default is refused here: it is accepted by [`Self::load`],
    /// whose caller builds the table with [`Self::rope_table`].
    pub fn parse(bytes: &[u8], path: &Path) -> Result<Self, EngineError> {
        let cfg = Self::parse_any_rope(bytes, path)?;
        if let Some(s) = &cfg.rope_scaling {
            return Err(EngineError::ConfigValue {
                path: path.into(),
                field: "rope_scaling",
                value: s.to_string(),
                why: "this loader builds the unscaled RoPE table only".into(),
            });
        }
        Ok(cfg)
    }

    /// The config of a model's files: `config.json` parsed and validated
    /// (every implemented RoPE type accepted), with the EOS ids of
    /// `generation_config.json` merged in.
    pub fn load(files: &ModelFiles) -> Result<Self, EngineError> {
        let mut cfg = Self::parse_any_rope(&files.config, &files.config_path)?;
        let v: serde_json::Value = parse_json(&files.config, &files.config_path)?;
        let eos = hf_config::eos_token_ids(
            &v,
            &files.config_path,
            files
                .generation_config
                .as_ref()
                .map(|(b, p)| (&b[..], p.as_path())),
        )?;
        if eos != TokenIds::canonical(cfg.eos_token_id.as_ref()) {
            cfg.eos_token_id = Some(TokenIds::Many(eos));
        }
        Ok(cfg)
    }

    fn parse_any_rope(bytes: &[u8], path: &Path) -> Result<Self, EngineError> {
        let v: serde_json::Value = parse_json(bytes, path)?;
        let mut cfg: Self = serde_json::from_value(v.clone()).map_err(|e| EngineError::Config {
            path: path.into(),
            msg: e.to_string(),
        })?;
        if cfg.model_type == "llama" {
            hf_config::refuse_unimplemented(&v, path, &[])?;
        }
        let rope = RopeParams::from_config(&v, path, default_theta())?;
        if rope.partial_rotary_factor != 1.0 {
            return Err(EngineError::ConfigValue {
                path: path.into(),
                field: "partial_rotary_factor",
                value: rope.partial_rotary_factor.to_string(),
                why: "the llama family rotates whole heads".into(),
            });
        }
        cfg.rope_theta = rope.theta;
        cfg.rope_scaling = rope.scaling_json();
        cfg.validate(path)?;
        Ok(cfg)
    }

    /// The RoPE parameters (base and scaling) this config stands for.
    pub fn rope_params(&self) -> Result<RopeParams, EngineError> {
        let v = serde_json::json!({
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
        });
        RopeParams::from_config(&v, Path::new("config.json"), default_theta())
    }

    /// The RoPE table of this config for every position of its context.
    pub fn rope_table(&self) -> Result<RopeTable, EngineError> {
        Ok(self
            .rope_params()?
            .table(self.head_dim(), self.max_position_embeddings))
    }

    fn validate(&self, path: &Path) -> Result<(), EngineError> {
        let bad = |field: &'static str, value: String, why: &str| EngineError::ConfigValue {
            path: path.into(),
            field,
            value,
            why: why.into(),
        };
        if !super::variant::MODEL_TYPES.contains(&self.model_type.as_str()) {
            return Err(bad(
                "model_type",
                self.model_type.clone(),
                &format!(
                    "not a model type of the llama folder ({})",
                    super::variant::MODEL_TYPES.join(", ")
                ),
            ));
        }
        check_dims(
            path,
            &[
                ("hidden_size", self.hidden_size),
                ("intermediate_size", self.intermediate_size),
                ("num_hidden_layers", self.num_hidden_layers),
                ("num_attention_heads", self.num_attention_heads),
                ("vocab_size", self.vocab_size),
                ("max_position_embeddings", self.max_position_embeddings),
            ],
        )?;
        let kv = self.n_kv_heads();
        if kv == 0 || !self.num_attention_heads.is_multiple_of(kv) {
            return Err(bad(
                "num_key_value_heads",
                kv.to_string(),
                &format!(
                    "must divide num_attention_heads = {}",
                    self.num_attention_heads
                ),
            ));
        }
        if self.head_dim.is_none() && !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return Err(bad(
                "hidden_size",
                self.hidden_size.to_string(),
                &format!(
                    "not divisible by num_attention_heads = {}",
                    self.num_attention_heads
                ),
            ));
        }
        let hd = self.head_dim();
        if hd == 0 || !hd.is_multiple_of(2) || hd > 4096 {
            return Err(bad("head_dim", hd.to_string(), "must be even, in 2..=4096"));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(bad(
                "rms_norm_eps",
                self.rms_norm_eps.to_string(),
                "must be finite and > 0",
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 1.0) {
            return Err(bad(
                "rope_theta",
                self.rope_theta.to_string(),
                "must be finite and > 1",
            ));
        }
        if self.hidden_act != "silu" {
            return Err(bad(
                "hidden_act",
                self.hidden_act.clone(),
                "only silu is supported",
            ));
        }
        Ok(())
    }

    pub fn n_kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// Whether `id` ends generation.
    pub fn is_eos(&self, id: u32) -> bool {
        self.eos_token_id.as_ref().is_some_and(|e| e.contains(id))
    }
}
