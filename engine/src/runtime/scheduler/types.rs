//! What bundles record of the serving core: requests, the engine
//! configuration, scheduling decisions and per-step reports. Changing a
//! field's order or type changes the bundle format (see `recorder::schema`).

use serde::{Deserialize, Serialize};

use crate::pool::Hash;
use crate::sampling::SamplingParams;
use crate::FinishReason;

pub type RequestId = u64;

/// One generation request, fully tokenized.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Request {
    pub id: RequestId,
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    pub stop_at_eos: bool,
}

/// Serving-core configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineConfig {
    /// Positions per KV page.
    pub page_size: usize,
    /// Pages in the pool.
    pub pool_pages: usize,
    /// Tokens (prefill + decode) per step.
    pub max_batch_tokens: usize,
    /// Reuse cached prefixes across requests.
    pub prefix_cache: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            page_size: 16,
            pool_pages: 256,
            max_batch_tokens: 512,
            prefix_cache: true,
        }
    }
}

/// A scheduling decision. Applied in list order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Decision {
    /// Abort a request at this step boundary.
    Interrupt { id: RequestId },
    /// Release a running request's pages; it waits and is recomputed later.
    Preempt { id: RequestId },
    /// Start a waiting request, reusing `cached_tokens` from the prefix cache.
    Admit { id: RequestId, cached_tokens: usize },
    /// Run positions `start..start + len` of a running request in this step.
    Schedule {
        id: RequestId,
        start: usize,
        len: usize,
    },
}

/// What happened to one scheduled request in a step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SeqReport {
    pub id: RequestId,
    pub start: usize,
    pub len: usize,
    /// Token sampled at the end of the span, if the span reached the end of the
    /// request's known tokens.
    pub sampled: Option<u32>,
    /// SHA-256 of the logits row `sampled` was drawn from.
    pub logits_digest: Option<Hash>,
    /// The most likely tokens of that row with their log-probabilities (for
    /// reports; computed in f64, outside the contract). Empty unless enabled
    /// with [`Scheduler::set_top_logprobs`].
    pub top_logprobs: Vec<(u32, f32)>,
    pub finish: Option<FinishReason>,
}

/// The outcome of one step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepReport {
    pub step: u64,
    pub decisions: Vec<Decision>,
    pub seqs: Vec<SeqReport>,
    /// Requests that ended this step (interrupted ones included).
    pub finished: Vec<(RequestId, FinishReason)>,
    /// Layout of the cache without its contents: the radix tree's keys and
    /// shape, and every in-use page's id and refcount. Differs when *what* is
    /// cached or referenced changes (a behavioural change), not when K/V
    /// numbers drift.
    pub cache_layout: Hash,
    /// Everything: the radix tree with page contents (Merkle), and every in-use
    /// page's id, refcount and content hash.
    pub cache_state: Hash,
}

/// A request's result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestOutput {
    pub id: RequestId,
    pub prompt_len: usize,
    pub tokens: Vec<u32>,
    pub finish: FinishReason,
    /// Same definition as [`crate::Generation::digest`].
    pub digest: Hash,
    /// Prompt tokens served from the prefix cache at first admission.
    pub cached_tokens: usize,
    pub preemptions: usize,
}
