//! The serving core against the contract, on every family's tiny model:
//! every request's tokens and logits bits equal the same request run alone
//! with no cache (I4, with I2/I3 along the way), over random sessions with
//! shared prefixes, interrupts, tiny pools (eviction and preemption), page
//! sizes that cut mini-v4's index blocks anywhere and token budgets from 1
//! up; plus pool accounting, and page hashes over every row a family keeps.

use crate::families;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

use families::{assert_reaches_sparse, model, sparse_from};
use lmrr_engine::pool::{BlockTable, PagePool, PagedKv};
use lmrr_engine::{
    generate, Decision, EngineConfig, FinishReason, GenerateOptions, KvCache, LogitsWanted, Model,
    Preset, Request, SamplingParams, Scheduler, SeqKvStore, SeqSpan, StepReport,
};
use lmrr_kernels::Threads;

per_family!(
    i4_every_request_equals_its_solo_cache_off_run,
    sessions_are_deterministic_step_by_step_and_across_threads,
    a_second_turn_reuses_the_first_turns_pages,
    a_tiny_pool_forces_preemption_and_the_results_still_match,
    forced_decisions_reproduce_the_step_reports,
    requests_that_can_never_fit_are_refused_with_numbers,
    page_hashes_cover_every_row_the_family_stores,
    storage_bytes_count_every_row_the_family_stores,
    slot_digests_are_the_same_on_any_thread_count,
);

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

