//! The mini-v4 family on its own terms: the generator's determinism, the
//! config checks, and the early-exit indexer's amnesia on a long context.

use std::sync::OnceLock;

use lmrr_engine::mini_v4::indexer::Selection;
use lmrr_engine::{KvCache, LogitsWanted, Model, PatchSet, Preset, SeqKvStore, SeqSpan, SynthSpec};
use lmrr_kernels::Threads;

fn model() -> &'static Model {
    static M: OnceLock<Model> = OnceLock::new();
    M.get_or_init(|| Model::synthetic(SynthSpec::new(Preset::MiniV4Tiny, 0)).unwrap())
}

/// Deterministic tokens (ids 3..1000).
fn tokens(seed: u64, n: usize) -> Vec<u32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % 997) as u32 + 3
        })
        .collect()
}

/// Bits of the logits at the last position of `toks`, prefilled in chunks of 256.
fn last_logits(m: &Model, toks: &[u32], patches: &PatchSet) -> Vec<u32> {
    let th = Threads::new(2).unwrap();
    let mut kv = SeqKvStore::new(m.net.kv_layout());
    let mut last = Vec::new();
    let n = toks.len();
    for (ci, part) in toks.chunks(256).enumerate() {
        let span = SeqSpan {
            seq: 1,
            start: kv.len(1),
            tokens: part,
            logits: if (ci + 1) * 256 >= n {
                LogitsWanted::Last
            } else {
                LogitsWanted::None
            },
        };
        last = m
            .net
            .forward_patched(&mut kv, &[span], &th, patches)
            .unwrap()
            .remove(0);
    }
    last.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn gen_model_is_byte_identical_for_a_seed_and_differs_across_seeds() {
    let preset = Preset::MiniV4Tiny;
    let a = SynthSpec::new(preset, 0).build();
    let b = SynthSpec::new(preset, 0).build();
    assert_eq!(a.config, b.config);
    assert!(a.weight_bytes() == b.weight_bytes());
    let c = SynthSpec::new(preset, 1).build();
    assert!(a.weight_bytes() != c.weight_bytes());
    let m = model();
    assert_eq!(m.net.family(), lmrr_engine::Family::MiniV4);
    let n = m.net.param_count();
    assert!((2_000_000..6_000_000).contains(&n), "{n} parameters");
}

/// A mini-v4 config with one field replaced, loaded from a directory.
fn load_with(field: &str, value: serde_json::Value) -> String {
    let d = tempfile::tempdir().unwrap();
    SynthSpec::new(Preset::MiniV4Tiny, 0)
        .write_dir(d.path())
        .unwrap();
    let p = d.path().join("config.json");
    let mut cfg: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    cfg[field] = value;
    std::fs::write(&p, serde_json::to_vec(&cfg).unwrap()).unwrap();
    match Model::load_dir(d.path()) {
        Ok(_) => panic!("{field} = {cfg} loaded"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn inconsistent_configs_are_refused_naming_the_field_and_both_numbers() {
    let e = load_with("num_experts_per_tok", 9.into());
    assert!(
        e.contains("num_experts_per_tok") && e.contains('9') && e.contains("n_routed_experts = 8"),
        "{e}"
    );
    let e = load_with("hc_mult", 0.into());
    assert!(e.contains("hc_mult") && e.contains("= 0"), "{e}");
    let e = load_with("index_block_size", 0.into());
    assert!(e.contains("index_block_size") && e.contains("= 0"), "{e}");
    let e = load_with("n_hash_layers", 5.into());
    assert!(
        e.contains("n_hash_layers") && e.contains('5') && e.contains("num_hidden_layers = 4"),
        "{e}"
    );
    let e = load_with("model_type", "mini-v5".into());
    assert!(e.contains("model_type") && e.contains("mini-v5"), "{e}");
}

#[test]
fn every_patch_point_changes_the_logits_and_early_exit_only_on_long_contexts() {
    let m = model();
    let short = tokens(3, 60);
    let long = tokens(3, 300);
    let none = PatchSet::none();
    for (patch, on_short) in [
        ("mhc-bf16", true),
        ("moe-routed-scaling", true),
        ("indexer-early-exit", false),
    ] {
        let p = PatchSet::parse(patch).unwrap();
        assert_eq!(
            last_logits(m, &short, &p) != last_logits(m, &short, &none),
            on_short,
            "{patch} on a 60-token context (4 index blocks of 16 = dense)"
        );
        assert_ne!(
            last_logits(m, &long, &p),
            last_logits(m, &long, &none),
            "{patch} on a 300-token context"
        );
    }
}

/// The incident's signature on a long context: under the reference engine a
/// token early in the context, in a block the indexer selects, matters to the
/// last position; under `indexer-early-exit` it does not, bit for bit.
#[test]
fn early_exit_forgets_an_early_token_that_the_reference_reads() {
    let m = model();
    let v4 = m.mini_v4().unwrap();
    let th = Threads::new(2).unwrap();
    let n = 1600;
    let toks = tokens(11, n);
    let last = n - 1;
    let none = PatchSet::none();
    let early = PatchSet::parse("indexer-early-exit").unwrap();
    let block = v4.config().index_block_size;
    let nb = last / block + 1;

    // Blocks the reference indexer chose for the last position, in any layer,
    // well before anything early exit scans.
    let chosen = v4.chosen_blocks(&toks, last, &th, &none).unwrap();
    let far: Vec<usize> = chosen
        .iter()
        .flat_map(|c| match &c.selection {
            Selection::Sparse { blocks, scanned } => {
                assert_eq!(*scanned, nb, "the reference scores every block");
                blocks.clone()
            }
            Selection::Dense => panic!("1600 positions are beyond the dense range"),
        })
        .filter(|&b| b < nb / 2)
        .collect();
    let b = *far
        .first()
        .expect("the reference reads some block in the first half of the context");

    // Under the patch, the same position never scores the first half.
    for c in v4.chosen_blocks(&toks, last, &th, &early).unwrap() {
        match c.selection {
            Selection::Sparse { blocks, scanned } => {
                assert!(
                    scanned < nb / 2,
                    "layer {}: {scanned} blocks scanned",
                    c.layer
                );
                assert!(blocks.iter().all(|&x| x >= nb / 2), "layer {}", c.layer);
            }
            Selection::Dense => panic!("layer {}: dense", c.layer),
        }
    }

    let mut changed = toks.clone();
    let at = b * block + 1;
    changed[at] = if toks[at] == 500 { 501 } else { 500 };
    assert_ne!(
        last_logits(m, &toks, &none),
        last_logits(m, &changed, &none),
        "reference: the token at {at} (block {b}, chosen) changes the last logits"
    );
    assert_eq!(
        last_logits(m, &toks, &early),
        last_logits(m, &changed, &early),
        "indexer-early-exit: the token at {at} changes nothing"
    );
}

/// Where the context has no more than index_topk blocks, the patch is exact:
/// how it passed single-turn checks.
#[test]
fn early_exit_is_exact_on_a_short_context() {
    let m = model();
    let v4 = m.mini_v4().unwrap();
    let dense = v4.config().index_topk * v4.config().index_block_size;
    let early = PatchSet::parse("indexer-early-exit").unwrap();
    for len in [1, 17, dense - 1, dense] {
        let t = tokens(len as u64, len);
        assert_eq!(
            last_logits(m, &t, &early),
            last_logits(m, &t, &PatchSet::none()),
            "{len} tokens"
        );
    }
}

#[test]
fn explain_lists_the_chosen_blocks_per_layer() {
    let m = model();
    let th = Threads::new(2).unwrap();
    let toks = tokens(5, 400);
    let reference = m
        .net
        .explain(&toks, 399, &th, &PatchSet::none())
        .unwrap()
        .unwrap();
    let patched = m
        .net
        .explain(
            &toks,
            399,
            &th,
            &PatchSet::parse("indexer-early-exit").unwrap(),
        )
        .unwrap()
        .unwrap();
    assert_eq!(reference.lines().count(), 1 + 4, "{reference}");
    assert!(reference.contains("layer 3: blocks ["), "{reference}");
    assert!(reference.contains("25 of 25 scored"), "{reference}");
    assert!(patched.contains("never considered"), "{patched}");
    assert!(!reference.contains("never considered"), "{reference}");
}
