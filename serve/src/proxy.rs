//! `lmrr proxy`: forwards OpenAI-compatible traffic to an upstream server,
//! streams its answers back, and records both sides into a traffic bundle
//! ([`lmrr_recorder::traffic`]) for `lmrr audit`.
//!
//! What is recorded: `POST /v1/chat/completions` and `POST /v1/completions`
//! — the client's body, the body sent upstream when it differs, the status,
//! every SSE event's data as the upstream sent it (or the whole body of a
//! non-streaming answer), and how the request ended: whole, client gone
//! (with how many chunks the client had been handed), upstream unreachable,
//! upstream broken. Other paths (`/v1/models`, `/health`, …) are forwarded
//! and not recorded.
//!
//! Logprobs: when a client did not ask for them, the proxy asks the upstream
//! (chat: `logprobs: true, top_logprobs: K`; completions: `logprobs: K`) and
//! sets `logprobs` back to `null` in every choice the client receives, so the
//! audit has the upstream's own distribution while the client sees what it
//! asked for. Events of a client that asked are forwarded byte for byte.
//!
//! Failure: an unreachable upstream is a 502 in OpenAI's error shape; a
//! stream that breaks off or carries something that is not JSON ends with an
//! `error` event for the client, and the recording keeps every byte received
//! and the reason. A client that leaves closes the upstream connection (the
//! upstream sees the abort, as it would without the proxy).
//!
//! `--resend FILE` plays the client side of a recording against a (possibly
//! different) upstream through the same path: each recorded request in order,
//! one at a time, each interrupted client hanging up after as many chunks as
//! it received then.
//!
//! Invariants: nothing the client or the upstream sends panics the proxy;
//! every request that reached the proxy has an `End` event once the proxy
//! exits normally; the writer runs on its own thread and is flushed at every
//! `End`, so a killed proxy keeps every finished request.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{mpsc as std_mpsc, Arc};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, Method, Uri};
use axum::response::{IntoResponse, Response};
use axum::Router;
use futures_util::StreamExt;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;
use tokio::sync::mpsc;

use lmrr_recorder::traffic::{Outcome, TrafficEvent, TrafficManifest, TrafficWriter};

use crate::error::{ApiError, ServeError};
use crate::sse::Parser;

/// Largest client body forwarded (as `lmrr serve`'s).
pub const BODY_LIMIT: usize = crate::server::BODY_LIMIT;
/// Largest non-streaming upstream body kept.
pub const UPSTREAM_BODY_LIMIT: usize = 64 << 20;
/// How long connecting to the upstream may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long open streams may run on after SIGTERM.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);
/// Chunks buffered between the upstream reader and the client.
const CLIENT_BUFFER: usize = 4;

/// How to proxy.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    /// `http://host:port` of the upstream.
    pub upstream: String,
    pub listen: SocketAddr,
    pub record_dir: PathBuf,
    /// Alternatives per token asked of the upstream for clients that did not
    /// ask for logprobs (0: do not ask; OpenAI allows up to 20, its legacy
    /// completions endpoint 5).
    pub top_logprobs: u32,
    pub tool_version: String,
    pub git_revision: String,
}

/// The upstream's base URL, checked.
#[derive(Debug, Clone)]
pub struct Upstream {
    /// `scheme://authority`, no trailing slash.
    pub base: String,
}

impl Upstream {
    /// Parses `http://host:port` (a trailing `/` allowed; no other path).
    pub fn parse(url: &str) -> Result<Self, ServeError> {
        let bad = |why: &str| ServeError::Option {
            name: "--upstream",
            value: url.to_string(),
            why: why.to_string(),
        };
        let uri: Uri = url.parse().map_err(|e| bad(&format!("not a URL: {e}")))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some("https") => {
                return Err(bad(
                    "https upstreams are not supported: run the proxy next to the server and give its http address",
                ))
            }
            _ => return Err(bad("expected http://host:port")),
        }
        let authority = uri
            .authority()
            .ok_or_else(|| bad("expected http://host:port"))?;
        if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
            return Err(bad(&format!(
                "the upstream is a server's root; request paths (/v1/…) are forwarded as sent, so drop `{}`",
                uri.path()
            )));
        }
        Ok(Self {
            base: format!("http://{authority}"),
        })
    }

    fn uri(&self, path_and_query: &str) -> Result<Uri, String> {
        format!("{}{path_and_query}", self.base)
            .parse()
            .map_err(|e| format!("{e}"))
    }
}

