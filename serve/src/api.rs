//! The OpenAI request shapes lmrr accepts, parsed and validated before
//! anything reaches the engine (after text-generation-inference's
//! `validation.rs`).
//!
//! Parsing goes through `serde_json::Value` rather than derived structs so
//! that every refusal names its field (`messages[3].content`,
//! `stream_options.include_usage`) and says what was expected and found.
//! Invariant: [`parse_chat`] and [`parse_completion`] never panic, whatever
//! the bytes (a property test feeds them arbitrary JSON); what they return is
//! in range for the engine's sampler (`temperature` finite and in `[0, 2]`,
//! `top_p` in `(0, 1]`, `max_tokens` at least 1). Limits that depend on the
//! model (context, pool) are checked once the prompt is tokenized.
//!
//! Accepted and used: `model`, `messages` (roles `system`, `developer` — taken
//! as `system` —, `user`, `assistant`, `tool`; content as a string, as text
//! parts, or null for an assistant turn with `tool_calls`), `tools`,
//! `tool_choice`, `stream`, `stream_options.include_usage`, `max_tokens`,
//! `max_completion_tokens`, `temperature`, `top_p`, `top_k` and `ignore_eos`
//! (extensions), `seed`, `stop`, `n` (1 only), and logprobs: on chat
//! `logprobs` (a boolean) with `top_logprobs` (0 to [`MAX_TOP_LOGPROBS_CHAT`]
//! alternatives; set above 0 it needs `logprobs: true`), on completions
//! `logprobs` (an integer, 0 to [`MAX_LOGPROBS_COMPLETIONS`] alternatives;
//! 0 is the sampled token's logprob alone). Refused with a 400 when set to
//! something lmrr would silently not honour: non-zero
//! `frequency_penalty`/`presence_penalty`, a non-empty `logit_bias`, a
//! `response_format` other than text, `echo`, `suffix`, `best_of > 1`, and
//! a non-zero `top_logprobs` on completions (its `logprobs` is the count
//! there).
//! Anything else (`user`, `metadata`, `parallel_tool_calls`, …) is ignored.
use serde_json::{Map, Value};

use crate::error::ApiError;

/// OpenAI's limit on stop sequences.
pub const MAX_STOP: usize = 4;
/// Longest stop sequence accepted, bytes.
pub const MAX_STOP_LEN: usize = 256;
/// OpenAI's sampling temperature range.
pub const MAX_TEMPERATURE: f64 = 2.0;
/// Default `max_tokens` of `/v1/completions` (OpenAI's).
pub const COMPLETIONS_DEFAULT_MAX_TOKENS: usize = 16;
/// Most `top_logprobs` on chat (OpenAI's limit).
pub const MAX_TOP_LOGPROBS_CHAT: usize = 20;
/// Most `logprobs` on `/v1/completions` (OpenAI's legacy limit).
pub const MAX_LOGPROBS_COMPLETIONS: usize = 5;

/// Sampling and length parameters common to both endpoints.
#[derive(Debug, Clone, PartialEq)]
pub struct GenParams {
    /// `None`: as many as the context allows.
    pub max_tokens: Option<usize>,
    pub temperature: f32,
    pub top_p: f32,
    /// 0 = off.
    pub top_k: usize,
    /// `None`: the server picks one (recorded).
    pub seed: Option<u64>,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    /// `None`: no logprobs; `Some(k)`: the sampled token's logprob and its
    /// `k` most likely alternatives, per token.
    pub logprobs: Option<usize>,
}

/// One chat message, normalised: text content, and the fields a chat
/// template may read besides `role` and `content`.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatMessage {
    pub role: String,
    pub content: Option<String>,
    /// `tool_calls` (assistant), `tool_call_id` and `name` (tool), as sent.
    pub extra: Map<String, Value>,
}

/// A validated `POST /v1/chat/completions`.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatRequest {
    pub model: String,
    pub messages: Vec<ChatMessage>,
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
    pub gen: GenParams,
    pub stream: bool,
    pub include_usage: bool,
}

/// A completion prompt.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

