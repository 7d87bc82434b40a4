//! The engine loop: one thread that owns the [`lmrr_engine::Scheduler`] (or,
//! with `--disaggregate`, the prefill and decode engines of a
//! [`lmrr_engine::PdEngine`], see [`crate::deploy`]) and the bundle, and that
//! every HTTP handler talks to through channels.
//!
//! Handlers send a validated, tokenized [`Submission`] into a bounded inbox
//! and read [`Update`]s from the submission's own bounded channel. The loop
//! runs step boundaries back to back while there is work; at each boundary,
//! in the session driver's order (`engine/src/session.rs`), so that
//! `lmrr inspect --script` reproduces the bundle exactly:
//!
//! 1. interrupts, in request id order, for live requests whose client went
//!    away (its update channel is closed), whose output met a stop sequence,
//!    or all of them when the server shuts down;
//! 2. arrivals: submissions waiting in the inbox get the next request id
//!    (0, 1, … per bundle, in arrival order) and are submitted; the arrival
//!    step recorded is the scheduler's step count;
//! 3. interrupts of requests that arrived already abandoned;
//! 4. one step, recorded whole, whose sampled tokens are
//!    detokenized and sent to their clients.
//!
//! Idle time is not recorded: when nothing is waiting, running or pending
//! the loop flushes the bundle and blocks on the inbox without stepping, so
//! a server idle for an hour adds no step, and the next arrival's step is the
//! one the engine is at. Arrival steps are engine steps, never wall-clock
//! times: replaying them re-creates the same batches.
//!
//! The loop never blocks on a client: every update is a `try_send` into a
//! channel sized for the whole request (at most one text update per sampled
//! token, the held-back text at the end, the start and the end), so it cannot
//! be full. A client that stops reading
//! costs at most that buffer; its request runs to its end like any other and
//! releases its KV pages then. A client that disconnects is an interrupt at
//! the next boundary: the scheduler's abort path, the one scripted
//! `interrupt_after_tokens` takes, and the one the incident went through.
//!
//! Logprobs (OpenAI's `logprobs`): when a live request asks for them, the
//! step keeps its sampled logits rows (`Scheduler::set_keep_rows`, off
//! otherwise: a row is a vocabulary of f32 per sequence), and each sampled
//! token of such a request becomes a [`TokenLogprob`] computed with the
//! engine's own [`token_logprob`] and [`top_logprobs`] (the functions
//! behind the bundle's recorded top-5: the same logits give the same bits
//! wherever they are computed), of the raw logits (before temperature,
//! top-k, top-p). It travels in the same [`Update::Text`] as
//! the text of its step, which the detokenizer or the stop matcher may still
//! hold back: an entry can arrive before its text. Invariant: a request's
//! entries, concatenated, are its sampled tokens in order, each once, up to
//! and including the one that completed a stop sequence, except an EOS that
//! ends the request: it is neither text nor entry (OpenAI's and llama.cpp's
//! servers leave `<|im_end|>` out of `content` too), so the entries' bytes,
//! joined, are the response text's bytes. What is recorded is unchanged: the bundle's top-5 logprobs
//! come from the scheduler's own report, whatever clients ask.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::mpsc;

use lmrr_engine::scheduler::{token_logprob, top_logprobs, Request, RequestId, StepReport};
use lmrr_engine::{
    EngineConfig, EngineError, FinishReason, Model, ModelFamily, PatchSet, SamplingParams,
};
use lmrr_kernels::Threads;
use lmrr_recorder::{Event, Manifest};

use crate::detok::{Detok, Stopper};
use crate::error::{ApiError, ServeError};
use crate::record::{Bundle, BundleDir, Rotation};

/// The one place the server reaches into the model's network: the scheduler
/// runs it, and the context, vocabulary and EOS come from it.
pub fn net(model: &Model) -> &dyn ModelFamily {
    model.net()
}

/// Top-k logprobs recorded per sampled token (as `lmrr run --record`).
pub const TOP_LOGPROBS: usize = 5;

/// Which endpoint a request came from (its id prefix).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Chat,
    Completion,
}