/// Shared by every handler.
pub struct Proxy {
    upstream: Upstream,
    client: Client<HttpConnector, Full<Bytes>>,
    rec: std_mpsc::Sender<Msg>,
    next_id: AtomicU64,
    t0: Instant,
    top_logprobs: u32,
}

impl Proxy {
    fn now_us(&self) -> u64 {
        self.t0.elapsed().as_micros() as u64
    }

    fn record(&self, e: TrafficEvent) {
        // After the writer closed (shutdown past its grace period) events
        // are dropped: those requests have no `End` in the bundle.
        let _ = self.rec.send(Msg::Event(e));
    }
}

/// What the writer thread receives.
enum Msg {
    Event(TrafficEvent),
    /// Finish the bundle now, whoever still holds a sender.
    Close,
}

/// The writer thread: events in, a traffic bundle out.
pub struct Recording {
    tx: std_mpsc::Sender<Msg>,
    join: std::thread::JoinHandle<Result<(PathBuf, u64), ServeError>>,
    pub path: PathBuf,
}

impl Recording {
    /// Creates `dir/lmrr-traffic-<UTC>-<pid>.lmrr` and its writer thread.
    pub fn start(dir: &Path, manifest: &TrafficManifest) -> Result<Self, ServeError> {
        std::fs::create_dir_all(dir).map_err(|source| ServeError::RecordDir {
            path: dir.into(),
            source,
        })?;
        let secs = manifest.started_unix_ms / 1000;
        let mut path = dir.join(format!(
            "lmrr-traffic-{}-{}.lmrr",
            crate::record::utc_stamp(secs),
            std::process::id()
        ));
        let mut n = 1;
        while path.exists() {
            n += 1;
            path = dir.join(format!(
                "lmrr-traffic-{}-{}-{n}.lmrr",
                crate::record::utc_stamp(secs),
                std::process::id()
            ));
        }
        let f = std::fs::File::create(&path).map_err(|source| ServeError::RecordDir {
            path: path.clone(),
            source,
        })?;
        let mut w = TrafficWriter::new(std::io::BufWriter::new(f), manifest, 1)?;
        let (tx, rx) = std_mpsc::channel::<Msg>();
        let p2 = path.clone();
        let join = std::thread::Builder::new()
            .name("lmrr-traffic".into())
            .spawn(move || {
                let mut requests = 0;
                for m in rx {
                    let Msg::Event(e) = m else { break };
                    if e.ends_request() {
                        requests += 1;
                    }
                    w.push(e)?;
                }
                let f = w
                    .finish()?
                    .into_inner()
                    .map_err(|e| ServeError::Io(e.into_error()))?;
                f.sync_all()?;
                Ok((p2, requests))
            })?;
        Ok(Self { tx, join, path })
    }

    /// Closes the bundle (events sent after this are dropped); returns its
    /// path and the number of requests recorded.
    pub fn finish(self) -> Result<(PathBuf, u64), ServeError> {
        let _ = self.tx.send(Msg::Close);
        self.join
            .join()
            .map_err(|_| ServeError::EngineLoop("the traffic writer panicked".into()))?
    }
}

/// Builds the shared state.
pub fn state(cfg: &ProxyConfig, rec: &Recording) -> Result<Arc<Proxy>, ServeError> {
    let upstream = Upstream::parse(&cfg.upstream)?;
    let mut conn = HttpConnector::new();
    conn.set_connect_timeout(Some(CONNECT_TIMEOUT));
    conn.set_nodelay(true);
    let client = Client::builder(TokioExecutor::new()).build(conn);
    Ok(Arc::new(Proxy {
        upstream,
        client,
        rec: rec.tx.clone(),
        next_id: AtomicU64::new(0),
        t0: Instant::now(),
        top_logprobs: cfg.top_logprobs,
    }))
}

