//! The resident CUDA executor of [`Program`]s (feature `cuda`), and the
//! device-independent analysis it runs from ([`plan`]).
//!
//! A family hands its tables over once ([`Resident::new`]): every matrix,
//! vector and RoPE table is uploaded in its stored form. A step uploads one
//! small array (token ids, positions, page tables, wanted rows), runs the
//! program's ops as resident kernels with no host round trip (a MoE op
//! routes on the host: one download of the router logits), and brings back
//! the wanted logits rows and the step's new K/V (and indexer-key) rows,
//! which go into the host store so that its slot digests and page hashes are
//! the CPU's. Which kernel serves an op is looked up from the op and the
//! step's shape ([`launch`], the kernels' `Tuning`); the executor knows no
//! family.
//!
//! Decode steps with no host round trip are captured as CUDA graphs on the
//! second step of a shape and replayed from then on: the step's inputs sit
//! at fixed device addresses, so the same graph serves every later step of
//! that shape. Graphs change no bit: they replay the very launches captured.
//!
//! Invariant: every kernel is the canonical order's (kernels/cuda/), so the
//! logits and K/V rows are the host executor's bits whatever the batch, the
//! chunking, the page size, the prefix cache or graphs on or off.

pub mod plan;

#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
mod launch;
#[cfg(feature = "cuda")]
mod moe;

#[cfg(feature = "cuda")]
pub use device::Resident;

#[allow(unused_imports)] // the doc links
use super::program::Program;
