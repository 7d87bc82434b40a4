//! `lmrr audit`: checks what an upstream server answered, as recorded by
//! `lmrr proxy`, against lmrr's deterministic reference engine.
//!
//! Each recorded request is a turn. Its prompt is rebuilt as `lmrr serve`
//! builds it (the model's chat template, then its tokenizer); the upstream's
//! output tokens — recovered from its logprob entries (`bytes`, else the
//! token's text) looked up in this model's vocabulary, or, with no usable
//! entries, by tokenizing the text; a turn that answered with `tool_calls`
//! shows only the text outside its calls, so its tokens come from its entries
//! alone, and with none it is skipped — are teacher-forced through the reference
//! engine, and each is scored against the reference row it was drawn from:
//! its rank (ties to the lower id, as the sampler), its log-probability, the
//! gap to the reference's top choice, and, where the upstream returned
//! alternatives, the KL divergence between the two distributions. An
//! interrupted turn is cut where its client cut it (the chunks the client was
//! handed).
//!
//! Verdicts ([`Thresholds`] names the numbers and why):
//! - **faithful**: every greedy choice is the reference's or a near-tie, no
//!   token is improbable, and the KL stays at the level of rounding noise;
//!   *bit-faithful* when every returned logprob has the reference's bits;
//! - **drifted**: a greedy choice beyond a near-tie, or KL above the noise,
//!   but nothing improbable;
//! - **broken**: a token the reference finds improbable (below its top-5 and
//!   past a near-tie for a greedy turn; below [`Thresholds::improbable_logprob`]
//!   for a sampled one) — the signature of a corrupted context.
//!
//! Those are levels, turn by turn; [`change`] then judges the upstream
//! against itself (calibrated on the turns before the first interrupt or
//! cache hit) and names the change point: `broken after interrupt` for an
//! upstream that was bit-faithful and stops being so right after one.
//!
//! Context fidelity: for a chat turn with history, the reference log-probability
//! of the upstream's answer with the full history against the same answer
//! with the history removed (system messages and the last user message kept).
//! An answer that fits "no history" better is flagged as amnesia.
//!
//! Invariants: the reference rows are a pure function of the tokens, so the
//! same traffic and model always give the same report; logprobs are computed
//! with the functions `lmrr serve` uses, so an lmrr upstream is bit-faithful.
//! A traffic bundle is untrusted input: a turn that cannot be read is
//! skipped with its reason; a tokenizer that does not match the upstream's is
//! an error naming the first piece of text that does not round-trip.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::Value;

use lmrr_engine::scheduler::{token_logprob, top_logprobs};
use lmrr_engine::{LogitsWanted, Model, SeqKvStore, SeqSpan};
use lmrr_kernels::Threads;
use lmrr_recorder::traffic::{Outcome, TrafficBundle, TrafficEvent};

use crate::api::{self, ChatMessage, Prompt};
use crate::template::Renderer;

pub mod change;
mod recover;
mod text;

pub use change::{Calibration, ChangePoint, Event, UpstreamVerdict, CHANGE_FACTOR};
use recover::answer;
pub use recover::Vocab;

/// Most lossy entries one turn re-settles (each costs a forward pass).
const MAX_SWAPS: usize = 32;

/// The numbers behind the verdicts.
#[derive(Debug, Clone, Serialize)]
pub struct Thresholds {
    /// A greedy choice at rank > 1 whose reference log-probability is within
    /// this many nats of the top is a near-tie. llama.cpp's top-1 agrees with
    /// lmrr's wherever its own top-2 gap exceeds 1.5 (docs/REFERENCE.md:
    /// 224 of 224 positions); its logits differ from the exact ones by up to
    /// 2.15 per entry, mostly as a shift of the whole row.
    pub near_tie_nats: f32,
    /// Ranks past this are "below the top-k" (the top-5).
    pub top_k: u32,
    /// A sampled token whose reference log-probability is below this
    /// (p < 1e-4) is improbable: a sampler at temperature ≤ 1 picks one at
    /// most once in 10,000 positions.
    pub improbable_logprob: f32,
    /// Mean KL (nats per token, over the upstream's returned alternatives)
    /// above which a turn has drifted. llama.cpp serving the same Q4_1 GGUF
    /// measured 0.0013–0.0017 per turn and at most 0.006 on one token
    /// (docs/REFERENCE.md, "Auditing a server"): 0.05 is 30× its worst turn.
    pub kl_drift: f64,
}

