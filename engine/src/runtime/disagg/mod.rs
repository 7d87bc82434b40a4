//! Prefill/decode disaggregation: a prefill engine and a decode engine, each
//! a [`Scheduler`] with its own KV pool, radix cache and batch, joined by a
//! link that carries [`PdMessage`]s (serde values: what a socket between two
//! processes would carry; here both engines live in one process and the
//! link is a pair of queues).
//!
//! A request's life, after SGLang's disaggregation (bootstrap, pre-allocated
//! decode pages, K/V written into them by the prefill side, then decode):
//! 1. it arrives on the prefill engine as a one-token request and is
//!    announced to the decode engine (`Bootstrap`);
//! 2. the decode engine reserves pages for its prompt (`Reserve`), FCFS, only
//!    when what every reserved or decoding request may still need fits
//!    beside it, so that admitted requests always run to their end;
//! 3. the prefill engine computes the prompt and draws the first token from
//!    the prompt's last row (`Prefilled`); its pages are held;
//! 4. the link carries the prompt's K/V, one prefill page per `Transfer`, at
//!    most [`PdConfig::transfer_pages_per_step`] per step, into the reserved
//!    pages; then `Complete` (the first token and its row go along), and the
//!    prefill engine releases the pages into its prefix cache (an orphaned
//!    writer, see `pd-abort-reuses-pages`, finishes late: it writes only
//!    while no live reservation is being filled);
//! 5. at the next step boundary the decode engine admits it (`Admit`) as a
//!    running request that holds its prompt's K/V and decodes from there.
//!
//! A step: aborts due, bootstraps, admissions, reservations; the prefill
//! engine's step; first tokens, transfers and completions; the decode
//! engine's step. An abort reaches a request at whatever [`Stage`] it is in
//! and undoes exactly what that stage holds. Three catalog patches change
//! the abort path (`pd-abort-reuses-pages`, `pd-abort-incomplete-kv`,
//! `pd-abort-leaks`, see [`crate::patches`]).
//!
//! Contract: for every request, the tokens and logits bits equal the
//! colocated engine's (and the request's alone, cache off) whatever the two
//! engines' page sizes, pools, budgets and chunking: the K/V moved is the
//! K/V a recompute writes (I3, I4), the first token is drawn from the same
//! row at the same position, and a request's digest chains on across the
//! two engines. Every decision is data: [`PdEngine::step_replay`] re-executes
//! a recorded step with both engines' recorded decisions.

pub mod types;

use std::collections::{BTreeMap, VecDeque};

use lmrr_kernels::Threads;

use crate::model::ModelFamily;
use crate::patches::{Patch, PatchSet};
use crate::pool::PageId;
use crate::scheduler::{EngineConfig, Request, RequestId, RequestOutput, Scheduler, StepReport};
use crate::{EngineError, FinishReason};

pub use types::*;

/// A request the deployment still tracks.
struct Flight {
    req: Request,
    stage: Stage,
    /// The decode engine's reservation, as the prefill side was told it.
    pages: Option<Vec<PageId>>,
    /// First token and the row it was drawn from.
    first: Option<(u32, Vec<f32>)>,
    /// Transfers sent (prefill pages of the prompt).
    sent: usize,
    /// The prefill engine's result (first token, digest, cache hit).
    prefill_out: Option<RequestOutput>,
    /// Aborted with its writer still going (`pd-abort-reuses-pages`).
    orphan: bool,
}

/// The two queues of the link.
#[derive(Default)]
struct Link {
    to_decode: VecDeque<PdMessage>,
    to_prefill: VecDeque<PdMessage>,
}

