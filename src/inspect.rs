//! `lmrr inspect`: a bundle's manifest, counts, size and integrity, as text
//! or JSON, for both kinds of bundle. A session bundle can also become an
//! HTML timeline or a session script; a traffic bundle (`lmrr proxy`) is
//! listed request by request.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};

use lmrr_recorder::Summary;
use lmrr_replays::report::plural;
use lmrr_serve::traffic_summary::TrafficSummary;

#[derive(clap::Args, Debug)]
pub struct InspectArgs {
    /// The bundle.
    pub bundle: PathBuf,
    /// Print JSON (manifest and summary) instead of text.
    #[arg(long)]
    json: bool,
    /// Also write the bundle's timeline as one self-contained HTML page.
    #[arg(long, value_name = "OUT.html")]
    html: Option<PathBuf>,
    /// Also write the session as a script for `lmrr run --script`.
    #[arg(long, value_name = "OUT.toml")]
    script: Option<PathBuf>,
    /// The model for `--script`'s prompt texts (default: the bundle's
    /// synthetic model; token ids without one).
    #[arg(long)]
    model: Option<String>,
}

pub fn run(a: &InspectArgs) -> Result<()> {
    let b = match lmrr_recorder::open(&a.bundle) {
        Err(lmrr_recorder::BundleError::WrongKind { found, .. })
            if found == <lmrr_recorder::format::Traffic as lmrr_recorder::Kind>::WHAT =>
        {
            return traffic(a);
        }
        _ => crate::open_bundle(&a.bundle)?,
    };
    let s = Summary::of(&b);
    if let Some(out) = &a.script {
        crate::serve::write_script(&b, &a.bundle, a.model.as_deref(), out)?;
    }
    if let Some(p) = &a.html {
        let cmd = format!("lmrr inspect {}", a.bundle.display());
        let data =
            lmrr_replays::html::ReportData::inspect(&b, &a.bundle.display().to_string(), &cmd);
        std::fs::write(p, data.to_html()?)
            .with_context(|| format!("writing the HTML report {}", p.display()))?;
        eprintln!("report: {}", p.display());
    }
    let mut out = std::io::stdout().lock();
    if a.json {
        let v = serde_json::json!({ "manifest": b.manifest, "summary": s });
        writeln!(out, "{}", serde_json::to_string_pretty(&v)?)?;
        return Ok(());
    }
    let m = &b.manifest;
    writeln!(out, "bundle      {}", a.bundle.display())?;
    writeln!(
        out,
        "format      v{} · contract v{} · lmrr {} ({})",
        m.format_version, m.contract_version, m.tool_version, m.git_revision
    )?;
    writeln!(out, "model       {} · {}", m.model.origin, m.model.identity)?;
    writeln!(
        out,
        "engine      page size {} · pool {} pages · {} tokens/step · prefix cache {}",
        m.engine.page_size,
        m.engine.pool_pages,
        m.engine.max_batch_tokens,
        if m.engine.prefix_cache { "on" } else { "off" }
    )?;
    if let Some(c) = lmrr_replays::pd::pd_config(&b) {
        let d = &c.decode;
        writeln!(
            out,
            "deployment  disaggregated: the engine above prefills; decode engine page size {} · pool {} pages · {} tokens/step · prefix cache {} · link {} pages/step",
            d.page_size,
            d.pool_pages,
            d.max_batch_tokens,
            if d.prefix_cache { "on" } else { "off" },
            c.transfer_pages_per_step
        )?;
    }
    writeln!(
        out,
        "patches     {}",
        if m.patches.is_empty() {
            "none".to_string()
        } else {
            m.patches.join(",")
        }
    )?;
    writeln!(out, "numerics    {}", m.numerics)?;
    writeln!(
        out,
        "tp          {} (the degree it was recorded at; any degree replays it bit for bit)",
        plural(m.tp_degree, "rank")
    )?;
    writeln!(
        out,
        "host        {} {} · {} · {} · {}",
        m.host.os,
        m.host.arch,
        m.host.isa,
        m.host.cpu,
        plural(m.threads, "thread")
    )?;
    writeln!(out, "session     {}", m.source.script_path)?;
    writeln!(
        out,
        "counts      {} · {} · {} · {} · {}",
        plural(s.requests as u64, "request"),
        plural(s.turns as u64, "follow-up turn"),
        plural(s.interrupts as u64, "interrupt"),
        plural(s.preemptions as u64, "preemption"),
        plural(s.steps as u64, "step")
    )?;
    writeln!(
        out,
        "tokens      {} prompt · {} generated",
        s.prompt_tokens, s.generated_tokens
    )?;
    writeln!(
        out,
        "size        {} bytes in {} frames · {:.2} bytes/token · token data {} bytes ({:.2}/token) · hashes {} bytes",
        s.bytes, s.frames, s.bytes_per_token, s.token_data_bytes, s.token_data_bytes_per_token, s.hash_bytes
    )?;
    writeln!(out, "integrity   {}", s.integrity)?;
    Ok(())
}