/// A validated `POST /v1/completions`.
#[derive(Debug, Clone, PartialEq)]
pub struct CompletionRequest {
    pub model: String,
    pub prompt: Prompt,
    pub gen: GenParams,
    pub stream: bool,
    pub include_usage: bool,
}

/// JSON's name for a value's type, for messages.
fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn wrong(param: &str, want: &str, v: &Value) -> ApiError {
    ApiError::invalid(param, format!("`{param}` must be {want}, got {}", kind(v)))
}

/// The body as a JSON object.
fn object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::bad_request(format!("request body is not valid JSON: {e}"))
            .with_code("invalid_json")
    })?;
    match v {
        Value::Object(m) => Ok(m),
        other => Err(ApiError::bad_request(format!(
            "request body must be a JSON object, got {}",
            kind(&other)
        ))),
    }
}

/// A field, with JSON `null` read as absent (as OpenAI does).
fn field<'a>(m: &'a Map<String, Value>, k: &str) -> Option<&'a Value> {
    m.get(k).filter(|v| !v.is_null())
}

fn opt_bool(m: &Map<String, Value>, k: &str) -> Result<Option<bool>, ApiError> {
    match field(m, k) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(wrong(k, "a boolean", v)),
    }
}

fn opt_f64(m: &Map<String, Value>, k: &str) -> Result<Option<f64>, ApiError> {
    match field(m, k) {
        None => Ok(None),
        Some(Value::Number(n)) => n
            .as_f64()
            .filter(|x| x.is_finite())
            .map(Some)
            .ok_or_else(|| ApiError::invalid(k, format!("`{k}` = {n} is not a finite number"))),
        Some(v) => Err(wrong(k, "a number", v)),
    }
}

/// An integer field; `i64` covers every value OpenAI documents.
fn opt_i64(m: &Map<String, Value>, k: &str) -> Result<Option<i64>, ApiError> {
    match field(m, k) {
        None => Ok(None),
        Some(Value::Number(n)) => match n.as_i64() {
            Some(i) => Ok(Some(i)),
            None => match n.as_u64() {
                Some(u) => Ok(Some(i64::try_from(u).unwrap_or(i64::MAX))),
                None => Err(ApiError::invalid(
                    k,
                    format!("`{k}` must be an integer, got {n}"),
                )),
            },
        },
        Some(v) => Err(wrong(k, "an integer", v)),
    }
}

fn required_string(m: &Map<String, Value>, k: &str) -> Result<String, ApiError> {
    match field(m, k) {
        None => Err(ApiError::invalid(k, format!("`{k}` is required"))),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(v) => Err(wrong(k, "a string", v)),
    }
}

/// Fields that would change the output in ways lmrr does not implement.
fn refuse_unsupported(m: &Map<String, Value>) -> Result<(), ApiError> {
    for k in ["frequency_penalty", "presence_penalty"] {
        if let Some(x) = opt_f64(m, k)? {
            if x != 0.0 {
                return Err(ApiError::invalid(
                    k,
                    format!("`{k}` = {x} is not supported by lmrr serve (only 0)"),
                ));
            }
        }
    }
    match field(m, "logit_bias") {
        None => {}
        Some(Value::Object(o)) if o.is_empty() => {}
        Some(Value::Object(_)) => {
            return Err(ApiError::invalid(
                "logit_bias",
                "`logit_bias` is not supported by lmrr serve",
            ))
        }
        Some(v) => return Err(wrong("logit_bias", "an object", v)),
    }
    match field(m, "response_format") {
        None => {}
        Some(Value::Object(o)) => match o.get("type") {
            Some(Value::String(t)) if t == "text" => {}
            Some(Value::String(t)) => {
                return Err(ApiError::invalid(
                    "response_format.type",
                    format!("`response_format.type` = \"{t}\" is not supported by lmrr serve (only \"text\")"),
                ))
            }
            Some(v) => return Err(wrong("response_format.type", "a string", v)),
            None => {
                return Err(ApiError::invalid(
                    "response_format.type",
                    "`response_format.type` is required",
                ))
            }
        },
        Some(v) => return Err(wrong("response_format", "an object", v)),
    }
    Ok(())
}

