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
