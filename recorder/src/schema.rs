//! The trace schema: a manifest, then events in order. Serde types, encoded by
//! [`crate::codec`]. Changing any type here changes the bytes of a bundle and
//! must bump [`FORMAT_VERSION`].

use serde::{Deserialize, Serialize};

use lmrr_engine::scheduler::{Request, RequestId, StepReport};
use lmrr_engine::{EngineConfig, ModelIdentity, SynthSpec};
use lmrr_engine::{PdConfig, PdStep};

/// Version of the bundle format (framing and schema).
///
/// - 1: first format.
/// - 2: the model identity is a content identity (digests of the config
///   fields, tokenizer and f32 weight values; 32-byte digests, not hex text).
/// - 3: two events appended to [`Event`] for disaggregated deployments
///   (`Disaggregated`, `PdStep`); nothing else changed, so a format-2 bundle
///   decodes as it is and is still read.
/// - 4: [`Manifest::numerics`], the arithmetic of the matmuls
///   (`canonical` or `tensor-core-sm90`); a format-2 or -3 manifest reads
///   as `canonical`, the only mode those formats had.
/// - 5: [`Manifest::tp_degree`], the tensor-parallel degree the session
///   ran at (never changes a bit); a manifest of formats 2 to 4 reads as
///   degree 1, the only degree those formats had.
pub const FORMAT_VERSION: u32 = 5;

/// The oldest format this lmrr reads (formats 2 to 5 differ by event
/// variants appended and the manifest's numerics, read as `canonical`
/// before 4, and tensor-parallel degree, read as 1 before 5).
pub const MIN_READ_VERSION: u32 = 2;

/// What changed after format `version`, for the message that refuses it.
pub fn format_change(version: u32) -> &'static str {
    match version {
        0 | 1 => "format 2 identifies models by content, format 1 by file hashes",
        _ => "an earlier format",
    }
}

/// Everything about a recording except its events.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format_version: u32,
    /// Arithmetic contract the logits were computed under.
    pub contract_version: u32,
    pub tool_version: String,
    pub git_revision: String,
    pub model: ModelInfo,
    pub engine: EngineConfig,
    /// Engine patches active while recording (empty = reference engine).
    pub patches: Vec<String>,
    pub host: HostInfo,
    pub source: SessionSource,
    /// Top-k logprobs recorded per sampled token.
    pub top_logprobs: u32,
    /// Threads used (never changes a bit; recorded for reports).
    pub threads: u32,
    /// The matmuls' arithmetic (`lmrr_kernels::tensor_core::Numerics`'s
    /// name): replay runs under it, on any device that has it.
    pub numerics: String,
    /// Tensor-parallel ranks the session ran over (never changes a bit:
    /// replay at any degree gives the same logits; recorded for reports).
    pub tp_degree: u32,
}

/// A format-2 or -3 manifest: [`Manifest`] without `numerics` and
/// `tp_degree`.
#[derive(Debug, Clone, Deserialize)]
pub(crate) struct ManifestV3 {
    format_version: u32,
    contract_version: u32,
    tool_version: String,
    git_revision: String,
    model: ModelInfo,
    engine: EngineConfig,
    patches: Vec<String>,
    host: HostInfo,
    source: SessionSource,
    top_logprobs: u32,
    threads: u32,
}

impl From<ManifestV3> for Manifest {
    fn from(m: ManifestV3) -> Self {
        Self {
            format_version: m.format_version,
            contract_version: m.contract_version,
            tool_version: m.tool_version,
            git_revision: m.git_revision,
            model: m.model,
            engine: m.engine,
            patches: m.patches,
            host: m.host,
            source: m.source,
            top_logprobs: m.top_logprobs,
            threads: m.threads,
            numerics: lmrr_kernels::tensor_core::Numerics::Canonical.name().into(),
            tp_degree: 1,
        }
    }
}

/// A format-4 manifest: [`Manifest`] without `tp_degree`.
#[derive(Debug, Clone, Deserialize)]
pub(crate) struct ManifestV4 {
    format_version: u32,
    contract_version: u32,
    tool_version: String,
    git_revision: String,
    model: ModelInfo,
    engine: EngineConfig,
    patches: Vec<String>,
    host: HostInfo,
    source: SessionSource,
    top_logprobs: u32,
    threads: u32,
    numerics: String,
}

