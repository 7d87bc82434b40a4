//! The serving core's step loop: continuous batching over the paged KV pool and
//! the radix prefix cache, with chunked prefill, preemption by recompute and
//! interrupts at step boundaries.
//!
//! Policy (FCFS by submission order, no wall clock anywhere):
//! 1. pending interrupts are applied, in the order they were requested;
//! 2. running sequences, oldest first, get their next span — one token when
//!    decoding, a chunk of the remaining prompt when prefilling — under the
//!    per-step token budget; when pages run out, unreferenced cached pages are
//!    evicted (LRU), then the youngest running sequence not yet scheduled in
//!    this step is preempted (its pages released, its tokens kept, recomputed
//!    on re-admission);
//! 3. waiting requests, oldest first, are admitted while budget and pages last,
//!    reusing the longest cached prefix; the head of the queue blocks the rest.
//!
//! Every decision is a [`Decision`] value, listed in the [`StepReport`];
//! [`Scheduler::step_forced`] executes a given list instead of deciding, which
//! is how a recording's schedule is replayed.
//!
//! Contract: a request's tokens and logits depend only on its own tokens (I4,
//! I2, I3): a cache hit reuses K/V that a recompute would produce bit for bit.

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use lmrr_kernels::Threads;

use crate::llama::{LogitsWanted, SeqSpan};
use crate::patches::{Patch, PatchSet};
use crate::pool::{BlockTable, Hash, PagePool, PagedKv};
use crate::radix::{Match, RadixCache};
use crate::sampling::{sample, SamplingParams};
use crate::{EngineError, FinishReason, Llama};

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

struct Seq {
    req: Request,
    /// Prompt then generated tokens.
    tokens: Vec<u32>,
    order: u64,
    hasher: Sha256,
    cached_tokens: Option<usize>,
    preemptions: usize,
    /// Pages matched from the prefix cache at the latest admission.
    shared_pages: Vec<crate::pool::PageId>,
}

impl Seq {
    fn generated(&self) -> &[u32] {
        &self.tokens[self.req.prompt.len()..]
    }
}

/// The serving core.
pub struct Scheduler<'m> {
    model: &'m Llama,
    threads: Threads,
    cfg: EngineConfig,
    kv: PagedKv,
    radix: RadixCache,
    seqs: BTreeMap<RequestId, Seq>,
    waiting: VecDeque<RequestId>,
    running: Vec<RequestId>,
    pending_interrupts: Vec<RequestId>,
    done: BTreeMap<RequestId, RequestOutput>,
    step: u64,
    next_order: u64,
    timings: StepTimings,
    top_logprobs: usize,
    patches: PatchSet,
    keep_rows: bool,
    last_rows: Vec<(RequestId, Vec<f32>)>,
    force_tokens: BTreeMap<RequestId, u32>,
    /// Consecutive steps with work pending in which no request sampled a
    /// token, finished or was interrupted.
    stalled: u64,
    /// `stalled` at which [`Scheduler::step`] refuses to go on.
    stall_limit: u64,
}

/// Steps without progress before a run is declared livelocked, at least.
/// The bound used is the larger of this and four times the steps a
/// context-long prefill takes at the batch budget (see
/// [`Scheduler::stall_limit`]).
pub const MIN_STALL_LIMIT: u64 = 4096;

/// Time spent inside steps, for `lmrr bench` (measurement only: no decision
/// ever reads a clock).
#[derive(Debug, Clone, Copy, Default)]
pub struct StepTimings {
    /// Whole steps.
    pub total: std::time::Duration,
    /// Slot digests, page hashes, radix and cache-state hashes.
    pub hashing: std::time::Duration,
}

fn infeasible(what: String) -> EngineError {
    EngineError::Infeasible { what }
}

