//! Canonical-order f32 kernels: the arithmetic half of lmrr's determinism contract.
//!
//! Every op here is a pure function over slices and comes in two forms with the
//! same name stem: `*_ref`, a slow scalar reference written to be read, and the
//! fast path (AVX2+FMA through `std::arch`, selected at run time, threads over
//! independent outputs). The two agree bit for bit on every input; the tests in
//! `tests/` compare them with `to_bits()` on awkward sizes and 1, 2, 3 threads.
//!
//! The canonical order (contract version [`CONTRACT_VERSION`]):
//! - A reduction over `k` elements is cut into chunks of [`CHUNK`] elements
//!   aligned to index 0. Inside a chunk, element `i` goes to lane `i % LANES`
//!   ([`LANES`] = 8); each lane is an FMA chain from `+0.0`. The lanes of a chunk
//!   are joined by the fixed tree of [`lane_tree`]; the chunk partials are added
//!   sequentially, in chunk order, from `+0.0`.
//! - Attention walks keys in tiles of [`ATTN_TILE`] absolute positions and merges
//!   tiles in order with the online-softmax rescale (see [`attention`]).
//! - Transcendentals are built from fma/mul/add only ([`exp::det_exp`]);
//!   division and square root are IEEE correctly rounded.
//!
//! A wider SIMD unit must emulate the 8-lane order; it never reassociates.

// Reference kernels index several slices with one loop variable on purpose:
// they read like the math they define.
#![allow(clippy::needless_range_loop)]

pub mod act;
pub mod argmax;
pub mod attention;
pub mod attention_variants;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod cuda_source;
pub mod exp;
pub mod hyper;
pub mod kquant;
pub mod matmul;
pub mod moe;
pub mod norm;
pub mod paged;
pub mod partials;
#[cfg(target_arch = "x86_64")]
mod prefill;
pub mod quant;
pub mod reduce;
pub mod rope;
pub mod softmax;
pub mod splitmix;
pub mod tensor_core;
pub mod threads;
#[cfg(target_arch = "x86_64")]
mod x86;
#[cfg(target_arch = "x86_64")]
mod x86_512;

pub use act::{geglu, geglu_ref, gelu_tanh_scalar, silu, silu_ref, swiglu, swiglu_ref};
pub use argmax::{argmax, argmax_ref};
pub use attention::{
    attention, attention_ref, attention_window, attention_window_ref, AttnShape, AttnTask, KvView,
};
pub use exp::{det_exp, exp_slice, exp_slice_ref};
pub use hyper::{hc_coeffs, hc_post, hc_pre, index_scores, moe_combine, sigmoid};
pub use kquant::{dequant_format, dequant_format_ref, BlockFormat, QK_K};
pub use matmul::{matmul, matmul_many, matmul_ref, Matrix, Weights};
pub use moe::{sigmoid_group_topk, softmax_topk, GroupTopK, Route};
pub use norm::{rms_norm, rms_norm_ref};
pub use partials::{matmul_partials, matmul_partials_ref, sum_partials};
pub use quant::{dequant, dequant_ref, f16_to_f32, QuantKind, QBLOCK};
pub use reduce::{dot, dot_ref, lane_tree, sum, sum_ref};
pub use rope::{rope, rope_ref, RopeTable};
pub use softmax::{softmax, softmax_ref};
pub use splitmix::SplitMix64;
pub use threads::Threads;

/// Version of the arithmetic contract. Any change to an op's order of operations
/// changes the bits of some logits and must bump this number.
pub const CONTRACT_VERSION: u32 = 1;
/// Reduction chunk length: partial sums restart from `+0.0` every `CHUNK` elements.
pub const CHUNK: usize = 64;
/// Interleaved FMA chains inside a chunk.
pub const LANES: usize = 8;
/// Attention key tile, in absolute positions.
pub const ATTN_TILE: usize = 32;

/// Floats of scratch the device's decode attention split over the KV length
/// needs for `rows` (token, head) rows of `tiles` tiles each at `head_dim`:
/// each tile's scores, its max, alpha and sum, and its P·V partials.
pub const fn split_kv_floats(rows: usize, tiles: usize, head_dim: usize) -> usize {
    rows * tiles * (ATTN_TILE + 3 + head_dim)
}

/// Which implementation the fast entry points run on this machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// AVX2 + FMA + F16C (x86_64), detected at run time.
    Avx2Fma,
    /// The scalar code path (bitwise the same results, slower).
    Scalar,
}

/// The ISA the fast paths use; detected once. `LMRR_FORCE_SCALAR=1` forces the
/// scalar path (used to cross-check the SIMD path end to end).
pub fn isa() -> Isa {
    use std::sync::OnceLock;
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        if std::env::var_os("LMRR_FORCE_SCALAR").is_some_and(|v| v == "1") {
            return Isa::Scalar;
        }
        detect()
    })
}

#[cfg(target_arch = "x86_64")]
fn detect() -> Isa {
    if is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
    {
        Isa::Avx2Fma
    } else {
        Isa::Scalar
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> Isa {
    Isa::Scalar
}

/// Whether quantized matmuls run the AVX-512 kernels (`Q4_K` / `Q6_K`
/// decode, every quantized prefill; the same bits as the AVX2 ones;
/// `LMRR_NO_AVX512=1` turns them off).
pub fn quant_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        x86_512::use_avx512()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[inline]
pub(crate) fn use_avx2() -> bool {
    isa() == Isa::Avx2Fma
}
