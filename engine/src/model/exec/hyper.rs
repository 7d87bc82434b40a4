//! The host executor's DeepSeek-V4-class ops: hyper-connection streams
//! ([`Op::Repeat`](super::Op::Repeat), [`Op::HcSinkhorn`](super::Op::HcSinkhorn),
//! [`Op::HcPre`](super::Op::HcPre), [`Op::HcPost`](super::Op::HcPost),
//! [`Op::StreamMean`](super::Op::StreamMean)), the bf16 rounding of the
//! `mhc-bf16` patch, and the trace of the sparse indexer's choices that
//! [`Op::MlaAttend`](super::Op::MlaAttend) keeps for `explain`.
//!
//! Invariant: every row is computed from its own token's values alone (the
//! stream mixes and the selection are per token; the indexer's blocks are
//! absolute positions), so results do not depend on batch-mates, chunking or
//! the KV page size.

use super::indexer::Selection;
use crate::synth::f32_to_bf16;

/// The indexer's choices of one traced token, per layer (for `explain`).
#[derive(Debug, Clone, Default)]
pub struct Trace {
    /// The stacked token whose selections are kept.
    pub token: usize,
    pub chosen: Vec<(usize, Selection)>,
}

/// Rounds to bf16 (nearest, ties to even) and widens back, exactly.
pub fn bf16_round(x: f32) -> f32 {
    f32::from_bits(u32::from(f32_to_bf16(x)) << 16)
}

/// Each row of `x` (width `d`) repeated across the row of `out`.
pub fn repeat(x: &[f32], d: usize, out: &mut [f32]) {
    if d == 0 {
        return;
    }
    let copies = out.len() / x.len().max(1);
    for (xr, or) in x.chunks(d).zip(out.chunks_mut(d * copies)) {
        for c in or.chunks_mut(d) {
            c.copy_from_slice(xr);
        }
    }
}

/// The mean of each row's `streams` pieces of width `d`: a sequential sum
/// from `+0.0` in stream order, then one multiply by `1/streams`.
pub fn stream_mean(x: &[f32], streams: usize, d: usize, out: &mut [f32]) {
    let inv = 1.0 / streams as f32;
    for (xr, or) in x.chunks(streams * d).zip(out.chunks_mut(d)) {
        for (c, o) in or.iter_mut().enumerate() {
            let mut acc = 0.0f32;
            for s in 0..streams {
                acc += xr[s * d + c];
            }
            *o = acc * inv;
        }
    }
}
