//! Tensor parallelism changes no bit: the rank simulator at degrees 2, 4
//! and 8 against the host executor at degree 1 (a separately loaded model
//! with tensor parallelism off), bitwise, on both synthetic families and on
//! every conformance fixture. Each (model, degree) is listed with what it
//! must do: run and match, or be refused because its heads or a row-parallel
//! slice do not split at that degree (the message must give the numbers).
//! Nothing is skipped: a new fixture or a changed outcome fails the test.

use std::path::Path;

use lmrr_engine::exec::tp::{TpConfig, TpError};
use lmrr_engine::{EngineError, LogitsWanted, Model, Preset, SeqKvStore, SeqSpan, SynthSpec};
use lmrr_kernels::Threads;

/// What a degree does on a model.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Want {
    /// Runs and gives the degree-1 bits.
    Same,
    /// Refused: heads that do not divide by the degree.
    Heads,
    /// Refused: a row-parallel slice off a chunk boundary.
    Chunk,
}
use Want::*;

/// Every model under test and its outcome at degrees 2, 4, 8. The fixtures
/// are 4 heads (2 KV heads) of 16: at degree 2 a rank's slice of `o_proj`'s
/// 64 inputs starts at 32, off the chunk of 64; deepseek_v3's MLA splits its
/// 4 heads at 2 and 4 (and runs once on rank 0 at 8), and its dense MLP's
/// 128 inputs split on chunks only in two.
const CASES: &[(&str, [Want; 3])] = &[
    ("synthetic:tiny", [Same, Heads, Heads]),
    ("synthetic:mini-v4-tiny", [Same, Same, Same]),
    ("llama", [Chunk, Heads, Heads]),
    ("llama_rope_llama3", [Chunk, Heads, Heads]),
    ("qwen2", [Chunk, Heads, Heads]),
    ("qwen3", [Chunk, Heads, Heads]),
    ("mistral", [Chunk, Heads, Heads]),
    ("gemma3_text", [Chunk, Heads, Heads]),
    ("mixtral", [Chunk, Heads, Heads]),
    ("qwen3_moe", [Chunk, Heads, Heads]),
    ("deepseek_v3", [Same, Chunk, Chunk]),
];

fn load(name: &str) -> Model {
    match name {
        "synthetic:tiny" => Model::synthetic(SynthSpec::new(Preset::Tiny, 0)).unwrap(),
        "synthetic:mini-v4-tiny" => {
            Model::synthetic(SynthSpec::new(Preset::MiniV4Tiny, 0)).unwrap()
        }
        f => Model::load_dir(
            &Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/fixtures/conformance")
                .join(f),
        )
        .unwrap(),
    }
}

fn tokens(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % (vocab as u64 - 3)) as u32 + 3
        })
        .collect()
}

/// Three sequences: prefill in uneven chunks side by side, then decode steps
/// of all three at once (past mini-v4's first sparse position); every wanted
/// row's bits in order.
pub(crate) fn workload(m: &Model) -> Vec<u32> {
    let th = Threads::new(2).unwrap();
    let vocab = m.net.vocab_size();
    let seqs: Vec<Vec<u32>> = [(1u64, 84usize), (2, 40), (3, 75)]
        .iter()
        .map(|&(s, n)| tokens(s, n, vocab))
        .collect();
    let mut kv = SeqKvStore::new(m.net.kv_layout());
    let mut pos = [0usize; 3];
    let mut out = Vec::new();
    let step =
        |kv: &mut SeqKvStore, parts: &[(usize, usize, LogitsWanted)], pos: &mut [usize; 3]| {
            let spans: Vec<SeqSpan> = parts
                .iter()
                .map(|&(s, n, logits)| SeqSpan {
                    seq: s as u64,
                    start: pos[s],
                    tokens: &seqs[s][pos[s]..pos[s] + n],
                    logits,
                })
                .collect();
            let rows = m.net.forward(kv, &spans, &th).unwrap();
            for &(s, n, _) in parts {
                pos[s] += n;
            }
            rows.into_iter()
                .flatten()
                .map(f32::to_bits)
                .collect::<Vec<u32>>()
        };
    out.extend(step(
        &mut kv,
        &[(0, 33, LogitsWanted::All), (1, 30, LogitsWanted::Last)],
        &mut pos,
    ));
    out.extend(step(
        &mut kv,
        &[(0, 37, LogitsWanted::All), (2, 64, LogitsWanted::All)],
        &mut pos,
    ));
    for _ in 0..10 {
        out.extend(step(
            &mut kv,
            &[
                (0, 1, LogitsWanted::All),
                (1, 1, LogitsWanted::All),
                (2, 1, LogitsWanted::All),
            ],
            &mut pos,
        ));
    }
    out
}