/// A traffic bundle: its manifest, then one line per request.
fn traffic(a: &InspectArgs) -> Result<()> {
    if a.html.is_some() || a.script.is_some() {
        bail!(
            "{} is a traffic bundle (`lmrr proxy`): --html and --script need a session bundle; `lmrr audit {}` checks its answers",
            a.bundle.display(),
            a.bundle.display()
        );
    }
    let b = lmrr_recorder::traffic::open(&a.bundle)
        .with_context(|| format!("reading traffic bundle {}", a.bundle.display()))?;
    let s = TrafficSummary::of(&b);
    let mut out = std::io::stdout().lock();
    if a.json {
        let v = serde_json::json!({ "manifest": b.manifest, "summary": s });
        writeln!(out, "{}", serde_json::to_string_pretty(&v)?)?;
        return Ok(());
    }
    let m = &b.manifest;
    writeln!(out, "traffic     {}", a.bundle.display())?;
    writeln!(
        out,
        "format      v{} · traffic v{} · lmrr {} ({})",
        m.format_version, m.traffic_version, m.tool_version, m.git_revision
    )?;
    writeln!(
        out,
        "upstream    {} · listened on {} · requests from {}",
        m.upstream, m.listen, m.origin
    )?;
    writeln!(
        out,
        "logprobs    {}",
        if m.top_logprobs == 0 {
            "not asked for clients that did not ask".to_string()
        } else {
            format!("top {} asked for clients that did not ask", m.top_logprobs)
        }
    )?;
    writeln!(
        out,
        "counts      {} ({} streamed) · {} complete · {} client gone · {} upstream failed · {} unfinished",
        plural(s.requests as u64, "request"),
        s.streamed,
        s.complete,
        s.client_gone,
        s.upstream_failed,
        s.unfinished
    )?;
    writeln!(
        out,
        "size        {} bytes of request bodies · {} in {} bytes",
        s.body_bytes,
        plural(s.chunks as u64, "chunk"),
        s.chunk_bytes
    )?;
    writeln!(out, "integrity   {}", s.integrity)?;
    writeln!(out)?;
    writeln!(
        out,
        "{:>4}  {:<22} {:<16} {:>6} {:>6} {:>6} {:>9}  outcome",
        "id", "path", "model", "stream", "status", "chunks", "ms"
    )?;
    for r in &s.list {
        let mut outcome = r.outcome.clone();
        if r.outcome == "client gone" {
            if let Some(n) = r.chunks_delivered {
                outcome = format!("{outcome} after {}", plural(n as u64, "chunk"));
            }
        }
        if let Some(n) = r.messages {
            outcome = format!("{outcome} · {}", plural(n as u64, "message"));
        }
        writeln!(
            out,
            "{:>4}  {:<22} {:<16} {:>6} {:>6} {:>6} {:>9}  {}",
            r.id,
            r.path,
            r.model.as_deref().unwrap_or("-"),
            if r.stream { "yes" } else { "no" },
            r.status.map_or("-".into(), |s| s.to_string()),
            r.chunks,
            r.duration_us
                .map_or("-".into(), |d| format!("{:.1}", d as f64 / 1000.0)),
            outcome
        )?;
    }
    Ok(())
}
