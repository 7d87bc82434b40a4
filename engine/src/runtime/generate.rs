//! Single-request generation: chunked prefill, then token-by-token decode, and
//! the run digest.
//!
//! Digest: SHA-256 over, for each generated token in order, the little-endian
//! bits of the logits row it was sampled from followed by the token id as a
//! little-endian `u32`. Two runs compare by one line.

use sha2::{Digest, Sha256};

use lmrr_kernels::Threads;

use crate::kv::{KvCache, SeqKvStore};
use crate::model::{LogitsWanted, ModelFamily, SeqSpan};
use crate::sampling::{sample, SamplingParams};
use crate::EngineError;

/// Options of [`generate`].
#[derive(Debug, Clone)]
pub struct GenerateOptions {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Prompt tokens per prefill forward; `None` = the whole prompt at once.
    pub prefill_chunk: Option<usize>,
    /// Stop when the model's EOS token is drawn.
    pub stop_at_eos: bool,
    /// Keep every logits row in [`Generation::logits`].
    pub keep_logits: bool,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        Self {
            max_tokens: 32,
            sampling: SamplingParams::default(),
            prefill_chunk: None,
            stop_at_eos: true,
            keep_logits: false,
        }
    }
}

/// Why generation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// `max_tokens` reached.
    Length,
    /// EOS drawn.
    Eos,
    /// The model's context is full.
    Context,
    /// Interrupted (aborted) at a step boundary.
    Interrupted,
}

impl std::fmt::Display for FinishReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Length => "length",
            Self::Eos => "eos",
            Self::Context => "context",
            Self::Interrupted => "interrupted",
        })
    }
}

/// The result of [`generate`].
#[derive(Debug, Clone)]
pub struct Generation {
    pub tokens: Vec<u32>,
    /// Logits rows (only with `keep_logits`).
    pub logits: Vec<Vec<f32>>,
    pub digest: [u8; 32],
    pub finish: FinishReason,
}

/// Generates a continuation of `prompt`.
pub fn generate(
    model: &dyn ModelFamily,
    prompt: &[u32],
    opts: &GenerateOptions,
    threads: &Threads,
) -> Result<Generation, EngineError> {
    opts.sampling.validate()?;
    if opts.max_tokens == 0 {
        return Err(EngineError::ZeroMaxTokens);
    }
    if prompt.is_empty() {
        return Err(EngineError::EmptyPrompt);
    }
    if prompt.len() > model.context() {
        return Err(EngineError::PromptTooLong {
            tokens: prompt.len(),
            context: model.context(),
        });
    }
    if opts.prefill_chunk == Some(0) {
        return Err(EngineError::InvalidOption {
            name: "prefill_chunk",
            value: "0".into(),
            why: "must be at least 1".into(),
        });
    }
    let mut kv = SeqKvStore::new(model.kv_layout());
    let seq = 0;
    let chunk = opts.prefill_chunk.unwrap_or(prompt.len());
    let mut last = Vec::new();
    for (ci, part) in prompt.chunks(chunk).enumerate() {
        let is_last = (ci + 1) * chunk >= prompt.len();
        let span = SeqSpan {
            seq,
            start: kv.len(seq),
            tokens: part,
            logits: if is_last {
                LogitsWanted::Last
            } else {
                LogitsWanted::None
            },
        };
        last = model
            .forward(&mut kv, &[span], threads)?
            .pop()
            .unwrap_or_default();
    }
    let mut hasher = Sha256::new();
    let mut out = Generation {
        tokens: Vec::new(),
        logits: Vec::new(),
        digest: [0; 32],
        finish: FinishReason::Length,
    };
    let mut pos = prompt.len();
    while out.tokens.len() < opts.max_tokens {
        let tok = sample(&last, &opts.sampling, pos as u64);
        hasher.update(crate::digest::row_bytes(&last));
        hasher.update(tok.to_le_bytes());
        out.tokens.push(tok);
        if opts.keep_logits {
            out.logits.push(std::mem::take(&mut last));
        }
        if opts.stop_at_eos && model.is_eos(tok) {
            out.finish = FinishReason::Eos;
            break;
        }
        if out.tokens.len() == opts.max_tokens {
            break;
        }
        if pos >= model.context() {
            out.finish = FinishReason::Context;
            break;
        }
        let span = SeqSpan {
            seq,
            start: pos,
            tokens: std::slice::from_ref(&tok),
            logits: LogitsWanted::Last,
        };
        last = model
            .forward(&mut kv, &[span], threads)?
            .pop()
            .unwrap_or_default();
        pos += 1;
    }
    out.digest = hasher.finalize().into();
    Ok(out)
}
