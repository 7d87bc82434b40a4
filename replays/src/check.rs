//! The API for regression tests over committed bundles: replay a bundle file
//! under a patch set and get a report whose `Display` is stable — no absolute
//! paths, timings or versions — and meant for `insta::assert_snapshot!`.
//!
//! ```no_run
//! let report = lmrr_replays::Check::bundle("replays/incident.lmrr").run().unwrap();
//! assert!(report.outcome.is_bit_exact(), "{report}");
//! ```

use std::path::{Path, PathBuf};

use lmrr_engine::{EngineError, Model, PatchSet};
use lmrr_kernels::Threads;
use lmrr_recorder::BundleError;

use crate::driver::{replay, ReplayError, ReplayOptions};
use crate::report::Outcome;

/// A replay of one bundle file.
#[derive(Debug, Clone)]
pub struct Check {
    bundle: PathBuf,
    model: Option<PathBuf>,
    patches: Option<PatchSet>,
    threads: usize,
}

/// Errors of [`Check::run`].
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error("reading bundle {path}: {source}")]
    Bundle {
        path: String,
        #[source]
        source: BundleError,
    },
    #[error("bundle {path} was recorded on `{origin}`, not a synthetic model: give Check::model a directory")]
    NeedModel { path: String, origin: String },
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Replay(#[from] ReplayError),
    #[error("invalid patch set: {0}")]
    Patches(String),
}

/// A stable, snapshot-friendly replay report.
#[derive(Debug, Clone)]
pub struct Report {
    /// File name of the bundle (no directory).
    pub bundle: String,
    pub patches: PatchSet,
    /// `complete` or the truncation verdict.
    pub integrity: String,
    pub outcome: Outcome,
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "bundle:  {} ({})", self.bundle, self.integrity)?;
        writeln!(f, "patches: {}", self.patches)?;
        write!(f, "{}", self.outcome)
    }
}

impl Check {
    /// Replays `path` under the patch set it was recorded with.
    pub fn bundle(path: impl AsRef<Path>) -> Self {
        Self {
            bundle: path.as_ref().to_path_buf(),
            model: None,
            patches: None,
            threads: 1,
        }
    }

    /// Uses this model directory (default: regenerate the bundle's synthetic model).
    pub fn model(mut self, dir: impl AsRef<Path>) -> Self {
        self.model = Some(dir.as_ref().to_path_buf());
        self
    }

    /// Replays under this patch set (`none`, `all`, `a,b`).
    pub fn patches(mut self, set: &str) -> Result<Self, CheckError> {
        self.patches = Some(PatchSet::parse(set).map_err(CheckError::Patches)?);
        Ok(self)
    }

    /// Worker threads (never changes a result).
    pub fn threads(mut self, n: usize) -> Self {
        self.threads = n.max(1);
        self
    }

    pub fn run(&self) -> Result<Report, CheckError> {
        let shown = self.bundle.display().to_string();
        let b = lmrr_recorder::open(&self.bundle).map_err(|source| CheckError::Bundle {
            path: shown.clone(),
            source,
        })?;
        let mut model = match (&self.model, &b.manifest.model.synthetic) {
            (Some(dir), _) => Model::load_dir(dir)?,
            (None, Some(spec)) => Model::synthetic(*spec)?,
            (None, None) => {
                return Err(CheckError::NeedModel {
                    path: shown,
                    origin: b.manifest.model.origin.clone(),
                })
            }
        };
        crate::set_recorded_numerics(&mut model, &b)?;
        let recorded =
            PatchSet::parse(&b.manifest.patches.join(",")).map_err(CheckError::Patches)?;
        let patches = self.patches.clone().unwrap_or(recorded);
        let name = self
            .bundle
            .file_name()
            .map_or(shown.clone(), |n| n.to_string_lossy().into_owned());
        let mut opts = ReplayOptions::new(
            patches.clone(),
            Threads::new(self.threads).map_err(EngineError::from)?,
        );
        opts.repro = format!("lmrr replay {name} --patches {patches}");
        let outcome = replay(&b, &model, &opts)?;
        let integrity = match &b.integrity {
            lmrr_recorder::Integrity::Complete { .. } => "complete".to_string(),
            t => t.to_string(),
        };
        Ok(Report {
            bundle: name,
            patches,
            integrity,
            outcome,
        })
    }
}
