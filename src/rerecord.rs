//! `lmrr rerecord B --out B2`: for intentional numeric changes (a new contract
//! version, a changed kernel). Re-runs the recorded session — the script, engine
//! configuration and patch set from the manifest — on the current engine,
//! writes a fresh bundle, and prints what changed (steps, tokens per request)
//! so that a reviewer sees it. The new bundle is written to a temporary file
//! and renamed over `--out` only when complete: the old one is never lost.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result};

use lmrr_engine::{run_session, Model, PatchSet, PdEngine, Scheduler, Script};
use lmrr_recorder::{Bundle, Event, Recorder};

#[derive(clap::Args, Debug)]
pub struct RerecordArgs {
    /// The bundle to re-record.
    bundle: PathBuf,
    /// Where to write the new bundle (may be the same path).
    #[arg(long)]
    out: PathBuf,
    /// Model directory (default: regenerate the bundle's synthetic model).
    #[arg(long)]
    model: Option<String>,
    /// Worker threads (default: all cores). Never changes a bit.
    #[arg(long)]
    threads: Option<usize>,
}

/// Output tokens per request name, and the step count.
fn outputs(b: &Bundle) -> (BTreeMap<String, Vec<u32>>, usize) {
    let mut names = BTreeMap::new();
    let mut out: BTreeMap<String, Vec<u32>> = BTreeMap::new();
    let mut steps = 0;
    for e in &b.events {
        match e {
            Event::Arrival { name, request, .. } => {
                names.insert(request.id, name.clone());
                out.entry(name.clone()).or_default();
            }
            Event::Step(_) | Event::PdStep(_) => {
                steps += 1;
                for r in e.reports() {
                    for s in &r.seqs {
                        if let (Some(t), Some(n)) = (s.sampled, names.get(&s.id)) {
                            out.entry(n.clone()).or_default().push(t);
                        }
                    }
                }
            }
            Event::Interrupt { .. } | Event::Disaggregated(_) => {}
        }
    }
    (out, steps)
}

pub fn run(a: &RerecordArgs) -> Result<()> {
    let old = crate::open_bundle(&a.bundle)?;
    let m = &old.manifest;
    let mut model = match (&a.model, &m.model.synthetic) {
        (Some(dir), _) => crate::load_model(Some(dir))?,
        (None, Some(spec)) => Model::synthetic(*spec)?,
        (None, None) => anyhow::bail!(
            "the bundle was recorded on `{}`: pass --model DIR",
            m.model.origin
        ),
    };
    // The session is re-run in the arithmetic it was recorded in, at the
    // tensor-parallel degree it was recorded at (a deployment fact the new
    // bundle keeps; it changes no bit).
    lmrr_replays::set_recorded_numerics(&mut model, &old)?;
    crate::set_tp(&mut model, m.tp_degree as usize)?;
    let mut out = std::io::stdout().lock();
    if model.identity() != m.model.identity {
        writeln!(
            out,
            "note: model differs from the recording's\n  was {}\n  now {}",
            m.model.identity,
            model.identity()
        )?;
    }
    let script = Script::parse(&m.source.script, &m.source.script_path)?;
    let patches = PatchSet::parse(&m.patches.join(",")).map_err(anyhow::Error::msg)?;
    let th = crate::threads(a.threads)?;
    let n_threads = th.count();
    let manifest = crate::session_manifest(
        &model,
        m.engine,
        &patches,
        &m.source.script_path,
        &m.source.script,
        n_threads,
    );
    let tmp = a.out.with_extension("lmrr.partial");
    let f = std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    let mut rec = Recorder::new(std::io::BufWriter::new(f), &manifest)?;
    // A disaggregated recording is re-run on the same deployment.
    match lmrr_replays::pd::pd_config(&old) {
        Some(c) => {
            let mut eng = PdEngine::new(model.net(), m.engine, c, th, patches.clone())?;
            script.check_fits(&model, &eng)?;
            eng.set_top_logprobs(crate::TOP_LOGPROBS);
            rec.disaggregated(c);
            run_session(&model, &script, &mut eng, |e| rec.observe(e))?;
        }
        None => {
            let mut sch = Scheduler::with_patches(model.net(), m.engine, th, patches.clone())?;
            script.check_fits(&model, &sch)?;
            sch.set_top_logprobs(crate::TOP_LOGPROBS);
            run_session(&model, &script, &mut sch, |e| rec.observe(e))?;
        }
    }
    let w = rec.finish()?;
    let f = w
        .into_inner()
        .map_err(|e| anyhow::anyhow!("flushing {}: {}", tmp.display(), e.error()))?;
    f.sync_all()?;
    std::fs::rename(&tmp, &a.out)
        .with_context(|| format!("renaming {} to {}", tmp.display(), a.out.display()))?;

    let new = lmrr_recorder::open(&a.out)?;
    let (before, steps_before) = outputs(&old);
    let (after, steps_after) = outputs(&new);
    writeln!(
        out,
        "re-recorded {} → {}",
        a.bundle.display(),
        a.out.display()
    )?;
    writeln!(
        out,
        "contract v{} → v{} · format v{} → v{} · steps {steps_before} → {steps_after}",
        m.contract_version,
        new.manifest.contract_version,
        m.format_version,
        new.manifest.format_version
    )?;
    let mut changed = 0;
    for (name, toks) in &after {
        let old_toks = before.get(name).cloned().unwrap_or_default();
        match old_toks.iter().zip(toks).position(|(x, y)| x != y) {
            None if old_toks.len() == toks.len() => {
                writeln!(out, "  {name}: {} tokens, unchanged", toks.len())?
            }
            first => {
                changed += 1;
                let at = first.unwrap_or(old_toks.len().min(toks.len()));
                writeln!(
                    out,
                    "  {name}: CHANGED from output token {at}: {} → {} tokens",
                    old_toks.len(),
                    toks.len()
                )?;
            }
        }
    }
    writeln!(out, "{changed} request(s) changed")?;
    Ok(())
}
