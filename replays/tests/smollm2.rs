//! The incident on a real model: SmolLM2-135M-Instruct forgets the user's name
//! under `abort-frees-shared`, replay shows where, and a token-criterion bisect
//! over the catalog names the patch. Skipped (with the reason) when the model
//! is not present (`scripts/get-smollm2.sh`, or `LMRR_SMOLLM2=DIR`).

use std::path::PathBuf;

use lmrr_engine::{run_session, EngineConfig, Model, Patch, PatchSet, Scheduler, Script};
use lmrr_kernels::Threads;
use lmrr_recorder::{read, Manifest, Recorder};
use lmrr_replays::{bisect, probe, replay, Criterion, ReplayOptions};

fn model_dir() -> Option<PathBuf> {
    let dir = std::env::var_os("LMRR_SMOLLM2")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .map(|h| PathBuf::from(h).join(".cache/lmrr/smollm2-135m-instruct"))
        })?;
    if dir.join("model.safetensors").is_file() {
        Some(dir)
    } else {
        eprintln!(
            "SKIPPED: no SmolLM2 at {} (run scripts/get-smollm2.sh, or set LMRR_SMOLLM2)",
            dir.display()
        );
        None
    }
}

#[test]
fn smollm2_forgets_under_abort_frees_shared_and_bisect_names_it() {
    let Some(dir) = model_dir() else { return };
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
        let mut sch = Scheduler::with_patches(&m.llama, cfg, th.clone(), patches).unwrap();
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
    assert!(res.probes.len() <= 3);
}
