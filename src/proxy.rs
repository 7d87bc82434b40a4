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
    /// the GGUF it serves), or `synthetic:PRESET[:SEED]`. Without it, the
    /// model the traffic's requests name, when that is a directory here or a
    /// synthetic model; otherwise the audit refuses to guess.
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
    let spec = match &a.model {
        Some(m) => m.clone(),
        None => traffic_model(&traffic, &a.traffic)?,
    };
    let model = crate::load_model(Some(&spec))?;
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

/// The model the traffic's requests name, when this machine can load it by
/// that name (a directory, or `synthetic:…`); else an error asking for
/// `--model`, naming what the traffic says.
fn traffic_model(
    traffic: &lmrr_recorder::traffic::TrafficBundle,
    path: &std::path::Path,
) -> Result<String> {
    let mut named = std::collections::BTreeSet::new();
    for e in &traffic.events {
        if let lmrr_recorder::traffic::TrafficEvent::Request { body, .. } = e {
            if let Some(m) = serde_json::from_slice::<serde_json::Value>(body)
                .ok()
                .and_then(|v| v.get("model")?.as_str().map(str::to_string))
            {
                named.insert(m);
            }
        }
    }
    let loadable = |m: &str| m.starts_with("synthetic:") || std::path::Path::new(m).is_dir();
    match named.iter().collect::<Vec<_>>().as_slice() {
        [one] if loadable(one) => {
            eprintln!("audit: reference model `{one}`, as the traffic names it");
            Ok(one.to_string())
        }
        [] => anyhow::bail!(
            "{}: no request names a model; pass --model DIR (the model the upstream serves)",
            path.display()
        ),
        names => anyhow::bail!(
            "{}: the requests name the model{} {}, which {} not a model directory here or `synthetic:…`; pass --model DIR (the model the upstream serves, e.g. lmrr's import of its GGUF)",
            path.display(),
            if names.len() > 1 { "s" } else { "" },
            names
                .iter()
                .map(|n| format!("`{n}`"))
                .collect::<Vec<_>>()
                .join(", "),
            if names.len() > 1 { "are" } else { "is" }
        ),
    }
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
