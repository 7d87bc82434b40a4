//! Replay: re-executes a bundle under its recorded inputs, scheduling decisions
//! and interrupts, compares every signal (cache-state hash, logits digest,
//! sampled token) and reports the first divergence the way rr and Hermit users
//! find actionable: where, which signal, expected vs actual with context, drift
//! statistics, surrounding events and a one-line repro.
//!
//! - [`driver`]: lockstep re-execution (the patch set under test, and — when it
//!   differs from the recording's — the recorded set alongside, for expected
//!   logits rows and drift statistics); [`pd`] does the same for a
//!   disaggregated deployment's bundle (both engines and the link).
//! - [`report`]: the divergence report, human text (`Display`) and JSON (serde).
//! - [`bisect`]: binary search for one culprit patch, ddmin for combinations.
//! - [`oracle`]: the recompute oracle (cache-off, batch-of-one recomputation).
//! - [`validate`]: semantic checks of a decoded bundle (ids, spans, tokens,
//!   steps) before anything executes it.
//! - [`check`]: the API for users' regression tests over committed bundles.
//! - [`html`]: the HTML report (timeline, divergence, drift plots, texts,
//!   bisect probes, oracle turns) and the `--svg` drift plot.

pub mod bisect;
pub mod check;
pub mod driver;
pub mod explain;
pub mod html;
pub mod oracle;
pub mod pd;
pub mod report;
pub mod validate;

pub use bisect::{
    all_culprits, all_found, bisect, bisect_all, probe, rounds_text, BisectOutcome, Probe,
};
pub use check::{Check, CheckError, Report};
pub use driver::{
    replay, replay_traced, set_recorded_numerics, Criterion, ReplayError, ReplayOptions, Trace,
};
pub use oracle::{oracle, oracle_traced, OracleTurn};
pub use report::{Divergence, DriftRow, Outcome, Signal, TokenInfo};