/// A validated request on its way to the engine.
#[derive(Debug)]
pub struct Submission {
    pub kind: Kind,
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    /// `None`: the request's seed is its id in the bundle.
    pub seed: Option<u64>,
    /// Already clamped to what the context allows.
    pub max_tokens: usize,
    pub stop_at_eos: bool,
    pub stop: Vec<String>,
    /// Whether `max_tokens` was clamped (the finish reason is then `length`).
    pub clamped: bool,
    /// `Some(k)`: a [`TokenLogprob`] with `k` alternatives per token.
    pub logprobs: Option<usize>,
    pub updates: mpsc::Sender<Update>,
}

impl Submission {
    /// Capacity of the update channel: never full (see the module header).
    pub fn channel_capacity(max_tokens: usize) -> usize {
        max_tokens.saturating_add(4)
    }
}

/// How a request ended, for its client.
#[derive(Debug, Clone, PartialEq)]
pub struct Finish {
    /// OpenAI's `finish_reason`: `stop` or `length`.
    pub reason: &'static str,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
    /// The request's digest (same definition as `lmrr generate`'s), hex.
    pub digest: String,
}

/// One sampled token's log-probabilities (ids only: the handler turns them
/// into text and bytes).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    /// [`token_logprob`] of the row; `None` for a row of NaNs.
    pub logprob: Option<f32>,
    /// [`top_logprobs`] of the row: the `k` most likely, best first.
    pub top: Vec<(u32, f32)>,
}

/// What the engine tells a handler.
#[derive(Debug, Clone, PartialEq)]
pub enum Update {
    /// The request arrived in the engine under this name.
    Started {
        name: String,
        bundle: Option<String>,
        step: u64,
    },
    /// More text (maybe empty when only `logprobs` has news), and the
    /// logprobs of the tokens sampled since the last update, when asked for.
    Text {
        text: String,
        logprobs: Vec<TokenLogprob>,
    },
    Finished(Finish),
    Failed(ApiError),
}

enum Inbox {
    Submit(Box<Submission>),
    /// Look at the shutdown flag.
    Wake,
}

/// Counters for `/health` and the log.
#[derive(Debug, Default)]
pub struct Stats {
    pub requests: AtomicU64,
    pub live: AtomicU64,
    pub steps: AtomicU64,
    pub interrupts: AtomicU64,
    /// Microseconds inside `Scheduler::step`.
    pub step_us: AtomicU64,
    /// Microseconds the loop was not waiting for work (steps, boundaries,
    /// recording, detokenization).
    pub busy_us: AtomicU64,
    pub alive: AtomicBool,
}

/// The handlers' side of the engine.
#[derive(Clone)]
pub struct EngineHandle {
    inbox: mpsc::Sender<Inbox>,
    shutdown: Arc<AtomicBool>,
    pub stats: Arc<Stats>,
}

impl EngineHandle {
    /// Queues a submission; refused with 503 when the inbox is full or the
    /// engine has stopped.
    pub fn submit(&self, s: Submission) -> Result<(), ApiError> {
        if self.shutdown.load(Ordering::SeqCst) {
            return Err(ApiError::overloaded("the server is shutting down"));
        }
        self.inbox
            .try_send(Inbox::Submit(Box::new(s)))
            .map_err(|e| match e {
                mpsc::error::TrySendError::Full(_) => ApiError::overloaded(format!(
                    "{} requests are queued for the engine; retry later",
                    self.inbox.max_capacity()
                )),
                mpsc::error::TrySendError::Closed(_) => {
                    ApiError::server("the engine loop has stopped")
                }
            })
    }

    /// Asks the loop to interrupt everything, close the bundle and stop.
    pub fn shutdown(&self) {
        self.shutdown.store(true, Ordering::SeqCst);
        let _ = self.inbox.try_send(Inbox::Wake);
    }
}

#[cfg(test)]
impl EngineHandle {
    /// A handle on no engine: tests feed a response's updates by hand.
    pub(crate) fn detached() -> Self {
        let (inbox, _) = mpsc::channel(1);
        Self {
            inbox,
            shutdown: Arc::new(AtomicBool::new(true)),
            stats: Arc::new(Stats::default()),
        }
    }
}

