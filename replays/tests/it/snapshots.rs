//! The replay regression suite: every committed bundle in `replays/`, replayed
//! under the reference engine and under each catalog patch, against insta
//! snapshots in the top-level `snapshots/`. A behaviour change fails here; an
//! intentional one is reviewed with `cargo insta review` (and `lmrr rerecord`
//! for numeric changes). In CI (`CI` set, `INSTA_UPDATE=no`) nothing is written.

use lmrr_replays::Check;

/// Bundles recorded on the llama tiny model, replayed under every patch that
/// can act on a llama (the mini-v4 patches are inert there: checked once, in
/// `mini_v4_patches_are_inert_on_llama_bundles`).
const BUNDLES: [&str; 4] = ["incident", "long-recall", "multi-user", "sampled"];
const PATCH_SETS: [&str; 5] = [
    "none",
    "splitk-decode",
    "fast-exp",
    "abort-inserts-partial",
    "abort-frees-shared",
];
/// Bundles recorded on the mini-v4 tiny model, replayed under the whole
/// catalog: each shows one of the mini-v4 patches (`v4-batch`: mhc-bf16,
/// `v4-agent`: moe-routed-scaling, `v4-long-context`: indexer-early-exit).
const V4_BUNDLES: [&str; 3] = ["v4-batch", "v4-agent", "v4-long-context"];
const V4_PATCH_SETS: [&str; 8] = [
    "none",
    "splitk-decode",
    "fast-exp",
    "abort-inserts-partial",
    "abort-frees-shared",
    "mhc-bf16",
    "moe-routed-scaling",
    "indexer-early-exit",
];

/// Bundles recorded on a disaggregated deployment (llama tiny model),
/// replayed under the reference engine, the colocated cache patches and each
/// disaggregation patch (`pd-incident`: an abort mid-transfer, where
/// `pd-abort-reuses-pages` and `pd-abort-incomplete-kv` act;
/// `pd-incident-bug`: the same session recorded under
/// `pd-abort-reuses-pages`; `pd-leak`: aborts after the transfer, before
/// admission, where `pd-abort-leaks` acts).
const PD_BUNDLES: [&str; 3] = ["pd-incident", "pd-incident-bug", "pd-leak"];
const PD_PATCH_SETS: [&str; 6] = [
    "none",
    "abort-inserts-partial",
    "abort-frees-shared",
    "pd-abort-reuses-pages",
    "pd-abort-incomplete-kv",
    "pd-abort-leaks",
];

/// Bundles recorded on a GPU's tensor cores (`--numerics tensor-core-sm90
/// --device cuda`, llama tiny model): the CPU replays them by its model of
/// the instruction, under the reference engine and the llama patches.
const TC_BUNDLES: [&str; 2] = ["tc-incident", "tc-multi-user"];

fn settings() -> insta::Settings {
    let mut s = insta::Settings::clone_current();
    s.set_snapshot_path("../../../snapshots");
    s.set_prepend_module_to_snapshot(false);
    // Paths are volatile; the reports name bundles by file name already.
    s.add_filter(r"(/[^\s/]+)+/replays/", "replays/");
    s
}

