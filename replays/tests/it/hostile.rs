//! Hostile bundles: well-framed (valid checksums) but written to crash or
//! exhaust the replayer. Each named finding is pinned by a test; a sweep of
//! structure-aware mutations (the `replay_mutated` fuzz target's own
//! mutator, driven by a fixed SplitMix64 stream) must give errors or reports,
//! never a panic, on a seed bundle of each family's tiny model (colocated,
//! and disaggregated with orphaned transfers).

use crate::common::families;
#[path = "../mutator/mod.rs"]
mod mutator;

use lmrr_engine::scheduler::Decision;
use lmrr_engine::{PatchSet, Preset};
use lmrr_kernels::{SplitMix64, Threads};
use lmrr_recorder::Event;
use lmrr_replays::{replay, ReplayError, ReplayOptions};
use mutator::{exercise, model, mutate, reframe, seed_bundle};

fn replay_err(b: &lmrr_recorder::Bundle, m: &lmrr_engine::Model) -> String {
    let opts = ReplayOptions::new(PatchSet::none(), Threads::single());
    match replay(b, m, &opts) {
        Err(e) => e.to_string(),
        Ok(o) => format!("no error: {o}"),
    }
}

fn reread(m: lmrr_recorder::Manifest, ev: Vec<Event>) -> lmrr_recorder::Bundle {
    lmrr_recorder::read(&reframe(&m, ev)).expect("a re-framed bundle reads")
}

#[test]
fn a_schedule_whose_start_plus_length_overflows_is_refused_with_the_numbers() {
    let m = model();
    let seed = seed_bundle(&m, PatchSet::none());
    let mut ev = seed.events.clone();
    let step = ev
        .iter_mut()
        .find_map(|e| match e {
            Event::Step(r) => Some(r),
            _ => None,
        })
        .expect("a step");
    for d in &mut step.decisions {
        if let Decision::Schedule { start, len, .. } = d {
            *start = usize::MAX - 1;
            *len = 3;
        }
    }
    let e = replay_err(&reread(seed.manifest.clone(), ev), &m);
    assert!(
        e.contains("invalid bundle: event") && e.contains("overflows"),
        "{e}"
    );
}

#[test]
fn a_manifest_asking_for_a_huge_pool_replays_without_touching_it() {
    // 30 GiB of K/V promised, below the 64 GiB cap: the pool is sized lazily,
    // so the replay holds only the pages the session uses.
    let m = model();
    let seed = seed_bundle(&m, PatchSet::none());
    let mut man = seed.manifest.clone();
    let per_page = man.engine.page_size * 64 * 4 * 2 * 4; // positions × kv_dim × f32 × K,V × layers
    man.engine.pool_pages = (30usize << 30) / per_page;
    let b = reread(man, seed.events.clone());
    let opts = ReplayOptions::new(PatchSet::none(), Threads::single());
    let o = replay(&b, &m, &opts).expect("replays");
    // The pool size is part of the engine config, so the cache state may
    // differ from the recording; what matters is that it ran.
    let _ = o.to_string();
}

#[test]
fn a_pool_past_the_cap_or_pages_past_the_context_are_refused_before_anything_runs() {
    let m = model();
    let seed = seed_bundle(&m, PatchSet::none());
    let mut man = seed.manifest.clone();
    man.engine.pool_pages = usize::MAX / 2;
    let e = replay_err(&reread(man, seed.events.clone()), &m);
    assert!(e.contains("exceeds 64 GiB"), "{e}");
    let mut man = seed.manifest.clone();
    man.engine.page_size = 1 << 24;
    let e = replay_err(&reread(man, seed.events.clone()), &m);
    assert!(e.contains("page_size") && e.contains("context"), "{e}");
}

#[test]
fn events_naming_unknown_requests_tokens_or_steps_are_refused() {
    let m = model();
    let seed = seed_bundle(&m, PatchSet::none());
    let vocab = m.net.vocab_size() as u32;
    type Edit = Box<dyn Fn(&mut Vec<Event>)>;
    let cases: Vec<(&str, Edit)> = vec![
        (
            "outside the vocabulary",
            Box::new(move |ev| {
                if let Some(Event::Arrival { request, .. }) = ev.first_mut() {
                    request.prompt[0] = vocab;
                }
            }),
        ),
        (
            "has not arrived",
            Box::new(|ev| {
                if let Some(Event::Interrupt { id, .. }) =
                    ev.iter_mut().find(|e| matches!(e, Event::Interrupt { .. }))
                {
                    *id = 999;
                }
            }),
        ),
        (
            "where step",
            Box::new(|ev| {
                if let Some(Event::Step(r)) =
                    ev.iter_mut().rev().find(|e| matches!(e, Event::Step(_)))
                {
                    r.step = 3;
                }
            }),
        ),
        (
            "arrives twice",
            Box::new(|ev| {
                let a = ev[0].clone();
                ev.insert(1, a);
            }),
        ),
        (
            "empty span",
            Box::new(|ev| {
                if let Some(Event::Step(r)) = ev.iter_mut().find(|e| matches!(e, Event::Step(_))) {
                    if let Some(s) = r.seqs.first_mut() {
                        s.len = 0;
                        s.sampled = Some(1);
                    }
                }
            }),
        ),
    ];
    for (want, f) in cases {
        let mut ev = seed.events.clone();
        f(&mut ev);
        let e = replay_err(&reread(seed.manifest.clone(), ev), &m);
        assert!(e.contains(want), "expected `{want}`: {e}");
        // The oracle validates the same way.
    }
}