/// A count of logprob alternatives in `0..=max`.
fn logprob_count(m: &Map<String, Value>, k: &str, max: usize) -> Result<Option<usize>, ApiError> {
    match opt_i64(m, k)? {
        None => Ok(None),
        Some(n) => match usize::try_from(n) {
            Ok(n) if n <= max => Ok(Some(n)),
            _ => Err(ApiError::invalid(
                k,
                format!("`{k}` = {n} is outside [0, {max}]"),
            )),
        },
    }
}

/// Chat's `logprobs` (a boolean) and `top_logprobs` (the alternatives).
/// `top_logprobs: 0` without `logprobs` asks for nothing and is accepted,
/// as it was before logprobs were served.
fn chat_logprobs(m: &Map<String, Value>) -> Result<Option<usize>, ApiError> {
    let on = opt_bool(m, "logprobs")?.unwrap_or(false);
    let top = logprob_count(m, "top_logprobs", MAX_TOP_LOGPROBS_CHAT)?;
    match (on, top) {
        (true, top) => Ok(Some(top.unwrap_or(0))),
        (false, Some(k)) if k > 0 => Err(ApiError::invalid(
            "top_logprobs",
            format!("`top_logprobs` = {k} needs `logprobs: true`"),
        )),
        (false, _) => Ok(None),
    }
}

/// Completions' `logprobs`: the number of alternatives; null is off.
fn completion_logprobs(m: &Map<String, Value>) -> Result<Option<usize>, ApiError> {
    if let Some(v @ Value::Bool(_)) = field(m, "logprobs") {
        return Err(wrong(
            "logprobs",
            &format!("an integer (0 to {MAX_LOGPROBS_COMPLETIONS}) on /v1/completions"),
            v,
        ));
    }
    // `top_logprobs: 0` asks for nothing (accepted, as it was before).
    if field(m, "top_logprobs").is_some_and(|v| v.as_u64() != Some(0)) {
        return Err(ApiError::invalid(
            "top_logprobs",
            format!("`top_logprobs` is a chat field: on /v1/completions `logprobs` is the number of alternatives (0 to {MAX_LOGPROBS_COMPLETIONS})"),
        ));
    }
    logprob_count(m, "logprobs", MAX_LOGPROBS_COMPLETIONS)
}

/// `n`: absent or 1.
fn check_n(m: &Map<String, Value>, n_name: &str) -> Result<(), ApiError> {
    if let Some(n) = opt_i64(m, n_name)? {
        if n != 1 {
            return Err(ApiError::invalid(
                n_name,
                format!("`{n_name}` = {n}: lmrr serve generates one choice per request (send {n} requests)"),
            ));
        }
    }
    Ok(())
}

fn stream_flags(m: &Map<String, Value>) -> Result<(bool, bool), ApiError> {
    let stream = opt_bool(m, "stream")?.unwrap_or(false);
    let include_usage = match field(m, "stream_options") {
        None => false,
        Some(Value::Object(o)) => {
            if !stream {
                return Err(ApiError::invalid(
                    "stream_options",
                    "`stream_options` is only allowed when `stream` is true",
                ));
            }
            match o.get("include_usage").filter(|v| !v.is_null()) {
                None => false,
                Some(Value::Bool(b)) => *b,
                Some(v) => return Err(wrong("stream_options.include_usage", "a boolean", v)),
            }
        }
        Some(v) => return Err(wrong("stream_options", "an object", v)),
    };
    Ok((stream, include_usage))
}

