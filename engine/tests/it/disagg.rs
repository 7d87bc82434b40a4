//! The disaggregated deployment against the contract, on every family's tiny
//! model: every request's tokens and logits bits equal the same request run
//! alone with no cache, whatever the two engines' page sizes, pools and
//! budgets and the link's rate, over random sessions whose aborts land at
//! random steps (so at every stage: queued, prefilling, transferring,
//! transferred, decoding); pool accounting holds on both engines after
//! every step and nothing is held at the end. Then each stage's abort and
//! each disaggregation patch, by construction.

use crate::families;

use std::collections::BTreeSet;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

use families::{model, sparse_from};
use lmrr_engine::{
    generate, EngineConfig, EngineError, FinishReason, GenerateOptions, Model, PatchSet, PdConfig,
    PdEngine, PdEvent, PdStep, Preset, Request, SamplingParams, Stage,
};
use lmrr_kernels::Threads;

per_family!(
    every_request_equals_its_solo_run_whatever_the_deployment,
    an_abort_lands_at_every_stage_and_frees_what_the_stage_holds,
    reuses_pages_corrupts_the_next_request_and_the_clean_path_does_not,
    incomplete_kv_decodes_an_aborted_request_on_unwritten_pages,
    leaks_exhaust_the_decode_pool_and_the_livelock_report_says_so,
);

fn toks(seed: u64, n: usize) -> Vec<u32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % 1000) as u32 + 3
        })
        .collect()
}

#[derive(Debug, Clone)]
struct Planned {
    req: Request,
    arrive: u64,
    /// Abort at the boundary before this step.
    abort_at: Option<u64>,
}

#[derive(Debug, Clone)]
struct Session {
    prefill: EngineConfig,
    pd: PdConfig,
    reqs: Vec<Planned>,
}

fn cfg(page_size: usize, pages: usize, budget: usize, cache: bool) -> EngineConfig {
    EngineConfig {
        page_size,
        pool_pages: pages,
        max_batch_tokens: budget,
        prefix_cache: cache,
    }
}

fn arb_session(prefix_len: usize) -> impl Strategy<Value = Session> {
    let req = (
        0usize..4,
        0usize..prefix_len,
        1usize..12,
        1usize..10,
        any::<bool>(),
        0u64..8,
        proptest::option::of(0u64..30),
        any::<u64>(),
    );
    let side = (
        prop_oneof![Just(1usize), Just(3), Just(4), Just(16)],
        0usize..6,
        prop_oneof![Just(1usize), Just(5), Just(17), Just(1000)],
        any::<bool>(),
    );
    (
        side.clone(),
        side,
        1usize..4,
        proptest::collection::vec(req, 2..6),
    )
        .prop_map(move |(p, d, rate, reqs)| {
            let n = prefix_len;
            let prefixes = [toks(1, n), toks(2, n), toks(3, n), Vec::new()];
            let reqs: Vec<Planned> = reqs
                .into_iter()
                .enumerate()
                .map(
                    |(i, (pfx, plen, slen, max_tokens, sampled, arrive, abort_at, seed))| {
                        let (pfx, plen) = if i == 0 { (pfx % 3, n) } else { (pfx, plen) };
                        let mut prompt = prefixes[pfx][..plen.min(prefixes[pfx].len())].to_vec();
                        prompt.extend(toks(seed | 1, slen));
                        let sampling = if sampled {
                            SamplingParams {
                                temperature: 0.8,
                                top_k: 50,
                                top_p: 0.9,
                                seed,
                            }
                        } else {
                            SamplingParams::default()
                        };
                        Planned {
                            req: Request {
                                id: i as u64 + 10,
                                prompt,
                                sampling,
                                max_tokens,
                                stop_at_eos: true,
                            },
                            arrive,
                            abort_at,
                        }
                    },
                )
                .collect();
            let need = |ps: usize, whole: bool| {
                reqs.iter()
                    .map(|q| {
                        (q.req.prompt.len() + if whole { q.req.max_tokens } else { 1 }).div_ceil(ps)
                    })
                    .max()
                    .unwrap_or(1)
            };
            Session {
                prefill: cfg(p.0, need(p.0, false) + p.1, p.2, p.3),
                pd: PdConfig {
                    decode: cfg(d.0, need(d.0, true) + d.1, d.2, d.3),
                    transfer_pages_per_step: rate,
                },
                reqs,
            }
        })
}

