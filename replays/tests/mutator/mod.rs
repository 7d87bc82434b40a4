//! Structure-aware mutation of real bundles, shared by the `replay_mutated`
//! fuzz target (`replays/fuzz`) and the hostile-bundle regression tests.
//!
//! A mutation decodes a recorded bundle, rewrites its manifest and events as
//! a byte string of operations directs (recorded numbers set to boundary
//! values, events deleted, duplicated or swapped, ids and tokens redirected),
//! and frames the result again with valid checksums, so that it gets past the
//! integrity layer and reaches validation and the replayer.

#![allow(dead_code)]

use lmrr_engine::scheduler::Decision;
use lmrr_engine::FinishReason;
use lmrr_engine::{run_session, EngineConfig, Model, PatchSet, Scheduler, Script, SynthSpec};
use lmrr_kernels::Threads;
use lmrr_recorder::{Bundle, BundleWriter, Event, Manifest, Recorder};

/// A short real session on the tiny model: shared prefix (cache hits),
/// chunked prefill, an interrupt and a follow-up turn, a sampled request.
pub const SEED_SCRIPT: &str = r#"
[defaults]
max_tokens = 6
ignore_eos = true

[[request]]
id = "a"
prompt = "The shared system prompt, then question one"
interrupt_after_tokens = 3

[[request]]
id = "b"
at_step = 1
prompt = "The shared system prompt, then question two"
temperature = 0.8
seed = 7

[[request]]
id = "c"
after = "a"
prompt = "The shared system prompt, then question one"
"#;

pub fn model() -> Model {
    Model::synthetic(SynthSpec::embedded_default()).expect("the embedded model builds")
}

/// Records [`SEED_SCRIPT`] on `model` with a small pool and batch budget so
/// that paging, chunking and the cache are all exercised.
pub fn seed_bundle(model: &Model, patches: PatchSet) -> Bundle {
    let cfg = EngineConfig {
        page_size: 4,
        pool_pages: 64,
        max_batch_tokens: 16,
        prefix_cache: true,
    };
    let script = Script::parse(SEED_SCRIPT, "seed.toml").expect("seed script parses");
    let manifest = Manifest::for_session(
        model,
        cfg,
        &patches,
        "seed.toml",
        SEED_SCRIPT,
        3,
        1,
        "fuzz",
        "fuzz",
    );
    let mut sch = Scheduler::with_patches(model.net(), cfg, Threads::single(), patches)
        .expect("seed config is valid");
    sch.set_top_logprobs(3);
    let mut rec = Recorder::new(Vec::new(), &manifest).expect("recorder");
    run_session(model, &script, &mut sch, |e| rec.observe(e)).expect("seed session runs");
    let bytes = rec.finish().expect("seed bundle finishes");
    lmrr_recorder::read(&bytes).expect("seed bundle reads")
}

/// Reads operation bytes; runs dry as zeros.
struct Ops<'a> {
    b: &'a [u8],
}

impl Ops<'_> {
    fn u8(&mut self) -> u8 {
        match self.b.split_first() {
            Some((&x, rest)) => {
                self.b = rest;
                x
            }
            None => 0,
        }
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }
    fn index(&mut self, len: usize) -> Option<usize> {
        (len > 0).then(|| self.u8() as usize % len)
    }
    /// A boundary value, or one derived from `cur`.
    fn value(&mut self, cur: u64) -> u64 {
        match self.u8() % 20 {
            0 => 0,
            1 => 1,
            2 => 2,
            3 => 3,
            4 => 4,
            5 => 15,
            6 => 16,
            7 => 17,
            8 => 255,
            9 => 1023,
            10 => 1024,
            11 => 2048,
            12 => 4096,
            13 => u32::MAX as u64,
            14 => u64::MAX,
            15 => u64::MAX - 1,
            16 => u64::MAX / 2,
            17 => cur.wrapping_add(1),
            18 => cur.wrapping_sub(1),
            _ => self.u32() as u64,
        }
    }
    fn usize(&mut self, cur: usize) -> usize {
        self.value(cur as u64) as usize
    }
    fn f32(&mut self, cur: f32) -> f32 {
        match self.u8() % 8 {
            0 => 0.0,
            1 => -1.0,
            2 => f32::NAN,
            3 => f32::INFINITY,
            4 => 1e-30,
            5 => 1e30,
            6 => cur * 2.0,
            _ => f32::from_bits(self.u32()),
        }
    }
}