fn gen_params(
    m: &Map<String, Value>,
    default_max: Option<usize>,
    logprobs: Option<usize>,
) -> Result<GenParams, ApiError> {
    let mut max_tokens = default_max;
    // `max_completion_tokens` (the newer name) wins when both are sent.
    for k in ["max_tokens", "max_completion_tokens"] {
        if let Some(n) = opt_i64(m, k)? {
            if n < 1 {
                return Err(ApiError::invalid(
                    k,
                    format!("`{k}` = {n}: at least 1 token is generated"),
                ));
            }
            max_tokens = Some(usize::try_from(n).unwrap_or(usize::MAX));
        }
    }
    let temperature = opt_f64(m, "temperature")?.unwrap_or(1.0);
    if !(0.0..=MAX_TEMPERATURE).contains(&temperature) {
        return Err(ApiError::invalid(
            "temperature",
            format!("`temperature` = {temperature} is outside [0, {MAX_TEMPERATURE}]"),
        ));
    }
    let top_p = opt_f64(m, "top_p")?.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::invalid(
            "top_p",
            format!("`top_p` = {top_p} is outside (0, 1]"),
        ));
    }
    let top_k = match opt_i64(m, "top_k")? {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => usize::try_from(k).unwrap_or(usize::MAX),
        Some(k) => {
            return Err(ApiError::invalid(
                "top_k",
                format!("`top_k` = {k}: must be at least 1, or 0 or -1 for no cut"),
            ))
        }
    };
    // OpenAI's seeds are signed 64-bit: the sign bit is dropped, so every
    // seed is also a valid session-script seed (deterministic, and recorded).
    let seed = opt_i64(m, "seed")?.map(|s| (s as u64) & (i64::MAX as u64));
    let stop = match field(m, "stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => {
            if a.len() > MAX_STOP {
                return Err(ApiError::invalid(
                    "stop",
                    format!("`stop` has {} sequences, at most {MAX_STOP}", a.len()),
                ));
            }
            let mut out = Vec::new();
            for (i, v) in a.iter().enumerate() {
                match v {
                    Value::String(s) => out.push(s.clone()),
                    v => return Err(wrong(&format!("stop[{i}]"), "a string", v)),
                }
            }
            out
        }
        Some(v) => return Err(wrong("stop", "a string or an array of strings", v)),
    };
    for (i, s) in stop.iter().enumerate() {
        if s.is_empty() || s.len() > MAX_STOP_LEN {
            return Err(ApiError::invalid(
                format!("stop[{i}]"),
                format!(
                    "stop sequence {i} is {} bytes; it must hold 1 to {MAX_STOP_LEN}",
                    s.len()
                ),
            ));
        }
    }
    let ignore_eos = opt_bool(m, "ignore_eos")?.unwrap_or(false);
    Ok(GenParams {
        max_tokens,
        temperature: temperature as f32,
        top_p: top_p as f32,
        top_k,
        seed,
        stop,
        ignore_eos,
        logprobs,
    })
}

/// Content as text: a string, or an array of text parts joined.
fn content_text(v: &Value, param: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut out = String::new();
            for (j, p) in parts.iter().enumerate() {
                let pp = format!("{param}[{j}]");
                let Value::Object(o) = p else {
                    return Err(wrong(&pp, "a content part object", p));
                };
                match o.get("type") {
                    Some(Value::String(t)) if t == "text" => match o.get("text") {
                        Some(Value::String(s)) => out.push_str(s),
                        Some(v) => return Err(wrong(&format!("{pp}.text"), "a string", v)),
                        None => {
                            return Err(ApiError::invalid(
                                format!("{pp}.text"),
                                format!("`{pp}.text` is required"),
                            ))
                        }
                    },
                    Some(Value::String(t)) => {
                        return Err(ApiError::invalid(
                            format!("{pp}.type"),
                            format!("content part type \"{t}\" is not supported (text only)"),
                        ))
                    }
                    Some(v) => return Err(wrong(&format!("{pp}.type"), "a string", v)),
                    None => {
                        return Err(ApiError::invalid(
                            format!("{pp}.type"),
                            format!("`{pp}.type` is required"),
                        ))
                    }
                }
            }
            Ok(out)
        }
        v => Err(wrong(param, "a string or an array of text parts", v)),
    }
}

