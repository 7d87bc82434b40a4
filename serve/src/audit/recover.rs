//! Recovering what an upstream answered, token by token: its response
//! (streamed or not, chat or completion) parsed into logprob entries, and
//! each entry's token looked up in this model's vocabulary ([`Vocab`]: by
//! its bytes, else by the lossy text a server shows for a token holding part
//! of a UTF-8 character). Responses are untrusted input: anything that does
//! not parse becomes a note on the turn, never a panic.

use std::collections::HashMap;

use serde_json::Value;

use lmrr_engine::Model;

/// An upstream logprob entry: the token, its logprob, its alternatives.
#[derive(Debug, Clone)]
pub(super) struct Entry {
    pub(super) text: String,
    pub(super) bytes: Option<Vec<u8>>,
    pub(super) logprob: Option<f64>,
    pub(super) top: Vec<(String, Option<Vec<u8>>, f64)>,
}

/// What one response said.
#[derive(Debug, Default)]
pub(super) struct Answer {
    pub(super) text: String,
    pub(super) entries: Vec<Entry>,
    pub(super) finish_reason: Option<String>,
    /// Names of the tool calls shown (`message.tool_calls`, or a stream's
    /// `delta.tool_calls` entries that name their function): the text is
    /// then only what the server left outside them, not the whole output.
    pub(super) tool_calls: Vec<String>,
    pub(super) prompt_tokens: Option<u64>,
    pub(super) notes: Vec<String>,
}

fn bytes_of(v: &Value) -> Option<Vec<u8>> {
    v.as_array()?
        .iter()
        .map(|b| b.as_u64().filter(|&b| b < 256).map(|b| b as u8))
        .collect()
}

/// Logprob entries of a chat choice (`logprobs.content`).
fn chat_entries(lp: &Value) -> Vec<Entry> {
    let Some(content) = lp.get("content").and_then(Value::as_array) else {
        return Vec::new();
    };
    content
        .iter()
        .map(|e| Entry {
            text: e.get("token").and_then(Value::as_str).unwrap_or("").into(),
            bytes: e.get("bytes").and_then(bytes_of),
            logprob: e.get("logprob").and_then(Value::as_f64),
            top: e
                .get("top_logprobs")
                .and_then(Value::as_array)
                .map(|a| {
                    a.iter()
                        .filter_map(|t| {
                            Some((
                                t.get("token")?.as_str()?.to_string(),
                                t.get("bytes").and_then(bytes_of),
                                t.get("logprob")?.as_f64()?,
                            ))
                        })
                        .collect()
                })
                .unwrap_or_default(),
        })
        .collect()
}

/// Logprob entries of a completion choice (the legacy shape).
fn completion_entries(lp: &Value) -> Vec<Entry> {
    let toks = lp.get("tokens").and_then(Value::as_array);
    let lps = lp.get("token_logprobs").and_then(Value::as_array);
    let tops = lp.get("top_logprobs").and_then(Value::as_array);
    let Some(toks) = toks else {
        return Vec::new();
    };
    toks.iter()
        .enumerate()
        .map(|(i, t)| Entry {
            text: t.as_str().unwrap_or("").into(),
            bytes: None,
            logprob: lps.and_then(|l| l.get(i)).and_then(Value::as_f64),
            top: tops
                .and_then(|l| l.get(i))
                .and_then(Value::as_object)
                .map(|o| {
                    o.iter()
                        .filter_map(|(k, v)| Some((k.clone(), None, v.as_f64()?)))
                        .collect()
                })
                .unwrap_or_default(),
        })
        .collect()
}

/// Reads the chunks the client was handed (or the whole body) of one turn.
pub(super) fn answer(chat: bool, chunks: &[&[u8]], streamed: bool) -> Answer {
    let mut a = Answer::default();
    for (i, data) in chunks.iter().enumerate() {
        if *data == b"[DONE]" {
            continue;
        }
        let v: Value = match serde_json::from_slice(data) {
            Ok(v) => v,
            Err(e) => {
                a.notes
                    .push(format!("chunk {i} is not JSON ({e}); ignored"));
                continue;
            }
        };
        if let Some(err) = v.get("error") {
            a.notes.push(format!("the upstream sent an error: {err}"));
            continue;
        }
        if let Some(p) = v
            .get("usage")
            .and_then(|u| u.get("prompt_tokens"))
            .and_then(Value::as_u64)
        {
            a.prompt_tokens = Some(p);
        }
        let Some(c) = v.get("choices").and_then(Value::as_array).and_then(|c| {
            c.iter()
                .find(|c| c.get("index").and_then(Value::as_u64).unwrap_or(0) == 0)
        }) else {
            continue;
        };
        let text = if chat {
            let m = if streamed {
                c.get("delta")
            } else {
                c.get("message")
            };
            m.and_then(|m| m.get("content")).and_then(Value::as_str)
        } else {
            c.get("text").and_then(Value::as_str)
        };
        a.text.push_str(text.unwrap_or(""));
        if chat {
            let m = c.get(if streamed { "delta" } else { "message" });
            if let Some(calls) = m
                .and_then(|m| m.get("tool_calls"))
                .and_then(Value::as_array)
            {
                a.tool_calls.extend(calls.iter().filter_map(|t| {
                    t.pointer("/function/name")
                        .and_then(Value::as_str)
                        .map(str::to_string)
                }));
            }
        }
        if let Some(lp) = c.get("logprobs").filter(|l| !l.is_null()) {
            a.entries.extend(if chat {
                chat_entries(lp)
            } else {
                completion_entries(lp)
            });
        }
        if let Some(f) = c.get("finish_reason").and_then(Value::as_str) {
            a.finish_reason = Some(f.into());
        }
    }
    a
}

