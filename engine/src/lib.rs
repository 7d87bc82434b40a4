//! lmrr's deterministic inference engine.
//!
//! Two halves. `model/` owns what a model is: the [`ModelFamily`] trait and
//! its families (`llama`, `mini_v4`), loading an HF directory (`config.json`,
//! `model.safetensors`, `tokenizer.json`), GGUF import, tokenizer, chat
//! templates, the synthetic generator and content identity. `runtime/` owns the
//! serving core, which knows no family: the paged KV pool, the radix cache,
//! the scheduler, session scripts and the single-request driver. `runtime/`
//! imports `model/`, never the other way round.
//!
//! Invariant (the contract, see docs/ARCHITECTURE.md): the logits at position
//! `p` of a sequence are a pure function of its tokens `[0..=p]` — independent of
//! batch-mates, chunking, thread count and run. Every reduction goes through
//! `lmrr_kernels`' canonical order; nothing here reduces floats on its own.

pub mod digest;
pub mod error;
pub mod model;
pub mod patches;
pub mod runtime;
pub mod sampling;
pub mod spec;

pub use model::llama::config;
pub use model::{
    chat, exec, gguf, hf_config, identity, kv, llama, mini_v4, synth, tokenizer, weights,
};
pub use runtime::{disagg, generate, pool, radix, scheduler, session};

pub use config::LlamaConfig;
pub use disagg::{PdConfig, PdEngine, PdEvent, PdStep, Side, Stage};
pub use error::EngineError;
pub use generate::{generate, FinishReason, GenerateOptions, Generation};
pub use identity::{ModelIdentity, Sha256Digest};
pub use kv::{BlockRows, KvBlocks, KvCache, KvRun, SeqId, SeqKvStore};
pub use llama::Llama;
pub use mini_v4::{MiniV4, MiniV4Config};
pub use model::{Device, Family, KvLayout, LogitsWanted, ModelFamily, SeqSpan};
pub use patches::{Patch, PatchSet};
pub use sampling::{sample, SamplingParams};
pub use scheduler::{
    Decision, EngineConfig, Request, RequestId, RequestOutput, Scheduler, SeqReport, StepReport,
};
pub use session::{run_session, Script, ScriptError, SessionEngine, SessionResult};
pub use synth::{Preset, SynthSpec};
pub use tokenizer::Tokenizer;
pub use weights::ModelFiles;

/// A loaded model: weights and tokenizer, ready to run.
pub struct Model {
    /// The family's forward pass.
    pub net: Box<dyn ModelFamily>,
    pub tokenizer: Tokenizer,
    /// Where it came from, for messages.
    pub origin: String,
    /// The generator, for synthetic models.
    pub synthetic: Option<SynthSpec>,
    /// The model's own chat template (`tokenizer_config.json`), if any.
    pub chat_template: Option<chat::ChatTemplate>,
    files: ModelFiles,
    identity: std::sync::OnceLock<ModelIdentity>,
}

impl Model {
    /// Loads an HF-layout directory.
    pub fn load_dir(dir: &std::path::Path) -> Result<Self, EngineError> {
        Self::from_files(ModelFiles::open_dir(dir)?)
    }

    /// Loads from files already opened or generated in memory.
    pub fn from_files(files: ModelFiles) -> Result<Self, EngineError> {
        let net = model::load_family(&files)?;
        let mut tokenizer = Tokenizer::from_bytes(&files.tokenizer, &files.tokenizer_path)?;
        if let Some((bytes, path)) = &files.tokenizer_config {
            tokenizer = tokenizer.with_bos_from_config(bytes, path)?;
        }
        if tokenizer.vocab_size() > net.vocab_size() {
            return Err(EngineError::ConfigValue {
                path: files.config_path.clone(),
                field: "vocab_size",
                value: net.vocab_size().to_string(),
                why: format!(
                    "tokenizer has {} tokens, more than the model's vocabulary",
                    tokenizer.vocab_size()
                ),
            });
        }
        let chat_template = match &files.tokenizer_config {
            Some((bytes, path)) => chat::ChatTemplate::from_tokenizer_config(bytes, path)?,
            None => None,
        };
        Ok(Self {
            net,
            tokenizer,
            origin: files.origin.clone(),
            synthetic: None,
            chat_template,
            files,
            identity: std::sync::OnceLock::new(),
        })
    }