fn finish_reason(x: u8) -> FinishReason {
    match x % 4 {
        0 => FinishReason::Eos,
        1 => FinishReason::Length,
        2 => FinishReason::Interrupted,
        _ => FinishReason::Context,
    }
}

/// Applies the operations in `ops` to a copy of `seed`'s manifest and events.
pub fn mutate(seed: &Bundle, ops: &[u8]) -> (Manifest, Vec<Event>) {
    let mut m = seed.manifest.clone();
    let mut ev = seed.events.clone();
    let mut o = Ops { b: ops };
    // At most 64 operations; each event edit stays O(1).
    for _ in 0..64 {
        if o.b.is_empty() {
            break;
        }
        match o.u8() % 16 {
            0 => {
                if let Some(i) = o.index(ev.len()) {
                    ev.remove(i);
                }
            }
            1 => {
                if let (Some(i), Some(j)) = (o.index(ev.len()), o.index(ev.len() + 1)) {
                    let e = ev[i].clone();
                    ev.insert(j, e);
                }
            }
            2 => {
                if let (Some(i), Some(j)) = (o.index(ev.len()), o.index(ev.len())) {
                    ev.swap(i, j);
                }
            }
            3 => m.engine.page_size = o.usize(m.engine.page_size),
            4 => m.engine.pool_pages = o.usize(m.engine.pool_pages),
            5 => m.engine.max_batch_tokens = o.usize(m.engine.max_batch_tokens),
            6 => m.engine.prefix_cache = !m.engine.prefix_cache,
            7 => m.top_logprobs = o.value(m.top_logprobs as u64) as u32,
            8 => {
                let names = [
                    "splitk-decode",
                    "fast-exp",
                    "abort-inserts-partial",
                    "abort-frees-shared",
                    "no-such-patch",
                ];
                let n = o.u8() as usize % 3;
                m.patches = (0..n)
                    .map(|_| names[o.u8() as usize % names.len()].to_string())
                    .collect();
            }
            op => {
                let Some(i) = o.index(ev.len()) else { continue };
                edit_event(&mut ev[i], op, &mut o);
            }
        }
    }
    (m, ev)
}

fn edit_event(e: &mut Event, op: u8, o: &mut Ops<'_>) {
    match e {
        Event::Arrival {
            step,
            name,
            request,
        } => match o.u8() % 10 {
            0 => *step = o.value(*step),
            1 => request.id = o.value(request.id),
            2 => {
                if let Some(k) = o.index(request.prompt.len()) {
                    request.prompt[k] = o.value(request.prompt[k] as u64) as u32;
                }
            }
            3 => {
                let k = o.u8() as usize;
                request.prompt.truncate(k % (request.prompt.len() + 1));
            }
            4 => request.max_tokens = o.usize(request.max_tokens),
            5 => request.sampling.temperature = o.f32(request.sampling.temperature),
            6 => request.sampling.top_k = o.usize(request.sampling.top_k),
            7 => request.sampling.top_p = o.f32(request.sampling.top_p),
            8 => request.stop_at_eos = !request.stop_at_eos,
            _ => name.push('\u{F8F0}'),
        },
        Event::Interrupt { step, id, .. } => match o.u8() % 2 {
            0 => *step = o.value(*step),
            _ => *id = o.value(*id),
        },
        Event::Step(r) => edit_report(r, op, o),
        Event::PdStep(p) => {
            if op & 4 == 0 {
                edit_report(&mut p.prefill, op, o)
            } else {
                edit_report(&mut p.decode, op, o)
            }
        }
        Event::Disaggregated(c) => match o.u8() % 4 {
            0 => c.decode.page_size = o.usize(c.decode.page_size),
            1 => c.decode.pool_pages = o.usize(c.decode.pool_pages),
            2 => c.decode.max_batch_tokens = o.usize(c.decode.max_batch_tokens),
            _ => c.transfer_pages_per_step = o.usize(c.transfer_pages_per_step),
        },
    }
}

