//! What several replay test files share: the embedded model, every family's
//! tiny model (the engine tests' family list and `per_family!` generator),
//! and recording a session script into an in-memory bundle.

#![allow(dead_code)]

#[macro_use]
#[path = "../../../engine/tests/common/families.rs"]
pub mod families;

use lmrr_engine::{run_session, EngineConfig, Model, PatchSet, Scheduler, Script, SynthSpec};
use lmrr_kernels::Threads;
use lmrr_recorder::{read, Bundle, Manifest, Recorder};

pub fn model() -> Model {
    Model::synthetic(SynthSpec::embedded_default()).unwrap()
}

/// Records `src` on `m` (2 threads, top-5 logprobs); `after` sees the
/// scheduler once the session has ended, before the bundle is finished.
pub fn record_then(
    m: &Model,
    src: &str,
    cfg: EngineConfig,
    patches: PatchSet,
    after: impl FnOnce(&Scheduler),
) -> Bundle {
    let script = Script::parse(src, "s.toml").unwrap();
    let manifest = Manifest::for_session(m, cfg, &patches, "s.toml", src, 5, 2, "test", "test");
    let mut sch = Scheduler::with_patches(m.net(), cfg, Threads::new(2).unwrap(), patches).unwrap();
    sch.set_top_logprobs(5);
    let mut rec = Recorder::new(Vec::new(), &manifest).unwrap();
    run_session(m, &script, &mut sch, |e| rec.observe(e)).unwrap();
    after(&sch);
    read(&rec.finish().unwrap()).unwrap()
}

/// [`record_then`] with nothing to check afterwards.
pub fn record(m: &Model, src: &str, cfg: EngineConfig, patches: PatchSet) -> Bundle {
    record_then(m, src, cfg, patches, |_| {})
}

/// Records `src` on `m` on a disaggregated deployment (prefill engine `cfg`,
/// decode engine and link `pd`), 2 threads, top-5 logprobs.
pub fn record_pd(
    m: &Model,
    src: &str,
    cfg: EngineConfig,
    pd: lmrr_engine::PdConfig,
    patches: PatchSet,
) -> Bundle {
    let script = Script::parse(src, "s.toml").unwrap();
    let manifest = Manifest::for_session(m, cfg, &patches, "s.toml", src, 5, 2, "test", "test");
    let mut eng =
        lmrr_engine::PdEngine::new(m.net(), cfg, pd, Threads::new(2).unwrap(), patches).unwrap();
    eng.set_top_logprobs(5);
    let mut rec = Recorder::new(Vec::new(), &manifest).unwrap();
    rec.disaggregated(pd);
    run_session(m, &script, &mut eng, |e| rec.observe(e)).unwrap();
    read(&rec.finish().unwrap()).unwrap()
}
