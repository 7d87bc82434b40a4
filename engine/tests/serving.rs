//! The serving core against the contract: every request's tokens and logits
//! bits equal the same request run alone with no cache (I4, with I2/I3 along
//! the way), over random sessions with shared prefixes, interrupts, tiny pools
//! (eviction and preemption) and token budgets from 1 up; plus pool accounting.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use proptest::prelude::*;

use lmrr_engine::{
    generate, Decision, EngineConfig, FinishReason, GenerateOptions, Model, Request,
    SamplingParams, Scheduler, StepReport, SynthSpec,
};
use lmrr_kernels::Threads;

fn model() -> &'static Model {
    static M: OnceLock<Model> = OnceLock::new();
    M.get_or_init(|| Model::from_files(SynthSpec::embedded_default().build()).unwrap())
}

#[derive(Debug, Clone)]
struct Planned {
    req: Request,
    arrive: u64,
    interrupt_after: Option<usize>,
}

#[derive(Debug, Clone)]
struct Session {
    cfg: EngineConfig,
    reqs: Vec<Planned>,
}

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

fn arb_session() -> impl Strategy<Value = Session> {
    let req = (
        0usize..4,
        0usize..40,
        1usize..20,
        1usize..12,
        any::<bool>(),
        0u64..8,
        proptest::option::of(0usize..10),
        any::<u64>(),
    );
    (
        prop_oneof![Just(1usize), Just(3), Just(16)],
        0usize..6,
        prop_oneof![
            Just(1usize),
            Just(2),
            Just(5),
            Just(17),
            Just(64),
            Just(1000)
        ],
        any::<bool>(),
        proptest::collection::vec(req, 2..6),
    )
        .prop_map(|(page_size, extra_pages, budget, cache, reqs)| {
            let prefixes = [toks(1, 40), toks(2, 40), toks(3, 40), Vec::new()];
            let reqs: Vec<Planned> = reqs
                .into_iter()
                .enumerate()
                .map(
                    |(i, (pfx, plen, slen, max_tokens, sampled, arrive, intr, seed))| {
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
                            interrupt_after: intr,
                        }
                    },
                )
                .collect();
            let max_need = reqs
                .iter()
                .map(|p| (p.req.prompt.len() + p.req.max_tokens).div_ceil(page_size))
                .max()
                .unwrap_or(1);
            let cfg = EngineConfig {
                page_size,
                pool_pages: max_need + extra_pages,
                max_batch_tokens: budget,
                prefix_cache: cache,
            };
            Session { cfg, reqs }
        })
}

/// Runs a session; checks accounting after every step.
fn run(s: &Session, th: &Threads) -> (Scheduler<'static>, Vec<StepReport>) {
    let m = model();
    let mut sch = Scheduler::new(m.net(), s.cfg, th.clone()).unwrap();
    let mut reports = Vec::new();
    let mut submitted = 0;
    let mut step = 0u64;
    while submitted < s.reqs.len() || !sch.is_idle() {
        for p in s.reqs.iter().filter(|p| p.arrive == step) {
            sch.submit(p.req.clone()).unwrap();
            submitted += 1;
        }
        for p in &s.reqs {
            if let (Some(k), Some(g)) = (p.interrupt_after, sch.generated(p.req.id)) {
                if g.len() >= k && sch.output(p.req.id).is_none() {
                    sch.interrupt(p.req.id).unwrap();
                }
            }
        }
        let r = sch.step().unwrap();
        sch.check_accounting()
            .unwrap_or_else(|e| panic!("step {step}: {e}"));
        reports.push(r);
        step += 1;
        assert!(step < 10_000, "session does not terminate");
    }
    (sch, reports)
}

fn solo(req: &Request, max_tokens: usize) -> (Vec<u32>, [u8; 32]) {
    if max_tokens == 0 {
        // Interrupted before its first token; `generate` refuses 0 tokens.
        use sha2::Digest;
        return (Vec::new(), sha2::Sha256::digest([]).into());
    }
    let m = model();
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

proptest! {
    #![proptest_config(ProptestConfig { cases: 40, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn i4_every_request_equals_its_solo_cache_off_run(s in arb_session()) {
        let th = Threads::new(2).unwrap();
        let (sch, _) = run(&s, &th);
        for p in &s.reqs {
            let out = sch.output(p.req.id).expect("every request ends");
            let (want_tokens, want_digest) = solo(&p.req, if out.finish == FinishReason::Interrupted { out.tokens.len() } else { p.req.max_tokens });
            prop_assert_eq!(&out.tokens, &want_tokens, "request {} ({:?})", p.req.id, out.finish);
            prop_assert_eq!(out.digest, want_digest, "request {} logits bits", p.req.id);
            if let Some(k) = p.interrupt_after {
                prop_assert!(out.tokens.len() <= k.max(1) || out.finish != FinishReason::Interrupted);
            }
        }
        // Nothing leaks: with every request done, pages are free or cached.
        prop_assert_eq!(sch.pages_held_by_requests(), 0);
        prop_assert_eq!(sch.free_pages() + sch.cached_pages(), s.cfg.pool_pages);
        if !s.cfg.prefix_cache {
            prop_assert_eq!(sch.cached_pages(), 0);
        }
    }
}

