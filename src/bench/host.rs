//! The host-side costs `lmrr bench` measures beside the model's speed:
//! slot hashing, KV store reuse and writes, the serving loop's hash share,
//! and the recorder's overhead.

use std::time::Instant;

use anyhow::Result;

use lmrr_engine::{KvCache, SeqKvStore};
use lmrr_kernels::Threads;

use super::median;

/// Seconds (median of `repeats`) to digest the slots a batch-64 decode step
/// writes: 64 sequences of one page, position 0 of each written in every
/// layer, then `finish_step` on one thread and `finish_step_on` the engine's.
pub fn slot_hashing(
    model: &lmrr_engine::Model,
    th: &Threads,
    repeats: usize,
) -> Result<(f64, f64)> {
    use lmrr_engine::pool::{BlockTable, PagePool, PagedKv};
    use lmrr_engine::KvCache;
    let layout = model.net.kv_layout();
    let mut kv = PagedKv::new(PagePool::new(1, 64, layout)?);
    for s in 0..64u64 {
        let p = kv
            .pool
            .alloc()?
            .ok_or_else(|| anyhow::anyhow!("a 64-page pool ran out of pages"))?;
        kv.tables.insert(
            s,
            BlockTable {
                pages: vec![p],
                len: 1,
            },
        );
    }
    let k = vec![0.25f32; layout.kv_dim];
    let v = vec![-0.5f32; layout.kv_dim];
    let aux = vec![1.0f32; layout.aux_dim];
    let write = |kv: &mut PagedKv| {
        for s in 0..64u64 {
            for l in 0..layout.layers {
                kv.write(s, l, 0, &k, &v);
                if layout.aux_dim > 0 {
                    kv.write_aux(s, l, 0, &aux);
                }
            }
        }
    };
    let once = |kv: &mut PagedKv, threads: Option<&Threads>| {
        write(kv);
        let t = std::time::Instant::now();
        match threads {
            Some(th) => kv.finish_step_on(th),
            None => kv.finish_step(),
        }
        t.elapsed().as_secs_f64()
    };
    let (mut one, mut all) = (Vec::new(), Vec::new());
    for _ in 0..repeats.max(3) {
        one.push(once(&mut kv, None));
        all.push(once(&mut kv, Some(th)));
    }
    Ok((median(one), median(all)))
}

/// Seconds (medians of `repeats`, alternating) to write the K/V rows of a
/// step of `seqs` sequences of `n` tokens each (stacked sequence after
/// sequence, positions `0..n` of each) into a [`PagedKv`] with the engine's
/// page size: per row (`write`, token-outer, layer-inner), in runs
/// (`write_run`, layer-outer, one per (layer, sequence)) and as one
/// `write_step` on `th`. Each timed write starts from an empty written-slot
/// set, as a step does (`finish_step`, untimed, in between).
///
/// [`PagedKv`]: lmrr_engine::pool::PagedKv
/// `prepare` + `write_step` of one `n`-token sequence: the first time in
/// this process (one sample: memory the allocator has not handed out
/// before), then medians in a fresh [`SeqKvStore`] (its drop untimed; the
/// allocator may hand back the memory of the one before) and in one store
/// whose previous sequence was removed (its buffers kept).
pub fn kv_store_reuse(
    model: &lmrr_engine::Model,
    n: usize,
    th: &Threads,
    repeats: usize,
) -> Result<[f64; 3]> {
    use lmrr_engine::KvRun;
    let layout = model.net.kv_layout();
    let (layers, d) = (layout.layers, layout.kv_dim);
    let hk: Vec<f32> = (0..layers * n * d)
        .map(|i| (i % 251) as f32 * 0.5)
        .collect();
    let hv: Vec<f32> = hk.iter().map(|x| -x).collect();
    let runs = [KvRun {
        seq: 0,
        pos0: 0,
        row0: 0,
        n,
    }];
    let fill = |kv: &mut SeqKvStore| -> Result<()> {
        kv.prepare(0, 0, n)?;
        kv.write_step(&runs, layers, &hk, &hv, th);
        Ok(())
    };
    let mut kept = SeqKvStore::new(layout);
    let t0 = Instant::now();
    fill(&mut kept)?;
    let first = t0.elapsed().as_secs_f64();
    let (mut fresh, mut reused) = (Vec::new(), Vec::new());
    // Alternating, so both see the same machine.
    for _ in 0..repeats.max(5) {
        let mut kv = SeqKvStore::new(layout);
        let t0 = Instant::now();
        fill(&mut kv)?;
        fresh.push(t0.elapsed().as_secs_f64());
        drop(kv);
        kept.remove(0);
        let t0 = Instant::now();
        fill(&mut kept)?;
        reused.push(t0.elapsed().as_secs_f64());
    }
    Ok([first, median(fresh), median(reused)])
}

