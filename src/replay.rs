//! `lmrr replay`: bit-exact re-execution, divergence reports, bisect and the
//! recompute oracle. Exit codes: replay and oracle 0 = bit-exact, 1 =
//! diverged; bisect (in the spirit of `git bisect run`) 0 = culprit found
//! and confirmed, 2 = refused (the good set diverges, the bad set is clean,
//! or the culprit does not confirm: the report says which); 2 = error, always.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;

use anyhow::{bail, Context, Result};

use lmrr_engine::{Model, Patch, PatchSet};
use lmrr_kernels::tensor_core::Numerics;
use lmrr_replays::html::ReportData;
use lmrr_replays::report::plural;
use lmrr_replays::{
    all_culprits, all_found, bisect_all, oracle_traced, probe, replay_traced, rounds_text,
    Criterion, Outcome, Probe, ReplayOptions,
};

#[derive(clap::Args, Debug)]
pub struct ReplayArgs {
    /// The bundle.
    bundle: PathBuf,
    /// Model directory (default: regenerate the bundle's synthetic model).
    #[arg(long)]
    model: Option<String>,
    /// Patch set to replay under (default: the recording's own).
    #[arg(long, value_parser = crate::parse_patches)]
    patches: Option<PatchSet>,
    /// Find the minimal set of `--patches` that makes the replay diverge.
    #[arg(long)]
    bisect: bool,
    /// With --bisect: a patch set known to replay clean (applied to every probe).
    #[arg(long, value_parser = crate::parse_patches, requires = "bisect")]
    good: Option<PatchSet>,
    /// With --bisect: a patch set known to diverge (its patches beyond --good are the candidates).
    #[arg(long, value_parser = crate::parse_patches, requires = "bisect")]
    bad: Option<PatchSet>,
    /// `recompute`: check every sampled token against a cache-off, batch-of-one recomputation.
    #[arg(long, value_parser = ["recompute"])]
    oracle: Option<String>,
    /// With --bisect, what makes a probe diverge: `behaviour` (default: a
    /// decision, what is cached or referenced, or a sampled token changes),
    /// `tokens` (only what the user sees: sampled tokens), or `bits` (any bit,
    /// numerical drift of logits and K/V included).
    #[arg(long, default_value = "behaviour", value_parser = ["behaviour", "tokens", "bits"], requires = "bisect")]
    criterion: String,
    /// After a divergence, explain how the divergent position was computed,
    /// under the recorded patches and under the replay's (mini-v4: the index
    /// blocks its indexer chose and scored, per layer).
    #[arg(long, conflicts_with_all = ["bisect", "oracle"])]
    explain: bool,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
    /// Also write the report as one self-contained HTML page (timeline,
    /// divergence, drift plots, texts, bisect probes or oracle turns).
    #[arg(long, value_name = "OUT.html")]
    html: Option<PathBuf>,
    /// Also write the drift plot alone as SVG.
    #[arg(long, value_name = "OUT.svg")]
    svg: Option<PathBuf>,
    /// Worker threads (default: all cores). Never changes a bit.
    #[arg(long)]
    threads: Option<usize>,
    /// Where the kernels run: `cpu`, or `cuda` (builds with `--features
    /// cuda`). A bundle recorded on one device replays on the other.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Tensor-parallel ranks: on the CPU, N ranks of the rank simulator
    /// (each holding its slice of the weights); on CUDA a degree above 1 is
    /// refused (multi-GPU needs NCCL, not built yet). Never changes a bit.
    #[arg(long, default_value_t = 1)]
    tp: usize,
}

fn load_model(a: &ReplayArgs, b: &lmrr_recorder::Bundle) -> Result<Model> {
    match (&a.model, &b.manifest.model.synthetic) {
        (Some(m), _) => crate::load_model(Some(m)),
        (None, Some(spec)) => {
            Model::synthetic(*spec).with_context(|| format!("regenerating {}", spec.name()))
        }
        (None, None) => bail!(
            "the bundle was recorded on `{}`, not a synthetic model: pass --model DIR",
            b.manifest.model.origin
        ),
    }
}

fn repro(a: &ReplayArgs, patches: &PatchSet) -> String {
    let mut s = format!("lmrr replay {}", a.bundle.display());
    if let Some(m) = &a.model {
        s += &format!(" --model {m}");
    }
    s += &format!(
        " --patches {}",
        if patches.is_empty() {
            "none".into()
        } else {
            patches.to_string()
        }
    );
    s
}

