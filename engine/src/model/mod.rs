//! What a model family is, and how a model directory loads into one.
//!
//! A family is one folder under `model/` behind the [`ModelFamily`] trait: a
//! forward pass over a batch of (sequence, span) entries, the per-position
//! state it keeps in the KV store ([`KvLayout`]), and the engine patches it
//! owns ([`ModelFamily::patch_points`]). The serving core (`runtime/`) sees only
//! the trait; a new family is a new folder plus one line in [`load_family`].
//!
//! Invariant (the contract): a family's logits at position `p` of a sequence
//! are a pure function of that sequence's tokens `[0..=p]`: whatever its
//! batch-mates, chunking, page size, thread count or device. Everything a
//! family computes from goes through `lmrr_kernels`' canonical order, and
//! everything it stores per position is in the KV store, where the pool's
//! page hashes cover it.

pub mod chat;
pub mod deepseek_v3;
pub(crate) mod device_kv;
pub mod exec;
pub mod gemma3;
pub mod gguf;
pub mod hf_config;
pub mod identity;
pub mod kv;
pub mod llama;
pub mod mini_v4;
pub mod moe;
pub mod ops;
pub mod synth;
pub mod tokenizer;
pub mod weights;

use lmrr_kernels::tensor_core::Numerics;
use lmrr_kernels::Threads;

use crate::kv::{KvCache, SeqId};
use crate::patches::{Patch, PatchSet};
use crate::weights::Tensor;
use crate::{EngineError, ModelFiles};

/// Which family a model belongs to (its `config.json` `model_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Llama,
    MiniV4,
    Mixtral,
    Qwen3Moe,
    Qwen2,
    Qwen3,
    Mistral,
    Gemma3Text,
    DeepseekV3,
}

impl Family {
    /// The `model_type` string of `config.json`.
    pub fn model_type(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::MiniV4 => "mini-v4",
            Self::Mixtral => "mixtral",
            Self::Qwen3Moe => "qwen3_moe",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
            Self::Mistral => "mistral",
            Self::Gemma3Text => "gemma3_text",
            Self::DeepseekV3 => "deepseek_v3",
        }
    }

    /// Every family, in listing order.
    pub const ALL: [Family; 9] = [
        Family::Llama,
        Family::MiniV4,
        Family::Mixtral,
        Family::Qwen3Moe,
        Family::Qwen2,
        Family::Qwen3,
        Family::Mistral,
        Family::Gemma3Text,
        Family::DeepseekV3,
    ];
}

impl std::fmt::Display for Family {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.model_type())
    }
}

/// What a family keeps in the KV store per layer and position: a K and a V
/// row of `kv_dim` floats each (what attention reads), and an auxiliary row
/// of `aux_dim` floats (0 for none). The MLA families, deepseek_v3 and
/// mini-v4, keep no K/V rows (`kv_dim` 0): their auxiliary row is the
/// compressed latent and the rotated shared key their attention reads,
/// then for mini-v4 the indexer key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    pub layers: usize,
    pub kv_dim: usize,
    pub aux_dim: usize,
}

/// Which logits rows a span wants back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsWanted {
    None,
    /// The span's last position only.
    Last,
    /// Every position of the span.
    All,
}

/// One entry of a batch: `tokens` of sequence `seq` at positions
/// `start..start + tokens.len()`.
#[derive(Debug, Clone)]
pub struct SeqSpan<'a> {
    pub seq: SeqId,
    pub start: usize,
    pub tokens: &'a [u32],
    pub logits: LogitsWanted,
}

/// Where the forward pass's kernels run. Every device gives the same bits
/// (contract invariant I6); the CUDA path copies operands per call (portable
/// mode, not a fast path) and runs no numerical engine patch.
#[derive(Clone, Default)]
pub enum Device {
    #[default]
    Cpu,
    #[cfg(feature = "cuda")]
    Cuda(std::sync::Arc<lmrr_kernels::cuda::Gpu>),
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Cpu => write!(f, "cpu"),
            #[cfg(feature = "cuda")]
            Self::Cuda(g) => write!(f, "cuda ({})", g.name()),
        }
    }
}

