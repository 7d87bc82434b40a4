//! Tensor parallelism that changes no bit: a program's sharded plan
//! ([`plan`]) and a simulator of its ranks on the CPU ([`sim`]), with each
//! rank's slice of the weights cut at load ([`shard`]).
//!
//! The plan follows the program's buffers. A matmul over a whole (replicated)
//! input is column-parallel: each rank owns whole output rows — whole heads
//! where the output feeds attention, an even cut of the rows otherwise (the
//! lm head's vocabulary included) — and no reduction crosses ranks. A matmul
//! over an input split across ranks is row-parallel: each rank computes the
//! canonical chunk partials of its slice of `k` (`lmrr_kernels::partials`),
//! the partials are gathered (data movement only), and every rank adds them
//! in chunk order from `+0.0`, which is the one-device kernel's sum. Such a
//! slice must start on a chunk of [`lmrr_kernels::CHUNK`]; a shape that does
//! not split so, or heads that do not divide by the degree, is refused with
//! the numbers ([`TpError`]). Attention runs per rank over its heads; MoE
//! experts are placed whole on ranks and combined in the canonical order on
//! every rank. Multi-head Latent Attention runs by heads too where its heads
//! divide by the degree: rank 0 stores the step's latent rows (one per
//! token, shared by every head), each rank absorbs, attends and
//! decompresses its heads, and the output columns are gathered. Every other
//! op runs on every rank over whole operands (gathered first where they
//! were split); an op that writes the KV store outside attention (sparse
//! attention, MLA whose heads do not divide) runs once, on rank 0, and its
//! outputs are broadcast.
//!
//! Invariant: every value a rank computes is computed by the same canonical
//! instruction sequence as on one device, so the logits at any degree are
//! the degree-1 logits, bit for bit. The degree is a deployment fact
//! recorded in bundles, never an input of the arithmetic.

pub mod plan;
pub mod shard;
pub mod sim;
mod sim_ops;

pub use plan::{Layout, Plan};
pub use sim::Simulator;

/// Tensor-parallel settings of a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TpConfig {
    /// Ranks (1: no tensor parallelism).
    pub degree: usize,
    /// A rank that fails at a step (rank, 0-based count of the model's
    /// steps since `set_tp`): the test hook behind `LMRR_TP_FAIL=RANK:STEP`.
    pub fail: Option<(usize, u64)>,
}

impl Default for TpConfig {
    fn default() -> Self {
        Self {
            degree: 1,
            fail: None,
        }
    }
}

impl TpConfig {
    /// `degree` ranks, no injected failure.
    pub fn degree(degree: usize) -> Self {
        Self { degree, fail: None }
    }

    /// Parses `LMRR_TP_FAIL`'s `RANK:STEP`.
    pub fn parse_fail(s: &str) -> Result<(usize, u64), TpError> {
        let bad = || TpError::BadFailSpec(s.to_string());
        let (r, st) = s.split_once(':').ok_or_else(bad)?;
        Ok((
            r.trim().parse().map_err(|_| bad())?,
            st.trim().parse().map_err(|_| bad())?,
        ))
    }
}

/// Why a tensor-parallel run cannot go on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TpError {
    #[error("a tensor-parallel degree of {0}: it must be between 1 and {max}", max = MAX_DEGREE)]
    Degree(usize),
    #[error("{what} over {degree} ranks: {heads} heads do not divide by {degree}")]
    Heads {
        what: String,
        heads: usize,
        degree: usize,
    },
    #[error(
        "`{matrix}` ({rows}×{cols}) is row-parallel over {degree} ranks: rank {rank}'s slice of its {cols} inputs starts at {start}, not on a chunk of {chunk} (its input is split as {ranges:?})"
    )]
    Chunk {
        matrix: String,
        rows: usize,
        cols: usize,
        degree: usize,
        rank: usize,
        start: usize,
        chunk: usize,
        ranges: Vec<(usize, usize)>,
    },
    #[error("multi-GPU tensor parallelism (--tp {0} on CUDA) needs {0} GPUs and NCCL, which are not built yet; the CPU runs --tp N as a rank simulator")]
    NeedsNccl(usize),
    #[error("tensor parallelism multiplies in the canonical numerics only, not {0}")]
    Numerics(String),
    #[error("rank {rank} of {degree} failed at step {step} (injected by LMRR_TP_FAIL)")]
    RankFailed {
        rank: usize,
        degree: usize,
        step: u64,
    },
    #[error("LMRR_TP_FAIL = `{0}`: expected RANK:STEP, e.g. 1:3")]
    BadFailSpec(String),
    #[error("op {op} ({name}): {msg}")]
    Program {
        op: usize,
        name: &'static str,
        msg: String,
    },
}

/// The largest degree accepted (a GPU host has at most 8 or 16 devices).
pub const MAX_DEGREE: usize = 64;