    /// Generates and loads a synthetic model.
    pub fn synthetic(spec: SynthSpec) -> Result<Self, EngineError> {
        let mut m = Self::from_files(spec.build())?;
        m.synthetic = Some(spec);
        Ok(m)
    }

    /// Renders chat messages with the model's template into prompt parts.
    /// A model without one gets the built-in ChatML only where its
    /// vocabulary has ChatML's tokens (the synthetic models, which are made
    /// with them); any other is refused, so that a model never reads a chat
    /// format it was not trained on.
    pub fn render_chat(&self, messages: &[chat::Message]) -> Result<Vec<chat::Part>, EngineError> {
        match &self.chat_template {
            Some(t) => t.render(messages).map_err(|msg| EngineError::Config {
                path: self.origin.clone().into(),
                msg: format!("rendering the chat template: {msg}"),
            }),
            None if self.speaks_chatml() => Ok(chat::render_chatml(messages)),
            None => Err(EngineError::Config {
                path: self.origin.clone().into(),
                msg: "the model has no chat template (no `chat_template` in \
                      tokenizer_config.json) and its vocabulary has no ChatML tokens \
                      (`<|im_start|>`, `<|im_end|>`): give a plain prompt instead of \
                      chat messages, or add the model's template to tokenizer_config.json"
                    .into(),
            }),
        }
    }

    /// Whether the vocabulary has ChatML's two special tokens.
    pub fn speaks_chatml(&self) -> bool {
        ["<|im_start|>", "<|im_end|>"]
            .iter()
            .all(|t| self.tokenizer.token_id(t).is_some())
    }

    /// The prompt text for one user message in the model's template,
    /// generation prompt included (what `generate --chat` sends).
    pub fn chat_prompt(&self, user: &str) -> Result<String, EngineError> {
        let parts = self.render_chat(&[chat::Message {
            role: "user".into(),
            content: chat::Content::Text(user.into()),
        }])?;
        // A text message yields text parts only: splicing is structural
        // (`chat` module), so no text is ever taken for a splice.
        let mut prompt = String::new();
        for p in parts {
            match p {
                chat::Part::Text(t) => prompt.push_str(&t),
                chat::Part::Output(id) => {
                    return Err(EngineError::Config {
                        path: self.origin.clone().into(),
                        msg: format!(
                            "the chat template turned a text message into a splice of `{id}`"
                        ),
                    })
                }
            }
        }
        Ok(prompt)
    }

    /// The llama family's model, when this is one.
    pub fn llama(&self) -> Option<&Llama> {
        self.net.as_any().downcast_ref()
    }

    /// The mini-v4 family's model, when this is one.
    pub fn mini_v4(&self) -> Option<&MiniV4> {
        self.net.as_any().downcast_ref()
    }

    /// The forward pass, as the serving core takes it.
    pub fn net(&self) -> &dyn ModelFamily {
        self.net.as_ref()
    }

    /// Size of the weights file.
    pub fn weight_file_bytes(&self) -> usize {
        self.files.weight_file_bytes()
    }

    /// The model's content identity (see [`identity`]): computed on first use
    /// with one pass over the weights, then cached.
    pub fn identity(&self) -> ModelIdentity {
        *self.identity.get_or_init(|| {
            let workers = std::thread::available_parallelism().map_or(1, |n| n.get());
            ModelIdentity {
                config_sha256: identity::Sha256Digest::of(self.net.config_text().as_bytes()),
                weights_sha256: identity::weights_digest(self.net(), workers),
                tokenizer_sha256: identity::tokenizer_digest(
                    &self.files.tokenizer,
                    self.files.tokenizer_config.as_ref().map(|(b, _)| &b[..]),
                ),
            }
        })
    }
}
