//! HTTP: routes, authentication, body limit, request → submission. No
//! engine logic: handlers validate
//! (`api`), render and tokenize (`template`), then talk to the engine loop
//! through channels (`engine`).
//!
//! OpenAI's response bodies and SSE framing are [`crate::response`]'s.
//!
//! Headers are sent when the engine has taken the request (its arrival), so
//! a request the engine refuses still gets a proper status. Each response
//! names its request in the bundle: `x-lmrr-request` and `x-lmrr-bundle`
//! headers, and an `lmrr` object (request, bundle, digest) next to `usage`.
//! Dropping the response body — the client closing the connection or the
//! stream — drops the update channel's receiver, which the engine loop sees
//! at its next step boundary and turns into an interrupt.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use futures_util::StreamExt;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use lmrr_engine::{Model, SamplingParams};

use crate::api::{self, GenParams, Prompt};
use crate::engine::{net, EngineHandle, Kind, Submission, Update};
use crate::error::ApiError;
use crate::response::Meta;
use crate::template::Renderer;

/// Largest request body, bytes (tens of KB of tools fit many times over).
pub const BODY_LIMIT: usize = 4 << 20;

/// Shared by every handler.
pub struct App {
    pub model: Arc<Model>,
    pub model_name: String,
    pub api_key: Option<String>,
    pub renderer: Renderer,
    pub engine: EngineHandle,
    pub body_limit: usize,
    /// `system_fingerprint` of responses: contract version and patches.
    pub fingerprint: String,
    /// Unix time the server started (`created` of `/v1/models`).
    pub started: u64,
    /// Every token's raw bytes, by id ([`lmrr_engine::Tokenizer::byte_table`],
    /// built once at start: it walks the vocabulary).
    pub token_bytes: Vec<Vec<u8>>,
}

pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model_info))
        .route("/health", get(health))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(app)
}

async fn not_found() -> ApiError {
    ApiError::not_found("no such endpoint (POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health)")
}

async fn method_not_allowed() -> Response {
    let mut e = ApiError::not_found("method not allowed on this endpoint").into_response();
    *e.status_mut() = StatusCode::METHOD_NOT_ALLOWED;
    e
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Compares without an early exit on the first differing byte.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn authorize(app: &App, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = &app.api_key else {
        return Ok(());
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    match given {
        Some(g) if same_secret(g.as_bytes(), key.as_bytes()) => Ok(()),
        Some(_) => Err(ApiError::unauthorized("incorrect API key")),
        None => Err(ApiError::unauthorized(
            "missing API key: send `Authorization: Bearer KEY`",
        )),
    }
}

/// The body, refused with 413 past the limit (before reading it whole when
/// `Content-Length` says so).
async fn read_body(headers: &HeaderMap, body: Body, limit: usize) -> Result<Bytes, ApiError> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(ApiError::too_large(limit));
    }
    let mut stream = body.into_data_stream();
    let mut buf = Vec::new();
    while let Some(chunk) = stream.next().await {
        let chunk =
            chunk.map_err(|e| ApiError::bad_request(format!("reading the request body: {e}")))?;
        if buf.len() + chunk.len() > limit {
            return Err(ApiError::too_large(limit));
        }
        buf.extend_from_slice(&chunk);
    }
    Ok(Bytes::from(buf))
}

fn check_model(app: &App, model: &str) -> Result<(), ApiError> {
    if model == app.model_name {
        Ok(())
    } else {
        Err(ApiError::invalid(
            "model",
            format!(
                "unknown model \"{model}\": this server serves \"{}\" (GET /v1/models)",
                app.model_name
            ),
        )
        .with_code("model_not_found"))
    }
}

/// Prompt length against the context, and `max_tokens` clamped to what is
/// left: a prompt of `p` tokens can grow by `context + 1 - p` (the last
/// token sampled needs no KV position).
fn fit(
    app: &App,
    prompt_len: usize,
    gen: &GenParams,
    param: &str,
) -> Result<(usize, bool), ApiError> {
    let context = net(&app.model).context();
    if prompt_len == 0 {
        return Err(ApiError::invalid(param, "the prompt is empty (0 tokens)"));
    }
    if prompt_len > context {
        return Err(ApiError::invalid(
            param,
            format!(
                "the prompt is {prompt_len} tokens, the model's context is {context}: shorten it by {}",
                prompt_len - context
            ),
        )
        .with_code("context_length_exceeded"));
    }
    let room = context + 1 - prompt_len;
    Ok(match gen.max_tokens {
        Some(n) if n > room => (room, true),
        Some(n) => (n, false),
        None => (room, false),
    })
}

/// Renders and tokenizes off the async workers (a 30 KB tool list is a few
/// milliseconds of CPU).
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::server(format!("worker failed: {e}")))?
}

struct Prepared {
    prompt: Vec<u32>,
    max_tokens: usize,
    clamped: bool,
}

fn submit(
    app: &App,
    kind: Kind,
    p: Prepared,
    gen: &GenParams,
) -> Result<mpsc::Receiver<Update>, ApiError> {
    let (tx, rx) = mpsc::channel(Submission::channel_capacity(p.max_tokens));
    app.engine.submit(Submission {
        kind,
        prompt: p.prompt,
        sampling: SamplingParams {
            temperature: gen.temperature,
            top_k: gen.top_k,
            top_p: gen.top_p,
            seed: 0,
        },
        seed: gen.seed,
        max_tokens: p.max_tokens,
        stop_at_eos: !gen.ignore_eos,
        stop: gen.stop.clone(),
        clamped: p.clamped,
        logprobs: gen.logprobs,
        updates: tx,
    })?;
    Ok(rx)
}