impl<'m> Scheduler<'m> {
    pub fn new(model: &'m Llama, cfg: EngineConfig, threads: Threads) -> Result<Self, EngineError> {
        if cfg.max_batch_tokens == 0 {
            return Err(EngineError::InvalidOption {
                name: "max_batch_tokens",
                value: "0".into(),
                why: "must be at least 1".into(),
            });
        }
        if cfg.page_size > model.context() {
            return Err(EngineError::InvalidOption {
                name: "page_size",
                value: cfg.page_size.to_string(),
                why: format!(
                    "a page holds at most the model's context of {} positions",
                    model.context()
                ),
            });
        }
        let shape = model.attn_shape();
        let pool = PagePool::new(
            cfg.page_size,
            cfg.pool_pages,
            model.config().num_hidden_layers,
            shape.kv_dim(),
        )?;
        Ok(Self {
            model,
            threads,
            cfg,
            kv: PagedKv::new(pool),
            radix: RadixCache::new(),
            seqs: BTreeMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            pending_interrupts: Vec::new(),
            done: BTreeMap::new(),
            step: 0,
            next_order: 0,
            timings: StepTimings::default(),
            top_logprobs: 0,
            patches: PatchSet::none(),
            keep_rows: false,
            last_rows: Vec::new(),
            force_tokens: BTreeMap::new(),
            stalled: 0,
            stall_limit: MIN_STALL_LIMIT
                .max(4 * model.context().div_ceil(cfg.max_batch_tokens) as u64),
        })
    }

    /// Steps without progress (no token sampled, no request ended) after
    /// which [`Scheduler::step`] stops with [`EngineError::Livelock`]. A
    /// healthy engine never comes near it: the oldest running request always
    /// advances, and a context-long prefill takes `context / max_batch_tokens`
    /// steps.
    pub fn stall_limit(&self) -> u64 {
        self.stall_limit
    }

    /// Overrides the livelock bound (at least 1).
    pub fn set_stall_limit(&mut self, steps: u64) {
        self.stall_limit = steps.max(1);
    }

    /// What a livelock report shows: the pool, the queue and every pending
    /// request with what it holds.
    fn livelock_report(&self) -> String {
        let pool = &self.kv.pool;
        let mut s = format!(
            "pool: {} of {} pages free, {} cached in the prefix tree, {} held by requests (page size {})",
            pool.free_count(),
            pool.n_pages(),
            self.radix.len(),
            self.pages_held_by_requests(),
            self.cfg.page_size
        );
        let describe = |id: &RequestId| -> String {
            let Some(seq) = self.seqs.get(id) else {
                return format!("\n  request {id}: unknown");
            };
            let kv = self.kv.tables.get(id);
            format!(
                "\n  request {id}: {} of {} tokens in KV over {} pages, {} generated of {}, preempted {}×",
                kv.map_or(0, |t| t.len),
                seq.tokens.len(),
                kv.map_or(0, |t| t.pages.len()),
                seq.generated().len(),
                seq.req.max_tokens,
                seq.preemptions
            )
        };
        s += &format!("\nrunning ({}), starved:", self.running.len());
        for id in &self.running {
            s += &describe(id);
        }
        s += &format!("\nwaiting ({}), starved:", self.waiting.len());
        for id in &self.waiting {
            s += &describe(id);
        }
        s
    }

    /// A scheduler running engine patches (see [`crate::patches`]).
    pub fn with_patches(
        model: &'m Llama,
        cfg: EngineConfig,
        threads: Threads,
        patches: PatchSet,
    ) -> Result<Self, EngineError> {
        let mut s = Self::new(model, cfg, threads)?;
        s.patches = patches;
        Ok(s)
    }

