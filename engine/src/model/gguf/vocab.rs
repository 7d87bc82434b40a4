//! A GGUF vocabulary (`tokenizer.ggml.*` metadata) to an HF `tokenizer.json`.
//!
//! Two tokenizer models, as llama.cpp names them in `tokenizer.ggml.model`:
//! - `gpt2`: byte-level BPE with the file's merges. `tokenizer.ggml.pre` names
//!   the split before the byte-level step: GPT-2's own regex (`default`,
//!   `gpt2`), digits one by one first (`smollm`, `starcoder`, `refact`), or the
//!   regex of the model's own `tokenizer.json` (`qwen2`: Qwen2's, with its NFC
//!   normalizer; `llama-bpe`: Llama 3's). Any other name is refused: a wrong
//!   split changes the ids without any error.
//! - `llama`: SentencePiece BPE with byte fallback, as transformers'
//!   `GemmaTokenizer` builds it: spaces become `▁` in a normalizer, no prefix
//!   space, `<0x..>` tokens for bytes missing from the vocabulary, a decoder
//!   `▁`→space + byte fallback + fuse, and BOS added by the post-processor when
//!   the file says `add_bos_token`. The file has no merges; they are derived
//!   from the vocabulary as transformers derives them from a GGUF
//!   (`gguf_tokenizer_mapping.py`): every split of a token into two tokens is a
//!   merge, ranked by the token's position in the file, a longer left part
//!   first. Tokens of spaces alone, which the file spells with real spaces, are
//!   spelled with `▁` (what the normalized text holds) under the same id.
//!
//! In both, control tokens (type 3) become special added tokens and
//! user-defined ones (type 4) plain added tokens, matched whole in the text
//! before the model runs (llama.cpp does the same); unused ones (type 5, such
//! as `[PAD151665]`) stay in the vocabulary only, where no merge reaches them.

use serde_json::{json, Value as Json};

