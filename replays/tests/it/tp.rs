//! A bundle's tensor-parallel degree is a deployment fact: a session recorded
//! at one degree replays bit-exactly at any other (the rank simulator), the
//! manifest says the degree it ran at, and a rank that fails mid-session
//! leaves a complete, readable bundle of every step before the failure,
//! which itself replays bit-exactly.

use lmrr_engine::exec::tp::{TpConfig, TpError};
use lmrr_engine::{run_session, EngineConfig, EngineError, Model, Preset, Scheduler, Script};
use lmrr_engine::{PatchSet, SynthSpec};
use lmrr_kernels::Threads;
use lmrr_recorder::{read, Bundle, Event, Integrity, Manifest, Recorder};
use lmrr_replays::{replay, Outcome, ReplayOptions};

fn multi_user_src() -> String {
    std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/multi-user.toml"
    ))
    .unwrap()
}

/// The engine settings `examples/multi-user.toml` names (64 tokens a step:
/// chunked prefill beside decode).
fn cfg() -> EngineConfig {
    EngineConfig {
        max_batch_tokens: 64,
        ..EngineConfig::default()
    }
}

/// Records `src` on `m` (reference engine, 2 threads, top-5 logprobs).
fn record(m: &Model, src: &str) -> Bundle {
    let script = Script::parse(src, "s.toml").unwrap();
    let none = PatchSet::none();
    let manifest = Manifest::for_session(m, cfg(), &none, "s.toml", src, 5, 2, "t", "t");
    let mut sch = Scheduler::new(m.net(), cfg(), Threads::new(2).unwrap()).unwrap();
    sch.set_top_logprobs(5);
    let mut rec = Recorder::new(Vec::new(), &manifest).unwrap();
    run_session(m, &script, &mut sch, |e| rec.observe(e)).unwrap();
    read(&rec.finish().unwrap()).unwrap()
}

/// `p`'s synthetic model over `degree` ranks.
fn at(p: Preset, degree: usize) -> Model {
    let mut m = Model::synthetic(SynthSpec::new(p, 0)).unwrap();
    m.net.set_tp(TpConfig::degree(degree)).unwrap();
    m
}

fn steps(b: &Bundle) -> usize {
    b.events.iter().filter(|e| e.step().is_some()).count()
}

/// Replays `b` on `m` (2 threads, reference engine): the outcome.
fn replay_on(b: &Bundle, m: &Model) -> Outcome {
    replay(
        b,
        m,
        &ReplayOptions::new(PatchSet::none(), Threads::new(2).unwrap()),
    )
    .unwrap()
}

fn assert_bit_exact(o: &Outcome, what: &str, recorded_steps: usize) {
    match o {
        Outcome::BitExact {
            steps, truncated, ..
        } => {
            assert!(!truncated, "{what}");
            assert_eq!(*steps as usize, recorded_steps, "{what}: steps replayed");
        }
        o => panic!("{what}: {o}"),
    }
}

#[test]
fn a_multi_user_session_recorded_at_tp2_replays_bit_exactly_at_every_degree_the_model_allows() {
    let src = multi_user_src();
    for (p, replay_at) in [
        (Preset::Tiny, &[1usize, 2][..]),
        (Preset::MiniV4Tiny, &[1, 2, 4][..]),
    ] {
        let m2 = at(p, 2);
        let b = record(&m2, &src);
        assert_eq!(b.manifest.tp_degree, 2, "{p:?}: the manifest's degree");
        let n = steps(&b);
        assert!(n > 40, "{p:?}: {n} steps");
        for &d in replay_at {
            assert_bit_exact(
                &replay_on(&b, &at(p, d)),
                &format!("{p:?} recorded at 2, replayed at {d}"),
                n,
            );
        }
        // The same session recorded at degree 1 has the same events.
        let b1 = record(&at(p, 1), &src);
        assert_eq!(b1.manifest.tp_degree, 1);
        assert_eq!(b1.events, b.events, "{p:?}: events at degree 1 and 2");
    }
    // The llama tiny model's heads do not split in four: refused, not run.
    let mut m = Model::synthetic(SynthSpec::new(Preset::Tiny, 0)).unwrap();
    assert!(matches!(
        m.net.set_tp(TpConfig::degree(4)),
        Err(EngineError::Tp(TpError::Heads { degree: 4, .. }))
    ));
}

