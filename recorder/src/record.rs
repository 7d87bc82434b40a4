//! Session observer → bundle. [`Recorder::observe`] is handed every
//! [`SessionEvent`] of [`lmrr_engine::run_session`]; a write error is kept and
//! returned by [`Recorder::finish`] (the observer itself cannot fail).

use std::io::Write;

use lmrr_engine::session::SessionEvent;

use crate::format::{BundleError, BundleWriter};
use crate::schema::{Event, Manifest};

/// Steps per events frame: at most this many steps are lost if the recorder
/// is killed.
pub const FLUSH_EVERY_STEPS: usize = 8;

pub struct Recorder<W: Write> {
    writer: BundleWriter<W>,
    error: Option<BundleError>,
}

impl<W: Write> Recorder<W> {
    pub fn new(out: W, manifest: &Manifest) -> Result<Self, BundleError> {
        Ok(Self {
            writer: BundleWriter::new(out, manifest, FLUSH_EVERY_STEPS)?,
            error: None,
        })
    }

    /// Records one session event.
    pub fn observe(&mut self, e: SessionEvent<'_>) {
        if self.error.is_some() {
            return;
        }
        let ev = match e {
            SessionEvent::Arrival {
                step,
                name,
                request,
            } => Event::Arrival {
                step,
                name: name.to_string(),
                request: request.clone(),
            },
            SessionEvent::Interrupt { step, name, id } => Event::Interrupt {
                step,
                name: name.to_string(),
                id,
            },
            SessionEvent::Step(r) => Event::Step(r.clone()),
            SessionEvent::PdStep(r) => Event::PdStep(Box::new(r.clone())),
        };
        if let Err(err) = self.writer.push(ev) {
            self.error = Some(err);
        }
    }

    /// Records that the session runs on a disaggregated deployment (call it
    /// before the first session event).
    pub fn disaggregated(&mut self, cfg: lmrr_engine::PdConfig) {
        if self.error.is_some() {
            return;
        }
        if let Err(err) = self.writer.push(Event::Disaggregated(cfg)) {
            self.error = Some(err);
        }
    }

    /// Writes the trailer, or returns the first error met while recording.
    pub fn finish(self) -> Result<W, BundleError> {
        if let Some(e) = self.error {
            return Err(e);
        }
        self.writer.finish()
    }
}
