//! What a disaggregated deployment records and what crosses between its two
//! engines. Every type here is serde: [`PdMessage`] is what a socket between
//! a prefill process and a decode process would carry, [`PdStep`] and
//! [`PdEvent`] what bundles record. Changing a field's order or type changes
//! the bundle format (see `recorder::schema`).

use serde::{Deserialize, Serialize};

use crate::pool::{Hash, PageId};
use crate::scheduler::{EngineConfig, Request, RequestId, StepReport};
use crate::FinishReason;

/// The decode engine and the link of a disaggregated deployment (the
/// prefill engine's configuration is the colocated one's place: a bundle's
/// manifest `engine`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PdConfig {
    /// The decode engine's pool, pages and budget.
    pub decode: EngineConfig,
    /// K/V pages (of the prefill engine's page size) the link carries per
    /// step, over every transfer in flight (at least 1).
    pub transfer_pages_per_step: usize,
}

impl PdConfig {
    /// A decode engine configured like `prefill`, one page per step.
    pub fn like(prefill: EngineConfig) -> Self {
        Self {
            decode: prefill,
            transfer_pages_per_step: 1,
        }
    }
}

/// Which engine of the deployment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Side {
    Prefill,
    Decode,
}

impl std::fmt::Display for Side {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Prefill => "prefill",
            Self::Decode => "decode",
        })
    }
}

/// Where a request is in the deployment when an abort reaches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Stage {
    /// Waiting in the prefill engine's queue.
    QueuedForPrefill,
    /// Its prompt is being computed on the prefill engine.
    Prefilling,
    /// Prefilled (first token drawn); its K/V waits for, or is in, transfer.
    Transferring,
    /// Every page transferred; not yet admitted by the decode engine.
    Transferred,
    /// Running on the decode engine.
    Decoding,
}

impl std::fmt::Display for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::QueuedForPrefill => "queued for prefill",
            Self::Prefilling => "prefilling",
            Self::Transferring => "transferring",
            Self::Transferred => "transferred, not admitted",
            Self::Decoding => "decoding",
        })
    }
}

/// A message between the two engines.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum PdMessage {
    /// Prefill → decode: a request has arrived; reserve `positions` positions.
    Bootstrap { request: Request },
    /// Decode → prefill: the pages reserved, by id, in position order.
    Reserved { id: RequestId, pages: Vec<PageId> },
    /// Prefill → decode: K/V rows of positions `start..start + len`, to be
    /// written into the reserved pages; `(len, layers, 2·kv_dim + aux_dim)`.
    Kv {
        id: RequestId,
        start: usize,
        len: usize,
        /// Destination pages (the reservation), as the sender knows them.
        pages: Vec<PageId>,
        rows: Vec<f32>,
    },
    /// Prefill → decode: every page sent; the first token and the logits
    /// row it was drawn from.
    Done {
        id: RequestId,
        token: u32,
        row: Vec<f32>,
    },
    /// Either way: the client went away.
    Abort { id: RequestId },
}

/// One recorded event of a disaggregated step, besides the two engines'
/// step reports.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum PdEvent {
    /// An abort applied at the step boundary, at the stage it found.
    Abort { id: RequestId, stage: Stage },
    /// The decode engine heard of a request (`positions` prompt positions).
    Bootstrap { id: RequestId, positions: usize },
    /// The decode engine reserved `pages` for the request's prompt.
    Reserve { id: RequestId, pages: Vec<PageId> },
    /// The prefill engine drew the first token; `finish` when the request
    /// ends there (EOS, `max_tokens` of 1, context), else its K/V goes to
    /// the decode engine.
    Prefilled {
        id: RequestId,
        token: u32,
        finish: Option<FinishReason>,
    },
    /// Positions `start..start + len` carried into decode pages `pages`;
    /// `digest` is the SHA-256 of the rows' bits. `orphan`: the request was
    /// aborted and its reservation freed, the writer went on.
    Transfer {
        id: RequestId,
        start: usize,
        len: usize,
        pages: Vec<PageId>,
        digest: Hash,
        orphan: bool,
    },
    /// The decode engine was told the request's K/V is complete, after
    /// `pages_sent` of `pages_total` transfers.
    Complete {
        id: RequestId,
        pages_sent: usize,
        pages_total: usize,
    },
    /// The decode engine admitted the request into its running batch.
    Admit { id: RequestId },
    /// An aborted request's decode reservation of `pages` pages is never
    /// released.
    Leak { id: RequestId, pages: usize },
}

/// One step of a disaggregated deployment: boundary events (aborts,
/// bootstraps, admissions, reservations), the prefill engine's step, the
/// link's events (first tokens, transfers, completions), the decode
/// engine's step, and the requests that ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PdStep {
    pub step: u64,
    pub before: Vec<PdEvent>,
    pub prefill: StepReport,
    pub link: Vec<PdEvent>,
    pub decode: StepReport,
    /// Requests that ended this step, as the client sees them.
    pub finished: Vec<(RequestId, FinishReason)>,
}

impl PdStep {
    /// The step's events in order, with the side a report belongs to.
    pub fn reports(&self) -> [(Side, &StepReport); 2] {
        [(Side::Prefill, &self.prefill), (Side::Decode, &self.decode)]
    }
}