/// A disaggregated deployment: two engines and the link between them.
pub struct PdEngine<'m> {
    prefill: Scheduler<'m>,
    decode: Scheduler<'m>,
    cfg: PdConfig,
    patches: PatchSet,
    context: usize,
    link: Link,
    flights: BTreeMap<RequestId, Flight>,
    /// Arrived since the last boundary, not yet announced to the decode side.
    arrived: Vec<RequestId>,
    /// Announced, waiting for a reservation (decode side), FCFS.
    reserve_queue: VecDeque<RequestId>,
    /// Prefilled and reserved: transfers to send, FCFS (orphans included).
    sending: VecDeque<RequestId>,
    /// Complete, waiting for admission (decode side).
    transferred: VecDeque<RequestId>,
    pending_aborts: Vec<RequestId>,
    done: BTreeMap<RequestId, RequestOutput>,
    /// Decode reservations of aborted requests never released, pages each.
    leaked: BTreeMap<RequestId, usize>,
    step: u64,
    stalled: u64,
    stall_limit: u64,
}

impl<'m> PdEngine<'m> {
    /// A deployment whose prefill engine runs `prefill` and decode engine
    /// `cfg.decode`, both under `patches`.
    pub fn new(
        model: &'m dyn ModelFamily,
        prefill: EngineConfig,
        cfg: PdConfig,
        threads: Threads,
        patches: PatchSet,
    ) -> Result<Self, EngineError> {
        if cfg.transfer_pages_per_step == 0 {
            return Err(EngineError::InvalidOption {
                name: "transfer_pages_per_step",
                value: "0".into(),
                why: "the link must carry at least 1 page per step".into(),
            });
        }
        let mut p = Scheduler::with_patches(model, prefill, threads.clone(), patches.clone())?;
        let mut d = Scheduler::with_patches(model, cfg.decode, threads, patches.clone())?;
        p.set_hold_finished(true);
        p.set_keep_rows(true);
        // The deployment judges progress as a whole (an engine waiting on
        // the other is not stuck).
        p.set_stall_limit(u64::MAX);
        d.set_stall_limit(u64::MAX);
        let context = model.context();
        // The colocated engine's bound, at the smaller of the two budgets.
        let budget = prefill.max_batch_tokens.min(cfg.decode.max_batch_tokens);
        let stall_limit =
            crate::scheduler::MIN_STALL_LIMIT.max(4 * context.div_ceil(budget) as u64);
        Ok(Self {
            prefill: p,
            decode: d,
            cfg,
            patches,
            context,
            link: Link::default(),
            flights: BTreeMap::new(),
            arrived: Vec::new(),
            reserve_queue: VecDeque::new(),
            sending: VecDeque::new(),
            transferred: VecDeque::new(),
            pending_aborts: Vec::new(),
            done: BTreeMap::new(),
            leaked: BTreeMap::new(),
            step: 0,
            stalled: 0,
            stall_limit,
        })
    }

    pub fn config(&self) -> &PdConfig {
        &self.cfg
    }

    /// The prefill engine's configuration.
    pub fn prefill_config(&self) -> &EngineConfig {
        self.prefill.config()
    }

    pub fn patches(&self) -> &PatchSet {
        &self.patches
    }

