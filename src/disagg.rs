//! `--disaggregate` for `lmrr run`: the flags of the decode engine and the
//! link, and the engine a session runs on (one scheduler, or a prefill and a
//! decode engine joined by a K/V link).

use lmrr_engine::session::{SessionEvent, StepSummary};
use lmrr_engine::{
    EngineConfig, EngineError, ModelFamily, PatchSet, PdConfig, PdEngine, Request, RequestId,
    RequestOutput, Scheduler, SessionEngine,
};
use lmrr_kernels::Threads;

/// Flags of a disaggregated deployment (the prefill engine takes the
/// colocated engine's flags).
#[derive(clap::Args, Debug, Clone)]
pub struct DisaggArgs {
    /// Run on a prefill engine and a decode engine, each with its own
    /// scheduler and KV pool, the prompt's K/V carried page by page between
    /// them (recorded: bootstrap, reservation, each transfer, completion,
    /// admission).
    #[arg(long)]
    pub disaggregate: bool,
    /// Decode engine: positions per KV page (default: --page-size).
    #[arg(long, requires = "disaggregate")]
    pub decode_page_size: Option<usize>,
    /// Decode engine: pages in its KV pool (default: --pool-pages).
    #[arg(long, requires = "disaggregate")]
    pub decode_pool_pages: Option<usize>,
    /// Decode engine: tokens per step (default: --max-batch-tokens).
    #[arg(long, requires = "disaggregate")]
    pub decode_max_batch_tokens: Option<usize>,
    /// Decode engine: no radix prefix cache.
    #[arg(long, requires = "disaggregate")]
    pub decode_no_prefix_cache: bool,
    /// Prefill pages the link carries per step.
    #[arg(long, default_value_t = 1, requires = "disaggregate")]
    pub transfer_pages_per_step: usize,
}

impl DisaggArgs {
    /// The deployment, if `--disaggregate`.
    pub fn config(&self, prefill: EngineConfig) -> Option<PdConfig> {
        self.disaggregate.then(|| PdConfig {
            decode: EngineConfig {
                page_size: self.decode_page_size.unwrap_or(prefill.page_size),
                pool_pages: self.decode_pool_pages.unwrap_or(prefill.pool_pages),
                max_batch_tokens: self
                    .decode_max_batch_tokens
                    .unwrap_or(prefill.max_batch_tokens),
                prefix_cache: prefill.prefix_cache && !self.decode_no_prefix_cache,
            },
            transfer_pages_per_step: self.transfer_pages_per_step,
        })
    }
}

/// The engine a session runs on.
pub enum Engine<'m> {
    Colocated(Box<Scheduler<'m>>),
    Disaggregated(Box<PdEngine<'m>>),
}

impl<'m> Engine<'m> {
    pub fn new(
        model: &'m dyn ModelFamily,
        cfg: EngineConfig,
        pd: Option<PdConfig>,
        threads: Threads,
        patches: PatchSet,
    ) -> Result<Self, EngineError> {
        Ok(match pd {
            Some(c) => {
                Self::Disaggregated(Box::new(PdEngine::new(model, cfg, c, threads, patches)?))
            }
            None => Self::Colocated(Box::new(Scheduler::with_patches(
                model, cfg, threads, patches,
            )?)),
        })
    }

    /// The deployment of a disaggregated engine.
    pub fn pd_config(&self) -> Option<PdConfig> {
        match self {
            Self::Disaggregated(e) => Some(*e.config()),
            Self::Colocated(_) => None,
        }
    }

    pub fn set_top_logprobs(&mut self, k: usize) {
        match self {
            Self::Colocated(s) => s.set_top_logprobs(k),
            Self::Disaggregated(e) => e.set_top_logprobs(k),
        }
    }

    /// Pages cached in the prefix trees at the end.
    pub fn cached_pages(&self) -> usize {
        match self {
            Self::Colocated(s) => s.cached_pages(),
            Self::Disaggregated(e) => [lmrr_engine::Side::Prefill, lmrr_engine::Side::Decode]
                .iter()
                .map(|&side| e.engine(side).cached_pages())
                .sum(),
        }
    }

    fn inner(&self) -> &dyn SessionEngine {
        match self {
            Self::Colocated(s) => &**s,
            Self::Disaggregated(e) => &**e,
        }
    }

    fn inner_mut(&mut self) -> &mut (dyn SessionEngine + 'm) {
        match self {
            Self::Colocated(s) => &mut **s,
            Self::Disaggregated(e) => &mut **e,
        }
    }
}

impl SessionEngine for Engine<'_> {
    fn steps(&self) -> u64 {
        self.inner().steps()
    }
    fn submit(&mut self, req: Request) -> Result<(), EngineError> {
        self.inner_mut().submit(req)
    }
    fn interrupt(&mut self, id: RequestId) -> Result<bool, EngineError> {
        self.inner_mut().interrupt(id)
    }
    fn generated(&self, id: RequestId) -> Option<&[u32]> {
        self.inner().generated(id)
    }
    fn is_idle(&self) -> bool {
        self.inner().is_idle()
    }
    fn output(&self, id: RequestId) -> Option<&RequestOutput> {
        self.inner().output(id)
    }
    fn pools(&self) -> Vec<(EngineConfig, bool)> {
        self.inner().pools()
    }
    fn step_observed(
        &mut self,
        observe: &mut dyn FnMut(SessionEvent<'_>),
    ) -> Result<StepSummary, EngineError> {
        self.inner_mut().step_observed(observe)
    }
}