impl From<ManifestV4> for Manifest {
    fn from(m: ManifestV4) -> Self {
        Self {
            format_version: m.format_version,
            contract_version: m.contract_version,
            tool_version: m.tool_version,
            git_revision: m.git_revision,
            model: m.model,
            engine: m.engine,
            patches: m.patches,
            host: m.host,
            source: m.source,
            top_logprobs: m.top_logprobs,
            threads: m.threads,
            numerics: m.numerics,
            tp_degree: 1,
        }
    }
}

impl Manifest {
    /// A manifest for recording a session of `script_path` (text `script`) on
    /// `model` with the given engine settings; versions and host are current.
    #[allow(clippy::too_many_arguments)]
    pub fn for_session(
        model: &lmrr_engine::Model,
        engine: EngineConfig,
        patches: &lmrr_engine::PatchSet,
        script_path: &str,
        script: &str,
        top_logprobs: u32,
        threads: u32,
        tool_version: &str,
        git_revision: &str,
    ) -> Self {
        Self {
            format_version: FORMAT_VERSION,
            contract_version: lmrr_kernels::CONTRACT_VERSION,
            tool_version: tool_version.into(),
            git_revision: git_revision.into(),
            model: ModelInfo {
                origin: model.origin.clone(),
                identity: model.identity(),
                synthetic: model.synthetic,
            },
            engine,
            patches: patches.names(),
            host: HostInfo::current(),
            source: SessionSource {
                script_path: script_path.into(),
                script: script.into(),
            },
            top_logprobs,
            threads,
            numerics: model.net.numerics().name().into(),
            tp_degree: u32::try_from(model.net.tp_degree()).unwrap_or(u32::MAX),
        }
    }
}

/// Which model produced the recording.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelInfo {
    /// Directory or generator name, as given.
    pub origin: String,
    pub identity: ModelIdentity,
    /// Generator, preset and seed, for synthetic models.
    pub synthetic: Option<SynthSpec>,
}

/// Host and ISA fingerprint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HostInfo {
    pub os: String,
    pub arch: String,
    /// Kernel path used: `avx2+fma` or `scalar`.
    pub isa: String,
    pub cpu: String,
}

impl HostInfo {
    /// This machine.
    pub fn current() -> Self {
        let cpu = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("model name"))
                    .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
            })
            .unwrap_or_else(|| "unknown".into());
        let isa = match lmrr_kernels::isa() {
            lmrr_kernels::Isa::Avx2Fma => "avx2+fma",
            lmrr_kernels::Isa::Scalar => "scalar",
        };
        Self {
            os: std::env::consts::OS.into(),
            arch: std::env::consts::ARCH.into(),
            isa: isa.into(),
            cpu,
        }
    }
}

/// The session as the user wrote it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionSource {
    pub script_path: String,
    pub script: String,
}

/// One recorded event. Arrivals and interrupts happen at the boundary before
/// step `step`; a `Step` is the scheduler's full report of that step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Event {
    Arrival {
        step: u64,
        name: String,
        request: Request,
    },
    Interrupt {
        step: u64,
        name: String,
        id: RequestId,
    },
    Step(StepReport),
    /// Format 3: the session ran on a disaggregated deployment, whose
    /// prefill engine is the manifest's `engine` and whose decode engine and
    /// link are these. The first event when present.
    Disaggregated(PdConfig),
    /// Format 3: one step of a disaggregated deployment (both engines'
    /// reports and the link's events; boxed, it holds two reports, encoded
    /// as the value itself).
    PdStep(Box<PdStep>),
}

impl Event {
    /// The engine step reports the event holds: a colocated step's, or a
    /// disaggregated step's prefill then decode report.
    pub fn reports(&self) -> Vec<&StepReport> {
        match self {
            Self::Step(r) => vec![r],
            Self::PdStep(p) => vec![&p.prefill, &p.decode],
            _ => Vec::new(),
        }
    }

    /// The step number of a step event.
    pub fn step(&self) -> Option<u64> {
        match self {
            Self::Step(r) => Some(r.step),
            Self::PdStep(p) => Some(p.step),
            _ => None,
        }
    }
}

/// The last frame of a complete bundle.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Trailer {
    /// Frames before the trailer (manifest included).
    pub frames: u32,
    pub events: u64,
    pub steps: u64,
    /// SHA-256 over every byte before the trailer frame (header included).
    pub sha256: [u8; 32],
}
