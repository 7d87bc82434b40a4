//! One response's body: OpenAI's JSON for a whole answer and its
//! server-sent events for a streamed one, built from the engine's updates.
//! Presentation only: what the engine sampled and the bundle recorded is
//! never changed here.
//!
//! Streaming responses are OpenAI's server-sent events: one
//! `data: {json}\n\n` per chunk — a first chunk with the assistant role, one
//! per text piece, one with the `finish_reason`, with
//! `stream_options.include_usage` a last chunk with empty `choices` and the
//! usage (every earlier chunk then carries `"usage": null`) — and
//! `data: [DONE]\n\n`. An error after the stream started is sent as
//! `data: {"error": {...}}\n\n` with no `[DONE]`.
//!
//! Tool calls: on a chat request with `tools` (and `tool_choice` not
//! `"none"`) the answer's `<tool_call>` blocks are shown as
//! `message.tool_calls` (streamed: one `delta.tool_calls` chunk per call once
//! its block is complete, the text that may begin one held back meanwhile),
//! the rest as `content` (trimmed; null when empty), and `finish_reason` is
//! `tool_calls` when there is a call; see [`crate::tools`]. Presentation
//! only: the logprob entries, `usage` and the bundle are the tokens sampled.
//!
//! Logprobs, when asked for, are in each choice's `logprobs` (null
//! otherwise, and in the role chunk): chat's `{"content": [{"token",
//! "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`,
//! completions' legacy `{"tokens", "token_logprobs", "top_logprobs": [{token:
//! logprob}], "text_offset"}`. A token's `token` is its bytes as lossy UTF-8
//! (a token holding part of a character shows U+FFFD; `bytes` has the truth);
//! a logprob is the engine's f32 written as the f64 it widens to (a client's
//! f64 parse, cast back to f32, gives the very bits), −∞ written as OpenAI's
//! −9999.0 and a NaN row as null. A stream's entries travel with the next
//! text piece (or tool call) after their token was sampled (the text of a
//! token held back by the detokenizer, a stop sequence or a possible tool
//! call may come chunks later), and any left at the end (the token that
//! completed a stop sequence) with the `finish_reason` chunk; concatenated,
//! they are the response's tokens.
//! Legacy `top_logprobs` objects are keyed by token text: alternatives with
//! the same text keep the likeliest; `text_offset` counts the characters
//! begun before each token in the completion.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::engine::{Finish, Kind, TokenLogprob, Update};
use crate::error::ApiError;
use crate::server::App;
use crate::tools::{self, Piece, ToolStream};

pub(crate) fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

/// A streaming response's state between updates.
pub(crate) struct StreamState {
    rx: mpsc::Receiver<Update>,
    queue: std::collections::VecDeque<Bytes>,
    done: bool,
    /// Logprob entries not sent yet, and the legacy `text_offset`.
    pending: Vec<TokenLogprob>,
    offset: usize,
    include_usage: bool,
    /// The answer's tool-call reader, when its calls are shown as such.
    tools: Option<ToolStream>,
    /// Tool calls sent.
    calls: usize,
}

/// A response being built.
pub(crate) struct Meta {
    pub(crate) app: Arc<App>,
    pub(crate) name: String,
    pub(crate) bundle: Option<String>,
    pub(crate) created: u64,
    pub(crate) kind: Kind,
    /// Whether the client asked for logprobs.
    pub(crate) logprobs: bool,
    /// The request's tool names when the answer's calls become `tool_calls`
    /// (a chat request with `tools`, `tool_choice` not `"none"`; see
    /// [`tools`]); `None` leaves the answer as text.
    pub(crate) tools: Option<Vec<String>>,
}

/// OpenAI's floor for a logprob JSON cannot write (−∞).
pub(crate) const LOGPROB_FLOOR: f64 = -9999.0;

