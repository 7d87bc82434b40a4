//! The recorder: trace schema and the `.lmrr` bundle format.
//!
//! Owns everything that turns an engine run into bytes on disk and back. Not yet
//! built: the serving core it observes comes first (see docs/ARCHITECTURE.md).
//! Dependency direction: kernels ← engine ← recorder ← replays ← binary.

pub use lmrr_engine as engine;