pub fn router(p: Arc<Proxy>) -> Router {
    Router::new().fallback(handle).with_state(p)
}

fn recorded_path(method: &Method, path: &str) -> bool {
    method == Method::POST && matches!(path, "/v1/chat/completions" | "/v1/completions")
}

async fn handle(
    State(p): State<Arc<Proxy>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let path = uri
        .path_and_query()
        .map_or_else(|| uri.path().to_string(), |pq| pq.as_str().to_string());
    let body = match axum::body::to_bytes(body, BODY_LIMIT).await {
        Ok(b) => b,
        Err(_) => return ApiError::too_large(BODY_LIMIT).into_response(),
    };
    if recorded_path(&method, uri.path()) {
        forward_recorded(p, method, path, headers, body).await
    } else {
        forward_plain(p, method, path, headers, body).await
    }
}

/// Headers passed to the upstream.
const FORWARDED: [header::HeaderName; 4] = [
    header::AUTHORIZATION,
    header::CONTENT_TYPE,
    header::ACCEPT,
    header::USER_AGENT,
];

fn upstream_request(
    p: &Proxy,
    method: &Method,
    path: &str,
    headers: &HeaderMap,
    body: Bytes,
) -> Result<hyper::Request<Full<Bytes>>, ApiError> {
    let uri = p
        .upstream
        .uri(path)
        .map_err(|e| ApiError::bad_request(format!("path {path:?}: {e}")))?;
    let mut b = hyper::Request::builder().method(method.clone()).uri(uri);
    for h in &FORWARDED {
        for v in headers.get_all(h) {
            b = b.header(h, v);
        }
    }
    b.body(Full::new(body))
        .map_err(|e| ApiError::bad_request(format!("request: {e}")))
}

fn bad_gateway(p: &Proxy, what: &str) -> ApiError {
    ApiError {
        status: 502,
        kind: "upstream_error",
        message: format!("upstream {}: {what}", p.upstream.base),
        param: None,
        code: Some("bad_gateway"),
    }
}

/// Not recorded: passed through, streaming included.
async fn forward_plain(
    p: Arc<Proxy>,
    method: Method,
    path: String,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let req = match upstream_request(&p, &method, &path, &headers, body) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    match p.client.request(req).await {
        Err(e) => bad_gateway(&p, &format!("unreachable: {}", error_chain(&e))).into_response(),
        Ok(resp) => {
            let (parts, body) = resp.into_parts();
            let mut r = Response::new(Body::new(body));
            *r.status_mut() = parts.status;
            if let Some(ct) = parts.headers.get(header::CONTENT_TYPE) {
                r.headers_mut().insert(header::CONTENT_TYPE, ct.clone());
            }
            r
        }
    }
}

/// An error and its sources on one line.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// The body to send upstream when the client did not ask for logprobs, and
/// whether the proxy must strip them from what the client sees.
pub fn ask_logprobs(path: &str, body: &[u8], k: u32) -> Option<Vec<u8>> {
    if k == 0 {
        return None;
    }
    let Ok(Value::Object(mut m)) = serde_json::from_slice::<Value>(body) else {
        return None;
    };
    let chat = path.starts_with("/v1/chat/completions");
    let asked = match m.get("logprobs") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(_) => true,
    };
    if asked {
        return None;
    }
    if chat {
        m.insert("logprobs".into(), Value::Bool(true));
        m.insert("top_logprobs".into(), Value::from(k.min(20)));
    } else {
        m.insert("logprobs".into(), Value::from(k.min(5)));
    }
    serde_json::to_vec(&Value::Object(m)).ok()
}

