//! Replay, divergence reports, the patch catalog, bisect and the oracle, on
//! every family's tiny model (the incident runs past mini-v4's first sparse
//! position in both turns).

use crate::common;

use common::families::{self, sparse_from};
use common::record;
use lmrr_engine::patches::PatchClass;
use lmrr_engine::{
    run_session, EngineConfig, Family, Model, Patch, PatchSet, Preset, Scheduler, Script, SynthSpec,
};
use lmrr_kernels::Threads;
use lmrr_recorder::{read, Bundle, Event, Manifest, Recorder};
use lmrr_replays::bisect::Verdict;
use lmrr_replays::{bisect, oracle, replay, Criterion, Outcome, Probe, ReplayOptions, Signal};

fn incident_src() -> String {
    std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/incident.toml"
    ))
    .unwrap()
}

fn run(b: &Bundle, m: &Model, patches: PatchSet) -> Outcome {
    replay(b, m, &ReplayOptions::new(patches, Threads::new(2).unwrap())).unwrap()
}

per_family!(
    the_incident_replays_bit_exactly_and_diverges_at_turn_2_under_abort_inserts_partial,
    bisect_names_the_one_patch_that_changes_behaviour_within_the_probe_bound,
    bisect_never_names_a_patch_for_a_bundle_recorded_with_another,
    the_oracle_flags_a_bundle_recorded_with_the_patch_and_passes_a_clean_one,
    every_catalog_patch_fires_in_its_scenario_and_the_others_are_inert,
    a_different_model_is_refused_naming_both_hashes,
    a_truncated_bundle_replays_up_to_its_last_complete_frame,
);

/// The incident recorded on `m` by the reference engine.
fn incident(m: &Model) -> Bundle {
    record(
        m,
        &incident_src(),
        EngineConfig::default(),
        PatchSet::none(),
    )
}

fn the_incident_replays_bit_exactly_and_diverges_at_turn_2_under_abort_inserts_partial(p: Preset) {
    let m = families::model(p);
    let b = incident(m);
    let turn2_prompt = b
        .events
        .iter()
        .find_map(|e| match e {
            Event::Arrival { name, request, .. } if name == "turn2" => Some(request.prompt.len()),
            _ => None,
        })
        .unwrap();
    families::assert_reaches_sparse(m, turn2_prompt, "the incident's turn 2");
    match run(&b, m, PatchSet::none()) {
        Outcome::BitExact {
            steps,
            tokens,
            truncated,
        } => {
            assert_eq!((tokens, truncated), (180, false));
            assert!(steps >= 180);
        }
        o => panic!("{o}"),
    }
    let o = run(&b, m, PatchSet::parse("abort-inserts-partial").unwrap());
    let d = o.divergence().expect("diverges");
    assert_eq!(d.signal, Signal::CacheState);
    assert_eq!((d.request.as_deref(), d.turn), (Some("turn2"), Some(2)));
    assert!(d.repro.is_empty() || d.repro.contains("replay"));
    let text = o.to_string();
    assert!(
        text.contains("DIVERGED at step") && text.contains("turn2 (turn 2)"),
        "{text}"
    );
    assert!(text.contains("`turn1` is interrupted"), "{text}");
}