impl Default for Thresholds {
    fn default() -> Self {
        Self {
            near_tie_nats: 1.5,
            top_k: 5,
            improbable_logprob: -9.21,
            kl_drift: 0.05,
        }
    }
}

/// Errors that stop an audit.
#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    #[error(
        "the traffic does not match this model's tokenizer: turn {turn} (request {request}), output token {index} {text:?} (bytes {bytes:?}) is not a token of this model's vocabulary of {vocab}; audit with the model the upstream serves"
    )]
    Tokenizer {
        turn: usize,
        request: u64,
        index: usize,
        text: String,
        bytes: Vec<u8>,
        vocab: usize,
    },
    #[error("turn {turn} (request {request}): the upstream's text {text:?} does not round-trip through this model's tokenizer (it decodes to {back:?})")]
    RoundTrip {
        turn: usize,
        request: u64,
        text: String,
        back: String,
    },
    #[error("the model's chat template: {0}")]
    Template(String),
    #[error(transparent)]
    Engine(#[from] lmrr_engine::EngineError),
}

/// One output token, scored.
#[derive(Debug, Clone, Serialize)]
pub struct TokenScore {
    pub id: u32,
    pub text: String,
    /// 1 = the reference's greedy choice.
    pub rank: u32,
    pub ref_logprob: f32,
    /// Reference top-1 minus this token's log-probability (0 at rank 1).
    pub gap: f32,
    pub ref_top: u32,
    pub ref_top_text: String,
    pub upstream_logprob: Option<f64>,
    /// KL(upstream ‖ reference) over the upstream's alternatives plus the rest.
    pub kl: Option<f64>,
}

/// Per-turn figures.
#[derive(Debug, Clone, Default, Serialize)]
pub struct TurnStats {
    pub tokens: usize,
    pub rank1: usize,
    pub near_ties: usize,
    /// Greedy choices past a near-tie, within the top-k.
    pub off: usize,
    pub improbable: usize,
    pub first_below_top_k: Option<usize>,
    pub first_improbable: Option<usize>,
    pub mean_kl: Option<f64>,
    pub max_kl: Option<f64>,
    /// Returned logprobs equal to the reference's bits, of those returned.
    pub identical_logprobs: usize,
    pub returned_logprobs: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    Faithful,
    Drifted,
    Broken,
    Skipped,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Faithful => "faithful",
            Self::Drifted => "drifted",
            Self::Broken => "broken",
            Self::Skipped => "skipped",
        }
    }
}

/// The context-fidelity comparison of one turn.
#[derive(Debug, Clone, Serialize)]
pub struct Fidelity {
    /// Σ reference logprob of the answer with the full history.
    pub with_history: f64,
    /// The same without the history.
    pub without_history: f64,
    pub history_messages: usize,
    pub amnesia: bool,
}

/// One audited request.
#[derive(Debug, Clone, Serialize)]
pub struct Turn {
    pub turn: usize,
    pub request: u64,
    pub endpoint: String,
    /// The last user message (or the prompt), shortened.
    pub asks: String,
    pub temperature: f32,
    /// Chunks the client was handed before it left.
    pub interrupted_after_chunks: Option<u32>,
    /// The turn before this one was interrupted.
    pub after_interrupt: bool,
    /// Prompt tokens the upstream says it served from its cache.
    pub cached_tokens: Option<u64>,
    pub prompt_tokens: usize,
    pub upstream_prompt_tokens: Option<u64>,
    /// Where the token ids came from.
    pub ids_from: String,
    pub answer: String,
    pub finish_reason: Option<String>,
    pub stats: TurnStats,
    pub verdict: Verdict,
    pub why: String,
    pub fidelity: Option<Fidelity>,
    pub notes: Vec<String>,
    pub tokens: Vec<TokenScore>,
}

/// A whole audit.
#[derive(Debug, Clone, Serialize)]
pub struct AuditReport {
    pub traffic: String,
    pub upstream: String,
    pub origin: String,
    pub integrity: String,
    pub model: String,
    pub thresholds: Thresholds,
    /// The upstream over the whole traffic ([`change`]).
    pub verdict: UpstreamVerdict,
    /// The turns before the first interrupt or cache hit.
    pub calibration: Option<Calibration>,
    /// The first turn that departs from the calibration.
    pub change: Option<ChangePoint>,
    pub turns: Vec<Turn>,
}

