//! The recorder's integration tests, one binary (one link instead of one per
//! file): each module is a former `tests/*.rs` file and keeps its name, so
//! `cargo test -p lmrr-recorder --test it bundles::` runs one of them.

mod bundles;
mod traffic;
