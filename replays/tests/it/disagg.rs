//! Disaggregated bundles: they replay bit-exactly; each disaggregation
//! patch fires in its scenario (a clean recording replayed under it
//! diverges where the patch acts) and is inert on a colocated bundle;
//! bisect names it; the recompute oracle flags a bundle recorded with
//! `pd-abort-reuses-pages` or `pd-abort-incomplete-kv`, with no golden run.
//!
//! The scenarios use token-id prompts so the stages are at known steps:
//! 20-token prompts, 4-position pages, an 8-token budget (prefill in steps
//! 0–2), one page per step on the link (transfers in steps 2–6, the request
//! transferred at the boundary before step 7, decoding from step 7).

use crate::common;

use common::families;
use common::{record, record_pd};
use lmrr_engine::patches::PatchClass;
use lmrr_engine::{EngineConfig, Model, Patch, PatchSet, PdConfig, PdEvent, Preset, Stage};
use lmrr_kernels::Threads;
use lmrr_recorder::{Bundle, Event};
use lmrr_replays::{
    all_culprits, bisect, bisect_all, oracle, probe, replay, Criterion, Outcome, ReplayOptions,
    Signal,
};

per_family!(
    a_disaggregated_bundle_replays_bit_exactly_and_matches_the_colocated_tokens,
    each_disaggregation_patch_fires_in_its_scenario,
    disaggregation_patches_are_inert_on_a_colocated_bundle,
    bisect_names_each_disaggregation_patch,
    the_oracle_flags_reuses_pages_and_incomplete_kv_with_no_golden_run,
);

fn cfg() -> (EngineConfig, PdConfig) {
    let c = EngineConfig {
        page_size: 4,
        pool_pages: 64,
        max_batch_tokens: 8,
        prefix_cache: true,
    };
    (
        c,
        PdConfig {
            decode: c,
            transfer_pages_per_step: 1,
        },
    )
}

fn ids(seed: u32) -> String {
    let v: Vec<String> = (0..20)
        .map(|i| (3 + (seed * 37 + i * 11) % 200).to_string())
        .collect();
    format!("[{}]", v.join(", "))
}

/// `a` aborted at the boundary before step `at`, then `b` at once.
fn two(at: u64) -> String {
    format!(
        "[defaults]\nmax_tokens = 6\nignore_eos = true\n\
         [[request]]\nid = \"a\"\nprompt_tokens = {}\ninterrupt_at_step = {at}\n\
         [[request]]\nid = \"b\"\nafter = \"a\"\nprompt_tokens = {}\n",
        ids(1),
        ids(2)
    )
}

/// Aborted with pages still on the link.
fn mid_transfer() -> String {
    two(4)
}

/// Aborted once transferred, before admission.
fn transferred() -> String {
    two(7)
}

fn run(b: &Bundle, m: &Model, patches: PatchSet) -> Outcome {
    replay(b, m, &ReplayOptions::new(patches, Threads::new(2).unwrap())).unwrap()
}

fn pd(m: &Model, src: &str, patches: PatchSet) -> Bundle {
    let (c, p) = cfg();
    record_pd(m, src, c, p, patches)
}

/// The stages the recording's aborts found.
fn stages(b: &Bundle) -> Vec<Stage> {
    b.events
        .iter()
        .filter_map(|e| match e {
            Event::PdStep(p) => Some(&**p),
            _ => None,
        })
        .flat_map(|p| &p.before)
        .filter_map(|e| match e {
            PdEvent::Abort { stage, .. } => Some(*stage),
            _ => None,
        })
        .collect()
}

/// The tokens each request sampled, in order.
fn outputs(b: &Bundle) -> Vec<Vec<u32>> {
    let mut out = vec![Vec::new(); 2];
    for e in &b.events {
        for r in e.reports() {
            for s in &r.seqs {
                if let Some(t) = s.sampled {
                    out[s.id as usize].push(t);
                }
            }
        }
    }
    out
}