/// The `tokenizer.ggml.*` metadata a `tokenizer.json` is built from.
#[derive(Debug, Clone, Default)]
pub struct GgufVocab {
    /// `tokenizer.ggml.model`: `gpt2` or `llama`.
    pub model: String,
    /// `tokenizer.ggml.pre` (`default` when absent).
    pub pre: String,
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.token_type` (1 normal, 2 unknown, 3 control,
    /// 4 user-defined, 5 unused, 6 byte); normal when absent.
    pub types: Vec<u64>,
    /// `tokenizer.ggml.merges` (`gpt2` only).
    pub merges: Vec<String>,
    pub bos: Option<u32>,
    pub unk: Option<u32>,
    /// `tokenizer.ggml.add_bos_token`.
    pub add_bos: bool,
    /// `tokenizer.ggml.add_space_prefix` (`llama` only; `true` is refused).
    pub add_space_prefix: bool,
}

/// Token types (llama.cpp's `llama_token_type`).
const CONTROL: u64 = 3;
const USER_DEFINED: u64 = 4;

/// Tokenizer models this converter writes, for errors.
pub const SUPPORTED_MODELS: &str = "gpt2 (byte-level BPE), llama (SentencePiece BPE)";
/// `tokenizer.ggml.pre` values of a `gpt2` vocabulary this converter knows.
pub const SUPPORTED_PRE: &str = "default, gpt2, smollm, starcoder, refact, qwen2, llama-bpe";

/// Qwen2's pre-tokenization regex (its `tokenizer.json`): letters with one
/// leading non-letter, digits one by one, punctuation runs with their line
/// breaks, whitespace.
pub const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Llama 3's: as Qwen2's, digits in runs of up to three.
pub const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

impl GgufVocab {
    fn ty(&self, id: usize) -> u64 {
        self.types.get(id).copied().unwrap_or(1)
    }

    /// Writes the `tokenizer.json`; the error says which field is not
    /// supported and what is.
    pub fn tokenizer_json(&self) -> Result<String, String> {
        let v = match self.model.as_str() {
            "gpt2" => self.byte_level()?,
            "llama" => self.sentencepiece()?,
            other => {
                return Err(format!(
                    "metadata `tokenizer.ggml.model` = `{other}`, supported: {SUPPORTED_MODELS}"
                ))
            }
        };
        Ok(serde_json::to_string(&v).expect("json of strings and numbers serialises"))
    }

    /// Added tokens, sorted by id: control ones (special) and user-defined
    /// ones, those of them `keep` accepts.
    fn added(&self, keep: impl Fn(usize, &str) -> bool) -> Vec<Json> {
        self.tokens
            .iter()
            .enumerate()
            .filter(|&(i, t)| matches!(self.ty(i), CONTROL | USER_DEFINED) && keep(i, t))
            .map(|(i, t)| {
                json!({"id": i, "content": t, "single_word": false, "lstrip": false, "rstrip": false,
                       "normalized": false, "special": self.ty(i) == CONTROL})
            })
            .collect()
    }

    /// Byte-level BPE (`gpt2`).
    fn byte_level(&self) -> Result<Json, String> {
        let vocab: serde_json::Map<String, Json> = self
            .tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), json!(i)))
            .collect();
        let added = self.added(|_, _| true);
        let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
        let split = |regex: &str| {
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}]})
        };
        let (normalizer, pre_tokenizer) = match self.pre.as_str() {
            "default" | "gpt2" | "gpt-2" => (Json::Null, byte_level),
            "smollm" | "starcoder" | "refact" => (
                Json::Null,
                json!({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": true}, byte_level]}),
            ),
            "qwen2" => (json!({"type": "NFC"}), split(QWEN2_SPLIT)),
            "llama-bpe" | "llama3" | "llama-v3" => (Json::Null, split(LLAMA3_SPLIT)),
            other => {
                return Err(format!(
                    "metadata `tokenizer.ggml.pre` = `{other}`, supported for a gpt2 vocabulary: {SUPPORTED_PRE}"
                ))
            }
        };
        Ok(json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": added,
            "normalizer": normalizer,
            "pre_tokenizer": pre_tokenizer,
            "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                      "vocab": vocab, "merges": self.merges}
        }))
    }

    /// SentencePiece BPE with byte fallback (`llama`).
    fn sentencepiece(&self) -> Result<Json, String> {
        if self.add_space_prefix {
            return Err(
                "metadata `tokenizer.ggml.add_space_prefix` = true: a SentencePiece \
                        vocabulary is converted without a prefix space only (as Gemma's)"
                    .into(),
            );
        }
        if !self.merges.is_empty() {
            return Err(format!(
                "metadata `tokenizer.ggml.merges` holds {} merges in a `llama` vocabulary: \
                 supported are merges derived from the vocabulary order only",
                self.merges.len()
            ));
        }
        let spelled: Vec<String> = self.tokens.iter().map(|t| spm_spelling(t)).collect();
        let vocab: serde_json::Map<String, Json> = spelled
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), json!(i)))
            .collect();
        // A user-defined token respelled with `▁` is reached through merges,
        // as transformers does (its file spelling is not in the vocabulary).
        let added = self.added(|i, t| self.ty(i) == CONTROL || spelled[i] == *t);
        let merges = spm_merges(&spelled);
        let name = |id: Option<u32>| id.and_then(|i| spelled.get(i as usize)).cloned();
        let unk =
            name(self.unk).or_else(|| vocab.contains_key("<unk>").then(|| "<unk>".to_string()));
        let post_processor = match (self.add_bos, self.bos) {
            (false, _) => Json::Null,
            (true, Some(id)) => {
                let bos = name(Some(id)).ok_or_else(|| {
                    format!(
                        "metadata `tokenizer.ggml.bos_token_id` = {id} is outside the vocabulary of {}",
                        self.tokens.len()
                    )
                })?;
                let tok = |t: u32| json!({"SpecialToken": {"id": bos, "type_id": t}});
                let seq = |s: &str, t: u32| json!({"Sequence": {"id": s, "type_id": t}});
                json!({"type": "TemplateProcessing",
                       "single": [tok(0), seq("A", 0)],
                       "pair": [tok(0), seq("A", 0), tok(1), seq("B", 1)],
                       "special_tokens": {bos.clone(): {"id": bos, "ids": [id], "tokens": [bos]}}})
            }
            (true, None) => {
                return Err(
                    "metadata `tokenizer.ggml.add_bos_token` is true but `tokenizer.ggml.bos_token_id` is missing"
                        .into(),
                )
            }
        };
        Ok(json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": added,
            "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
            "pre_tokenizer": {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": false},
            "post_processor": post_processor,
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"}, {"type": "Fuse"}]},
            "model": {"type": "BPE", "dropout": null, "unk_token": unk, "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                      "vocab": vocab, "merges": merges}
        }))
    }
}

/// Python's `str.isspace` (what transformers tests with `strip()`): Unicode
/// whitespace plus the separators U+001C..U+001F.
fn py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// A token of whitespace holding a space is spelled with one `▁` per
/// character; every other token as the file spells it.
pub fn spm_spelling(t: &str) -> String {
    if t.contains(' ') && t.chars().all(py_space) {
        "▁".repeat(t.chars().count())
    } else {
        t.to_string()
    }
}

/// Merges implied by a SentencePiece vocabulary in file order: for each token
/// in order, each split into two vocabulary tokens, the longer left part
/// first (transformers' `generate_merges` with the negated position as the
/// score).
pub fn spm_merges(tokens: &[String]) -> Vec<[String; 2]> {
    let ids: std::collections::HashMap<&str, usize> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.as_str(), i))
        .collect();
    let mut out = Vec::new();
    // A token spelled twice counts once, at its last position (a dict of
    // spelling → position, built in order).
    for (i, t) in tokens.iter().enumerate() {
        if ids[t.as_str()] != i {
            continue;
        }
        let cuts: Vec<usize> = t.char_indices().map(|(b, _)| b).skip(1).collect();
        for &b in cuts.iter().rev() {
            let (l, r) = t.split_at(b);
            if ids.contains_key(l) && ids.contains_key(r) {
                out.push([l.to_string(), r.to_string()]);
            }
        }
    }
    out
}
