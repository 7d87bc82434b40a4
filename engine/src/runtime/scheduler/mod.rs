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
//!
//! Layout: [`types`] (what bundles record), `policy` (deciding a step),
//! `state` (applying decisions: admission, preemption, interrupts, release
//! into the radix cache), `step` (executing a step: the forward pass,
//! sampling and the hashes), `handoff` (what a disaggregated deployment
//! asks of each side: the prefill side holding finished requests' pages
//! until their K/V has been sent, the decode side reserving pages, taking
//! K/V rows and admitting a request that was prefilled elsewhere).

mod handoff;
mod policy;
mod state;
mod step;
pub mod types;

use std::collections::{BTreeMap, VecDeque};

use lmrr_kernels::Threads;
use sha2::{Digest, Sha256};

use crate::model::ModelFamily;
use crate::patches::PatchSet;
use crate::pool::{PagePool, PagedKv};
use crate::radix::RadixCache;
use crate::EngineError;

pub use step::{log_sum_exp, token_logprob, top_logprobs};
pub use types::*;

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
    model: &'m dyn ModelFamily,
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
    /// Prefill side of a disaggregated deployment: finished requests keep
    /// their pages (and their tokens here) until [`Scheduler::release_held`].
    hold_finished: bool,
    held: BTreeMap<RequestId, Vec<u32>>,
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
    pub fn new(
        model: &'m dyn ModelFamily,
        cfg: EngineConfig,
        threads: Threads,
    ) -> Result<Self, EngineError> {
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
        let pool = PagePool::new(cfg.page_size, cfg.pool_pages, model.kv_layout())?;
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
            hold_finished: false,
            held: BTreeMap::new(),
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
        model: &'m dyn ModelFamily,
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
        let vocab = self.model.vocab_size();
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
