//! The real `lmrr` binary, run in a temp dir with a cleared environment. The
//! digests, recording, replay, bisect and oracle run on every family's tiny
//! model (`--model synthetic:tiny`, `synthetic:mini-v4-tiny`).

#[macro_use]
#[path = "../../engine/tests/common/families.rs"]
mod families;

use std::process::{Command, Output};

use families::cli_name;
use lmrr_engine::{Family, Preset};

per_family!(
    threads_and_prefill_chunks_give_one_digest,
    scalar_and_simd_engines_agree_end_to_end,
    sampling_is_seeded,
    gen_model_writes_identical_directories_that_generate_like_the_preset,
    a_prompt_longer_than_the_context_exits_2,
    run_plays_the_incident_script_with_one_digest_per_request,
    record_then_inspect_reports_counts_and_integrity,
    replay_exit_codes_reports_bisect_and_oracle,
    another_contract_version_is_refused_and_rerecord_refreshes_it,
);

fn lmrr(args: &[&str], env: &[(&str, &str)]) -> Output {
    let dir = tempfile::tempdir().unwrap();
    let mut c = Command::new(env!("CARGO_BIN_EXE_lmrr"));
    c.args(args).current_dir(dir.path()).env_clear();
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().unwrap()
}

fn digest(o: &Output) -> String {
    assert!(
        o.status.success(),
        "lmrr failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let out = String::from_utf8(o.stdout.clone()).unwrap();
    let last = out.lines().last().unwrap_or_default().to_string();
    let hex = last
        .strip_prefix("digest: ")
        .unwrap_or_else(|| panic!("no digest line in {out:?}"));
    assert_eq!(hex.len(), 64);
    assert!(hex.bytes().all(|b| b.is_ascii_hexdigit()));
    hex.to_string()
}

/// Past mini-v4's first sparse position (checked where it is used).
const LONG_PROMPT: &str = "In the beginning the engine was deterministic, and every logit was a pure function of the tokens before it; chunked or whole, batched or alone, one thread or three.";

/// `LONG_PROMPT`'s tokens reach the family's sparse attention, if it has one.
fn long_prompt_reaches_sparse(p: Preset) {
    let m = families::model(p);
    let n = m.tokenizer.encode(LONG_PROMPT).unwrap().len();
    families::assert_reaches_sparse(m, n, "LONG_PROMPT");
}

#[test]
fn bare_lmrr_runs_the_incident_demo() {
    let o = lmrr(&[], &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8(o.stdout).unwrap();
    for want in [
        "synthetic:tiny:seed0",
        "bit-exact: 180 steps, 180 tokens",
        "DIVERGED at step 60: first signal: cache-state hash",
        "turn2 (turn 2)",
        "culprit (binary, 5 replays): abort-inserts-partial",
        "recompute oracle",
    ] {
        assert!(out.contains(want), "missing {want:?} in\n{out}");
    }
}

fn threads_and_prefill_chunks_give_one_digest(p: Preset) {
    long_prompt_reaches_sparse(p);
    let model = cli_name(p);
    let base = digest(&lmrr(
        &[
            "generate",
            "--model",
            &model,
            "--prompt",
            LONG_PROMPT,
            "--max-tokens",
            "20",
            "--threads",
            "1",
        ],
        &[],
    ));
    for extra in [
        vec!["--threads", "2"],
        vec!["--threads", "3"],
        vec!["--prefill-chunk", "1"],
        vec!["--prefill-chunk", "7", "--threads", "2"],
        vec!["--prefill-chunk", "64", "--threads", "3"],
        vec!["--prefill-chunk", "23", "--threads", "2"],
    ] {
        let mut args = vec![
            "generate",
            "--model",
            &model,
            "--prompt",
            LONG_PROMPT,
            "--max-tokens",
            "20",
        ];
        args.extend(&extra);
        assert_eq!(digest(&lmrr(&args, &[])), base, "{extra:?}");
    }
}

fn scalar_and_simd_engines_agree_end_to_end(p: Preset) {
    long_prompt_reaches_sparse(p);
    let model = cli_name(p);
    let args = [
        "generate",
        "--model",
        &model,
        "--prompt",
        LONG_PROMPT,
        "--max-tokens",
        "16",
        "--temperature",
        "0.7",
        "--seed",
        "3",
    ];
    assert_eq!(
        digest(&lmrr(&args, &[("LMRR_FORCE_SCALAR", "1")])),
        digest(&lmrr(&args, &[]))
    );
}

fn sampling_is_seeded(p: Preset) {
    let model = cli_name(p);
    let run = |seed: &str| {
        digest(&lmrr(
            &[
                "generate",
                "--model",
                &model,
                "--max-tokens",
                "24",
                "--temperature",
                "1.0",
                "--top-p",
                "0.9",
                "--seed",
                seed,
            ],
            &[],
        ))
    };
    assert_eq!(run("5"), run("5"));
    assert_ne!(run("5"), run("6"));
}

fn gen_model_writes_identical_directories_that_generate_like_the_preset(p: Preset) {
    let d = tempfile::tempdir().unwrap();
    let (a, b) = (d.path().join("a"), d.path().join("b"));
    for dir in [&a, &b] {
        let o = lmrr(
            &[
                "gen-model",
                "--arch",
                p.family().model_type(),
                "--preset",
                "tiny",
                "--seed",
                "0",
                "--out",
                dir.to_str().unwrap(),
            ],
            &[],
        );
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    for f in ["config.json", "tokenizer.json", "model.safetensors"] {
        assert!(
            std::fs::read(a.join(f)).unwrap() == std::fs::read(b.join(f)).unwrap(),
            "{f} differs"
        );
    }
    let from_dir = digest(&lmrr(&["generate", "--model", a.to_str().unwrap()], &[]));
    let preset = digest(&lmrr(&["generate", "--model", &cli_name(p)], &[]));
    assert_eq!(from_dir, preset);
    // llama's tiny preset is the embedded default model.
    if p.family() == Family::Llama {
        assert_eq!(from_dir, digest(&lmrr(&["generate"], &[])));
    }
}

#[test]
fn bad_input_exits_2_with_a_clear_message() {
    let o = lmrr(&["generate", "--model", "/nonexistent/model-dir"], &[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("/nonexistent/model-dir"));

    let o = lmrr(
        &[
            "gen-model",
            "--arch",
            "mistral",
            "--preset",
            "tiny",
            "--out",
            "x",
        ],
        &[],
    );
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("mistral"));

    let o = lmrr(&["generate", "--threads", "0"], &[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("at least 1"));
}

/// A prompt over the model's context (llama tiny: 2,048; mini-v4 tiny:
/// 4,096) is refused with both numbers.
fn a_prompt_longer_than_the_context_exits_2(p: Preset) {
    let context = families::model(p).net.context();
    let n = context + 952;
    let long = " a".repeat(n);
    let o = lmrr(
        &["generate", "--model", &cli_name(p), "--prompt", &long],
        &[],
    );
    assert_eq!(o.status.code(), Some(2));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        e.contains(&format!("context is {context}"))
            && e.contains(&format!("prompt is {n} tokens")),
        "{e}"
    );
}

fn run_plays_the_incident_script_with_one_digest_per_request(p: Preset) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/incident.toml");
    let model = cli_name(p);
    let run = |extra: &[&str]| {
        let mut args = vec!["run", "--model", &model, "--script", script];
        args.extend(extra);
        let o = lmrr(&args, &[]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let out = String::from_utf8(o.stdout).unwrap();
        assert!(
            out.contains("=== turn1") && out.contains("=== turn2") && out.contains("interrupted"),
            "{out}"
        );
        out.lines()
            .filter(|l| l.starts_with("digest: "))
            .map(String::from)
            .collect::<Vec<_>>()
    };
    let base = run(&[]);
    assert_eq!(base.len(), 2);
    // Cache off, tiny pages, a one-token budget: same bits.
    assert_eq!(run(&["--no-prefix-cache", "--threads", "1"]), base);
    assert_eq!(
        run(&[
            "--page-size",
            "1",
            "--pool-pages",
            "1024",
            "--max-batch-tokens",
            "1",
            "--threads",
            "3"
        ]),
        base
    );
    // Pages of 7 and a 5-token budget: chunks and pages across index blocks.
    assert_eq!(
        run(&[
            "--page-size",
            "7",
            "--max-batch-tokens",
            "5",
            "--threads",
            "2"
        ]),
        base
    );
}

#[test]
fn run_refuses_a_bad_script_with_exit_2() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("bad.toml");
    std::fs::write(
        &p,
        "[[request]]\nid = \"a\"\nprompt = \"x\"\nafter = \"nobody\"\n",
    )
    .unwrap();
    let o = lmrr(&["run", "--script", p.to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(2));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(e.contains("bad.toml:4") && e.contains("nobody"), "{e}");
}

fn record_then_inspect_reports_counts_and_integrity(p: Preset) {
    let d = tempfile::tempdir().unwrap();
    let b = d.path().join("s.lmrr");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/incident.toml");
    let o = lmrr(
        &[
            "run",
            "--model",
            &cli_name(p),
            "--script",
            script,
            "--record",
            b.to_str().unwrap(),
        ],
        &[],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = lmrr(&["inspect", b.to_str().unwrap()], &[]);
    assert!(o.status.success());
    let out = String::from_utf8(o.stdout).unwrap();
    assert!(
        out.contains("2 requests · 1 follow-up turn · 1 interrupt ·"),
        "{out}"
    );
    assert!(out.contains("integrity   complete"), "{out}");
    let o = lmrr(&["inspect", "--json", b.to_str().unwrap()], &[]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["summary"]["generated_tokens"], 60 + 120);
    assert_eq!(v["manifest"]["model"]["synthetic"]["preset"], p.name());
    // A foreign file: exit 2, says what it is not.
    std::fs::write(d.path().join("x.lmrr"), b"hello world").unwrap();
    let o = lmrr(&["inspect", d.path().join("x.lmrr").to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("not an lmrr bundle"));
}

#[test]
fn a_recorder_killed_with_sigkill_leaves_a_readable_truncated_bundle() {
    let d = tempfile::tempdir().unwrap();
    let script = d.path().join("long.toml");
    let mut s = String::new();
    for i in 0..40 {
        s += &format!("[[request]]\nid = \"r{i}\"\nprompt = \"request {i}\"\nmax_tokens = 1900\nignore_eos = true\n");
        if i > 0 {
            s += &format!("after = \"r{}\"\n", i - 1);
        }
    }
    std::fs::write(&script, s).unwrap();
    let b = d.path().join("killed.lmrr");
    let mut child = Command::new(env!("CARGO_BIN_EXE_lmrr"))
        .args([
            "run",
            "--script",
            script.to_str().unwrap(),
            "--record",
            b.to_str().unwrap(),
            "--threads",
            "1",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let t0 = std::time::Instant::now();
    while std::fs::metadata(&b).map_or(0, |m| m.len()) < 20_000 {
        assert!(t0.elapsed().as_secs() < 60, "recorder wrote nothing");
        assert!(
            child.try_wait().unwrap().is_none(),
            "the session ended before it could be killed"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let o = lmrr(&["inspect", b.to_str().unwrap()], &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8(o.stdout).unwrap();
    assert!(out.contains("TRUNCATED"), "{out}");
    assert!(!out.contains(" 0 steps"), "{out}");
}

/// Exit codes and reports of replay, bisect and the oracle on the incident.
/// Bisect over the family's whole catalog: llama's names
/// `abort-inserts-partial`; mini-v4's own patches change the incident's
/// tokens too, so there every culprit is named round by round, and a bad set
/// of the patches that keep the incident's behaviour plus `indexer-early-exit`
/// names that one alone.
fn replay_exit_codes_reports_bisect_and_oracle(p: Preset) {
    let d = tempfile::tempdir().unwrap();
    let model = cli_name(p);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/incident.toml");
    let (good, bad) = (d.path().join("good.lmrr"), d.path().join("bad.lmrr"));
    for (path, patches) in [(&good, "none"), (&bad, "abort-inserts-partial")] {
        let o = lmrr(
            &[
                "run",
                "--model",
                &model,
                "--script",
                script,
                "--record",
                path.to_str().unwrap(),
                "--patches",
                patches,
            ],
            &[],
        );
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    let g = good.to_str().unwrap();
    let o = lmrr(&["replay", g], &[]);
    assert_eq!(o.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&o.stdout).contains("bit-exact: 180 steps, 180 tokens"));

    let o = lmrr(&["replay", g, "--patches", "abort-inserts-partial"], &[]);
    assert_eq!(o.status.code(), Some(1));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("cache-state hash")
            && out.contains(&format!(
                "repro     lmrr replay {g} --patches abort-inserts-partial"
            )),
        "{out}"
    );

    let o = lmrr(&["replay", g, "--patches", "fast-exp", "--json"], &[]);
    assert_eq!(o.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["verdict"], "diverged");
    assert_eq!(v["signal"], "logits");
    assert!(v["drift"][0]["max_abs_dlogit"].as_f64().unwrap() > 0.0);

    let o = lmrr(&["replay", g, "--bisect"], &[]);
    let out = String::from_utf8_lossy(&o.stdout);
    match p.family() {
        Family::Llama => {
            assert_eq!(o.status.code(), Some(0), "{out}");
            assert!(
                out.contains("bisect over 4 candidate patches")
                    && out.contains("culprit (binary, 5 replays): abort-inserts-partial"),
                "{out}"
            );
        }
        Family::MiniV4 => {
            // Several independent culprits: the search goes on over the rest
            // round by round and names each (the cache bug, and the mini-v4
            // patches that change tokens on this session; `mhc-bf16` moves
            // logits here without changing a token).
            assert_eq!(o.status.code(), Some(0), "{out}");
            assert!(
                out.contains("bisect over 7 candidate patches")
                    && out.contains("culprits (3 rounds): abort-inserts-partial; moe-routed-scaling; indexer-early-exit"),
                "{out}"
            );
            let o = lmrr(
                &[
                    "replay",
                    g,
                    "--bisect",
                    "--patches",
                    "splitk-decode,fast-exp,abort-frees-shared,indexer-early-exit",
                ],
                &[],
            );
            let out = String::from_utf8_lossy(&o.stdout);
            assert_eq!(o.status.code(), Some(0), "{out}");
            // good + bad + ⌈log2 4⌉ halvings + the culprit + the rest without it.
            let re = regex::Regex::new(r"culprit \(binary, (\d+) replays\): indexer-early-exit\n")
                .unwrap();
            let n: usize = re.captures(&out).expect("a culprit")[1].parse().unwrap();
            assert!(n <= 6, "{out}");
        }
        other => panic!("no test preset of {other}"),
    }
    let o = lmrr(
        &[
            "replay",
            g,
            "--bisect",
            "--patches",
            "fast-exp,splitk-decode",
        ],
        &[],
    );
    assert_eq!(
        o.status.code(),
        Some(2),
        "no behavioural culprit among numerical patches: the bad set is clean, refused"
    );
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("refused: the bad set")
            && out.contains("same behaviour; logits differ from step"),
        "{out}"
    );
    assert!(
        !out.lines()
            .any(|l| l.contains("(bad)") && l.contains("bit-exact")),
        "a probe judged by behaviour is not bit-exact: {out}"
    );
    let o = lmrr(
        &[
            "replay",
            g,
            "--bisect",
            "--criterion",
            "bits",
            "--patches",
            "fast-exp,splitk-decode",
        ],
        &[],
    );
    assert_eq!(o.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&o.stdout).contains("culprit (binary, 4 replays): fast-exp"));
    // A bundle recorded with the bug: the empty good set already diverges,
    // so nothing is blamed (the reported bug named `splitk-decode`).
    let b = bad.to_str().unwrap();
    let o = lmrr(&["replay", b, "--bisect", "--good", "none"], &[]);
    assert_eq!(o.status.code(), Some(2));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("refused: the good set `none` already diverges"),
        "{out}"
    );
    assert!(!out.contains("culprit ("), "{out}");

    let b = bad.to_str().unwrap();
    let o = lmrr(&["replay", b, "--oracle", "recompute"], &[]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stdout).contains("turn2 (turn 2)"));
    let o = lmrr(&["replay", g, "--oracle", "recompute"], &[]);
    assert_eq!(o.status.code(), Some(0));

    // Another model: refused with both hashes, exit 2.
    let other = format!("{model}:7");
    let o = lmrr(&["replay", g, "--model", &other], &[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("model mismatch"));
    let o = lmrr(&["replay", g, "--patches", "no-such-patch"], &[]);
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn patches_lists_the_catalog() {
    let o = lmrr(&["patches"], &[]);
    assert!(o.status.success());
    let out = String::from_utf8(o.stdout).unwrap();
    for p in lmrr_engine::Patch::CATALOG {
        assert!(out.contains(p.name()), "{out}");
    }
    assert!(out.contains("Semantic, mini-v4"), "{out}");
    assert!(out.contains("disaggregated deployments"), "{out}");
}

/// Rewrites a bundle with `edit` applied to its manifest.
fn rewrite_manifest(
    src: &std::path::Path,
    dst: &std::path::Path,
    edit: impl FnOnce(&mut lmrr_recorder::Manifest),
) {
    let b = lmrr_recorder::open(src).unwrap();
    let mut m = b.manifest.clone();
    edit(&mut m);
    let mut w = lmrr_recorder::BundleWriter::new(Vec::new(), &m, 8).unwrap();
    for e in b.events {
        w.push(e).unwrap();
    }
    std::fs::write(dst, w.finish().unwrap()).unwrap();
}

fn another_contract_version_is_refused_and_rerecord_refreshes_it(p: Preset) {
    let d = tempfile::tempdir().unwrap();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/incident.toml");
    let (cur, old, new) = (
        d.path().join("cur.lmrr"),
        d.path().join("old.lmrr"),
        d.path().join("new.lmrr"),
    );
    assert!(lmrr(
        &[
            "run",
            "--model",
            &cli_name(p),
            "--script",
            script,
            "--record",
            cur.to_str().unwrap()
        ],
        &[]
    )
    .status
    .success());
    rewrite_manifest(&cur, &old, |m| m.contract_version = 0);
    let o = lmrr(&["replay", old.to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(2));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        e.contains("contract v0") && e.contains("implements v1") && e.contains("lmrr rerecord"),
        "{e}"
    );

    let o = lmrr(
        &[
            "rerecord",
            old.to_str().unwrap(),
            "--out",
            new.to_str().unwrap(),
        ],
        &[],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("contract v0 → v1") && out.contains("0 request(s) changed"),
        "{out}"
    );
    assert_eq!(
        lmrr(&["replay", new.to_str().unwrap()], &[]).status.code(),
        Some(0)
    );

    // A change in what the session does is shown per request.
    let changed = d.path().join("changed.lmrr");
    rewrite_manifest(&cur, &changed, |m| {
        m.source.script = m
            .source
            .script
            .replace("max_tokens = 120", "max_tokens = 50")
    });
    let o = lmrr(
        &[
            "rerecord",
            changed.to_str().unwrap(),
            "--out",
            changed.to_str().unwrap(),
        ],
        &[],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("turn2: CHANGED from output token 50: 120 → 50 tokens")
            && out.contains("turn1: 60 tokens, unchanged"),
        "{out}"
    );
    assert!(!d.path().join("changed.lmrr.partial").exists());
}

#[test]
fn a_livelocked_run_stops_with_a_report_and_a_complete_bundle() {
    let d = tempfile::tempdir().unwrap();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/livelock.toml");
    let b = d.path().join("livelock.lmrr");
    let args = |patches: &'static str| {
        vec![
            "run",
            "--script",
            script,
            "--page-size",
            "7",
            "--pool-pages",
            "17",
            "--patches",
            patches,
        ]
    };
    let mut a = args("abort-frees-shared");
    a.extend(["--record", b.to_str().unwrap()]);
    let t0 = std::time::Instant::now();
    let o = lmrr(&a, &[]);
    assert_eq!(
        o.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(t0.elapsed().as_secs() < 60, "took {:?}", t0.elapsed());
    let err = String::from_utf8_lossy(&o.stderr);
    for want in [
        "livelock: no request made progress for 4096 steps",
        "pool: 0 of 17 pages free",
        "waiting (2), starved:",
        "holds every step up to the livelock",
    ] {
        assert!(err.contains(want), "missing {want:?} in {err}");
    }
    // The bundle is complete (trailer written) and replays bit-exactly.
    let o = lmrr(&["inspect", b.to_str().unwrap()], &[]);
    assert!(o.status.success() && !String::from_utf8_lossy(&o.stdout).contains("TRUNCATED"));
    let o = lmrr(&["replay", b.to_str().unwrap()], &[]);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
    // Without the patch the same session completes.
    let o = lmrr(&args("none"), &[]);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn generate_chat_sends_marker_characters_as_text_on_a_model_with_its_own_template() {
    let d = tempfile::tempdir().unwrap();
    let m = d.path().join("m");
    let o = lmrr(
        &[
            "gen-model",
            "--preset",
            "tiny",
            "--out",
            m.to_str().unwrap(),
        ],
        &[],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    std::fs::write(
        m.join("tokenizer_config.json"),
        r#"{"chat_template": "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}{{ '<|im_start|>assistant\n' }}"}"#,
    )
    .unwrap();
    let user = "keep \u{F8F0}turn1\u{F8F1} and \u{F8F0} as text";
    let o = lmrr(
        &[
            "generate",
            "--model",
            m.to_str().unwrap(),
            "--chat",
            "--prompt",
            user,
            "--max-tokens",
            "1",
        ],
        &[],
    );
    digest(&o);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.starts_with(&format!(
            "<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
        )),
        "{out}"
    );
}

#[test]
fn max_tokens_zero_exits_2_in_generate_and_in_run() {
    let o = lmrr(&["generate", "--max-tokens", "0"], &[]);
    assert_eq!(o.status.code(), Some(2));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        e.contains("--max-tokens 0") && e.contains("at least 1"),
        "{e}"
    );
    let d = tempfile::tempdir().unwrap();
    let s = d.path().join("s.toml");
    std::fs::write(
        &s,
        "[[request]]\nid = \"a\"\nprompt = \"x\"\nmax_tokens = 0\n",
    )
    .unwrap();
    let o = lmrr(&["run", "--script", s.to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(2));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        e.contains("request `a`") && e.contains("max_tokens = 0") && e.contains("at least 1"),
        "{e}"
    );
}

/// A session recorded under tensor-core numerics says so in its manifest
/// (a canonical one says canonical), replays bit-exactly under them (the
/// CPU model of the instruction) and is re-recorded under them; an unknown
/// mode and a model that cannot run it are refused with the reason.
#[test]
fn tensor_core_numerics_are_recorded_and_replayed() {
    let d = tempfile::tempdir().unwrap();
    let b = d.path().join("tc.lmrr");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/multi-user.toml");
    let run = |numerics: &str, out: &std::path::Path| {
        lmrr(
            &[
                "run",
                "--script",
                script,
                "--numerics",
                numerics,
                "--record",
                out.to_str().unwrap(),
            ],
            &[],
        )
    };
    let o = run("tensor-core-sm90", &b);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = lmrr(&["inspect", b.to_str().unwrap()], &[]);
    let out = String::from_utf8(o.stdout).unwrap();
    assert!(out.contains("numerics    tensor-core-sm90"), "{out}");
    let o = lmrr(&["replay", b.to_str().unwrap(), "--threads", "1"], &[]);
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert_eq!(o.status.code(), Some(0), "{out}{err}");
    assert!(out.contains("bit-exact"), "{out}");
    assert!(
        err.contains("numerics: tensor-core-sm90, as recorded"),
        "{err}"
    );
    // rerecord re-runs it in the same arithmetic.
    let b2 = d.path().join("tc2.lmrr");
    let o = lmrr(
        &[
            "rerecord",
            b.to_str().unwrap(),
            "--out",
            b2.to_str().unwrap(),
        ],
        &[],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let c = d.path().join("canonical.lmrr");
    assert!(run("canonical", &c).status.success());
    let numerics_of = |p: &std::path::Path| {
        let o = lmrr(&["inspect", "--json", p.to_str().unwrap()], &[]);
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        v["manifest"]["numerics"].as_str().unwrap().to_string()
    };
    assert_eq!(numerics_of(&b), "tensor-core-sm90");
    assert_eq!(numerics_of(&b2), "tensor-core-sm90");
    assert_eq!(numerics_of(&c), "canonical");
    // An unknown mode and an f32 model are refused, exit 2, naming why.
    let o = lmrr(&["generate", "--numerics", "tensor-core-sm91"], &[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("unknown (known: canonical, tensor-core-sm90)")
    );
    let m = d.path().join("f32");
    let o = lmrr(
        &[
            "gen-model",
            "--preset",
            "tiny",
            "--dtype",
            "f32",
            "--out",
            m.to_str().unwrap(),
        ],
        &[],
    );
    assert!(o.status.success());
    let o = lmrr(
        &[
            "generate",
            "--model",
            m.to_str().unwrap(),
            "--numerics",
            "tensor-core-sm90",
        ],
        &[],
    );
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("stored as f32"), "{err}");
}

/// A session run at `--tp 2` records the degree (inspect says it), replays
/// bit-exactly at `--tp 1` (replay names both degrees); a rank failure
/// injected by `LMRR_TP_FAIL` ends the run with exit 2 naming the rank and
/// step, and leaves a complete bundle that replays bit-exactly.
#[test]
fn the_tp_degree_is_recorded_and_a_rank_failure_leaves_a_complete_bundle() {
    let d = tempfile::tempdir().unwrap();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/multi-user.toml");
    let run = |out: &std::path::Path, env: &[(&str, &str)]| {
        let args = ["run", "--script", script, "--tp", "2", "--record"];
        let mut args = args.to_vec();
        args.push(out.to_str().unwrap());
        lmrr(&args, env)
    };
    let inspect = |p: &std::path::Path| {
        let o = lmrr(&["inspect", p.to_str().unwrap()], &[]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8(o.stdout).unwrap()
    };
    let replay_at = |p: &std::path::Path, tp: &str| {
        let o = lmrr(&["replay", p.to_str().unwrap(), "--tp", tp], &[]);
        let (out, err) = (
            String::from_utf8_lossy(&o.stdout).into_owned(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        );
        assert_eq!(o.status.code(), Some(0), "{out}{err}");
        assert!(out.contains("bit-exact"), "{out}");
        err
    };
    let b = d.path().join("tp2.lmrr");
    let o = run(&b, &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = inspect(&b);
    assert!(out.contains("tp          2 ranks"), "{out}");
    let err = replay_at(&b, "1");
    assert!(
        err.contains("recorded at degree 2, replayed at degree 1"),
        "{err}"
    );
    // Re-recorded, the session keeps the degree it was recorded at.
    let rr = d.path().join("rerecorded.lmrr");
    let o = lmrr(
        &[
            "rerecord",
            b.to_str().unwrap(),
            "--out",
            rr.to_str().unwrap(),
        ],
        &[],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = inspect(&rr);
    assert!(out.contains("tp          2 ranks"), "{out}");
    // The HTML page names the degree too (a degree-1 page is unchanged).
    let page = d.path().join("tp2.html");
    let o = lmrr(
        &[
            "inspect",
            b.to_str().unwrap(),
            "--html",
            page.to_str().unwrap(),
        ],
        &[],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let html = std::fs::read_to_string(&page).unwrap();
    assert!(html.contains("at tensor-parallel degree 2"), "{html}");
    let f = d.path().join("failed.lmrr");
    let o = run(&f, &[("LMRR_TP_FAIL", "1:7")]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("rank 1 of 2 failed at step 7"), "{err}");
    let out = inspect(&f);
    assert!(
        out.contains("integrity   complete") && out.contains("· 7 steps"),
        "{out}"
    );
    replay_at(&f, "2");
}