/// A logprob as JSON: the f32 widened to f64 (exact), −∞ as the floor,
/// NaN or missing as null.
pub(crate) fn logprob_json(x: Option<f32>) -> Value {
    match x {
        Some(x) if x.is_finite() => json!(f64::from(x)),
        Some(x) if x == f32::NEG_INFINITY => json!(LOGPROB_FLOOR),
        _ => Value::Null,
    }
}

/// Characters begun in `bytes` (UTF-8 lead bytes and invalid ones).
pub(crate) fn chars_begun(bytes: &[u8]) -> usize {
    bytes.iter().filter(|&&b| b & 0xC0 != 0x80).count()
}

pub(crate) fn usage(f: &Finish) -> Value {
    json!({
        "prompt_tokens": f.prompt_tokens,
        "completion_tokens": f.completion_tokens,
        "total_tokens": f.prompt_tokens + f.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": f.cached_tokens},
    })
}

impl Meta {
    pub(crate) fn bytes(&self, t: u32) -> &[u8] {
        self.app
            .token_bytes
            .get(t as usize)
            .map_or(&[][..], Vec::as_slice)
    }

    /// Chat's `{"token", "logprob", "bytes"}`.
    pub(crate) fn chat_token(&self, t: u32, logprob: Option<f32>) -> Value {
        let b = self.bytes(t);
        json!({
            "token": String::from_utf8_lossy(b),
            "logprob": logprob_json(logprob),
            "bytes": b,
        })
    }

    /// A choice's `logprobs` for these entries: null unless asked for.
    /// `offset` is the legacy `text_offset` of the first entry; it moves on.
    pub(crate) fn logprobs_json(&self, entries: &[TokenLogprob], offset: &mut usize) -> Value {
        if !self.logprobs {
            return Value::Null;
        }
        match self.kind {
            Kind::Chat => {
                let content: Vec<Value> = entries
                    .iter()
                    .map(|e| {
                        let mut v = self.chat_token(e.token, e.logprob);
                        v["top_logprobs"] = e
                            .top
                            .iter()
                            .map(|&(t, lp)| self.chat_token(t, Some(lp)))
                            .collect();
                        v
                    })
                    .collect();
                json!({"content": content})
            }
            Kind::Completion => {
                let mut tokens = Vec::with_capacity(entries.len());
                let mut token_logprobs = Vec::with_capacity(entries.len());
                let mut top = Vec::with_capacity(entries.len());
                let mut text_offset = Vec::with_capacity(entries.len());
                for e in entries {
                    let b = self.bytes(e.token);
                    tokens.push(Value::String(String::from_utf8_lossy(b).into_owned()));
                    token_logprobs.push(logprob_json(e.logprob));
                    let mut alts = serde_json::Map::new();
                    for &(t, lp) in &e.top {
                        alts.entry(String::from_utf8_lossy(self.bytes(t)).into_owned())
                            .or_insert_with(|| logprob_json(Some(lp)));
                    }
                    top.push(Value::Object(alts));
                    text_offset.push(*offset);
                    *offset += chars_begun(b);
                }
                json!({
                    "tokens": tokens,
                    "token_logprobs": token_logprobs,
                    "top_logprobs": top,
                    "text_offset": text_offset,
                })
            }
        }
    }

