//! The incident on a real model: SmolLM2-135M-Instruct forgets the user's name
//! under `abort-frees-shared`, replay shows where, and a token-criterion bisect
//! over the catalog names the patch. Ignored by default (it needs the model:
//! `scripts/get-smollm2.sh`, or `LMRR_SMOLLM2=DIR`); `.ci/run` adds
//! `--include-ignored` when it fetched the model.

use std::path::PathBuf;

use lmrr_engine::{run_session, EngineConfig, Model, Patch, PatchSet, Scheduler, Script};
use lmrr_kernels::Threads;
use lmrr_recorder::{read, Manifest, Recorder};
use lmrr_replays::{bisect, probe, replay, Criterion, ReplayOptions};

/// The imported model's directory. The tests that call this are ignored by
/// default; run with `--include-ignored` they fail, naming the path, when the
/// model is absent.
fn model_dir() -> PathBuf {
    let dir = std::env::var_os("LMRR_SMOLLM2")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .map(|h| PathBuf::from(h).join(".cache/lmrr/smollm2-135m-instruct"))
        })
        .expect("LMRR_SMOLLM2 or HOME is set");
    assert!(
        dir.join("model.safetensors").is_file(),
        "no SmolLM2 at {} (run scripts/get-smollm2.sh, or set LMRR_SMOLLM2)",
        dir.display()
    );
    dir
}

#[test]
#[ignore = "needs SmolLM2: scripts/get-smollm2.sh, then --include-ignored"]
fn smollm2_forgets_under_abort_frees_shared_and_bisect_names_it() {
    let dir = model_dir();
    let m = Model::load_dir(&dir).unwrap();
    let src = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/zorblax.toml"
    ))
    .unwrap();
    let script = Script::parse(&src, "zorblax.toml").unwrap();
    let th = Threads::new(2).unwrap();
    let cfg = EngineConfig::default();
    let run = |patches: PatchSet| {
        let manifest = Manifest::for_session(
            &m,
            cfg,
            &patches,
            "zorblax.toml",
            &src,
            5,
            2,
            "test",
            "test",
        );
        let mut sch = Scheduler::with_patches(m.net(), cfg, th.clone(), patches).unwrap();
        sch.set_top_logprobs(5);
        let mut rec = Recorder::new(Vec::new(), &manifest).unwrap();
        let res = run_session(&m, &script, &mut sch, |e| rec.observe(e)).unwrap();
        let answer = m
            .tokenizer
            .decode(&res.requests.last().unwrap().output.tokens)
            .unwrap();
        (read(&rec.finish().unwrap()).unwrap(), answer)
    };
    let (good, answer) = run(PatchSet::none());
    assert!(
        answer.contains("Zorblax") && answer.contains("teal"),
        "reference answer: {answer}"
    );
    let (_, forgot) = run(PatchSet::parse("abort-frees-shared").unwrap());
    assert!(
        !forgot.contains("Zorblax"),
        "patched answer still recalls: {forgot}"
    );

    let o = replay(
        &good,
        &m,
        &ReplayOptions::new(PatchSet::parse("abort-frees-shared").unwrap(), th.clone()),
    )
    .unwrap();
    assert!(!o.is_bit_exact(), "{o}");
    let mut p = |set: &PatchSet| probe(&good, &m, set, &th, Criterion::Tokens);
    let res = bisect(&PatchSet::none(), &Patch::ALL, &mut p).unwrap();
    assert_eq!(res.culprits, Some(vec!["abort-frees-shared".to_string()]));
    assert!(res.found(), "{res}");
    // good + bad + ⌈log2 4⌉ halvings + the culprit + the rest without it.
    assert!(res.probes.len() <= 6, "{res}");
}