/// This model's vocabulary by the bytes of each token.
pub struct Vocab {
    bytes: Vec<Vec<u8>>,
    by_bytes: HashMap<Vec<u8>, u32>,
    /// Ids by the text a server shows for a token holding part of a UTF-8
    /// character: invalid bytes replaced by U+FFFD, or dropped (Python's
    /// `errors="ignore"`, llama-cpp-python's).
    by_lossy: HashMap<String, Vec<u32>>,
}

/// A token's text with invalid UTF-8 dropped.
fn dropped(b: &[u8]) -> String {
    String::from_utf8_lossy(b).replace('\u{FFFD}', "")
}

impl Vocab {
    pub fn new(model: &Model) -> Self {
        let bytes = model.tokenizer.byte_table();
        let mut by_bytes = HashMap::with_capacity(bytes.len());
        let mut by_lossy: HashMap<String, Vec<u32>> = HashMap::new();
        for (i, b) in bytes.iter().enumerate() {
            // The lowest id wins a collision.
            by_bytes.entry(b.clone()).or_insert(i as u32);
            if std::str::from_utf8(b).is_err() {
                let replaced = String::from_utf8_lossy(b).into_owned();
                let gone = dropped(b);
                by_lossy.entry(replaced).or_default().push(i as u32);
                by_lossy.entry(gone).or_default().push(i as u32);
            }
        }
        for v in by_lossy.values_mut() {
            v.dedup();
        }
        Self {
            bytes,
            by_bytes,
            by_lossy,
        }
    }

    /// Every id an entry may stand for: the exact one first, then those a
    /// lossy text may hide.
    pub(super) fn candidates(&self, e: &Entry) -> Vec<u32> {
        if let Some(b) = &e.bytes {
            return self.by_bytes.get(b).copied().into_iter().collect();
        }
        let mut c: Vec<u32> = self
            .by_bytes
            .get(e.text.as_bytes())
            .copied()
            .into_iter()
            .collect();
        if let Some(more) = self.by_lossy.get(&e.text) {
            for &x in more {
                if !c.contains(&x) {
                    c.push(x);
                }
            }
        }
        c
    }

    /// Whether `ids` decode (as a stream) to `text` or a longer text.
    pub(super) fn spells(&self, ids: &[u32], text: &str) -> bool {
        let acc: Vec<u8> = ids
            .iter()
            .flat_map(|&i| self.bytes[i as usize].iter().copied())
            .collect();
        String::from_utf8_lossy(&acc).starts_with(text)
    }

    /// The ids of `entries` (some of whose texts are lossy) whose bytes,
    /// decoded as a server decodes a stream (invalid bytes as U+FFFD, an
    /// incomplete character held until it completes), give `text` — or a
    /// longer text that starts with it (a tail held back or cut by a stop
    /// sequence). Depth-first over each entry's candidates, exact ones
    /// first, within a budget of steps; `None` when nothing fits.
    pub(super) fn align(&self, entries: &[Entry], text: &str) -> Option<Vec<u32>> {
        let cands: Vec<Vec<u32>> = entries.iter().map(|e| self.candidates(e)).collect();
        let mut out = Vec::with_capacity(entries.len());
        let mut acc = Vec::new();
        let mut budget = 100_000usize;
        fn shown(acc: &[u8]) -> std::borrow::Cow<'_, str> {
            let cut = match std::str::from_utf8(acc) {
                Err(e) if e.error_len().is_none() => e.valid_up_to(),
                _ => acc.len(),
            };
            String::from_utf8_lossy(&acc[..cut])
        }
        fn go(
            v: &Vocab,
            cands: &[Vec<u32>],
            i: usize,
            acc: &mut Vec<u8>,
            text: &str,
            out: &mut Vec<u32>,
            budget: &mut usize,
        ) -> bool {
            if i == cands.len() {
                return String::from_utf8_lossy(acc).starts_with(text)
                    || shown(acc).starts_with(text);
            }
            for &id in &cands[i] {
                if *budget == 0 {
                    return false;
                }
                *budget -= 1;
                let n = acc.len();
                acc.extend_from_slice(&v.bytes[id as usize]);
                let s = shown(acc);
                if text.starts_with(s.as_ref()) || s.starts_with(text) {
                    out.push(id);
                    if go(v, cands, i + 1, acc, text, out, budget) {
                        return true;
                    }
                    out.pop();
                }
                acc.truncate(n);
            }
            false
        }
        go(self, &cands, 0, &mut acc, text, &mut out, &mut budget).then_some(out)
    }

    /// The id of an alternative: by its bytes, else its text, else the one
    /// token its lossy text can stand for.
    pub(super) fn id(&self, text: &str, bytes: Option<&[u8]>) -> Option<u32> {
        let key = bytes.unwrap_or(text.as_bytes());
        if let Some(&id) = self.by_bytes.get(key) {
            return Some(id);
        }
        match self.by_lossy.get(text).map(Vec::as_slice) {
            Some([one]) if bytes.is_none() => Some(*one),
            _ => None,
        }
    }

    pub(super) fn text(&self, id: u32) -> String {
        self.bytes
            .get(id as usize)
            .map(|b| String::from_utf8_lossy(b).into_owned())
            .unwrap_or_default()
    }
}