/// Bisect on the incident. Over the family's whole catalog: llama's has one
/// patch that changes behaviour there (`abort-inserts-partial`), named alone;
/// mini-v4's own patches change tokens too, so its bisect finds one culprit
/// and refuses to call it the whole story. Over the family's one
/// behaviour-changing candidate among the patches that keep the incident's
/// behaviour (splitk-decode, fast-exp, abort-frees-shared): that one, by
/// binary search, within the probe bound, confirmed by replays of its own.
fn bisect_names_the_one_patch_that_changes_behaviour_within_the_probe_bound(p: Preset) {
    let m = families::model(p);
    let b = incident(m);
    let th = Threads::new(2).unwrap();
    let mut probe = |set: &PatchSet| lmrr_replays::probe(&b, m, set, &th, Criterion::Behaviour);
    let family = m.net.family();
    let catalog: Vec<Patch> = PatchSet::all_for(family).iter().collect();
    // llama: the 4 patches of attention and cache; mini-v4: those and its 3 own.
    let (size, culprit) = match family {
        Family::Llama => (4, Patch::AbortInsertsPartial),
        Family::MiniV4 => (7, Patch::IndexerEarlyExit),
        other => panic!("no test preset of {other}"),
    };
    assert_eq!(catalog.len(), size);
    let res = bisect(&PatchSet::none(), &catalog, &mut probe).unwrap();
    match family {
        Family::Llama => assert_eq!(
            res.culprits,
            Some(vec!["abort-inserts-partial".to_string()]),
            "{res}"
        ),
        Family::MiniV4 => {
            assert!(!res.found(), "{res}");
            assert!(
                matches!(&res.verdict, Verdict::RestDiverges { rest } if rest.contains("moe-routed-scaling")),
                "{res}"
            );
        }
        other => panic!("no test preset of {other}"),
    }
    let candidates = [
        Patch::SplitkDecode,
        Patch::FastExp,
        Patch::AbortFreesShared,
        culprit,
    ];
    let res = bisect(&PatchSet::none(), &candidates, &mut probe).unwrap();
    assert_eq!(
        res.culprits,
        Some(vec![culprit.name().to_string()]),
        "{res}"
    );
    assert_eq!(res.method, "binary");
    assert!(res.found(), "{res}");
    // good + bad + ⌈log2 4⌉ halvings + the culprit + the rest without it.
    assert!(
        res.probes.len() <= 6,
        "{} probes for 4 patches",
        res.probes.len()
    );
    let bad: PatchSet = candidates.into_iter().collect();
    confirm(
        &b,
        m,
        &PatchSet::none(),
        &bad,
        res.culprits.as_deref().unwrap(),
    );
}

/// The culprit of a bisect, checked by replays of its own (not the search's).
fn confirm(b: &Bundle, m: &Model, base: &PatchSet, bad: &PatchSet, culprits: &[String]) {
    let th = Threads::new(2).unwrap();
    let p = |set: &PatchSet| lmrr_replays::probe(b, m, set, &th, Criterion::Behaviour).unwrap();
    let culprit: PatchSet = culprits
        .iter()
        .map(|c| c.parse::<Patch>().unwrap())
        .collect();
    let with: PatchSet = base.iter().chain(culprit.iter()).collect();
    let without: PatchSet = bad.iter().filter(|x| !culprit.contains(*x)).collect();
    assert!(!p(base).diverged, "good set {base} diverges");
    assert!(p(&with).diverged, "culprit set {with} is clean");
    assert!(
        !p(&without).diverged,
        "bad set without the culprit ({without}) diverges"
    );
}