    /// The active patches.
    pub fn patches(&self) -> &PatchSet {
        &self.patches
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Pages a request may need at most: prompt plus generation, capped by the context.
    pub fn pages_needed(&self, prompt_len: usize, max_tokens: usize) -> usize {
        prompt_len
            .saturating_add(max_tokens)
            .min(self.model.context())
            .div_ceil(self.cfg.page_size)
    }

    /// Queues a request. Refuses, before anything runs, one that could never fit.
    pub fn submit(&mut self, req: Request) -> Result<(), EngineError> {
        let id = req.id;
        if self.seqs.contains_key(&id) || self.done.contains_key(&id) {
            return Err(EngineError::InvalidOption {
                name: "request id",
                value: id.to_string(),
                why: "already submitted".into(),
            });
        }
        req.sampling.validate()?;
        if req.max_tokens == 0 {
            return Err(EngineError::ZeroMaxTokens);
        }
        if req.prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let vocab = self.model.config().vocab_size;
        if let Some(&t) = req.prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(EngineError::TokenOutOfRange { token: t, vocab });
        }
        if req.prompt.len() > self.model.context() {
            return Err(EngineError::PromptTooLong {
                tokens: req.prompt.len(),
                context: self.model.context(),
            });
        }
        let need = self.pages_needed(req.prompt.len(), req.max_tokens);
        if need > self.cfg.pool_pages {
            return Err(EngineError::NeverFits {
                id: id.to_string(),
                tokens: (req.prompt.len().saturating_add(req.max_tokens)).min(self.model.context()),
                need_pages: need,
                pool_pages: self.cfg.pool_pages,
                page_size: self.cfg.page_size,
            });
        }
        let tokens = req.prompt.clone();
        self.seqs.insert(
            id,
            Seq {
                req,
                tokens,
                order: self.next_order,
                hasher: Sha256::new(),
                cached_tokens: None,
                preemptions: 0,
                shared_pages: Vec::new(),
            },
        );
        self.next_order += 1;
        self.waiting.push_back(id);
        Ok(())
    }

    /// Requests an abort of `id` at the next step boundary. Returns `false` if
    /// the request already ended.
    pub fn interrupt(&mut self, id: RequestId) -> Result<bool, EngineError> {
        if self.done.contains_key(&id) {
            return Ok(false);
        }
        if !self.seqs.contains_key(&id) {
            return Err(EngineError::InvalidOption {
                name: "interrupt",
                value: id.to_string(),
                why: "no such request".into(),
            });
        }
        if !self.pending_interrupts.contains(&id) {
            self.pending_interrupts.push(id);
        }
        Ok(true)
    }