#[test]
fn sessions_are_deterministic_step_by_step_and_across_threads() {
    let s = Session {
        cfg: EngineConfig {
            page_size: 4,
            pool_pages: 40,
            max_batch_tokens: 9,
            prefix_cache: true,
        },
        reqs: (0..5)
            .map(|i| Planned {
                req: Request {
                    id: i,
                    prompt: [toks(7, 21), toks(100 + i, 5 + i as usize)].concat(),
                    sampling: SamplingParams {
                        temperature: 0.7,
                        top_k: 0,
                        top_p: 1.0,
                        seed: i,
                    },
                    max_tokens: 8,
                    stop_at_eos: false,
                },
                arrive: i,
                interrupt_after: (i == 2).then_some(3),
            })
            .collect(),
    };
    let (_, a) = run(&s, &Threads::single());
    let (_, b) = run(&s, &Threads::new(3).unwrap());
    assert_eq!(a, b);
}

#[test]
fn a_second_turn_reuses_the_first_turns_pages() {
    let m = model();
    let th = Threads::single();
    let mut sch = Scheduler::new(
        m.net(),
        EngineConfig {
            page_size: 4,
            ..Default::default()
        },
        th,
    )
    .unwrap();
    let turn1 = Request {
        id: 1,
        prompt: toks(5, 30),
        sampling: SamplingParams::default(),
        max_tokens: 10,
        stop_at_eos: false,
    };
    sch.submit(turn1.clone()).unwrap();
    while !sch.is_idle() {
        sch.step().unwrap();
    }
    let out1 = sch.output(1).unwrap().clone();
    let mut history = turn1.prompt.clone();
    history.extend(&out1.tokens);
    history.extend(toks(6, 7));
    let turn2 = Request {
        id: 2,
        prompt: history,
        sampling: SamplingParams::default(),
        max_tokens: 5,
        stop_at_eos: false,
    };
    sch.submit(turn2.clone()).unwrap();
    while !sch.is_idle() {
        sch.step().unwrap();
    }
    let out2 = sch.output(2).unwrap();
    // Turn 1 computed KV for its 30 prompt tokens and 9 of its 10 outputs: 39
    // positions, 9 full pages of 4.
    assert_eq!(out2.cached_tokens, 36);
    let (t, d) = solo(&turn2, 5);
    assert_eq!(out2.tokens, t);
    assert_eq!(out2.digest, d);
}

#[test]
fn a_tiny_pool_forces_preemption_and_the_results_still_match() {
    let m = model();
    let reqs: Vec<Request> = (0..3)
        .map(|i| Request {
            id: i,
            prompt: toks(40 + i, 10),
            sampling: SamplingParams::default(),
            max_tokens: 10,
            stop_at_eos: false,
        })
        .collect();
    // Each request needs 5 pages of 4 at most; the pool has 7.
    let cfg = EngineConfig {
        page_size: 4,
        pool_pages: 7,
        max_batch_tokens: 64,
        prefix_cache: false,
    };
    let mut sch = Scheduler::new(m.net(), cfg, Threads::single()).unwrap();
    for r in &reqs {
        sch.submit(r.clone()).unwrap();
    }
    let mut preempts = 0;
    while !sch.is_idle() {
        let rep = sch.step().unwrap();
        preempts += rep
            .decisions
            .iter()
            .filter(|d| matches!(d, Decision::Preempt { .. }))
            .count();
        sch.check_accounting().unwrap();
    }
    assert!(preempts > 0, "the pool should have forced a preemption");
    for r in &reqs {
        let out = sch.output(r.id).unwrap();
        let (t, d) = solo(r, 10);
        assert_eq!((&out.tokens, out.digest), (&t, d), "request {}", r.id);
    }
    assert_eq!(sch.free_pages(), 7);
}

#[test]
fn forced_decisions_reproduce_the_step_reports() {
    let s = Session {
        cfg: EngineConfig {
            page_size: 2,
            pool_pages: 30,
            max_batch_tokens: 6,
            prefix_cache: true,
        },
        reqs: (0..4)
            .map(|i| Planned {
                req: Request {
                    id: i,
                    prompt: [toks(9, 8), toks(200 + i, 3)].concat(),
                    sampling: SamplingParams {
                        temperature: 1.0,
                        top_k: 10,
                        top_p: 1.0,
                        seed: 5,
                    },
                    max_tokens: 6,
                    stop_at_eos: false,
                },
                arrive: i / 2,
                interrupt_after: (i == 1).then_some(2),
            })
            .collect(),
    };
    let (_, reports) = run(&s, &Threads::single());
    // Replay: submit at the same steps, force each step's decisions.
    let m = model();
    let mut sch = Scheduler::new(m.net(), s.cfg, Threads::single()).unwrap();
    for (step, rep) in reports.iter().enumerate() {
        for p in s.reqs.iter().filter(|p| p.arrive == step as u64) {
            sch.submit(p.req.clone()).unwrap();
        }
        let got = sch.step_forced(rep.decisions.clone()).unwrap();
        assert_eq!(&got, rep, "step {step}");
    }
    // An infeasible forced decision is an error, not a panic.
    let e = sch
        .step_forced(vec![Decision::Schedule {
            id: 99,
            start: 0,
            len: 1,
        }])
        .unwrap_err();
    assert!(e.to_string().contains("99"), "{e}");
}

#[test]
fn requests_that_can_never_fit_are_refused_with_numbers() {
    let m = model();
    let mut sch = Scheduler::new(
        m.net(),
        EngineConfig {
            page_size: 16,
            pool_pages: 2,
            ..Default::default()
        },
        Threads::single(),
    )
    .unwrap();
    let e = sch
        .submit(Request {
            id: 3,
            prompt: toks(1, 30),
            sampling: SamplingParams::default(),
            max_tokens: 10,
            stop_at_eos: true,
        })
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("request `3`")
            && e.contains("40 tokens")
            && e.contains("3 pages")
            && e.contains("has 2"),
        "{e}"
    );
    let _ = BTreeMap::<u8, u8>::new();
}