/// Everything the loop needs.
pub struct EngineSetup {
    pub model: Arc<Model>,
    pub engine: EngineConfig,
    pub threads: Threads,
    pub patches: PatchSet,
    /// Recording: the directory, rotation limits and the manifest every
    /// bundle starts from (its `source` is filled in per bundle).
    pub record: Option<(BundleDir, Rotation, Manifest)>,
    /// Inbox capacity.
    pub queue: usize,
    /// Log a line per request.
    pub log_requests: bool,
    /// A disaggregated deployment's decode engine and link (`engine` is
    /// then its prefill engine).
    pub pd: Option<lmrr_engine::PdConfig>,
}

/// A request the loop is serving.
struct Live {
    name: String,
    tx: mpsc::Sender<Update>,
    detok: Detok,
    stopper: Stopper,
    prompt_len: usize,
    generated: usize,
    clamped: bool,
    logprobs: Option<usize>,
    /// Interrupt at the next boundary (a stop sequence completed, or the
    /// channel refused an update).
    end_now: bool,
    arrived: Instant,
    first_token: Option<Instant>,
}

/// Starts the loop on its own thread.
pub fn spawn(
    setup: EngineSetup,
) -> Result<
    (
        EngineHandle,
        std::thread::JoinHandle<Result<(), ServeError>>,
    ),
    ServeError,
> {
    let (tx, rx) = mpsc::channel(setup.queue.max(1));
    let shutdown = Arc::new(AtomicBool::new(false));
    let stats = Arc::new(Stats::default());
    stats.alive.store(true, Ordering::SeqCst);
    let handle = EngineHandle {
        inbox: tx,
        shutdown: shutdown.clone(),
        stats: stats.clone(),
    };
    let join = std::thread::Builder::new()
        .name("lmrr-engine".into())
        .spawn(move || {
            /// Marks the loop dead however it ends, a panic included, so
            /// that `/health` says so.
            struct Alive<'a>(&'a Stats);
            impl Drop for Alive<'_> {
                fn drop(&mut self) {
                    self.0.alive.store(false, Ordering::SeqCst);
                }
            }
            let _alive = Alive(&stats);
            let r = run(setup, rx, &shutdown, &stats);
            if let Err(e) = &r {
                eprintln!("lmrr serve: engine loop stopped: {e}");
            }
            r
        })?;
    Ok((handle, join))
}

/// One bundle's worth of engine: a fresh scheduler and its bundle.
struct Epoch<'m> {
    sch: crate::deploy::Deployment<'m>,
    bundle: Option<Bundle>,
    live: BTreeMap<RequestId, Live>,
    next_id: RequestId,
    index: u64,
}

/// What every epoch is made from.
struct EpochCtx<'a> {
    model: &'a Model,
    engine: EngineConfig,
    threads: &'a Threads,
    patches: &'a PatchSet,
    pd: Option<lmrr_engine::PdConfig>,
}

impl<'a> EpochCtx<'a> {
    /// A fresh scheduler, and its bundle when recording.
    fn open(
        &self,
        record: &mut Option<(BundleDir, Rotation, Manifest)>,
        index: u64,
    ) -> Result<Epoch<'a>, ServeError> {
        let mut sch = crate::deploy::Deployment::new(
            net(self.model),
            self.engine,
            self.pd,
            self.threads.clone(),
            self.patches.clone(),
        )?;
        let bundle = match record {
            None => None,
            Some((dir, _, manifest)) => {
                sch.set_top_logprobs(TOP_LOGPROBS);
                let mut b = dir.open(manifest)?;
                if let Some(e) = sch.first_event() {
                    b.push(e)?;
                }
                log(format!("recording into {}", b.path.display()));
                Some(b)
            }
        };
        Ok(Epoch {
            sch,
            bundle,
            live: BTreeMap::new(),
            next_id: 0,
            index,
        })
    }
}

fn log(msg: impl AsRef<str>) {
    eprintln!("lmrr serve: {}", msg.as_ref());
}