#[test]
fn every_committed_bundle_reads_as_degree_one() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut versions = std::collections::BTreeSet::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "lmrr") {
            let b = lmrr_recorder::open(&p).unwrap();
            assert_eq!(b.manifest.tp_degree, 1, "{}", p.display());
            versions.insert(b.manifest.format_version);
        }
    }
    // Each older manifest layout is read as degree one: 2 and 3 (no
    // numerics), 4 (numerics, no degree); 5 records the degree.
    for v in [2, 3, 4] {
        assert!(
            versions.contains(&v),
            "no committed bundle of format {v}: {versions:?}"
        );
    }
}

#[test]
fn a_committed_degree_one_bundle_replays_bit_exactly_at_tp2() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/multi-user.lmrr");
    let b = lmrr_recorder::open(std::path::Path::new(path)).unwrap();
    assert!(b.manifest.format_version < 5, "a bundle of an older format");
    assert_eq!(b.manifest.tp_degree, 1, "an older format reads as degree 1");
    let n = steps(&b);
    assert_bit_exact(&replay_on(&b, &at(Preset::Tiny, 2)), "multi-user at 2", n);
}

#[test]
fn a_rank_failure_leaves_a_complete_bundle_of_every_step_before_it() {
    const FAIL_AT: u64 = 9;
    let src = multi_user_src();
    let script = Script::parse(&src, "s.toml").unwrap();
    let full = record(&at(Preset::Tiny, 2), &src);
    let mut m = Model::synthetic(SynthSpec::new(Preset::Tiny, 0)).unwrap();
    m.net
        .set_tp(TpConfig {
            degree: 2,
            fail: Some((1, FAIL_AT)),
        })
        .unwrap();
    let manifest =
        Manifest::for_session(&m, cfg(), &PatchSet::none(), "s.toml", &src, 5, 2, "t", "t");
    let mut sch = Scheduler::new(m.net(), cfg(), Threads::new(2).unwrap()).unwrap();
    sch.set_top_logprobs(5);
    let mut rec = Recorder::new(Vec::new(), &manifest).unwrap();
    let e = run_session(&m, &script, &mut sch, |e| rec.observe(e)).unwrap_err();
    assert!(
        matches!(
            e,
            EngineError::Tp(TpError::RankFailed {
                rank: 1,
                degree: 2,
                step: FAIL_AT
            })
        ),
        "{e}"
    );
    let b = read(&rec.finish().unwrap()).unwrap();
    assert!(
        matches!(b.integrity, Integrity::Complete { .. }),
        "{}",
        b.integrity
    );
    assert_eq!(b.manifest.tp_degree, 2);
    // Every model step before the failing one, each as the full session
    // recorded it, and nothing of the failing step.
    assert_eq!(steps(&b), FAIL_AT as usize);
    let last = b.events.len();
    assert!(last < full.events.len());
    assert_eq!(b.events[..], full.events[..last]);
    // What follows its last step is what arrived before the failing one.
    let mut after_last_step = b.events.iter().rev().take_while(|e| e.step().is_none());
    assert!(after_last_step.all(|e| matches!(e, Event::Arrival { .. } | Event::Interrupt { .. })));
    // It replays bit-exactly, at the degree it ran at and at 1.
    for d in [1, 2] {
        assert_bit_exact(
            &replay_on(&b, &at(Preset::Tiny, d)),
            &format!("failed at step {FAIL_AT}, replayed at {d}"),
            FAIL_AT as usize,
        );
    }
}
