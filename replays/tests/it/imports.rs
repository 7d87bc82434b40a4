//! A bundle recorded on one import of a GGUF replays on another import of the
//! same file: imports are byte-deterministic and the model identity is a
//! content identity, so `--dtype keep` and `--dtype f32` (same logits) are one
//! model and a bf16 import (rounded weights) is another.

#[path = "../../../engine/tests/fixtures/tiny_gguf.rs"]
mod tiny_gguf;

use lmrr_engine::gguf::{import, ImportDtype};
use lmrr_engine::{run_session, EngineConfig, Model, PatchSet, Scheduler, Script};
use lmrr_kernels::Threads;
use lmrr_recorder::{read, Bundle, Manifest, Recorder};
use lmrr_replays::{replay, Outcome, ReplayError, ReplayOptions};

const SCRIPT: &str = r#"
[[request]]
id = "a"
prompt = "the quick brown fox"
max_tokens = 12

[[request]]
id = "b"
prompt = "the quick brown dog jumps over"
max_tokens = 8
at_step = 3
"#;

fn record(m: &Model) -> Bundle {
    let script = Script::parse(SCRIPT, "s.toml").unwrap();
    let cfg = EngineConfig::default();
    let none = PatchSet::none();
    let manifest = Manifest::for_session(m, cfg, &none, "s.toml", SCRIPT, 5, 2, "test", "test");
    let mut sch = Scheduler::new(m.net(), cfg, Threads::new(2).unwrap()).unwrap();
    sch.set_top_logprobs(5);
    let mut rec = Recorder::new(Vec::new(), &manifest).unwrap();
    run_session(m, &script, &mut sch, |e| rec.observe(e)).unwrap();
    read(&rec.finish().unwrap()).unwrap()
}

fn replay_on(b: &Bundle, m: &Model) -> Result<Outcome, ReplayError> {
    replay(
        b,
        m,
        &ReplayOptions::new(PatchSet::none(), Threads::new(3).unwrap()),
    )
}

#[test]
fn a_bundle_recorded_on_one_import_replays_bit_exactly_on_another() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("tiny.gguf");
    std::fs::write(&src, tiny_gguf::tiny_quantized_llama()).unwrap();
    let load = |name: &str, dtype| {
        let dir = tmp.path().join(name);
        import(&src, &dir, dtype).unwrap();
        Model::load_dir(&dir).unwrap()
    };
    let mine = load("mine", ImportDtype::Keep);
    let bundle = record(&mine);
    assert_eq!(bundle.manifest.model.identity, mine.identity());
    // Someone else's import: a fresh process would see the same files; here a
    // second import in another directory, and an f32 import of the same GGUF.
    for (name, dtype) in [("theirs", ImportDtype::Keep), ("f32", ImportDtype::F32)] {
        let theirs = load(name, dtype);
        match replay_on(&bundle, &theirs).unwrap() {
            Outcome::BitExact { tokens, .. } => assert_eq!(tokens, 20, "{name}"),
            o => panic!("{name}: {o}"),
        }
    }
    // Weights rounded to bf16 compute other logits: refused before replaying,
    // naming the digest that differs.
    let bf16 = load("bf16", ImportDtype::Bf16);
    let e = replay_on(&bundle, &bf16).unwrap_err();
    assert!(matches!(e, ReplayError::ModelMismatch { .. }), "{e}");
    let text = e.to_string();
    assert!(text.contains("differs in: weights;"), "{text}");
}