fn bisect_never_names_a_patch_for_a_bundle_recorded_with_another(p: Preset) {
    // Bundles recorded with each patch of the catalog. Bisecting from the
    // empty set must refuse whenever the empty set already diverges (the
    // reported bug named `splitk-decode` on an `abort-frees-shared` bundle);
    // bisecting from the recording's own set must name only confirmed culprits.
    let m = families::model(p);
    let th = Threads::new(2).unwrap();
    for rec_patch in Patch::ALL {
        let recorded: PatchSet = [rec_patch].into_iter().collect();
        let b = record(
            m,
            &incident_src(),
            EngineConfig::default(),
            recorded.clone(),
        );
        let mut probe = |set: &PatchSet| lmrr_replays::probe(&b, m, set, &th, Criterion::Behaviour);
        let none_diverges = probe(&PatchSet::none()).unwrap().diverged;
        let res = bisect(&PatchSet::none(), &Patch::ALL, &mut probe).unwrap();
        if none_diverges {
            assert_eq!(
                res.verdict,
                Verdict::BaseDiverges,
                "recorded {rec_patch}: {res}"
            );
            assert!(!res.found());
            assert!(res.to_string().contains("already diverges"), "{res}");
        } else if res.found() {
            let bad = PatchSet::all();
            confirm(
                &b,
                m,
                &PatchSet::none(),
                &bad,
                res.culprits.as_deref().unwrap(),
            );
        }
        // From the recording's own set.
        let rest: Vec<Patch> = Patch::ALL.into_iter().filter(|p| *p != rec_patch).collect();
        let res = bisect(&recorded, &rest, &mut probe).unwrap();
        assert_ne!(
            res.verdict,
            Verdict::BaseDiverges,
            "recorded {rec_patch}: {res}"
        );
        if res.found() {
            confirm(
                &b,
                m,
                &recorded,
                &PatchSet::all(),
                res.culprits.as_deref().unwrap(),
            );
        }
    }
    // The reported case: recorded with abort-frees-shared, bad set
    // abort-frees-shared + fast-exp from the empty set: refused, not `fast-exp`.
    let afs = PatchSet::parse("abort-frees-shared").unwrap();
    let b = record(m, &incident_src(), EngineConfig::default(), afs.clone());
    let mut probe = |set: &PatchSet| lmrr_replays::probe(&b, m, set, &th, Criterion::Behaviour);
    assert!(!probe(&afs).unwrap().diverged, "its own set replays clean");
    let res = bisect(
        &PatchSet::none(),
        &[Patch::AbortFreesShared, Patch::FastExp],
        &mut probe,
    )
    .unwrap();
    assert_ne!(res.culprits, Some(vec!["fast-exp".to_string()]), "{res}");
    assert!(
        !res.found() || res.culprits == Some(vec!["abort-frees-shared".into()]),
        "{res}"
    );
}

/// The oracle flags a cache bug recorded in a bundle and passes a clean one.
/// It recomputes under the recording's own patches, so it is blind to
/// arithmetic patches by design: a bundle recorded under fast-exp or one of
/// mini-v4's patches (indexer-early-exit included, past the first sparse
/// position) passes it.
fn the_oracle_flags_a_bundle_recorded_with_the_patch_and_passes_a_clean_one(p: Preset) {
    let m = families::model(p);
    let opts = ReplayOptions::new(PatchSet::none(), Threads::new(2).unwrap());
    let clean = incident(m);
    assert!(oracle(&clean, m, &opts).unwrap().is_bit_exact());
    for patch in PatchSet::all_for(m.net.family()).iter() {
        if patch.class() == PatchClass::CacheCorruption || patch == Patch::SplitkDecode {
            continue;
        }
        let b = record(
            m,
            &incident_src(),
            EngineConfig::default(),
            [patch].into_iter().collect(),
        );
        assert!(
            !run(&b, m, PatchSet::none()).is_bit_exact(),
            "{patch} changes nothing on the incident"
        );
        let o = oracle(&b, m, &opts).unwrap();
        assert!(o.is_bit_exact(), "recorded under {patch}: {o}");
    }
    let bad = record(
        m,
        &incident_src(),
        EngineConfig::default(),
        PatchSet::parse("abort-inserts-partial").unwrap(),
    );
    let o = oracle(&bad, m, &opts).unwrap();
    let d = o
        .divergence()
        .expect("the oracle must flag the corrupted cache");
    assert_eq!(
        (d.request.as_deref(), d.signal),
        (Some("turn2"), Signal::Logits)
    );
    // And a plain replay of the patched bundle without the patch diverges at turn 2.
    let r = run(&bad, m, PatchSet::none());
    assert_eq!(
        r.divergence().map(|d| d.request.as_deref()),
        Some(Some("turn2"))
    );
}

