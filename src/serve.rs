//! `lmrr serve` and `lmrr inspect --script`: argument parsing and the calls
//! into `lmrr_serve`. The server itself lives in the `serve/` crate.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{Context, Result};

use lmrr_engine::{EngineConfig, Model, PatchSet};

#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// Model: an HF directory, or `synthetic:PRESET[:SEED]` (default: embedded).
    #[arg(long)]
    model: Option<String>,
    /// Address to listen on. Anything but loopback needs `--api-key`.
    #[arg(long, default_value = "127.0.0.1:8000")]
    addr: SocketAddr,
    /// Require `Authorization: Bearer KEY` on /v1/* (also read from
    /// `LMRR_API_KEY`).
    #[arg(long)]
    api_key: Option<String>,
    /// The model name clients send (default: the directory's name, or the
    /// synthetic model's name).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Record every request into bundles in this directory (see README, "Serve").
    #[arg(long)]
    record_dir: Option<PathBuf>,
    /// Start a new bundle once this many MiB are written (0 = no limit).
    #[arg(long, default_value_t = 256)]
    rotate_mib: u64,
    /// Start a new bundle after this many requests (0 = no limit).
    #[arg(long, default_value_t = 10_000)]
    rotate_requests: u64,
    /// Start a new bundle after this many seconds (0 = no limit).
    #[arg(long, default_value_t = 0)]
    rotate_secs: u64,
    /// Engine patches to run with (comma-separated; see `lmrr patches`).
    #[arg(long, default_value = "", value_parser = crate::parse_patches)]
    patches: PatchSet,
    /// Worker threads (default: all cores). Never changes a bit.
    #[arg(long)]
    threads: Option<usize>,
    /// Where the kernels run: `cpu`, or `cuda` (builds with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// The matmuls' arithmetic: `canonical` or `tensor-core-sm90` (see
    /// `lmrr run --help`); recorded in the bundle.
    #[arg(long, default_value = "canonical")]
    numerics: String,
    /// Tensor-parallel ranks: on the CPU, N ranks of the rank simulator
    /// (each holding its slice of the weights); on CUDA a degree above 1 is
    /// refused (multi-GPU needs NCCL, not built yet). Never changes a bit.
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// Positions per KV page.
    #[arg(long, default_value_t = 16)]
    page_size: usize,
    /// Pages in the KV pool (default: 4 contexts' worth, at least 256;
    /// allocated lazily).
    #[arg(long)]
    pool_pages: Option<usize>,
    /// Tokens per step (decode + chunked prefill).
    #[arg(long, default_value_t = 512)]
    max_batch_tokens: usize,
    /// Disable the radix prefix cache.
    #[arg(long)]
    no_prefix_cache: bool,
    /// Requests queued for the engine before new ones get 503.
    #[arg(long, default_value_t = 1024)]
    queue: usize,
    /// No log line per request.
    #[arg(long)]
    quiet: bool,
    #[command(flatten)]
    disagg: crate::disagg::DisaggArgs,
}

pub fn run(a: &ServeArgs) -> Result<()> {
    let mut model = crate::load_model(a.model.as_deref())?;
    crate::set_device(&mut model, &a.device)?;
    crate::set_numerics(&mut model, &a.numerics)?;
    crate::set_tp(&mut model, a.tp)?;
    let th = crate::threads(a.threads)?;
    let context = model.net.context();
    let cfg = EngineConfig {
        page_size: a.page_size,
        pool_pages: a
            .pool_pages
            .unwrap_or_else(|| (4 * context.div_ceil(a.page_size.max(1))).max(256)),
        max_batch_tokens: a.max_batch_tokens,
        prefix_cache: !a.no_prefix_cache,
    };
    let name = a.served_model_name.clone().unwrap_or_else(|| {
        match (&model.synthetic, a.model.as_deref()) {
            (Some(s), _) => s.name(),
            (None, Some(dir)) => std::path::Path::new(dir)
                .file_name()
                .map_or_else(|| dir.to_string(), |n| n.to_string_lossy().into_owned()),
            (None, None) => model.origin.clone(),
        }
    });
    let manifest = a.record_dir.as_ref().map(|dir| {
        let source = format!(
            "# Recorded live by `lmrr serve` on {}: requests arrived over HTTP.\n\
             # `lmrr inspect BUNDLE --script S.toml` writes the equivalent session script.\n",
            a.addr
        );
        crate::session_manifest(
            &model,
            cfg,
            &a.patches,
            &format!("lmrr serve {} (recording into {})", a.addr, dir.display()),
            &source,
            th.count(),
        )
    });
    let rotation = lmrr_serve::Rotation {
        max_bytes: a.rotate_mib.saturating_mul(1 << 20),
        max_requests: a.rotate_requests,
        max_age: (a.rotate_secs > 0).then(|| std::time::Duration::from_secs(a.rotate_secs)),
        ..Default::default()
    };
    lmrr_serve::serve(
        model,
        lmrr_serve::ServeConfig {
            addr: a.addr,
            api_key: a
                .api_key
                .clone()
                .or_else(|| std::env::var("LMRR_API_KEY").ok()),
            model_name: name,
            engine: cfg,
            threads: th,
            patches: a.patches.clone(),
            record_dir: a.record_dir.clone(),
            rotation,
            manifest,
            queue: a.queue,
            body_limit: lmrr_serve::server::BODY_LIMIT,
            log_requests: !a.quiet,
            disaggregate: a.disagg.config(cfg),
        },
    )?;
    Ok(())
}

/// `lmrr inspect B --script OUT`: the bundle's session as a script. Prompts
/// are text when the model (regenerated for a synthetic one, `--model` for a
/// directory) tokenizes them back to the recorded ids, token ids otherwise.
pub fn write_script(
    b: &lmrr_recorder::Bundle,
    bundle: &std::path::Path,
    model: Option<&str>,
    out: &std::path::Path,
) -> Result<()> {
    let m: Option<Model> = match (model, &b.manifest.model.synthetic) {
        (Some(spec), _) => Some(crate::load_model(Some(spec))?),
        (None, Some(s)) => {
            Some(Model::synthetic(*s).with_context(|| format!("regenerating {}", s.name()))?)
        }
        (None, None) => {
            eprintln!(
                "note: no --model given for {}: prompts are written as token ids",
                b.manifest.model.origin
            );
            None
        }
    };
    if let Some(m) = &m {
        if m.identity() != b.manifest.model.identity {
            anyhow::bail!(
                "--model {} is not the model the bundle was recorded on ({})",
                m.origin,
                b.manifest.model.origin
            );
        }
    }
    let text = lmrr_serve::script::bundle_to_script(
        b,
        m.as_ref().map(|m| &m.tokenizer),
        &bundle.display().to_string(),
    )
    .with_context(|| format!("writing {} as a script", bundle.display()))?;
    std::fs::write(out, text).with_context(|| format!("writing {}", out.display()))?;
    eprintln!("script: {}", out.display());
    Ok(())
}
