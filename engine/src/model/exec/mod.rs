//! One forward, several executors: a family describes its step as a
//! [`Program`] (fused ops over named buffers, [`program`]); an executor runs
//! it. The host executor ([`host`]) runs each op with the canonical kernels
//! of the model's device. No family contains device code, and no executor
//! names a family: a family writes its arithmetic once, as a program, and
//! every executor gives the same bits (contract invariant I6).

pub mod executors;
pub mod host;
pub mod hyper;
pub mod indexer;
pub mod mla;
pub mod moe;
pub mod program;
pub mod resident;
pub mod routing_v4;
pub mod tp;

pub use executors::Executors;
pub use program::{
    Act, AttnSpec, Buf, BufDecl, Builder, ExpertMats, Mat, MatJob, MlaIndex, MlaShape, Op, Program,
    RoutingSpec, Rows, Tables, Vector,
};

use std::sync::{Arc, Mutex};

use crate::model::{stacked_tokens, wanted_rows, SeqSpan};
use crate::patches::PatchSet;

/// Where one timed resident step's wall time went (measurement: a
/// family's `set_cuda_step_timing`), seconds. The host parts are the
/// calling thread's clock; `kernels` and `copies` are the device's, by
/// events recorded before the step's first launch, after its last, and
/// after the downloads.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepSplit {
    /// The step's kernels on the device, first launch to last.
    pub kernels: f64,
    /// The downloads (logits and K/V rows) on the device after them.
    pub copies: f64,
    /// Host work before the first launch (page checks, the inputs' upload).
    pub before: f64,
    /// The launch calls themselves (a graph, or every kernel).
    pub launch: f64,
    /// From the last launch call's return until the downloads are done.
    pub wait: f64,
    /// Host work after the downloads (the K/V rows into the host store, the
    /// logits rows handed out).
    pub after: f64,
}

/// A family's programs, one per patch set, built once and kept: a program
/// does not depend on the step's shape, and the device executor keys what
/// it keeps per program by the program's address.
#[derive(Default)]
pub struct Programs(Mutex<Vec<(PatchSet, Arc<Program>)>>);

impl Programs {
    /// The program of `patches`, built by `build` the first time.
    pub fn get(&self, patches: &PatchSet, build: impl FnOnce() -> Program) -> Arc<Program> {
        let mut v = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, p)) = v.iter().find(|(s, _)| s == patches) {
            return p.clone();
        }
        let p = Arc::new(build());
        v.push((patches.clone(), p.clone()));
        p
    }
}

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