/// Random sessions over prefixes of `prefix_len` tokens; the first request
/// always carries a whole prefix, so on mini-v4 (prefixes past its first
/// sparse position) every session runs sparse attention.
fn arb_session(prefix_len: usize) -> impl Strategy<Value = Session> {
    let req = (
        0usize..4,
        0usize..prefix_len,
        1usize..20,
        1usize..12,
        any::<bool>(),
        0u64..8,
        proptest::option::of(0usize..10),
        any::<u64>(),
    );
    (
        prop_oneof![Just(1usize), Just(3), Just(7), Just(16), Just(64)],
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
        .prop_map(move |(page_size, extra_pages, budget, cache, reqs)| {
            let n = prefix_len;
            let prefixes = [toks(1, n), toks(2, n), toks(3, n), Vec::new()];
            let reqs: Vec<Planned> = reqs
                .into_iter()
                .enumerate()
                .map(
                    |(i, (pfx, plen, slen, max_tokens, sampled, arrive, intr, seed))| {
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
fn run(m: &'static Model, s: &Session, th: &Threads) -> (Scheduler<'static>, Vec<StepReport>) {
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

fn solo(m: &Model, req: &Request, max_tokens: usize) -> (Vec<u32>, [u8; 32]) {
    if max_tokens == 0 {
        // Interrupted before its first token; `generate` refuses 0 tokens.
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

/// I4 over one session.
fn i4_holds(m: &'static Model, s: &Session) -> Result<(), TestCaseError> {
    let th = Threads::new(2).unwrap();
    let (sch, _) = run(m, s, &th);
    for p in &s.reqs {
        let out = sch.output(p.req.id).expect("every request ends");
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
    Ok(())
}

/// The I4 property test: 40 random sessions per family. Prefixes are 40
/// tokens on llama; on mini-v4 they run 16 past its first sparse position.
fn i4_every_request_equals_its_solo_cache_off_run(p: Preset) {
    let m = model(p);
    let prefix_len = sparse_from(m).map_or(40, |from| from + 16);
    assert_reaches_sparse(m, prefix_len + 1, "I4's first request");
    let mut runner = TestRunner::new(Config {
        cases: 40,
        failure_persistence: None,
        ..Config::default()
    });
    if let Err(e) = runner.run(&arb_session(prefix_len), |s| i4_holds(m, &s)) {
        panic!("{p}: {e}");
    }
}

fn sessions_are_deterministic_step_by_step_and_across_threads(p: Preset) {
    let m = model(p);
    let s = Session {
        cfg: EngineConfig {
            page_size: 4,
            pool_pages: 120,
            max_batch_tokens: 9,
            prefix_cache: true,
        },
        reqs: (0..5)
            .map(|i| Planned {
                req: Request {
                    id: i,
                    prompt: [toks(7, 60), toks(100 + i, 5 + i as usize)].concat(),
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
    assert_reaches_sparse(m, 65 + 8, "the session's requests");
    let (_, a) = run(m, &s, &Threads::single());
    let (_, b) = run(m, &s, &Threads::new(3).unwrap());
    assert_eq!(a, b);
}

/// Turn 2 carries turn 1 and more: it is served turn 1's full pages from the
/// cache (7-position pages, across index blocks) and computes the rest.
fn a_second_turn_reuses_the_first_turns_pages(p: Preset) {
    let m = model(p);
    let th = Threads::single();
    let page_size = 7;
    let mut sch = Scheduler::new(
        m.net(),
        EngineConfig {
            page_size,
            ..Default::default()
        },
        th,
    )
    .unwrap();
    let turn1 = Request {
        id: 1,
        prompt: toks(5, 60),
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
    assert_reaches_sparse(m, history.len(), "turn 2's prompt");
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
    // Turn 1 computed KV for its 60 prompt tokens and 9 of its 10 outputs (the
    // last was sampled, never fed): 69 positions, 9 full pages of 7.
    assert_eq!(out2.cached_tokens, 9 * 7);
    let (t, d) = solo(m, &turn2, 5);
    assert_eq!(out2.tokens, t);
    assert_eq!(out2.digest, d);
}

fn a_tiny_pool_forces_preemption_and_the_results_still_match(p: Preset) {
    let m = model(p);
    let (prompt_len, max_tokens, page_size) = (60, 10, 4);
    assert_reaches_sparse(m, prompt_len + max_tokens, "each request");
    let reqs: Vec<Request> = (0..3)
        .map(|i| Request {
            id: i,
            prompt: toks(40 + i, prompt_len),
            sampling: SamplingParams::default(),
            max_tokens,
            stop_at_eos: false,
        })
        .collect();
    // Each request needs 18 pages of 4 at most; the pool has half as many
    // again, so two cannot run to the end together.
    let need = (prompt_len + max_tokens).div_ceil(page_size);
    let cfg = EngineConfig {
        page_size,
        pool_pages: need + need / 2,
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
        let (t, d) = solo(m, r, max_tokens);
        assert_eq!((&out.tokens, out.digest), (&t, d), "request {}", r.id);
    }
    assert_eq!(sch.free_pages(), cfg.pool_pages);
}

fn forced_decisions_reproduce_the_step_reports(p: Preset) {
    let m = model(p);
    let s = Session {
        cfg: EngineConfig {
            page_size: 2,
            pool_pages: 160,
            max_batch_tokens: 16,
            prefix_cache: true,
        },
        reqs: (0..4)
            .map(|i| Planned {
                req: Request {
                    id: i,
                    prompt: [toks(9, 60), toks(200 + i, 3)].concat(),
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
    assert_reaches_sparse(m, 63 + 6, "the session's requests");
    let (_, reports) = run(m, &s, &Threads::single());
    // Replay: submit at the same steps, force each step's decisions.
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

fn requests_that_can_never_fit_are_refused_with_numbers(p: Preset) {
    let m = model(p);
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
}

/// A pool with `pages` pages of `ps` positions, one sequence (id 1) holding
/// `toks` computed by the model's forward pass.
fn filled_pool(m: &Model, ps: usize, pages: usize, toks: &[u32]) -> PagedKv {
    filled_pool_on(m, ps, pages, toks, None)
}

/// [`filled_pool`], its slots digested by `finish_step_on(threads)` where
/// given, else by `finish_step`.
fn filled_pool_on(
    m: &Model,
    ps: usize,
    pages: usize,
    toks: &[u32],
    threads: Option<&Threads>,
) -> PagedKv {
    let mut kv = PagedKv::new(PagePool::new(ps, pages, m.net.kv_layout()).unwrap());
    let ids = (0..toks.len().div_ceil(ps))
        .map(|_| kv.pool.alloc().unwrap().unwrap())
        .collect();
    kv.tables.insert(1, BlockTable { pages: ids, len: 0 });
    let span = SeqSpan {
        seq: 1,
        start: 0,
        tokens: toks,
        logits: LogitsWanted::None,
    };
    m.net.forward(&mut kv, &[span], &Threads::single()).unwrap();
    match threads {
        Some(t) => kv.finish_step_on(t),
        None => kv.finish_step(),
    }
    kv
}

/// `finish_step_on` hashes the written slots across threads: every slot
/// digest and page hash equals the one-thread pass's, over several pages
/// (a ragged last one) and every row the family keeps.
fn slot_digests_are_the_same_on_any_thread_count(p: Preset) {
    let m = model(p);
    let toks: Vec<u32> = (0..45).map(|i| 3 + (i * 7) % 50).collect();
    let ps = 8;
    let fill = |threads: Option<&Threads>| {
        let kv = filled_pool_on(m, ps, 8, &toks, threads);
        let digests: Vec<[u8; 32]> = kv.tables[&1]
            .pages
            .iter()
            .flat_map(|&pg| (0..ps).map(move |s| (pg, s)))
            .map(|(pg, s)| kv.pool.slot_digest(pg, s))
            .collect();
        (digests, page_hashes(&kv))
    };
    let one = fill(None);
    assert!(one.0.iter().any(|d| *d != [0u8; 32]), "slots were hashed");
    for n in [2, 3] {
        let th = Threads::new(n).unwrap();
        assert_eq!(fill(Some(&th)), one, "{n} threads");
    }
}

fn page_hashes(kv: &PagedKv) -> Vec<[u8; 32]> {
    kv.tables[&1]
        .pages
        .iter()
        .map(|&p| kv.pool.page_hash(p))
        .collect()
}

/// Flips the lowest bit of one element of one row of sequence 1 at `pos`
/// in `layer`: `row` 0 is K, 1 is V (`d` floats; their last element), 2 the
/// auxiliary row (its element `at`).
fn flip(kv: &mut PagedKv, (row, at): (usize, usize), layer: usize, pos: usize, d: usize) {
    let flip = |r: &mut Vec<f32>| {
        let x = r.last_mut().unwrap();
        *x = f32::from_bits(x.to_bits() ^ 1);
    };
    if row == 2 {
        let mut a = kv.aux_view(1, layer).row(pos).to_vec();
        a[at] = f32::from_bits(a[at].to_bits() ^ 1);
        kv.write_aux(1, layer, pos, &a);
    } else {
        let view = kv.view(1, layer);
        let (mut k, mut v) = (view.key(pos, d).to_vec(), view.value(pos, d).to_vec());
        flip(if row == 0 { &mut k } else { &mut v });
        kv.write(1, layer, pos, &k, &v);
    }
    kv.finish_step();
}

/// What the cache-state hash is made of: each page's content hash covers
/// every row the family keeps per position: K and V for llama; for mini-v4
/// (MLA, no K/V rows) the auxiliary row's normalised latent, rotated RoPE
/// key and indexer key. One flipped bit in any of them, at one position in
/// one layer, changes that page's hash and no other page's; flipping it
/// back restores it.
fn page_hashes_cover_every_row_the_family_stores(p: Preset) {
    let m = model(p);
    let layout = m.net.kv_layout();
    let ps = 7;
    let mut kv = filled_pool(m, ps, 8, &toks(21, 40));
    let before = page_hashes(&kv);
    let (layer, pos) = (layout.layers - 1, 3 * ps + 2);
    let rows: Vec<((usize, usize), &str)> = match m.mini_v4() {
        Some(v) => {
            // kv_lora_rank latent, qk_rope_head_dim key, index_head_dim key.
            let c = v.config();
            let (lr, rope) = (c.kv_lora_rank, c.qk_rope_head_dim);
            assert_eq!(
                (layout.kv_dim, layout.aux_dim),
                (0, lr + rope + c.index_head_dim)
            );
            let row = kv.aux_view(1, layer).row(pos).to_vec();
            for (part, r) in [
                ("latent", 0..lr),
                ("rope key", lr..lr + rope),
                ("indexer key", lr + rope..row.len()),
            ] {
                assert!(
                    row[r].iter().any(|&x| x != 0.0),
                    "the forward pass wrote no {part} at {pos}"
                );
            }
            vec![
                ((2, 0), "latent"),
                ((2, lr), "rope key"),
                ((2, lr + rope), "indexer key"),
            ]
        }
        None => {
            assert_eq!(layout.aux_dim, 0);
            vec![((0, 0), "K"), ((1, 0), "V")]
        }
    };
    for &(row, name) in &rows {
        flip(&mut kv, row, layer, pos, layout.kv_dim);
        let after = page_hashes(&kv);
        for (i, (a, b)) in before.iter().zip(&after).enumerate() {
            if i == pos / ps {
                assert_ne!(
                    a, b,
                    "a flipped {name} bit leaves page {i}'s hash as it was"
                );
            } else {
                assert_eq!(
                    a, b,
                    "a flipped {name} bit at {pos} changes page {i}'s hash"
                );
            }
        }
        flip(&mut kv, row, layer, pos, layout.kv_dim);
        assert_eq!(page_hashes(&kv), before, "{name} restored");
    }
}

/// The pool's storage is K, V and the auxiliary row per position and layer,
/// for the pages ever handed out: the same account as the per-sequence
/// store's, and for mini-v4 (no K/V rows) exactly its latent, RoPE-key and
/// indexer-key floats.
fn storage_bytes_count_every_row_the_family_stores(p: Preset) {
    let m = model(p);
    let layout = m.net.kv_layout();
    let (ps, used) = (16, 5);
    let pool_of = |layout| {
        let mut pool = PagePool::new(ps, 100, layout).unwrap();
        assert_eq!(pool.storage_bytes(), 0, "storage is lazy");
        for _ in 0..used {
            pool.alloc().unwrap().unwrap();
        }
        pool.storage_bytes()
    };
    let bytes = pool_of(layout);
    let per_position = layout.layers * (2 * layout.kv_dim + layout.aux_dim) * 4;
    assert_eq!(bytes, used * ps * per_position);
    let mut store = SeqKvStore::new(layout);
    store.prepare(1, 0, used * ps).unwrap();
    assert_eq!(bytes, store.bytes());
    if let Some(v) = m.mini_v4() {
        let c = v.config();
        let row = c.kv_lora_rank + c.qk_rope_head_dim + c.index_head_dim;
        assert_eq!(bytes, used * ps * c.num_hidden_layers * row * 4);
    }
}