    /// One of the two engines.
    pub fn engine(&self, side: Side) -> &Scheduler<'m> {
        match side {
            Side::Prefill => &self.prefill,
            Side::Decode => &self.decode,
        }
    }

    /// Reports the `k` most likely tokens of every sampled row, both sides.
    pub fn set_top_logprobs(&mut self, k: usize) {
        self.prefill.set_top_logprobs(k);
        self.decode.set_top_logprobs(k);
    }

    /// Keeps the decode engine's sampled rows too (the prefill engine's are
    /// always kept: the first row travels to the decode engine).
    pub fn set_keep_rows(&mut self, keep: bool) {
        self.decode.set_keep_rows(keep);
    }

    /// Overrides the livelock bound (at least 1).
    pub fn set_stall_limit(&mut self, steps: u64) {
        self.stall_limit = steps.max(1);
    }

    pub fn stall_limit(&self) -> u64 {
        self.stall_limit
    }

    /// Steps taken so far.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// Queues a request: the prefill engine gets it as a one-token request;
    /// the decode engine hears of it at the next boundary. Refuses one that
    /// could never fit either engine.
    pub fn submit(&mut self, req: Request) -> Result<(), EngineError> {
        let id = req.id;
        if self.flights.contains_key(&id) || self.done.contains_key(&id) {
            return Err(EngineError::InvalidOption {
                name: "request id",
                value: id.to_string(),
                why: "already submitted".into(),
            });
        }
        if req.max_tokens == 0 {
            return Err(EngineError::ZeroMaxTokens);
        }
        let d = self.decode.config();
        let need = self.decode.pages_needed(req.prompt.len(), req.max_tokens);
        if need > d.pool_pages {
            return Err(EngineError::NeverFits {
                id: format!("{id} (decode engine)"),
                tokens: (req.prompt.len().saturating_add(req.max_tokens)).min(self.context),
                need_pages: need,
                pool_pages: d.pool_pages,
                page_size: d.page_size,
            });
        }
        self.prefill.submit(Request {
            max_tokens: 1,
            ..req.clone()
        })?;
        self.flights.insert(
            id,
            Flight {
                req,
                stage: Stage::QueuedForPrefill,
                pages: None,
                first: None,
                sent: 0,
                prefill_out: None,
                orphan: false,
            },
        );
        self.arrived.push(id);
        Ok(())
    }

    /// Requests an abort of `id` at the next step boundary. `false` if the
    /// request already ended.
    pub fn interrupt(&mut self, id: RequestId) -> Result<bool, EngineError> {
        if self.done.contains_key(&id) {
            return Ok(false);
        }
        if !self.flights.contains_key(&id) {
            return Err(EngineError::InvalidOption {
                name: "interrupt",
                value: id.to_string(),
                why: "no such request".into(),
            });
        }
        if !self.pending_aborts.contains(&id) {
            self.pending_aborts.push(id);
        }
        Ok(true)
    }

    /// Nothing in flight anywhere (leaked reservations are not work).
    pub fn is_idle(&self) -> bool {
        self.flights.is_empty()
            && self.pending_aborts.is_empty()
            && self.prefill.is_idle()
            && self.decode.is_idle()
    }

    /// Tokens generated so far, as the client sees them.
    pub fn generated(&self, id: RequestId) -> Option<&[u32]> {
        if let Some(o) = self.done.get(&id) {
            return Some(&o.tokens);
        }
        let f = self.flights.get(&id)?;
        match (&f.stage, &f.first) {
            (Stage::Decoding, _) => self.decode.generated(id),
            (_, Some((t, _))) => Some(std::slice::from_ref(t)),
            _ => Some(&[]),
        }
    }

    /// The result of a finished request.
    pub fn output(&self, id: RequestId) -> Option<&RequestOutput> {
        self.done.get(&id)
    }

    /// Removes and returns the result of a finished request.
    pub fn take_output(&mut self, id: RequestId) -> Option<RequestOutput> {
        self.done.remove(&id)
    }

    /// Whether a request has ended or ends at the next step boundary.
    pub fn has_ended(&self, id: RequestId) -> bool {
        self.done.contains_key(&id) || self.pending_aborts.contains(&id)
    }

    /// All finished requests by id.
    pub fn outputs(&self) -> &BTreeMap<RequestId, RequestOutput> {
        &self.done
    }

    /// Where a live request is.
    pub fn stage(&self, id: RequestId) -> Option<Stage> {
        let f = self.flights.get(&id)?;
        if f.orphan {
            return None;
        }
        Some(match f.stage {
            Stage::QueuedForPrefill | Stage::Prefilling if self.prefill.is_waiting(id) => {
                Stage::QueuedForPrefill
            }
            Stage::QueuedForPrefill => Stage::Prefilling,
            s => s,
        })
    }

    /// Decode reservations never released (the `pd-abort-leaks` bug), by
    /// request: pages each.
    pub fn leaked(&self) -> &BTreeMap<RequestId, usize> {
        &self.leaked
    }

    /// Pool accounting of both engines ([`Scheduler::check_accounting`]).
    pub fn check_accounting(&self) -> Result<(), String> {
        self.prefill
            .check_accounting()
            .map_err(|e| format!("prefill engine: {e}"))?;
        self.decode
            .check_accounting()
            .map_err(|e| format!("decode engine: {e}"))
    }

    /// Decides and runs one step.
    pub fn step(&mut self) -> Result<PdStep, EngineError> {
        self.run_step(None)
    }

    /// Re-executes a recorded step: both engines execute their recorded
    /// decisions and go on with the recorded tokens; the deployment's own
    /// events (bootstraps, reservations, transfers, admissions) are decided
    /// afresh, for the caller to compare with the recording.
    pub fn step_replay(&mut self, rec: &PdStep) -> Result<PdStep, EngineError> {
        self.run_step(Some(rec))
    }

    fn run_step(&mut self, rec: Option<&PdStep>) -> Result<PdStep, EngineError> {
        if self.stalled >= self.stall_limit {
            return Err(EngineError::Livelock {
                step: self.step,
                stalled: self.stalled,
                report: self.livelock_report(),
            });
        }
        let mut before = Vec::new();
        let mut finished = Vec::new();
        for id in std::mem::take(&mut self.pending_aborts) {
            self.abort(id, &mut before, &mut finished)?;
        }
        for id in std::mem::take(&mut self.arrived) {
            if let Some(f) = self.flights.get(&id) {
                self.link.to_decode.push_back(PdMessage::Bootstrap {
                    request: f.req.clone(),
                });
            }
        }
        self.decode_receive(&mut before)?;
        while let Some(id) = self.transferred.pop_front() {
            let Some(f) = self.flights.get_mut(&id) else {
                continue;
            };
            let Some((token, row)) = f.first.as_ref() else {
                continue;
            };
            self.decode.admit_prefilled(f.req.clone(), *token, row)?;
            f.stage = Stage::Decoding;
            before.push(PdEvent::Admit { id });
        }
        self.reserve(&mut before)?;
        self.prefill_receive();
        let prefill = match rec {
            Some(r) => self
                .prefill
                .step_replay(r.prefill.decisions.clone(), forced(&r.prefill))?,
            None => self.prefill.step()?,
        };
        let mut link = Vec::new();
        self.prefilled(&prefill, &mut link, &mut finished);
        self.transfer(&mut link)?;
        self.decode_receive(&mut link)?;
        let decode = match rec {
            Some(r) => self
                .decode
                .step_replay(r.decode.decisions.clone(), forced(&r.decode))?,
            None => self.decode.step()?,
        };
        for &(id, reason) in &decode.finished {
            let Some(mut out) = self.decode.take_output(id) else {
                continue;
            };
            if let Some(f) = self.flights.remove(&id) {
                if let Some(p) = f.prefill_out {
                    out.cached_tokens = p.cached_tokens;
                    out.preemptions += p.preemptions;
                }
            }
            out.finish = reason;
            self.done.insert(id, out);
            finished.push((id, reason));
        }
        let progress = !before.is_empty()
            || !link.is_empty()
            || !finished.is_empty()
            || [&prefill, &decode]
                .iter()
                .any(|r| r.seqs.iter().any(|s| s.sampled.is_some()));
        self.stalled = if progress || self.is_idle() {
            0
        } else {
            self.stalled + 1
        };
        let out = PdStep {
            step: self.step,
            before,
            prefill,
            link,
            decode,
            finished,
        };
        self.step += 1;
        Ok(out)
    }

    /// Applies an abort at the stage it finds the request in.
    fn abort(
        &mut self,
        id: RequestId,
        before: &mut Vec<PdEvent>,
        finished: &mut Vec<(RequestId, FinishReason)>,
    ) -> Result<(), EngineError> {
        let Some(stage) = self.stage(id) else {
            return Ok(());
        };
        before.push(PdEvent::Abort { id, stage });
        let total = self.transfers_of(id);
        let Some((reserved, sent)) = self.flights.get(&id).map(|f| (f.pages.is_some(), f.sent))
        else {
            return Ok(());
        };
        match stage {
            Stage::QueuedForPrefill | Stage::Prefilling => {
                // The prefill engine applies it as its step's first decision.
                self.prefill.interrupt(id)?;
                self.reserve_queue.retain(|&r| r != id);
                self.arrived.retain(|&r| r != id);
                self.decode.unreserve(id);
                if let Some(f) = self.flights.get_mut(&id) {
                    f.pages = None;
                }
            }
            Stage::Transferring => {
                if reserved && self.patches.contains(Patch::PdAbortIncompleteKv) {
                    // The bug: the sender concludes the aborted transfer as a
                    // success; the decode side admits on what it received.
                    self.sending.retain(|&r| r != id);
                    self.prefill.release_held(id);
                    before.push(PdEvent::Complete {
                        id,
                        pages_sent: sent,
                        pages_total: total,
                    });
                    if let Some(f) = self.flights.get_mut(&id) {
                        f.stage = Stage::Transferred;
                    }
                    self.transferred.push_back(id);
                    return Ok(());
                }
                if reserved && sent < total && self.patches.contains(Patch::PdAbortReusesPages) {
                    // The bug: the decode side frees its reservation at once;
                    // nobody tells the writer, which goes on.
                    self.decode.unreserve(id);
                    if let Some(f) = self.flights.get_mut(&id) {
                        f.orphan = true;
                    }
                } else {
                    self.link.to_prefill.push_back(PdMessage::Abort { id });
                    self.sending.retain(|&r| r != id);
                    self.reserve_queue.retain(|&r| r != id);
                    self.prefill.release_held(id);
                    self.decode.unreserve(id);
                }
                self.end_interrupted(id, finished);
            }
            Stage::Transferred => {
                self.transferred.retain(|&r| r != id);
                if self.patches.contains(Patch::PdAbortLeaks) {
                    // The bug: dropped from the admission queue, its pages kept.
                    let pages = self.decode.pages_of(id);
                    self.leaked.insert(id, pages);
                    before.push(PdEvent::Leak { id, pages });
                } else {
                    self.decode.unreserve(id);
                }
                self.end_interrupted(id, finished);
            }
            Stage::Decoding => {
                self.decode.interrupt(id)?;
            }
        }
        Ok(())
    }

    /// Ends a request aborted between the two engines: the client has its
    /// first token. An orphan stays tracked until its writer finishes.
    fn end_interrupted(&mut self, id: RequestId, finished: &mut Vec<(RequestId, FinishReason)>) {
        let Some(f) = self.flights.get_mut(&id) else {
            return;
        };
        let mut out = f.prefill_out.clone().unwrap_or(RequestOutput {
            id,
            prompt_len: f.req.prompt.len(),
            tokens: Vec::new(),
            finish: FinishReason::Interrupted,
            digest: [0; 32],
            cached_tokens: 0,
            preemptions: 0,
        });
        out.finish = FinishReason::Interrupted;
        if !f.orphan {
            self.flights.remove(&id);
        }
        self.done.insert(id, out);
        finished.push((id, FinishReason::Interrupted));
    }

    /// Transfers a request's prompt takes (prefill pages).
    fn transfers_of(&self, id: RequestId) -> usize {
        self.flights.get(&id).map_or(0, |f| {
            f.req.prompt.len().div_ceil(self.prefill.config().page_size)
        })
    }

    /// The decode engine's side of the link.
    fn decode_receive(&mut self, events: &mut Vec<PdEvent>) -> Result<(), EngineError> {
        while let Some(m) = self.link.to_decode.pop_front() {
            match m {
                PdMessage::Bootstrap { request } => {
                    events.push(PdEvent::Bootstrap {
                        id: request.id,
                        positions: request.prompt.len(),
                    });
                    self.reserve_queue.push_back(request.id);
                }
                PdMessage::Kv {
                    start, pages, rows, ..
                } => {
                    // Written where the sender was told, whoever holds the page.
                    self.decode.write_rows(&pages, start, &rows)?;
                }
                PdMessage::Done { id, .. } => {
                    if let Some(f) = self.flights.get_mut(&id) {
                        if f.orphan {
                            self.flights.remove(&id);
                        } else if self.decode.is_reserved(id) {
                            f.stage = Stage::Transferred;
                            self.transferred.push_back(id);
                        }
                    }
                }
                PdMessage::Reserved { .. } | PdMessage::Abort { .. } => {}
            }
        }
        Ok(())
    }

    /// The prefill engine's side of the link.
    fn prefill_receive(&mut self) {
        while let Some(m) = self.link.to_prefill.pop_front() {
            if let PdMessage::Reserved { id, pages } = m {
                if let Some(f) = self.flights.get_mut(&id) {
                    f.pages = Some(pages);
                    if f.stage == Stage::Transferring && !self.sending.contains(&id) {
                        self.sending.push_back(id);
                    }
                }
            }
        }
    }

    /// Decode side: reservations, FCFS, the head blocking the rest, each
    /// only when every reserved or decoding request can still reach its
    /// end beside it.
    fn reserve(&mut self, events: &mut Vec<PdEvent>) -> Result<(), EngineError> {
        while let Some(&id) = self.reserve_queue.front() {
            let Some(f) = self.flights.get(&id) else {
                self.reserve_queue.pop_front();
                continue;
            };
            let (p, max) = (f.req.prompt.len(), f.req.max_tokens);
            let headroom: usize = self
                .flights
                .iter()
                .filter(|(&r, g)| !g.orphan && self.decode.pages_of(r) > 0)
                .map(|(&r, g)| {
                    self.decode
                        .pages_needed(g.req.prompt.len(), g.req.max_tokens)
                        .saturating_sub(self.decode.pages_of(r))
                })
                .sum();
            let need = self.decode.pages_needed(p, max);
            if self.decode.available_pages() < headroom + need {
                break;
            }
            let Some(pages) = self.decode.reserve(id, p)? else {
                break;
            };
            self.reserve_queue.pop_front();
            events.push(PdEvent::Reserve {
                id,
                pages: pages.clone(),
            });
            self.link
                .to_prefill
                .push_back(PdMessage::Reserved { id, pages });
        }
        Ok(())
    }

    /// The prefill engine's finished requests: ended there, or on to transfer.
    fn prefilled(
        &mut self,
        r: &StepReport,
        link: &mut Vec<PdEvent>,
        finished: &mut Vec<(RequestId, FinishReason)>,
    ) {
        for &(id, reason) in &r.finished {
            let Some(mut out) = self.prefill.take_output(id) else {
                continue;
            };
            if reason == FinishReason::Interrupted {
                self.flights.remove(&id);
                self.done.insert(id, out);
                finished.push((id, reason));
                continue;
            }
            let Some(&token) = out.tokens.first() else {
                continue;
            };
            let row = self.prefill.last_row(id).unwrap_or(&[]).to_vec();
            let Some(f) = self.flights.get_mut(&id) else {
                continue;
            };
            // The colocated engine's order: EOS, then max_tokens, then context.
            let end = match reason {
                FinishReason::Length if f.req.max_tokens > 1 => {
                    (f.req.prompt.len() + 1 > self.context).then_some(FinishReason::Context)
                }
                other => Some(other),
            };
            link.push(PdEvent::Prefilled {
                id,
                token,
                finish: end,
            });
            if let Some(end) = end {
                self.flights.remove(&id);
                self.prefill.release_held(id);
                self.decode.unreserve(id);
                self.reserve_queue.retain(|&q| q != id);
                out.finish = end;
                self.done.insert(id, out);
                finished.push((id, end));
                continue;
            }
            f.first = Some((token, row));
            f.prefill_out = Some(out);
            f.stage = Stage::Transferring;
            if f.pages.is_some() {
                self.sending.push_back(id);
            }
        }
    }

    /// The link's transfers of this step, FCFS over the requests ready.
    fn transfer(&mut self, link: &mut Vec<PdEvent>) -> Result<(), EngineError> {
        let ps = self.prefill.config().page_size;
        let mut budget = self.cfg.transfer_pages_per_step;
        loop {
            // Live transfers first, FCFS; an orphaned writer finishes late:
            // it writes only while no live reservation is being filled.
            let live = self
                .sending
                .iter()
                .copied()
                .find(|id| self.flights.get(id).is_some_and(|f| !f.orphan));
            let filling = self.flights.values().any(|f| {
                !f.orphan
                    && f.pages.is_some()
                    && matches!(
                        f.stage,
                        Stage::QueuedForPrefill | Stage::Prefilling | Stage::Transferring
                    )
            });
            let id = match (live, self.sending.front()) {
                (Some(id), _) => id,
                (None, Some(&id)) if !filling => id,
                _ => break,
            };
            let total = self.transfers_of(id);
            let Some(f) = self.flights.get_mut(&id) else {
                self.sending.retain(|&r| r != id);
                continue;
            };
            let (Some(pages), Some((token, row))) = (f.pages.clone(), f.first.clone()) else {
                self.sending.retain(|&r| r != id);
                continue;
            };
            if f.sent < total {
                if budget == 0 {
                    break;
                }
                let start = f.sent * ps;
                let len = ps.min(f.req.prompt.len() - start);
                f.sent += 1;
                let orphan = f.orphan;
                let rows = self.prefill.held_rows(id, start, len)?;
                let bits: Vec<u8> = rows
                    .iter()
                    .flat_map(|x| x.to_bits().to_le_bytes())
                    .collect();
                let d = self.decode.config().page_size;
                let last = (start + len).div_ceil(d).min(pages.len());
                link.push(PdEvent::Transfer {
                    id,
                    start,
                    len,
                    pages: pages[(start / d).min(last)..last].to_vec(),
                    digest: crate::digest::bytes_digest(&bits),
                    orphan,
                });
                self.link.to_decode.push_back(PdMessage::Kv {
                    id,
                    start,
                    len,
                    pages,
                    rows,
                });
                budget -= 1;
                continue;
            }
            self.sending.retain(|&r| r != id);
            self.prefill.release_held(id);
            link.push(PdEvent::Complete {
                id,
                pages_sent: total,
                pages_total: total,
            });
            self.link
                .to_decode
                .push_back(PdMessage::Done { id, token, row });
        }
        Ok(())
    }

    /// What a livelock report shows: both pools, leaked reservations, and
    /// where each live request waits.
    fn livelock_report(&self) -> String {
        let mut s = format!(
            "prefill engine: {}\ndecode engine: {}",
            self.prefill.pool_summary(),
            self.decode.pool_summary()
        );
        if !self.leaked.is_empty() {
            let pages: usize = self.leaked.values().sum();
            let list: Vec<String> = self
                .leaked
                .iter()
                .map(|(id, n)| format!("request {id} ({n} pages)"))
                .collect();
            s += &format!(
                "\nleaked: {pages} decode pages are held by {} requests aborted after their K/V \
                 was transferred and never admitted, and are never released: {}",
                self.leaked.len(),
                list.join(", ")
            );
            if self.decode.free_pages() < self.decode.config().pool_pages {
                s += &format!(
                    "\nthe decode pool is exhausted by them: {} of {} pages free, no reservation fits",
                    self.decode.free_pages(),
                    self.decode.config().pool_pages
                );
            }
        }
        for (id, f) in &self.flights {
            let need = self
                .decode
                .pages_needed(f.req.prompt.len(), f.req.max_tokens);
            s += &format!(
                "\n  request {id}: {}{}",
                self.stage(*id)
                    .map_or("orphaned transfer".into(), |st| st.to_string()),
                if self.reserve_queue.contains(id) {
                    format!(", waiting for a decode reservation of {need} pages")
                } else {
                    String::new()
                }
            );
        }
        s
    }
}

/// The tokens a recorded report sampled, to go on with in a replay.
fn forced(r: &StepReport) -> BTreeMap<RequestId, u32> {
    r.seqs
        .iter()
        .filter_map(|s| s.sampled.map(|t| (s.id, t)))
        .collect()
}