fn a_disaggregated_bundle_replays_bit_exactly_and_matches_the_colocated_tokens(p: Preset) {
    let m = families::model(p);
    for src in [mid_transfer(), transferred()] {
        let b = pd(m, &src, PatchSet::none());
        assert!(matches!(b.events[0], Event::Disaggregated(_)));
        let o = run(&b, m, PatchSet::none());
        assert!(o.is_bit_exact(), "{o:?}");
        // b is never interrupted: its tokens are the colocated engine's.
        let colocated = record(m, &src, cfg().0, PatchSet::none());
        assert_eq!(outputs(&b)[1], outputs(&colocated)[1]);
        assert_eq!(outputs(&b)[1].len(), 6);
    }
    assert_eq!(
        stages(&pd(m, &mid_transfer(), PatchSet::none())),
        [Stage::Transferring]
    );
    assert_eq!(
        stages(&pd(m, &transferred(), PatchSet::none())),
        [Stage::Transferred]
    );
}

fn each_disaggregation_patch_fires_in_its_scenario(p: Preset) {
    let m = families::model(p);
    let mid = pd(m, &mid_transfer(), PatchSet::none());
    let late = pd(m, &transferred(), PatchSet::none());
    let cases = [
        (Patch::PdAbortReusesPages, &mid, 4, Signal::CacheState),
        (Patch::PdAbortIncompleteKv, &mid, 4, Signal::Decision),
        (Patch::PdAbortLeaks, &late, 7, Signal::Decision),
    ];
    assert_eq!(
        cases.map(|c| c.0),
        Patch::DISAGGREGATED,
        "one case per patch"
    );
    for (patch, b, step, signal) in cases {
        let o = run(b, m, [patch].into_iter().collect());
        let d = o
            .divergence()
            .unwrap_or_else(|| panic!("{patch} never fired"));
        assert_eq!((d.step, d.signal), (step, signal), "{patch}: {}", d.detail);
    }
    // What the report says where each acts.
    let d = run(&mid, m, PatchSet::parse("pd-abort-incomplete-kv").unwrap());
    let d = d.divergence().unwrap();
    assert!(
        d.detail
            .contains("transfer of a reported complete after 2 of 5 pages"),
        "{}",
        d.detail
    );
    let d = run(&late, m, PatchSet::parse("pd-abort-leaks").unwrap());
    let d = d.divergence().unwrap();
    assert!(
        d.detail.contains("its 5 decode pages are never released"),
        "{}",
        d.detail
    );
    // The other scenario leaves each patch inert.
    for (patch, b) in [
        (Patch::PdAbortReusesPages, &late),
        (Patch::PdAbortIncompleteKv, &late),
        (Patch::PdAbortLeaks, &mid),
    ] {
        assert!(
            run(b, m, [patch].into_iter().collect()).is_bit_exact(),
            "{patch}"
        );
    }
}

fn disaggregation_patches_are_inert_on_a_colocated_bundle(p: Preset) {
    let m = families::model(p);
    for src in [mid_transfer(), transferred()] {
        let b = record(m, &src, cfg().0, PatchSet::none());
        let all: PatchSet = Patch::DISAGGREGATED.into_iter().collect();
        assert!(run(&b, m, all).is_bit_exact());
    }
}

fn bisect_names_each_disaggregation_patch(p: Preset) {
    let m = families::model(p);
    let th = Threads::new(2).unwrap();
    let family = m.net.family();
    // The cache patches (the numerical ones change tokens in any bundle).
    let space: Vec<Patch> = PatchSet::all_for_deployment(family, true)
        .iter()
        .filter(|p| p.class() == PatchClass::CacheCorruption)
        .collect();
    assert_eq!(space.len(), 5);
    // Mid-transfer: the two patches acting there, one round each.
    let b = pd(m, &mid_transfer(), PatchSet::none());
    let mut f = |set: &PatchSet| probe(&b, m, set, &th, Criterion::Behaviour);
    let rounds = bisect_all(&PatchSet::none(), &space, &mut f).unwrap();
    let mut named: Vec<String> = all_culprits(&rounds).into_iter().flatten().collect();
    named.sort();
    assert_eq!(
        named,
        ["pd-abort-incomplete-kv", "pd-abort-reuses-pages"],
        "{rounds:?}"
    );
    // Transferred: the leak alone.
    let b = pd(m, &transferred(), PatchSet::none());
    let mut f = |set: &PatchSet| probe(&b, m, set, &th, Criterion::Behaviour);
    let r = bisect(&PatchSet::none(), &space, &mut f).unwrap();
    assert_eq!(r.culprits, Some(vec!["pd-abort-leaks".to_string()]), "{r}");
    assert!(r.found(), "{r}");
}

