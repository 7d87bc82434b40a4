//! A bundle back into a session script (`lmrr inspect B --script S.toml`),
//! so that a live session can be read, edited and run again with
//! `lmrr run --script`.
//!
//! Each arrival becomes a `[[request]]` in request-id order (ids are script
//! positions in both `lmrr run` and `lmrr serve` bundles) with its name, its
//! arrival step as `at_step`, its sampling parameters, `max_tokens`,
//! `ignore_eos`, and each recorded interrupt as `interrupt_at_step`. The
//! prompt is written as text (`prompt = "..."`) when the text tokenizes back
//! to exactly the recorded ids, and as `prompt_tokens = [...]` otherwise (or
//! when no tokenizer is at hand).
//!
//! Invariant: on the recording's model and engine configuration (the header
//! comment gives the command), `lmrr run` of the script records the same
//! events as the bundle: the same arrivals at the same steps, the same
//! interrupts, the same steps (tested on a server bundle).

use std::collections::BTreeMap;
use std::fmt::Write;

use lmrr_engine::scheduler::RequestId;
use lmrr_engine::Tokenizer;
use lmrr_recorder::{Bundle, Event};

/// Why a bundle cannot be written as a script.
#[derive(Debug, thiserror::Error)]
pub enum ScriptExportError {
    #[error("event {index}: request id {id} arrives where id {expected} was due (a script's ids are its positions)")]
    Ids {
        index: usize,
        id: RequestId,
        expected: RequestId,
    },
    #[error("event {index}: interrupt of request {id}, which has not arrived")]
    UnknownInterrupt { index: usize, id: RequestId },
    #[error("the bundle has no request")]
    Empty,
}

fn toml_str(s: &str) -> String {
    toml::Value::String(s.to_string()).to_string()
}

fn toml_f32(x: f32) -> String {
    // TOML floats need a fraction or exponent; Rust's shortest round-trip
    // form of an f32 parses back to the same f32.
    let s = format!("{x:?}");
    if s.contains(['.', 'e', 'E']) || s.contains("inf") || s.contains("NaN") {
        s
    } else {
        format!("{s}.0")
    }
}

/// The session script of `bundle` (`source` names it in the header).
pub fn bundle_to_script(
    bundle: &Bundle,
    tokenizer: Option<&Tokenizer>,
    source: &str,
) -> Result<String, ScriptExportError> {
    let m = &bundle.manifest;
    let mut interrupts: BTreeMap<RequestId, u64> = BTreeMap::new();
    let mut arrivals = Vec::new();
    let mut disaggregated = None;
    for (index, e) in bundle.events.iter().enumerate() {
        match e {
            Event::Arrival {
                step,
                name,
                request,
            } => {
                let expected = arrivals.len() as RequestId;
                if request.id != expected {
                    return Err(ScriptExportError::Ids {
                        index,
                        id: request.id,
                        expected,
                    });
                }
                arrivals.push((*step, name, request));
            }
            Event::Interrupt { step, id, .. } => {
                if *id >= arrivals.len() as RequestId {
                    return Err(ScriptExportError::UnknownInterrupt { index, id: *id });
                }
                interrupts.entry(*id).or_insert(*step);
            }
            Event::Disaggregated(c) => disaggregated = Some(*c),
            Event::Step(_) | Event::PdStep(_) => {}
        }
    }
    if arrivals.is_empty() {
        return Err(ScriptExportError::Empty);
    }
    let e = &m.engine;
    let mut run = format!("lmrr run --script SCRIPT.toml --model {}", m.model.origin);
    for (flag, v, default) in [
        ("--page-size", e.page_size, 16),
        ("--pool-pages", e.pool_pages, 256),
        ("--max-batch-tokens", e.max_batch_tokens, 512),
    ] {
        if v != default {
            let _ = write!(run, " {flag} {v}");
        }
    }
    if !e.prefix_cache {
        run += " --no-prefix-cache";
    }
    if let Some(c) = disaggregated {
        run += &disagg_flags(&c);
    }
    if !m.patches.is_empty() {
        let _ = write!(run, " --patches {}", m.patches.join(","));
    }
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# Session script written by `lmrr inspect --script` from {source}"
    );
    let _ = writeln!(
        out,
        "# (recorded by lmrr {} on {}; session: {}).",
        m.tool_version,
        m.model.origin,
        m.source.script_path.replace('\n', " ")
    );
    let _ = writeln!(
        out,
        "# Arrivals and interrupts are at engine steps. Re-run it, with the recording's engine:"
    );
    let _ = writeln!(out, "#   {run} --record again.lmrr");
    for (id, (step, name, r)) in arrivals.iter().enumerate() {
        let _ = writeln!(out, "\n[[request]]");
        let _ = writeln!(out, "id = {}", toml_str(name));
        let _ = writeln!(out, "at_step = {step}");
        let text = tokenizer.and_then(|t| {
            let s = t.decode(&r.prompt).ok()?;
            (t.encode(&s).ok()? == r.prompt).then_some(s)
        });
        match text {
            Some(s) => {
                let _ = writeln!(out, "prompt = {}", toml_str(&s));
            }
            None => {
                let ids: Vec<String> = r.prompt.iter().map(u32::to_string).collect();
                let _ = writeln!(out, "prompt_tokens = [{}]", ids.join(", "));
            }
        }
        let s = &r.sampling;
        let _ = writeln!(out, "max_tokens = {}", r.max_tokens);
        let _ = writeln!(out, "temperature = {}", toml_f32(s.temperature));
        if s.top_k != 0 {
            let _ = writeln!(out, "top_k = {}", s.top_k);
        }
        if s.top_p != 1.0 {
            let _ = writeln!(out, "top_p = {}", toml_f32(s.top_p));
        }
        // TOML integers are signed 64-bit; larger seeds cannot be written.
        if s.seed != 0 {
            match i64::try_from(s.seed) {
                Ok(v) => {
                    let _ = writeln!(out, "seed = {v}");
                }
                Err(_) => {
                    let _ = writeln!(
                        out,
                        "# seed {} does not fit a TOML integer: sampled replays of this request differ",
                        s.seed
                    );
                }
            }
        }
        if !r.stop_at_eos {
            let _ = writeln!(out, "ignore_eos = true");
        }
        if let Some(at) = interrupts.get(&(id as RequestId)) {
            let _ = writeln!(out, "interrupt_at_step = {at}");
        }
    }
    Ok(out)
}

/// The `lmrr run` flags that rebuild a disaggregated deployment's decode
/// engine and link (the prefill engine takes the colocated flags).
pub fn disagg_flags(c: &lmrr_engine::PdConfig) -> String {
    let d = &c.decode;
    let mut s = format!(
        " --disaggregate --decode-page-size {} --decode-pool-pages {} --decode-max-batch-tokens {} --transfer-pages-per-step {}",
        d.page_size, d.pool_pages, d.max_batch_tokens, c.transfer_pages_per_step
    );
    if !d.prefix_cache {
        s += " --decode-no-prefix-cache";
    }
    s
}
