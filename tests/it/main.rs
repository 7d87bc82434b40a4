//! The `lmrr` binary's integration tests, one test binary (one link instead
//! of one per file): each module is a former `tests/*.rs` file and keeps its
//! name, so `cargo test --test it serve::` runs one of them. Every module
//! runs the real binary (`CARGO_BIN_EXE_lmrr`) in its own temp dir or on
//! its own loopback port, so they share one process safely.

#[path = "../common/listening.rs"]
mod listening;

mod cli;
mod cli_snapshots;
mod probe;
mod proxy;
mod serve;
mod serve_ends;
mod serve_logprobs;