fn messages(m: &Map<String, Value>) -> Result<Vec<ChatMessage>, ApiError> {
    let arr = match field(m, "messages") {
        None => return Err(ApiError::invalid("messages", "`messages` is required")),
        Some(Value::Array(a)) => a,
        Some(v) => return Err(wrong("messages", "an array", v)),
    };
    if arr.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "`messages` must hold at least one message",
        ));
    }
    let mut out = Vec::with_capacity(arr.len());
    for (i, v) in arr.iter().enumerate() {
        let p = format!("messages[{i}]");
        let Value::Object(o) = v else {
            return Err(wrong(&p, "an object", v));
        };
        let role = match o.get("role") {
            Some(Value::String(r)) => r.as_str(),
            Some(v) => return Err(wrong(&format!("{p}.role"), "a string", v)),
            None => {
                return Err(ApiError::invalid(
                    format!("{p}.role"),
                    format!("`{p}.role` is required"),
                ))
            }
        };
        let role = match role {
            "system" | "user" | "assistant" | "tool" => role.to_string(),
            "developer" => "system".to_string(),
            other => {
                return Err(ApiError::invalid(
                    format!("{p}.role"),
                    format!("unknown role \"{other}\" (system, developer, user, assistant, tool)"),
                ))
            }
        };
        let mut extra = Map::new();
        match o.get("tool_calls").filter(|v| !v.is_null()) {
            None => {}
            Some(Value::Array(calls)) if role == "assistant" => {
                extra.insert("tool_calls".into(), Value::Array(calls.clone()));
            }
            Some(Value::Array(_)) => {
                return Err(ApiError::invalid(
                    format!("{p}.tool_calls"),
                    format!("`tool_calls` belongs to assistant messages, not {role}"),
                ))
            }
            Some(v) => return Err(wrong(&format!("{p}.tool_calls"), "an array", v)),
        }
        for k in ["tool_call_id", "name"] {
            match o.get(k).filter(|v| !v.is_null()) {
                None => {}
                Some(Value::String(s)) => {
                    extra.insert(k.into(), Value::String(s.clone()));
                }
                Some(v) => return Err(wrong(&format!("{p}.{k}"), "a string", v)),
            }
        }
        let content = match o.get("content").filter(|v| !v.is_null()) {
            Some(c) => Some(content_text(c, &format!("{p}.content"))?),
            None if role == "assistant" && extra.contains_key("tool_calls") => None,
            None => {
                return Err(ApiError::invalid(
                    format!("{p}.content"),
                    format!("`{p}.content` is required"),
                ))
            }
        };
        out.push(ChatMessage {
            role,
            content,
            extra,
        });
    }
    Ok(out)
}

/// Parses and validates a chat completions body.
pub fn parse_chat(body: &[u8]) -> Result<ChatRequest, ApiError> {
    let m = object(body)?;
    let model = required_string(&m, "model")?;
    let messages = messages(&m)?;
    check_n(&m, "n")?;
    refuse_unsupported(&m)?;
    let logprobs = chat_logprobs(&m)?;
    let (stream, include_usage) = stream_flags(&m)?;
    let tools = match field(&m, "tools") {
        None => None,
        Some(Value::Array(a)) if a.is_empty() => None,
        Some(Value::Array(a)) => {
            for (i, t) in a.iter().enumerate() {
                if !t.is_object() {
                    return Err(wrong(&format!("tools[{i}]"), "an object", t));
                }
            }
            Some(Value::Array(a.clone()))
        }
        Some(v) => return Err(wrong("tools", "an array", v)),
    };
    let tool_choice = match field(&m, "tool_choice") {
        None => None,
        Some(v @ Value::String(s)) => {
            if !["none", "auto", "required"].contains(&s.as_str()) {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("`tool_choice` = \"{s}\" (none, auto, required, or an object)"),
                ));
            }
            Some(v.clone())
        }
        Some(v @ Value::Object(_)) => Some(v.clone()),
        Some(v) => return Err(wrong("tool_choice", "a string or an object", v)),
    };
    Ok(ChatRequest {
        model,
        messages,
        tools,
        tool_choice,
        gen: gen_params(&m, None, logprobs)?,
        stream,
        include_usage,
    })
}

/// Token ids from a JSON array of integers.
fn token_ids(a: &[Value], param: &str) -> Result<Vec<u32>, ApiError> {
    a.iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_u64()
                .and_then(|t| u32::try_from(t).ok())
                .ok_or_else(|| wrong(&format!("{param}[{i}]"), "a token id (0 to 2^32-1)", v))
        })
        .collect()
}