/// One scenario per catalog patch in which it really changes something on a
/// family it can act on (indexer-early-exit only past the first sparse
/// position); on another family it is inert: the scenario replays
/// bit-exactly under it.
fn every_catalog_patch_fires_in_its_scenario_and_the_others_are_inert(p: Preset) {
    let m = families::model(p);
    let family = m.net.family();
    let concurrent = r#"
[[request]]
id = "a"
prompt = "first of two concurrent requests"
max_tokens = 12
ignore_eos = true
[[request]]
id = "b"
prompt = "second one, decoding in the same steps"
max_tokens = 12
ignore_eos = true
"#;
    let shared_abort = r#"
[[request]]
id = "t1"
messages = [{ role = "user", content = "tell me about caches and what they hold" }]
max_tokens = 40
ignore_eos = true
[[request]]
id = "t2"
after = "t1"
messages = [{ role = "user", content = "tell me about caches and what they hold" }, { role = "assistant", from = "t1" }, { role = "user", content = "more" }]
max_tokens = 30
ignore_eos = true
interrupt_after_tokens = 5
[[request]]
id = "t3"
after = "t2"
messages = [{ role = "user", content = "tell me about caches and what they hold" }, { role = "assistant", from = "t1" }, { role = "user", content = "again" }]
max_tokens = 10
ignore_eos = true
"#;
    let cfg = EngineConfig {
        page_size: 4,
        ..Default::default()
    };
    let incident = incident_src();
    let scenarios = [concurrent, shared_abort, incident.as_str()];
    let cases: [(Patch, usize, Signal); 7] = [
        (Patch::SplitkDecode, 0, Signal::Logits),
        (Patch::FastExp, 0, Signal::Logits),
        (Patch::AbortInsertsPartial, 2, Signal::CacheState),
        (Patch::AbortFreesShared, 1, Signal::CacheState),
        (Patch::MhcBf16, 0, Signal::Logits),
        (Patch::MoeRoutedScaling, 0, Signal::Logits),
        (Patch::IndexerEarlyExit, 2, Signal::Logits),
    ];
    assert_eq!(cases.map(|c| c.0), Patch::ALL, "one scenario per patch");
    let bundles: Vec<Bundle> = scenarios
        .iter()
        .map(|src| {
            let b = record(m, src, cfg, PatchSet::none());
            assert!(
                run(&b, m, PatchSet::none()).is_bit_exact(),
                "reference replay"
            );
            b
        })
        .collect();
    for (patch, scenario, signal) in cases {
        let o = run(&bundles[scenario], m, [patch].into_iter().collect());
        if !patch.applies_to(family) {
            assert!(o.is_bit_exact(), "{patch} acts on {family}: {o}");
            continue;
        }
        let d = o
            .divergence()
            .unwrap_or_else(|| panic!("{patch} never fired"));
        assert_eq!(d.signal, signal, "{patch}: {o}");
        if signal == Signal::Logits {
            assert!(
                !d.drift.is_empty() && d.drift[0].max_abs_dlogit > 0.0,
                "{patch}: drift statistics"
            );
        }
        if patch == Patch::IndexerEarlyExit {
            // Exact while attention is dense: the first token it changes is
            // sampled from a query at the first sparse position or later (a
            // report's position is the sampled token's, one past the query's).
            let from = sparse_from(m).unwrap();
            assert!(
                d.position.is_some_and(|p| p > from),
                "{patch} fired at {:?}: {o}",
                d.position
            );
        }
    }
    // splitk-decode only breaks batch invariance: a single decoding request is untouched.
    let single = "[[request]]\nid = \"solo\"\nprompt = \"alone in the batch\"\nmax_tokens = 10\nignore_eos = true\n";
    let b = record(m, single, cfg, PatchSet::none());
    assert!(run(&b, m, PatchSet::parse("splitk-decode").unwrap()).is_bit_exact());
}