/// Runs a session, checking both pools' accounting after every step.
fn run(m: &'static Model, s: &Session, patches: PatchSet) -> (PdEngine<'static>, Vec<PdStep>) {
    let th = Threads::new(2).unwrap();
    let mut pd = PdEngine::new(m.net(), s.prefill, s.pd, th, patches).unwrap();
    let mut steps = Vec::new();
    let mut submitted = 0;
    let mut step = 0u64;
    while submitted < s.reqs.len() || !pd.is_idle() {
        for p in s.reqs.iter().filter(|p| p.arrive == step) {
            pd.submit(p.req.clone()).unwrap();
            submitted += 1;
        }
        for p in &s.reqs {
            if p.abort_at == Some(step) && p.arrive <= step {
                pd.interrupt(p.req.id).unwrap();
            }
        }
        let r = pd.step().unwrap();
        pd.check_accounting()
            .unwrap_or_else(|e| panic!("step {step}: {e}"));
        steps.push(r);
        step += 1;
        assert!(step < 10_000, "session does not terminate");
    }
    (pd, steps)
}

fn solo(m: &Model, req: &Request, max_tokens: usize) -> (Vec<u32>, [u8; 32]) {
    if max_tokens == 0 {
        use sha2::Digest;
        return (Vec::new(), sha2::Sha256::digest([]).into());
    }
    let opts = GenerateOptions {
        max_tokens,
        sampling: req.sampling,
        prefill_chunk: None,
        stop_at_eos: req.stop_at_eos,
        keep_logits: false,
    };
    let g = generate(m.net(), &req.prompt, &opts, &Threads::single()).unwrap();
    (g.tokens, g.digest)
}

fn contract_holds(m: &'static Model, s: &Session) -> Result<(), TestCaseError> {
    let (pd, _) = run(m, s, PatchSet::none());
    for p in &s.reqs {
        let out = pd.output(p.req.id).expect("every request ends");
        let max = if out.finish == FinishReason::Interrupted {
            out.tokens.len()
        } else {
            p.req.max_tokens
        };
        let (want_tokens, want_digest) = solo(m, &p.req, max);
        prop_assert_eq!(
            &out.tokens,
            &want_tokens,
            "request {} ({:?})",
            p.req.id,
            out.finish
        );
        prop_assert_eq!(out.digest, want_digest, "request {} logits bits", p.req.id);
    }
    for side in [lmrr_engine::Side::Prefill, lmrr_engine::Side::Decode] {
        let e = pd.engine(side);
        prop_assert_eq!(e.pages_held_by_requests(), 0, "{} engine holds pages", side);
        prop_assert_eq!(e.free_pages() + e.cached_pages(), e.config().pool_pages);
    }
    Ok(())
}

/// The contract over 40 random disaggregated sessions per family.
fn every_request_equals_its_solo_run_whatever_the_deployment(p: Preset) {
    let m = model(p);
    let prefix_len = sparse_from(m).map_or(40, |from| from + 16);
    let mut runner = TestRunner::new(Config {
        cases: 40,
        failure_persistence: None,
        ..Config::default()
    });
    if let Err(e) = runner.run(&arb_session(prefix_len), |s| contract_holds(m, &s)) {
        panic!("{p}: {e}");
    }
}

fn plain(id: u64, prompt: Vec<u32>, max_tokens: usize) -> Planned {
    Planned {
        req: Request {
            id,
            prompt,
            sampling: SamplingParams::default(),
            max_tokens,
            stop_at_eos: false,
        },
        arrive: 0,
        abort_at: None,
    }
}

/// Small pages, one page per step: a 20-token prompt takes three prefill
/// steps and five transfers.
fn slow_link() -> (EngineConfig, PdConfig) {
    let c = cfg(4, 64, 8, true);
    (
        c,
        PdConfig {
            decode: c,
            transfer_pages_per_step: 1,
        },
    )
}

/// The stage each step's aborts found.
fn abort_stages(steps: &[PdStep]) -> Vec<Stage> {
    steps
        .iter()
        .flat_map(|s| &s.before)
        .filter_map(|e| match e {
            PdEvent::Abort { stage, .. } => Some(*stage),
            _ => None,
        })
        .collect()
}

