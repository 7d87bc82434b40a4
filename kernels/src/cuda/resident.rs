//! The resident device path's public face: device memory the caller keeps
//! across steps (weights uploaded once, activations, paged KV) and the
//! kernels that run over it, launched asynchronously on the [`Gpu`]'s one
//! stream with no host round trip between them.
//!
//! The parts live by responsibility in sibling modules, re-exported here
//! under the paths the engine uses: buffers and copies (`buf`), graphs
//! (`graph`), the module and its launcher (`launch`), the launch wrappers
//! per op family (`ops::{matmul, norm, elementwise, attention}`, plus
//! `split` and `overlap`), the kernel choices (`tuning`), and the check
//! harness that only `gpu_check` and `lmrr bench` use (`harness`).
//!
//! Invariants: every kernel computes each output in the canonical order of
//! the CPU fast path (the comments in kernels/cuda/ say how), so a step on
//! the resident path gives the CPU's bits; `gpu_check` holds each one to
//! the one-thread references. Which kernel serves a step or a matmul
//! ([`Tuning`]) moves speed only, never bits; so does programmatic
//! dependent launch, because every resident kernel waits for the one ahead
//! of it before touching memory (`PDL_ENTRY` in kernels/cuda/common.cuh).
//! Addresses are raw device pointers (`u64`): a wrapper's caller
//! guarantees that every buffer it names holds the extent the shapes imply;
//! each wrapper checks that its sizes fit the kernel's 32-bit indices and
//! returns an error, never a launch, when they do not.

#[allow(unused_imports)] // the doc links
use super::Gpu;

pub use super::buf::{DevBuf, DevMatrix, Mark, Pinned, SplitScratch};
pub use super::graph::Graph;
pub use super::harness::DecodeRopeCase;
pub use super::launch::{
    GM_ROWS, GM_TOKS, GW_ROWS, GW_TOKS, MM_TOKENS, MR4_MAX_CHUNKS, MR4_ROWS, MR_MAX_CHUNKS,
    MR_THREADS, NR_MAX_CHUNKS, PF_MAXHD, PF_TQ,
};
pub use super::ops::attention::{prefill_fixed, AttnKernel, PageTable};
pub use super::ops::attention_split::SplitKv;
pub use super::ops::matmul::GemmTiles;
pub use super::ops::norm::NormKernel;
pub use super::split::MmOut;
pub use super::tuning::{longest_first, prefill_groups, Tuning};
pub use crate::paged::PageLayout;
