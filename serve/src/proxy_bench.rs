//! `lmrr bench --proxy`: the latency `lmrr proxy` adds to each streamed
//! chunk, measured in one process against a local SSE upstream.
//!
//! The upstream streams chat chunks (with logprobs, as the proxy asks for
//! them) at a fixed interval, each stamped with the time it was written.
//! A client reads the same stream directly and through the proxy, in
//! alternating rounds, and takes each chunk's arrival time minus its stamp.
//! The proxy's cost is the difference between the two, per chunk: parsing
//! the event, recording it, stripping the logprobs the client did not ask
//! for and re-serializing it, plus the extra loopback hop.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::response::Response;
use axum::routing::post;
use axum::Router;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use crate::error::ServeError;
use crate::proxy::{self, ProxyConfig};
use crate::sse::Parser;

/// Latencies of one path, microseconds.
#[derive(Debug, Clone)]
pub struct Latencies {
    pub median_us: f64,
    pub p99_us: f64,
    pub chunks: usize,
}

/// The measurement.
#[derive(Debug, Clone)]
pub struct ProxyBench {
    pub direct: Latencies,
    pub proxied: Latencies,
    /// Median over rounds of (proxied median − direct median), microseconds.
    pub added_median_us: f64,
    pub rounds: usize,
    pub chunks_per_round: usize,
    pub interval: Duration,
}

fn quantile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * q).round() as usize]
}

async fn upstream(origin: Instant, chunks: usize, interval: Duration) -> Response {
    let s = futures_util::stream::unfold(0usize, move |i| async move {
        if i > chunks {
            return None;
        }
        if i == chunks {
            return Some((
                Ok::<Bytes, std::convert::Infallible>(Bytes::from_static(b"data: [DONE]\n\n")),
                i + 1,
            ));
        }
        tokio::time::sleep(interval).await;
        let t = origin.elapsed().as_micros() as u64;
        let c = serde_json::json!({
            "id": "bench", "object": "chat.completion.chunk", "t_us": t,
            "choices": [{"index": 0, "delta": {"content": " word"}, "finish_reason": null,
                "logprobs": {"content": [{"token": " word", "logprob": -0.25, "bytes": null,
                    "top_logprobs": [
                        {"token": " word", "logprob": -0.25, "bytes": null},
                        {"token": " term", "logprob": -1.75, "bytes": null},
                        {"token": " item", "logprob": -2.5, "bytes": null},
                        {"token": " thing", "logprob": -3.0, "bytes": null},
                        {"token": " one", "logprob": -3.5, "bytes": null}]}]}}]
        });
        Some((Ok(Bytes::from(format!("data: {c}\n\n"))), i + 1))
    });
    let mut r = Response::new(Body::from_stream(s));
    r.headers_mut().insert(
        axum::http::header::CONTENT_TYPE,
        axum::http::HeaderValue::from_static("text/event-stream"),
    );
    r
}

/// One streamed request; per-chunk latency in microseconds.
async fn stream_once(
    client: &Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
    port: u16,
    origin: Instant,
) -> Result<Vec<f64>, ServeError> {
    let body = r#"{"model":"bench","messages":[{"role":"user","content":"hi"}],"stream":true}"#;
    let req = hyper::Request::post(format!("http://127.0.0.1:{port}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .map_err(|e| ServeError::EngineLoop(e.to_string()))?;
    let resp = client
        .request(req)
        .await
        .map_err(|e| ServeError::EngineLoop(format!("bench request: {e}")))?;
    let mut body = resp.into_body();
    let mut parser = Parser::new();
    let mut out = Vec::new();
    while let Some(f) = body.frame().await {
        let f = f.map_err(|e| ServeError::EngineLoop(format!("bench stream: {e}")))?;
        let Ok(b) = f.into_data() else { continue };
        let now = origin.elapsed().as_micros() as f64;
        for ev in parser.push(&b).map_err(ServeError::EngineLoop)? {
            let Some(d) = ev.data else { continue };
            if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&d) {
                if let Some(t) = v.get("t_us").and_then(serde_json::Value::as_u64) {
                    out.push(now - t as f64);
                }
            }
        }
    }
    Ok(out)
}

/// Runs the measurement: `rounds` alternating direct/proxied streams of
/// `chunks` chunks each, one every `interval`.
pub fn bench(rounds: usize, chunks: usize, interval: Duration) -> Result<ProxyBench, ServeError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let origin = Instant::now();
        let app = Router::new().route(
            "/v1/chat/completions",
            post(move || upstream(origin, chunks, interval)),
        );
        let up = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let up_port = up.local_addr()?.port();
        tokio::spawn(async move {
            let _ = axum::serve(up, app).await;
        });
        let dir = std::env::temp_dir().join(format!("lmrr-bench-proxy-{}", std::process::id()));
        let cfg = ProxyConfig {
            upstream: format!("http://127.0.0.1:{up_port}"),
            listen: "127.0.0.1:0"
                .parse()
                .map_err(|e| ServeError::EngineLoop(format!("{e}")))?,
            record_dir: dir.clone(),
            top_logprobs: 5,
            tool_version: String::new(),
            git_revision: String::new(),
        };
        let pl = tokio::net::TcpListener::bind(cfg.listen).await?;
        let p_port = pl.local_addr()?.port();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let cfg2 = cfg.clone();
        let proxy_task = tokio::spawn(async move {
            proxy::run(&cfg2, pl, async {
                let _ = stop_rx.await;
            })
            .await
        });
        let client = Arc::new(Client::builder(TokioExecutor::new()).build_http());
        let (mut direct, mut proxied, mut added) = (Vec::new(), Vec::new(), Vec::new());
        // One warm-up of each.
        stream_once(&client, up_port, origin).await?;
        stream_once(&client, p_port, origin).await?;
        for _ in 0..rounds {
            let mut d = stream_once(&client, up_port, origin).await?;
            let mut p = stream_once(&client, p_port, origin).await?;
            added.push(quantile(&mut p.clone(), 0.5) - quantile(&mut d.clone(), 0.5));
            direct.append(&mut d);
            proxied.append(&mut p);
        }
        let _ = stop_tx.send(());
        let _ = proxy_task.await;
        let _ = std::fs::remove_dir_all(&dir);
        let lat = |v: &mut Vec<f64>| Latencies {
            chunks: v.len(),
            median_us: quantile(v, 0.5),
            p99_us: quantile(v, 0.99),
        };
        Ok(ProxyBench {
            direct: lat(&mut direct),
            proxied: lat(&mut proxied),
            added_median_us: quantile(&mut added, 0.5),
            rounds,
            chunks_per_round: chunks,
            interval,
        })
    })
}
