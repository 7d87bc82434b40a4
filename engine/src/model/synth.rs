//! Synthetic models with seeded weights (`lmrr gen-model`), of either family:
//! the embedded default and the test fixtures.
//!
//! Generator: each tensor gets its own SplitMix64 stream seeded with
//! `seed ⊕ fnv1a64(tensor name)`; element values are Irwin–Hall(4) draws — the
//! sum of four 24-bit uniforms, centred, computed in integers and scaled in f64
//! — so they are bit-identical on every platform (no libm). Scales:
//! `std = 1/√fan_in` for every projection, 1 for the embedding, norm weights
//! `1 + 0.1·noise`. Weights are stored bf16 (round to nearest even) or f32.
//! Same (preset, seed, dtype) → byte-identical files.
//!
//! mini-v4 presets add the hyper-connection projections (kept f32 whatever
//! the dtype, as the real model keeps its mixing weights fp32; std
//! `0.5/√fan_in`, residual-mix bias `+2` on the diagonal so the mix starts
//! near the identity), the indexer (`1/√fan_in`), the router (`1/√fan_in`)
//! and the experts (`1/√fan_in`).

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::config::{LlamaConfig, TokenIds};
use crate::mini_v4::MiniV4Config;
use crate::model::Family;
use crate::{tokenizer, EngineError, ModelFiles};

/// Model shapes.
/// (Variants are appended, never reordered: bundles record them by index.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Preset {
    /// llama, about 1M parameters: for tests.
    #[serde(rename = "tiny")]
    Tiny,
    /// llama shaped like SmolLM2-135M: for benchmarks.
    #[serde(rename = "small")]
    Small,
    /// mini-v4, about 3M parameters: for tests.
    #[serde(rename = "mini-v4-tiny")]
    MiniV4Tiny,
    /// mini-v4 with 64 routed experts: for benchmarks.
    #[serde(rename = "mini-v4-small")]
    MiniV4Small,
    /// llama at a 1.2B shape (hidden 2048, 16 layers, 32/8 heads, FFN
    /// 8192; `small`'s vocabulary): GPU benchmarks at the size of Llama 3.2
    /// 1B.
    #[serde(rename = "1b")]
    OneB,
    /// llama at a 7.4B shape (hidden 4096, 32 layers, 32/8 heads, FFN
    /// 14336; `small`'s vocabulary): GPU benchmarks at Llama 3 8B's size.
    #[serde(rename = "8b")]
    EightB,
}

impl Preset {
    pub const ALL: [Preset; 6] = [
        Preset::Tiny,
        Preset::Small,
        Preset::MiniV4Tiny,
        Preset::MiniV4Small,
        Preset::OneB,
        Preset::EightB,
    ];

    /// The preset's name (`tiny`, `mini-v4-small`, …).
    pub fn name(self) -> &'static str {
        match self {
            Self::Tiny => "tiny",
            Self::Small => "small",
            Self::MiniV4Tiny => "mini-v4-tiny",
            Self::MiniV4Small => "mini-v4-small",
            Self::OneB => "1b",
            Self::EightB => "8b",
        }
    }

    /// The model family it generates.
    pub fn family(self) -> Family {
        match self {
            Self::Tiny | Self::Small | Self::OneB | Self::EightB => Family::Llama,
            Self::MiniV4Tiny | Self::MiniV4Small => Family::MiniV4,
        }
    }

    /// The size (`tiny` or `small`) in `family`.
    pub fn of(family: Family, size: &str) -> Result<Self, String> {
        match (family, size) {
            (Family::Llama, "tiny") => Ok(Self::Tiny),
            (Family::Llama, "small") => Ok(Self::Small),
            (Family::Llama, "1b") => Ok(Self::OneB),
            (Family::Llama, "8b") => Ok(Self::EightB),
            (Family::MiniV4, "tiny") => Ok(Self::MiniV4Tiny),
            (Family::MiniV4, "small") => Ok(Self::MiniV4Small),
            _ => Err(format!(
                "unknown preset `{size}` (tiny, small; llama also 1b, 8b)"
            )),
        }
    }
}

impl std::str::FromStr for Preset {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                format!(
                    "unknown preset `{s}` ({})",
                    Self::ALL.map(|p| p.name()).join(", ")
                )
            })
    }
}