#[test]
fn bisect_finds_one_culprit_a_pair_and_none_on_synthetic_predicates() {
    let all = Patch::ALL;
    let mk = |pred: &dyn Fn(&PatchSet) -> bool| {
        let mut f = |s: &PatchSet| -> Result<Probe, ()> {
            Ok(Probe {
                set: s.to_string(),
                diverged: pred(s),
                step: None,
                signal: None,
                bits_from: None,
            })
        };
        bisect(&PatchSet::none(), &all, &mut f).unwrap()
    };
    for c in all {
        let r = mk(&|s: &PatchSet| s.contains(c));
        assert_eq!(r.culprits, Some(vec![c.name().to_string()]), "culprit {c}");
        // good + bad + ⌈log2 7⌉ halvings + the culprit + the rest without it.
        assert!(
            r.probes.len() <= 7,
            "culprit {c}: {} probes",
            r.probes.len()
        );
    }
    // A pair that only diverges together (split across the halves).
    let r = mk(&|s: &PatchSet| s.contains(Patch::FastExp) && s.contains(Patch::AbortFreesShared));
    assert_eq!(
        r.culprits,
        Some(vec![
            "fast-exp".to_string(),
            "abort-frees-shared".to_string()
        ])
    );
    assert_eq!(r.method, "ddmin");
    // No culprit: the bad set is clean.
    let r = mk(&|_| false);
    assert_eq!((r.culprits, r.verdict), (None, Verdict::BadClean));
    // The good set already diverges: refused after one probe.
    let r = mk(&|_| true);
    assert_eq!(
        (r.culprits.clone(), r.verdict.clone()),
        (None, Verdict::BaseDiverges)
    );
    assert_eq!(r.probes.len(), 1);
    // Two independent culprits: the first is found, and the check on the rest
    // refuses to call it the whole story.
    let r =
        mk(&|s: &PatchSet| s.contains(Patch::SplitkDecode) || s.contains(Patch::AbortFreesShared));
    assert!(!r.found(), "{r}");
    assert!(
        matches!(&r.verdict, Verdict::RestDiverges { rest } if rest.contains("abort-frees-shared")),
        "{r}"
    );
}

/// A bundle replays only on its own model: another seed of the family
/// (weights differ) and the other family's model (config and weights differ)
/// are refused, naming both weights hashes.
fn a_different_model_is_refused_naming_both_hashes(p: Preset) {
    let m = families::model(p);
    let b = incident(m);
    let other_family = families::FAMILIES.into_iter().find(|&f| f != p).unwrap();
    for (other, differs) in [
        (SynthSpec::new(p, 1), "differs in: weights;"),
        (
            SynthSpec::new(other_family, 0),
            "differs in: config, weights;",
        ),
    ] {
        let other = Model::synthetic(other).unwrap();
        let e = replay(
            &b,
            &other,
            &ReplayOptions::new(PatchSet::none(), Threads::single()),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains(&m.identity().weights_sha256.hex())
                && e.contains(&other.identity().weights_sha256.hex())
                && e.contains(differs),
            "{e}"
        );
    }
}

fn a_truncated_bundle_replays_up_to_its_last_complete_frame(p: Preset) {
    let m = families::model(p);
    let script = Script::parse(&incident_src(), "s.toml").unwrap();
    let cfg = EngineConfig::default();
    let manifest = Manifest::for_session(m, cfg, &PatchSet::none(), "s", "", 5, 1, "t", "t");
    let mut sch = Scheduler::new(m.net(), cfg, Threads::single()).unwrap();
    sch.set_top_logprobs(5);
    let mut rec = Recorder::new(Vec::new(), &manifest).unwrap();
    run_session(m, &script, &mut sch, |e| rec.observe(e)).unwrap();
    let bytes = rec.finish().unwrap();
    let cut = read(&bytes[..bytes.len() * 2 / 3]).unwrap();
    match run(&cut, m, PatchSet::none()) {
        Outcome::BitExact {
            truncated, steps, ..
        } => assert!(truncated && steps > 0 && steps < 180),
        o => panic!("{o}"),
    }
}
