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
//! A request has `prompt` (raw text) or `messages` (ChatML), optional
//! `max_tokens`, `temperature`, `top_k`, `top_p`, `seed`, `ignore_eos`,
//! `at_step` (arrive at that engine step, default 0), `after` (arrive once that
//! request ended), and `interrupt_after_tokens`. A `from` message depends on its
//! source like `after` does. Errors — unknown fields, unknown ids, dependency
//! cycles, requests that can never fit in the pool — name the line or the id.
//! Arrivals and interrupts are applied at step boundaries, in script order.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use serde::Deserialize;
use toml::Spanned;

use crate::chat::{Content, Message, Part};
use crate::scheduler::{Request, RequestId, RequestOutput, Scheduler, StepReport};
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
            let prompt = match (r.prompt, r.messages) {
                (Some(p), None) => PromptSpec::Raw(p),
                (None, Some(ms)) => {
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
                        "needs exactly one of `prompt` and `messages`".into(),
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
                max_tokens: r.max_tokens.or(d.max_tokens).unwrap_or(64),
                stop_at_eos: !r.ignore_eos.or(d.ignore_eos).unwrap_or(false),
                at_step,
                deps,
                interrupt_after_tokens: r.interrupt_after_tokens,
            });
        }
        let script = Script {
            requests,
            source: src.to_string(),
        };
        script.check_cycles(path)?;
        Ok(script)
    }

    fn check_cycles(&self, path: &str) -> Result<(), ScriptError> {
        let idx: BTreeMap<&str, usize> = self
            .requests
            .iter()
            .enumerate()
            .map(|(i, r)| (r.name.as_str(), i))
            .collect();
        // 0 = unvisited, 1 = on stack, 2 = done.
        let mut state = vec![0u8; self.requests.len()];
        fn dfs(
            i: usize,
            s: &Script,
            idx: &BTreeMap<&str, usize>,
            state: &mut [u8],
            stack: &mut Vec<usize>,
        ) -> Option<Vec<usize>> {
            state[i] = 1;
            stack.push(i);
            for d in &s.requests[i].deps {
                let j = idx[d.as_str()];
                if state[j] == 1 {
                    let from = stack.iter().position(|&x| x == j).unwrap_or(0);
                    let mut c = stack[from..].to_vec();
                    c.push(j);
                    return Some(c);
                }
                if state[j] == 0 {
                    if let Some(c) = dfs(j, s, idx, state, stack) {
                        return Some(c);
                    }
                }
            }
            stack.pop();
            state[i] = 2;
            None
        }
        for i in 0..self.requests.len() {
            if state[i] == 0 {
                if let Some(c) = dfs(i, self, &idx, &mut state, &mut Vec::new()) {
                    let names: Vec<&str> =
                        c.iter().map(|&k| self.requests[k].name.as_str()).collect();
                    return Err(ScriptError::Cycle {
                        path: path.into(),
                        cycle: names.join(" → "),
                    });
                }
            }
        }
        Ok(())
    }

    /// Checks, before anything runs, that every request fits the model's context
    /// and the pool in the worst case (spliced outputs at their `max_tokens`).
    pub fn check_fits(&self, model: &Model, sch: &Scheduler) -> Result<(), EngineError> {
        let by_name: BTreeMap<&str, &ScriptRequest> =
            self.requests.iter().map(|r| (r.name.as_str(), r)).collect();
        for r in &self.requests {
            let mut len = 0;
            for part in parts(model, &r.prompt)? {
                len += match part {
                    Part::Text(t) => model.tokenizer.encode(&t)?.len(),
                    Part::Output(id) => by_name[id.as_str()].max_tokens,
                };
            }
            if len > model.llama.context() {
                return Err(EngineError::InvalidOption {
                    name: "request",
                    value: r.name.clone(),
                    why: format!(
                        "its prompt can reach {len} tokens, the model's context is {}",
                        model.llama.context()
                    ),
                });
            }
            let need = sch.pages_needed(len, r.max_tokens);
            if need > sch.config().pool_pages {
                return Err(EngineError::NeverFits {
                    id: r.name.clone(),
                    tokens: (len + r.max_tokens).min(model.llama.context()),
                    need_pages: need,
                    pool_pages: sch.config().pool_pages,
                    page_size: sch.config().page_size,
                });
            }
        }
        Ok(())
    }
}

fn parts(model: &Model, p: &PromptSpec) -> Result<Vec<Part>, EngineError> {
    match p {
        PromptSpec::Raw(t) => Ok(vec![Part::Text(t.clone())]),
        PromptSpec::Chat(ms) => model.render_chat(ms),
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
}

/// Plays `script` on `sch`. Request ids are script positions. `observe` sees
/// every arrival, interrupt and step report, in order.
pub fn run_session(
    model: &Model,
    script: &Script,
    sch: &mut Scheduler,
    mut observe: impl FnMut(SessionEvent<'_>),
) -> Result<SessionResult, EngineError> {
    script.check_fits(model, sch)?;
    let eos = |t: u32| model.llama.config().is_eos(t);
    let idx: BTreeMap<&str, RequestId> = script
        .requests
        .iter()
        .enumerate()
        .map(|(i, r)| (r.name.as_str(), i as RequestId))
        .collect();
    let mut submitted: BTreeMap<RequestId, (u64, Vec<u32>)> = BTreeMap::new();
    let mut interrupted: BTreeSet<RequestId> = BTreeSet::new();
    loop {
        let step = sch.steps();
        // Interrupts first, so that a request waiting on an interrupted one
        // arrives at the same boundary; then arrivals; then interrupts again
        // for requests that just arrived with `interrupt_after_tokens = 0`.
        for pass in 0..2 {
            for (i, r) in script.requests.iter().enumerate() {
                let id = i as RequestId;
                let Some(k) = r.interrupt_after_tokens else {
                    continue;
                };
                if interrupted.contains(&id) || sch.output(id).is_some() {
                    continue;
                }
                if sch.generated(id).is_some_and(|g| g.len() >= k) {
                    observe(SessionEvent::Interrupt {
                        step,
                        name: &r.name,
                        id,
                    });
                    sch.interrupt(id)?;
                    interrupted.insert(id);
                }
            }
            if pass == 1 {
                break;
            }
            for (i, r) in script.requests.iter().enumerate() {
                let id = i as RequestId;
                if submitted.contains_key(&id) || r.at_step > step {
                    continue;
                }
                if !r.deps.iter().all(|d| sch.has_ended(idx[d.as_str()])) {
                    continue;
                }
                let mut prompt = Vec::new();
                for part in parts(model, &r.prompt)? {
                    match part {
                        Part::Text(t) => prompt.extend(model.tokenizer.encode(&t)?),
                        Part::Output(src) => {
                            let out = sch
                                .generated(idx[src.as_str()])
                                .expect("dependency submitted");
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
                submitted.insert(id, (step, prompt));
            }
        }
        if submitted.len() == script.requests.len() && sch.is_idle() {
            break;
        }
        let report = sch.step()?;
        observe(SessionEvent::Step(&report));
    }
    let requests = script
        .requests
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let id = i as RequestId;
            let (arrived_at_step, prompt) = submitted.remove(&id).expect("all submitted");
            RequestResult {
                name: r.name.clone(),
                id,
                arrived_at_step,
                prompt,
                output: sch.output(id).expect("all ended").clone(),
            }
        })
        .collect();
    Ok(SessionResult {
        requests,
        steps: sch.steps(),
    })
}
