//! Model identity by content: what a bundle's manifest names, so that a replay
//! runs on the model it was recorded on, and only on that one.
//!
//! Three SHA-256 digests, each over a canonical encoding of what the engine
//! computes with, never over file bytes:
//!
//! - **config**: the `config.json` fields that change the arithmetic or the
//!   run (dimensions, `rms_norm_eps` and `rope_theta` bits, tied embeddings,
//!   activation, context length, BOS/EOS ids), one `key=value` line each. A
//!   storage note (`torch_dtype`) or a field the engine ignores does not count.
//! - **tokenizer**: `tokenizer.json` and, when present, `tokenizer_config.json`
//!   (the chat template), each parsed and written back as compact JSON with
//!   sorted keys, so whitespace and key order do not count.
//! - **weights**: every tensor the forward pass reads, in name order: its name,
//!   its shape and its values exactly as the kernels see them, as little-endian
//!   f32 (bf16 widened, GGUF blocks dequantized — both exact). A `--dtype keep`
//!   import (Q8_0 blocks in place) and an f32 import of the same GGUF therefore
//!   share this digest; a bf16 import, whose values are rounded, does not.
//!
//! Invariant: two models with the same identity compute the same logits, bit
//! for bit (the kernels see the same config and the same f32 values), whatever
//! file layout, dtype or header order they were stored in. Every encoding
//! starts with a versioned tag (`lmrr-…-v1`); changing one changes every
//! identity and so needs a new bundle format version.
//!
//! Cost: one pass over the weights, tensors hashed in parallel on the
//! available cores; [`crate::Model::identity`] caches the result per process.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicUsize, Ordering};

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use sha2::{Digest, Sha256};

use crate::model::{ModelFamily, TensorValues};
use crate::LlamaConfig;

/// A SHA-256 digest: always 32 bytes, so every formatting of it is total.
/// Serialised as 32 bytes in binary formats (bundles) and as 64 lowercase hex
/// digits in human-readable ones (`inspect --json`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Sha256Digest(pub [u8; 32]);

impl Sha256Digest {
    /// SHA-256 of `bytes`.
    pub fn of(bytes: &[u8]) -> Self {
        Self(Sha256::digest(bytes).into())
    }

    /// All 64 hex digits.
    pub fn hex(&self) -> String {
        crate::digest::hex(&self.0)
    }

    /// The first 16 hex digits, for one-line messages.
    pub fn short(&self) -> String {
        crate::digest::hex(&self.0[..8])
    }

    /// Parses 64 hex digits (either case).
    pub fn from_hex(s: &str) -> Result<Self, String> {
        let b = s.as_bytes();
        if b.len() != 64 {
            return Err(format!(
                "a SHA-256 digest has 64 hex digits, this has {}",
                b.len()
            ));
        }
        let nibble = |c: u8| match c {
            b'0'..=b'9' => Ok(c - b'0'),
            b'a'..=b'f' => Ok(c - b'a' + 10),
            b'A'..=b'F' => Ok(c - b'A' + 10),
            _ => Err(format!("`{}` is not a hex digit", c.escape_ascii())),
        };
        let mut out = [0u8; 32];
        for (i, o) in out.iter_mut().enumerate() {
            *o = nibble(b[2 * i])? << 4 | nibble(b[2 * i + 1])?;
        }
        Ok(Self(out))
    }
}

impl std::fmt::Display for Sha256Digest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.hex())
    }
}

impl std::fmt::Debug for Sha256Digest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Sha256Digest({})", self.hex())
    }
}

impl Serialize for Sha256Digest {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if s.is_human_readable() {
            s.serialize_str(&self.hex())
        } else {
            self.0.serialize(s)
        }
    }
}

impl<'de> Deserialize<'de> for Sha256Digest {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        if d.is_human_readable() {
            let s = String::deserialize(d)?;
            Self::from_hex(&s).map_err(serde::de::Error::custom)
        } else {
            <[u8; 32]>::deserialize(d).map(Self)
        }
    }
}

/// What a model is, by content (see the module docs for each digest).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelIdentity {
    pub config_sha256: Sha256Digest,
    pub weights_sha256: Sha256Digest,
    pub tokenizer_sha256: Sha256Digest,
}

