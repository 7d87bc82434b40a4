//! Tokenizer: `tokenizer.json` through the `tokenizers` crate, and the
//! byte-level BPE tokenizer written for synthetic models.

use std::path::{Path, PathBuf};

use crate::EngineError;

/// A loaded tokenizer.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
    /// The token a plain-text prompt starts with, when the model's
    /// `tokenizer_config.json` says `add_bos_token` (Gemma's do).
    bos: Option<u32>,
}

impl Tokenizer {
    pub fn from_bytes(bytes: &[u8], path: &Path) -> Result<Self, EngineError> {
        let inner =
            tokenizers::Tokenizer::from_bytes(bytes).map_err(|e| EngineError::Tokenizer {
                path: path.into(),
                msg: e.to_string(),
            })?;
        Ok(Self {
            inner,
            path: path.into(),
            bos: None,
        })
    }

    /// Reads `add_bos_token` and `bos_token` (a string, or an object with
    /// `content`) from a `tokenizer_config.json`: when the flag is true, the
    /// BOS token must be in the vocabulary, and [`Self::encode_prompt`]
    /// starts with it. A config without the flag changes nothing.
    pub fn with_bos_from_config(mut self, bytes: &[u8], path: &Path) -> Result<Self, EngineError> {
        let err = |msg: String| EngineError::Config {
            path: path.into(),
            msg,
        };
        let v: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| err(e.to_string()))?;
        if v.get("add_bos_token").and_then(|b| b.as_bool()) != Some(true) {
            return Ok(self);
        }
        let tok = match v.get("bos_token") {
            Some(serde_json::Value::String(s)) => Some(s.as_str()),
            Some(o) => o.get("content").and_then(|c| c.as_str()),
            None => None,
        }
        .ok_or_else(|| err("`add_bos_token` is true but `bos_token` is missing".into()))?;
        let id = self.token_id(tok).ok_or_else(|| {
            err(format!(
                "`add_bos_token` is true but `bos_token` `{tok}` is not in the vocabulary"
            ))
        })?;
        self.bos = Some(id);
        Ok(self)
    }

    /// The token a plain-text prompt starts with, if the model has one.
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// Token ids of a plain-text prompt: [`Self::encode`] after the BOS
    /// token when the model's tokenizer config asks for one (a chat
    /// template's output is encoded without it: the template writes its own).
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, EngineError> {
        let mut ids: Vec<u32> = self.bos.into_iter().collect();
        ids.extend(self.encode(text)?);
        Ok(ids)
    }

    /// Token ids of `text`, special tokens written in the text recognised, no
    /// BOS/EOS added.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, EngineError> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| EngineError::Tokenizer {
                path: self.path.clone(),
                msg: e.to_string(),
            })?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`, special tokens kept.
    pub fn decode(&self, ids: &[u32]) -> Result<String, EngineError> {
        self.inner
            .decode(ids, false)
            .map_err(|e| EngineError::Tokenizer {
                path: self.path.clone(),
                msg: e.to_string(),
            })
    }

    /// Number of tokens, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Id of a token string, if present.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The raw bytes every token stands for, indexed by id (OpenAI's `bytes`
    /// field of a logprob). For a byte-level BPE token, its vocabulary string
    /// mapped back through [`bytes_to_unicode`], so a token holding part of a
    /// UTF-8 character gives exactly its bytes; for an added (special) token,
    /// or a vocabulary that is not byte-level, the token's decoded text.
    /// Built once per use site: it walks the whole vocabulary.
    pub fn byte_table(&self) -> Vec<Vec<u8>> {
        let added = self.inner.get_added_tokens_decoder();
        let mut back = std::collections::HashMap::with_capacity(256);
        for (b, &c) in bytes_to_unicode().iter().enumerate() {
            back.insert(c, b as u8);
        }
        (0..self.vocab_size() as u32)
            .map(|id| {
                let Some(s) = self.inner.id_to_token(id) else {
                    return Vec::new();
                };
                if !added.contains_key(&id) {
                    if let Some(bytes) = s.chars().map(|c| back.get(&c).copied()).collect() {
                        return bytes;
                    }
                }
                match self.inner.decode(&[id], false) {
                    Ok(text) if !text.is_empty() => text.into_bytes(),
                    _ => s.into_bytes(),
                }
            })
            .collect()
    }
}

/// GPT-2's reversible byte → printable char map used by byte-level BPE.
pub fn bytes_to_unicode() -> [char; 256] {
    let mut out = ['\0'; 256];
    let mut extra = 0u32;
    for b in 0..256u32 {
        let printable =
            (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        let c = if printable {
            b
        } else {
            extra += 1;
            255 + extra
        };
        out[b as usize] = char::from_u32(c).expect("valid code point");
    }
    out
}

/// Special tokens of synthetic models, ids 0.. (ChatML, as SmolLM2).
pub const SPECIAL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// Order in which bytes pair up into merges (frequent English letters first).
const MERGE_ALPHABET: &[u8] =
    b" etaoinshrdlcumwfgypbvkjxqzETAOINSHRDLCUMWFGYPBVKJXQZ0123456789.,;:!?'\"-()[]{}<>/\\|@#$%^&*_+=~`";