impl AuditReport {
    /// Whether at least one turn was audited, every audited turn is
    /// faithful, none forgot its history, and nothing changed after an
    /// interrupt or a cache hit.
    pub fn all_faithful(&self) -> bool {
        self.change.is_none()
            && self.turns.iter().any(|t| t.verdict != Verdict::Skipped)
            && self.turns.iter().all(|t| {
                matches!(t.verdict, Verdict::Faithful | Verdict::Skipped)
                    && !t.fidelity.as_ref().is_some_and(|f| f.amnesia)
            })
    }
}

/// Rank of `t` in `row`: 1 + entries above it (ties to the lower id).
fn rank(row: &[f32], t: u32) -> u32 {
    let v = row[t as usize];
    let mut r = 1u32;
    for (j, &x) in row.iter().enumerate() {
        if x.is_nan() {
            continue;
        }
        if x > v || (x == v && (j as u32) < t) {
            r += 1;
        }
    }
    r
}

/// KL(P_up ‖ P_ref) over the upstream's alternatives and one "rest" bucket,
/// log-probabilities taken at f32 precision on both sides.
fn kl(row: &[f32], top: &[(u32, f64)]) -> Option<f64> {
    if top.is_empty() {
        return None;
    }
    let mut seen = std::collections::BTreeSet::new();
    let (mut up_sum, mut ref_sum, mut kl) = (0.0f64, 0.0f64, 0.0f64);
    for &(id, lp_up) in top {
        if !seen.insert(id) {
            continue;
        }
        // At f32 precision, the reference's: a value an f32 engine printed
        // (its shortest decimal) parses back to that f32, not to its f64.
        let lp_up = lp_up as f32 as f64;
        let p_up = lp_up.exp();
        let lp_ref = token_logprob(row, id)? as f64;
        let p_ref = lp_ref.exp();
        up_sum += p_up;
        ref_sum += p_ref;
        if p_up > 0.0 {
            kl += p_up * (lp_up - lp_ref);
        }
    }
    let rest_up = (1.0 - up_sum).max(0.0);
    let rest_ref = (1.0 - ref_sum).max(1e-30);
    if rest_up > 0.0 {
        kl += rest_up * (rest_up / rest_ref).ln();
    }
    Some(kl.max(0.0))
}

/// Reference rows predicting `out` after `prompt`: `out.len()` rows.
fn rows(
    model: &Model,
    prompt: &[u32],
    out: &[u32],
    threads: &Threads,
) -> Result<Vec<f32>, AuditError> {
    let net = model.net();
    if prompt.is_empty() || out.is_empty() {
        return Ok(Vec::new());
    }
    let mut kv = SeqKvStore::new(net.kv_layout());
    let mut seq = prompt.to_vec();
    seq.extend_from_slice(out);
    let fed = &seq[..seq.len() - 1];
    let split = prompt.len() - 1;
    if split > 0 {
        net.forward(
            &mut kv,
            &[SeqSpan {
                seq: 0,
                start: 0,
                tokens: &fed[..split],
                logits: LogitsWanted::None,
            }],
            threads,
        )?;
    }
    let mut r = net.forward(
        &mut kv,
        &[SeqSpan {
            seq: 0,
            start: split,
            tokens: &fed[split..],
            logits: LogitsWanted::All,
        }],
        threads,
    )?;
    Ok(r.remove(0))
}

/// Σ reference logprob of `out` after `prompt`.
fn answer_logprob(
    model: &Model,
    prompt: &[u32],
    out: &[u32],
    threads: &Threads,
) -> Result<f64, AuditError> {
    let vocab = model.net().vocab_size();
    let r = rows(model, prompt, out, threads)?;
    Ok(out
        .iter()
        .enumerate()
        .map(|(i, &t)| {
            r.get(i * vocab..(i + 1) * vocab)
                .and_then(|row| token_logprob(row, t))
                .unwrap_or(f32::NEG_INFINITY) as f64
        })
        .sum())
}

fn shorten(s: &str, n: usize) -> String {
    let one: String = s.split_whitespace().collect::<Vec<_>>().join(" ");
    if one.chars().count() <= n {
        one
    } else {
        let mut t: String = one.chars().take(n - 1).collect();
        t.push('…');
        t
    }
}