pub fn run(a: &ReplayArgs) -> Result<u8> {
    let b = crate::open_bundle(&a.bundle)?;
    if let lmrr_recorder::Integrity::Truncated { .. } = &b.integrity {
        eprintln!("warning: {}: {}", a.bundle.display(), b.integrity);
    }
    let mut model = load_model(a, &b)?;
    crate::set_device(&mut model, &a.device)?;
    let numerics = lmrr_replays::set_recorded_numerics(&mut model, &b)?;
    crate::set_tp(&mut model, a.tp)?;
    if b.manifest.tp_degree != 1 || a.tp != 1 {
        eprintln!(
            "tp: recorded at degree {}, replayed at degree {} (the degree never changes a bit)",
            b.manifest.tp_degree, a.tp
        );
    }
    if numerics != Numerics::Canonical {
        let how = match a.device.as_str() {
            "cpu" => "on the CPU by its bit-exact model of the sm_90 tensor core's inner product",
            _ => "on the device's tensor cores",
        };
        eprintln!("numerics: {numerics}, as recorded; {how}");
    }
    let th = crate::threads(a.threads)?;
    let recorded = PatchSet::parse(&b.manifest.patches.join(",")).map_err(anyhow::Error::msg)?;
    let path = a.bundle.display().to_string();
    let mut out = std::io::stdout().lock();

    if a.oracle.is_some() {
        let mut opts = ReplayOptions::new(recorded.clone(), th);
        opts.repro = format!("lmrr replay {} --oracle recompute", a.bundle.display());
        let (o, turns) = oracle_traced(&b, &model, &opts)?;
        print_outcome(&mut out, &o, a.json, "oracle recompute")?;
        if a.html.is_some() || a.svg.is_some() {
            let cmd = format!("lmrr replay {} --oracle recompute", a.bundle.display());
            let data = ReportData::oracle(&b, &path, &cmd, &model, &o, &turns);
            write_reports(a, &data)?;
        }
        return Ok(u8::from(!o.is_bit_exact()));
    }

    if a.bisect {
        // The good set defaults to the recording's own: a bundle replays clean
        // under the patches it was recorded with.
        let good = a.good.clone().unwrap_or_else(|| recorded.clone());
        let bad = match (&a.bad, &a.patches) {
            (Some(bad), _) => bad.clone(),
            (None, Some(p)) => p.clone(),
            // The whole catalog that can act on this model's family (and
            // on a disaggregated deployment, for such a bundle).
            (None, None) => PatchSet::all_for_deployment(
                model.net.family(),
                lmrr_replays::pd::pd_config(&b).is_some(),
            ),
        };
        let (base, candidates): (PatchSet, Vec<Patch>) = (
            good.clone(),
            bad.iter().filter(|p| !good.contains(*p)).collect(),
        );
        let bar = if std::io::stderr().is_terminal() && !a.json {
            let pb = indicatif::ProgressBar::new_spinner();
            pb.set_message("bisecting");
            Some(pb)
        } else {
            None
        };
        let mut run_probe = |set: &PatchSet| -> Result<Probe> {
            if let Some(pb) = &bar {
                pb.set_message(format!("replaying under {set}"));
                pb.tick();
            }
            let criterion = match a.criterion.as_str() {
                "bits" => Criterion::Bits,
                "tokens" => Criterion::Tokens,
                _ => Criterion::Behaviour,
            };
            Ok(probe(&b, &model, set, &th, criterion)?)
        };
        let rounds = bisect_all(&base, &candidates, &mut run_probe)?;
        let res = rounds[0].clone();
        if let Some(pb) = bar {
            pb.finish_and_clear();
        }
        if a.html.is_some() || a.svg.is_some() {
            // The page shows the culprit's own divergence: one more replay.
            let culprit = match (&res.culprits, res.found()) {
                (Some(c), true) => {
                    let set: PatchSet = base
                        .iter()
                        .chain(c.iter().filter_map(|n| n.parse::<Patch>().ok()))
                        .collect();
                    let mut opts = ReplayOptions::new(set.clone(), th.clone());
                    opts.repro = repro(a, &set);
                    opts.trace_steps = TRACE_STEPS;
                    let (o, t) = replay_traced(&b, &model, &opts)?;
                    Some((set.to_string(), o, t))
                }
                _ => None,
            };
            let cmd = format!("lmrr replay {} --bisect", a.bundle.display());
            let data = ReportData::bisect(
                &b,
                &path,
                &cmd,
                &model,
                &res,
                culprit.as_ref().map(|(s, o, t)| (s.as_str(), o, t)),
            );
            write_reports(a, &data)?;
        }
        if a.json {
            // One round: the outcome itself; several: the list of rounds.
            let json = if rounds.len() == 1 {
                serde_json::to_string_pretty(&res)?
            } else {
                serde_json::to_string_pretty(&rounds)?
            };
            writeln!(out, "{json}")?;
        } else {
            writeln!(
                out,
                "bisect over {} on top of `{}` ({} criterion):",
                plural(candidates.len() as u64, "candidate patch"),
                res.base,
                a.criterion
            )?;
            for line in rounds_text(&rounds).lines() {
                writeln!(out, "  {line}")?;
            }
            if all_found(&rounds) {
                for c in all_culprits(&rounds) {
                    let set: PatchSet = base
                        .iter()
                        .chain(c.iter().filter_map(|n| n.parse::<Patch>().ok()))
                        .collect();
                    writeln!(out, "repro: {}", repro(a, &set))?;
                }
            }
        }
        return Ok(if all_found(&rounds) { 0 } else { 2 });
    }

    let patches = a.patches.clone().unwrap_or_else(|| recorded.clone());
    let mut opts = ReplayOptions::new(patches.clone(), th);
    opts.repro = repro(a, &patches);
    if a.html.is_some() || a.svg.is_some() {
        opts.trace_steps = TRACE_STEPS;
    }
    let (o, trace) = replay_traced(&b, &model, &opts)?;
    // Under another patch set, lead with the request whose output changes.
    let harm = if patches != recorded && !o.is_bit_exact() {
        match crate::harm::harm(&b, &model, &patches, &opts.threads, &path) {
            Ok(h) => h,
            Err(e) => {
                eprintln!("warning: the harmed request could not be computed: {e:#}");
                None
            }
        }
    } else {
        None
    };
    if a.json {
        let mut v = serde_json::to_value(&o)?;
        if let (Some(h), Some(m)) = (&harm, v.as_object_mut()) {
            m.insert("harm".into(), h.to_json());
        }
        writeln!(out, "{}", serde_json::to_string_pretty(&v)?)?;
    } else {
        if let Some(h) = &harm {
            writeln!(out, "{h}")?;
        }
        print_outcome(
            &mut out,
            &o,
            false,
            &format!("replay under patches `{patches}`"),
        )?;
    }
    if a.explain {
        let text = match o.divergence() {
            Some(d) => {
                lmrr_replays::explain::explain(&b, &model, d, &recorded, &patches, &opts.threads)?
                    .unwrap_or_else(|| "explain: the divergence names no request".into())
            }
            None => "explain: nothing diverged".into(),
        };
        writeln!(out, "{text}")?;
    }
    if a.html.is_some() || a.svg.is_some() {
        let data = ReportData::replay(
            &b,
            &path,
            &opts.repro,
            &model,
            &patches.to_string(),
            &o,
            &trace,
        );
        write_reports_led(a, &data, harm.as_ref())?;
    }
    Ok(u8::from(!o.is_bit_exact()))
}