/// Sets `logprobs` to `null` in every choice of a chunk or body.
pub fn strip_logprobs(v: &mut Value) {
    if let Some(Value::Array(choices)) = v.get_mut("choices") {
        for c in choices {
            if let Some(lp) = c.get_mut("logprobs") {
                *lp = Value::Null;
            }
        }
    }
}

/// The client's side of a stream: items are `(bytes, is_chunk)`. Counts the
/// chunks handed to the connection; `gone` fires when the body is finished
/// or dropped (the client read it all, or left).
fn counted_body(
    rx: mpsc::Receiver<(Bytes, bool)>,
    yielded: Arc<AtomicU32>,
    gone: tokio::sync::oneshot::Sender<()>,
) -> Body {
    let s = futures_util::stream::unfold((rx, gone), |(mut rx, gone)| async move {
        rx.recv().await.map(|item| (item, (rx, gone)))
    })
    .map(move |(b, is_chunk)| {
        if is_chunk {
            yielded.fetch_add(1, Ordering::Relaxed);
        }
        Ok::<Bytes, std::convert::Infallible>(b)
    });
    Body::from_stream(s)
}

fn error_event(message: &str) -> Bytes {
    let v = serde_json::json!({
        "error": {"message": message, "type": "upstream_error", "param": null, "code": "bad_gateway"}
    });
    Bytes::from(format!("data: {v}\n\n"))
}