impl std::fmt::Display for Preset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
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

    /// The llama config of a llama preset (`None` for another family).
    pub fn llama_config(&self) -> Option<LlamaConfig> {
        let (hidden, ffn, layers, heads, kv, vocab, ctx) = match self.preset {
            Preset::Tiny => (128, 384, 4, 4, 2, 1024, 2048),
            Preset::Small => (576, 1536, 30, 9, 3, 49152, 8192),
            Preset::OneB => (2048, 8192, 16, 32, 8, 49152, 32768),
            Preset::EightB => (4096, 14336, 32, 32, 8, 49152, 32768),
            Preset::MiniV4Tiny | Preset::MiniV4Small => return None,
        };
        Some(LlamaConfig {
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
            torch_dtype: Some(self.torch_dtype().into()),
        })
    }

    fn torch_dtype(&self) -> &'static str {
        match self.dtype {
            SynthDtype::F32 => "float32",
            SynthDtype::Bf16 => "bfloat16",
        }
    }

    /// The mini-v4 config of a mini-v4 preset (`None` for another family).
    pub fn mini_v4_config(&self) -> Option<MiniV4Config> {
        // (hidden, layers, heads, vocab, context,
        //  experts, top-k, expert width, hash layers,
        //  indexer heads, indexer dim, top-k blocks, block, window)
        let p = match self.preset {
            Preset::MiniV4Tiny => (128, 4, 4, 1024, 4096, 8, 2, 128, 1, 2, 16, 4, 16, 16),
            Preset::MiniV4Small => (512, 8, 8, 32768, 8192, 64, 6, 256, 2, 4, 32, 16, 64, 64),
            Preset::Tiny | Preset::Small | Preset::OneB | Preset::EightB => return None,
        };
        // MLA: (q_lora_rank, kv_lora_rank, qk_nope, qk_rope, v) per head.
        let m = match self.preset {
            Preset::MiniV4Tiny => (64, 32, 32, 16, 32),
            _ => (192, 128, 64, 32, 64),
        };
        Some(MiniV4Config {
            architectures: vec!["MiniV4ForCausalLM".into()],
            model_type: "mini-v4".into(),
            hidden_size: p.0,
            num_hidden_layers: p.1,
            num_attention_heads: p.2,
            q_lora_rank: Some(m.0),
            kv_lora_rank: m.1,
            qk_nope_head_dim: m.2,
            qk_rope_head_dim: m.3,
            v_head_dim: m.4,
            rope_interleave: true,
            vocab_size: p.3,
            max_position_embeddings: p.4,
            rms_norm_eps: 1e-5,
            rope_theta: 100_000.0,
            tie_word_embeddings: false,
            bos_token_id: Some(1),
            eos_token_id: Some(TokenIds::One(2)),
            torch_dtype: Some(self.torch_dtype().into()),
            hc_mult: 4,
            hc_sinkhorn_iters: 20,
            n_routed_experts: p.5,
            num_experts_per_tok: p.6,
            n_shared_experts: 1,
            moe_intermediate_size: p.7,
            routed_scaling_factor: 2.5,
            n_hash_layers: p.8,
            index_n_heads: p.9,
            index_head_dim: p.10,
            index_topk: p.11,
            index_block_size: p.12,
            sliding_window: p.13,
        })
    }

    /// Generates the three files in memory.
    pub fn build(&self) -> ModelFiles {
        let (config, vocab, specs) = match (self.llama_config(), self.mini_v4_config()) {
            (Some(cfg), _) => (
                serde_json::to_vec_pretty(&cfg),
                cfg.vocab_size,
                llama_specs(&cfg),
            ),
            (None, Some(cfg)) => (
                serde_json::to_vec_pretty(&cfg),
                cfg.vocab_size,
                mini_v4_specs(&cfg),
            ),
            (None, None) => unreachable!("every preset has a family"),
        };
        let config = config.expect("config serialises");
        let tok = tokenizer::byte_level_json(vocab).into_bytes();
        let weights = self.weights(specs);
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

    /// Draws and serialises `specs`.
    fn weights(&self, specs: Vec<Spec>) -> Vec<u8> {
        let elem = |f32_always: bool| match (self.dtype, f32_always) {
            (SynthDtype::F32, _) | (_, true) => (safetensors::Dtype::F32, 4),
            (SynthDtype::Bf16, false) => (safetensors::Dtype::BF16, 2),
        };
        let data: Vec<(String, Vec<usize>, safetensors::Dtype, Vec<u8>)> = specs
            .into_iter()
            .map(|(name, shape, init)| {
                let n: usize = shape.iter().product();
                let (dtype, size) = elem(init.always_f32());
                let mut rng = SplitMix(self.seed ^ fnv1a64(name.as_bytes()));
                let mut bytes = Vec::with_capacity(n * size);
                for i in 0..n {
                    let x = init.draw(&mut rng, i);
                    match size {
                        4 => bytes.extend_from_slice(&x.to_le_bytes()),
                        _ => bytes.extend_from_slice(&f32_to_bf16(x).to_le_bytes()),
                    }
                }
                (name, shape, dtype, bytes)
            })
            .collect();
        let views: Vec<(String, safetensors::tensor::TensorView)> = data
            .iter()
            .map(|(name, shape, dtype, bytes)| {
                let view = safetensors::tensor::TensorView::new(*dtype, shape.clone(), bytes)
                    .expect("generated tensor length matches its shape");
                (name.clone(), view)
            })
            .collect();
        safetensors::tensor::serialize(views, None).expect("serialising generated tensors")
    }
}

/// A tensor to generate: name, shape, distribution.
type Spec = (String, Vec<usize>, Init);

fn llama_specs(cfg: &LlamaConfig) -> Vec<Spec> {
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
    specs
}