/// Waits for the engine to take the request.
async fn started(rx: &mut mpsc::Receiver<Update>) -> Result<(String, Option<String>), ApiError> {
    match rx.recv().await {
        Some(Update::Started { name, bundle, .. }) => Ok((name, bundle)),
        Some(Update::Failed(e)) => Err(e),
        Some(other) => Err(ApiError::server(format!(
            "the engine answered {other:?} before starting the request"
        ))),
        None => Err(ApiError::server("the engine loop stopped")),
    }
}

async fn chat(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    match chat_inner(app, headers, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn chat_inner(app: Arc<App>, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    authorize(&app, &headers)?;
    let bytes = read_body(&headers, body, app.body_limit).await?;
    let req = api::parse_chat(&bytes)?;
    check_model(&app, &req.model)?;
    let a = app.clone();
    let (req, prepared, warnings) = blocking(move || {
        let r = a
            .renderer
            .render(&req.messages, req.tools.as_ref(), req.tool_choice.as_ref())?;
        let prompt = a
            .model
            .tokenizer
            .encode(&r.text)
            .map_err(|e| ApiError::server(e.to_string()))?;
        let (max_tokens, clamped) = fit(&a, prompt.len(), &req.gen, "messages")?;
        Ok((
            req,
            Prepared {
                prompt,
                max_tokens,
                clamped,
            },
            r.warnings,
        ))
    })
    .await?;
    let mut rx = submit(&app, Kind::Chat, prepared, &req.gen)?;
    let (name, bundle) = started(&mut rx).await?;
    for w in warnings {
        eprintln!("lmrr serve: {name}: warning: {w}");
    }
    let meta = Meta {
        app: app.clone(),
        name,
        bundle,
        created: now(),
        kind: Kind::Chat,
        logprobs: req.gen.logprobs.is_some(),
        tools: req
            .tools
            .as_ref()
            .filter(|_| req.tool_choice.as_ref().and_then(Value::as_str) != Some("none"))
            .map(crate::tools::names),
    };
    if req.stream {
        Ok(meta.stream(rx, req.include_usage))
    } else {
        meta.whole(rx).await
    }
}

async fn completions(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    match completions_inner(app, headers, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn completions_inner(
    app: Arc<App>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    authorize(&app, &headers)?;
    let bytes = read_body(&headers, body, app.body_limit).await?;
    let req = api::parse_completion(&bytes)?;
    check_model(&app, &req.model)?;
    let a = app.clone();
    let (req, prepared) = blocking(move || {
        let prompt = match &req.prompt {
            Prompt::Text(t) => a
                .model
                .tokenizer
                .encode_prompt(t)
                .map_err(|e| ApiError::server(e.to_string()))?,
            Prompt::Tokens(t) => {
                let vocab = net(&a.model).vocab_size();
                if let Some((i, &bad)) = t.iter().enumerate().find(|(_, &x)| x as usize >= vocab) {
                    return Err(ApiError::invalid(
                        format!("prompt[{i}]"),
                        format!("token id {bad} is outside the vocabulary of {vocab}"),
                    ));
                }
                t.clone()
            }
        };
        let (max_tokens, clamped) = fit(&a, prompt.len(), &req.gen, "prompt")?;
        Ok((
            req,
            Prepared {
                prompt,
                max_tokens,
                clamped,
            },
        ))
    })
    .await?;
    let mut rx = submit(&app, Kind::Completion, prepared, &req.gen)?;
    let (name, bundle) = started(&mut rx).await?;
    let meta = Meta {
        app: app.clone(),
        name,
        bundle,
        created: now(),
        kind: Kind::Completion,
        logprobs: req.gen.logprobs.is_some(),
        tools: None,
    };
    if req.stream {
        Ok(meta.stream(rx, req.include_usage))
    } else {
        meta.whole(rx).await
    }
}

async fn models(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    if let Err(e) = authorize(&app, &headers) {
        return e.into_response();
    }
    let body = json!({"object": "list", "data": [model_card(&app)]});
    (
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

fn model_card(app: &App) -> Value {
    json!({
        "id": app.model_name,
        "object": "model",
        "created": app.started,
        "owned_by": "lmrr",
        "context_length": net(&app.model).context(),
    })
}

async fn model_info(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    if let Err(e) = authorize(&app, &headers) {
        return e.into_response();
    }
    if id != app.model_name {
        return ApiError::not_found(format!("unknown model \"{id}\"")).into_response();
    }
    (
        [(header::CONTENT_TYPE, "application/json")],
        model_card(&app).to_string(),
    )
        .into_response()
}

async fn health(State(app): State<Arc<App>>) -> Response {
    use std::sync::atomic::Ordering::Relaxed;
    let s = &app.engine.stats;
    let alive = s.alive.load(Relaxed);
    let body = json!({
        "status": if alive { "ok" } else { "engine stopped" },
        "model": app.model_name,
        "requests": s.requests.load(Relaxed),
        "live": s.live.load(Relaxed),
        "steps": s.steps.load(Relaxed),
        "interrupts": s.interrupts.load(Relaxed),
        "step_ms": s.step_us.load(Relaxed) / 1000,
        "busy_ms": s.busy_us.load(Relaxed) / 1000,
    });
    let status = if alive {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// Whether `addr` may be served without an API key.
pub fn is_loopback(addr: &SocketAddr) -> bool {
    addr.ip().is_loopback()
}

/// How long a shutdown waits for open responses before closing them.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);
