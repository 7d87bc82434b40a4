//! `lmrr serve`: an OpenAI-compatible HTTP server on the deterministic
//! engine that records what really happened, with client disconnects as
//! interrupts.
//!
//! Layout (after text-generation-inference's router): [`api`] parses and
//! validates request bodies, [`template`] renders chat prompts, [`server`]
//! holds routes and SSE framing, [`engine`] is the one thread that owns the
//! scheduler and the bundle, [`detok`] streams text and stop sequences,
//! [`record`] names and rotates bundles, [`script`] turns a bundle back
//! into a session script (`lmrr inspect B --script`), and [`tools`] shows an
//! answer's `<tool_call>` blocks as OpenAI's `tool_calls`.
//!
//! Invariants: nothing a client sends can panic the server (parsing is
//! property-tested; every limit is a 4xx with the numbers); the engine loop
//! never waits on a client; a bundle replays bit-exactly because arrivals
//! and interrupts are recorded at engine steps, never at wall-clock times.

pub mod api;
pub mod audit;
pub mod deploy;
pub mod detok;
pub mod engine;
pub mod error;
pub mod probe;
pub mod proxy;
pub mod proxy_bench;
pub mod record;
mod response;
pub mod script;
pub mod server;
pub mod sse;
pub mod template;
pub mod tools;
pub mod traffic_summary;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use lmrr_engine::{EngineConfig, Model, PatchSet};
use lmrr_kernels::Threads;
use lmrr_recorder::Manifest;

pub use error::{ApiError, ServeError};
pub use record::Rotation;

/// How to serve.
pub struct ServeConfig {
    pub addr: SocketAddr,
    /// Required to bind a non-loopback address.
    pub api_key: Option<String>,
    /// The name clients send as `model`.
    pub model_name: String,
    pub engine: EngineConfig,
    pub threads: Threads,
    pub patches: PatchSet,
    /// Record into this directory; `manifest` is the template every bundle
    /// starts from.
    pub record_dir: Option<PathBuf>,
    pub rotation: Rotation,
    pub manifest: Option<Manifest>,
    /// Submissions the engine's inbox holds before answering 503.
    pub queue: usize,
    pub body_limit: usize,
    /// One log line per finished request.
    pub log_requests: bool,
    /// Serve from a disaggregated deployment: `engine` is the prefill
    /// engine; this the decode engine and the link.
    pub disaggregate: Option<lmrr_engine::PdConfig>,
}

/// Runs the server until SIGINT or SIGTERM; returns once the bundle is
/// complete.
pub fn serve(model: Model, cfg: ServeConfig) -> Result<(), ServeError> {
    if cfg.api_key.is_none() && !server::is_loopback(&cfg.addr) {
        return Err(ServeError::NeedsApiKey { addr: cfg.addr });
    }
    if cfg.api_key.as_deref().is_some_and(str::is_empty) {
        return Err(ServeError::Option {
            name: "--api-key",
            value: "\"\"".into(),
            why: "an empty key authorizes nothing".into(),
        });
    }
    let renderer = template::Renderer::new(&model).map_err(|why| ServeError::Option {
        name: "--model",
        value: model.origin.clone(),
        why,
    })?;
    let token_bytes = model.tokenizer.byte_table();
    let model = Arc::new(model);
    let record = match (&cfg.record_dir, cfg.manifest) {
        (Some(dir), Some(m)) => Some((record::BundleDir::new(dir)?, cfg.rotation.clone(), m)),
        (Some(_), None) => {
            return Err(ServeError::Option {
                name: "--record-dir",
                value: "set".into(),
                why: "recording needs a manifest".into(),
            })
        }
        _ => None,
    };
    let fingerprint = format!(
        "lmrr-c{}{}",
        lmrr_kernels::CONTRACT_VERSION,
        if cfg.patches.names().is_empty() {
            String::new()
        } else {
            format!("+{}", cfg.patches.names().join("+"))
        }
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .thread_name("lmrr-http")
        .build()?;
    let listener = rt
        .block_on(tokio::net::TcpListener::bind(cfg.addr))
        .map_err(|source| ServeError::Bind {
            addr: cfg.addr,
            source,
        })?;
    let local = listener.local_addr()?;
    let (handle, join) = engine::spawn(engine::EngineSetup {
        model: model.clone(),
        engine: cfg.engine,
        threads: cfg.threads,
        patches: cfg.patches,
        record,
        queue: cfg.queue,
        log_requests: cfg.log_requests,
        pd: cfg.disaggregate,
    })?;
    let app = Arc::new(server::App {
        model,
        model_name: cfg.model_name.clone(),
        api_key: cfg.api_key,
        renderer,
        engine: handle.clone(),
        body_limit: cfg.body_limit,
        fingerprint,
        started: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        token_bytes,
    });
    eprintln!(
        "lmrr serve: listening on http://{local} · model \"{}\" · page size {} · pool {} pages · {} tokens/step{}",
        cfg.model_name,
        cfg.engine.page_size,
        cfg.engine.pool_pages,
        cfg.engine.max_batch_tokens,
        cfg.disaggregate.map_or(String::new(), |c| format!(
            " · disaggregated: that is the prefill engine; decode engine page size {} · pool {} pages · {} tokens/step · link {} pages/step",
            c.decode.page_size,
            c.decode.pool_pages,
            c.decode.max_batch_tokens,
            c.transfer_pages_per_step
        ))
    );
    let h2 = handle.clone();
    let served: Result<(), std::io::Error> = rt.block_on(async move {
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let serve = axum::serve(listener, server::router(app)).with_graceful_shutdown(async {
            let _ = rx.await;
        });
        let mut serve = std::pin::pin!(std::future::IntoFuture::into_future(serve));
        tokio::select! {
            r = &mut serve => return r,
            s = signal() => eprintln!("lmrr serve: {s}: shutting down"),
        }
        // Open streams end (their requests are interrupted and recorded),
        // then the listener closes; a client that stopped reading gets a
        // grace period, not a veto.
        h2.shutdown();
        let _ = tx.send(());
        match tokio::time::timeout(server::SHUTDOWN_GRACE, &mut serve).await {
            Ok(r) => r,
            Err(_) => {
                eprintln!(
                    "lmrr serve: connections still open after {:?}, closing them",
                    server::SHUTDOWN_GRACE
                );
                Ok(())
            }
        }
    });
    handle.shutdown();
    let engine = join
        .join()
        .map_err(|_| ServeError::EngineLoop("the engine thread panicked".into()))?;
    rt.shutdown_timeout(std::time::Duration::from_millis(100));
    served?;
    engine
}

/// Waits for SIGINT or SIGTERM; names it.
pub(crate) async fn signal() -> &'static str {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = match signal(SignalKind::terminate()) {
            Ok(s) => s,
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
                return "SIGINT";
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => "SIGINT",
            _ = term.recv() => "SIGTERM",
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
        "Ctrl-C"
    }
}
