//! The recorder: the trace schema and the `.lmrr` bundle format.
//!
//! A bundle is what a user attaches to a bug report: everything needed to
//! re-execute a session and check it. It is small (zstd-compressed bincode,
//! tokens as varints), versioned (magic, format and contract versions),
//! crash-safe (append-only frames flushed every few steps, so a killed recorder
//! leaves a bundle readable up to its last complete frame) and safe to open
//! from a stranger (every length checked against a named limit before anything
//! is allocated; corrupt input is an error with the frame index and byte
//! offset, never a panic).
//!
//! Modules: [`schema`] (the serde types), [`codec`] (the only place that
//! touches bincode), [`format`] (framing, writer, reader, limits), [`record`]
//! (session observer → bundle), [`summary`] (counts for `lmrr inspect`) and
//! [`traffic`] (what `lmrr proxy` records, in the same framing).
//! Dependency direction: kernels ← engine ← recorder ← replays ← binary.

pub mod codec;
pub mod format;
pub mod record;
pub mod schema;
pub mod summary;
pub mod traffic;

pub use format::{
    open, read, Bundle, BundleError, BundleOf, BundleWriter, Integrity, Kind, Writer,
};
pub use record::Recorder;
pub use schema::{
    Event, HostInfo, Manifest, ModelInfo, SessionSource, Trailer, FORMAT_VERSION, MIN_READ_VERSION,
};
pub use summary::Summary;