/// Parses and validates a (legacy) completions body.
pub fn parse_completion(body: &[u8]) -> Result<CompletionRequest, ApiError> {
    let m = object(body)?;
    let model = required_string(&m, "model")?;
    let one = |n: usize| {
        ApiError::invalid(
            "prompt",
            format!("`prompt` holds {n} prompts: lmrr serve takes one per request"),
        )
    };
    let prompt = match field(&m, "prompt") {
        None => return Err(ApiError::invalid("prompt", "`prompt` is required")),
        Some(Value::String(s)) => Prompt::Text(s.clone()),
        Some(Value::Array(a)) => match a.as_slice() {
            [] => return Err(ApiError::invalid("prompt", "`prompt` is empty")),
            [Value::String(s)] => Prompt::Text(s.clone()),
            [Value::Array(t)] => Prompt::Tokens(token_ids(t, "prompt[0]")?),
            [Value::Number(_), ..] => Prompt::Tokens(token_ids(a, "prompt")?),
            [Value::String(_) | Value::Array(_), ..] => return Err(one(a.len())),
            [v, ..] => {
                return Err(wrong(
                    "prompt[0]",
                    "a string, a token id or an array of token ids",
                    v,
                ))
            }
        },
        Some(v) => return Err(wrong("prompt", "a string or an array of token ids", v)),
    };
    check_n(&m, "n")?;
    if let Some(b) = opt_i64(&m, "best_of")? {
        if b != 1 {
            return Err(ApiError::invalid(
                "best_of",
                format!("`best_of` = {b} is not supported by lmrr serve (only 1)"),
            ));
        }
    }
    if opt_bool(&m, "echo")? == Some(true) {
        return Err(ApiError::invalid(
            "echo",
            "`echo` is not supported by lmrr serve",
        ));
    }
    match field(&m, "suffix") {
        None => {}
        Some(Value::String(s)) if s.is_empty() => {}
        Some(_) => {
            return Err(ApiError::invalid(
                "suffix",
                "`suffix` is not supported by lmrr serve",
            ))
        }
    }
    refuse_unsupported(&m)?;
    let logprobs = completion_logprobs(&m)?;
    let (stream, include_usage) = stream_flags(&m)?;
    Ok(CompletionRequest {
        model,
        prompt,
        gen: gen_params(&m, Some(COMPLETIONS_DEFAULT_MAX_TOKENS), logprobs)?,
        stream,
        include_usage,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn chat(v: Value) -> Result<ChatRequest, ApiError> {
        parse_chat(v.to_string().as_bytes())
    }

    #[test]
    fn a_plain_chat_request_parses_with_openai_defaults() {
        let r = chat(serde_json::json!({
            "model": "m", "messages": [{"role": "user", "content": "hi"}]
        }))
        .unwrap();
        assert_eq!(r.messages[0].content.as_deref(), Some("hi"));
        assert_eq!(r.gen.temperature, 1.0);
        assert_eq!(r.gen.max_tokens, None);
        assert!(!r.stream);
    }

    #[test]
    fn errors_name_the_field() {
        let cases = [
            (serde_json::json!({"messages": []}), "model"),
            (serde_json::json!({"model": "m"}), "messages"),
            (
                serde_json::json!({"model": "m", "messages": [{"role": "user", "content": 3}]}),
                "messages[0].content",
            ),
            (
                serde_json::json!({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}),
                "messages[0].role",
            ),
            (
                serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}),
                "temperature",
            ),
            (
                serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2}),
                "n",
            ),
            (
                serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}),
                "max_tokens",
            ),
            (
                serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ["a", 1]}),
                "stop[1]",
            ),
            (
                serde_json::json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
                "messages[0].content[0].type",
            ),
            (
                serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": true}}),
                "stream_options",
            ),
        ];
        for (body, param) in cases {
            let e = chat(body.clone()).unwrap_err();
            assert_eq!(e.status, 400, "{body}");
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {e}");
        }
    }

    #[test]
    fn logprobs_are_parsed_per_endpoint() {
        let c = |extra: Value| {
            let mut b =
                serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "x"}]});
            for (k, v) in extra.as_object().unwrap() {
                b[k] = v.clone();
            }
            chat(b).map(|r| r.gen.logprobs)
        };
        assert_eq!(c(serde_json::json!({})).unwrap(), None);
        assert_eq!(c(serde_json::json!({"logprobs": false})).unwrap(), None);
        assert_eq!(c(serde_json::json!({"logprobs": true})).unwrap(), Some(0));
        assert_eq!(
            c(serde_json::json!({"logprobs": true, "top_logprobs": 20})).unwrap(),
            Some(20)
        );
        assert_eq!(c(serde_json::json!({"top_logprobs": 0})).unwrap(), None);
        assert_eq!(
            c(serde_json::json!({"logprobs": null, "top_logprobs": null})).unwrap(),
            None
        );
        let p = |extra: Value| {
            let mut b = serde_json::json!({"model": "m", "prompt": "x"});
            for (k, v) in extra.as_object().unwrap() {
                b[k] = v.clone();
            }
            parse_completion(b.to_string().as_bytes()).map(|r| r.gen.logprobs)
        };
        assert_eq!(p(serde_json::json!({})).unwrap(), None);
        assert_eq!(p(serde_json::json!({"logprobs": null})).unwrap(), None);
        assert_eq!(p(serde_json::json!({"logprobs": 0})).unwrap(), Some(0));
        assert_eq!(p(serde_json::json!({"logprobs": 5})).unwrap(), Some(5));
        assert_eq!(
            p(serde_json::json!({"logprobs": 2, "top_logprobs": 0})).unwrap(),
            Some(2)
        );
    }

    #[test]
    fn logprob_errors_name_the_field_the_number_and_the_range() {
        let chat_with = |extra: Value| {
            let mut b =
                serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "x"}]});
            for (k, v) in extra.as_object().unwrap() {
                b[k] = v.clone();
            }
            chat(b).unwrap_err()
        };
        let completion_with = |extra: Value| {
            let mut b = serde_json::json!({"model": "m", "prompt": "x"});
            for (k, v) in extra.as_object().unwrap() {
                b[k] = v.clone();
            }
            parse_completion(b.to_string().as_bytes()).unwrap_err()
        };
        let cases = [
            (
                chat_with(serde_json::json!({"logprobs": true, "top_logprobs": 21})),
                "top_logprobs",
                &["21", "[0, 20]"][..],
            ),
            (
                chat_with(serde_json::json!({"logprobs": true, "top_logprobs": -1})),
                "top_logprobs",
                &["-1", "[0, 20]"],
            ),
            (
                chat_with(serde_json::json!({"top_logprobs": 3})),
                "top_logprobs",
                &["3", "`logprobs: true`"],
            ),
            (
                chat_with(serde_json::json!({"logprobs": false, "top_logprobs": 3})),
                "top_logprobs",
                &["3", "`logprobs: true`"],
            ),
            (
                chat_with(serde_json::json!({"logprobs": 5})),
                "logprobs",
                &["boolean"],
            ),
            (
                chat_with(serde_json::json!({"logprobs": true, "top_logprobs": 2.5})),
                "top_logprobs",
                &["integer", "2.5"],
            ),
            (
                completion_with(serde_json::json!({"logprobs": 6})),
                "logprobs",
                &["6", "[0, 5]"],
            ),
            (
                completion_with(serde_json::json!({"logprobs": -2})),
                "logprobs",
                &["-2", "[0, 5]"],
            ),
            (
                completion_with(serde_json::json!({"logprobs": true})),
                "logprobs",
                &["integer", "0 to 5"],
            ),
            (
                completion_with(serde_json::json!({"logprobs": 1, "top_logprobs": 3})),
                "top_logprobs",
                &["chat field"],
            ),
        ];
        for (e, param, words) in cases {
            assert_eq!(e.status, 400, "{e}");
            assert_eq!(e.param.as_deref(), Some(param), "{e}");
            for w in words {
                assert!(e.message.contains(w), "{w:?} not in {e}");
            }
        }
    }

    #[test]
    fn malformed_json_is_a_400_without_a_param() {
        let e = parse_chat(b"{\"model\": ").unwrap_err();
        assert_eq!(e.status, 400);
        assert!(e.message.contains("not valid JSON"), "{e}");
        let e = parse_chat(b"[1, 2]").unwrap_err();
        assert!(e.message.contains("JSON object"), "{e}");
    }

    #[test]
    fn completion_prompts_as_text_or_tokens() {
        let p = |v: Value| {
            parse_completion(
                serde_json::json!({"model": "m", "prompt": v})
                    .to_string()
                    .as_bytes(),
            )
        };
        assert_eq!(
            p(serde_json::json!("hi")).unwrap().prompt,
            Prompt::Text("hi".into())
        );
        assert_eq!(
            p(serde_json::json!(["hi"])).unwrap().prompt,
            Prompt::Text("hi".into())
        );
        assert_eq!(
            p(serde_json::json!([1, 2])).unwrap().prompt,
            Prompt::Tokens(vec![1, 2])
        );
        assert_eq!(
            p(serde_json::json!([[1, 2]])).unwrap().prompt,
            Prompt::Tokens(vec![1, 2])
        );
        assert_eq!(
            p(serde_json::json!(["a", "b"]))
                .unwrap_err()
                .param
                .as_deref(),
            Some("prompt")
        );
        assert_eq!(
            p(serde_json::json!([1, -2])).unwrap_err().param.as_deref(),
            Some("prompt[1]")
        );
        assert_eq!(
            p(serde_json::json!("x")).unwrap().gen.max_tokens,
            Some(COMPLETIONS_DEFAULT_MAX_TOKENS)
        );
    }

    /// Arbitrary JSON, biased towards the fields the parser reads.
    fn arb_json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(|i| serde_json::json!(i)),
            any::<u64>().prop_map(|i| serde_json::json!(i)),
            any::<f64>().prop_map(|f| serde_json::json!(f)),
            "[a-z ]{0,8}".prop_map(Value::String),
            prop_oneof![
                Just("user"),
                Just("assistant"),
                Just("tool"),
                Just("system"),
                Just("text"),
                Just("m")
            ]
            .prop_map(|s| Value::String(s.into())),
        ];
        let keys = prop_oneof![
            Just("model"),
            Just("messages"),
            Just("role"),
            Just("content"),
            Just("type"),
            Just("text"),
            Just("prompt"),
            Just("temperature"),
            Just("top_p"),
            Just("top_k"),
            Just("seed"),
            Just("stop"),
            Just("n"),
            Just("max_tokens"),
            Just("max_completion_tokens"),
            Just("stream"),
            Just("stream_options"),
            Just("include_usage"),
            Just("tools"),
            Just("tool_choice"),
            Just("tool_calls"),
            Just("logprobs"),
            Just("top_logprobs"),
            Just("logit_bias"),
            Just("response_format"),
            Just("echo"),
            Just("best_of"),
        ];
        leaf.prop_recursive(4, 48, 6, move |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                prop::collection::btree_map(keys.clone(), inner, 0..8).prop_map(|m| {
                    Value::Object(m.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
                }),
            ]
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn parsing_never_panics_and_accepted_values_are_in_range(v in arb_json()) {
            let body = v.to_string();
            for r in [parse_chat(body.as_bytes()).map(|r| r.gen), parse_completion(body.as_bytes()).map(|r| r.gen)] {
                match r {
                    Ok(g) => {
                        prop_assert!(g.temperature.is_finite() && (0.0..=2.0).contains(&g.temperature));
                        prop_assert!(g.top_p > 0.0 && g.top_p <= 1.0);
                        prop_assert!(g.max_tokens.is_none_or(|n| n >= 1));
                        prop_assert!(g.stop.len() <= MAX_STOP);
                        prop_assert!(g.logprobs.is_none_or(|k| k <= MAX_TOP_LOGPROBS_CHAT));
                    }
                    Err(e) => prop_assert_eq!(e.status, 400),
                }
            }
        }

        #[test]
        fn arbitrary_bytes_never_panic(b in prop::collection::vec(any::<u8>(), 0..256)) {
            let _ = parse_chat(&b);
            let _ = parse_completion(&b);
        }
    }
}