/// One engine step report, edited.
fn edit_report(r: &mut lmrr_engine::StepReport, op: u8, o: &mut Ops<'_>) {
    match op % 4 {
        0 => r.step = o.value(r.step),
        1 => {
            let Some(k) = o.index(r.decisions.len()) else {
                r.decisions.push(Decision::Preempt { id: o.value(0) });
                return;
            };
            let d = &mut r.decisions[k];
            match (o.u8() % 6, d) {
                (0, d) => {
                    *d = match o.u8() % 4 {
                        0 => Decision::Interrupt { id: o.value(0) },
                        1 => Decision::Preempt { id: o.value(0) },
                        2 => Decision::Admit {
                            id: o.value(0),
                            cached_tokens: o.usize(0),
                        },
                        _ => Decision::Schedule {
                            id: o.value(0),
                            start: o.usize(0),
                            len: o.usize(1),
                        },
                    }
                }
                (
                    1,
                    Decision::Interrupt { id }
                    | Decision::Preempt { id }
                    | Decision::Admit { id, .. }
                    | Decision::Schedule { id, .. },
                ) => *id = o.value(*id),
                (2, Decision::Admit { cached_tokens, .. }) => {
                    *cached_tokens = o.usize(*cached_tokens)
                }
                (3, Decision::Schedule { start, .. }) => *start = o.usize(*start),
                (4, Decision::Schedule { len, .. }) => *len = o.usize(*len),
                (_, _) => {
                    let d = r.decisions.remove(k);
                    let j = o.u8() as usize % (r.decisions.len() + 1);
                    r.decisions.insert(j, d);
                }
            }
        }
        2 => {
            let Some(k) = o.index(r.seqs.len()) else {
                return;
            };
            let s = &mut r.seqs[k];
            match o.u8() % 7 {
                0 => s.id = o.value(s.id),
                1 => s.start = o.usize(s.start),
                2 => s.len = o.usize(s.len),
                3 => s.sampled = Some(o.value(s.sampled.unwrap_or(0) as u64) as u32),
                4 => s.sampled = None,
                5 => {
                    if let Some(t) = s.top_logprobs.first_mut() {
                        t.0 = o.value(t.0 as u64) as u32;
                        t.1 = o.f32(t.1);
                    } else {
                        s.top_logprobs.push((o.u32(), o.f32(0.0)));
                    }
                }
                _ => s.finish = Some(finish_reason(o.u8())),
            }
        }
        _ => match o.u8() % 3 {
            0 => r.finished.push((o.value(0), finish_reason(o.u8()))),
            1 => r.cache_state[o.u8() as usize % 32] ^= 1,
            _ => {
                if let Some(k) = o.index(r.seqs.len()) {
                    let s = r.seqs[k].clone();
                    r.seqs.push(s);
                }
            }
        },
    }
}

/// Frames `manifest` and `events` as a bundle with valid checksums.
pub fn reframe(manifest: &Manifest, events: Vec<Event>) -> Vec<u8> {
    let mut w = BundleWriter::new(Vec::new(), manifest, 4).expect("framing a manifest");
    for e in events {
        w.push(e).expect("framing an event");
    }
    w.finish().expect("finishing a bundle")
}

/// Everything a hostile bundle can reach: read, summarise, replay under its
/// own patches and under another set, and the oracle. Errors are fine;
/// panics, hangs and unbounded allocation are not.
pub fn exercise(model: &Model, bytes: &[u8], other: PatchSet) {
    let Ok(b) = lmrr_recorder::read(bytes) else {
        return;
    };
    let _ = lmrr_recorder::Summary::of(&b);
    let _ = b.manifest.model.identity.to_string();
    let own = PatchSet::parse(&b.manifest.patches.join(",")).unwrap_or_default();
    for set in [own, other] {
        let mut opts = lmrr_replays::ReplayOptions::new(set, Threads::single());
        opts.drift_steps = 2;
        if let Ok(o) = lmrr_replays::replay(&b, model, &opts) {
            let _ = o.to_string();
        }
    }
    let opts = lmrr_replays::ReplayOptions::new(PatchSet::none(), Threads::single());
    if let Ok(o) = lmrr_replays::oracle(&b, model, &opts) {
        let _ = o.to_string();
    }
}
