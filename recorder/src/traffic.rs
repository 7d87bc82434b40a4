//! The traffic schema: what `lmrr proxy` saw between OpenAI-compatible
//! clients and an upstream server, for `lmrr audit` to check against lmrr's
//! reference engine.
//!
//! A traffic bundle uses the session bundle's framing, integrity checks and
//! limits ([`crate::format`]) with its own frame kinds, so neither kind of
//! reader mistakes one for the other. Its events are in the order the proxy
//! saw them; times are microseconds since the manifest's `started_unix_ms`.
//! Bodies and SSE payloads are kept as the bytes that crossed the wire
//! (upstream side, before logprobs were stripped for the client): parsing
//! happens when the bundle is read, so a malformed payload is recorded, not
//! lost. Changing any type here changes the bytes of a traffic bundle and
//! must bump [`TRAFFIC_VERSION`].

use serde::{Deserialize, Serialize};

use crate::schema::{HostInfo, FORMAT_VERSION};

/// Version of the traffic schema inside the shared framing.
pub const TRAFFIC_VERSION: u32 = 1;

/// Everything about a traffic recording except its events.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrafficManifest {
    /// Framing version (the session bundles' [`FORMAT_VERSION`]).
    pub format_version: u32,
    /// lmrr's arithmetic contract (for the header; traffic holds no logits of
    /// lmrr's own).
    pub contract_version: u32,
    pub traffic_version: u32,
    pub tool_version: String,
    pub git_revision: String,
    /// The upstream's base URL, as given.
    pub upstream: String,
    /// Where the proxy listened (or `resend` for `lmrr proxy --resend`).
    pub listen: String,
    /// Unix time of the recording's start, milliseconds.
    pub started_unix_ms: u64,
    /// Alternatives per token asked of the upstream when a client did not ask
    /// for logprobs (0: the proxy did not ask).
    pub top_logprobs: u32,
    pub host: HostInfo,
    /// Where the requests came from: `clients`, or `resend of FILE`.
    pub origin: String,
}

impl TrafficManifest {
    /// A manifest for a recording starting now.
    pub fn new(
        upstream: &str,
        listen: &str,
        top_logprobs: u32,
        origin: &str,
        tool_version: &str,
        git_revision: &str,
    ) -> Self {
        let started_unix_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        Self {
            format_version: FORMAT_VERSION,
            contract_version: lmrr_kernels::CONTRACT_VERSION,
            traffic_version: TRAFFIC_VERSION,
            tool_version: tool_version.into(),
            git_revision: git_revision.into(),
            upstream: upstream.into(),
            listen: listen.into(),
            started_unix_ms,
            top_logprobs,
            host: HostInfo::current(),
            origin: origin.into(),
        }
    }
}

/// How a proxied request ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    /// The upstream's response was delivered whole.
    Complete,
    /// The client closed the connection before the response ended; the
    /// upstream's connection was closed too (its server sees the abort).
    ClientGone,
    /// The upstream could not be reached (the client got a 502).
    UpstreamUnreachable { error: String },
    /// The upstream's response broke off or was not valid SSE/JSON (the
    /// client got an error event or a 502).
    UpstreamBroken { error: String },
}

/// One recorded event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum TrafficEvent {
    /// A client's request, in arrival order (`id` from 0).
    Request {
        id: u64,
        at_us: u64,
        method: String,
        /// Path and query, as sent.
        path: String,
        /// The client's body, as sent.
        body: Vec<u8>,
        /// The body sent upstream, when the proxy changed it (asked for
        /// logprobs the client did not ask for).
        upstream_body: Option<Vec<u8>>,
    },
    /// The upstream's status line and content type.
    Response {
        id: u64,
        at_us: u64,
        status: u16,
        content_type: String,
    },
    /// One SSE event's `data` (a JSON chunk, or `[DONE]`), or a whole
    /// non-streaming body, as the upstream sent it.
    Chunk { id: u64, at_us: u64, data: Vec<u8> },
    /// The request's end. `chunks_delivered`: how many of its chunks the
    /// client had been handed when it ended (all of them unless the client
    /// left first).
    End {
        id: u64,
        at_us: u64,
        outcome: Outcome,
        chunks_delivered: u32,
    },
}

impl TrafficEvent {
    /// The request this event belongs to.
    pub fn id(&self) -> u64 {
        match self {
            Self::Request { id, .. }
            | Self::Response { id, .. }
            | Self::Chunk { id, .. }
            | Self::End { id, .. } => *id,
        }
    }

    /// Whether this event ends a request (counted by the trailer).
    pub fn ends_request(&self) -> bool {
        matches!(self, Self::End { .. })
    }
}

/// A traffic bundle read into memory.
pub type TrafficBundle = crate::format::BundleOf<crate::format::Traffic>;

/// A traffic bundle's writer.
pub type TrafficWriter<W> = crate::format::Writer<W, crate::format::Traffic>;

/// Reads a traffic bundle file.
pub fn open(path: &std::path::Path) -> Result<TrafficBundle, crate::BundleError> {
    crate::format::open_as::<crate::format::Traffic>(path)
}

/// Reads a traffic bundle from bytes.
pub fn read(bytes: &[u8]) -> Result<TrafficBundle, crate::BundleError> {
    crate::format::read_as::<crate::format::Traffic>(bytes)
}