/// With `--html`/`--svg`, the replay goes on this many steps past the first
/// divergence, so the drift plots show how the drift grew (the text report
/// keeps its own short window).
const TRACE_STEPS: u64 = u64::MAX;

fn write_reports(a: &ReplayArgs, data: &ReportData) -> Result<()> {
    write_reports_led(a, data, None)
}

/// The reports, the HTML page led by the harmed request when there is one.
fn write_reports_led(
    a: &ReplayArgs,
    data: &ReportData,
    harm: Option<&crate::harm::Harm>,
) -> Result<()> {
    if let Some(p) = &a.html {
        let html = data.to_html()?;
        let html = match harm {
            Some(h) => crate::harm::lead_html(&html, h),
            None => html,
        };
        std::fs::write(p, html)
            .with_context(|| format!("writing the HTML report {}", p.display()))?;
        eprintln!("report: {}", p.display());
    }
    if let Some(p) = &a.svg {
        std::fs::write(p, data.drift_svg()?)
            .with_context(|| format!("writing the drift plot {}", p.display()))?;
        eprintln!("drift plot: {}", p.display());
    }
    Ok(())
}

fn print_outcome(out: &mut impl Write, o: &Outcome, json: bool, what: &str) -> Result<()> {
    if json {
        writeln!(out, "{}", serde_json::to_string_pretty(o)?)?;
    } else {
        writeln!(out, "{what}")?;
        writeln!(out, "{o}")?;
    }
    Ok(())
}
