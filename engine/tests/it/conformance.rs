//! Conformance against transformers, the definition of each architecture.
//!
//! Each directory under `tests/fixtures/conformance/` is a tiny random
//! checkpoint written by transformers' own `save_pretrained` with its float64
//! logits for three prompts (`scripts/conformance/make_fixtures.py`, which
//! also records the transformers and torch versions in `conformance.json`).
//! For every implemented family lmrr loads the directory as a user's, runs the
//! prompts on the CPU and must agree with transformers within the named
//! tolerances below, and must keep the determinism contract bitwise on it:
//! I1 run to run, I2 batched vs alone, I3 prefill in chunks of 1, 3 and all,
//! I4 prefix pages shared (a radix-cache hit) vs recompute, I5 one vs two
//! threads, and the KV page size.
//!
//! Nothing skips: a fixture directory must be listed either as implemented
//! (and then pass) or as pending (a family being written), so adding a
//! fixture without deciding fails [`every_fixture_is_implemented_or_pending`].

use std::path::{Path, PathBuf};

use lmrr_engine::pool::{BlockTable, PagePool, PagedKv};
use lmrr_engine::{KvCache, LogitsWanted, Model, SeqKvStore, SeqSpan};
use lmrr_kernels::Threads;

/// Fixture directories whose family lmrr runs: each must pass every test here.
pub const FAMILIES_IMPLEMENTED: &[&str] = &[
    "llama",
    "llama_rope_llama3",
    "qwen2",
    "qwen3",
    "mistral",
    "gemma3_text",
    "mixtral",
    "qwen3_moe",
    "deepseek_v3",
];

/// Fixture directories whose family is being written: listed so that they
/// are decided, moved to [`FAMILIES_IMPLEMENTED`] as each lands.
pub const FAMILIES_PENDING: &[&str] = &[];

/// Largest |lmrr − transformers| allowed on any logit. transformers runs in
/// float64 from the same float32 weights; lmrr runs float32 activations in its
/// canonical reduction order, and its RoPE table is rounded to float32 from
/// float64 where transformers computes angles in float32. Over a few layers of
/// width 64 with logits of order 1–40 that moves logits by about 1e-6 to 1e-5;
/// a wrong formula (a missing norm, a wrong RoPE frequency, a mis-scaled
/// softmax) moves them by 1e-2 and more. 1e-4 sits between with room on
/// both sides.
const MAX_ABS_DLOGIT: f64 = 1e-4;

/// Top-1 must agree wherever transformers' top-2 margin exceeds this: a
/// smaller margin can flip within [`MAX_ABS_DLOGIT`] (twice it, one logit
/// moving each way) without any error in lmrr.
const TOP1_MARGIN: f64 = 2.0 * MAX_ABS_DLOGIT;

fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/conformance")
}

/// One fixture: its directory, prompts and transformers' logits per prompt
/// (`(len, vocab)` row-major each).
struct Fixture {
    dir: PathBuf,
    prompts: Vec<Vec<u32>>,
    logits: Vec<Vec<f64>>,
    vocab: usize,
}

fn fixture(name: &str) -> Fixture {
    let dir = fixtures_dir().join(name);
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("conformance.json")).unwrap()).unwrap();
    let vocab = manifest["vocab_size"].as_u64().unwrap() as usize;
    let raw = std::fs::read(dir.join("logits.f64")).unwrap();
    let mut prompts = Vec::new();
    let mut logits = Vec::new();
    for p in manifest["prompts"].as_array().unwrap() {
        let ids: Vec<u32> = p["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        let off = p["offset"].as_u64().unwrap() as usize;
        let n = ids.len() * vocab;
        let l: Vec<f64> = raw[off..off + 8 * n]
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        prompts.push(ids);
        logits.push(l);
    }
    Fixture {
        dir,
        prompts,
        logits,
        vocab,
    }
}