    /// Nothing waiting, running or pending.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty() && self.pending_interrupts.is_empty()
    }

    /// Steps taken so far.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// Tokens generated so far by a live or finished request.
    pub fn generated(&self, id: RequestId) -> Option<&[u32]> {
        match self.seqs.get(&id) {
            Some(s) => Some(s.generated()),
            None => self.done.get(&id).map(|o| o.tokens.as_slice()),
        }
    }

    /// Whether a request has ended or ends at the next step boundary (an
    /// interrupt is pending).
    pub fn has_ended(&self, id: RequestId) -> bool {
        self.done.contains_key(&id) || self.pending_interrupts.contains(&id)
    }

    /// The result of a finished request.
    pub fn output(&self, id: RequestId) -> Option<&RequestOutput> {
        self.done.get(&id)
    }

    /// Removes and returns the result of a finished request (a long-running
    /// server forgets what it has answered; [`Self::interrupt`] then treats
    /// the id as unknown).
    pub fn take_output(&mut self, id: RequestId) -> Option<RequestOutput> {
        self.done.remove(&id)
    }

    /// All finished requests by id.
    pub fn outputs(&self) -> &BTreeMap<RequestId, RequestOutput> {
        &self.done
    }

    /// Reports the `k` most likely tokens of every sampled row (0 = off).
    pub fn set_top_logprobs(&mut self, k: usize) {
        self.top_logprobs = k;
    }

    /// Keeps the logits rows sampled in the latest step ([`Self::last_rows`]).
    pub fn set_keep_rows(&mut self, keep: bool) {
        self.keep_rows = keep;
    }

    /// `(request, logits row)` sampled in the latest step, with `set_keep_rows`.
    pub fn last_rows(&self) -> &[(RequestId, Vec<f32>)] {
        &self.last_rows
    }

    /// Replays one step: executes `decisions`, samples as usual (reported in
    /// `sampled`), but continues each request in `tokens` with the given token
    /// instead of its own draw (teacher forcing on a recorded path).
    pub fn step_replay(
        &mut self,
        decisions: Vec<Decision>,
        tokens: BTreeMap<RequestId, u32>,
    ) -> Result<StepReport, EngineError> {
        self.force_tokens = tokens;
        let r = self.step_forced(decisions);
        self.force_tokens.clear();
        r
    }

    /// Accumulated step timings.
    pub fn timings(&self) -> StepTimings {
        self.timings
    }

    /// Decides and runs one step.
    pub fn step(&mut self) -> Result<StepReport, EngineError> {
        if self.stalled >= self.stall_limit {
            return Err(EngineError::Livelock {
                step: self.step,
                stalled: self.stalled,
                report: self.livelock_report(),
            });
        }
        let t0 = std::time::Instant::now();
        let mut decisions = Vec::new();
        let mut finished = Vec::new();
        self.decide(&mut decisions, &mut finished)?;
        let r = self.execute(decisions, finished);
        self.timings.total += t0.elapsed();
        r
    }

    /// Runs one step under the given decisions (replay). An infeasible decision
    /// is an error naming it.
    pub fn step_forced(&mut self, decisions: Vec<Decision>) -> Result<StepReport, EngineError> {
        let t0 = std::time::Instant::now();
        let mut finished = Vec::new();
        for d in &decisions {
            self.apply(d, &mut finished)?;
        }
        // Recorded decisions come from a file: every scheduled request must
        // still be running once all of them are applied, and be scheduled once.
        let mut seen = std::collections::BTreeSet::new();
        for d in &decisions {
            if let Decision::Schedule { id, .. } = *d {
                if !seen.insert(id) {
                    return Err(infeasible(format!(
                        "request {id} is scheduled twice in one step"
                    )));
                }
                if !self.running.contains(&id) || !self.kv.tables.contains_key(&id) {
                    return Err(infeasible(format!(
                        "schedule of request {id}, which a later decision of the same step ended"
                    )));
                }
            }
        }
        let r = self.execute(decisions, finished);
        self.timings.total += t0.elapsed();
        r
    }

    fn decide(
        &mut self,
        out: &mut Vec<Decision>,
        finished: &mut Vec<(RequestId, FinishReason)>,
    ) -> Result<(), EngineError> {
        let ps = self.cfg.page_size;
        for id in self.pending_interrupts.clone() {
            let d = Decision::Interrupt { id };
            self.apply(&d, finished)?;
            out.push(d);
        }
        let mut budget = self.cfg.max_batch_tokens;
        let mut scheduled: Vec<RequestId> = Vec::new();
        // Running sequences, oldest first.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let (kv_len, have) = self.table(id).map(|t| (t.len, t.pages.len()))?;
            let remaining = self.seqs[&id].tokens.len() - kv_len;
            let mut n = remaining.min(budget);
            loop {
                let need = (kv_len + n).div_ceil(ps).saturating_sub(have);
                let avail = self.kv.pool.free_count()
                    + if self.cfg.prefix_cache {
                        self.radix.evictable(&self.kv.pool, &[])
                    } else {
                        0
                    };
                if need <= avail {
                    break;
                }
                // Preempt the youngest running request not scheduled yet.
                let victim = self
                    .running
                    .iter()
                    .rev()
                    .copied()
                    .find(|&v| v != id && !scheduled.contains(&v));
                match victim {
                    Some(v) => {
                        let d = Decision::Preempt { id: v };
                        self.apply(&d, finished)?;
                        out.push(d);
                    }
                    None => {
                        n = ((have + avail) * ps).saturating_sub(kv_len).min(n);
                        break;
                    }
                }
            }
            // `running` may have shrunk behind us; find our index again.
            i = self
                .running
                .iter()
                .position(|&r| r == id)
                .map_or(i, |p| p + 1);
            if n == 0 {
                continue;
            }
            let d = Decision::Schedule {
                id,
                start: kv_len,
                len: n,
            };
            self.apply(&d, finished)?;
            out.push(d);
            scheduled.push(id);
            budget -= n;
        }
        // Admissions, FCFS; the head of the queue blocks the rest.
        while budget > 0 {
            let Some(&id) = self.waiting.front() else {
                break;
            };
            let tokens = &self.seqs[&id].tokens;
            let matched = if self.cfg.prefix_cache {
                self.radix
                    .match_prefix(&tokens[..tokens.len() - 1], ps, false)
            } else {
                Match {
                    pages: Vec::new(),
                    tokens: 0,
                }
            };
            let cached = matched.tokens;
            let avail = self.kv.pool.free_count()
                + if self.cfg.prefix_cache {
                    self.radix.evictable(&self.kv.pool, &matched.pages)
                } else {
                    0
                };
            let fit = ((matched.pages.len() + avail) * ps).saturating_sub(cached);
            let n = (tokens.len() - cached).min(budget).min(fit);
            if n == 0 {
                break;
            }
            for d in [
                Decision::Admit {
                    id,
                    cached_tokens: cached,
                },
                Decision::Schedule {
                    id,
                    start: cached,
                    len: n,
                },
            ] {
                self.apply(&d, finished)?;
                out.push(d);
            }
            budget -= n;
        }
        Ok(())
    }

    fn table(&self, id: RequestId) -> Result<&BlockTable, EngineError> {
        self.kv
            .tables
            .get(&id)
            .ok_or_else(|| infeasible(format!("request {id} has no KV (not running)")))
    }

    /// Applies one decision to the scheduler state.
    fn apply(
        &mut self,
        d: &Decision,
        finished: &mut Vec<(RequestId, FinishReason)>,
    ) -> Result<(), EngineError> {
        let ps = self.cfg.page_size;
        match *d {
            Decision::Interrupt { id } => {
                self.pending_interrupts.retain(|&x| x != id);
                if let Some(pos) = self.waiting.iter().position(|&x| x == id) {
                    self.waiting.remove(pos);
                } else if self.running.contains(&id) {
                    self.release_as(id, true, true);
                } else {
                    return Err(infeasible(format!(
                        "interrupt of request {id}, which is neither waiting nor running"
                    )));
                }
                self.finish(id, FinishReason::Interrupted);
                finished.push((id, FinishReason::Interrupted));
            }
            Decision::Preempt { id } => {
                if !self.running.contains(&id) {
                    return Err(infeasible(format!(
                        "preemption of request {id}, which is not running"
                    )));
                }
                self.release(id, true);
                let seq = self.seqs.get_mut(&id).expect("running request exists");
                seq.preemptions += 1;
                let order = seq.order;
                let at = self
                    .waiting
                    .iter()
                    .position(|w| self.seqs[w].order > order)
                    .unwrap_or(self.waiting.len());
                self.waiting.insert(at, id);
            }
            Decision::Admit { id, cached_tokens } => {
                let Some(pos) = self.waiting.iter().position(|&x| x == id) else {
                    return Err(infeasible(format!(
                        "admission of request {id}, which is not waiting"
                    )));
                };
                if cached_tokens > 0 && !self.cfg.prefix_cache {
                    return Err(infeasible(format!(
                        "admission of request {id} with {cached_tokens} cached tokens, the prefix cache is off"
                    )));
                }
                let seq = &self.seqs[&id];
                let probe = &seq.tokens[..seq.tokens.len() - 1];
                let m = if cached_tokens > 0 {
                    self.radix.match_prefix(probe, ps, true)
                } else {
                    Match {
                        pages: Vec::new(),
                        tokens: 0,
                    }
                };
                // A cut inside a page is only possible at the end of a partial match.
                if m.tokens < cached_tokens
                    || (cached_tokens % ps != 0 && cached_tokens != m.tokens)
                {
                    return Err(infeasible(format!(
                        "admission of request {id} expects {cached_tokens} cached tokens, the cache holds {}",
                        m.tokens
                    )));
                }
                let pages: Vec<_> = m
                    .pages
                    .into_iter()
                    .take(cached_tokens.div_ceil(ps))
                    .collect();
                for &p in &pages {
                    self.kv.pool.incref(p);
                }
                let shared = pages.clone();
                self.waiting.remove(pos);
                self.kv.tables.insert(
                    id,
                    BlockTable {
                        pages,
                        len: cached_tokens,
                    },
                );
                let seq = self.seqs.get_mut(&id).expect("waiting request exists");
                seq.cached_tokens.get_or_insert(cached_tokens);
                seq.shared_pages = shared;
                let order = seq.order;
                let at = self
                    .running
                    .iter()
                    .position(|r| self.seqs[r].order > order)
                    .unwrap_or(self.running.len());
                self.running.insert(at, id);
            }
            Decision::Schedule { id, start, len } => {
                let t = self.table(id)?;
                let total = self.seqs[&id].tokens.len();
                let end = start.checked_add(len).filter(|&e| e <= total);
                let Some(end) = end.filter(|_| start == t.len && len > 0) else {
                    return Err(infeasible(format!(
                        "schedule of request {id} positions {start}..{start}+{len} (it holds {} of {total} tokens)",
                        t.len
                    )));
                };
                let need = end.div_ceil(ps).saturating_sub(t.pages.len());
                for _ in 0..need {
                    let page = match self.kv.pool.alloc()? {
                        Some(p) => p,
                        None => {
                            self.radix.evict(1, &mut self.kv.pool);
                            self.kv.pool.alloc()?.ok_or_else(|| {
                                infeasible(format!(
                                    "schedule of request {id}: the pool has no free page"
                                ))
                            })?
                        }
                    };
                    self.kv
                        .tables
                        .get_mut(&id)
                        .expect("table checked")
                        .pages
                        .push(page);
                }
            }
        }
        Ok(())
    }

    /// Releases a running request's pages; with `cache`, its full computed
    /// pages enter the prefix cache first.
    fn release(&mut self, id: RequestId, cache: bool) {
        self.release_as(id, cache, false);
    }

    /// Releases a request; `interrupted` selects the abort path, where the
    /// cache-corruption patches act.
    fn release_as(&mut self, id: RequestId, cache: bool, interrupted: bool) {
        self.running.retain(|&r| r != id);
        let Some(t) = self.kv.tables.remove(&id) else {
            return;
        };
        let ps = self.cfg.page_size;
        if cache && self.cfg.prefix_cache {
            let full = t.len / ps;
            let tokens = &self.seqs[&id].tokens;
            self.radix
                .insert(&tokens[..full * ps], &t.pages[..full], &mut self.kv.pool);
            if interrupted && self.patches.contains(Patch::AbortInsertsPartial) && t.len % ps != 0 {
                // The bug: the unfinished page goes in too, keyed by every token
                // it covers — including the last sampled one, never computed.
                let key = &tokens[full * ps..tokens.len().min((full + 1) * ps)];
                self.radix.insert_partial(
                    &tokens[..full * ps],
                    key,
                    t.pages[full],
                    &mut self.kv.pool,
                );
            }
        }
        for p in t.pages {
            self.kv.pool.decref(p);
        }
        if interrupted && self.patches.contains(Patch::AbortFreesShared) {
            // The bug: pages shared with the tree are freed as if exclusive.
            let shared = std::mem::take(
                &mut self
                    .seqs
                    .get_mut(&id)
                    .expect("released request exists")
                    .shared_pages,
            );
            for p in shared {
                self.kv.pool.force_free(p);
            }
        }
    }

    fn finish(&mut self, id: RequestId, reason: FinishReason) {
        let Some(seq) = self.seqs.remove(&id) else {
            return;
        };
        let out = RequestOutput {
            id,
            prompt_len: seq.req.prompt.len(),
            tokens: seq.generated().to_vec(),
            finish: reason,
            digest: seq.hasher.finalize().into(),
            cached_tokens: seq.cached_tokens.unwrap_or(0),
            preemptions: seq.preemptions,
        };
        self.done.insert(id, out);
    }

    fn execute(
        &mut self,
        decisions: Vec<Decision>,
        mut finished: Vec<(RequestId, FinishReason)>,
    ) -> Result<StepReport, EngineError> {
        let sched: Vec<(RequestId, usize, usize)> = decisions
            .iter()
            .filter_map(|d| match *d {
                Decision::Schedule { id, start, len } => Some((id, start, len)),
                _ => None,
            })
            .collect();
        let spans: Vec<SeqSpan> = sched
            .iter()
            .map(|&(id, start, len)| {
                let toks = &self.seqs[&id].tokens;
                SeqSpan {
                    seq: id,
                    start,
                    tokens: &toks[start..start + len],
                    logits: if start + len == toks.len() {
                        LogitsWanted::Last
                    } else {
                        LogitsWanted::None
                    },
                }
            })
            .collect();
        let logits = if spans.is_empty() {
            Vec::new()
        } else {
            self.model
                .forward_patched(&mut self.kv, &spans, &self.threads, &self.patches)?
        };
        let th = std::time::Instant::now();
        self.kv.finish_step();
        let mut hash_time = th.elapsed();
        self.last_rows.clear();
        let mut seqs = Vec::with_capacity(sched.len());
        for (&(id, start, len), row) in sched.iter().zip(logits) {
            let mut rep = SeqReport {
                id,
                start,
                len,
                sampled: None,
                logits_digest: None,
                top_logprobs: Vec::new(),
                finish: None,
            };
            if !row.is_empty() {
                let cfg = self.model.config();
                let context = self.model.context();
                let seq = self.seqs.get_mut(&id).expect("scheduled request exists");
                let pos = seq.tokens.len();
                let tok = sample(&row, &seq.req.sampling, pos as u64);
                let th = std::time::Instant::now();
                let bytes = row_bytes(&row);
                let next = self.force_tokens.get(&id).copied().unwrap_or(tok);
                seq.hasher.update(&bytes);
                seq.hasher.update(next.to_le_bytes());
                let row_digest: Hash = Sha256::digest(&bytes).into();
                hash_time += th.elapsed();
                seq.tokens.push(next);
                rep.sampled = Some(tok);
                rep.logits_digest = Some(row_digest);
                rep.top_logprobs = top_logprobs(&row, self.top_logprobs);
                if self.keep_rows {
                    self.last_rows.push((id, row.clone()));
                }
                let n_gen = seq.tokens.len() - seq.req.prompt.len();
                rep.finish = if seq.req.stop_at_eos && cfg.is_eos(next) {
                    Some(FinishReason::Eos)
                } else if n_gen >= seq.req.max_tokens {
                    Some(FinishReason::Length)
                } else if seq.tokens.len() > context {
                    Some(FinishReason::Context)
                } else {
                    None
                };
            }
            if let Some(r) = rep.finish {
                self.release(id, true);
                self.finish(id, r);
                finished.push((id, r));
            }
            seqs.push(rep);
        }
        let th = std::time::Instant::now();
        let mut h = Sha256::new();
        h.update(self.radix.structure_hash(&self.kv.pool, true));
        let mut lh = Sha256::new();
        lh.update(self.radix.structure_hash(&self.kv.pool, false));
        for (p, refs, content) in self.kv.pool.in_use() {
            h.update(p.to_le_bytes());
            h.update(refs.to_le_bytes());
            h.update(content);
            lh.update(p.to_le_bytes());
            lh.update(refs.to_le_bytes());
        }
        hash_time += th.elapsed();
        self.timings.hashing += hash_time;
        let report = StepReport {
            step: self.step,
            decisions,
            seqs,
            finished,
            cache_layout: lh.finalize().into(),
            cache_state: h.finalize().into(),
        };
        self.step += 1;
        let progress = !report.finished.is_empty()
            || report.seqs.iter().any(|q| q.sampled.is_some())
            || report
                .decisions
                .iter()
                .any(|d| matches!(d, Decision::Interrupt { .. }));
        self.stalled = if progress || self.is_idle() {
            0
        } else {
            self.stalled + 1
        };
        Ok(report)
    }

    /// Checks pool accounting: every page's refcount equals the number of
    /// block tables holding it plus one if the tree holds it; free pages are
    /// exactly those with refcount 0. Returns a description of the first
    /// mismatch.
    pub fn check_accounting(&self) -> Result<(), String> {
        let pool = &self.kv.pool;
        let mut expect = vec![0u32; pool.used_pages()];
        let held = self
            .kv
            .tables
            .values()
            .flat_map(|t| t.pages.iter().copied())
            .chain(self.radix.pages());
        for p in held {
            match expect.get_mut(p as usize) {
                Some(e) => *e += 1,
                None => return Err(format!("page {p} is held but was never allocated")),
            }
        }
        for (p, &e) in expect.iter().enumerate() {
            let r = pool.refcount(p as u32);
            if r != e {
                return Err(format!("page {p}: refcount {r}, held by {e}"));
            }
        }
        let zero = expect.iter().filter(|&&e| e == 0).count() + pool.n_pages() - pool.used_pages();
        if pool.free_count() != zero {
            return Err(format!(
                "free list has {} pages, {zero} have refcount 0",
                pool.free_count()
            ));
        }
        Ok(())
    }

    /// Pages in the pool that are neither free nor owned by the tree alone.
    pub fn pages_held_by_requests(&self) -> usize {
        self.kv.tables.values().map(|t| t.pages.len()).sum()
    }

    /// Pages cached by the radix tree.
    pub fn cached_pages(&self) -> usize {
        self.radix.len()
    }

    /// Free pages.
    pub fn free_pages(&self) -> usize {
        self.kv.pool.free_count()
    }
}

