//! Replay: re-executes a bundle under recorded decisions, compares every signal,
//! and bisects patch sets. Not yet built: it needs the recorder (see
//! docs/ARCHITECTURE.md). Committed example bundles will live beside this crate.

pub use lmrr_recorder as recorder;
