//! Every conformance family at tensor-parallel degrees 2, 4 and 8, bitwise
//! against degree 1. The committed fixtures are too narrow to split (see
//! `tp.rs`, which holds their refusals), so each is widened here, in memory:
//! its config.json gets 16 query heads and 8 KV heads of 64 (so `o_proj`'s
//! 1,024 inputs split on chunks of 64 over 2, 4 or 8 ranks and the KV heads
//! divide by each) and a dense FFN width of 512 (64·8), and the tensors those
//! shapes change get seeded random values; every other tensor (embeddings,
//! norms, routers, experts, MLA's projections, the lm head) is the fixture's
//! own. deepseek_v3's Multi-head Latent Attention gets 8 heads (its
//! `q_b_proj`, `kv_b_proj` and `o_proj` widened), so it splits by heads at
//! every degree, and its dense FFN widens as the others'. Nothing is skipped: a fixture without a wide
//! case fails the test, and so does a widened model that is refused.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use lmrr_engine::exec::tp::TpConfig;
use lmrr_engine::model::weights::{write_safetensors, TensorBytes};
use lmrr_engine::{Model, ModelFiles};
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

use super::tp::workload;

/// Heads, KV heads and head width of a widened attention.
const HEADS: usize = 16;
const KV_HEADS: usize = 8;
const HEAD_DIM: usize = 64;
/// A dense FFN's width: its down projection's inputs split on chunks of 64
/// over 8 ranks.
const FFN: usize = 512;

/// MLA's heads when widened: one a rank at degree 8.
const MLA_HEADS: usize = 8;

/// How a fixture's attention widens.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Attn {
    /// Query, key and value heads ([`HEADS`], [`KV_HEADS`], [`HEAD_DIM`]).
    Heads,
    /// Multi-head Latent Attention's heads ([`MLA_HEADS`]; their widths as
    /// the fixture has them).
    Mla,
}

/// Each fixture and its attention.
const WIDE: &[(&str, Attn)] = &[
    ("llama", Attn::Heads),
    ("llama_rope_llama3", Attn::Heads),
    ("qwen2", Attn::Heads),
    ("qwen3", Attn::Heads),
    ("mistral", Attn::Heads),
    ("gemma3_text", Attn::Heads),
    ("mixtral", Attn::Heads),
    ("qwen3_moe", Attn::Heads),
    ("deepseek_v3", Attn::Mla),
];

/// A config's unsigned field.
fn field(config: &Value, name: &str) -> usize {
    config[name]
        .as_u64()
        .unwrap_or_else(|| panic!("config field `{name}`")) as usize
}

fn fixture_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/conformance")
        .join(name)
}

/// `n` values of a seeded xorshift stream, uniform in `[center - half,
/// center + half)`, as little-endian f32 bytes.
fn random_f32(seed: u64, n: usize, center: f32, half: f32) -> Vec<u8> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(n * 4);
    for _ in 0..n {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        let u = (s >> 40) as f32 / (1u64 << 24) as f32;
        out.extend_from_slice(&(center + half * (2.0 * u - 1.0)).to_le_bytes());
    }
    out
}

/// The widened shape of tensor `name` (`None`: the fixture's own), given
/// the fixture's config, how its attention widens and whether its dense FFN
/// does.
fn wide_shape(name: &str, config: &Value, attn: Option<Attn>, ffn: bool) -> Option<Vec<usize>> {
    let hidden = field(config, "hidden_size");
    let (q, kv) = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM);
    let at =
        |a: Attn, suffix: &str| attn == Some(a) && name.ends_with(&format!("self_attn.{suffix}"));
    let dense =
        |suffix: &str| ffn && !name.contains("expert") && name.ends_with(&format!("mlp.{suffix}"));
    let mla = |f: &str| MLA_HEADS * field(config, f);
    Some(match () {
        _ if at(Attn::Heads, "q_proj.weight") => vec![q, hidden],
        _ if at(Attn::Heads, "q_proj.bias") => vec![q],
        _ if at(Attn::Heads, "k_proj.weight") || at(Attn::Heads, "v_proj.weight") => {
            vec![kv, hidden]
        }
        _ if at(Attn::Heads, "k_proj.bias") || at(Attn::Heads, "v_proj.bias") => vec![kv],
        _ if at(Attn::Heads, "o_proj.weight") => vec![hidden, q],
        _ if at(Attn::Heads, "q_norm.weight") || at(Attn::Heads, "k_norm.weight") => {
            vec![HEAD_DIM]
        }
        _ if at(Attn::Mla, "q_b_proj.weight") => {
            vec![mla("qk_head_dim"), field(config, "q_lora_rank")]
        }
        _ if at(Attn::Mla, "kv_b_proj.weight") => vec![
            MLA_HEADS * (field(config, "qk_nope_head_dim") + field(config, "v_head_dim")),
            field(config, "kv_lora_rank"),
        ],
        _ if at(Attn::Mla, "o_proj.weight") => vec![hidden, mla("v_head_dim")],
        _ if dense("gate_proj.weight") || dense("up_proj.weight") => vec![FFN, hidden],
        _ if dense("down_proj.weight") => vec![hidden, FFN],
        _ => return None,
    })
}