fn bundle(name: &str) -> String {
    format!("{}/{name}.lmrr", env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn committed_bundles_are_small_and_complete() {
    for b in BUNDLES
        .into_iter()
        .chain(V4_BUNDLES)
        .chain(PD_BUNDLES)
        .chain(TC_BUNDLES)
    {
        let len = std::fs::metadata(bundle(b)).unwrap().len();
        assert!(
            len <= 200 * 1024,
            "{b}.lmrr is {len} bytes, the limit for committed bundles is 200 KB"
        );
        let r = Check::bundle(bundle(b)).run().unwrap();
        assert_eq!(r.integrity, "complete", "{b}");
        assert!(
            r.outcome.is_bit_exact(),
            "{b} must replay bit-exactly under its own patch set:\n{r}"
        );
    }
}

/// Each bundle's replay report under each patch set, against `{b}__{p}.snap`.
fn reports_match(bundles: &[&str], sets: &[&str]) {
    settings().bind(|| {
        for b in bundles {
            for p in sets {
                let report = Check::bundle(bundle(b))
                    .patches(p)
                    .unwrap()
                    .threads(2)
                    .run()
                    .unwrap();
                insta::assert_snapshot!(format!("{b}__{p}"), report.to_string());
            }
        }
    });
}

#[test]
fn replay_reports_match_their_snapshots() {
    reports_match(&BUNDLES, &PATCH_SETS);
}

#[test]
fn mini_v4_replay_reports_match_their_snapshots() {
    reports_match(&V4_BUNDLES, &V4_PATCH_SETS);
}

#[test]
fn mini_v4_patches_are_inert_on_llama_bundles() {
    for b in BUNDLES {
        let r = Check::bundle(bundle(b))
            .patches("mhc-bf16,moe-routed-scaling,indexer-early-exit")
            .unwrap()
            .threads(2)
            .run()
            .unwrap();
        assert!(r.outcome.is_bit_exact(), "{b}:\n{r}");
    }
}

#[test]
fn tensor_core_replay_reports_match_their_snapshots() {
    for b in TC_BUNDLES {
        let m = lmrr_recorder::open(std::path::Path::new(&bundle(b)))
            .unwrap()
            .manifest;
        assert_eq!(m.numerics, "tensor-core-sm90", "{b}");
    }
    reports_match(&TC_BUNDLES, &PATCH_SETS);
}

#[test]
fn disaggregated_replay_reports_match_their_snapshots() {
    reports_match(&PD_BUNDLES, &PD_PATCH_SETS);
}

/// The recompute oracle on the bundle recorded under
/// `pd-abort-reuses-pages` (no golden run: the bundle alone), and the
/// bisect over the catalog on the clean recording of the same session.
#[test]
fn disaggregated_oracle_and_bisect_match_their_snapshots() {
    use lmrr_engine::{Model, PatchSet};
    use lmrr_replays::{bisect_all, oracle, probe, rounds_text, Criterion, ReplayOptions};
    let th = lmrr_kernels::Threads::new(2).unwrap();
    let load = |name: &str| {
        let b = lmrr_recorder::open(std::path::Path::new(&bundle(name))).unwrap();
        let m = Model::synthetic(b.manifest.model.synthetic.unwrap()).unwrap();
        (b, m)
    };
    settings().bind(|| {
        let (b, m) = load("pd-incident-bug");
        let o = oracle(&b, &m, &ReplayOptions::new(PatchSet::none(), th.clone())).unwrap();
        let d = o.divergence().expect("the oracle flags the late writes");
        assert_eq!(d.request.as_deref(), Some("turn2"));
        insta::assert_snapshot!("pd-incident-bug__oracle", o.to_string());
        let (b, m) = load("pd-incident");
        let space: Vec<lmrr_engine::Patch> = PatchSet::all_for_deployment(m.net.family(), true)
            .iter()
            .collect();
        let mut f = |set: &PatchSet| probe(&b, &m, set, &th, Criterion::Behaviour);
        let rounds = bisect_all(&PatchSet::none(), &space, &mut f).unwrap();
        insta::assert_snapshot!("pd-incident__bisect", rounds_text(&rounds));
    });
}

/// A tensor-core bundle replayed by a model left in canonical numerics is
/// refused before any step runs, naming both modes; set to the recorded
/// mode (`set_recorded_numerics`) it replays bit-exactly.
#[test]
fn a_bundle_replays_only_under_its_recorded_numerics() {
    use lmrr_engine::{Model, PatchSet};
    use lmrr_replays::{replay, set_recorded_numerics, ReplayOptions};
    let b = lmrr_recorder::open(std::path::Path::new(&bundle("tc-multi-user"))).unwrap();
    let mut m = Model::synthetic(b.manifest.model.synthetic.unwrap()).unwrap();
    let opts = ReplayOptions::new(PatchSet::none(), lmrr_kernels::Threads::new(2).unwrap());
    let e = replay(&b, &m, &opts).unwrap_err().to_string();
    assert!(
        e.contains("recorded under `tensor-core-sm90` numerics and the model runs `canonical`"),
        "{e}"
    );
    set_recorded_numerics(&mut m, &b).unwrap();
    assert!(replay(&b, &m, &opts).unwrap().is_bit_exact());
}
