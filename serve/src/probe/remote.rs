//! The probes against an OpenAI-compatible server, through `lmrr proxy`'s
//! own client path ([`crate::proxy::send`]): every request is recorded in one
//! traffic bundle, which `lmrr audit` can check afterwards, and an
//! interrupted retry hangs up after `cut` chunks as a real client does. A
//! server's patches are its own, so the sweep has one panel, named by the
//! URL. Without a tokenizer, lengths are counted as four characters a token.

use std::path::Path;

use axum::http::Method;
use serde_json::{json, Value};

use lmrr_recorder::traffic::TrafficManifest;

use super::{
    haystack, needle, NeedleCell, ProbeReport, RecallRow, Sweep, FILLER, NEEDLE_VALUES,
    RECALL_FACTS, RECALL_QUESTION, RECALL_WORDS,
};
use crate::error::ServeError;
use crate::proxy::{self, ProxyConfig, Recording};

/// Characters per token where no tokenizer is at hand.
const CHARS_PER_TOKEN: usize = 4;

/// The text of a response: a JSON body's `choices[0].message.content`, or
/// the SSE events' `delta.content`, joined; an error the server sent (or no
/// response at all) is the error's message.
fn text_of(frames: &[axum::body::Bytes]) -> Result<String, String> {
    let all: Vec<u8> = frames.iter().flat_map(|f| f.iter().copied()).collect();
    if all.is_empty() {
        return Err("no response (the server closed the connection)".into());
    }
    let error = |v: &Value| {
        v.get("error").map(|e| {
            e.pointer("/message")
                .and_then(Value::as_str)
                .map_or_else(|| e.to_string(), str::to_string)
        })
    };
    if let Ok(v) = serde_json::from_slice::<Value>(&all) {
        if let Some(e) = error(&v) {
            return Err(format!("the server answered an error: {e}"));
        }
        return Ok(v
            .pointer("/choices/0/message/content")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string());
    }
    let mut out = String::new();
    for line in String::from_utf8_lossy(&all).lines() {
        let Some(d) = line.strip_prefix("data:") else {
            continue;
        };
        if let Ok(v) = serde_json::from_str::<Value>(d.trim()) {
            if let Some(e) = error(&v) {
                return Err(format!("the server's stream ended in an error: {e}"));
            }
            if let Some(t) = v
                .pointer("/choices/0/delta/content")
                .and_then(Value::as_str)
            {
                out.push_str(t);
            }
        }
    }
    Ok(out)
}

fn body(model: &str, messages: Value, max_tokens: usize, stream: bool) -> Vec<u8> {
    json!({
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    })
    .to_string()
    .into_bytes()
}

/// Runs the sweep against `url`, asking for `model_name`; `sentences` gives
/// the filler count for a length (a tokenizer's, else by characters).
pub fn run(
    url: &str,
    model_name: &str,
    sweep: &Sweep,
    dir: &Path,
    cfg_versions: (&str, &str),
    sentences: &dyn Fn(usize) -> usize,
    progress: &mut dyn FnMut(&str),
) -> Result<ProbeReport, ServeError> {
    let t0 = std::time::Instant::now();
    let cfg = ProxyConfig {
        upstream: url.to_string(),
        listen: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
        record_dir: dir.to_path_buf(),
        top_logprobs: 5,
        tool_version: cfg_versions.0.into(),
        git_revision: cfg_versions.1.into(),
    };
    let upstream = proxy::Upstream::parse(url)?;
    let manifest = TrafficManifest::new(
        &upstream.base,
        "probe",
        cfg.top_logprobs,
        "lmrr probe",
        &cfg.tool_version,
        &cfg.git_revision,
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .thread_name("lmrr-probe")
        .build()?;
    let rec = Recording::start(dir, &manifest)?;
    let traffic = rec.path.display().to_string();
    let p = proxy::state(&cfg, &rec)?;
    let panel = url.to_string();
    let mut report = ProbeReport {
        target: url.to_string(),
        patch_sets: vec![panel.clone()],
        sweep: sweep.clone(),
        needle: Vec::new(),
        recall: Vec::new(),
        seconds: 0.0,
    };
    let mut request = 0u64;
    // Each request's text (an error names the request), and its id in the
    // traffic bundle.
    let mut send = |b: Vec<u8>, cut: Option<u32>| -> Result<(String, u64), ServeError> {
        let frames = rt.block_on(proxy::send(
            &p,
            Method::POST,
            "/v1/chat/completions",
            b,
            cut,
        ));
        request += 1;
        let text = text_of(&frames).map_err(|what| ServeError::Probe {
            request: request - 1,
            what,
        })?;
        Ok((text, request - 1))
    };
    let (a, b) = NEEDLE_VALUES[0];
    for &length in &sweep.lengths {
        let n = sentences(length);
        for &depth in &sweep.depths {
            progress(&format!("needle {depth}% of {length} · {url}"));
            let msg = |v: &str| json!([{"role": "user", "content": haystack(n, depth, v)}]);
            let (ta, ia) = send(body(model_name, msg(a), sweep.needle_tokens, false), None)?;
            let (tb, _) = send(body(model_name, msg(b), sweep.needle_tokens, false), None)?;
            report.needle.push(NeedleCell {
                patches: panel.clone(),
                depth,
                length,
                prompt_tokens: haystack(n, depth, a).len() / CHARS_PER_TOKEN,
                needle_at: None,
                value: a.into(),
                recalled: ta.contains(a),
                read: ta != tb,
                answer: ta,
                same_as_reference: None,
                bundle: format!("{traffic}#request-{ia}"),
            });
        }
    }
    for &cut in &sweep.cuts {
        for interrupted in [false, true] {
            progress(&format!(
                "recall, retry {} after {cut} · {url}",
                if interrupted { "cut" } else { "ending" }
            ));
            let facts = json!({"role": "user", "content": RECALL_FACTS});
            send(body(model_name, json!([facts]), 4, false), None)?;
            let (partial, _) = if interrupted {
                send(body(model_name, json!([facts]), 400, true), Some(cut))?
            } else {
                send(body(model_name, json!([facts]), cut as usize, true), None)?
            };
            let history = json!([
                facts,
                {"role": "assistant", "content": partial},
                {"role": "user", "content": RECALL_QUESTION},
            ]);
            let (answer, ia) = send(body(model_name, history, sweep.recall_tokens, false), None)?;
            report.recall.push(RecallRow {
                patches: panel.clone(),
                cut,
                interrupted,
                partial,
                recalled: RECALL_WORDS
                    .iter()
                    .filter(|w| answer.to_lowercase().contains(&w.to_lowercase()))
                    .map(|w| w.to_string())
                    .collect(),
                answer,
                same_as_reference: None,
                bundle: format!("{traffic}#request-{ia}"),
            });
        }
    }
    drop(p);
    rec.finish()?;
    rt.shutdown_timeout(std::time::Duration::from_millis(100));
    report.seconds = t0.elapsed().as_secs_f64();
    Ok(report)
}

/// Filler sentences for `length` tokens at [`CHARS_PER_TOKEN`].
pub fn sentences_by_chars(length: usize) -> usize {
    let avg = FILLER.iter().map(|s| s.len() + 1).sum::<usize>() / FILLER.len();
    let fixed = haystack(0, 0, NEEDLE_VALUES[0].0).len() + needle("").len();
    (length * CHARS_PER_TOKEN).saturating_sub(fixed) / avg.max(1)
}