async fn forward_recorded(
    p: Arc<Proxy>,
    method: Method,
    path: String,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let id = p.next_id.fetch_add(1, Ordering::Relaxed);
    let upstream_body = ask_logprobs(&path, &body, p.top_logprobs);
    let strip = upstream_body.is_some();
    p.record(TrafficEvent::Request {
        id,
        at_us: p.now_us(),
        method: method.to_string(),
        path: path.clone(),
        body: body.to_vec(),
        upstream_body: upstream_body.clone(),
    });
    let end = |outcome: Outcome, chunks_delivered: u32| TrafficEvent::End {
        id,
        at_us: p.now_us(),
        outcome,
        chunks_delivered,
    };
    let sent = upstream_body.map_or(body, Bytes::from);
    let req = match upstream_request(&p, &method, &path, &headers, sent) {
        Ok(r) => r,
        Err(e) => {
            p.record(end(
                Outcome::UpstreamBroken {
                    error: e.message.clone(),
                },
                0,
            ));
            return e.into_response();
        }
    };
    let resp = match p.client.request(req).await {
        Ok(r) => r,
        Err(e) => {
            let why = format!("unreachable: {}", error_chain(&e));
            p.record(end(Outcome::UpstreamUnreachable { error: why.clone() }, 0));
            return bad_gateway(&p, &why).into_response();
        }
    };
    let (parts, mut up) = resp.into_parts();
    let content_type = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    p.record(TrafficEvent::Response {
        id,
        at_us: p.now_us(),
        status: parts.status.as_u16(),
        content_type: content_type.clone(),
    });
    if !content_type.starts_with("text/event-stream") {
        // Whole body: read, record, strip, answer.
        let whole = match http_body_util::Limited::new(up, UPSTREAM_BODY_LIMIT)
            .collect()
            .await
        {
            Ok(c) => c.to_bytes(),
            Err(e) => {
                let why = format!("body: {e}");
                p.record(end(Outcome::UpstreamBroken { error: why.clone() }, 0));
                return bad_gateway(&p, &why).into_response();
            }
        };
        p.record(TrafficEvent::Chunk {
            id,
            at_us: p.now_us(),
            data: whole.to_vec(),
        });
        let out = if strip && parts.status.is_success() {
            match serde_json::from_slice::<Value>(&whole) {
                Ok(mut v) => {
                    strip_logprobs(&mut v);
                    Bytes::from(v.to_string())
                }
                Err(e) => {
                    let why = format!("a {} body that is not JSON: {e}", parts.status.as_u16());
                    p.record(end(Outcome::UpstreamBroken { error: why.clone() }, 0));
                    return bad_gateway(&p, &why).into_response();
                }
            }
        } else {
            whole
        };
        p.record(end(Outcome::Complete, 1));
        let mut r = Response::new(Body::from(out));
        *r.status_mut() = parts.status;
        if let Ok(ct) = HeaderValue::from_str(&content_type) {
            r.headers_mut().insert(header::CONTENT_TYPE, ct);
        }
        return r;
    }

    // Streaming: a task reads the upstream, records, and feeds the client.
    let (tx, rx) = mpsc::channel::<(Bytes, bool)>(CLIENT_BUFFER);
    let (gone_tx, gone_rx) = tokio::sync::oneshot::channel::<()>();
    let yielded = Arc::new(AtomicU32::new(0));
    let y2 = yielded.clone();
    let p2 = p.clone();
    tokio::spawn(async move {
        let p = p2;
        let mut parser = Parser::new();
        let mut chunks: u32 = 0;
        let mut done = false;
        let delivered = |chunks: u32| y2.load(Ordering::Relaxed).min(chunks);
        let fail = |error: String| Outcome::UpstreamBroken { error };
        let outcome = 'read: loop {
            let frame = tokio::select! {
                f = up.frame() => f,
                _ = tx.closed() => break 'read Outcome::ClientGone,
            };
            let bytes = match frame {
                None => {
                    let rest = parser.rest().len();
                    if rest > 0 && !parser.rest().iter().all(|c| c.is_ascii_whitespace()) {
                        let why = format!(
                            "the stream ended inside an event ({rest} bytes after chunk {chunks})"
                        );
                        let _ = tx.send((error_event(&why), false)).await;
                        break fail(why);
                    }
                    if !done {
                        let why = format!("the stream ended after {chunks} chunks without [DONE]");
                        break fail(why);
                    }
                    break Outcome::Complete;
                }
                Some(Err(e)) => {
                    let why = format!(
                        "reading the stream after {chunks} chunks: {}",
                        error_chain(&e)
                    );
                    let _ = tx.send((error_event(&why), false)).await;
                    break fail(why);
                }
                Some(Ok(f)) => match f.into_data() {
                    Ok(b) => b,
                    Err(_) => continue, // trailers
                },
            };
            let events = match parser.push(&bytes) {
                Ok(ev) => ev,
                Err(why) => {
                    let _ = tx.send((error_event(&why), false)).await;
                    break fail(why);
                }
            };
            for ev in events {
                let is_chunk = ev.data.is_some();
                let out = match &ev.data {
                    None => Bytes::from(ev.raw),
                    Some(data) => {
                        p.record(TrafficEvent::Chunk {
                            id,
                            at_us: p.now_us(),
                            data: data.clone(),
                        });
                        chunks += 1;
                        if data.as_slice() == b"[DONE]" {
                            done = true;
                            Bytes::from(ev.raw)
                        } else {
                            match serde_json::from_slice::<Value>(data) {
                                Err(e) => {
                                    let why = format!("chunk {chunks} is not JSON: {e}");
                                    let _ = tx.send((error_event(&why), false)).await;
                                    break 'read fail(why);
                                }
                                Ok(mut v) if strip => {
                                    strip_logprobs(&mut v);
                                    Bytes::from(format!("data: {v}\n\n"))
                                }
                                Ok(_) => Bytes::from(ev.raw),
                            }
                        }
                    }
                };
                if tx.send((out, is_chunk)).await.is_err() {
                    break 'read Outcome::ClientGone;
                }
            }
        };
        // Wait until the client has taken what was sent (or left), so
        // `chunks_delivered` counts what it was handed.
        drop(up);
        drop(tx);
        let _ = tokio::time::timeout(Duration::from_secs(30), gone_rx).await;
        p.record(TrafficEvent::End {
            id,
            at_us: p.now_us(),
            chunks_delivered: delivered(chunks),
            outcome,
        });
    });
    let mut r = Response::new(counted_body(rx, yielded, gone_tx));
    *r.status_mut() = parts.status;
    if let Ok(ct) = HeaderValue::from_str(&content_type) {
        r.headers_mut().insert(header::CONTENT_TYPE, ct);
    }
    r.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