impl std::fmt::Display for ModelIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "config {} · weights {} · tokenizer {}",
            self.config_sha256.short(),
            self.weights_sha256.short(),
            self.tokenizer_sha256.short()
        )
    }
}

/// The canonical text the config digest is taken over: one `key=value` line
/// per field that matters, floats as their bits.
pub fn config_text(cfg: &LlamaConfig) -> String {
    let eos = crate::config::TokenIds::canonical(cfg.eos_token_id.as_ref());
    let mut t = String::from("lmrr-config-v1\nfamily=llama\n");
    let mut line = |k: &str, v: &dyn std::fmt::Display| {
        // Writing to a String cannot fail.
        let _ = writeln!(t, "{k}={v}");
    };
    line("hidden_size", &cfg.hidden_size);
    line("intermediate_size", &cfg.intermediate_size);
    line("num_hidden_layers", &cfg.num_hidden_layers);
    line("num_attention_heads", &cfg.num_attention_heads);
    line("num_key_value_heads", &cfg.n_kv_heads());
    line("head_dim", &cfg.head_dim());
    line("vocab_size", &cfg.vocab_size);
    line("max_position_embeddings", &cfg.max_position_embeddings);
    line(
        "rms_norm_eps",
        &format_args!("f32:{:08x}", cfg.rms_norm_eps.to_bits()),
    );
    line(
        "rope_theta",
        &format_args!("f64:{:016x}", cfg.rope_theta.to_bits()),
    );
    line("tie_word_embeddings", &cfg.tie_word_embeddings);
    line("hidden_act", &cfg.hidden_act);
    line(
        "bos_token_id",
        &cfg.bos_token_id.map_or("none".into(), |b| b.to_string()),
    );
    line("eos_token_ids", &format_args!("{eos:?}"));
    // Only a scaled RoPE adds a line, so unscaled configs keep their digest;
    // the object is the resolved one (`LlamaConfig` writes every value out)
    // as compact JSON with sorted keys.
    if let Some(s) = cfg.rope_scaling.as_ref().filter(|s| !s.is_null()) {
        line("rope_scaling", s);
    }
    t
}

/// Digest of [`config_text`].
pub fn config_digest(cfg: &LlamaConfig) -> Sha256Digest {
    Sha256Digest::of(config_text(cfg).as_bytes())
}

/// JSON re-written compactly with sorted keys; bytes that are not JSON are
/// taken as they are (the loader has already refused those for the tokenizer).
fn canonical_json(bytes: &[u8]) -> Vec<u8> {
    serde_json::from_slice::<serde_json::Value>(bytes)
        .ok()
        .and_then(|v| serde_json::to_vec(&v).ok())
        .unwrap_or_else(|| bytes.to_vec())
}

/// Digest of the tokenizer and, when present, the chat template's file.
pub fn tokenizer_digest(tokenizer_json: &[u8], tokenizer_config: Option<&[u8]>) -> Sha256Digest {
    let mut h = Sha256::new();
    let mut part = |tag: &[u8], bytes: &[u8]| {
        h.update(tag);
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(bytes);
    };
    part(b"lmrr-tokenizer-v1", &canonical_json(tokenizer_json));
    if let Some(tc) = tokenizer_config {
        part(b"tokenizer_config", &canonical_json(tc));
    }
    Sha256Digest(h.finalize().into())
}

/// Elements hashed per SHA-256 update (bounds the scratch buffers).
const CHUNK: usize = 1 << 14;