#[cfg(feature = "cuda")]
pub(crate) fn gpu_err(e: lmrr_kernels::cuda::GpuError) -> EngineError {
    EngineError::Device(e.to_string())
}

/// A tensor's values as the kernels see them: stored (f32, bf16 or GGUF
/// blocks, widened exactly on use), or already widened at load (norm weights).
pub enum TensorValues<'a> {
    Stored(&'a Tensor),
    F32(&'a [f32]),
}

/// A named tensor the forward pass reads: HF name, shape, values.
pub type NamedTensor<'a> = (String, Vec<usize>, TensorValues<'a>);

/// A stored tensor, named as in its file.
pub(crate) fn stored(t: &Tensor) -> NamedTensor<'_> {
    (t.name.clone(), t.shape.clone(), TensorValues::Stored(t))
}

/// A vector widened at load (norm weights, biases), under `name`.
pub(crate) fn vector(name: String, v: &[f32]) -> NamedTensor<'_> {
    (name, vec![v.len()], TensorValues::F32(v))
}

/// One model family's forward pass and facts, as the serving core sees them.
pub trait ModelFamily: Send + Sync {
    /// Which family this is.
    fn family(&self) -> Family;

    /// The concrete family type, for family-specific tools and tests.
    fn as_any(&self) -> &dyn std::any::Any;

    /// Runs one step over `spans` with engine `patches` applied (patches this
    /// family has no point for are inert), writing their per-position state
    /// into `kv`. Returns, per span, its wanted logits rows concatenated
    /// (`rows × vocab`). Validates every span before touching `kv`.
    fn forward_patched(
        &self,
        kv: &mut dyn KvCache,
        spans: &[SeqSpan],
        threads: &Threads,
        patches: &PatchSet,
    ) -> Result<Vec<Vec<f32>>, EngineError>;

    /// [`Self::forward_patched`] with no patch: the reference engine.
    fn forward(
        &self,
        kv: &mut dyn KvCache,
        spans: &[SeqSpan],
        threads: &Threads,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        self.forward_patched(kv, spans, threads, &PatchSet::none())
    }

    /// What the family stores per layer and position.
    fn kv_layout(&self) -> KvLayout;

    /// Maximum positions per sequence.
    fn context(&self) -> usize;

    /// Rows of the logits.
    fn vocab_size(&self) -> usize;

    /// Width of the hidden state.
    fn hidden_size(&self) -> usize;

    /// Whether `id` ends generation.
    fn is_eos(&self, id: u32) -> bool;

    /// The canonical `key=value` text of the config fields that change the
    /// arithmetic (see [`identity`]).
    fn config_text(&self) -> String;

    /// Every tensor the forward pass reads, by HF name (for [`identity`]).
    fn named_tensors(&self) -> Vec<NamedTensor<'_>>;

    /// Runs the kernels on `device` from now on (uploading what the family
    /// keeps resident there; out of device memory is an error with the sizes).
    fn set_device(&mut self, device: Device) -> Result<(), EngineError>;

    /// Where the kernels run.
    fn device(&self) -> &Device;

    /// The numerics mode its matmuls follow.
    fn numerics(&self) -> Numerics {
        Numerics::Canonical
    }

    /// Switches the matmuls' numerics mode; a family that has only the
    /// canonical one refuses the others, naming itself.
    fn set_numerics(&mut self, numerics: Numerics) -> Result<(), EngineError> {
        match numerics {
            Numerics::Canonical => Ok(()),
            other => Err(EngineError::Device(format!(
                "{} has no {other} numerics yet (llama, qwen2 and qwen3 have)",
                self.family()
            ))),
        }
    }

    /// Tensor parallelism over `tp.degree` ranks from the next step (on the
    /// CPU, the rank simulator of [`exec::tp`]); a shape the degree cannot
    /// split is refused here with the numbers, and tensor parallelism stays
    /// off. The degree never changes a bit.
    fn set_tp(&mut self, tp: exec::tp::TpConfig) -> Result<(), EngineError> {
        if tp == exec::tp::TpConfig::default() {
            return Ok(());
        }
        Err(EngineError::Device(format!(
            "{} has no tensor-parallel plan",
            self.family()
        )))
    }

