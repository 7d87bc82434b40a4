//! What the engine loop steps: one scheduler, or a disaggregated deployment
//! (`lmrr serve --disaggregate`: a prefill and a decode engine joined by a
//! K/V link). Both answer the loop's questions the same way; a step comes
//! back as the event the bundle records and as the one report the loop
//! delivers tokens from (a disaggregated step's two engines' sampled rows,
//! prefill first, and the requests that ended, as the client sees them).

use lmrr_engine::scheduler::{Request, RequestId, RequestOutput, StepReport};
use lmrr_engine::{
    EngineConfig, EngineError, ModelFamily, PatchSet, PdConfig, PdEngine, Scheduler, Side,
};
use lmrr_kernels::Threads;
use lmrr_recorder::Event;

/// The engine behind the loop.
pub enum Deployment<'m> {
    Colocated(Box<Scheduler<'m>>),
    Disaggregated {
        engine: Box<PdEngine<'m>>,
        /// Both engines' rows of the latest step, prefill first.
        rows: Vec<(RequestId, Vec<f32>)>,
    },
}

/// One step: what the bundle records, and what the clients are sent from.
pub struct Stepped {
    pub event: Event,
    pub report: StepReport,
}

impl<'m> Deployment<'m> {
    pub fn new(
        model: &'m dyn ModelFamily,
        cfg: EngineConfig,
        pd: Option<PdConfig>,
        threads: Threads,
        patches: PatchSet,
    ) -> Result<Self, EngineError> {
        Ok(match pd {
            None => Self::Colocated(Box::new(Scheduler::with_patches(
                model, cfg, threads, patches,
            )?)),
            Some(c) => Self::Disaggregated {
                engine: Box::new(PdEngine::new(model, cfg, c, threads, patches)?),
                rows: Vec::new(),
            },
        })
    }

    /// The event a bundle of this deployment starts with, if any.
    pub fn first_event(&self) -> Option<Event> {
        match self {
            Self::Colocated(_) => None,
            Self::Disaggregated { engine, .. } => Some(Event::Disaggregated(*engine.config())),
        }
    }

    pub fn set_top_logprobs(&mut self, k: usize) {
        match self {
            Self::Colocated(s) => s.set_top_logprobs(k),
            Self::Disaggregated { engine, .. } => engine.set_top_logprobs(k),
        }
    }

    pub fn set_keep_rows(&mut self, keep: bool) {
        match self {
            Self::Colocated(s) => s.set_keep_rows(keep),
            Self::Disaggregated { engine, .. } => engine.set_keep_rows(keep),
        }
    }

    pub fn is_idle(&self) -> bool {
        match self {
            Self::Colocated(s) => s.is_idle(),
            Self::Disaggregated { engine, .. } => engine.is_idle(),
        }
    }

    pub fn steps(&self) -> u64 {
        match self {
            Self::Colocated(s) => s.steps(),
            Self::Disaggregated { engine, .. } => engine.steps(),
        }
    }

    pub fn has_ended(&self, id: RequestId) -> bool {
        match self {
            Self::Colocated(s) => s.has_ended(id),
            Self::Disaggregated { engine, .. } => engine.has_ended(id),
        }
    }

    pub fn interrupt(&mut self, id: RequestId) -> Result<bool, EngineError> {
        match self {
            Self::Colocated(s) => s.interrupt(id),
            Self::Disaggregated { engine, .. } => engine.interrupt(id),
        }
    }

    pub fn submit(&mut self, req: Request) -> Result<(), EngineError> {
        match self {
            Self::Colocated(s) => s.submit(req),
            Self::Disaggregated { engine, .. } => engine.submit(req),
        }
    }

    pub fn take_output(&mut self, id: RequestId) -> Option<RequestOutput> {
        match self {
            Self::Colocated(s) => s.take_output(id),
            Self::Disaggregated { engine, .. } => engine.take_output(id),
        }
    }

    /// `(request, logits row)` sampled in the latest step (rows kept).
    pub fn last_rows(&self) -> &[(RequestId, Vec<f32>)] {
        match self {
            Self::Colocated(s) => s.last_rows(),
            Self::Disaggregated { rows, .. } => rows,
        }
    }

    /// Decides and runs one step.
    pub fn step(&mut self) -> Result<Stepped, EngineError> {
        match self {
            Self::Colocated(s) => {
                let report = s.step()?;
                Ok(Stepped {
                    event: Event::Step(report.clone()),
                    report,
                })
            }
            Self::Disaggregated { engine, rows } => {
                let p = engine.step()?;
                rows.clear();
                for side in [Side::Prefill, Side::Decode] {
                    rows.extend(engine.engine(side).last_rows().iter().cloned());
                }
                // The prefill engine's handoff of a request to the decode
                // engine is not the request's end: only `p.finished` is.
                let finished = &p.finished;
                let mut seqs = Vec::new();
                for (side, r) in p.reports() {
                    for s in &r.seqs {
                        let mut s = s.clone();
                        if side == Side::Prefill {
                            s.finish = finished.iter().find(|f| f.0 == s.id).map(|f| f.1);
                        }
                        seqs.push(s);
                    }
                }
                let report = StepReport {
                    step: p.step,
                    decisions: Vec::new(),
                    seqs,
                    finished: p.finished.clone(),
                    cache_layout: p.decode.cache_layout,
                    cache_state: p.decode.cache_state,
                };
                Ok(Stepped {
                    event: Event::PdStep(Box::new(p)),
                    report,
                })
            }
        }
    }
}