/// Digest of one tensor: tag, name, shape, then its f32 values.
fn tensor_digest(name: &str, shape: &[usize], values: &TensorValues<'_>) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(b"lmrr-tensor-v1");
    h.update((name.len() as u64).to_le_bytes());
    h.update(name.as_bytes());
    h.update((shape.len() as u64).to_le_bytes());
    for &d in shape {
        h.update((d as u64).to_le_bytes());
    }
    let mut bytes = Vec::with_capacity(4 * CHUNK);
    let mut put = |vals: &[f32]| {
        for c in vals.chunks(CHUNK) {
            bytes.clear();
            bytes.extend(c.iter().flat_map(|v| v.to_bits().to_le_bytes()));
            h.update(&bytes);
        }
    };
    match values {
        TensorValues::F32(v) => put(v),
        TensorValues::Stored(t) => {
            let m = t.matrix();
            // Whole rows per update, about CHUNK elements at a time.
            let per = (CHUNK / m.cols.max(1)).max(1);
            let mut row = vec![0.0f32; per * m.cols];
            for r0 in (0..m.rows).step_by(per) {
                let n = per.min(m.rows - r0);
                for (i, out) in row.chunks_mut(m.cols).take(n).enumerate() {
                    m.row_into(r0 + i, out, true);
                }
                put(&row[..n * m.cols]);
            }
        }
    }
    h.finalize().into()
}

/// Digest of every tensor `net` computes with (see the module docs).
/// Tensors are hashed in parallel on up to `workers` threads; the result does
/// not depend on how many.
pub fn weights_digest(net: &dyn ModelFamily, workers: usize) -> Sha256Digest {
    let mut tensors = net.named_tensors();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let next = AtomicUsize::new(0);
    let mut digests = vec![[0u8; 32]; tensors.len()];
    let workers = workers.clamp(1, tensors.len().max(1));
    let done: Vec<Vec<(usize, [u8; 32])>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                s.spawn(|| {
                    let mut mine = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some((name, shape, values)) = tensors.get(i) else {
                            return mine;
                        };
                        mine.push((i, tensor_digest(name, shape, values)));
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    for (i, d) in done.into_iter().flatten() {
        digests[i] = d;
    }
    let mut h = Sha256::new();
    h.update(b"lmrr-weights-v1");
    h.update((tensors.len() as u64).to_le_bytes());
    for d in &digests {
        h.update(d);
    }
    Sha256Digest(h.finalize().into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_round_trip_through_hex_and_refuse_malformed_text() {
        let d = Sha256Digest::of(b"abc");
        // FIPS 180-2, appendix B.1.
        assert_eq!(
            d.hex(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(d.short(), "ba7816bf8f01cfea");
        assert_eq!(Sha256Digest::from_hex(&d.hex().to_uppercase()), Ok(d));
        let json = serde_json::to_string(&d).unwrap();
        assert_eq!(json, format!("\"{}\"", d.hex()));
        assert_eq!(serde_json::from_str::<Sha256Digest>(&json).unwrap(), d);
        for bad in ["", "ab", &"g".repeat(64), &"a".repeat(63), &"é".repeat(32)] {
            assert!(Sha256Digest::from_hex(bad).is_err(), "{bad:?}");
            assert!(serde_json::from_str::<Sha256Digest>(&format!("\"{bad}\"")).is_err());
        }
    }

    #[test]
    fn config_text_ignores_storage_and_names_every_arithmetic_field() {
        let mut a = crate::SynthSpec::embedded_default().llama_config().unwrap();
        let mut b = a.clone();
        b.torch_dtype = Some("gguf".into());
        b.architectures.clear();
        assert_eq!(config_digest(&a), config_digest(&b));
        // `eos_token_id` as an integer or a one-element list is one config.
        a.eos_token_id = Some(crate::config::TokenIds::Many(vec![2]));
        assert_eq!(config_digest(&a), config_digest(&b));
        b.rope_theta = 10_000.0;
        assert_ne!(config_digest(&a), config_digest(&b));
        let t = config_text(&a);
        assert!(t.contains("rope_theta=f64:40f86a0000000000\n"), "{t}");
        assert!(
            t.contains("head_dim=32\n") && t.contains("eos_token_ids=[2]\n"),
            "{t}"
        );
    }

    #[test]
    fn tokenizer_digest_ignores_whitespace_and_key_order() {
        let a = tokenizer_digest(br#"{"a": 1, "b": [1, 2]}"#, None);
        let b = tokenizer_digest(b"{\"b\":[1,2],\n \"a\":1}", None);
        assert_eq!(a, b);
        assert_ne!(a, tokenizer_digest(br#"{"a": 1, "b": [2, 1]}"#, None));
        assert_ne!(
            a,
            tokenizer_digest(br#"{"a": 1, "b": [1, 2]}"#, Some(b"{}"))
        );
    }
}