#[test]
fn the_error_is_typed_as_invalid() {
    let m = model();
    let seed = seed_bundle(&m, PatchSet::none());
    let mut ev = seed.events.clone();
    ev.swap(0, 1);
    let b = reread(seed.manifest.clone(), ev);
    let r = replay(
        &b,
        &m,
        &ReplayOptions::new(PatchSet::none(), Threads::single()),
    );
    assert!(matches!(r, Err(ReplayError::Invalid(_))), "{:?}", r.err());
}

per_family!(
    the_seed_bundle_itself_replays_bit_exactly,
    a_sweep_of_structure_aware_mutations_never_panics,
);

fn the_seed_bundle_itself_replays_bit_exactly(p: Preset) {
    // The mutator starts from a real recording: unmutated, it is clean.
    let m = families::model(p);
    let seed = seed_bundle(m, PatchSet::none());
    let b = reread(seed.manifest.clone(), seed.events.clone());
    let o = replay(
        &b,
        m,
        &ReplayOptions::new(PatchSet::none(), Threads::single()),
    )
    .unwrap();
    assert!(o.is_bit_exact(), "{o}");
}

/// A disaggregated recording whose first request is aborted with its K/V on
/// the link, under `pd-abort-reuses-pages` (orphaned transfers included).
fn pd_seed(m: &lmrr_engine::Model) -> lmrr_recorder::Bundle {
    use lmrr_engine::{EngineConfig, PdConfig, PdEngine, Script};
    let src = "[defaults]\nmax_tokens = 5\nignore_eos = true\n\
               [[request]]\nid = \"a\"\nprompt_tokens = [5, 9, 14, 3, 77, 8, 19, 40, 2, 31, 6, 12]\ninterrupt_at_step = 2\n\
               [[request]]\nid = \"b\"\nafter = \"a\"\nprompt_tokens = [7, 7, 21, 4, 90, 11, 3, 3, 65, 12]\n";
    let cfg = EngineConfig {
        page_size: 2,
        pool_pages: 40,
        max_batch_tokens: 6,
        prefix_cache: true,
    };
    let pd = PdConfig {
        decode: cfg,
        transfer_pages_per_step: 1,
    };
    let patches = PatchSet::parse("pd-abort-reuses-pages").unwrap();
    let script = Script::parse(src, "pd.toml").unwrap();
    let manifest =
        lmrr_recorder::Manifest::for_session(m, cfg, &patches, "pd.toml", src, 5, 1, "t", "t");
    let mut eng = PdEngine::new(m.net(), cfg, pd, Threads::single(), patches).unwrap();
    eng.set_top_logprobs(5);
    let mut rec = lmrr_recorder::Recorder::new(Vec::new(), &manifest).unwrap();
    rec.disaggregated(pd);
    lmrr_engine::run_session(m, &script, &mut eng, |e| rec.observe(e)).unwrap();
    let b = lmrr_recorder::read(&rec.finish().unwrap()).unwrap();
    assert!(b.events.iter().any(|e| matches!(
        e,
        Event::PdStep(p) if p.link.iter().any(|l| matches!(l, lmrr_engine::PdEvent::Transfer { orphan: true, .. }))
    )));
    b
}

fn a_sweep_of_structure_aware_mutations_never_panics(p: Preset) {
    let m = families::model(p);
    let seeds = [
        seed_bundle(m, PatchSet::none()),
        seed_bundle(m, PatchSet::parse("abort-frees-shared").unwrap()),
        pd_seed(m),
    ];
    let mut rng = SplitMix64(0x1157_0b00);
    let sweeps: usize = std::env::var("LMRR_HOSTILE_SWEEP")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    for i in 0..sweeps {
        let n = 1 + (rng.next_u64() % 24) as usize;
        let ops: Vec<u8> = (0..n).map(|_| rng.next_u64() as u8).collect();
        let seed = &seeds[i % seeds.len()];
        let (man, ev) = mutate(seed, &ops);
        let bytes = reframe(&man, ev);
        let other = PatchSet::parse(["none", "fast-exp", "abort-inserts-partial"][i % 3]).unwrap();
        exercise(m, &bytes, other);
    }
}

#[test]
fn a_step_that_schedules_a_request_and_then_ends_it_is_a_decision_divergence() {
    // Found by the mutation sweep: the scheduler indexed a request that a
    // later decision of the same step had interrupted, and panicked.
    let m = model();
    let seed = seed_bundle(&m, PatchSet::none());
    let mut ev = seed.events.clone();
    let (at, id) = ev
        .iter()
        .enumerate()
        .find_map(|(i, e)| match e {
            Event::Step(r) => r.decisions.iter().find_map(|d| match d {
                Decision::Schedule { id, .. } => Some((i, *id)),
                _ => None,
            }),
            _ => None,
        })
        .expect("a scheduled step");
    if let Event::Step(r) = &mut ev[at] {
        r.decisions.push(Decision::Interrupt { id });
    }
    let b = reread(seed.manifest.clone(), ev);
    let o = replay(
        &b,
        &m,
        &ReplayOptions::new(PatchSet::none(), Threads::single()),
    )
    .expect("a report, not an error");
    let d = o.divergence().expect("diverges");
    assert_eq!(d.signal, lmrr_replays::Signal::Decision, "{o}");
    assert!(d.detail.contains("later decision of the same step"), "{o}");
    // Scheduled twice in one step: refused the same way.
    let mut ev = seed.events.clone();
    if let Event::Step(r) = &mut ev[at] {
        let d = r
            .decisions
            .iter()
            .find(|d| matches!(d, Decision::Schedule { .. }))
            .cloned();
        r.decisions.extend(d);
    }
    let o = replay(
        &reread(seed.manifest.clone(), ev),
        &m,
        &ReplayOptions::new(PatchSet::none(), Threads::single()),
    )
    .expect("a report, not an error");
    assert_eq!(
        o.divergence().map(|d| d.signal),
        Some(lmrr_replays::Signal::Decision),
        "{o}"
    );
}
