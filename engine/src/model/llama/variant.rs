//! The llama family's variants: HF `model_type`s whose forward is llama's
//! with a few ops more, read from the same `config.json` fields.
//!
//! - `qwen2`: biases on the q, k and v projections (always: transformers'
//!   `Qwen2Attention` builds them whatever `attention_bias` says).
//! - `qwen3`: RMSNorm of each head's q and k before RoPE (`q_norm`,
//!   `k_norm`, weights of `head_dim`); `attention_bias` adds biases to q, k,
//!   v and o; `head_dim` defaults to 128 as in transformers' `Qwen3Config`.
//! - `mistral`: attention over the last `sliding_window` positions (4096
//!   when the field is absent, none when null, as in `MistralConfig`);
//!   `num_key_value_heads` defaults to 8.
//!
//! Invariant: every field that changes a variant's arithmetic is implemented
//! or refused by name ([`crate::hf_config::refuse_unimplemented`] with the
//! variant's list), and appears in the variant's config text.
//! Design source: issue 37 item 3; transformers' `modeling_qwen2.py`,
//! `modeling_qwen3.py`, `modeling_mistral.py`.

use std::fmt::Write;
use std::path::Path;

use serde_json::Value;

use crate::hf_config;
use crate::model::Family;
use crate::{EngineError, LlamaConfig};

/// The `model_type`s of the llama folder.
pub const MODEL_TYPES: [&str; 4] = ["llama", "qwen2", "qwen3", "mistral"];

/// What a variant adds to llama's step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Variant {
    pub family: Family,
    /// Biases on the q, k and v projections.
    pub qkv_bias: bool,
    /// A bias on the o projection.
    pub o_bias: bool,
    /// RMSNorm of each head's q and k before RoPE.
    pub qk_norm: bool,
    /// Attention over the last `window` positions; `None` when the window
    /// is absent or covers the whole context (the same arithmetic).
    pub window: Option<usize>,
}

fn bad(path: &Path, field: &'static str, value: impl ToString, why: &str) -> EngineError {
    EngineError::ConfigValue {
        path: path.into(),
        field,
        value: value.to_string(),
        why: why.into(),
    }
}

impl Variant {
    /// Plain llama.
    pub const LLAMA: Variant = Variant {
        family: Family::Llama,
        qkv_bias: false,
        o_bias: false,
        qk_norm: false,
        window: None,
    };

    /// The variant of `config.json` (`v`, read from `path`), after
    /// [`LlamaConfig`] parsed its common fields into `cfg`; fills the
    /// variant's defaults where transformers' differ from llama's.
    pub fn from_config(v: &Value, path: &Path, cfg: &mut LlamaConfig) -> Result<Self, EngineError> {
        let flag = |field: &'static str| -> Result<bool, EngineError> {
            match v.get(field) {
                None | Some(Value::Null) => Ok(false),
                Some(Value::Bool(b)) => Ok(*b),
                Some(x) => Err(bad(path, field, x, "must be true or false")),
            }
        };
        let absent = |field: &str| v.get(field).is_none();
        match cfg.model_type.as_str() {
            "llama" => Ok(Self::LLAMA),
            "qwen2" => {
                // `attention_bias` is not read by qwen2 (its q/k/v biases are fixed).
                hf_config::refuse_unimplemented(v, path, &["attention_bias"])?;
                Ok(Self {
                    family: Family::Qwen2,
                    qkv_bias: true,
                    ..Self::LLAMA
                })
            }
            "qwen3" => {
                hf_config::refuse_unimplemented(v, path, &["attention_bias"])?;
                if absent("head_dim") {
                    cfg.head_dim = Some(128);
                }
                let bias = flag("attention_bias")?;
                Ok(Self {
                    family: Family::Qwen3,
                    qkv_bias: bias,
                    o_bias: bias,
                    qk_norm: true,
                    window: None,
                })
            }
            "mistral" => {
                // `use_sliding_window` is not read by mistral: `sliding_window` is.
                hf_config::refuse_unimplemented(v, path, &["use_sliding_window"])?;
                if absent("num_key_value_heads") {
                    cfg.num_key_value_heads = Some(8);
                }
                let window = match v.get("sliding_window") {
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
                };
                Ok(Self {
                    family: Family::Mistral,
                    window: window.filter(|&w| w < cfg.max_position_embeddings),
                    ..Self::LLAMA
                })
            }
            other => Err(bad(
                path,
                "model_type",
                other,
                "not a model type of the llama folder",
            )),
        }
    }

    /// The variant's lines of the config text (after llama's): its family
    /// and every arithmetic switch, so two variants of one shape never share
    /// a config digest; empty for plain llama (its digest unchanged). The
    /// RoPE scaling is in llama's lines already.
    pub fn config_text(&self) -> String {
        if *self == Self::LLAMA {
            return String::new();
        }
        let mut t = String::new();
        // Writing to a String cannot fail.
        let _ = writeln!(t, "model_type={}", self.family.model_type());
        let _ = writeln!(t, "qkv_bias={}", self.qkv_bias);
        let _ = writeln!(t, "o_bias={}", self.o_bias);
        let _ = writeln!(t, "qk_norm={}", self.qk_norm);
        let _ = writeln!(
            t,
            "sliding_window={}",
            self.window.map_or("none".into(), |w| w.to_string())
        );
        t
    }
}