fn load(f: &Fixture) -> Model {
    Model::load_dir(&f.dir).unwrap_or_else(|e| panic!("{}: {e}", f.dir.display()))
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Logits of every position of `toks`, one sequence alone, fed in `chunk`s.
fn all_logits(m: &Model, toks: &[u32], chunk: usize, th: &Threads) -> Vec<f32> {
    let mut kv = SeqKvStore::new(m.net.kv_layout());
    let mut out = Vec::new();
    for part in toks.chunks(chunk) {
        let span = SeqSpan {
            seq: 7,
            start: kv.len(7),
            tokens: part,
            logits: LogitsWanted::All,
        };
        out.extend(m.net.forward(&mut kv, &[span], th).unwrap().remove(0));
    }
    out
}

#[test]
fn every_fixture_is_implemented_or_pending() {
    let mut found: Vec<String> = std::fs::read_dir(fixtures_dir())
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.path().is_dir())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    found.sort();
    for name in &found {
        let (i, p) = (
            FAMILIES_IMPLEMENTED.contains(&name.as_str()),
            FAMILIES_PENDING.contains(&name.as_str()),
        );
        assert!(i ^ p, "fixture `{name}`: implemented {i}, pending {p}");
    }
    for name in FAMILIES_IMPLEMENTED.iter().chain(FAMILIES_PENDING) {
        assert!(found.iter().any(|f| f == name), "no fixture `{name}`");
    }
}

#[test]
fn implemented_families_agree_with_transformers() {
    let th = Threads::new(2).unwrap();
    for name in FAMILIES_IMPLEMENTED {
        let f = fixture(name);
        let m = load(&f);
        assert_eq!(m.net.vocab_size(), f.vocab, "{name}");
        let (mut max_d, mut agree, mut judged, mut rows) = (0f64, 0, 0, 0);
        for (ids, want) in f.prompts.iter().zip(&f.logits) {
            let got = all_logits(&m, ids, ids.len(), &th);
            assert_eq!(got.len(), want.len(), "{name}");
            for (g, w) in got.chunks(f.vocab).zip(want.chunks(f.vocab)) {
                rows += 1;
                for (a, b) in g.iter().zip(w) {
                    max_d = max_d.max((*a as f64 - b).abs());
                }
                let top = |r: &[f64]| {
                    let mut i: Vec<usize> = (0..r.len()).collect();
                    i.sort_by(|&x, &y| r[y].total_cmp(&r[x]).then(x.cmp(&y)));
                    (i[0], r[i[0]] - r[i[1]])
                };
                let g64: Vec<f64> = g.iter().map(|&x| x as f64).collect();
                let ((wt, margin), (gt, _)) = (top(w), top(&g64));
                if margin > TOP1_MARGIN {
                    judged += 1;
                    assert_eq!(gt, wt, "{name}: top-1 differs with margin {margin}");
                    agree += 1;
                }
            }
        }
        eprintln!(
            "{name}: max |Δlogit| {max_d:.3e} (limit {MAX_ABS_DLOGIT:e}); top-1 equal at {agree}/{judged} positions with margin > {TOP1_MARGIN:e} ({rows} positions)"
        );
        assert!(
            max_d < MAX_ABS_DLOGIT,
            "{name}: max |Δlogit| {max_d} against transformers"
        );
    }
}

/// A pool with `ps`-position pages for up to `seqs` sequences of `n` positions.
fn paged(m: &Model, ps: usize, seqs: usize, n: usize) -> PagedKv {
    PagedKv::new(PagePool::new(ps, seqs * n.div_ceil(ps), m.net.kv_layout()).unwrap())
}