/// Runs the proxy on `listener` until `stop` resolves; returns the traffic
/// bundle's path and how many requests it holds.
pub async fn run(
    cfg: &ProxyConfig,
    listener: tokio::net::TcpListener,
    stop: impl std::future::Future<Output = ()>,
) -> Result<(PathBuf, u64), ServeError> {
    let upstream = Upstream::parse(&cfg.upstream)?;
    let manifest = TrafficManifest::new(
        &upstream.base,
        &listener.local_addr()?.to_string(),
        cfg.top_logprobs,
        "clients",
        &cfg.tool_version,
        &cfg.git_revision,
    );
    let rec = Recording::start(&cfg.record_dir, &manifest)?;
    let p = state(cfg, &rec)?;
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let serve = axum::serve(listener, router(p.clone())).with_graceful_shutdown(async {
        let _ = rx.await;
    });
    let mut serve = std::pin::pin!(std::future::IntoFuture::into_future(serve));
    let served = tokio::select! {
        r = &mut serve => r,
        _ = stop => {
            // Open streams may finish; a client that stopped reading gets a
            // grace period, not a veto.
            let _ = tx.send(());
            match tokio::time::timeout(SHUTDOWN_GRACE, &mut serve).await {
                Ok(r) => r,
                Err(_) => {
                    eprintln!("lmrr proxy: connections still open after {SHUTDOWN_GRACE:?}, closing them");
                    Ok(())
                }
            }
        }
    };
    // Streams still being read end with their connections; give their
    // tasks a moment to record their ends.
    let until = Instant::now() + Duration::from_secs(5);
    while Arc::strong_count(&p) > 1 && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(p);
    let out = rec.finish()?;
    served?;
    Ok(out)
}

/// Plays the client side of `traffic` against `cfg.upstream`, recording a
/// new traffic bundle: requests in their recorded order, one at a time, and
/// each request whose client left hangs up after as many chunks.
pub async fn resend(
    cfg: &ProxyConfig,
    traffic: &lmrr_recorder::traffic::TrafficBundle,
    from: &str,
) -> Result<(PathBuf, u64), ServeError> {
    let upstream = Upstream::parse(&cfg.upstream)?;
    let manifest = TrafficManifest::new(
        &upstream.base,
        "resend",
        cfg.top_logprobs,
        &format!("resend of {from}"),
        &cfg.tool_version,
        &cfg.git_revision,
    );
    let rec = Recording::start(&cfg.record_dir, &manifest)?;
    let p = state(cfg, &rec)?;
    let mut ends = std::collections::BTreeMap::new();
    for e in &traffic.events {
        if let TrafficEvent::End {
            id,
            outcome,
            chunks_delivered,
            ..
        } = e
        {
            ends.insert(*id, (outcome.clone(), *chunks_delivered));
        }
    }
    for e in &traffic.events {
        let TrafficEvent::Request {
            id,
            method,
            path,
            body,
            ..
        } = e
        else {
            continue;
        };
        let Ok(m) = Method::from_bytes(method.as_bytes()) else {
            continue;
        };
        let cut = match ends.get(id) {
            Some((Outcome::ClientGone, n)) => Some(*n),
            _ => None,
        };
        send(&p, m, path, body.clone(), cut).await;
    }
    drop(p);
    rec.finish()
}

