//! The probes on the local engine: each cell is a session script run on a
//! fresh scheduler with the cell's patch set, recorded into its own bundle
//! (`lmrr replay` re-executes it). Needle cells run with the prefix cache
//! off, so A and B are each computed from scratch and only arithmetic is
//! probed; recall rows keep it on (the incident's bug lives there).

use std::collections::BTreeMap;
use std::io::BufWriter;
use std::path::Path;

use lmrr_engine::{run_session, EngineConfig, Model, PatchSet, Scheduler, Script};
use lmrr_kernels::Threads;
use lmrr_recorder::{Manifest, Recorder};

use super::{
    haystack, NeedleCell, ProbeReport, RecallRow, Sweep, FILLER, NEEDLE_VALUES, RECALL_FACTS,
    RECALL_QUESTION, RECALL_WORDS,
};
use crate::probe::needle;

/// Errors of a local probe.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error(transparent)]
    Engine(#[from] lmrr_engine::EngineError),
    #[error("probe script: {0}")]
    Script(#[from] lmrr_engine::ScriptError),
    #[error("recording {path}: {source}")]
    Record {
        path: String,
        source: lmrr_recorder::BundleError,
    },
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("length {length}: the haystack's question and template alone take {overhead} tokens; the shortest length this model can probe is {min}")]
    TooShort {
        length: usize,
        overhead: usize,
        min: usize,
    },
    #[error("length {length} does not fit this model's context of {context} tokens (with {answer} answer tokens)")]
    TooLong {
        length: usize,
        context: usize,
        answer: usize,
    },
    #[error("no pair of needle values tokenizes to equal lengths with this tokenizer (tried {0})")]
    NoNeedlePair(String),
}

/// Versions written into each bundle's manifest.
pub struct Tool<'a> {
    pub version: &'a str,
    pub git_revision: &'a str,
}

/// Top-k logprobs recorded per sampled token (as `lmrr run --record`).
const TOP_LOGPROBS: usize = 5;

/// A TOML basic string (JSON's escapes are TOML's).
fn q(s: &str) -> String {
    serde_json::Value::String(s.to_string()).to_string()
}

fn user(content: &str) -> String {
    format!("{{ role = \"user\", content = {} }}", q(content))
}

fn file_name(patches: &PatchSet) -> String {
    let n = patches.names();
    if n.is_empty() {
        "none".into()
    } else {
        n.join("+")
    }
}

/// The label of a patch set in tables.
pub fn label(patches: &PatchSet) -> String {
    let n = patches.names();
    if n.is_empty() {
        "none".into()
    } else {
        n.join(",")
    }
}

/// Each request's output tokens and digest, in script order.
type Outputs = Vec<(Vec<u32>, [u8; 32])>;

struct Ctx<'a> {
    model: &'a Model,
    threads: &'a Threads,
    dir: &'a Path,
    tool: Tool<'a>,
}

impl Ctx<'_> {
    /// Runs `src` under `patches`, recording into `dir/name`; the requests'
    /// output tokens and digests in script order.
    fn session(
        &self,
        src: &str,
        name: &str,
        patches: &PatchSet,
        prefix_cache: bool,
    ) -> Result<(Outputs, String), ProbeError> {
        let script = Script::parse(src, name)?;
        let context = self.model.net.context();
        let cfg = EngineConfig {
            page_size: 16,
            pool_pages: (4 * context.div_ceil(16)).max(256),
            max_batch_tokens: 512,
            prefix_cache,
        };
        let mut sch =
            Scheduler::with_patches(self.model.net(), cfg, self.threads.clone(), patches.clone())?;
        script.check_fits(self.model, &sch)?;
        sch.set_top_logprobs(TOP_LOGPROBS);
        let path = self.dir.join(name);
        let shown = path.display().to_string();
        let manifest = Manifest::for_session(
            self.model,
            cfg,
            patches,
            &format!("lmrr probe ({name})"),
            src,
            TOP_LOGPROBS as u32,
            self.threads.count() as u32,
            self.tool.version,
            self.tool.git_revision,
        );
        let f = std::fs::File::create(&path).map_err(|source| ProbeError::Io {
            path: shown.clone(),
            source,
        })?;
        let mut rec =
            Recorder::new(BufWriter::new(f), &manifest).map_err(|source| ProbeError::Record {
                path: shown.clone(),
                source,
            })?;
        let res = run_session(self.model, &script, &mut sch, |e| rec.observe(e));
        rec.finish().map_err(|source| ProbeError::Record {
            path: shown.clone(),
            source,
        })?;
        let res = res?;
        Ok((
            res.requests
                .iter()
                .map(|r| (r.output.tokens.clone(), r.output.digest))
                .collect(),
            shown,
        ))
    }

    /// The answer's text, without the EOS that ended it (as a server sends).
    fn text(&self, ids: &[u32]) -> String {
        let ids = match ids.split_last() {
            Some((&last, rest)) if self.model.net.is_eos(last) => rest,
            _ => ids,
        };
        self.model.tokenizer.decode(ids).unwrap_or_default()
    }
}