fn mini_v4_specs(cfg: &MiniV4Config) -> Vec<Spec> {
    let (d, v, h) = (cfg.hidden_size, cfg.vocab_size, cfg.hc_mult);
    let mla = cfg.mla();
    let (qr, lr) = (cfg.q_lora_rank.unwrap_or(0), mla.latent);
    let (ih, idim, e, f) = (
        cfg.index_n_heads,
        cfg.index_head_dim,
        cfg.n_routed_experts,
        cfg.moe_intermediate_size,
    );
    let hw = lmrr_kernels::hyper::hc_raw_width(h);
    let proj = |fan_in: usize| Init::Normal(1.0 / (fan_in as f64).sqrt());
    let mut specs: Vec<Spec> = vec![
        (
            "model.embed_tokens.weight".into(),
            vec![v, d],
            Init::Normal(EMBED_STD),
        ),
        ("model.norm.weight".into(), vec![d], Init::Norm),
        ("lm_head.weight".into(), vec![v, d], proj(d)),
    ];
    for i in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{i}");
        for hc in ["hc_attn", "hc_ffn"] {
            specs.extend([
                (format!("{p}.{hc}.norm.weight"), vec![h * d], Init::NormF32),
                (
                    format!("{p}.{hc}.proj.weight"),
                    vec![hw, h * d],
                    Init::MixF32(0.5 / ((h * d) as f64).sqrt()),
                ),
                (format!("{p}.{hc}.bias"), vec![hw], Init::HcBias(h)),
            ]);
        }
        specs.extend([
            (format!("{p}.input_layernorm.weight"), vec![d], Init::Norm),
            (
                format!("{p}.self_attn.q_a_proj.weight"),
                vec![qr, d],
                proj(d),
            ),
            (
                format!("{p}.self_attn.q_a_layernorm.weight"),
                vec![qr],
                Init::Norm,
            ),
            (
                format!("{p}.self_attn.q_b_proj.weight"),
                vec![mla.q_dim(), qr],
                proj(qr),
            ),
            (
                format!("{p}.self_attn.kv_a_proj_with_mqa.weight"),
                vec![mla.row(), d],
                proj(d),
            ),
            (
                format!("{p}.self_attn.kv_a_layernorm.weight"),
                vec![lr],
                Init::Norm,
            ),
            (
                format!("{p}.self_attn.kv_b_proj.weight"),
                vec![mla.heads * (mla.nope + mla.v), lr],
                proj(lr),
            ),
            (
                format!("{p}.self_attn.o_proj.weight"),
                vec![d, mla.out_dim()],
                proj(mla.out_dim()),
            ),
            (
                format!("{p}.self_attn.indexer.wq.weight"),
                vec![ih * idim, d],
                proj(d),
            ),
            (
                format!("{p}.self_attn.indexer.wk.weight"),
                vec![idim, d],
                proj(d),
            ),
            (
                format!("{p}.self_attn.indexer.weights_proj.weight"),
                vec![ih, d],
                proj(d),
            ),
            (
                format!("{p}.post_attention_layernorm.weight"),
                vec![d],
                Init::Norm,
            ),
            (format!("{p}.mlp.gate.weight"), vec![e, d], proj(d)),
        ]);
        let experts = (0..e)
            .map(|j| format!("{p}.mlp.experts.{j}"))
            .chain(std::iter::once(format!("{p}.mlp.shared_experts")));
        for x in experts {
            specs.extend([
                (format!("{x}.gate_proj.weight"), vec![f, d], proj(d)),
                (format!("{x}.up_proj.weight"), vec![f, d], proj(d)),
                (format!("{x}.down_proj.weight"), vec![d, f], proj(f)),
            ]);
        }
    }
    specs
}

#[derive(Clone, Copy)]
enum Init {
    /// Irwin–Hall(4), scaled to this standard deviation.
    Normal(f64),
    /// `1 + 0.1·noise`.
    Norm,
    /// As `Norm`, stored f32 whatever the dtype.
    NormF32,
    /// As `Normal`, stored f32 whatever the dtype (mixing weights).
    MixF32(f64),
    /// Hyper-connection bias for `h` streams, f32: `0.1·noise`, plus 2 on the
    /// residual mix's diagonal.
    HcBias(usize),
}

impl Init {
    fn always_f32(self) -> bool {
        matches!(self, Self::NormF32 | Self::MixF32(_) | Self::HcBias(_))
    }

    /// Element `i` of the tensor.
    fn draw(self, rng: &mut SplitMix, i: usize) -> f32 {
        // Sum of four 24-bit uniforms, centred: integer in [-2^25, 2^25].
        let s: i64 = (0..4).map(|_| (rng.next_u64() >> 40) as i64).sum::<i64>() - (2 << 24);
        // Irwin–Hall(4) of U[0,1) has variance 4/12; scale to unit variance.
        let unit = s as f64 / (1u64 << 24) as f64 * 3f64.sqrt();
        match self {
            Self::Normal(std) | Self::MixF32(std) => (unit * std) as f32,
            Self::Norm | Self::NormF32 => (1.0 + 0.1 * unit) as f32,
            Self::HcBias(h) => {
                let diagonal = i >= 2 * h && (i - 2 * h).is_multiple_of(h + 1);
                (0.1 * unit + if diagonal { 2.0 } else { 0.0 }) as f32
            }
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