fn the_oracle_flags_reuses_pages_and_incomplete_kv_with_no_golden_run(p: Preset) {
    let m = families::model(p);
    let opts = ReplayOptions::new(PatchSet::none(), Threads::new(2).unwrap());
    let clean = pd(m, &mid_transfer(), PatchSet::none());
    assert!(oracle(&clean, m, &opts).unwrap().is_bit_exact());
    for (patch, harmed) in [
        ("pd-abort-reuses-pages", "b"),
        ("pd-abort-incomplete-kv", "a"),
    ] {
        let bad = pd(m, &mid_transfer(), PatchSet::parse(patch).unwrap());
        assert!(run(&bad, m, PatchSet::parse(patch).unwrap()).is_bit_exact());
        let o = oracle(&bad, m, &opts).unwrap();
        let d = o
            .divergence()
            .unwrap_or_else(|| panic!("the oracle misses {patch}"));
        assert_eq!(
            (d.request.as_deref(), d.signal),
            (Some(harmed), Signal::Logits),
            "{patch}"
        );
    }
}

/// The HTML report of a disaggregated bundle: a prefill and a decode lane
/// per request, the transfers on the decode lanes, the writes that went on
/// after the abort marked as such, in the SVG and in the data part.
#[test]
fn the_html_report_shows_both_engines_lanes_and_the_transfers() {
    use lmrr_replays::html::ReportData;
    use lmrr_replays::replay_traced;
    let path = format!("{}/pd-incident-bug.lmrr", env!("CARGO_MANIFEST_DIR"));
    let b = lmrr_recorder::open(std::path::Path::new(&path)).unwrap();
    let m = Model::synthetic(b.manifest.model.synthetic.unwrap()).unwrap();
    let mut opts = ReplayOptions::new(PatchSet::none(), Threads::new(2).unwrap());
    opts.trace_steps = u64::MAX;
    let (o, t) = replay_traced(&b, &m, &opts).unwrap();
    let r = ReportData::replay(
        &b,
        "pd-incident-bug.lmrr",
        "lmrr replay",
        &m,
        "none",
        &o,
        &t,
    );
    let lanes: Vec<(String, Option<String>)> = r
        .timeline
        .lanes
        .iter()
        .map(|l| (l.request.clone(), l.engine.clone()))
        .collect();
    let want: Vec<(String, Option<String>)> = ["turn1", "turn2"]
        .iter()
        .flat_map(|n| ["prefill", "decode"].map(|e| (n.to_string(), Some(e.to_string()))))
        .collect();
    assert_eq!(lanes, want);
    let kinds = |lane: usize| -> Vec<String> {
        r.timeline.lanes[lane]
            .runs
            .iter()
            .map(|run| format!("{:?}", run.kind))
            .collect()
    };
    // turn1's decode lane: its transfer, then the orphaned writes.
    assert_eq!(kinds(1), ["Transfer", "OrphanTransfer"]);
    // turn2: prefill on the prefill lane; transfer then decode on the decode lane.
    assert_eq!(kinds(2), ["Prefill"]);
    assert_eq!(kinds(3), ["Transfer", "Decode"]);
    let html = r.to_html().unwrap();
    for needle in [
        "turn1 · turn 1 · decode",
        "turn2 · turn 2 · prefill",
        "class=\"transfer\"",
        "class=\"orphan-transfer\"",
        "K/V transfer into decode pages",
    ] {
        assert!(html.contains(needle), "{needle}");
    }
}
