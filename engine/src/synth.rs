//! Synthetic llama models with seeded weights (`lmrr gen-model`), the embedded
//! default and the test fixtures.
//!
//! Generator: each tensor gets its own SplitMix64 stream seeded with
//! `seed ⊕ fnv1a64(tensor name)`; element values are Irwin–Hall(4) draws — the
//! sum of four 24-bit uniforms, centred, computed in integers and scaled in f64
//! — so they are bit-identical on every platform (no libm). Scales:
//! `std = 1/√fan_in` for every projection, 1 for the embedding, norm weights
//! `1 + 0.1·noise`. Weights are stored bf16 (round to nearest even) or f32.
//! Same (preset, seed, dtype) → byte-identical files.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::config::{LlamaConfig, TokenIds};
use crate::{tokenizer, EngineError, ModelFiles};

/// Model shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Preset {
    /// About 1M parameters: for tests.
    Tiny,
    /// Shaped like SmolLM2-135M: for benchmarks.
    Small,
}

impl std::str::FromStr for Preset {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "tiny" => Ok(Self::Tiny),
            "small" => Ok(Self::Small),
            _ => Err(format!("unknown preset `{s}` (tiny, small)")),
        }
    }
}

impl std::fmt::Display for Preset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Tiny => "tiny",
            Self::Small => "small",
        })
    }
}

/// Storage dtype of generated weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SynthDtype {
    F32,
    Bf16,
}

/// What to generate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SynthSpec {
    pub preset: Preset,
    pub seed: u64,
    pub dtype: SynthDtype,
}

impl SynthSpec {
    pub fn new(preset: Preset, seed: u64) -> Self {
        Self {
            preset,
            seed,
            dtype: SynthDtype::Bf16,
        }
    }

    /// The embedded default model: tiny, seed 0, bf16.
    pub fn embedded_default() -> Self {
        Self::new(Preset::Tiny, 0)
    }

    /// A short name, e.g. `synthetic:tiny:seed0`.
    pub fn name(&self) -> String {
        format!("synthetic:{}:seed{}", self.preset, self.seed)
    }

    pub fn config(&self) -> LlamaConfig {
        let (hidden, ffn, layers, heads, kv, vocab, ctx) = match self.preset {
            Preset::Tiny => (128, 384, 4, 4, 2, 1024, 2048),
            Preset::Small => (576, 1536, 30, 9, 3, 49152, 8192),
        };
        LlamaConfig {
            architectures: vec!["LlamaForCausalLM".into()],
            model_type: "llama".into(),
            hidden_size: hidden,
            intermediate_size: ffn,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: Some(kv),
            head_dim: None,
            vocab_size: vocab,
            max_position_embeddings: ctx,
            rms_norm_eps: 1e-5,
            rope_theta: 100_000.0,
            tie_word_embeddings: false,
            hidden_act: "silu".into(),
            bos_token_id: Some(1),
            eos_token_id: Some(TokenIds::One(2)),
            rope_scaling: None,
            attention_bias: false,
            mlp_bias: false,
            torch_dtype: Some(match self.dtype {
                SynthDtype::F32 => "float32".into(),
                SynthDtype::Bf16 => "bfloat16".into(),
            }),
        }
    }

    /// Generates the three files in memory.
    pub fn build(&self) -> ModelFiles {
        let cfg = self.config();
        let config = serde_json::to_vec_pretty(&cfg).expect("config serialises");
        let tok = tokenizer::byte_level_json(cfg.vocab_size).into_bytes();
        let weights = self.weights(&cfg);
        ModelFiles::in_memory(&self.name(), config, tok, weights)
    }

    /// Writes the files to `dir` (created if needed).
    pub fn write_dir(&self, dir: &Path) -> Result<(), EngineError> {
        let files = self.build();
        std::fs::create_dir_all(dir).map_err(|source| EngineError::Io {
            path: dir.into(),
            source,
        })?;
        for (name, bytes) in [
            ("config.json", &files.config[..]),
            ("tokenizer.json", &files.tokenizer[..]),
            ("model.safetensors", files.weight_bytes()),
        ] {
            let p = dir.join(name);
            std::fs::write(&p, bytes).map_err(|source| EngineError::Io { path: p, source })?;
        }
        Ok(())
    }

