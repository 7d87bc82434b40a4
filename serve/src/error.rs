//! Errors. [`ApiError`] is what a client gets: an HTTP status and OpenAI's
//! error body (`{"error": {"message", "type", "param", "code"}}`), with the
//! offending field in `param` and the numbers in the message. [`ServeError`]
//! is what stops the server from starting or running.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

/// An error returned to a client, in OpenAI's shape.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{status} {kind}: {message}")]
pub struct ApiError {
    pub status: u16,
    /// OpenAI's `type`: `invalid_request_error`, `authentication_error`,
    /// `server_error`, …
    pub kind: &'static str,
    pub message: String,
    /// The request field at fault (`messages[2].content`), if any.
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    /// 400 naming `param`.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            status: 400,
            kind: "invalid_request_error",
            message: message.into(),
            param: Some(param.into()),
            code: None,
        }
    }

    /// 400 not tied to one field.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self {
            status: 400,
            kind: "invalid_request_error",
            message: message.into(),
            param: None,
            code: None,
        }
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self {
            status: 401,
            kind: "authentication_error",
            message: message.into(),
            param: None,
            code: Some("invalid_api_key"),
        }
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self {
            status: 404,
            kind: "invalid_request_error",
            message: message.into(),
            param: None,
            code: None,
        }
    }

    pub fn too_large(limit: usize) -> Self {
        Self {
            status: 413,
            kind: "invalid_request_error",
            message: format!("request body exceeds the limit of {limit} bytes"),
            param: None,
            code: Some("request_too_large"),
        }
    }

    pub fn overloaded(message: impl Into<String>) -> Self {
        Self {
            status: 503,
            kind: "server_error",
            message: message.into(),
            param: None,
            code: Some("overloaded"),
        }
    }

    pub fn server(message: impl Into<String>) -> Self {
        Self {
            status: 500,
            kind: "server_error",
            message: message.into(),
            param: None,
            code: None,
        }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut r = (status, self.body().to_string()).into_response();
        r.headers_mut().insert(
            axum::http::header::CONTENT_TYPE,
            axum::http::HeaderValue::from_static("application/json"),
        );
        r
    }
}

/// What stops the server.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("refusing to bind {addr} without --api-key: only loopback addresses (127.0.0.0/8, ::1) may be served without a key")]
    NeedsApiKey { addr: std::net::SocketAddr },
    #[error("binding {addr}")]
    Bind {
        addr: std::net::SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("record directory {path}")]
    RecordDir {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid option {name} = {value}: {why}")]
    Option {
        name: &'static str,
        value: String,
        why: String,
    },
    #[error(transparent)]
    Engine(#[from] lmrr_engine::EngineError),
    #[error(transparent)]
    Bundle(#[from] lmrr_recorder::BundleError),
    #[error("server: {0}")]
    Io(#[from] std::io::Error),
    #[error("the engine loop stopped: {0}")]
    EngineLoop(String),
    #[error("lmrr probe: request {request} to the server: {what}")]
    Probe { request: u64, what: String },
}