/// The first needle pair whose values tokenize to the same length in the
/// haystack (so A and B line up position by position).
fn needle_pair(model: &Model) -> Result<(&'static str, &'static str), ProbeError> {
    let len = |v: &str| -> Result<usize, ProbeError> {
        Ok(model
            .tokenizer
            .encode(&format!(" {} {}", needle(v), FILLER[0]))?
            .len())
    };
    for &(a, b) in NEEDLE_VALUES {
        if len(a)? == len(b)? {
            return Ok((a, b));
        }
    }
    Err(ProbeError::NoNeedlePair(
        NEEDLE_VALUES
            .iter()
            .map(|(a, b)| format!("{a}/{b}"))
            .collect::<Vec<_>>()
            .join(", "),
    ))
}

/// Filler sentences that bring the chat prompt to about `length` tokens.
pub fn sentences_for(model: &Model, length: usize, value: &str) -> Result<usize, ProbeError> {
    let prompt_len = |n: usize| -> Result<usize, ProbeError> {
        Ok(model
            .tokenizer
            .encode(&model.chat_prompt(&haystack(n, 100, value))?)?
            .len())
    };
    let overhead = prompt_len(0)?;
    if overhead >= length {
        return Err(ProbeError::TooShort {
            length,
            overhead,
            min: overhead + 1,
        });
    }
    // Grow by the sentences' average, then settle one sentence at a time.
    let per: usize = FILLER
        .iter()
        .map(|s| model.tokenizer.encode(&format!(" {s}")).map(|t| t.len()))
        .sum::<Result<usize, _>>()?
        .div_ceil(FILLER.len())
        .max(1);
    let mut n = (length - overhead) / per;
    while n > 0 && prompt_len(n)? > length {
        n -= 1;
    }
    while prompt_len(n + 1)? <= length {
        n += 1;
    }
    Ok(n)
}