    fn weights(&self, cfg: &LlamaConfig) -> Vec<u8> {
        let (d, f, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
        let hd = cfg.head_dim();
        let (qd, kvd) = (cfg.num_attention_heads * hd, cfg.n_kv_heads() * hd);
        // (name, shape, kind)
        let mut specs: Vec<(String, Vec<usize>, Init)> = vec![
            (
                "model.embed_tokens.weight".into(),
                vec![v, d],
                Init::Normal(EMBED_STD),
            ),
            ("model.norm.weight".into(), vec![d], Init::Norm),
            (
                "lm_head.weight".into(),
                vec![v, d],
                Init::Normal(1.0 / (d as f64).sqrt()),
            ),
        ];
        let proj = |fan_in: usize| Init::Normal(1.0 / (fan_in as f64).sqrt());
        for i in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            specs.extend([
                (format!("{p}.input_layernorm.weight"), vec![d], Init::Norm),
                (format!("{p}.self_attn.q_proj.weight"), vec![qd, d], proj(d)),
                (
                    format!("{p}.self_attn.k_proj.weight"),
                    vec![kvd, d],
                    proj(d),
                ),
                (
                    format!("{p}.self_attn.v_proj.weight"),
                    vec![kvd, d],
                    proj(d),
                ),
                (
                    format!("{p}.self_attn.o_proj.weight"),
                    vec![d, qd],
                    proj(qd),
                ),
                (
                    format!("{p}.post_attention_layernorm.weight"),
                    vec![d],
                    Init::Norm,
                ),
                (format!("{p}.mlp.gate_proj.weight"), vec![f, d], proj(d)),
                (format!("{p}.mlp.up_proj.weight"), vec![f, d], proj(d)),
                (format!("{p}.mlp.down_proj.weight"), vec![d, f], proj(f)),
            ]);
        }
        let (dtype, elem) = match self.dtype {
            SynthDtype::F32 => (safetensors::Dtype::F32, 4),
            SynthDtype::Bf16 => (safetensors::Dtype::BF16, 2),
        };
        let data: Vec<(String, Vec<usize>, Vec<u8>)> = specs
            .into_iter()
            .map(|(name, shape, init)| {
                let n: usize = shape.iter().product();
                let mut rng = SplitMix(self.seed ^ fnv1a64(name.as_bytes()));
                let mut bytes = Vec::with_capacity(n * elem);
                for _ in 0..n {
                    let x = init.draw(&mut rng);
                    match self.dtype {
                        SynthDtype::F32 => bytes.extend_from_slice(&x.to_le_bytes()),
                        SynthDtype::Bf16 => bytes.extend_from_slice(&f32_to_bf16(x).to_le_bytes()),
                    }
                }
                (name, shape, bytes)
            })
            .collect();
        let views: Vec<(String, safetensors::tensor::TensorView)> = data
            .iter()
            .map(|(name, shape, bytes)| {
                let view = safetensors::tensor::TensorView::new(dtype, shape.clone(), bytes)
                    .expect("generated tensor length matches its shape");
                (name.clone(), view)
            })
            .collect();
        safetensors::tensor::serialize(views, None).expect("serialising generated tensors")
    }
}

#[derive(Clone, Copy)]
enum Init {
    /// Irwin–Hall(4), scaled to this standard deviation.
    Normal(f64),
    /// `1 + 0.1·noise`.
    Norm,
}

impl Init {
    fn draw(self, rng: &mut SplitMix) -> f32 {
        // Sum of four 24-bit uniforms, centred: integer in [-2^25, 2^25].
        let s: i64 = (0..4).map(|_| (rng.next_u64() >> 40) as i64).sum::<i64>() - (2 << 24);
        // Irwin–Hall(4) of U[0,1) has variance 4/12; scale to unit variance.
        let unit = s as f64 / (1u64 << 24) as f64 * 3f64.sqrt();
        match self {
            Self::Normal(std) => (unit * std) as f32,
            Self::Norm => (1.0 + 0.1 * unit) as f32,
        }
    }
}

use lmrr_kernels::SplitMix64 as SplitMix;

fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// f32 → bf16, round to nearest even (NaN stays NaN).
pub fn f32_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) as u16
}

/// Embedding scale. Small against the layers' residual updates (std ≈ 1), so
/// the tied output head does not simply echo the current token's embedding —
/// with std 1, greedy decoding collapses into repeating the last token.
const EMBED_STD: f64 = 1.0;
