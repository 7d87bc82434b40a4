//! `lmrr probe`: argument parsing and the calls into `lmrr_serve::probe`
//! (the sweeps, the table, the HTML heat map).

use std::path::PathBuf;

use anyhow::{bail, Context, Result};

use lmrr_engine::PatchSet;
use lmrr_serve::probe::{self, Sweep};

#[derive(clap::Args, Debug)]
pub struct ProbeArgs {
    /// The model to probe on the local engine (an HF directory or
    /// `synthetic:PRESET[:SEED]`); with `--url`, only its tokenizer is used
    /// (to size the haystacks).
    #[arg(long)]
    model: Option<String>,
    /// Probe an OpenAI-compatible server instead (`http://host:port`),
    /// through `lmrr proxy`'s client; its traffic bundle is recorded.
    #[arg(long)]
    url: Option<String>,
    /// The `model` sent to `--url`.
    #[arg(long, default_value = "default")]
    served_model_name: String,
    /// Patch sets, comma-separated; `none` is the reference, `a+b` combines
    /// patches (local engine only).
    #[arg(long, default_value = "none")]
    patches: String,
    /// Needle depths, percent of the haystack, comma-separated.
    #[arg(long, default_value = "0,25,50,75,100")]
    depths: String,
    /// Context lengths, tokens, comma-separated (`''`: no needle sweep).
    #[arg(long, default_value = "256,512,1024")]
    lengths: String,
    /// Interrupt points of the recall probe, tokens (chunks with `--url`),
    /// comma-separated (`''`: no recall probe).
    #[arg(long, default_value = "8,30")]
    cuts: String,
    /// Tokens generated for a needle answer.
    #[arg(long, default_value_t = 12)]
    needle_tokens: usize,
    /// Tokens generated for the recall answer.
    #[arg(long, default_value_t = 24)]
    recall_tokens: usize,
    /// Where each probe's bundle is written.
    #[arg(long, default_value = "lmrr-probe")]
    record_dir: PathBuf,
    /// Also write the heat map as one HTML page.
    #[arg(long, value_name = "OUT.html")]
    html: Option<PathBuf>,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// Worker threads (default: all cores). Never changes a bit.
    #[arg(long)]
    threads: Option<usize>,
}

/// A comma-separated list of numbers (empty: none).
fn list<T: std::str::FromStr>(name: &str, s: &str) -> Result<Vec<T>> {
    s.split(',')
        .map(str::trim)
        .filter(|x| !x.is_empty())
        .map(|x| {
            x.parse()
                .map_err(|_| anyhow::anyhow!("{name} {s}: `{x}` is not a non-negative integer"))
        })
        .collect()
}

fn patch_sets(s: &str) -> Result<Vec<PatchSet>> {
    s.split(',')
        .map(str::trim)
        .filter(|x| !x.is_empty())
        .map(|x| {
            if x == "none" {
                Ok(PatchSet::default())
            } else {
                PatchSet::parse(&x.replace('+', ",")).map_err(anyhow::Error::msg)
            }
        })
        .collect::<Result<Vec<_>>>()
}

/// Exit 0 when every patch set matches `none` (or only one ran), 1 when
/// one departs from it somewhere (a lost needle, a forgotten fact, or only
/// another answer).
pub fn run(a: &ProbeArgs) -> Result<u8> {
    let sweep = Sweep {
        depths: list("--depths", &a.depths)?,
        lengths: list("--lengths", &a.lengths)?,
        needle_tokens: a.needle_tokens,
        cuts: list("--cuts", &a.cuts)?,
        recall_tokens: a.recall_tokens,
    };
    if let Some(d) = sweep.depths.iter().find(|&&d| d > 100) {
        bail!("--depths {d}: a depth is a percentage, 0 to 100");
    }
    if sweep.needle_tokens == 0 || sweep.recall_tokens == 0 {
        bail!("--needle-tokens and --recall-tokens must be at least 1");
    }
    if sweep.cuts.contains(&0) {
        bail!("--cuts 0: a retry is cut after at least one token");
    }
    let mut progress = |s: &str| eprintln!("probe: {s}");
    let report = match &a.url {
        Some(url) => {
            if a.patches != "none" {
                bail!(
                    "--patches {} with --url: a server runs its own patches; probe each deployment by its URL",
                    a.patches
                );
            }
            let model = a
                .model
                .as_deref()
                .map(|m| crate::load_model(Some(m)))
                .transpose()?;
            let sentences = |l: usize| -> usize {
                model
                    .as_ref()
                    .and_then(|m| probe::local::sentences_for(m, l, probe::NEEDLE_VALUES[0].0).ok())
                    .unwrap_or_else(|| probe::remote::sentences_by_chars(l))
            };
            probe::remote::run(
                url,
                &a.served_model_name,
                &sweep,
                &a.record_dir,
                (env!("CARGO_PKG_VERSION"), env!("LMRR_GIT_REV")),
                &sentences,
                &mut progress,
            )?
        }
        None => {
            let Some(spec) = a.model.as_deref() else {
                bail!("--model M (the model to probe) or --url U (a server to probe) is required");
            };
            let model = crate::load_model(Some(spec))?;
            let th = crate::threads(a.threads)?;
            let sets = patch_sets(&a.patches)?;
            if sets.is_empty() {
                bail!("--patches: no patch set (use `none` for the reference)");
            }
            for s in &sets {
                let inert = s.inert_for(model.net.family());
                if !inert.is_empty() {
                    let names: Vec<&str> = inert.iter().map(|p| p.name()).collect();
                    eprintln!(
                        "warning: {} cannot act on a {} model: inert in this probe",
                        names.join(", "),
                        model.net.family()
                    );
                }
            }
            probe::local::run(
                &model,
                &th,
                &sets,
                &sweep,
                &a.record_dir,
                probe::local::Tool {
                    version: env!("CARGO_PKG_VERSION"),
                    git_revision: env!("LMRR_GIT_REV"),
                },
                &mut progress,
            )?
        }
    };
    if let Some(p) = &a.html {
        let dir = p
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .map_or_else(|| PathBuf::from("."), PathBuf::from);
        let dir = std::fs::canonicalize(&dir).unwrap_or(dir);
        std::fs::write(p, probe::html::page(&report, &dir)?)
            .with_context(|| format!("writing {}", p.display()))?;
        eprintln!("heat map: {}", p.display());
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!("{report}");
    }
    let worse = report
        .patch_sets
        .iter()
        .filter(|p| *p != "none")
        .any(|p| !report.findings(p).is_empty());
    Ok(if worse { 1 } else { 0 })
}
