//! `lmrr` with no command: the incident, end to end, on the embedded default
//! model — record the session, replay it bit-exactly, replay it under the
//! cache-corruption patch, bisect the whole catalog, and run the recompute
//! oracle on a bundle recorded with the patch. No download, no arguments.

use std::io::Write;

use anyhow::{ensure, Result};

use lmrr_engine::{
    run_session, EngineConfig, Model, Patch, PatchSet, Scheduler, Script, SynthSpec,
};
use lmrr_recorder::Recorder;
use lmrr_replays::report::plural;
use lmrr_replays::{bisect, oracle, probe, replay, Criterion, Probe, ReplayOptions};

const INCIDENT: &str = include_str!("../examples/incident.toml");

fn record(
    model: &Model,
    script: &Script,
    patches: &PatchSet,
    th: &lmrr_kernels::Threads,
) -> Result<lmrr_recorder::Bundle> {
    let cfg = EngineConfig::default();
    let manifest = crate::session_manifest(
        model,
        cfg,
        patches,
        "examples/incident.toml",
        &script.source,
        th.count(),
    );
    let mut sch = Scheduler::with_patches(model.net(), cfg, th.clone(), patches.clone())?;
    sch.set_top_logprobs(crate::TOP_LOGPROBS);
    let mut rec = Recorder::new(Vec::new(), &manifest)?;
    run_session(model, script, &mut sch, |e| rec.observe(e))?;
    Ok(lmrr_recorder::read(&rec.finish()?)?)
}

pub fn run() -> Result<()> {
    let mut out = std::io::stdout().lock();
    let th = crate::threads(None)?;
    let model = Model::synthetic(SynthSpec::embedded_default())?;
    let script = Script::parse(INCIDENT, "examples/incident.toml")?;
    writeln!(
        out,
        "lmrr incident demo on {} (no download)\n",
        model.origin
    )?;

    writeln!(out, "1. record: turn 1 interrupted after 60 tokens, turn 2 \"to a file\" with the partial answer")?;
    let clean = record(&model, &script, &PatchSet::none(), &th)?;
    let s = lmrr_recorder::Summary::of(&clean);
    writeln!(
        out,
        "   {}, {}, {}, {}, {} ({:.2} bytes/token of token data)\n",
        plural(s.requests as u64, "request"),
        plural(s.turns as u64, "follow-up turn"),
        plural(s.interrupts as u64, "interrupt"),
        plural(s.steps as u64, "step"),
        plural(s.bytes as u64, "byte"),
        s.token_data_bytes_per_token
    )?;

    writeln!(out, "2. replay, reference engine")?;
    let o = replay(
        &clean,
        &model,
        &ReplayOptions::new(PatchSet::none(), th.clone()),
    )?;
    writeln!(out, "   {o}\n")?;
    ensure!(o.is_bit_exact(), "the reference replay diverged");

    writeln!(out, "3. replay under abort-inserts-partial")?;
    let patch = PatchSet::parse("abort-inserts-partial").map_err(anyhow::Error::msg)?;
    let mut opts = ReplayOptions::new(patch.clone(), th.clone());
    opts.repro = "lmrr replay incident.lmrr --patches abort-inserts-partial".into();
    opts.drift_steps = 2;
    let o = replay(&clean, &model, &opts)?;
    for line in o.to_string().lines() {
        writeln!(out, "   {line}")?;
    }
    writeln!(out)?;
    ensure!(
        !o.is_bit_exact(),
        "the patch did not make the replay diverge"
    );

    writeln!(
        out,
        "4. bisect over the whole catalog ({})",
        PatchSet::all_for(model.net.family())
    )?;
    let mut probe = |set: &PatchSet| -> Result<Probe> {
        Ok(probe(&clean, &model, set, &th, Criterion::Behaviour)?)
    };
    let catalog: Vec<Patch> = PatchSet::all_for(model.net.family()).iter().collect();
    let res = bisect(&PatchSet::none(), &catalog, &mut probe)?;
    for line in res.to_string().lines() {
        writeln!(out, "   {line}")?;
    }
    writeln!(out)?;
    ensure!(res.found(), "bisect found no confirmed culprit");

    writeln!(
        out,
        "5. recompute oracle on a bundle recorded WITH the patch (no golden run)"
    )?;
    let bad = record(&model, &script, &patch, &th)?;
    let mut opts = ReplayOptions::new(PatchSet::none(), th.clone());
    opts.repro = "lmrr replay incident-patched.lmrr --oracle recompute".into();
    let o = oracle(&bad, &model, &opts)?;
    for line in o.to_string().lines().take(6) {
        writeln!(out, "   {line}")?;
    }
    ensure!(!o.is_bit_exact(), "the oracle missed the corrupted cache");
    writeln!(
        out,
        "\nreproduce step by step: see README.md, \"The incident, step by step\""
    )?;
    Ok(())
}
