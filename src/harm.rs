//! The harm of a patch set, for `lmrr replay --patches`: the first request
//! whose *output* changes when the rest of the session runs under the patch.
//!
//! A replay feeds every request its recorded tokens, so after a divergence
//! the report can only show where bits first moved — often in a request whose
//! own tokens still agree (the interrupted one, whose abort corrupted the
//! cache), while the request that read the corrupted cache is never shown.
//! This re-runs the session freely under the patch set: the bundle's own
//! script when it was recorded from one (`lmrr run`), else the script
//! `lmrr inspect --script` writes (arrivals and interrupts at their recorded
//! steps, prompts as recorded), on the recording's engine configuration, and
//! compares each request's output tokens with the recording's, in arrival
//! order. The first that differs is the harmed request; its expected and
//! actual texts are shown side by side, first in the text and HTML reports.
//!
//! Invariant: a pure function of the bundle, the model and the patch set (the
//! engine is deterministic), so the same replay names the same request.

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use lmrr_engine::{run_session, Model, PatchSet, Script};
use lmrr_kernels::Threads;
use lmrr_recorder::{Bundle, Event};

/// The first request whose output changes under the patch set.
#[derive(Debug, Clone)]
pub struct Harm {
    pub request: String,
    pub request_id: u64,
    /// The request interrupted last before this one arrived, if any.
    pub after_interrupt: Option<String>,
    /// First output position where the tokens differ.
    pub first_difference: usize,
    pub expected_tokens: usize,
    pub actual_tokens: usize,
    pub expected: String,
    pub actual: String,
    /// Requests whose outputs differ, in arrival order (the first is this one).
    pub changed: Vec<String>,
    pub patches: String,
    pub recorded_patches: String,
}

/// Recorded output tokens per request id, names, arrival order and the
/// interrupts seen before each arrival.
struct Recorded {
    order: Vec<u64>,
    names: BTreeMap<u64, String>,
    outputs: BTreeMap<u64, Vec<u32>>,
    interrupted_before: BTreeMap<u64, String>,
}

fn recorded(b: &Bundle) -> Recorded {
    let mut r = Recorded {
        order: Vec::new(),
        names: BTreeMap::new(),
        outputs: BTreeMap::new(),
        interrupted_before: BTreeMap::new(),
    };
    let mut last_interrupt: Option<String> = None;
    for e in &b.events {
        match e {
            Event::Arrival { name, request, .. } => {
                r.order.push(request.id);
                r.names.insert(request.id, name.clone());
                r.outputs.entry(request.id).or_default();
                if let Some(i) = &last_interrupt {
                    r.interrupted_before.insert(request.id, i.clone());
                }
            }
            Event::Interrupt { name, .. } => last_interrupt = Some(name.clone()),
            Event::Step(_) | Event::PdStep(_) => {
                for s in e.reports() {
                    for q in &s.seqs {
                        if let Some(t) = q.sampled {
                            r.outputs.entry(q.id).or_default().push(t);
                        }
                    }
                }
            }
            Event::Disaggregated(_) => {}
        }
    }
    r
}

/// The session to re-run: the manifest's script, else the bundle's own.
fn script_of(b: &Bundle, model: &Model, path: &str) -> Result<Script> {
    let m = &b.manifest;
    if let Ok(s) = Script::parse(&m.source.script, &m.source.script_path) {
        if !s.requests.is_empty() {
            return Ok(s);
        }
    }
    let src = lmrr_serve::script::bundle_to_script(b, Some(&model.tokenizer), path)
        .with_context(|| format!("{path}: writing the session as a script"))?;
    Ok(Script::parse(&src, path)?)
}

/// The harm of `patches` on the session of `b` (None: every output as
/// recorded).
pub fn harm(
    b: &Bundle,
    model: &Model,
    patches: &PatchSet,
    threads: &Threads,
    path: &str,
) -> Result<Option<Harm>> {
    let rec = recorded(b);
    let script = script_of(b, model, path)?;
    // On the recording's deployment: one engine, or a disaggregated pair.
    let mut sch = crate::disagg::Engine::new(
        model.net(),
        b.manifest.engine,
        lmrr_replays::pd::pd_config(b),
        threads.clone(),
        patches.clone(),
    )?;
    let res = match run_session(model, &script, &mut sch, |_| {}) {
        Ok(r) => r,
        // A patch that livelocks the engine harms every request left; the
        // replay's own report says where.
        Err(e) => return Err(e).context("running the rest of the session under the patch"),
    };
    let by_name: BTreeMap<&str, &[u32]> = res
        .requests
        .iter()
        .map(|r| (r.name.as_str(), r.output.tokens.as_slice()))
        .collect();
    // The text a client saw: without the EOS that ended the output.
    let text = |t: &[u32]| {
        let t = match t.split_last() {
            Some((&last, rest)) if model.net.is_eos(last) => rest,
            _ => t,
        };
        model.tokenizer.decode(t).unwrap_or_default()
    };
    let mut changed = Vec::new();
    let mut first: Option<(u64, &[u32], &[u32])> = None;
    for id in &rec.order {
        let name = rec.names[id].as_str();
        let (Some(exp), Some(act)) = (rec.outputs.get(id), by_name.get(name)) else {
            continue;
        };
        if exp.as_slice() != *act {
            changed.push(name.to_string());
            first.get_or_insert((*id, exp.as_slice(), act));
        }
    }
    let Some((id, exp, act)) = first else {
        return Ok(None);
    };
    Ok(Some(Harm {
        request: rec.names[&id].clone(),
        request_id: id,
        after_interrupt: rec.interrupted_before.get(&id).cloned(),
        first_difference: exp.iter().zip(act).take_while(|(a, b)| a == b).count(),
        expected_tokens: exp.len(),
        actual_tokens: act.len(),
        expected: text(exp),
        actual: text(act),
        changed,
        patches: patches.to_string(),
        recorded_patches: b.manifest.patches.join(","),
    }))
}