#[test]
fn every_degree_gives_the_degree_one_bits_or_is_refused_with_the_numbers() {
    let fixtures: Vec<String> =
        std::fs::read_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/conformance"))
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.path().is_dir())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
    for f in &fixtures {
        assert!(
            CASES.iter().any(|(n, _)| n == f),
            "fixture `{f}` has no tensor-parallel case"
        );
    }
    for (name, wants) in CASES {
        let base = workload(&load(name));
        for (degree, want) in [2usize, 4, 8].into_iter().zip(wants) {
            let mut m = load(name);
            let r = m.net.set_tp(TpConfig::degree(degree));
            match (want, r) {
                (Same, Ok(())) => {
                    assert_eq!(m.net.tp_degree(), degree);
                    let got = workload(&m);
                    assert_eq!(got.len(), base.len(), "{name} at degree {degree}");
                    let first = got.iter().zip(&base).position(|(a, b)| a != b);
                    assert_eq!(
                        first, None,
                        "{name} at degree {degree}: first differing logit"
                    );
                }
                (Heads, Err(EngineError::Tp(e @ TpError::Heads { .. }))) => {
                    let msg = e.to_string();
                    assert!(msg.contains(&format!("over {degree} ranks")), "{msg}");
                    assert_eq!(m.net.tp_degree(), 1, "{name}: a refused degree stays off");
                }
                (Chunk, Err(EngineError::Tp(e @ TpError::Chunk { .. }))) => {
                    let msg = e.to_string();
                    assert!(msg.contains("not on a chunk of 64"), "{msg}");
                    assert_eq!(m.net.tp_degree(), 1, "{name}: a refused degree stays off");
                }
                (want, got) => panic!("{name} at degree {degree}: want {want:?}, got {got:?}"),
            }
        }
    }
}

#[test]
fn an_injected_rank_failure_ends_the_step_with_the_rank_and_step() {
    let mut m = load("synthetic:tiny");
    m.net
        .set_tp(TpConfig {
            degree: 2,
            fail: Some((1, 1)),
        })
        .unwrap();
    let th = Threads::single();
    let mut kv = SeqKvStore::new(m.net.kv_layout());
    let toks = tokens(9, 4, m.net.vocab_size());
    let span = |i: usize| SeqSpan {
        seq: 1,
        start: i,
        tokens: &toks[i..i + 1],
        logits: LogitsWanted::All,
    };
    m.net.forward(&mut kv, &[span(0)], &th).unwrap();
    let e = m.net.forward(&mut kv, &[span(1)], &th).unwrap_err();
    assert!(
        matches!(
            e,
            EngineError::Tp(TpError::RankFailed {
                rank: 1,
                degree: 2,
                step: 1
            })
        ),
        "{e}"
    );
    assert_eq!(TpConfig::parse_fail("1:3"), Ok((1, 3)));
    assert!(TpConfig::parse_fail("one").is_err());
}

#[test]
fn degree_zero_is_refused() {
    let mut m = load("synthetic:tiny");
    assert!(matches!(
        m.net.set_tp(TpConfig::degree(0)),
        Err(EngineError::Tp(TpError::Degree(0)))
    ));
}
