//! `lmrr proxy` and `lmrr audit`: argument parsing and the calls into
//! `lmrr_serve::{proxy, audit}`.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{Context, Result};

#[derive(clap::Args, Debug)]
pub struct ProxyArgs {
    /// The OpenAI-compatible server to forward to: `http://host:port`.
    #[arg(long)]
    upstream: String,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8001")]
    listen: SocketAddr,
    /// Write the traffic bundle (`lmrr-traffic-*.lmrr`) into this directory.
    #[arg(long)]
    record_dir: PathBuf,
    /// Alternatives per token asked of the upstream for clients that did not
    /// ask for logprobs (stripped from what they receive); 0 = do not ask.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(0..=20))]
    top_logprobs: u32,
    /// Instead of listening, send the requests of this traffic bundle to the
    /// upstream in their order, each interrupted client hanging up after as
    /// many chunks as it received, and record the new traffic.
    #[arg(long, value_name = "TRAFFIC.lmrr")]
    resend: Option<PathBuf>,
}

pub fn run_proxy(a: &ProxyArgs) -> Result<()> {
    let cfg = lmrr_serve::proxy::ProxyConfig {
        upstream: a.upstream.clone(),
        listen: a.listen,
        record_dir: a.record_dir.clone(),
        top_logprobs: a.top_logprobs,
        tool_version: env!("CARGO_PKG_VERSION").into(),
        git_revision: env!("LMRR_GIT_REV").into(),
    };
    let (path, n) = lmrr_serve::proxy::proxy(cfg, a.resend.clone())?;
    eprintln!("lmrr proxy: {n} requests recorded in {}", path.display());
    println!("{}", path.display());
    Ok(())
}

#[derive(clap::Args, Debug)]
pub struct AuditArgs {
    /// Traffic bundle written by `lmrr proxy`.
    traffic: PathBuf,
    /// The model the upstream serves: an HF directory (e.g. lmrr's import of
    /// the GGUF it serves), or `synthetic:PRESET[:SEED]`.
    #[arg(long)]
    model: Option<String>,
    /// Worker threads (default: all cores). Never changes a bit.
    #[arg(long)]
    threads: Option<usize>,
    /// Print the report as JSON (every token's scores included).
    #[arg(long)]
    json: bool,
    /// Also write a drift plot (per-token reference logprob and rank) as SVG.
    #[arg(long, value_name = "OUT.svg")]
    svg: Option<PathBuf>,
}

/// Exit 0 when every turn is faithful, 1 when one drifted, broke or forgot
/// its history.
pub fn run_audit(a: &AuditArgs) -> Result<u8> {
    let traffic = lmrr_serve_traffic(&a.traffic)?;
    if !matches!(traffic.integrity, lmrr_recorder::Integrity::Complete { .. }) {
        eprintln!("warning: {}: {}", a.traffic.display(), traffic.integrity);
    }
    let model = crate::load_model(a.model.as_deref())?;
    let th = crate::threads(a.threads)?;
    let report = lmrr_serve::audit::audit(
        &model,
        &traffic,
        &a.traffic.display().to_string(),
        &th,
        lmrr_serve::audit::Thresholds::default(),
    )?;
    if let Some(p) = &a.svg {
        let svg = lmrr_replays::html::audit_svg(&crate::proxy::plot_series(&report))?;
        std::fs::write(p, svg).with_context(|| p.display().to_string())?;
        eprintln!("drift plot: {}", p.display());
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!("{report}");
    }
    Ok(if report.all_faithful() { 0 } else { 1 })
}

fn lmrr_serve_traffic(p: &std::path::Path) -> Result<lmrr_recorder::traffic::TrafficBundle> {
    lmrr_recorder::traffic::open(p).with_context(|| format!("reading {}", p.display()))
}

/// One line per audited turn: (label, per-token (reference logprob, rank)).
pub fn plot_series(r: &lmrr_serve::audit::AuditReport) -> Vec<lmrr_replays::html::AuditSeries> {
    r.turns
        .iter()
        .filter(|t| !t.tokens.is_empty())
        .map(|t| lmrr_replays::html::AuditSeries {
            label: format!("turn {} ({})", t.turn, t.verdict.as_str()),
            logprob: t.tokens.iter().map(|x| x.ref_logprob as f64).collect(),
            rank: t.tokens.iter().map(|x| x.rank as f64).collect(),
        })
        .collect()
}