/// Cuts `s` into lines of at most `w` characters (newlines kept as breaks).
fn wrap(s: &str, w: usize) -> Vec<String> {
    let mut out = Vec::new();
    for line in s.split('\n') {
        let chars: Vec<char> = line
            .chars()
            .map(|c| if c.is_control() { '·' } else { c })
            .collect();
        if chars.is_empty() {
            out.push(String::new());
        }
        for c in chars.chunks(w) {
            out.push(c.iter().collect());
        }
    }
    out
}

/// Most lines per side in the text report.
const MAX_LINES: usize = 12;
/// Characters per side.
const SIDE: usize = 44;

impl std::fmt::Display for Harm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "HARMED: request {}{} — its output changes at token {} when the session runs under `{}`",
            self.request,
            self.after_interrupt
                .as_ref()
                .map_or(String::new(), |i| format!(" (after {i} was interrupted)")),
            self.first_difference,
            self.patches
        )?;
        if self.changed.len() > 1 {
            writeln!(f, "  outputs changed: {}", self.changed.join(", "))?;
        }
        let recorded = if self.recorded_patches.is_empty() {
            "none".to_string()
        } else {
            self.recorded_patches.clone()
        };
        let l = wrap(&self.expected, SIDE);
        let r = wrap(&self.actual, SIDE);
        let left = format!("expected (`{recorded}`, {} tokens)", self.expected_tokens);
        writeln!(
            f,
            "  {left:<SIDE$} | actual (`{}`, {} tokens)",
            self.patches, self.actual_tokens
        )?;
        let n = l.len().max(r.len());
        for i in 0..n.min(MAX_LINES) {
            writeln!(
                f,
                "  {:<SIDE$} | {}",
                l.get(i).map_or("", String::as_str),
                r.get(i).map_or("", String::as_str)
            )?;
        }
        if n > MAX_LINES {
            writeln!(f, "  … ({} more lines)", n - MAX_LINES)?;
        }
        Ok(())
    }
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

impl Harm {
    /// The JSON `harm` object of `lmrr replay --json`.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "request": self.request,
            "request_id": self.request_id,
            "after_interrupt": self.after_interrupt,
            "first_difference": self.first_difference,
            "expected_tokens": self.expected_tokens,
            "actual_tokens": self.actual_tokens,
            "expected": self.expected,
            "actual": self.actual,
            "changed": self.changed,
            "patches": self.patches,
            "recorded_patches": self.recorded_patches,
        })
    }

    /// The HTML section that leads the report.
    pub fn html(&self) -> String {
        format!(
            "<section id=\"harm\" class=\"verdict bad\"><h2>Harmed request: <code>{}</code></h2>\
             <p>Its output changes at token {} when the session runs under <code>{}</code>{}.{}</p>\
             <div class=\"sides\"><div class=\"side\"><h3>expected (<code>{}</code>, {} tokens)</h3><pre class=\"harm-text\">{}</pre></div>\
             <div class=\"side\"><h3>actual (<code>{}</code>, {} tokens)</h3><pre class=\"harm-text\">{}</pre></div></div></section>\n",
            esc(&self.request),
            self.first_difference,
            esc(&self.patches),
            self.after_interrupt
                .as_ref()
                .map_or(String::new(), |i| format!(", after <code>{}</code> was interrupted", esc(i))),
            if self.changed.len() > 1 {
                format!(" Outputs changed: {}.", esc(&self.changed.join(", ")))
            } else {
                String::new()
            },
            esc(if self.recorded_patches.is_empty() { "none" } else { &self.recorded_patches }),
            self.expected_tokens,
            esc(&self.expected),
            esc(&self.patches),
            self.actual_tokens,
            esc(&self.actual),
        )
    }
}

/// `html` with the harm section inserted right after the page header.
pub fn lead_html(html: &str, h: &Harm) -> String {
    match html.find("</header>") {
        Some(i) => {
            let at = i + "</header>".len();
            format!("{}{}{}", &html[..at], h.html(), &html[at..])
        }
        None => format!("{}{html}", h.html()),
    }
}