/// Runs the sweep on the local engine.
pub fn run(
    model: &Model,
    threads: &Threads,
    patch_sets: &[PatchSet],
    sweep: &Sweep,
    dir: &Path,
    tool: Tool<'_>,
    progress: &mut dyn FnMut(&str),
) -> Result<ProbeReport, ProbeError> {
    let t0 = std::time::Instant::now();
    std::fs::create_dir_all(dir).map_err(|source| ProbeError::Io {
        path: dir.display().to_string(),
        source,
    })?;
    let cx = Ctx {
        model,
        threads,
        dir,
        tool,
    };
    let context = model.net.context();
    for &l in &sweep.lengths {
        if l + sweep.needle_tokens > context {
            return Err(ProbeError::TooLong {
                length: l,
                context,
                answer: sweep.needle_tokens,
            });
        }
    }
    let mut report = ProbeReport {
        target: model.origin.clone(),
        patch_sets: patch_sets.iter().map(label).collect(),
        sweep: sweep.clone(),
        needle: Vec::new(),
        recall: Vec::new(),
        seconds: 0.0,
    };
    let mut tokens: BTreeMap<String, Vec<u32>> = BTreeMap::new();
    if !sweep.lengths.is_empty() && !sweep.depths.is_empty() {
        let (a, b) = needle_pair(model)?;
        for &length in &sweep.lengths {
            let n = sentences_for(model, length, a)?;
            for &depth in &sweep.depths {
                let (ma, mb) = (haystack(n, depth, a), haystack(n, depth, b));
                let rendered = model.chat_prompt(&ma)?;
                let prompt_tokens = model.tokenizer.encode(&rendered)?.len();
                let needle_at = match rendered.find(&needle(a)) {
                    Some(i) => Some(model.tokenizer.encode(&rendered[..i])?.len()),
                    None => None,
                };
                let src = format!(
                    "# lmrr probe: needle at {depth}% of {length} tokens, values {a} and {b}\n\
                     [defaults]\ntemperature = 0.0\nmax_tokens = {}\n\n\
                     [[request]]\nid = \"needle-{a}\"\nmessages = [{}]\n\n\
                     [[request]]\nid = \"needle-{b}\"\nafter = \"needle-{a}\"\nmessages = [{}]\n",
                    sweep.needle_tokens,
                    user(&ma),
                    user(&mb)
                );
                for ps in patch_sets {
                    let name = format!("needle-{}-{length}-{depth}.lmrr", file_name(ps));
                    progress(&format!("needle {depth}% of {length} · {}", label(ps)));
                    let (out, bundle) = cx.session(&src, &name, ps, false)?;
                    let (ta, da) = &out[0];
                    let (_, db) = &out[1];
                    let answer = cx.text(ta);
                    tokens.insert(format!("n|{}|{depth}|{length}", label(ps)), ta.clone());
                    report.needle.push(NeedleCell {
                        patches: label(ps),
                        depth,
                        length,
                        prompt_tokens,
                        needle_at,
                        value: a.to_string(),
                        recalled: answer.contains(a),
                        read: da != db,
                        answer,
                        same_as_reference: None,
                        bundle,
                    });
                }
            }
        }
    }
    for &cut in &sweep.cuts {
        for interrupted in [false, true] {
            let retry = if interrupted {
                format!("max_tokens = 400\ninterrupt_after_tokens = {cut}")
            } else {
                format!("max_tokens = {cut}")
            };
            let src = format!(
                "# lmrr probe: recall after a retry {} after {cut} tokens\n\
                 [defaults]\ntemperature = 0.0\n\n\
                 [[request]]\nid = \"first-try\"\nmessages = [{u}]\nmax_tokens = 4\n\n\
                 [[request]]\nid = \"retry\"\nafter = \"first-try\"\nmessages = [{u}]\n{retry}\nignore_eos = true\n\n\
                 [[request]]\nid = \"recall\"\nafter = \"retry\"\nmax_tokens = {}\nmessages = [\n  {u},\n  {{ role = \"assistant\", from = \"retry\" }},\n  {},\n]\n",
                if interrupted { "interrupted" } else { "that ends" },
                sweep.recall_tokens,
                user(RECALL_QUESTION),
                u = user(RECALL_FACTS),
            );
            for ps in patch_sets {
                let name = format!(
                    "recall-{}-{}{cut}.lmrr",
                    file_name(ps),
                    if interrupted { "cut" } else { "ends" }
                );
                progress(&format!(
                    "recall, retry {} after {cut} · {}",
                    if interrupted { "cut" } else { "ending" },
                    label(ps)
                ));
                let (out, bundle) = cx.session(&src, &name, ps, true)?;
                let answer = cx.text(&out[2].0);
                tokens.insert(
                    format!("r|{}|{cut}|{interrupted}", label(ps)),
                    out[2].0.clone(),
                );
                report.recall.push(RecallRow {
                    patches: label(ps),
                    cut,
                    interrupted,
                    partial: cx.text(&out[1].0),
                    recalled: RECALL_WORDS
                        .iter()
                        .filter(|w| answer.to_lowercase().contains(&w.to_lowercase()))
                        .map(|w| w.to_string())
                        .collect(),
                    answer,
                    same_as_reference: None,
                    bundle,
                });
            }
        }
    }
    report.compare_to_reference(&tokens);
    report.seconds = t0.elapsed().as_secs_f64();
    Ok(report)
}
