//! One forward, several executors: a family describes its step as a
//! [`Program`] (fused ops over named buffers, [`program`]); an executor runs
//! it. The host executor ([`host`]) runs each op with the canonical kernels
//! of the model's device. No family contains device code, and no executor
//! names a family: a family writes its arithmetic once, as a program, and
//! every executor gives the same bits (contract invariant I6).

pub mod host;
pub mod hyper;
pub mod indexer;
pub mod moe;
pub mod program;
pub mod routing_v4;

pub use program::{
    Act, AttnSpec, Buf, BufDecl, Builder, ExpertMats, Mat, MatJob, Op, Program, RoutingSpec, Rows,
    Tables, Vector,
};

use crate::model::{stacked_tokens, wanted_rows, SeqSpan};

/// What a step runs over: the spans, and derived from them the stacked
/// tokens (span index, absolute position), their ids, and the stacked
/// indices of the rows whose logits are wanted.
pub struct Step<'a> {
    pub spans: &'a [SeqSpan<'a>],
    pub tok: Vec<(usize, usize)>,
    pub ids: Vec<u32>,
    pub rows: Vec<usize>,
}

impl<'a> Step<'a> {
    pub fn new(spans: &'a [SeqSpan<'a>]) -> Self {
        Self {
            spans,
            tok: stacked_tokens(spans),
            ids: spans
                .iter()
                .flat_map(|s| s.tokens.iter().copied())
                .collect(),
            rows: wanted_rows(spans),
        }
    }
}

/// What every family does before its step touches the KV store: the patches
/// checked against the device, every span checked (each sequence once,
/// starting where its KV ends, inside `context` and the vocabulary), then
/// each span's positions prepared in the store.
pub fn begin_step(
    ops: &crate::model::ops::Ops,
    kv: &mut dyn crate::kv::KvCache,
    spans: &[SeqSpan],
    context: usize,
    vocab: usize,
    patches: &crate::patches::PatchSet,
) -> Result<(), crate::EngineError> {
    ops.check_patches(patches)?;
    crate::model::check_spans(kv, spans, context, vocab)?;
    for s in spans {
        kv.prepare(s.seq, s.start, s.tokens.len())?;
    }
    Ok(())
}

/// A step on the host executor after [`begin_step`]: `prog` over `tables`,
/// the logits split per span (`vocab` wide).
pub fn run_host(
    ops: &crate::model::ops::Ops,
    kv: &mut dyn crate::kv::KvCache,
    spans: &[SeqSpan],
    vocab: usize,
    prog: &Program,
    tables: &Tables,
    extras: host::Extras,
) -> Result<Vec<Vec<f32>>, crate::EngineError> {
    let step = Step::new(spans);
    let logits = host::run_with(prog, tables, &step, kv, ops, extras)?;
    Ok(crate::model::split_rows(spans, &logits, vocab, ops.threads))
}