/// Little-endian bits of a logits row.
fn row_bytes(row: &[f32]) -> Vec<u8> {
    row.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect()
}

/// The `k` largest logits (ties to the lowest id) as `(token, log-probability)`.
/// For reports only, but still deterministic: the log-sum-exp uses the
/// canonical `det_exp` and sum, and one f64 `ln` from the pure-Rust `libm`
/// (the same bits on every platform; recorded logprobs are in bundles).
pub fn top_logprobs(row: &[f32], k: usize) -> Vec<(u32, f32)> {
    let mut idx: Vec<u32> = (0..row.len() as u32)
        .filter(|&i| !row[i as usize].is_nan())
        .collect();
    let k = k.min(idx.len());
    if k == 0 {
        return Vec::new();
    }
    let m = idx
        .iter()
        .map(|&i| row[i as usize])
        .fold(f32::NEG_INFINITY, f32::max);
    let shifted: Vec<f32> = row
        .iter()
        .map(|&v| if v.is_nan() { f32::NEG_INFINITY } else { v - m })
        .collect();
    let mut e = vec![0.0f32; row.len()];
    lmrr_kernels::exp_slice(&shifted, &mut e);
    let lse = m as f64 + libm::log(lmrr_kernels::sum(&e) as f64);
    let order = |a: &u32, b: &u32| row[*b as usize].total_cmp(&row[*a as usize]).then(a.cmp(b));
    if k < idx.len() {
        idx.select_nth_unstable_by(k - 1, order);
        idx.truncate(k);
    }
    idx.sort_unstable_by(order);
    idx.into_iter()
        .map(|i| (i, (row[i as usize] as f64 - lse) as f32))
        .collect()
}