/// Everything the traffic says about one request.
struct Recorded<'a> {
    id: u64,
    path: &'a str,
    body: &'a [u8],
    status: Option<u16>,
    chunks: Vec<&'a [u8]>,
    streamed: bool,
    end: Option<(&'a Outcome, u32)>,
}

fn collect(traffic: &TrafficBundle) -> Vec<Recorded<'_>> {
    let mut by_id: BTreeMap<u64, Recorded<'_>> = BTreeMap::new();
    for e in &traffic.events {
        match e {
            TrafficEvent::Request { id, path, body, .. } => {
                by_id.entry(*id).or_insert(Recorded {
                    id: *id,
                    path,
                    body,
                    status: None,
                    chunks: Vec::new(),
                    streamed: false,
                    end: None,
                });
            }
            TrafficEvent::Response {
                id,
                status,
                content_type,
                ..
            } => {
                if let Some(r) = by_id.get_mut(id) {
                    r.status = Some(*status);
                    r.streamed = content_type.starts_with("text/event-stream");
                }
            }
            TrafficEvent::Chunk { id, data, .. } => {
                if let Some(r) = by_id.get_mut(id) {
                    r.chunks.push(data);
                }
            }
            TrafficEvent::End {
                id,
                outcome,
                chunks_delivered,
                ..
            } => {
                if let Some(r) = by_id.get_mut(id) {
                    r.end = Some((outcome, *chunks_delivered));
                }
            }
        }
    }
    by_id.into_values().collect()
}

/// `usage.prompt_tokens_details.cached_tokens` of the last chunk that has it.
fn cached_tokens(chunks: &[&[u8]]) -> Option<u64> {
    chunks.iter().rev().find_map(|c| {
        serde_json::from_slice::<Value>(c)
            .ok()?
            .pointer("/usage/prompt_tokens_details/cached_tokens")?
            .as_u64()
    })
}

