//! The server's bundles: where they go, what they are called, when a new one
//! starts.
//!
//! One bundle holds one engine epoch: a fresh scheduler (empty pool and
//! prefix cache), request ids from 0 in arrival order, steps from 0. That is
//! what makes a bundle replayable on its own: `lmrr replay` starts from an
//! empty engine too. Rotation therefore happens only when the engine is idle;
//! once a limit is reached the engine stops admitting, lets the running
//! requests finish, then closes the bundle (trailer) and opens the next one
//! with a fresh scheduler (so the prefix cache starts cold after a rotation).
//!
//! Limits (defaults): 256 MiB written, 10,000 requests, 90,000 steps
//! (inside what a session script can express), no age limit.
//!
//! Naming: `DIR/lmrr-serve-<UTC start, YYYYMMDDTHHMMSSZ>-<pid>-<NNNN>.lmrr`,
//! `NNNN` counting the server's bundles from 0001. Files are written in place
//! (no temporary name): a bundle whose server was killed keeps its name and
//! is read up to its last complete frame (`lmrr inspect` says TRUNCATED).
//!
//! Crash safety: the writer appends a frame every
//! [`lmrr_recorder::record::FLUSH_EVERY_STEPS`] steps and whenever the engine
//! goes idle, each handed to the OS at once, so a SIGKILL loses at most the
//! steps of the frame being built (none while idle).

use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use lmrr_recorder::{BundleWriter, Event, Manifest};

use crate::error::ServeError;

/// When to start a new bundle (checked at idle boundaries).
#[derive(Debug, Clone)]
pub struct Rotation {
    /// Bytes written; 0 = no limit.
    pub max_bytes: u64,
    /// Requests arrived; 0 = no limit.
    pub max_requests: u64,
    /// Age of the bundle; `None` = no limit.
    pub max_age: Option<Duration>,
    /// Engine steps; 0 = no limit. The default keeps every bundle within
    /// what a session script can say (`at_step` up to
    /// [`lmrr_engine::session::MAX_AT_STEP`]), so `lmrr inspect --script`
    /// works on any of them.
    pub max_steps: u64,
}

impl Default for Rotation {
    fn default() -> Self {
        Self {
            max_bytes: 256 << 20,
            max_requests: 10_000,
            max_age: None,
            max_steps: lmrr_engine::session::MAX_AT_STEP * 9 / 10,
        }
    }
}

/// Counts bytes on their way to the file.
struct Counting<W> {
    inner: W,
    n: Arc<AtomicU64>,
}

impl<W: Write> Write for Counting<W> {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        let k = self.inner.write(b)?;
        self.n.fetch_add(k as u64, Ordering::Relaxed);
        Ok(k)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// The bundle being written.
pub struct Bundle {
    writer: BundleWriter<Counting<BufWriter<std::fs::File>>>,
    pub path: PathBuf,
    /// The file name, as clients see it in `x-lmrr-bundle`.
    pub name: String,
    bytes: Arc<AtomicU64>,
    opened: Instant,
    pub requests: u64,
    pub steps: u64,
}

impl Bundle {
    pub fn push(&mut self, e: Event) -> Result<(), ServeError> {
        match e {
            Event::Arrival { .. } => self.requests += 1,
            Event::Step(_) | Event::PdStep(_) => self.steps += 1,
            Event::Interrupt { .. } | Event::Disaggregated(_) => {}
        }
        Ok(self.writer.push(e)?)
    }

    /// Hands every buffered event to the OS.
    pub fn flush(&mut self) -> Result<(), ServeError> {
        Ok(self.writer.flush()?)
    }

    /// Whether `r` asks for a new bundle.
    pub fn due(&self, r: &Rotation) -> bool {
        (r.max_bytes > 0 && self.bytes.load(Ordering::Relaxed) >= r.max_bytes)
            || (r.max_requests > 0 && self.requests >= r.max_requests)
            || (r.max_steps > 0 && self.steps >= r.max_steps)
            || r.max_age.is_some_and(|a| self.opened.elapsed() >= a)
    }

    /// Writes the trailer and syncs the file.
    pub fn finish(self) -> Result<PathBuf, ServeError> {
        let w = self.writer.finish()?;
        let f = w
            .inner
            .into_inner()
            .map_err(|e| ServeError::Io(e.into_error()))?;
        f.sync_all()?;
        Ok(self.path)
    }
}

/// Names and opens the server's bundles.
pub struct BundleDir {
    dir: PathBuf,
    stamp: String,
    next: u32,
}

impl BundleDir {
    /// Creates `dir` if needed.
    pub fn new(dir: &Path) -> Result<Self, ServeError> {
        std::fs::create_dir_all(dir).map_err(|source| ServeError::RecordDir {
            path: dir.into(),
            source,
        })?;
        let secs = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        Ok(Self {
            dir: dir.into(),
            stamp: format!("{}-{}", utc_stamp(secs), std::process::id()),
            next: 1,
        })
    }

    /// Opens the next bundle with `manifest`.
    pub fn open(&mut self, manifest: &Manifest) -> Result<Bundle, ServeError> {
        let name = format!("lmrr-serve-{}-{:04}.lmrr", self.stamp, self.next);
        self.next += 1;
        let path = self.dir.join(&name);
        let f = std::fs::File::create(&path).map_err(|source| ServeError::RecordDir {
            path: path.clone(),
            source,
        })?;
        let bytes = Arc::new(AtomicU64::new(0));
        let out = Counting {
            inner: BufWriter::new(f),
            n: bytes.clone(),
        };
        let writer = BundleWriter::new(out, manifest, lmrr_recorder::record::FLUSH_EVERY_STEPS)?;
        Ok(Bundle {
            writer,
            path,
            name,
            bytes,
            opened: Instant::now(),
            requests: 0,
            steps: 0,
        })
    }
}

/// `YYYYMMDDTHHMMSSZ` of a Unix time (civil-from-days, proleptic Gregorian).
pub fn utc_stamp(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}{m:02}{d:02}T{:02}{:02}{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn utc_stamps() {
        assert_eq!(super::utc_stamp(0), "19700101T000000Z");
        assert_eq!(super::utc_stamp(951_782_400), "20000229T000000Z");
        assert_eq!(super::utc_stamp(1_798_761_599), "20261231T235959Z");
    }
}