    pub(crate) fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Completion, _) => "text_completion",
        }
    }

    pub(crate) fn lmrr(&self, f: &Finish) -> Value {
        json!({"request": self.name, "bundle": self.bundle, "digest": f.digest})
    }

    pub(crate) fn headers(&self, r: &mut Response) {
        let h = r.headers_mut();
        if let Ok(v) = HeaderValue::from_str(&self.name) {
            h.insert("x-lmrr-request", v);
        }
        if let Some(v) = self
            .bundle
            .as_deref()
            .and_then(|b| HeaderValue::from_str(b).ok())
        {
            h.insert("x-lmrr-bundle", v);
        }
    }

    /// A non-streaming response: waits for the end.
    pub(crate) async fn whole(self, mut rx: mpsc::Receiver<Update>) -> Result<Response, ApiError> {
        let mut text = String::new();
        let mut entries = Vec::new();
        let fin = loop {
            match rx.recv().await {
                Some(Update::Text { text: t, logprobs }) => {
                    text.push_str(&t);
                    entries.extend(logprobs);
                }
                Some(Update::Finished(f)) => break f,
                Some(Update::Failed(e)) => return Err(e),
                Some(Update::Started { .. }) => {}
                None => return Err(ApiError::server("the engine loop stopped")),
            }
        };
        let logprobs = self.logprobs_json(&entries, &mut 0);
        let choice = match self.kind {
            Kind::Chat => {
                let (message, reason) = self.message(text, fin.reason);
                json!({
                    "index": 0,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": reason,
                })
            }
            Kind::Completion => json!({
                "index": 0,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": fin.reason,
            }),
        };
        let body = json!({
            "id": self.name,
            "object": self.object(false),
            "created": self.created,
            "model": self.app.model_name,
            "system_fingerprint": self.app.fingerprint,
            "choices": [choice],
            "usage": usage(&fin),
            "lmrr": self.lmrr(&fin),
        });
        let mut r = (
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            body.to_string(),
        )
            .into_response();
        self.headers(&mut r);
        Ok(r)
    }

    /// A whole answer's assistant message and its `finish_reason`:
    /// `tool_calls` when the answer made calls.
    pub(crate) fn message(&self, text: String, reason: &'static str) -> (Value, &'static str) {
        let Some(names) = &self.tools else {
            return (json!({"role": "assistant", "content": text}), reason);
        };
        let s = tools::split(&text, names);
        self.warn_rejected(&s.rejected);
        if s.calls.is_empty() {
            return (json!({"role": "assistant", "content": s.content}), reason);
        }
        let calls: Vec<Value> = s
            .calls
            .iter()
            .enumerate()
            .map(|(i, c)| c.to_json(&self.name, i))
            .collect();
        (
            json!({"role": "assistant", "content": s.content, "tool_calls": calls}),
            "tool_calls",
        )
    }

    pub(crate) fn warn_rejected(&self, rejected: &[tools::BadCall]) {
        for why in rejected {
            eprintln!(
                "lmrr serve: {}: warning: a {} block left in the content: {why}",
                self.name,
                tools::OPEN
            );
        }
    }

    pub(crate) fn chunk(&self, choices: Value, include_usage: bool) -> Value {
        let mut c = json!({
            "id": self.name,
            "object": self.object(true),
            "created": self.created,
            "model": self.app.model_name,
            "system_fingerprint": self.app.fingerprint,
            "choices": choices,
        });
        if include_usage {
            c["usage"] = Value::Null;
        }
        c
    }

    pub(crate) fn delta(
        &self,
        text: &str,
        first: bool,
        finish: Option<&str>,
        logprobs: Value,
    ) -> Value {
        match self.kind {
            Kind::Chat => {
                let delta = match (first, finish) {
                    (_, Some(_)) => json!({}),
                    (true, None) => json!({"role": "assistant", "content": text}),
                    (false, None) => json!({"content": text}),
                };
                json!([{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}])
            }
            Kind::Completion => {
                json!([{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}])
            }
        }
    }

    /// A streamed tool call: its whole entry in one delta, `index` counting
    /// the answer's calls.
    pub(crate) fn call_delta(
        &self,
        call: &tools::ToolCall,
        index: usize,
        logprobs: Value,
    ) -> Value {
        let mut c = call.to_json(&self.name, index);
        c["index"] = json!(index);
        json!([{"index": 0, "delta": {"tool_calls": [c]}, "logprobs": logprobs, "finish_reason": null}])
    }

    /// Queues a chunk for each piece, the logprob entries not sent yet on
    /// the first.
    pub(crate) fn pieces(&self, st: &mut StreamState, pieces: Vec<Piece>) {
        for p in pieces {
            let lp = self.logprobs_json(&st.pending, &mut st.offset);
            st.pending.clear();
            let choices = match p {
                Piece::Content(text) => self.delta(&text, false, None, lp),
                Piece::Call(c) => {
                    let d = self.call_delta(&c, st.calls, lp);
                    st.calls += 1;
                    d
                }
            };
            st.queue
                .push_back(sse(&self.chunk(choices, st.include_usage)));
        }
    }

    /// A streaming response.
    pub(crate) fn stream(self, rx: mpsc::Receiver<Update>, include_usage: bool) -> Response {
        let mut st = StreamState {
            rx,
            queue: Default::default(),
            done: false,
            pending: Vec::new(),
            offset: 0,
            include_usage,
            tools: self.tools.clone().map(ToolStream::new),
            calls: 0,
        };
        // The role chunk goes out with the headers (chat only).
        if self.kind == Kind::Chat {
            st.queue.push_back(sse(
                &self.chunk(self.delta("", true, None, Value::Null), include_usage)
            ));
        }
        let meta = Arc::new(self);
        let m2 = meta.clone();
        let body = futures_util::stream::unfold(st, move |mut st| {
            let meta = m2.clone();
            async move {
                loop {
                    if let Some(b) = st.queue.pop_front() {
                        return Some((Ok::<Bytes, std::convert::Infallible>(b), st));
                    }
                    if st.done {
                        return None;
                    }
                    match st.rx.recv().await {
                        Some(Update::Text { text, logprobs }) => {
                            st.pending.extend(logprobs);
                            if !text.is_empty() {
                                let pieces = match &mut st.tools {
                                    Some(t) => t.push(&text),
                                    None => vec![Piece::Content(text)],
                                };
                                meta.pieces(&mut st, pieces);
                            }
                        }
                        Some(Update::Finished(f)) => {
                            let mut reason = f.reason;
                            if let Some(mut t) = st.tools.take() {
                                meta.pieces(&mut st, t.finish());
                                meta.warn_rejected(t.rejected());
                                if t.calls() > 0 {
                                    reason = "tool_calls";
                                }
                            }
                            let lp = if st.pending.is_empty() {
                                Value::Null
                            } else {
                                meta.logprobs_json(&st.pending, &mut st.offset)
                            };
                            let mut last =
                                meta.chunk(meta.delta("", false, Some(reason), lp), include_usage);
                            last["lmrr"] = meta.lmrr(&f);
                            st.queue.push_back(sse(&last));
                            if include_usage {
                                let mut u = meta.chunk(json!([]), true);
                                u["usage"] = usage(&f);
                                st.queue.push_back(sse(&u));
                            }
                            st.queue.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
                            st.done = true;
                        }
                        Some(Update::Failed(e)) => {
                            st.queue.push_back(sse(&e.body()));
                            st.done = true;
                        }
                        Some(Update::Started { .. }) => {}
                        None => {
                            st.queue.push_back(sse(
                                &ApiError::server("the engine loop stopped").body()
                            ));
                            st.done = true;
                        }
                    }
                }
            }
        });
        let mut r = Response::new(Body::from_stream(body));
        let h = r.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        meta.headers(&mut r);
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::BODY_LIMIT;
    use crate::template::Renderer;
    use http_body_util::BodyExt;
    use lmrr_engine::Model;
    use lmrr_engine::SynthSpec;

    const NAME: &str = "chatcmpl-0-7";

    fn meta(tools: bool) -> Meta {
        let tools = tools.then(|| vec!["get_weather".to_string()]);
        let model = Model::synthetic(SynthSpec::embedded_default()).unwrap();
        let app = App {
            renderer: Renderer::new(&model).unwrap(),
            token_bytes: model.tokenizer.byte_table(),
            model: Arc::new(model),
            model_name: "tiny".into(),
            api_key: None,
            engine: crate::engine::EngineHandle::detached(),
            body_limit: BODY_LIMIT,
            fingerprint: "fp".into(),
            started: 0,
        };
        Meta {
            app: Arc::new(app),
            name: NAME.into(),
            bundle: Some("b.lmrr".into()),
            created: 0,
            kind: Kind::Chat,
            logprobs: true,
            tools,
        }
    }

    /// The engine's side of a request: a text update per piece, each with
    /// one logprob entry (token `10 + i`, logprob `-i/4`), then the end.
    fn updates(pieces: &[&str], reason: &'static str) -> mpsc::Receiver<Update> {
        let (tx, rx) = mpsc::channel(pieces.len() + 1);
        for (i, p) in pieces.iter().enumerate() {
            tx.try_send(Update::Text {
                text: p.to_string(),
                logprobs: vec![TokenLogprob {
                    token: 10 + i as u32,
                    logprob: Some(-(i as f32) / 4.0),
                    top: Vec::new(),
                }],
            })
            .unwrap();
        }
        tx.try_send(Update::Finished(Finish {
            reason,
            prompt_tokens: 11,
            completion_tokens: pieces.len(),
            cached_tokens: 3,
            digest: "d1g".into(),
        }))
        .unwrap();
        rx
    }

    async fn body(r: Response) -> String {
        let b = r.into_body().collect().await.unwrap().to_bytes();
        String::from_utf8(b.to_vec()).unwrap()
    }

    /// The entries' tokens (found by their bytes among 10..20) and
    /// logprobs, as the response shows them.
    fn entries(table: &[Vec<u8>], lp: &Value) -> Vec<(u32, f64)> {
        let Some(a) = lp["content"].as_array() else {
            return Vec::new();
        };
        a.iter()
            .map(|e| {
                let bytes: Vec<u8> = e["bytes"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_u64().unwrap() as u8)
                    .collect();
                let id = (10..20).find(|&t| table[t as usize] == bytes).unwrap();
                (id, e["logprob"].as_f64().unwrap())
            })
            .collect()
    }

    const PIECES: [&str; 4] = [
        "I'll look.\n<tool",
        "_call>\n{\"name\": \"get_weather\", ",
        "\"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>{\"name\": \"now\", ",
        "\"arguments\": \"{}\"}</tool_call>",
    ];

    fn expected_calls() -> Value {
        json!([
            {"id": "call_chatcmpl-0-7_0", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}},
            {"id": "call_chatcmpl-0-7_1", "type": "function",
             "function": {"name": "now", "arguments": "{}"}},
        ])
    }

    fn expected_entries() -> Vec<(u32, f64)> {
        vec![(10, 0.0), (11, -0.25), (12, -0.5), (13, -0.75)]
    }

    #[tokio::test]
    async fn a_whole_answer_with_tool_calls_is_openai_shaped_and_keeps_the_rest() {
        let m = meta(true);
        let table = m.app.token_bytes.clone();
        let r = m.whole(updates(&PIECES, "stop")).await.unwrap();
        let v: Value = serde_json::from_str(&body(r).await).unwrap();
        let c = &v["choices"][0];
        assert_eq!(c["message"]["content"], json!("I'll look."));
        assert_eq!(c["message"]["tool_calls"], expected_calls());
        assert_eq!(c["finish_reason"], json!("tool_calls"));
        assert_eq!(entries(&table, &c["logprobs"]), expected_entries());
        assert_eq!(
            v["usage"],
            json!({"prompt_tokens": 11, "completion_tokens": 4, "total_tokens": 15,
                   "prompt_tokens_details": {"cached_tokens": 3}})
        );
        assert_eq!(
            v["lmrr"],
            json!({"request": NAME, "bundle": "b.lmrr", "digest": "d1g"})
        );
        // Only calls: the content is null.
        let r = meta(true)
            .whole(updates(
                &[&PIECES[0][10..], PIECES[1], PIECES[2], PIECES[3]],
                "stop",
            ))
            .await
            .unwrap();
        let v: Value = serde_json::from_str(&body(r).await).unwrap();
        assert_eq!(v["choices"][0]["message"]["content"], Value::Null);
        assert_eq!(v["choices"][0]["message"]["tool_calls"], expected_calls());
    }

    #[tokio::test]
    async fn without_tools_the_answer_is_untouched() {
        let r = meta(false).whole(updates(&PIECES, "stop")).await.unwrap();
        let v: Value = serde_json::from_str(&body(r).await).unwrap();
        let m = &v["choices"][0]["message"];
        assert_eq!(m["content"], json!(PIECES.concat()));
        assert!(m.get("tool_calls").is_none(), "{m}");
        assert_eq!(v["choices"][0]["finish_reason"], json!("stop"));
    }

    /// A stream's chunks: content joined, tool-call deltas, logprob entries
    /// joined, the finish reason; checks the framing on the way.
    async fn streamed(
        meta: Meta,
        pieces: &[&str],
        reason: &'static str,
    ) -> (String, Vec<Value>, Vec<(u32, f64)>, Value) {
        let table = meta.app.token_bytes.clone();
        let text = body(meta.stream(updates(pieces, reason), false)).await;
        let events: Vec<&str> = text.split_terminator("\n\n").collect();
        assert_eq!(events.last(), Some(&"data: [DONE]"), "{text}");
        let mut content = String::new();
        let mut calls = Vec::new();
        let mut lps = Vec::new();
        let mut finish = Value::Null;
        for e in &events[..events.len() - 1] {
            let v: Value = serde_json::from_str(e.strip_prefix("data: ").unwrap()).unwrap();
            assert_eq!(v["id"], json!(NAME));
            let c = &v["choices"][0];
            content.push_str(c["delta"]["content"].as_str().unwrap_or(""));
            if let Some(t) = c["delta"]["tool_calls"].as_array() {
                assert!(c["delta"].get("content").is_none(), "{v}");
                calls.extend(t.iter().cloned());
            }
            lps.extend(entries(&table, &c["logprobs"]));
            if !c["finish_reason"].is_null() {
                finish = c["finish_reason"].clone();
            }
        }
        (content, calls, lps, finish)
    }

    #[tokio::test]
    async fn a_streamed_answer_sends_each_call_as_a_delta_once_complete() {
        let (content, calls, lps, finish) = streamed(meta(true), &PIECES, "stop").await;
        assert_eq!(content, "I'll look.");
        let mut want = expected_calls();
        for (i, c) in want.as_array_mut().unwrap().iter_mut().enumerate() {
            c["index"] = json!(i);
        }
        assert_eq!(Value::Array(calls), want);
        assert_eq!(lps, expected_entries());
        assert_eq!(finish, json!("tool_calls"));
        // Without tools: the text as it came.
        let (content, calls, lps, finish) = streamed(meta(false), &PIECES, "stop").await;
        assert_eq!(content, PIECES.concat());
        assert!(calls.is_empty());
        assert_eq!(lps, expected_entries());
        assert_eq!(finish, json!("stop"));
        // A call, then a block cut by the end of generation: the cut block
        // is content; a call was sent, so the reason is `tool_calls`.
        let (content, calls, lps, finish) = streamed(meta(true), &PIECES[..3], "length").await;
        assert_eq!(content, "I'll look.\n\n<tool_call>{\"name\": \"now\",");
        assert_eq!(Value::Array(calls), json!([want[0]]));
        assert_eq!(lps, expected_entries()[..3]);
        assert_eq!(finish, json!("tool_calls"));
        // Only a cut block: all content, the engine's reason.
        let (content, calls, _, finish) = streamed(
            meta(true),
            &["Sure: <tool_call>{\"name\"", ": \"now\""],
            "length",
        )
        .await;
        assert_eq!(content, "Sure: <tool_call>{\"name\": \"now\"");
        assert!(calls.is_empty());
        assert_eq!(finish, json!("length"));
    }
}
