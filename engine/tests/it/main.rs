//! The engine's integration tests, one binary (one link instead of one per
//! file): each module is a former `tests/*.rs` file and keeps its name, so
//! `cargo test -p lmrr-engine --test it invariance::` runs one of them.
//! Helpers shared with other crates' tests stay in `tests/common/` and
//! `tests/fixtures/`; a file added directly under `tests/` is its own binary.

#[macro_use]
#[path = "../common/families.rs"]
mod families;
#[path = "../fixtures/tiny_gguf.rs"]
mod tiny_gguf;

mod conformance;
mod deepseek_v3;
mod disagg;
mod gguf;
mod gguf_arch;
mod invariance;
mod kv_blocks;
mod loading;
mod mini_v4;
mod presets;
mod scripts;
mod serving;
mod smollm2;
mod tp;
mod tp_wide;
