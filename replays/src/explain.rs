//! `replay --explain`: what the model family can say about how the divergent
//! position was computed, under the recorded patches and under the replay's.
//! For mini-v4 that is, per layer, which index blocks the indexer chose and
//! how many it scored (so an early exit that never looked at the start of the
//! context shows as such); llama has dense attention and nothing to add.
//!
//! The position explained is the row the request's next token was drawn
//! from: the divergent position itself for a logits or token divergence; for
//! a divergence first seen in the cache during a prefill, the prompt's last
//! position (where the first affected token is drawn).

use lmrr_engine::{Model, PatchSet};
use lmrr_kernels::Threads;
use lmrr_recorder::Bundle;

use crate::driver::{Catalog, ReplayError};
use crate::report::{Divergence, Signal};

/// The family's account of the divergent position under `recorded` and
/// `patched`, or `None` when the divergence names no request or the family
/// has nothing to explain.
pub fn explain(
    bundle: &Bundle,
    model: &Model,
    d: &Divergence,
    recorded: &PatchSet,
    patched: &PatchSet,
    threads: &Threads,
) -> Result<Option<String>, ReplayError> {
    let (Some(id), Some(pos)) = (d.request_id, d.position) else {
        return Ok(None);
    };
    let cat = Catalog::of(bundle);
    let Some(prompt) = cat.prompts.get(&id) else {
        return Ok(None);
    };
    let mut tokens = prompt.clone();
    tokens.extend(cat.outputs.get(&id).into_iter().flatten().copied());
    // A sampled token's divergence names the token's position: its row is
    // the one before. A cache divergence names the span's first position.
    let pos = match d.signal {
        Signal::CacheState if pos < prompt.len() => prompt.len() - 1,
        Signal::CacheState => pos,
        _ => pos.saturating_sub(1),
    };
    let pos = pos.min(tokens.len().saturating_sub(1));
    let name = cat.name(id);
    let mut out = format!(
        "explain: request {name}, position {pos} ({}, family {})",
        if pos + 1 == prompt.len() {
            "the prompt's last position: the first token's row"
        } else {
            "the divergent token's row"
        },
        model.net.family()
    );
    for (label, set) in [("recorded", recorded), ("replayed", patched)] {
        match model.net.explain(&tokens, pos, threads, set)? {
            Some(text) => {
                out += &format!("\n{label} (patches `{set}`):");
                for line in text.lines() {
                    out += &format!("\n  {line}");
                }
            }
            None => {
                out += &format!(
                    "\n{label}: the {} family has nothing to explain (dense attention)",
                    model.net.family()
                );
                break;
            }
        }
    }
    Ok(Some(out))
}
