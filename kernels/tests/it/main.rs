//! The kernels' integration tests, one binary (one link instead of one per
//! file): each module is a former `tests/*.rs` file and keeps its name, so
//! `cargo test -p lmrr-kernels --test it quant::` runs one of them. The CUDA
//! source's own checks (`cuda_emulated`, `nvrtc_compile`) stay separate
//! binaries beside this folder.

mod bitwise;
mod cuda_algorithms;
mod partials;
mod quant;
mod rope_table;
