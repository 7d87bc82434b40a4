//! A family's executors in one place: its programs (one per patch set,
//! built once), the numerics mode its matmuls follow, and, on CUDA, the
//! resident executor with its tables on the device. A step runs on the resident executor where there is one and it
//! takes the step, else on the host executor; the measurement switches of
//! the device path are reached through here, so that no family holds device
//! code.

use std::sync::Arc;

use super::host::{self, Extras};
use super::{run_host, Programs, StepSplit};
use super::{Program, Tables};
use crate::kv::KvCache;
use crate::model::ops::Ops;
use crate::model::{Device, SeqSpan};
use crate::patches::PatchSet;
use crate::EngineError;
use lmrr_kernels::tensor_core::Numerics;

/// A family's programs and, on CUDA, its resident executor.
pub struct Executors {
    programs: Programs,
    numerics: Numerics,
    /// The rank simulator, when tensor parallelism is on (CPU).
    tp: Option<super::tp::Simulator>,
    cpu: bool,
    #[cfg(feature = "cuda")]
    resident: Option<super::resident::Resident>,
}

impl Default for Executors {
    fn default() -> Self {
        Self {
            programs: Programs::default(),
            numerics: Numerics::default(),
            tp: None,
            cpu: true,
            #[cfg(feature = "cuda")]
            resident: None,
        }
    }
}

impl Executors {
    /// Moves to `device`: on CUDA the tables are uploaded for the resident
    /// executor (every op of a program has a device kernel there; the
    /// attention patches, which have none, are refused when a step names
    /// them).
    pub fn set_device(&mut self, device: &Device, tables: &Tables) -> Result<(), EngineError> {
        if let (Some(tp), false) = (&self.tp, matches!(device, Device::Cpu)) {
            if tp.degree() > 1 {
                return Err(super::tp::TpError::NeedsNccl(tp.degree()).into());
            }
        }
        self.cpu = matches!(device, Device::Cpu);
        #[cfg(feature = "cuda")]
        {
            self.resident = None;
        }
        if matches!(device, Device::Cpu) {
            return Ok(());
        }
        #[cfg(feature = "cuda")]
        if let Device::Cuda(g) = device {
            let mut r = super::resident::Resident::new(g.clone(), tables)?;
            r.set_numerics(self.numerics)?;
            self.resident = Some(r);
        }
        let _ = tables;
        Ok(())
    }

    /// The numerics mode the matmuls follow.
    pub fn numerics(&self) -> Numerics {
        self.numerics
    }

    /// Switches the matmuls to `numerics`. The tensor-core mode multiplies
    /// bf16 weights only: a table with another storage is refused, naming
    /// it; on CUDA the resident executor switches its matmul kernels.
    pub fn set_numerics(&mut self, numerics: Numerics, tables: &Tables) -> Result<(), EngineError> {
        if numerics.model().is_some() {
            if self.tp.is_some() {
                return Err(super::tp::TpError::Numerics(numerics.to_string()).into());
            }
            for m in &tables.mats {
                let m = m.matrix();
                if !matches!(m.w, lmrr_kernels::Weights::Bf16(_)) {
                    return Err(crate::model::ops::not_bf16(&m));
                }
            }
        }
        #[cfg(feature = "cuda")]
        if let Some(r) = &mut self.resident {
            r.set_numerics(numerics)?;
        }
        self.numerics = numerics;
        Ok(())
    }

