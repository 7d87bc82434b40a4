//! The CLI's output, locked: the demo, `inspect`, a divergence report,
//! `--bisect` (a culprit and a refusal), the oracle and an error, each run
//! through the real binary from the repository root and snapshotted with insta
//! (`snapshots/cli__*.snap`). README.md's example blocks marked
//! `<!-- snapshot: NAME -->` must equal those snapshots (a first line
//! `$ lmrr …` shows the command), so the README cannot go stale.
//!
//! Filters: the only varying parts are bundle byte counts (the manifest holds
//! the build's git revision) and temporary paths.

use std::path::Path;
use std::process::Command;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// `(pattern, replacement)` applied to snapshots and README blocks alike.
const FILTERS: &[(&str, &str)] = &[(r"\b\d+ bytes \(", "[N] bytes (")];

fn filter(s: &str, tmp: Option<&Path>) -> String {
    let mut s = s.to_string();
    if let Some(t) = tmp {
        s = s.replace(&t.display().to_string(), "[TMP]");
    }
    for (pat, rep) in FILTERS {
        s = regex::Regex::new(pat)
            .unwrap()
            .replace_all(&s, *rep)
            .into_owned();
    }
    s
}

/// Runs `lmrr args` in the repository root with a cleared environment;
/// returns (exit code, stdout, stderr), filtered.
fn lmrr(args: &[&str], tmp: Option<&Path>) -> (i32, String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_lmrr"))
        .args(args)
        .current_dir(ROOT)
        .env_clear()
        .output()
        .unwrap();
    (
        o.status.code().unwrap_or(-1),
        filter(&String::from_utf8_lossy(&o.stdout), tmp),
        filter(&String::from_utf8_lossy(&o.stderr), tmp),
    )
}

fn settings() -> insta::Settings {
    let mut s = insta::Settings::clone_current();
    s.set_snapshot_path("../../snapshots");
    s.set_prepend_module_to_snapshot(false);
    s
}

fn snap(name: &str, body: &str) {
    settings().bind(|| insta::assert_snapshot!(format!("cli__{name}"), body));
}

#[test]
fn cli_output_is_locked() {
    let d = tempfile::tempdir().unwrap();
    let tmp = Some(d.path());

    let (code, out, _) = lmrr(&[], None);
    assert_eq!(code, 0);
    snap("demo", &out);

    let (code, out, _) = lmrr(&["inspect", "replays/incident.lmrr"], None);
    assert_eq!(code, 0);
    snap("inspect", &out);

    let (code, out, _) = lmrr(
        &[
            "replay",
            "replays/incident.lmrr",
            "--patches",
            "abort-inserts-partial",
        ],
        None,
    );
    assert_eq!(code, 1);
    snap("divergence", &out);

    let (code, out, _) = lmrr(&["replay", "replays/incident.lmrr", "--bisect"], None);
    assert_eq!(code, 0);
    snap("bisect", &out);

    let (code, out, _) = lmrr(
        &[
            "replay",
            "replays/multi-user.lmrr",
            "--bisect",
            "--patches",
            "fast-exp,splitk-decode",
        ],
        None,
    );
    assert_eq!(code, 2, "the bad set is clean by behaviour: refused");
    snap("bisect_refused", &out);

    let bad = d.path().join("bad.lmrr");
    let (code, _, err) = lmrr(
        &[
            "run",
            "--script",
            "examples/incident.toml",
            "--patches",
            "abort-inserts-partial",
            "--record",
            bad.to_str().unwrap(),
        ],
        tmp,
    );
    assert_eq!(code, 0, "{err}");
    let (code, out, _) = lmrr(
        &["replay", bad.to_str().unwrap(), "--oracle", "recompute"],
        tmp,
    );
    assert_eq!(code, 1);
    snap("oracle", &out);

    let (code, _, err) = lmrr(&["replay", "no-such.lmrr"], None);
    assert_eq!(code, 2);
    snap("error_missing_bundle", &err);
}

