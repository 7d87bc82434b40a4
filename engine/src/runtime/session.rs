//! Session scripts: multi-request, multi-turn sessions in TOML, validated
//! before anything runs, and the driver that plays them on a [`Scheduler`].
//!
//! Format (documented with examples in README.md):
//!
//! ```toml
//! [defaults]                 # optional; any per-request sampling field
//! max_tokens = 64
//!
//! [[request]]
//! id = "turn1"
//! messages = [{ role = "user", content = "write a tic tac toe html page" }]
//! interrupt_after_tokens = 60
//!
//! [[request]]
//! id = "turn2"
//! after = "turn1"            # arrives when turn1 finishes or is interrupted
//! messages = [
//!   { role = "user", content = "write a tic tac toe html page" },
//!   { role = "assistant", from = "turn1" },   # turn1's output, possibly partial
//!   { role = "user", content = "to a file" },
//! ]
//! ```
//!
//! A request has `prompt` (raw text), `prompt_tokens` (token ids) or
//! `messages` (the model's chat template), optional
//! `max_tokens` (at least 1), `temperature`, `top_k`, `top_p`, `seed`,
//! `ignore_eos`, `at_step` (arrive at that engine step, default 0), `after`
//! (arrive once that request ended), `interrupt_after_tokens` (abort once that
//! many tokens are out) and `interrupt_at_step` (abort at the boundary before
//! that engine step — mid-prefill if the prompt is still being computed in
//! chunks, as a client disconnect can; a request arriving later is aborted on
//! arrival). A `from` message depends on its source like `after` does. Errors —
//! unknown fields, unknown ids, dependency cycles, requests that can never fit
//! in the pool — name the line or the id.
//!
//! Arrivals and interrupts are applied at step boundaries, in script order:
//! first the interrupts that are due, then the arrivals whose step has come and
//! whose dependencies have ended (an interrupted request counts as ended at
//! once), then the interrupts due for requests that just arrived.
//!
//! The driver is event-driven so that its cost is linear in the script: each
//! request keeps a count of its unfinished dependencies, decremented when one
//! ends; interrupts due are kept in a set filled from the step reports and an
//! index by step. Nothing scans the whole script per step.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;

use serde::Deserialize;
use toml::Spanned;

use crate::chat::{Content, Message, Part};
use crate::disagg::{PdEngine, PdStep};
use crate::scheduler::{EngineConfig, Request, RequestId, RequestOutput, Scheduler, StepReport};
use crate::{EngineError, Model, SamplingParams};

