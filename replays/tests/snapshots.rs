//! The replay regression suite: every committed bundle in `replays/`, replayed
//! under the reference engine and under each catalog patch, against insta
//! snapshots in the top-level `snapshots/`. A behaviour change fails here; an
//! intentional one is reviewed with `cargo insta review` (and `lmrr rerecord`
//! for numeric changes). In CI (`CI` set, `INSTA_UPDATE=no`) nothing is written.

use lmrr_replays::Check;

const BUNDLES: [&str; 4] = ["incident", "long-recall", "multi-user", "sampled"];
const PATCH_SETS: [&str; 5] = [
    "none",
    "splitk-decode",
    "fast-exp",
    "abort-inserts-partial",
    "abort-frees-shared",
];

fn settings() -> insta::Settings {
    let mut s = insta::Settings::clone_current();
    s.set_snapshot_path("../../snapshots");
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
    for b in BUNDLES {
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

#[test]
fn replay_reports_match_their_snapshots() {
    settings().bind(|| {
        for b in BUNDLES {
            for p in PATCH_SETS {
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