/// A byte-level BPE `tokenizer.json` with exactly `vocab_size` tokens: the
/// special tokens, the 256 bytes, then merges — all pairs of
/// [`MERGE_ALPHABET`] in order, then (pair + char) triples — until full.
/// Deterministic: the same `vocab_size` gives the same bytes.
pub fn byte_level_json(vocab_size: usize) -> String {
    use serde_json::json;
    let map = bytes_to_unicode();
    let mut vocab: Vec<(String, usize)> = Vec::with_capacity(vocab_size);
    for s in SPECIAL_TOKENS {
        vocab.push((s.to_string(), vocab.len()));
    }
    for c in map {
        vocab.push((c.to_string(), vocab.len()));
    }
    let alpha: Vec<String> = MERGE_ALPHABET
        .iter()
        .map(|&b| map[b as usize].to_string())
        .collect();
    let mut merges: Vec<(String, String)> = Vec::new();
    let mut pairs: Vec<String> = Vec::new();
    'fill: {
        for a in &alpha {
            for b in &alpha {
                if vocab.len() >= vocab_size {
                    break 'fill;
                }
                merges.push((a.clone(), b.clone()));
                pairs.push(format!("{a}{b}"));
                vocab.push((format!("{a}{b}"), vocab.len()));
            }
        }
        for p in &pairs {
            for c in &alpha {
                if vocab.len() >= vocab_size {
                    break 'fill;
                }
                merges.push((p.clone(), c.clone()));
                vocab.push((format!("{p}{c}"), vocab.len()));
            }
        }
    }
    let vocab_obj: serde_json::Map<String, serde_json::Value> =
        vocab.iter().map(|(s, i)| (s.clone(), json!(i))).collect();
    let added: Vec<_> = SPECIAL_TOKENS
        .iter()
        .enumerate()
        .map(|(i, s)| {
            json!({"id": i, "content": s, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let merges: Vec<String> = merges.iter().map(|(a, b)| format!("{a} {b}")).collect();
    let v = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab_obj, "merges": merges
        }
    });
    serde_json::to_string_pretty(&v).expect("json of strings and numbers serialises")
}

#[cfg(test)]
mod byte_table_tests {
    use super::*;

    #[test]
    fn token_bytes_concatenate_to_the_text_even_inside_utf8_characters() {
        let json = byte_level_json(1024);
        let tok = Tokenizer::from_bytes(json.as_bytes(), Path::new("synthetic")).unwrap();
        let table = tok.byte_table();
        assert_eq!(table.len(), 1024);
        // Multi-byte characters split into byte tokens: each token's bytes are
        // a fragment of a character, not valid UTF-8 alone.
        let text = "Zorblax likes teal — 🌊 über <|im_end|> done";
        let ids = tok.encode(text).unwrap();
        let joined: Vec<u8> = ids
            .iter()
            .flat_map(|&i| table[i as usize].clone())
            .collect();
        assert_eq!(joined, text.as_bytes());
        assert!(ids
            .iter()
            .any(|&i| std::str::from_utf8(&table[i as usize]).is_err()));
        assert_eq!(table[2], b"<|im_end|>".to_vec());
    }
}

#[cfg(test)]
mod bos_tests {
    use super::*;

    fn tok() -> Tokenizer {
        let json = byte_level_json(1024);
        Tokenizer::from_bytes(json.as_bytes(), Path::new("synthetic")).unwrap()
    }

    #[test]
    fn add_bos_token_starts_plain_text_prompts_with_the_bos_id() {
        let t = tok();
        let bos = t.token_id("<|im_end|>").unwrap();
        let cfg = br#"{"add_bos_token": true, "bos_token": {"content": "<|im_end|>"}}"#;
        let t = t.with_bos_from_config(cfg, Path::new("c.json")).unwrap();
        assert_eq!(t.bos(), Some(bos));
        let plain = t.encode("hello").unwrap();
        let prompt = t.encode_prompt("hello").unwrap();
        assert_eq!(prompt[0], bos);
        assert_eq!(&prompt[1..], &plain[..]);
    }

    #[test]
    fn without_the_flag_a_prompt_is_its_text() {
        let cfg = br#"{"add_bos_token": false, "bos_token": "<|im_end|>"}"#;
        let t = tok()
            .with_bos_from_config(cfg, Path::new("c.json"))
            .unwrap();
        assert_eq!(t.bos(), None);
        assert_eq!(t.encode_prompt("hi").unwrap(), t.encode("hi").unwrap());
    }

    #[test]
    fn a_bos_token_outside_the_vocabulary_is_named() {
        let cfg = br#"{"add_bos_token": true, "bos_token": "<no such token>"}"#;
        let e = match tok().with_bos_from_config(cfg, Path::new("c.json")) {
            Ok(_) => panic!("a missing BOS token must be refused"),
            Err(e) => e.to_string(),
        };
        assert!(e.contains("<no such token>"), "{e}");
    }
}