pub fn kv_writes(
    model: &lmrr_engine::Model,
    seqs: usize,
    n: usize,
    th: &Threads,
    repeats: usize,
) -> Result<[f64; 3]> {
    use lmrr_engine::pool::{BlockTable, PagePool, PagedKv};
    use lmrr_engine::{EngineConfig, KvCache, KvRun};
    let layout = model.net.kv_layout();
    let (layers, d) = (layout.layers, layout.kv_dim);
    let ps = EngineConfig::default().page_size;
    let per_seq = n.div_ceil(ps);
    let mut kv = PagedKv::new(PagePool::new(ps, (seqs * per_seq).max(1), layout)?);
    for s in 0..seqs as u64 {
        let mut pages = Vec::new();
        for _ in 0..per_seq {
            pages.push(kv.pool.alloc()?.ok_or_else(|| {
                anyhow::anyhow!("a {}-page pool ran out of pages", seqs * per_seq)
            })?);
        }
        kv.tables.insert(s, BlockTable { pages, len: 0 });
        kv.prepare(s, 0, n)?;
    }
    // `(layers, seqs · n, kv_dim)`, as the device step hands them back.
    let rows_n = seqs * n;
    let hk: Vec<f32> = (0..layers * rows_n * d)
        .map(|i| (i % 251) as f32 * 0.5)
        .collect();
    let hv: Vec<f32> = hk.iter().map(|x| -x).collect();
    let runs: Vec<KvRun> = (0..seqs)
        .map(|s| KvRun {
            seq: s as u64,
            pos0: 0,
            row0: s * n,
            n,
        })
        .collect();
    let mut t = [Vec::new(), Vec::new(), Vec::new()];
    for _ in 0..repeats.max(3) {
        let t0 = Instant::now();
        for r in &runs {
            for i in 0..n {
                for l in 0..layers {
                    let at = (l * rows_n + r.row0 + i) * d..(l * rows_n + r.row0 + i + 1) * d;
                    kv.write(r.seq, l, i, &hk[at.clone()], &hv[at]);
                }
            }
        }
        t[0].push(t0.elapsed().as_secs_f64());
        kv.finish_step();
        let t0 = Instant::now();
        for l in 0..layers {
            for r in &runs {
                let at = (l * rows_n + r.row0) * d..(l * rows_n + r.row0 + n) * d;
                kv.write_run(r.seq, l, 0, &hk[at.clone()], &hv[at]);
            }
        }
        t[1].push(t0.elapsed().as_secs_f64());
        kv.finish_step();
        let t0 = Instant::now();
        kv.write_step(&runs, layers, &hk, &hv, th);
        t[2].push(t0.elapsed().as_secs_f64());
        kv.finish_step();
    }
    Ok(t.map(median))
}