/// The fixture `name` widened (module header), as a model in memory; also
/// how many of its tensors were replaced.
fn widened(name: &str, attn: Attn) -> (Model, usize) {
    let dir = fixture_dir(name);
    let mut config: Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    let mut shards: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    shards.sort();
    let bytes: Vec<Vec<u8>> = shards.iter().map(|p| std::fs::read(p).unwrap()).collect();
    let mut tensors: Vec<TensorBytes> = Vec::new();
    for b in &bytes {
        let st = SafeTensors::deserialize(b).unwrap();
        for (n, v) in st.tensors() {
            tensors.push((n, v.dtype(), v.shape().to_vec(), v.data().to_vec()));
        }
    }
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let ffn = tensors
        .iter()
        .any(|t| wide_shape(&t.0, &config, None, true).is_some());
    let mut replaced = 0;
    for (i, (n, dtype, shape, data)) in tensors.iter_mut().enumerate() {
        if let Some(s) = wide_shape(n, &config, Some(attn), ffn) {
            let count = s.iter().product::<usize>();
            *data = if n.ends_with("norm.weight") {
                random_f32(i as u64 + 1, count, 1.0, 0.25)
            } else {
                random_f32(
                    i as u64 + 1,
                    count,
                    0.0,
                    1.0 / (s[s.len() - 1] as f32).sqrt(),
                )
            };
            *dtype = Dtype::F32;
            *shape = s;
            replaced += 1;
        }
    }
    match attn {
        Attn::Heads => {
            config["num_attention_heads"] = HEADS.into();
            config["num_key_value_heads"] = KV_HEADS.into();
            config["head_dim"] = HEAD_DIM.into();
        }
        Attn::Mla => {
            config["num_attention_heads"] = MLA_HEADS.into();
            config["num_key_value_heads"] = MLA_HEADS.into();
        }
    }
    if ffn {
        config["intermediate_size"] = FFN.into();
    }
    let weights = write_safetensors(&tensors, &BTreeMap::new()).unwrap();
    let files = ModelFiles::in_memory(
        &format!("wide-{name}"),
        serde_json::to_vec(&config).unwrap(),
        std::fs::read(dir.join("tokenizer.json")).unwrap(),
        weights,
    );
    (Model::from_files(files).unwrap(), replaced)
}

#[test]
fn every_family_widened_gives_the_degree_one_bits_at_degrees_2_4_and_8() {
    for e in std::fs::read_dir(fixture_dir("")).unwrap() {
        let e = e.unwrap();
        if e.path().is_dir() {
            let f = e.file_name().to_string_lossy().into_owned();
            assert!(
                WIDE.iter().any(|(n, _)| *n == f),
                "fixture `{f}` has no widened case"
            );
        }
    }
    for &(name, attn) in WIDE {
        let (m, replaced) = widened(name, attn);
        // Attention widens in every layer (q, k, v, o at least), the dense
        // FFN in each dense layer: the model really changed shape.
        assert!(replaced >= 3, "{name}: {replaced} tensors widened");
        let base = workload(&m);
        for degree in [2usize, 4, 8] {
            let (mut m, _) = widened(name, attn);
            m.net
                .set_tp(TpConfig::degree(degree))
                .unwrap_or_else(|e| panic!("wide {name} at degree {degree}: {e}"));
            assert_eq!(m.net.tp_degree(), degree);
            let got = workload(&m);
            assert_eq!(got.len(), base.len(), "wide {name} at degree {degree}");
            let first = got.iter().zip(&base).position(|(a, b)| a != b);
            assert_eq!(
                first, None,
                "wide {name} at degree {degree}: first differing logit"
            );
        }
    }
}