/// An abort at each step of a request's life finds each stage in turn, and
/// the deployment is left holding nothing; the request's tokens are a
/// prefix of its solo run.
fn an_abort_lands_at_every_stage_and_frees_what_the_stage_holds(p: Preset) {
    let m = model(p);
    let (pc, pd) = slow_link();
    let mut seen = BTreeSet::new();
    for at in 0..14 {
        let mut r = plain(1, toks(5, 20), 6);
        r.abort_at = Some(at);
        let s = Session {
            prefill: pc,
            pd,
            reqs: vec![r.clone()],
        };
        let (eng, steps) = run(m, &s, PatchSet::none());
        for st in abort_stages(&steps) {
            seen.insert(format!("{st}"));
        }
        let out = eng.output(1).unwrap();
        let (want, digest) = solo(m, &r.req, out.tokens.len());
        assert_eq!(out.tokens, want, "abort at {at}");
        assert_eq!(out.digest, digest, "abort at {at}");
        for side in [lmrr_engine::Side::Prefill, lmrr_engine::Side::Decode] {
            assert_eq!(
                eng.engine(side).pages_held_by_requests(),
                0,
                "abort at {at}"
            );
        }
    }
    let want: BTreeSet<String> = [
        Stage::QueuedForPrefill,
        Stage::Prefilling,
        Stage::Transferring,
        Stage::Transferred,
        Stage::Decoding,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    // Queued needs a request behind another: checked below.
    let missing: Vec<&String> = want
        .iter()
        .filter(|s| !seen.contains(*s) && s.as_str() != "queued for prefill")
        .collect();
    assert!(missing.is_empty(), "stages never reached: {missing:?}");
    // Queued: a second request behind a one-token budget.
    let mut c = pc;
    c.max_batch_tokens = 1;
    let mut b = plain(2, toks(6, 8), 3);
    b.abort_at = Some(1);
    let s = Session {
        prefill: c,
        pd,
        reqs: vec![plain(1, toks(5, 20), 3), b],
    };
    let (_, steps) = run(m, &s, PatchSet::none());
    assert_eq!(abort_stages(&steps), vec![Stage::QueuedForPrefill]);
}

/// The first step whose aborts found `stage` for a request alone on a slow
/// link, aborted at `at`.
fn abort_step_for(m: &'static Model, stage: Stage) -> u64 {
    let (pc, pd) = slow_link();
    for at in 0..20 {
        let mut r = plain(1, toks(5, 20), 6);
        r.abort_at = Some(at);
        let s = Session {
            prefill: pc,
            pd,
            reqs: vec![r],
        };
        let (_, steps) = run(m, &s, PatchSet::none());
        if abort_stages(&steps) == [stage] {
            return at;
        }
    }
    panic!("no abort step finds {stage}");
}

/// A aborted mid-transfer; B arrives at once, reserves A's freed pages, and
/// A's writer goes on writing into them: B's logits differ from its solo
/// run under the patch, equal it without.
fn reuses_pages_corrupts_the_next_request_and_the_clean_path_does_not(p: Preset) {
    let m = model(p);
    let (pc, pd) = slow_link();
    let at = abort_step_for(m, Stage::Transferring) + 1;
    let mut a = plain(1, toks(5, 20), 6);
    a.abort_at = Some(at);
    let mut b = plain(2, toks(7, 20), 6);
    b.arrive = at;
    let s = Session {
        prefill: pc,
        pd,
        reqs: vec![a, b.clone()],
    };
    let (want, digest) = solo(m, &b.req, 6);
    let (clean, _) = run(m, &s, PatchSet::none());
    assert_eq!(clean.output(2).unwrap().tokens, want);
    assert_eq!(clean.output(2).unwrap().digest, digest);
    let (bad, steps) = run(m, &s, PatchSet::parse("pd-abort-reuses-pages").unwrap());
    let orphans = steps
        .iter()
        .flat_map(|s| &s.link)
        .filter(|e| matches!(e, PdEvent::Transfer { orphan: true, .. }))
        .count();
    assert!(orphans > 0, "the writer went on after the abort");
    assert_ne!(
        bad.output(2).unwrap().digest,
        digest,
        "B read A's late writes"
    );
}

/// Aborted mid-transfer under the patch, the request is admitted and
/// decodes on pages partly written; its logits then differ from its solo
/// run's. Without the patch it ends at the abort.
fn incomplete_kv_decodes_an_aborted_request_on_unwritten_pages(p: Preset) {
    let m = model(p);
    let (pc, pd) = slow_link();
    let at = abort_step_for(m, Stage::Transferring) + 1;
    // A first request leaves its K/V in the decode pool, so the pages the
    // aborted one never receives hold someone else's rows.
    let mut a = plain(2, toks(5, 20), 6);
    a.abort_at = Some(at + 40);
    a.arrive = 40;
    let s = Session {
        prefill: pc,
        pd,
        reqs: vec![plain(1, toks(9, 20), 4), a.clone()],
    };
    let (clean, _) = run(m, &s, PatchSet::none());
    assert_eq!(clean.output(2).unwrap().finish, FinishReason::Interrupted);
    let (bad, steps) = run(m, &s, PatchSet::parse("pd-abort-incomplete-kv").unwrap());
    let complete = steps.iter().flat_map(|s| &s.before).any(|e| {
        matches!(e, PdEvent::Complete { id: 2, pages_sent, pages_total } if pages_sent < pages_total)
    });
    assert!(complete, "the aborted transfer is concluded as complete");
    let out = bad.output(2).unwrap();
    assert_eq!(out.finish, FinishReason::Length, "it decodes to its end");
    let (_, digest) = solo(m, &a.req, 6);
    assert_ne!(out.digest, digest, "decoded on K/V never written");
}

/// Each request aborted between its transfer and its admission leaks its
/// reservation; a decode pool for two requests is exhausted after two, and
/// the third never runs: the livelock report names the leak.
fn leaks_exhaust_the_decode_pool_and_the_livelock_report_says_so(p: Preset) {
    let m = model(p);
    let at = abort_step_for(m, Stage::Transferred);
    let (pc, mut pd) = slow_link();
    pd.decode.pool_pages = 14;
    pd.decode.prefix_cache = false;
    let th = Threads::new(2).unwrap();
    let patches = PatchSet::parse("pd-abort-leaks").unwrap();
    let mut eng = PdEngine::new(m.net(), pc, pd, th, patches).unwrap();
    eng.set_stall_limit(50);
    let mut step = 0u64;
    for id in 1..=2u64 {
        let r = plain(id, toks(id + 20, 20), 6).req;
        eng.submit(r).unwrap();
        let start = step;
        loop {
            if step == start + at {
                eng.interrupt(id).unwrap();
            }
            eng.step().unwrap();
            step += 1;
            if eng.output(id).is_some() {
                break;
            }
        }
        assert_eq!(eng.output(id).unwrap().finish, FinishReason::Interrupted);
    }
    assert_eq!(eng.leaked().len(), 2, "both reservations leaked");
    eng.submit(plain(3, toks(30, 20), 6).req).unwrap();
    let err = loop {
        match eng.step() {
            Ok(_) => assert!(eng.steps() < 1000, "never stops"),
            Err(e) => break e,
        }
    };
    let EngineError::Livelock { report, .. } = &err else {
        panic!("{err}");
    };
    assert!(
        report.contains("leaked: 10 decode pages are held by 2 requests"),
        "{report}"
    );
    assert!(report.contains("the decode pool is exhausted"), "{report}");
    assert!(
        report.contains("request 3: transferring, waiting for a decode reservation"),
        "{report}"
    );
}

/// What crosses between the two engines is plain data: every message
/// survives an encoding to bytes and back, K/V rows bit for bit.
#[test]
fn link_messages_survive_an_encoding_to_bytes() {
    use lmrr_engine::disagg::PdMessage;
    let request = plain(7, toks(3, 9), 4).req;
    let rows = vec![1.5f32, -0.0, f32::MIN_POSITIVE, -3.4e38, 1e-45, 0.1];
    let msgs = vec![
        PdMessage::Bootstrap { request },
        PdMessage::Reserved {
            id: 7,
            pages: vec![4, 0, 9],
        },
        PdMessage::Kv {
            id: 7,
            start: 4,
            len: 1,
            pages: vec![4, 0, 9],
            rows: rows.clone(),
        },
        PdMessage::Done {
            id: 7,
            token: 11,
            row: rows.clone(),
        },
        PdMessage::Abort { id: 7 },
    ];
    for m in msgs {
        let bytes = serde_json::to_vec(&m).unwrap();
        let back: PdMessage = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(back, m);
        if let PdMessage::Kv { rows: r, .. } | PdMessage::Done { row: r, .. } = &back {
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(r), bits(&rows));
        }
    }
}