/// One request as a client sends it through the proxy's recording path
/// (`--resend`, `lmrr probe --url`): the response's frames (a whole body,
/// or one SSE event each), the client hanging up after `cut` of them. Returns
/// once the request's end is recorded, so requests sent one after another
/// keep their order in the traffic.
pub async fn send(
    p: &Arc<Proxy>,
    method: Method,
    path: &str,
    body: Vec<u8>,
    cut: Option<u32>,
) -> Vec<Bytes> {
    let mut headers = HeaderMap::new();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    let resp = forward_recorded(
        p.clone(),
        method,
        path.to_string(),
        headers,
        Bytes::from(body),
    )
    .await;
    let mut body = resp.into_body();
    let mut frames = Vec::new();
    loop {
        if cut.is_some_and(|n| frames.len() as u32 >= n) {
            break;
        }
        match body.frame().await {
            Some(Ok(f)) => frames.push(f.into_data().unwrap_or_default()),
            _ => break,
        }
    }
    drop(body);
    // The recording task notes the hang-up; wait for it.
    let until = Instant::now() + Duration::from_secs(30);
    while Arc::strong_count(p) > 1 && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    frames
}

/// `lmrr proxy`: runs until SIGINT or SIGTERM (or, with `resend`, until the
/// recorded requests are sent); returns the traffic bundle's path and how
/// many requests it holds.
pub fn proxy(cfg: ProxyConfig, resend_from: Option<PathBuf>) -> Result<(PathBuf, u64), ServeError> {
    Upstream::parse(&cfg.upstream)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .thread_name("lmrr-proxy")
        .build()?;
    let out = if let Some(from) = resend_from {
        let traffic = lmrr_recorder::traffic::open(&from)?;
        if !matches!(traffic.integrity, lmrr_recorder::Integrity::Complete { .. }) {
            eprintln!(
                "lmrr proxy: warning: {}: {}",
                from.display(),
                traffic.integrity
            );
        }
        eprintln!(
            "lmrr proxy: resending {} ({} requests) to {}",
            from.display(),
            traffic
                .events
                .iter()
                .filter(|e| matches!(e, TrafficEvent::Request { .. }))
                .count(),
            cfg.upstream
        );
        rt.block_on(resend(&cfg, &traffic, &from.display().to_string()))?
    } else {
        let listener = rt
            .block_on(tokio::net::TcpListener::bind(cfg.listen))
            .map_err(|source| ServeError::Bind {
                addr: cfg.listen,
                source,
            })?;
        let local = listener.local_addr()?;
        eprintln!(
            "lmrr proxy: listening on http://{local} · upstream {} · recording into {}",
            cfg.upstream,
            cfg.record_dir.display()
        );
        rt.block_on(run(&cfg, listener, async {
            let s = crate::signal().await;
            eprintln!("lmrr proxy: {s}: shutting down");
        }))?
    };
    rt.shutdown_timeout(Duration::from_millis(100));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A tool-call answer, whole or streamed, reaches the client as the
    /// upstream sent it but for `logprobs`; its request keeps its tools.
    #[test]
    fn a_tool_call_answer_passes_with_only_its_logprobs_stripped() {
        let call = json!({"id": "call_c_0", "type": "function",
            "function": {"name": "f", "arguments": "{\"x\":1}"}});
        let lp = json!({"content": [{"token": "<", "logprob": -0.5, "bytes": [60], "top_logprobs": []}]});
        let mut whole = json!({"choices": [{"index": 0,
            "message": {"role": "assistant", "content": null, "tool_calls": [call]},
            "logprobs": lp, "finish_reason": "tool_calls"}]});
        let mut chunk = json!({"choices": [{"index": 0,
            "delta": {"tool_calls": [call]}, "logprobs": lp, "finish_reason": null}]});
        for v in [&mut whole, &mut chunk] {
            let mut want = v.clone();
            want["choices"][0]["logprobs"] = Value::Null;
            strip_logprobs(v);
            assert_eq!(*v, want);
        }
        let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"});
        let sent: Value = serde_json::from_slice(
            &ask_logprobs("/v1/chat/completions", body.to_string().as_bytes(), 5).unwrap(),
        )
        .unwrap();
        assert_eq!(sent["tools"], body["tools"]);
        assert_eq!(sent["tool_choice"], json!("auto"));
        assert_eq!(sent["logprobs"], json!(true));
        assert_eq!(sent["top_logprobs"], json!(5));
    }
}
