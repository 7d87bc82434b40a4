//! Engine errors. Every variant names the file, tensor or sequence involved and
//! the numbers (expected vs found) so a message alone says what to fix.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("device: {0}")]
    Device(String),
    #[error("reading {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("model directory {dir} has no {file}")]
    MissingFile { dir: PathBuf, file: &'static str },
    #[error(
        "{} is a GGUF file; lmrr runs HF directories: convert it once with `lmrr import-gguf {} --out DIR`, then pass --model DIR",
        .path.display(), .path.display()
    )]
    GgufAsModel { path: PathBuf },
    #[error("{path}: {msg}")]
    Config { path: PathBuf, msg: String },
    #[error("{path}: field `{field}` = {value}: {why}")]
    ConfigValue {
        path: PathBuf,
        field: &'static str,
        value: String,
        why: String,
    },
    #[error("{path}: not a valid safetensors file: {msg}")]
    SafeTensors { path: PathBuf, msg: String },
    #[error("{path}: tensor `{name}` is missing")]
    MissingTensor { path: PathBuf, name: String },
    #[error("{path}: tensor `{name}` has shape {found:?}, expected {expected:?}")]
    TensorShape {
        path: PathBuf,
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("{path}: tensor `{name}` has dtype {dtype}, supported: F32, BF16, F16")]
    TensorDtype {
        path: PathBuf,
        name: String,
        dtype: String,
    },
    #[error("{path}: tokenizer: {msg}")]
    Tokenizer { path: PathBuf, msg: String },
    #[error("prompt is {tokens} tokens, the model's context is {context}")]
    PromptTooLong { tokens: usize, context: usize },
    #[error("empty prompt: at least one token is needed")]
    EmptyPrompt,
    #[error("max_tokens = 0: a request generates at least 1 token")]
    ZeroMaxTokens,
    #[error("token id {token} is outside the vocabulary of {vocab}")]
    TokenOutOfRange { token: u32, vocab: usize },
    #[error(
        "sequence {seq}: span starts at position {start} but the KV store holds {held} positions"
    )]
    KvPosition { seq: u64, start: usize, held: usize },
    #[error("sequence {seq}: position {pos} is beyond the model's context of {context}")]
    ContextOverflow {
        seq: u64,
        pos: usize,
        context: usize,
    },
    #[error("livelock: no request made progress for {stalled} steps (no token sampled, none finished), stopped before step {step}\n{report}")]
    Livelock {
        step: u64,
        stalled: u64,
        report: String,
    },
    #[error("out of memory: {what} would bring the KV pool to {bytes} bytes{}", budget.map(|b| format!(", past the {b} bytes this host had available (90% of MemAvailable)")).unwrap_or_else(|| ", which the allocator refused".into()))]
    OutOfMemory {
        what: String,
        bytes: usize,
        budget: Option<usize>,
    },
    #[error("sequence {seq}: needs {need_pages} KV pages, holds {have_pages}")]
    PoolExhausted {
        seq: u64,
        need_pages: usize,
        have_pages: usize,
    },
    #[error("request `{id}` can never fit: {tokens} tokens need {need_pages} pages of {page_size}, the pool has {pool_pages}")]
    NeverFits {
        id: String,
        tokens: usize,
        need_pages: usize,
        pool_pages: usize,
        page_size: usize,
    },
    #[error("infeasible decision: {what}")]
    Infeasible { what: String },
    #[error("sequence {seq} appears twice in one batch")]
    DuplicateSeq { seq: u64 },
    #[error("invalid option {name} = {value}: {why}")]
    InvalidOption {
        name: &'static str,
        value: String,
        why: String,
    },
    /// `offset` 0 is the file as a whole (not named as a byte).
    #[error("{path}: {}{msg}", if *.offset == 0 { String::new() } else { format!("byte {}: ", .offset) })]
    Gguf {
        path: String,
        offset: u64,
        msg: String,
    },
    #[error(transparent)]
    Threads(#[from] lmrr_kernels::threads::ThreadsError),
    /// Not a `#[source]`: the message already holds the reason once.
    #[error("tensor parallelism: {0}")]
    Tp(crate::model::exec::tp::TpError),
}

impl From<crate::model::exec::tp::TpError> for EngineError {
    fn from(e: crate::model::exec::tp::TpError) -> Self {
        Self::Tp(e)
    }
}