/// Feeds `toks` as sequence `id` from what `kv` holds of it on, in pieces of
/// `piece`; the logits bits of the positions fed.
fn feed(m: &Model, kv: &mut PagedKv, id: u64, toks: &[u32], piece: usize) -> Vec<u32> {
    let th = Threads::new(2).unwrap();
    let mut out = Vec::new();
    while kv.len(id) < toks.len() {
        let at = kv.len(id);
        let len = piece.min(toks.len() - at);
        let ps = kv.pool.page_size();
        let t = kv.tables.entry(id).or_default();
        while t.pages.len() * ps < t.len + len {
            t.pages
                .push(kv.pool.alloc().unwrap().expect("pool sized for it"));
        }
        let span = SeqSpan {
            seq: id,
            start: at,
            tokens: &toks[at..at + len],
            logits: LogitsWanted::All,
        };
        let r = m.net.forward(kv, &[span], &th).unwrap();
        kv.finish_step();
        out.extend(bits(&r[0]));
    }
    out
}

#[test]
fn implemented_families_keep_the_contract_bitwise() {
    let two = Threads::new(2).unwrap();
    for name in FAMILIES_IMPLEMENTED {
        let f = fixture(name);
        let m = load(&f);
        let long = f.prompts.iter().max_by_key(|p| p.len()).unwrap();
        let short = f.prompts.iter().min_by_key(|p| p.len()).unwrap();
        let whole = bits(&all_logits(&m, long, long.len(), &two));
        // I1: run to run, and a second instance loaded from disk.
        assert_eq!(
            bits(&all_logits(&m, long, long.len(), &two)),
            whole,
            "{name} I1"
        );
        assert_eq!(
            bits(&all_logits(&load(&f), long, long.len(), &two)),
            whole,
            "{name} I1"
        );
        // I3: chunks of 1, 3 and all.
        for chunk in [1, 3] {
            assert_eq!(
                bits(&all_logits(&m, long, chunk, &two)),
                whole,
                "{name} I3 chunk {chunk}"
            );
        }
        // I5: one thread.
        assert_eq!(
            bits(&all_logits(&m, long, long.len(), &Threads::single())),
            whole,
            "{name} I5"
        );
        // I2: batched with another sequence, fed in other pieces.
        let mut kv = SeqKvStore::new(m.net.kv_layout());
        let (mut at, mut mate_at, mut got) = (0, 0, Vec::new());
        for step in 0.. {
            if at == long.len() {
                break;
            }
            let len = [5, 1, 9][step % 3].min(long.len() - at);
            let mut spans = vec![SeqSpan {
                seq: 1,
                start: at,
                tokens: &long[at..at + len],
                logits: LogitsWanted::All,
            }];
            if mate_at < short.len() {
                spans.push(SeqSpan {
                    seq: 2,
                    start: mate_at,
                    tokens: &short[mate_at..mate_at + 1],
                    logits: LogitsWanted::Last,
                });
                mate_at += 1;
            }
            let r = step % spans.len();
            spans.rotate_left(r);
            let outs = m.net.forward(&mut kv, &spans, &two).unwrap();
            let i = spans.iter().position(|s| s.seq == 1).unwrap();
            got.extend(bits(&outs[i]));
            at += len;
        }
        assert_eq!(got, whole, "{name} I2");
        // Page sizes, and I4: a second sequence sharing the first's full
        // pages of a common prefix reads them instead of recomputing.
        let shared = long.len() / 2;
        let other = [&long[..shared], &short[..]].concat();
        let want_other = bits(&all_logits(&m, &other, other.len(), &two));
        for ps in [1, 4, 16] {
            let mut kv = paged(&m, ps, 2, long.len().max(other.len()));
            assert_eq!(
                feed(&m, &mut kv, 1, long, 7),
                whole,
                "{name} page size {ps}"
            );
            let full = shared / ps;
            let pages = kv.tables[&1].pages[..full].to_vec();
            for &p in &pages {
                kv.pool.incref(p);
            }
            kv.tables.insert(
                3,
                BlockTable {
                    len: full * ps,
                    pages,
                },
            );
            assert_eq!(
                feed(&m, &mut kv, 3, &other, 5),
                want_other[full * ps * f.vocab..],
                "{name} I4 page size {ps}, {} positions from shared pages",
                full * ps
            );
        }
    }
}