fn run(
    setup: EngineSetup,
    mut inbox: mpsc::Receiver<Inbox>,
    shutdown: &AtomicBool,
    stats: &Stats,
) -> Result<(), ServeError> {
    let model = setup.model.clone();
    let mut record = setup.record;
    let mut epochs = 0u64;
    let ctx = EpochCtx {
        model: &model,
        engine: setup.engine,
        threads: &setup.threads,
        patches: &setup.patches,
        pd: setup.pd,
    };
    let open_epoch =
        |record: &mut Option<(BundleDir, Rotation, Manifest)>, index: u64| ctx.open(record, index);
    let mut ep = open_epoch(&mut record, epochs)?;
    let mut pending: VecDeque<Box<Submission>> = VecDeque::new();
    let mut inbox_open = true;
    let mut busy_since = Instant::now();
    loop {
        let stopping = shutdown.load(Ordering::SeqCst) || !inbox_open;
        let rotate = !stopping
            && ep
                .bundle
                .as_ref()
                .zip(record.as_ref())
                .is_some_and(|(b, (_, r, _))| b.due(r));
        if ep.sch.is_idle() && ep.live.is_empty() {
            if stopping {
                break;
            }
            if rotate {
                close(&mut ep)?;
                epochs += 1;
                ep = open_epoch(&mut record, epochs)?;
                continue;
            }
            if pending.is_empty() {
                if let Some(b) = ep.bundle.as_mut() {
                    b.flush()?;
                }
                stats
                    .busy_us
                    .fetch_add(busy_since.elapsed().as_micros() as u64, Ordering::Relaxed);
                let got = inbox.blocking_recv();
                busy_since = Instant::now();
                match got {
                    Some(Inbox::Submit(s)) => pending.push_back(s),
                    Some(Inbox::Wake) => {}
                    None => inbox_open = false,
                }
                continue;
            }
        }
        // While a rotation drains the engine, arrivals wait in the inbox.
        if !rotate {
            loop {
                match inbox.try_recv() {
                    Ok(Inbox::Submit(s)) => pending.push_back(s),
                    Ok(Inbox::Wake) => {}
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => {
                        inbox_open = false;
                        break;
                    }
                }
            }
        }
        let stopping = shutdown.load(Ordering::SeqCst) || !inbox_open;
        boundary(&mut ep, &mut pending, stopping, rotate, stats)?;
        if ep.sch.is_idle() {
            continue;
        }
        let keep_rows = ep.live.values().any(|l| l.logprobs.is_some());
        ep.sch.set_keep_rows(keep_rows);
        let t0 = Instant::now();
        let stepped = ep.sch.step();
        stats
            .step_us
            .fetch_add(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
        match stepped {
            Ok(stepped) => {
                stats.steps.fetch_add(1, Ordering::Relaxed);
                if let Some(b) = ep.bundle.as_mut() {
                    b.push(stepped.event)?;
                }
                deliver(&mut ep, &stepped.report, &model, setup.log_requests, stats);
            }
            Err(e) => {
                // The scheduler cannot go on (a livelock under a patch, the
                // pool out of memory): its requests fail, the bundle keeps
                // every step up to here, and a fresh epoch starts.
                log(format!("engine error, starting a fresh engine: {e}"));
                for (_, l) in std::mem::take(&mut ep.live) {
                    let _ = l.tx.try_send(Update::Failed(ApiError::server(format!(
                        "the engine stopped: {e}"
                    ))));
                }
                stats.live.store(0, Ordering::Relaxed);
                close(&mut ep)?;
                epochs += 1;
                ep = open_epoch(&mut record, epochs)?;
            }
        }
    }
    for s in pending {
        let _ = s.updates.try_send(Update::Failed(ApiError::overloaded(
            "the server is shutting down",
        )));
    }
    close(&mut ep)?;
    Ok(())
}

/// Closes the epoch's bundle with its trailer.
fn close(ep: &mut Epoch<'_>) -> Result<(), ServeError> {
    if let Some(b) = ep.bundle.take() {
        let (n, steps) = (b.requests, ep.sch.steps());
        let path = b.finish()?;
        log(format!(
            "closed {} ({n} requests, {steps} steps)",
            path.display()
        ));
    }
    Ok(())
}

/// Interrupts `id` at this boundary and records it.
fn interrupt(ep: &mut Epoch<'_>, id: RequestId, stats: &Stats) -> Result<(), ServeError> {
    let step = ep.sch.steps();
    let Some(l) = ep.live.get(&id) else {
        return Ok(());
    };
    if ep.sch.has_ended(id) {
        return Ok(());
    }
    if let Some(b) = ep.bundle.as_mut() {
        b.push(Event::Interrupt {
            step,
            name: l.name.clone(),
            id,
        })?;
    }
    ep.sch.interrupt(id)?;
    stats.interrupts.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

/// Interrupts due, then arrivals, then interrupts of abandoned arrivals.
fn boundary(
    ep: &mut Epoch<'_>,
    pending: &mut VecDeque<Box<Submission>>,
    stopping: bool,
    rotate: bool,
    stats: &Stats,
) -> Result<(), ServeError> {
    let due: Vec<RequestId> = ep
        .live
        .iter()
        .filter(|(_, l)| stopping || l.end_now || l.tx.is_closed())
        .map(|(&id, _)| id)
        .collect();
    for id in due {
        interrupt(ep, id, stats)?;
    }
    if stopping {
        for s in pending.drain(..) {
            let _ = s.updates.try_send(Update::Failed(ApiError::overloaded(
                "the server is shutting down",
            )));
        }
        return Ok(());
    }
    if rotate {
        return Ok(());
    }
    let first_new = ep.next_id;
    for s in pending.drain(..) {
        let id = ep.next_id;
        let req = Request {
            id,
            prompt: s.prompt,
            sampling: SamplingParams {
                seed: s.seed.unwrap_or(id),
                ..s.sampling
            },
            max_tokens: s.max_tokens,
            stop_at_eos: s.stop_at_eos,
        };
        if let Err(e) = ep.sch.submit(req.clone()) {
            let _ = s.updates.try_send(Update::Failed(refusal(&e)));
            continue;
        }
        ep.next_id += 1;
        let step = ep.sch.steps();
        let name = format!(
            "{}-{}-{id}",
            match s.kind {
                Kind::Chat => "chatcmpl",
                Kind::Completion => "cmpl",
            },
            ep.index
        );
        if let Some(b) = ep.bundle.as_mut() {
            b.push(Event::Arrival {
                step,
                name: name.clone(),
                request: req.clone(),
            })?;
        }
        stats.requests.fetch_add(1, Ordering::Relaxed);
        let bundle = ep.bundle.as_ref().map(|b| b.name.clone());
        let _ = s.updates.try_send(Update::Started {
            name: name.clone(),
            bundle,
            step,
        });
        ep.live.insert(
            id,
            Live {
                name,
                tx: s.updates,
                detok: Detok::default(),
                stopper: Stopper::new(s.stop),
                prompt_len: req.prompt.len(),
                generated: 0,
                clamped: s.clamped,
                logprobs: s.logprobs,
                end_now: false,
                arrived: Instant::now(),
                first_token: None,
            },
        );
    }
    stats.live.store(ep.live.len() as u64, Ordering::Relaxed);
    let abandoned: Vec<RequestId> = ep
        .live
        .range(first_new..)
        .filter(|(_, l)| l.tx.is_closed())
        .map(|(&id, _)| id)
        .collect();
    for id in abandoned {
        interrupt(ep, id, stats)?;
    }
    Ok(())
}

/// A scheduler's refusal of a submission, for the client.
fn refusal(e: &EngineError) -> ApiError {
    match e {
        EngineError::PromptTooLong { .. } | EngineError::EmptyPrompt => {
            ApiError::invalid("messages", e.to_string()).with_code("context_length_exceeded")
        }
        EngineError::NeverFits { .. } => {
            ApiError::invalid("max_tokens", e.to_string()).with_code("context_length_exceeded")
        }
        EngineError::TokenOutOfRange { .. } => ApiError::invalid("prompt", e.to_string()),
        EngineError::InvalidOption { name, .. } => ApiError::invalid(*name, e.to_string()),
        _ => ApiError::server(e.to_string()),
    }
}

/// Sends a step's tokens and endings to their clients.
fn deliver(
    ep: &mut Epoch<'_>,
    report: &StepReport,
    model: &Model,
    log_requests: bool,
    stats: &Stats,
) {
    for s in &report.seqs {
        let Some(t) = s.sampled else { continue };
        let Some(l) = ep.live.get_mut(&s.id) else {
            continue;
        };
        l.generated += 1;
        l.first_token.get_or_insert_with(Instant::now);
        if l.stopper.hit() {
            continue;
        }
        // An EOS that ends the request is not part of the answer: no text
        // (its `<|im_end|>` stays out of `content`) and no entry, as OpenAI
        // and llama.cpp answer.
        if s.finish == Some(FinishReason::Eos) {
            continue;
        }
        let mut logprobs = Vec::new();
        if let Some(k) = l.logprobs {
            let row = ep.sch.last_rows().iter().find(|(id, _)| *id == s.id);
            logprobs.push(TokenLogprob {
                token: t,
                logprob: row.and_then(|(_, r)| token_logprob(r, t)),
                top: row.map_or_else(Vec::new, |(_, r)| top_logprobs(r, k)),
            });
        }
        let piece = l.detok.push(&model.tokenizer, t);
        let text = l.stopper.push(&piece);
        if (!text.is_empty() || !logprobs.is_empty())
            && l.tx.try_send(Update::Text { text, logprobs }).is_err()
        {
            // Closed (the client left) or full (cannot happen: the channel
            // holds the whole request): either way, end it.
            l.end_now = true;
        }
        if l.stopper.hit() {
            l.end_now = true;
        }
    }
    for &(id, reason) in &report.finished {
        let Some(mut l) = ep.live.remove(&id) else {
            continue;
        };
        let out = ep.sch.take_output(id);
        let (cached, digest) = out.as_ref().map_or((0, String::new()), |o| {
            (o.cached_tokens, lmrr_engine::digest::hex(&o.digest))
        });
        let fin = |reason: &'static str| Finish {
            reason,
            prompt_tokens: l.prompt_len,
            completion_tokens: l.generated,
            cached_tokens: cached,
            digest: digest.clone(),
        };
        let outcome = match reason {
            FinishReason::Interrupted if l.stopper.hit() => {
                let _ = l.tx.try_send(Update::Finished(fin("stop")));
                "stop sequence"
            }
            FinishReason::Interrupted if l.tx.is_closed() => "interrupted: client gone",
            FinishReason::Interrupted => {
                let _ = l.tx.try_send(Update::Failed(ApiError::overloaded(
                    "the server is shutting down",
                )));
                "interrupted: shutdown"
            }
            r => {
                let rest = l.detok.flush(&model.tokenizer);
                let mut text = l.stopper.push(&rest);
                let hit = l.stopper.hit();
                text += &l.stopper.flush();
                if !text.is_empty() {
                    let _ = l.tx.try_send(Update::Text {
                        text,
                        logprobs: Vec::new(),
                    });
                }
                let why = match r {
                    _ if hit => "stop",
                    FinishReason::Eos => "stop",
                    _ => "length",
                };
                let _ = l.tx.try_send(Update::Finished(fin(why)));
                match r {
                    FinishReason::Eos => "eos",
                    FinishReason::Context => "context full",
                    _ if l.clamped => "length (max_tokens clamped to the context)",
                    _ => "length",
                }
            }
        };
        if log_requests {
            let ttft = l.first_token.map_or("-".to_string(), |t| {
                format!("{} ms", (t - l.arrived).as_millis())
            });
            log(format!(
                "{} {} prompt + {} generated ({} cached) · {outcome} · step {} · first token {ttft} · {} ms",
                l.name,
                l.prompt_len,
                l.generated,
                cached,
                report.step,
                l.arrived.elapsed().as_millis()
            ));
        }
    }
    stats.live.store(ep.live.len() as u64, Ordering::Relaxed);
}
