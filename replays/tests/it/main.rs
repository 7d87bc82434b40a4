//! The replayer's integration tests, one binary (one link instead of one per
//! file): each module is a former `tests/*.rs` file and keeps its name, so
//! `cargo test -p lmrr-replays --test it snapshots::` runs one of them. The
//! shared helpers (`common/`, the fuzz target's `mutator/`) stay beside
//! this folder; insta snapshots stay in the repository's `snapshots/`.

#[macro_use]
#[path = "../common/mod.rs"]
mod common;

mod disagg;
mod hostile;
mod html;
mod imports;
mod mini_v4_oracle;
mod replay;
mod scripts;
mod smollm2;
mod snapshots;
mod tp;