    /// Tensor parallelism of `tp.degree` ranks from the next step: on the
    /// CPU the rank simulator runs every step (degree 1 with an injected
    /// failure included); on CUDA a degree above 1 is refused (it needs
    /// NCCL), as are the tensor-core numerics.
    pub fn set_tp(&mut self, tp: super::tp::TpConfig) -> Result<(), EngineError> {
        use super::tp::{Simulator, TpError};
        if tp.degree == 0 || tp.degree > super::tp::MAX_DEGREE {
            return Err(TpError::Degree(tp.degree).into());
        }
        if tp.degree > 1 && !self.cpu {
            return Err(TpError::NeedsNccl(tp.degree).into());
        }
        if self.numerics.model().is_some() && (tp.degree > 1 || tp.fail.is_some()) {
            return Err(TpError::Numerics(self.numerics.to_string()).into());
        }
        self.tp = if tp.degree > 1 || tp.fail.is_some() {
            Some(Simulator::new(tp)?)
        } else {
            None
        };
        Ok(())
    }

    /// The tensor-parallel degree (1 without).
    pub fn tp_degree(&self) -> usize {
        self.tp.as_ref().map_or(1, |t| t.degree())
    }

    /// Plans `prog` for the ranks now, so that a shape the degree cannot
    /// split is refused before a step runs.
    pub fn tp_check(&self, prog: &Arc<Program>, tables: &Tables) -> Result<(), EngineError> {
        match &self.tp {
            Some(t) => Ok(t.check(prog, tables)?),
            None => Ok(()),
        }
    }

    /// The program of `patches` (built by `build` the first time).
    pub fn program(&self, patches: &PatchSet, build: impl FnOnce() -> Program) -> Arc<Program> {
        self.programs.get(patches, build)
    }

    /// One step after [`super::begin_step`]: on the resident executor where
    /// there is one and the step needs nothing only the host executor does
    /// (the indexer's trace, a sparse selection), else on the host executor.
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &self,
        ops: &Ops,
        kv: &mut dyn KvCache,
        spans: &[SeqSpan],
        vocab: usize,
        prog: &Arc<Program>,
        tables: &Tables,
        extras: Extras,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        if let Some(t) = &self.tp {
            return t.run(ops, kv, spans, vocab, prog, tables, extras);
        }
        #[cfg(feature = "cuda")]
        if let (Some(r), None) = (&self.resident, &extras.trace) {
            return r.forward(prog, tables, kv, spans, ops.threads);
        }
        run_host(ops, kv, spans, vocab, prog, tables, extras)
    }

    /// Turns the resident path's decode-step CUDA graphs on or off (a
    /// measurement switch: the bits are the same either way).
    pub fn set_graphs(&self, on: bool) {
        #[cfg(feature = "cuda")]
        if let Some(r) = &self.resident {
            r.set_graphs(on);
        }
        let _ = on;
    }

    /// While on, each resident step's kernels are timed on the device by
    /// events around them ([`Executors::take_step_device`]).
    pub fn set_step_timing(&self, on: bool) {
        #[cfg(feature = "cuda")]
        if let Some(r) = &self.resident {
            r.set_step_timing(on);
        }
        let _ = on;
    }

    /// Each resident step timed since the last call.
    pub fn take_step_device(&self) -> Vec<StepSplit> {
        #[cfg(feature = "cuda")]
        if let Some(r) = &self.resident {
            return r.take_step_device();
        }
        Vec::new()
    }

    /// On the resident path: KV pages held on the device, and pages
    /// uploaded to it so far.
    pub fn device_stats(&self) -> Option<(usize, u64)> {
        #[cfg(feature = "cuda")]
        if let Some(r) = &self.resident {
            return Some(r.kv_stats());
        }
        None
    }

    /// The resident path's time per op (with `LMRR_CUDA_PROFILE=1`), else
    /// `host`'s.
    pub fn profile(&self, host: &host::Profile) -> Vec<(&'static str, f64)> {
        #[cfg(feature = "cuda")]
        if let Some(r) = &self.resident {
            let p = r.profile();
            if !p.is_empty() {
                return p;
            }
        }
        host.parts()
    }

    /// Zeroes both profiles.
    pub fn reset_profile(&self, host: &host::Profile) {
        #[cfg(feature = "cuda")]
        if let Some(r) = &self.resident {
            r.reset_profile();
        }
        host.take();
    }
}