    /// The tensor-parallel degree (1 without).
    fn tp_degree(&self) -> usize {
        1
    }

    /// Bytes of weights a decode step of one token streams.
    fn weight_bytes_per_step(&self) -> usize;

    /// Parameter count.
    fn param_count(&self) -> usize;

    /// The engine patches whose arithmetic lives in this family (the cache
    /// patches act in the scheduler and apply to every family).
    fn patch_points(&self) -> &'static [Patch];

    /// Time spent per part of the forward pass since the last
    /// [`Self::reset_profile`], `(part, seconds)`, for `lmrr bench`
    /// (measurement only: nothing reads it to decide anything). Empty where
    /// the family does not break its step down.
    fn profile(&self) -> Vec<(&'static str, f64)> {
        Vec::new()
    }

    /// Zeroes [`Self::profile`].
    fn reset_profile(&self) {}

    /// A family-specific account of how position `pos` of `tokens` was
    /// computed (mini-v4: the blocks its indexer chose per layer), under
    /// `patches`; `None` where the family has nothing to explain.
    fn explain(
        &self,
        _tokens: &[u32],
        _pos: usize,
        _threads: &Threads,
        _patches: &PatchSet,
    ) -> Result<Option<String>, EngineError> {
        Ok(None)
    }
}

/// Reads `model_type` from `config.json` and loads the matching family.
pub fn load_family(files: &ModelFiles) -> Result<Box<dyn ModelFamily>, EngineError> {
    #[derive(serde::Deserialize)]
    struct Probe {
        #[serde(default)]
        model_type: Option<String>,
    }
    let probe: Probe = serde_json::from_slice(&files.config).map_err(|e| EngineError::Config {
        path: files.config_path.clone(),
        msg: e.to_string(),
    })?;
    match probe.model_type.as_deref() {
        None | Some("llama" | "qwen2" | "qwen3" | "mistral") => {
            Ok(Box::new(llama::Llama::load(files)?))
        }
        Some("gemma3_text") => Ok(Box::new(gemma3::Gemma3::load(files)?)),
        Some("mini-v4") => Ok(Box::new(mini_v4::MiniV4::load(files)?)),
        Some("mixtral" | "qwen3_moe") => Ok(Box::new(moe::MoeModel::load(files)?)),
        Some("deepseek_v3") => Ok(Box::new(deepseek_v3::DeepseekV3::load(files)?)),
        Some(other) => Err(EngineError::ConfigValue {
            path: files.config_path.clone(),
            field: "model_type",
            value: other.into(),
            why: format!(
                "unknown model family (known: {})",
                Family::ALL.map(|f| f.model_type()).join(", ")
            ),
        }),
    }
}

/// Checks a batch before a family touches the KV store: each sequence once,
/// each span starting where its KV ends, inside the context and the
/// vocabulary. Shared by every family.
pub(crate) fn check_spans(
    kv: &dyn KvCache,
    spans: &[SeqSpan],
    context: usize,
    vocab: usize,
) -> Result<(), EngineError> {
    let mut seen = std::collections::HashSet::new();
    for s in spans {
        if !seen.insert(s.seq) {
            return Err(EngineError::DuplicateSeq { seq: s.seq });
        }
        let held = kv.len(s.seq);
        if s.start != held {
            return Err(EngineError::KvPosition {
                seq: s.seq,
                start: s.start,
                held,
            });
        }
        if s.start + s.tokens.len() > context {
            return Err(EngineError::ContextOverflow {
                seq: s.seq,
                pos: s.start + s.tokens.len() - 1,
                context,
            });
        }
        if let Some(&t) = s.tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(EngineError::TokenOutOfRange { token: t, vocab });
        }
    }
    Ok(())
}

/// Stacked-batch token `i` → (span index, absolute position).
pub(crate) fn stacked_tokens(spans: &[SeqSpan]) -> Vec<(usize, usize)> {
    spans
        .iter()
        .enumerate()
        .flat_map(|(si, s)| (0..s.tokens.len()).map(move |j| (si, s.start + j)))
        .collect()
}