/// Largest `at_step` accepted (a session is replayed step by step).
pub const MAX_AT_STEP: u64 = 100_000;

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct Defaults {
    max_tokens: Option<usize>,
    temperature: Option<f32>,
    top_k: Option<usize>,
    top_p: Option<f32>,
    seed: Option<u64>,
    ignore_eos: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMessage {
    role: String,
    content: Option<String>,
    from: Option<Spanned<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRequest {
    id: Spanned<String>,
    prompt: Option<String>,
    prompt_tokens: Option<Vec<u32>>,
    messages: Option<Vec<RawMessage>>,
    max_tokens: Option<usize>,
    temperature: Option<f32>,
    top_k: Option<usize>,
    top_p: Option<f32>,
    seed: Option<u64>,
    ignore_eos: Option<bool>,
    at_step: Option<u64>,
    after: Option<Spanned<String>>,
    interrupt_after_tokens: Option<usize>,
    interrupt_at_step: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawScript {
    #[serde(default)]
    defaults: Defaults,
    #[serde(default)]
    request: Vec<RawRequest>,
}

/// What a request's prompt is made of.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptSpec {
    Raw(String),
    Chat(Vec<Message>),
    /// Token ids, sent as they are (`prompt_tokens = [..]`; what `lmrr
    /// inspect --script` writes when a prompt's text would not tokenize back
    /// to the recorded ids).
    Tokens(Vec<u32>),
}

/// One validated request of a script.
#[derive(Debug, Clone, PartialEq)]
pub struct ScriptRequest {
    pub name: String,
    pub prompt: PromptSpec,
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    pub stop_at_eos: bool,
    pub at_step: u64,
    /// Requests that must end before this one arrives (`after` and `from`).
    pub deps: Vec<String>,
    pub interrupt_after_tokens: Option<usize>,
    /// Abort at the boundary before this engine step (or on arrival, if later).
    pub interrupt_at_step: Option<u64>,
}

/// A validated session script.
#[derive(Debug, Clone, PartialEq)]
pub struct Script {
    pub requests: Vec<ScriptRequest>,
    /// The source text, as recorded in bundles.
    pub source: String,
}

/// Errors in a script, each naming the line or the request.
#[derive(Debug, thiserror::Error)]
pub enum ScriptError {
    #[error("{path}: {msg}")]
    Parse { path: String, msg: String },
    #[error("{path}:{line}: {msg}")]
    At {
        path: String,
        line: usize,
        msg: String,
    },
    #[error("{path}: request `{id}`: {msg}")]
    Request {
        path: String,
        id: String,
        msg: String,
    },
    #[error("{path}: dependency cycle: {cycle}")]
    Cycle { path: String, cycle: String },
}

fn line_of(src: &str, offset: usize) -> usize {
    src[..offset.min(src.len())]
        .bytes()
        .filter(|&b| b == b'\n')
        .count()
        + 1
}

impl Script {
    /// Reads and validates a script file.
    pub fn load(path: &Path) -> Result<Self, ScriptError> {
        let src = std::fs::read_to_string(path).map_err(|e| ScriptError::Parse {
            path: path.display().to_string(),
            msg: e.to_string(),
        })?;
        Self::parse(&src, &path.display().to_string())
    }

    /// Parses and validates script text; `path` is used in messages.
    pub fn parse(src: &str, path: &str) -> Result<Self, ScriptError> {
        let raw: RawScript = toml::from_str(src).map_err(|e| ScriptError::Parse {
            path: path.into(),
            msg: e.to_string().trim_end().to_string(),
        })?;
        let at = |span: std::ops::Range<usize>, msg: String| ScriptError::At {
            path: path.into(),
            line: line_of(src, span.start),
            msg,
        };
        let d = &raw.defaults;
        if d.max_tokens == Some(0) {
            return Err(ScriptError::Parse {
                path: path.into(),
                msg: format!("[defaults] max_tokens = 0: {MAX_TOKENS_WHY}"),
            });
        }
        let mut names = BTreeMap::new();
        for r in &raw.request {
            if names.insert(r.id.get_ref().clone(), r.id.span()).is_some() {
                return Err(at(
                    r.id.span(),
                    format!("duplicate request id `{}`", r.id.get_ref()),
                ));
            }
        }
        if raw.request.is_empty() {
            return Err(ScriptError::Parse {
                path: path.into(),
                msg: "no [[request]] in the script".into(),
            });
        }
        let mut requests = Vec::new();
        for r in raw.request {
            let name = r.id.get_ref().clone();
            let req_err = |msg: String| ScriptError::Request {
                path: path.into(),
                id: name.clone(),
                msg,
            };
            let mut deps = Vec::new();
            let check_ref = |s: &Spanned<String>, what: &str| -> Result<String, ScriptError> {
                if !names.contains_key(s.get_ref()) {
                    return Err(at(
                        s.span(),
                        format!(
                            "{what} refers to request `{}`, which does not exist",
                            s.get_ref()
                        ),
                    ));
                }
                Ok(s.get_ref().clone())
            };
            if let Some(a) = &r.after {
                deps.push(check_ref(a, "`after`")?);
            }
            let prompt = match (r.prompt, r.messages, r.prompt_tokens) {
                (Some(p), None, None) => PromptSpec::Raw(p),
                (None, None, Some(t)) => {
                    if t.is_empty() {
                        return Err(req_err("`prompt_tokens` is empty".into()));
                    }
                    PromptSpec::Tokens(t)
                }
                (None, Some(ms), None) => {
                    if ms.is_empty() {
                        return Err(req_err("`messages` is empty".into()));
                    }
                    let mut out = Vec::new();
                    for m in ms {
                        if !["system", "user", "assistant"].contains(&m.role.as_str()) {
                            return Err(req_err(format!(
                                "unknown role `{}` (system, user, assistant)",
                                m.role
                            )));
                        }
                        let content = match (m.content, m.from) {
                            (Some(c), None) => Content::Text(c),
                            (None, Some(f)) => {
                                let src_id = check_ref(&f, "`from`")?;
                                deps.push(src_id.clone());
                                Content::OutputOf(src_id)
                            }
                            _ => {
                                return Err(req_err(
                                    "each message needs exactly one of `content` and `from`".into(),
                                ))
                            }
                        };
                        out.push(Message {
                            role: m.role,
                            content,
                        });
                    }
                    PromptSpec::Chat(out)
                }
                _ => {
                    return Err(req_err(
                        "needs exactly one of `prompt` and `messages` (or `prompt_tokens`)".into(),
                    ))
                }
            };
            let sampling = SamplingParams {
                temperature: r.temperature.or(d.temperature).unwrap_or(0.0),
                top_k: r.top_k.or(d.top_k).unwrap_or(0),
                top_p: r.top_p.or(d.top_p).unwrap_or(1.0),
                seed: r.seed.or(d.seed).unwrap_or(0),
            };
            sampling.validate().map_err(|e| req_err(e.to_string()))?;
            let at_step = r.at_step.unwrap_or(0);
            if at_step > MAX_AT_STEP {
                return Err(req_err(format!(
                    "at_step = {at_step} exceeds the limit of {MAX_AT_STEP}"
                )));
            }
            if let Some(n) = r.interrupt_at_step {
                if n > MAX_AT_STEP {
                    return Err(req_err(format!(
                        "interrupt_at_step = {n} exceeds the limit of {MAX_AT_STEP}"
                    )));
                }
                if n < at_step {
                    return Err(req_err(format!(
                        "interrupt_at_step = {n} is before its arrival at at_step = {at_step}"
                    )));
                }
            }
            let max_tokens = r.max_tokens.or(d.max_tokens).unwrap_or(64);
            if max_tokens == 0 {
                return Err(req_err(format!("max_tokens = 0: {MAX_TOKENS_WHY}")));
            }
            if deps.contains(&name) {
                return Err(ScriptError::Cycle {
                    path: path.into(),
                    cycle: format!("{name} → {name}"),
                });
            }
            deps.sort();
            deps.dedup();
            requests.push(ScriptRequest {
                name,
                prompt,
                sampling,
                max_tokens,
                stop_at_eos: !r.ignore_eos.or(d.ignore_eos).unwrap_or(false),
                at_step,
                deps,
                interrupt_after_tokens: r.interrupt_after_tokens,
                interrupt_at_step: r.interrupt_at_step,
            });
        }
        let script = Script {
            requests,
            source: src.to_string(),
        };
        script.check_cycles(path)?;
        Ok(script)
    }

    /// Each request's dependencies as script positions, in `deps` order.
    /// An id that names no request is an error (a hand-built [`Script`]).
    fn dep_indices(&self) -> Result<Vec<Vec<usize>>, EngineError> {
        let idx: HashMap<&str, usize> = self
            .requests
            .iter()
            .enumerate()
            .map(|(i, r)| (r.name.as_str(), i))
            .collect();
        self.requests
            .iter()
            .map(|r| {
                r.deps
                    .iter()
                    .map(|d| {
                        idx.get(d.as_str())
                            .copied()
                            .ok_or_else(|| unknown_request(&r.name, d))
                    })
                    .collect()
            })
            .collect()
    }

    /// Depth-first search for a dependency cycle, with an explicit stack: a
    /// chain of 100,000 `after`s must not overflow the thread's stack.
    fn check_cycles(&self, path: &str) -> Result<(), ScriptError> {
        let deps = self.dep_indices().map_err(|e| ScriptError::Parse {
            path: path.into(),
            msg: e.to_string(),
        })?;
        // 0 = unvisited, 1 = on the stack, 2 = done.
        let mut state = vec![0u8; self.requests.len()];
        // (request, next dependency to visit)
        let mut stack: Vec<(usize, usize)> = Vec::new();
        for root in 0..self.requests.len() {
            if state[root] != 0 {
                continue;
            }
            state[root] = 1;
            stack.push((root, 0));
            while let Some((i, next)) = stack.last_mut() {
                let i = *i;
                let Some(&j) = deps[i].get(*next) else {
                    state[i] = 2;
                    stack.pop();
                    continue;
                };
                *next += 1;
                match state[j] {
                    0 => {
                        state[j] = 1;
                        stack.push((j, 0));
                    }
                    1 => {
                        let from = stack.iter().position(|&(x, _)| x == j).unwrap_or(0);
                        let mut names: Vec<&str> = stack[from..]
                            .iter()
                            .map(|&(k, _)| self.requests[k].name.as_str())
                            .collect();
                        names.push(self.requests[j].name.as_str());
                        return Err(ScriptError::Cycle {
                            path: path.into(),
                            cycle: cycle_text(&names),
                        });
                    }
                    _ => {}
                }
            }
        }
        Ok(())
    }

    /// Checks, before anything runs, that every request fits the model's context
    /// and the pool in the worst case (spliced outputs at their `max_tokens`).
    pub fn check_fits<E: SessionEngine + ?Sized>(
        &self,
        model: &Model,
        sch: &E,
    ) -> Result<(), EngineError> {
        let by_name: HashMap<&str, &ScriptRequest> =
            self.requests.iter().map(|r| (r.name.as_str(), r)).collect();
        for r in &self.requests {
            let mut len = match &r.prompt {
                PromptSpec::Tokens(t) => t.len(),
                PromptSpec::Raw(_) => usize::from(model.tokenizer.bos().is_some()),
                PromptSpec::Chat(_) => 0,
            };
            for part in parts(model, &r.prompt)? {
                len += match part {
                    Part::Text(t) => model.tokenizer.encode(&t)?.len(),
                    Part::Output(id) => {
                        by_name
                            .get(id.as_str())
                            .ok_or_else(|| unknown_request(&r.name, &id))?
                            .max_tokens
                    }
                };
            }
            if len > model.net.context() {
                return Err(EngineError::InvalidOption {
                    name: "request",
                    value: r.name.clone(),
                    why: format!(
                        "its prompt can reach {len} tokens, the model's context is {}",
                        model.net.context()
                    ),
                });
            }
            for (cfg, whole) in sch.pools() {
                let gen = if whole { r.max_tokens } else { 1 };
                let tokens = len.saturating_add(gen).min(model.net.context());
                let need = tokens.div_ceil(cfg.page_size);
                if need > cfg.pool_pages {
                    return Err(EngineError::NeverFits {
                        id: r.name.clone(),
                        tokens,
                        need_pages: need,
                        pool_pages: cfg.pool_pages,
                        page_size: cfg.page_size,
                    });
                }
            }
        }
        Ok(())
    }
}

/// A cycle's names joined by arrows; a long one keeps its first and last
/// four requests and says how many it left out.
fn cycle_text(names: &[&str]) -> String {
    const KEEP: usize = 4;
    if names.len() <= 2 * KEEP + 1 {
        return names.join(" → ");
    }
    let hidden = names.len() - 2 * KEEP;
    let mut n = hidden.to_string();
    let mut i = n.len();
    while i > 3 {
        i -= 3;
        n.insert(i, ',');
    }
    format!(
        "{} → … ({n} more) … → {}",
        names[..KEEP].join(" → "),
        names[names.len() - KEEP..].join(" → ")
    )
}

/// Why a script refuses `max_tokens = 0` (and the scheduler a request with it).
const MAX_TOKENS_WHY: &str = "a request generates at least 1 token (as in `lmrr generate`)";

fn unknown_request(of: &str, id: &str) -> EngineError {
    EngineError::InvalidOption {
        name: "request",
        value: of.into(),
        why: format!("depends on or splices `{id}`, which is not in the script"),
    }
}

fn parts(model: &Model, p: &PromptSpec) -> Result<Vec<Part>, EngineError> {
    match p {
        PromptSpec::Raw(t) => Ok(vec![Part::Text(t.clone())]),
        PromptSpec::Chat(ms) => model.render_chat(ms),
        PromptSpec::Tokens(_) => Ok(Vec::new()),
    }
}

/// A request's outcome in a session.
#[derive(Debug, Clone)]
pub struct RequestResult {
    pub name: String,
    pub id: RequestId,
    pub arrived_at_step: u64,
    pub prompt: Vec<u32>,
    pub output: RequestOutput,
}

/// The outcome of a session, requests in script order.
#[derive(Debug, Clone)]
pub struct SessionResult {
    pub requests: Vec<RequestResult>,
    pub steps: u64,
}

/// Everything the driver does besides stepping, for observers (the recorder).
#[derive(Debug, Clone)]
pub enum SessionEvent<'a> {
    Arrival {
        step: u64,
        name: &'a str,
        request: &'a Request,
    },
    Interrupt {
        step: u64,
        name: &'a str,
        id: RequestId,
    },
    Step(&'a StepReport),
    /// A step of a disaggregated deployment.
    PdStep(&'a PdStep),
}

/// What the session driver steps: the colocated [`Scheduler`], or a
/// disaggregated [`PdEngine`] (a prefill and a decode engine).
pub trait SessionEngine {
    /// Steps taken so far.
    fn steps(&self) -> u64;
    fn submit(&mut self, req: Request) -> Result<(), EngineError>;
    /// Requests an abort at the next step boundary (`false`: already ended).
    fn interrupt(&mut self, id: RequestId) -> Result<bool, EngineError>;
    /// Tokens generated so far by a live or finished request.
    fn generated(&self, id: RequestId) -> Option<&[u32]>;
    fn is_idle(&self) -> bool;
    fn output(&self, id: RequestId) -> Option<&RequestOutput>;
    /// Each KV pool's configuration, and whether it holds a request's
    /// generation too (a prefill engine's holds its prompt and one token).
    fn pools(&self) -> Vec<(EngineConfig, bool)>;
    /// Runs one step and shows it to `observe`; returns the requests that
    /// ended in it and those that drew a token.
    fn step_observed(
        &mut self,
        observe: &mut dyn FnMut(SessionEvent<'_>),
    ) -> Result<StepSummary, EngineError>;
}

/// What the session driver needs of a step.
#[derive(Debug, Clone, Default)]
pub struct StepSummary {
    pub finished: Vec<RequestId>,
    pub sampled: Vec<RequestId>,
}

impl SessionEngine for Scheduler<'_> {
    fn steps(&self) -> u64 {
        Scheduler::steps(self)
    }
    fn submit(&mut self, req: Request) -> Result<(), EngineError> {
        Scheduler::submit(self, req)
    }
    fn interrupt(&mut self, id: RequestId) -> Result<bool, EngineError> {
        Scheduler::interrupt(self, id)
    }
    fn generated(&self, id: RequestId) -> Option<&[u32]> {
        Scheduler::generated(self, id)
    }
    fn is_idle(&self) -> bool {
        Scheduler::is_idle(self)
    }
    fn output(&self, id: RequestId) -> Option<&RequestOutput> {
        Scheduler::output(self, id)
    }
    fn pools(&self) -> Vec<(EngineConfig, bool)> {
        vec![(*self.config(), true)]
    }
    fn step_observed(
        &mut self,
        observe: &mut dyn FnMut(SessionEvent<'_>),
    ) -> Result<StepSummary, EngineError> {
        let r = self.step()?;
        observe(SessionEvent::Step(&r));
        Ok(StepSummary {
            finished: r.finished.iter().map(|f| f.0).collect(),
            sampled: r
                .seqs
                .iter()
                .filter(|s| s.sampled.is_some())
                .map(|s| s.id)
                .collect(),
        })
    }
}

impl SessionEngine for PdEngine<'_> {
    fn steps(&self) -> u64 {
        PdEngine::steps(self)
    }
    fn submit(&mut self, req: Request) -> Result<(), EngineError> {
        PdEngine::submit(self, req)
    }
    fn interrupt(&mut self, id: RequestId) -> Result<bool, EngineError> {
        PdEngine::interrupt(self, id)
    }
    fn generated(&self, id: RequestId) -> Option<&[u32]> {
        PdEngine::generated(self, id)
    }
    fn is_idle(&self) -> bool {
        PdEngine::is_idle(self)
    }
    fn output(&self, id: RequestId) -> Option<&RequestOutput> {
        PdEngine::output(self, id)
    }
    fn pools(&self) -> Vec<(EngineConfig, bool)> {
        vec![
            (*self.prefill_config(), false),
            (self.config().decode, true),
        ]
    }
    fn step_observed(
        &mut self,
        observe: &mut dyn FnMut(SessionEvent<'_>),
    ) -> Result<StepSummary, EngineError> {
        let r = self.step()?;
        observe(SessionEvent::PdStep(&r));
        Ok(StepSummary {
            finished: r.finished.iter().map(|f| f.0).collect(),
            sampled: r
                .reports()
                .iter()
                .flat_map(|(_, rep)| rep.seqs.iter())
                .filter(|s| s.sampled.is_some())
                .map(|s| s.id)
                .collect(),
        })
    }
}

/// The driver's bookkeeping, all indexed by script position.
struct Driver {
    /// Requests waiting on each request.
    dependents: Vec<Vec<usize>>,
    /// Dependencies of each request that have not ended yet.
    unmet: Vec<usize>,
    /// Ended as dependencies see it: finished, or interrupt requested.
    ended: Vec<bool>,
    /// Requests with no unmet dependency, not yet submitted, by `at_step`.
    eligible: BTreeMap<u64, Vec<usize>>,
    /// Submitted requests' arrival step and prompt.
    submitted: Vec<Option<(u64, Vec<u32>)>>,
    n_submitted: usize,
    /// Live requests whose interrupt is due, to be requested at the boundary.
    due: BTreeSet<usize>,
    /// Live requests with an `interrupt_at_step` still ahead, by that step.
    timed_interrupts: BTreeMap<u64, Vec<usize>>,
}

impl Driver {
    fn end(&mut self, i: usize, script: &Script) {
        if std::mem::replace(&mut self.ended[i], true) {
            return;
        }
        self.due.remove(&i);
        for k in 0..self.dependents[i].len() {
            let d = self.dependents[i][k];
            self.unmet[d] -= 1;
            if self.unmet[d] == 0 {
                self.eligible
                    .entry(script.requests[d].at_step)
                    .or_default()
                    .push(d);
            }
        }
    }
}

/// Plays `script` on `sch`. Request ids are script positions. `observe` sees
/// every arrival, interrupt and step report, in order.
pub fn run_session<E: SessionEngine + ?Sized>(
    model: &Model,
    script: &Script,
    sch: &mut E,
    mut observe: impl FnMut(SessionEvent<'_>),
) -> Result<SessionResult, EngineError> {
    script.check_fits(model, sch)?;
    let eos = |t: u32| model.net.is_eos(t);
    let n = script.requests.len();
    let deps = script.dep_indices()?;
    let idx: HashMap<&str, usize> = script
        .requests
        .iter()
        .enumerate()
        .map(|(i, r)| (r.name.as_str(), i))
        .collect();
    let mut dv = Driver {
        dependents: vec![Vec::new(); n],
        unmet: deps.iter().map(Vec::len).collect(),
        ended: vec![false; n],
        eligible: BTreeMap::new(),
        submitted: vec![None; n],
        n_submitted: 0,
        due: BTreeSet::new(),
        timed_interrupts: BTreeMap::new(),
    };
    for (i, ds) in deps.iter().enumerate() {
        for &j in ds {
            dv.dependents[j].push(i);
        }
        if ds.is_empty() {
            dv.eligible
                .entry(script.requests[i].at_step)
                .or_default()
                .push(i);
        }
    }
    loop {
        let step = sch.steps();
        let later = dv.timed_interrupts.split_off(&(step + 1));
        for (_, ids) in std::mem::replace(&mut dv.timed_interrupts, later) {
            dv.due.extend(ids.into_iter().filter(|&i| !dv.ended[i]));
        }
        // Interrupts first, so that a request waiting on an interrupted one
        // arrives at the same boundary; then arrivals; then interrupts again
        // for requests that arrived already due (`interrupt_after_tokens = 0`,
        // or `interrupt_at_step` reached).
        for pass in 0..2 {
            for i in std::mem::take(&mut dv.due) {
                let r = &script.requests[i];
                let id = i as RequestId;
                observe(SessionEvent::Interrupt {
                    step,
                    name: &r.name,
                    id,
                });
                sch.interrupt(id)?;
                dv.end(i, script);
            }
            if pass == 1 {
                break;
            }
            let later = dv.eligible.split_off(&(step + 1));
            let ready: BTreeSet<usize> = std::mem::replace(&mut dv.eligible, later)
                .into_values()
                .flatten()
                .collect();
            for i in ready {
                let r = &script.requests[i];
                let id = i as RequestId;
                let mut prompt = match &r.prompt {
                    PromptSpec::Tokens(t) => t.clone(),
                    // A plain-text prompt starts with the model's BOS when its
                    // tokenizer config asks for one; a chat's template
                    // writes its own.
                    PromptSpec::Raw(_) => model.tokenizer.bos().into_iter().collect(),
                    PromptSpec::Chat(_) => Vec::new(),
                };
                for part in parts(model, &r.prompt)? {
                    match part {
                        Part::Text(t) => prompt.extend(model.tokenizer.encode(&t)?),
                        Part::Output(src) => {
                            let out = idx
                                .get(src.as_str())
                                .and_then(|&j| sch.generated(j as RequestId))
                                .ok_or_else(|| unknown_request(&r.name, &src))?;
                            let end = if out.last().is_some_and(|&t| eos(t)) {
                                out.len() - 1
                            } else {
                                out.len()
                            };
                            prompt.extend(&out[..end]);
                        }
                    }
                }
                let req = Request {
                    id,
                    prompt: prompt.clone(),
                    sampling: r.sampling,
                    max_tokens: r.max_tokens,
                    stop_at_eos: r.stop_at_eos,
                };
                observe(SessionEvent::Arrival {
                    step,
                    name: &r.name,
                    request: &req,
                });
                sch.submit(req)?;
                dv.submitted[i] = Some((step, prompt));
                dv.n_submitted += 1;
                if r.interrupt_after_tokens == Some(0) {
                    dv.due.insert(i);
                } else if let Some(at) = r.interrupt_at_step {
                    if at <= step {
                        dv.due.insert(i);
                    } else {
                        dv.timed_interrupts.entry(at).or_default().push(i);
                    }
                }
            }
        }
        if dv.n_submitted == n && sch.is_idle() {
            break;
        }
        if sch.is_idle() && dv.eligible.is_empty() {
            // Nothing live, nothing due to arrive: only a hand-built script
            // with a dependency cycle gets here.
            let waiting: Vec<&str> = (0..n)
                .filter(|&i| dv.submitted[i].is_none())
                .take(8)
                .map(|i| script.requests[i].name.as_str())
                .collect();
            return Err(EngineError::InvalidOption {
                name: "script",
                value: format!("{} requests never arrive", n - dv.n_submitted),
                why: format!(
                    "their dependencies can never end (first: {})",
                    waiting.join(", ")
                ),
            });
        }
        let report = sch.step_observed(&mut observe)?;
        for &id in &report.finished {
            if let Some(i) = usize::try_from(id).ok().filter(|&i| i < n) {
                dv.end(i, script);
            }
        }
        for &id in &report.sampled {
            let Some(i) = usize::try_from(id).ok().filter(|&i| i < n) else {
                continue;
            };
            let Some(k) = script.requests[i].interrupt_after_tokens else {
                continue;
            };
            if !dv.ended[i] && sch.generated(id).is_some_and(|g| g.len() >= k) {
                dv.due.insert(i);
            }
        }
    }
    let mut requests = Vec::with_capacity(n);
    for (i, (r, sub)) in script.requests.iter().zip(dv.submitted).enumerate() {
        let id = i as RequestId;
        let (Some((arrived_at_step, prompt)), Some(output)) = (sub, sch.output(id)) else {
            return Err(EngineError::InvalidOption {
                name: "request",
                value: r.name.clone(),
                why: "the session ended before it did".into(),
            });
        };
        requests.push(RequestResult {
            name: r.name.clone(),
            id,
            arrived_at_step,
            prompt,
            output: output.clone(),
        });
    }
    Ok(SessionResult {
        requests,
        steps: sch.steps(),
    })
}