/// Audits `traffic` (read from `name`) on `model`.
pub fn audit(
    model: &Model,
    traffic: &TrafficBundle,
    name: &str,
    threads: &Threads,
    thresholds: Thresholds,
) -> Result<AuditReport, AuditError> {
    let renderer = Renderer::new(model).map_err(AuditError::Template)?;
    let vocab = Vocab::new(model);
    let vsize = model.net().vocab_size();
    let context = model.net().context();
    let mut turns = Vec::new();
    let mut prev_interrupted = false;
    for (turn_no, rec) in collect(traffic).into_iter().enumerate() {
        let chat = rec.path.starts_with("/v1/chat/completions");
        let mut t = Turn {
            turn: turn_no,
            request: rec.id,
            endpoint: rec.path.split('?').next().unwrap_or("").to_string(),
            asks: String::new(),
            temperature: 1.0,
            interrupted_after_chunks: None,
            after_interrupt: prev_interrupted,
            cached_tokens: cached_tokens(&rec.chunks),
            prompt_tokens: 0,
            upstream_prompt_tokens: None,
            ids_from: String::new(),
            answer: String::new(),
            finish_reason: None,
            stats: TurnStats::default(),
            verdict: Verdict::Skipped,
            why: String::new(),
            fidelity: None,
            notes: Vec::new(),
            tokens: Vec::new(),
        };
        let interrupted = matches!(rec.end, Some((Outcome::ClientGone, _)));
        prev_interrupted = interrupted;
        let skip = |mut t: Turn, why: String| {
            t.why = why;
            t
        };
        match rec.end {
            None => {
                turns.push(skip(
                    t,
                    "no end recorded (the proxy stopped mid-request)".into(),
                ));
                continue;
            }
            Some((Outcome::UpstreamUnreachable { error }, _)) => {
                turns.push(skip(t, format!("upstream unreachable: {error}")));
                continue;
            }
            Some((Outcome::ClientGone, n)) => t.interrupted_after_chunks = Some(n),
            Some((Outcome::UpstreamBroken { error }, _)) => t
                .notes
                .push(format!("the upstream's stream broke: {error}")),
            Some((Outcome::Complete, _)) => {}
        }
        if rec.status.is_some_and(|s| !(200..300).contains(&s)) {
            let s = rec.status.unwrap_or(0);
            let msg = rec
                .chunks
                .first()
                .and_then(|c| serde_json::from_slice::<Value>(c).ok())
                .and_then(|v| {
                    v.pointer("/error/message")
                        .and_then(Value::as_str)
                        .map(str::to_string)
                })
                .map(|m| format!(": {}", shorten(&m, 120)))
                .unwrap_or_default();
            turns.push(skip(t, format!("the upstream answered {s}{msg}")));
            continue;
        }
        // The prompt, as lmrr serve builds it.
        let (prompt, messages, temperature) = if chat {
            match api::parse_chat(rec.body) {
                Ok(req) => {
                    t.asks = req
                        .messages
                        .iter()
                        .rev()
                        .find(|m| m.role == "user")
                        .and_then(|m| m.content.clone())
                        .unwrap_or_default();
                    let r = match renderer.render(
                        &req.messages,
                        req.tools.as_ref(),
                        req.tool_choice.as_ref(),
                    ) {
                        Ok(r) => r,
                        Err(e) => {
                            turns.push(skip(
                                t,
                                format!("the chat template refused the request: {}", e.message),
                            ));
                            continue;
                        }
                    };
                    let p = model.tokenizer.encode(&r.text)?;
                    (p, Some(req.messages), req.gen.temperature)
                }
                Err(e) => {
                    turns.push(skip(t, format!("request not understood: {}", e.message)));
                    continue;
                }
            }
        } else {
            match api::parse_completion(rec.body) {
                Ok(req) => {
                    let p = match &req.prompt {
                        Prompt::Text(s) => {
                            t.asks = s.clone();
                            model.tokenizer.encode_prompt(s)?
                        }
                        Prompt::Tokens(ids) => {
                            if let Some(bad) = ids.iter().find(|&&x| x as usize >= vsize) {
                                turns.push(skip(
                                    t,
                                    format!("prompt token {bad} is outside this model's vocabulary of {vsize}"),
                                ));
                                continue;
                            }
                            ids.clone()
                        }
                    };
                    (p, None, req.gen.temperature)
                }
                Err(e) => {
                    turns.push(skip(t, format!("request not understood: {}", e.message)));
                    continue;
                }
            }
        };
        t.asks = shorten(&t.asks, 48);
        t.temperature = temperature;
        t.prompt_tokens = prompt.len();
        let chunks: &[&[u8]] = match t.interrupted_after_chunks {
            Some(n) => &rec.chunks[..(n as usize).min(rec.chunks.len())],
            None => &rec.chunks,
        };
        let ans = answer(chat, chunks, rec.streamed);
        t.notes.extend(ans.notes.iter().cloned());
        t.answer = ans.text.clone();
        t.finish_reason = ans.finish_reason.clone();
        t.upstream_prompt_tokens = ans.prompt_tokens;
        // A tool-call turn shows only the text outside its calls: the
        // entries spell more than that text, and the text alone is not the
        // output.
        let spelled = if ans.tool_calls.is_empty() {
            ans.text.as_str()
        } else {
            t.notes.push(format!(
                "the answer carries {} tool call(s) ({}): the answer shown is the text outside them, the tokens are the logprob entries'",
                ans.tool_calls.len(),
                shorten(&ans.tool_calls.join(", "), 40)
            ));
            if ans.entries.is_empty() {
                turns.push(skip(
                    t,
                    "the answer carries tool calls and no logprob entries: its tokens cannot be recovered from the text outside the calls".into(),
                ));
                continue;
            }
            ""
        };
        if let Some(p) = ans.prompt_tokens {
            if p as usize != prompt.len() {
                t.notes.push(format!(
                    "the upstream counted {p} prompt tokens, this model's template and tokenizer give {}: the audit scores the answer after lmrr's prompt",
                    prompt.len()
                ));
            }
        }
        // The output token ids.
        let aligned = if ans.entries.is_empty() {
            None
        } else {
            if let Some((i, e)) = ans
                .entries
                .iter()
                .enumerate()
                .find(|(_, e)| vocab.candidates(e).is_empty())
            {
                return Err(AuditError::Tokenizer {
                    turn: turn_no,
                    request: rec.id,
                    index: i,
                    text: e.text.clone(),
                    bytes: e
                        .bytes
                        .clone()
                        .unwrap_or_else(|| e.text.as_bytes().to_vec()),
                    vocab: vsize,
                });
            }
            let a = if ans.entries.iter().all(|e| e.bytes.is_some()) {
                // Exact bytes: the ids are known; the text may be lossy.
                Some(ans.entries.iter().map(|e| vocab.candidates(e)[0]).collect())
            } else {
                vocab.align(&ans.entries, spelled)
            };
            if a.is_none() {
                t.notes.push(format!(
                    "the {} logprob entries do not spell the text {:?}; ids re-derived by tokenizing the text",
                    ans.entries.len(),
                    shorten(&ans.text, 40)
                ));
            }
            a
        };
        let from_entries = aligned.is_some();
        let out: Vec<u32> = if let Some(ids) = aligned {
            t.ids_from = if ans.entries.iter().all(|e| e.bytes.is_some()) {
                "logprob bytes".into()
            } else {
                "logprob tokens".into()
            };
            ids
        } else {
            t.ids_from = "tokenized text".into();
            let ids = model.tokenizer.encode(&ans.text)?;
            let back = model.tokenizer.decode(&ids)?;
            if back != ans.text {
                return Err(AuditError::RoundTrip {
                    turn: turn_no,
                    request: rec.id,
                    text: shorten(&ans.text, 60),
                    back: shorten(&back, 60),
                });
            }
            ids
        };
        if out.is_empty() {
            t.verdict = Verdict::Skipped;
            t.why = "no output tokens".into();
            turns.push(t);
            continue;
        }
        if prompt.is_empty() || prompt.len() + out.len() > context + 1 {
            t.why = format!(
                "{} prompt + {} output tokens do not fit this model's context of {context}",
                prompt.len(),
                out.len()
            );
            turns.push(t);
            continue;
        }
        // Score every token against the reference. Lossy entries (no bytes,
        // several tokens show the same text) are settled by the upstream's
        // own logprob: the candidate whose reference logprob is nearest.
        let mut out = out;
        let mut r = rows(model, &prompt, &out, threads)?;
        if from_entries {
            let mut swaps = 0;
            for i in 0..out.len() {
                let Some(e) = ans.entries.get(i) else { break };
                let (Some(up), None) = (e.logprob, &e.bytes) else {
                    continue;
                };
                let cands = vocab.candidates(e);
                if cands.len() < 2 || swaps >= MAX_SWAPS {
                    continue;
                }
                let row = &r[i * vsize..(i + 1) * vsize];
                let dist = |id: u32| {
                    token_logprob(row, id)
                        .map_or(f64::INFINITY, |l| ((l as f64) - (up as f32 as f64)).abs())
                };
                let best = cands
                    .iter()
                    .copied()
                    .filter(|&c| {
                        c == out[i] || {
                            let mut alt = out.clone();
                            alt[i] = c;
                            vocab.spells(&alt, spelled)
                        }
                    })
                    .min_by(|&a, &b| dist(a).total_cmp(&dist(b)).then(a.cmp(&b)));
                if let Some(b) = best.filter(|&b| b != out[i] && dist(b) < dist(out[i])) {
                    out[i] = b;
                    swaps += 1;
                    r = rows(model, &prompt, &out, threads)?;
                }
            }
            if swaps > 0 {
                t.notes.push(format!(
                    "{swaps} lossy logprob entries (no bytes) matched several tokens; settled by the upstream's logprob"
                ));
            }
        }
        let greedy = temperature == 0.0;
        let mut kls = Vec::new();
        for (i, &id) in out.iter().enumerate() {
            let row = &r[i * vsize..(i + 1) * vsize];
            let top = top_logprobs(row, 1);
            let (ref_top, top_lp) = top.first().copied().unwrap_or((0, f32::NAN));
            let lp = token_logprob(row, id).unwrap_or(f32::NEG_INFINITY);
            let e = if from_entries {
                ans.entries.get(i)
            } else {
                None
            };
            let up_top: Vec<(u32, f64)> = e
                .map(|e| {
                    e.top
                        .iter()
                        .filter_map(|(s, b, l)| Some((vocab.id(s, b.as_deref())?, *l)))
                        .collect()
                })
                .unwrap_or_default();
            let k = kl(row, &up_top);
            if let Some(k) = k {
                kls.push(k);
            }
            let upstream_logprob = e.and_then(|e| e.logprob);
            let rk = rank(row, id);
            let gap = top_lp - lp;
            let s = &mut t.stats;
            s.tokens += 1;
            if let Some(u) = upstream_logprob {
                s.returned_logprobs += 1;
                if (u as f32).to_bits() == lp.to_bits() {
                    s.identical_logprobs += 1;
                }
            }
            let below = rk > thresholds.top_k;
            if below && s.first_below_top_k.is_none() {
                s.first_below_top_k = Some(i);
            }
            let improbable = if greedy {
                below && gap > thresholds.near_tie_nats
            } else {
                lp < thresholds.improbable_logprob
            };
            if improbable {
                s.improbable += 1;
                s.first_improbable.get_or_insert(i);
            } else if rk == 1 {
                s.rank1 += 1;
            } else if gap <= thresholds.near_tie_nats {
                s.near_ties += 1;
            } else if greedy {
                s.off += 1;
            }
            t.tokens.push(TokenScore {
                id,
                text: vocab.text(id),
                rank: rk,
                ref_logprob: lp,
                gap,
                ref_top,
                ref_top_text: vocab.text(ref_top),
                upstream_logprob,
                kl: k,
            });
        }
        if !kls.is_empty() {
            t.stats.mean_kl = Some(kls.iter().sum::<f64>() / kls.len() as f64);
            t.stats.max_kl = kls.iter().copied().reduce(f64::max);
        }
        let s = &t.stats;
        let (verdict, why) = if s.improbable > 0 {
            let i = s.first_improbable.unwrap_or(0);
            let tok = &t.tokens[i];
            (
                Verdict::Broken,
                format!(
                    "token {i} {:?} is improbable under the reference (rank {}, logprob {:.2}; the reference's choice is {:?}){}",
                    tok.text,
                    tok.rank,
                    tok.ref_logprob,
                    tok.ref_top_text,
                    if t.after_interrupt { ", right after an interrupted turn" } else { "" }
                ),
            )
        } else if s.off > 0 {
            (
                Verdict::Drifted,
                format!(
                    "{} greedy choice(s) past a near-tie ({} nats) but within the top-{}",
                    s.off, thresholds.near_tie_nats, thresholds.top_k
                ),
            )
        } else if s.mean_kl.is_some_and(|k| k > thresholds.kl_drift) {
            (
                Verdict::Drifted,
                format!(
                    "mean KL {:.3} nats/token above the noise level {}",
                    s.mean_kl.unwrap_or(0.0),
                    thresholds.kl_drift
                ),
            )
        } else if s.returned_logprobs == s.tokens
            && s.identical_logprobs == s.tokens
            && s.rank1 == s.tokens
        {
            (
                Verdict::Faithful,
                "bit-faithful: every token the reference's choice, every logprob the reference's bits".into(),
            )
        } else {
            (
                Verdict::Faithful,
                format!(
                    "{} of {} tokens the reference's choice, {} near-ties",
                    s.rank1, s.tokens, s.near_ties
                ),
            )
        };
        t.verdict = verdict;
        t.why = why;
        // Context fidelity.
        if let Some(msgs) = messages {
            let last_user = msgs.iter().rposition(|m| m.role == "user");
            if let Some(lu) = last_user {
                let kept: Vec<ChatMessage> = msgs
                    .iter()
                    .enumerate()
                    .filter(|(i, m)| *i >= lu || m.role == "system")
                    .map(|(_, m)| m.clone())
                    .collect();
                let history = msgs.len() - kept.len();
                if history > 0 {
                    if let Ok(r) = renderer.render(&kept, None, None) {
                        let bare = model.tokenizer.encode(&r.text)?;
                        let with_history: f64 = t.tokens.iter().map(|x| x.ref_logprob as f64).sum();
                        let without_history = answer_logprob(model, &bare, &out, threads)?;
                        t.fidelity = Some(Fidelity {
                            with_history,
                            without_history,
                            history_messages: history,
                            amnesia: without_history > with_history,
                        });
                    }
                }
            }
        }
        turns.push(t);
    }
    let (calibration, change, verdict) = change::judge(&turns, &thresholds);
    Ok(AuditReport {
        traffic: name.to_string(),
        verdict,
        calibration,
        change,
        upstream: traffic.manifest.upstream.clone(),
        origin: traffic.manifest.origin.clone(),
        integrity: traffic.integrity.to_string(),
        model: model.origin.clone(),
        thresholds,
        turns,
    })
}