/// Stacked indices of the rows whose logits the spans want, in span order.
pub(crate) fn wanted_rows(spans: &[SeqSpan]) -> Vec<usize> {
    let mut rows = Vec::new();
    let mut i0 = 0;
    for s in spans {
        let len = s.tokens.len();
        match s.logits {
            LogitsWanted::None => {}
            LogitsWanted::Last => rows.extend(len.checked_sub(1).map(|j| i0 + j)),
            LogitsWanted::All => rows.extend(i0..i0 + len),
        }
        i0 += len;
    }
    rows
}

/// Splits `logits` (the wanted rows, stacked) back per span, the copies of a
/// wide step across `threads`.
pub(crate) fn split_rows(
    spans: &[SeqSpan],
    logits: &[f32],
    vocab: usize,
    threads: &Threads,
) -> Vec<Vec<f32>> {
    let mut at = Vec::with_capacity(spans.len());
    let mut r0 = 0;
    for s in spans {
        let cnt = match s.logits {
            LogitsWanted::None => 0,
            LogitsWanted::Last => usize::from(!s.tokens.is_empty()),
            LogitsWanted::All => s.tokens.len(),
        };
        at.push(r0 * vocab..(r0 + cnt) * vocab);
        r0 += cnt;
    }
    // A wide step's rows (batch 64: 12.6 MB) are copied across the
    // threads; a copy, so the values are the same whichever thread makes it.
    if r0 * vocab < 1 << 18 || threads.count() == 1 {
        return at.into_iter().map(|r| logits[r].to_vec()).collect();
    }
    let out: Vec<std::sync::Mutex<Vec<f32>>> = (0..at.len())
        .map(|_| std::sync::Mutex::new(Vec::new()))
        .collect();
    threads.for_ranges(at.len(), 1, |rs| {
        for i in rs {
            let row = logits[at[i].clone()].to_vec();
            if let Ok(mut slot) = out[i].lock() {
                *slot = row;
            }
        }
    });
    out.into_iter()
        .map(|m| m.into_inner().unwrap_or_else(|p| p.into_inner()))
        .collect()
}

/// `x[i] += y[i]`, elementwise.
pub(crate) fn add_into(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

#[cfg(test)]
mod split_rows_tests {
    use super::*;

    /// A wide step's rows come out the same whether they are copied on one
    /// thread or across several: each span gets its own rows, in order.
    #[test]
    fn rows_are_split_the_same_on_one_thread_and_across_threads() {
        let vocab = 49_152;
        let toks: Vec<Vec<u32>> = (0..9u32).map(|i| (0..(i % 4 + 1)).collect()).collect();
        let wants = [LogitsWanted::Last, LogitsWanted::All, LogitsWanted::None];
        let spans: Vec<SeqSpan> = toks
            .iter()
            .enumerate()
            .map(|(i, t)| SeqSpan {
                seq: i as u64,
                start: 0,
                tokens: t,
                logits: wants[i % 3],
            })
            .collect();
        let rows: usize = spans
            .iter()
            .map(|s| match s.logits {
                LogitsWanted::None => 0,
                LogitsWanted::Last => 1,
                LogitsWanted::All => s.tokens.len(),
            })
            .sum();
        // Large enough (rows · vocab ≥ 2^18 floats) for the threaded copy.
        assert!(rows * vocab >= 1 << 18);
        let logits: Vec<f32> = (0..rows * vocab).map(|i| i as f32).collect();
        let one = split_rows(&spans, &logits, vocab, &Threads::single());
        let many = split_rows(&spans, &logits, vocab, &Threads::new(3).expect("threads"));
        assert_eq!(one, many);
        let mut r0 = 0;
        for (s, got) in spans.iter().zip(&one) {
            let cnt = match s.logits {
                LogitsWanted::None => 0,
                LogitsWanted::Last => 1,
                LogitsWanted::All => s.tokens.len(),
            };
            assert_eq!(got.len(), cnt * vocab, "span {}", s.seq);
            if cnt > 0 {
                assert_eq!(got[0], (r0 * vocab) as f32, "span {}", s.seq);
            }
            r0 += cnt;
        }
    }
}
