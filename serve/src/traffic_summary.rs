//! A traffic bundle summarised for `lmrr inspect`: per request its path,
//! model, streaming, status, chunks and how it ended; counts over all.
//! Never fails: a body that is not JSON is listed without what only JSON
//! says (model, stream flag, message count).

use serde::Serialize;

use lmrr_recorder::traffic::{Outcome, TrafficBundle, TrafficEvent};

/// One recorded request, as `lmrr inspect` lists it.
#[derive(Debug, Clone, Serialize)]
pub struct RequestSummary {
    pub id: u64,
    pub path: String,
    /// The body's `model`, when it is JSON and names one.
    pub model: Option<String>,
    pub stream: bool,
    /// Messages in a chat body.
    pub messages: Option<usize>,
    pub status: Option<u16>,
    pub chunks: u32,
    /// `complete`, `client gone`, `upstream unreachable`, `upstream broken`,
    /// or `no end` (the recording stopped first).
    pub outcome: String,
    /// Chunks the client had been handed when the request ended.
    pub chunks_delivered: Option<u32>,
    /// Microseconds from arrival to end.
    pub duration_us: Option<u64>,
}

/// Counts of a traffic bundle, for `lmrr inspect`.
#[derive(Debug, Clone, Serialize)]
pub struct TrafficSummary {
    pub requests: usize,
    pub complete: usize,
    pub client_gone: usize,
    pub upstream_failed: usize,
    pub unfinished: usize,
    pub streamed: usize,
    pub chunks: usize,
    /// Bytes of request bodies and recorded chunks.
    pub body_bytes: usize,
    pub chunk_bytes: usize,
    pub integrity: String,
    pub list: Vec<RequestSummary>,
}

impl TrafficSummary {
    /// Summarises `b`.
    pub fn of(b: &TrafficBundle) -> Self {
        use std::collections::BTreeMap;
        let mut list: BTreeMap<u64, (RequestSummary, u64)> = BTreeMap::new();
        let (mut chunks, mut body_bytes, mut chunk_bytes) = (0, 0, 0);
        for e in &b.events {
            match e {
                TrafficEvent::Request {
                    id,
                    at_us,
                    path,
                    body,
                    ..
                } => {
                    body_bytes += body.len();
                    let v: Option<serde_json::Value> = serde_json::from_slice(body).ok();
                    let field = |k: &str| v.as_ref().and_then(|v| v.get(k));
                    list.entry(*id).or_insert((
                        RequestSummary {
                            id: *id,
                            path: path.clone(),
                            model: field("model").and_then(|m| m.as_str()).map(str::to_string),
                            stream: field("stream").and_then(|s| s.as_bool()) == Some(true),
                            messages: field("messages").and_then(|m| m.as_array()).map(Vec::len),
                            status: None,
                            chunks: 0,
                            outcome: "no end".into(),
                            chunks_delivered: None,
                            duration_us: None,
                        },
                        *at_us,
                    ));
                }
                TrafficEvent::Response { id, status, .. } => {
                    if let Some((r, _)) = list.get_mut(id) {
                        r.status = Some(*status);
                    }
                }
                TrafficEvent::Chunk { id, data, .. } => {
                    chunks += 1;
                    chunk_bytes += data.len();
                    if let Some((r, _)) = list.get_mut(id) {
                        r.chunks = r.chunks.saturating_add(1);
                    }
                }
                TrafficEvent::End {
                    id,
                    at_us,
                    outcome,
                    chunks_delivered,
                } => {
                    if let Some((r, t0)) = list.get_mut(id) {
                        r.outcome = match outcome {
                            Outcome::Complete => "complete",
                            Outcome::ClientGone => "client gone",
                            Outcome::UpstreamUnreachable { .. } => "upstream unreachable",
                            Outcome::UpstreamBroken { .. } => "upstream broken",
                        }
                        .into();
                        r.chunks_delivered = Some(*chunks_delivered);
                        r.duration_us = Some(at_us.saturating_sub(*t0));
                    }
                }
            }
        }
        let list: Vec<RequestSummary> = list.into_values().map(|(r, _)| r).collect();
        let count = |o: &str| list.iter().filter(|r| r.outcome == o).count();
        Self {
            requests: list.len(),
            complete: count("complete"),
            client_gone: count("client gone"),
            upstream_failed: count("upstream unreachable") + count("upstream broken"),
            unfinished: count("no end"),
            streamed: list.iter().filter(|r| r.stream).count(),
            chunks,
            body_bytes,
            chunk_bytes,
            integrity: b.integrity.to_string(),
            list,
        }
    }
}
