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
    for b in BUNDLES.into_iter().chain(V4_BUNDLES) {
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