/// A serving session on the benchmark model: `n` requests sharing a prefix,
/// run through the scheduler; reports the share of step time spent hashing
/// (slot digests, page hashes, radix/cache-state hashes, logits-row digests).
pub fn serving_hash_share(
    model: &lmrr_engine::Model,
    th: &Threads,
    prompt_len: usize,
    decode: usize,
) -> Result<(f64, f64, u64)> {
    use lmrr_engine::{EngineConfig, Request, SamplingParams, Scheduler};
    let vocab = model.net.vocab_size() as u64;
    let mut sch = Scheduler::new(model.net(), EngineConfig::default(), th.clone())?;
    for i in 0..4u64 {
        let prompt: Vec<u32> = (0..prompt_len as u64)
            .map(|j| {
                let salt = if j < prompt_len as u64 / 2 { 0 } else { i + 1 };
                ((j * 7919 + salt * 104_729) % (vocab - 3)) as u32 + 3
            })
            .collect();
        sch.submit(Request {
            id: i,
            prompt,
            sampling: SamplingParams::default(),
            max_tokens: decode,
            stop_at_eos: false,
        })?;
    }
    while !sch.is_idle() {
        sch.step()?;
    }
    let t = sch.timings();
    Ok((t.hashing.as_secs_f64(), t.total.as_secs_f64(), sch.steps()))
}

/// Figures of recording a session on the benchmark model.
pub struct RecordFigures {
    pub plain_s: f64,
    pub recorded_s: f64,
    pub observe_s: f64,
    pub identity_s: f64,
    pub bytes: u64,
    pub tokens: usize,
    pub token_data_per_token: f64,
    pub read_s: f64,
    pub events: usize,
}

/// Runs one session with and without `--record` (alternating, `repeats` times
/// each, medians), then reads the bundle back.
pub fn recording_overhead(
    model: &lmrr_engine::Model,
    th: &Threads,
    repeats: usize,
) -> Result<RecordFigures> {
    use lmrr_engine::{run_session, EngineConfig, Scheduler, Script};
    use lmrr_recorder::{Recorder, Summary};
    let mut src = String::new();
    for i in 0..4 {
        src += &format!(
            "[[request]]\nid = \"u{i}\"\nmessages = [{{ role = \"user\", content = \"You are reviewing a pull request that rewrites the decode attention kernel. Question {i}: what could go wrong?\" }}]\nmax_tokens = 32\nignore_eos = true\n"
        );
    }
    let script = Script::parse(&src, "bench.toml")?;
    let cfg = EngineConfig::default();
    let path = std::env::temp_dir().join(format!("lmrr-bench-{}.lmrr", std::process::id()));
    let (mut plain, mut recorded, mut observe) = (Vec::new(), Vec::new(), Vec::new());
    // The model's content identity (one pass over its weights) is computed once per process
    // and cached: time that first computation on its own.
    let ti = Instant::now();
    model.identity();
    let identity_s = ti.elapsed().as_secs_f64();
    for _ in 0..repeats.max(1) {
        let mut sch = Scheduler::new(model.net(), cfg, th.clone())?;
        let t = Instant::now();
        run_session(model, &script, &mut sch, |_| {})?;
        plain.push(t.elapsed().as_secs_f64());

        let mut sch = Scheduler::new(model.net(), cfg, th.clone())?;
        let t = Instant::now();
        let manifest = crate::session_manifest(
            model,
            cfg,
            &lmrr_engine::PatchSet::none(),
            "bench.toml",
            &src,
            th.count(),
        );
        sch.set_top_logprobs(5);
        let mut rec = Recorder::new(
            std::io::BufWriter::new(std::fs::File::create(&path)?),
            &manifest,
        )?;
        let mut obs = 0.0;
        run_session(model, &script, &mut sch, |e| {
            let t = Instant::now();
            rec.observe(e);
            obs += t.elapsed().as_secs_f64();
        })?;
        rec.finish()?;
        recorded.push(t.elapsed().as_secs_f64());
        observe.push(obs);
    }
    let t = Instant::now();
    let b = lmrr_recorder::open(&path)?;
    let read_s = t.elapsed().as_secs_f64();
    let s = Summary::of(&b);
    let _ = std::fs::remove_file(&path);
    Ok(RecordFigures {
        plain_s: median(plain),
        recorded_s: median(recorded),
        observe_s: median(observe),
        identity_s,
        bytes: b.size,
        tokens: s.prompt_tokens + s.generated_tokens,
        token_data_per_token: s.token_data_bytes_per_token,
        read_s,
        events: b.events.len(),
    })
}