/// mini-v4's reports, locked: the incident recorded on `synthetic:mini-v4-tiny`
/// (into a temporary bundle) diverges under `indexer-early-exit` once a query
/// sees more than `index_topk` index blocks; bisect names it among the patches
/// that keep the incident's behaviour, and over the whole catalog names every
/// culprit round by round (mini-v4's own patches change tokens too); the
/// oracle, recomputing under the recording's patches, passes a bundle recorded
/// with it.
#[test]
fn mini_v4_cli_output_is_locked() {
    let d = tempfile::tempdir().unwrap();
    let tmp = Some(d.path());
    let (good, early) = (
        d.path().join("mini-v4.lmrr"),
        d.path().join("early-exit.lmrr"),
    );
    for (path, patches) in [(&good, "none"), (&early, "indexer-early-exit")] {
        let (code, _, err) = lmrr(
            &[
                "run",
                "--model",
                "synthetic:mini-v4-tiny",
                "--script",
                "examples/incident.toml",
                "--patches",
                patches,
                "--record",
                path.to_str().unwrap(),
            ],
            tmp,
        );
        assert_eq!(code, 0, "{err}");
    }
    let g = good.to_str().unwrap();

    let (code, out, _) = lmrr(&["replay", g, "--patches", "indexer-early-exit"], tmp);
    assert_eq!(code, 1);
    snap("mini_v4_divergence", &out);

    let (code, out, _) = lmrr(
        &[
            "replay",
            g,
            "--bisect",
            "--patches",
            "splitk-decode,fast-exp,abort-frees-shared,indexer-early-exit",
        ],
        tmp,
    );
    assert_eq!(code, 0);
    snap("mini_v4_bisect", &out);

    let (code, out, _) = lmrr(&["replay", g, "--bisect"], tmp);
    assert_eq!(code, 0, "every culprit of the whole catalog named: {out}");
    assert!(out.contains("culprits (3 rounds)"), "{out}");
    snap("mini_v4_bisect_all", &out);

    let (code, out, _) = lmrr(
        &["replay", early.to_str().unwrap(), "--oracle", "recompute"],
        tmp,
    );
    assert_eq!(
        code, 0,
        "the oracle recomputes under the recording's patches"
    );
    snap("mini_v4_oracle_blind", &out);
}

/// The body of `snapshots/cli__NAME.snap` (after insta's header).
fn snapshot_body(name: &str) -> String {
    let p = Path::new(ROOT).join(format!("snapshots/cli__{name}.snap"));
    let s = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    let body = s.splitn(3, "---\n").nth(2).expect("insta header");
    body.trim_end().to_string()
}

#[test]
fn readme_examples_match_the_snapshots() {
    let readme = std::fs::read_to_string(Path::new(ROOT).join("README.md")).unwrap();
    let mut checked = 0;
    let mut rest = readme.as_str();
    while let Some(at) = rest.find("<!-- snapshot: ") {
        rest = &rest[at + "<!-- snapshot: ".len()..];
        let name = &rest[..rest.find(" -->").expect("closed marker")];
        let start = rest
            .find("```text\n")
            .expect("a text block after the marker")
            + 8;
        let len = rest[start..].find("\n```").expect("closed block");
        // A first line `$ lmrr …` shows the command; the rest is its output.
        let block = &rest[start..start + len];
        let block = match block.strip_prefix("$ ") {
            Some(b) => b.split_once('\n').map_or("", |(_, out)| out),
            None => block,
        };
        assert_eq!(
            filter(block, None).trim_end(),
            snapshot_body(name),
            "README.md's `{name}` block differs from snapshots/cli__{name}.snap"
        );
        checked += 1;
    }
    assert!(
        checked >= 2,
        "README.md marks only {checked} example blocks"
    );
}

/// mini-v4: bisect over the whole catalog names each culprit of a committed
/// bundle in turn, and `--explain` shows what the early-exit indexer never
/// looked at.
#[test]
fn mini_v4_bisect_and_explain_are_locked() {
    let (code, out, _) = lmrr(&["replay", "replays/v4-agent.lmrr", "--bisect"], None);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains(
            "culprits (4 rounds): abort-inserts-partial; mhc-bf16; moe-routed-scaling; indexer-early-exit"
        ),
        "{out}"
    );
    snap("v4_bisect", &out);

    let (code, out, _) = lmrr(
        &[
            "replay",
            "replays/v4-batch.lmrr",
            "--bisect",
            "--criterion",
            "bits",
        ],
        None,
    );
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("mhc-bf16"), "{out}");
    snap("v4_bisect_bits", &out);

    let (code, out, _) = lmrr(
        &[
            "replay",
            "replays/v4-long-context.lmrr",
            "--patches",
            "indexer-early-exit",
            "--explain",
        ],
        None,
    );
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("never considered"), "{out}");
    snap("v4_explain", &out);
}
