//! `lmrr bench`: prefill and decode throughput at batch 1 and 8, matmul
//! GFLOP/s, and the machine's memory bandwidth measured in the same run, so
//! decode time can be compared with its physical floor (streaming the weights
//! once). Medians over repeats; the machine is shared and noisy.

use std::time::Instant;

use anyhow::Result;

use lmrr_engine::{KvCache, LogitsWanted, SeqKvStore, SeqSpan};
use lmrr_kernels::{matmul, Matrix, QuantKind, Threads, Weights};

mod device;
mod host;
mod proxy;

use device::{device_limits, device_tuning};
pub use host::*;
use proxy::run_proxy;

#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// Model: an HF directory or `synthetic:PRESET[:SEED]`.
    #[arg(long, default_value = "synthetic:small")]
    model: String,
    /// Worker threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Prompt length for the prefill measurements.
    #[arg(long, default_value_t = 128)]
    prompt_len: usize,
    /// Decode steps measured per batch size.
    #[arg(long, default_value_t = 16)]
    decode_steps: usize,
    /// Repeats of each measurement (the median is reported).
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Size of the buffer read for the bandwidth measurement, MiB.
    #[arg(long, default_value_t = 1024)]
    bandwidth_mib: usize,
    /// Only bandwidth and batch-1 prefill/decode (for side-by-side runs
    /// against a peer engine).
    #[arg(long)]
    speed_only: bool,
    /// Where the kernels run: `cpu`, or `cuda` (the resident path: then the
    /// device's copy bandwidth and FP32 FMA rate are measured instead of the
    /// host's, and each figure is given against them).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// The matmuls' arithmetic: `canonical` or `tensor-core-sm90` (see
    /// `lmrr run --help`).
    #[arg(long, default_value = "canonical")]
    numerics: String,
    /// Tensor-parallel ranks: on the CPU, N ranks of the rank simulator
    /// (each holding its slice of the weights); on CUDA a degree above 1 is
    /// refused (multi-GPU needs NCCL, not built yet). Never changes a bit.
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// Batch sizes for prefill and decode (default 1,8; with `--speed-only`, 1).
    #[arg(long, value_delimiter = ',')]
    batches: Option<Vec<usize>>,
    /// Instead: the latency `lmrr proxy` adds per streamed chunk, against a
    /// local SSE upstream (direct and proxied streams alternate; `--repeats`
    /// rounds of 200 chunks, one every 2 ms).
    #[arg(long)]
    proxy: bool,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn time<F: FnMut()>(repeats: usize, mut f: F) -> f64 {
    median(
        (0..repeats.max(1))
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64()
            })
            .collect(),
    )
}

/// Read bandwidth in bytes/s: every thread sums its share of a buffer larger
/// than the last-level cache.
fn bandwidth(th: &Threads, mib: usize, repeats: usize) -> f64 {
    let n = mib * (1 << 20) / 4;
    let buf: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
    let grain = n.div_ceil(th.count());
    let sink = std::sync::atomic::AtomicU32::new(0);
    let secs = time(repeats + 2, || {
        th.for_ranges(n, grain, |r| {
            let s = lmrr_kernels::sum(&buf[r]);
            sink.fetch_xor(s.to_bits(), std::sync::atomic::Ordering::Relaxed);
        })
    });
    (n * 4) as f64 / secs
}

pub fn run(a: &BenchArgs) -> Result<()> {
    if a.proxy {
        return run_proxy(a.repeats.max(3));
    }
    let th = crate::threads(a.threads)?;
    let default_batches: &[usize] = if a.speed_only { &[1] } else { &[1, 8] };
    let batches = a
        .batches
        .clone()
        .unwrap_or_else(|| default_batches.to_vec());
    if let Some(&b) = batches.iter().find(|&&b| b == 0 || b > 4096) {
        anyhow::bail!("--batches {b}: each batch size must be 1..=4096");
    }
    let t_load = Instant::now();
    let mut model = crate::load_model(Some(&a.model))?;
    let load_s = t_load.elapsed().as_secs_f64();
    let t_dev = Instant::now();
    crate::set_device(&mut model, &a.device)?;
    crate::set_numerics(&mut model, &a.numerics)?;
    crate::set_tp(&mut model, a.tp)?;
    let dev_s = t_dev.elapsed().as_secs_f64();
    let on_gpu = a.device != "cpu";
    let m = model.net();
    let r = a.repeats;
    let (layers, vocab) = (m.kv_layout().layers, m.vocab_size());
    println!(
        "# lmrr bench — model {} ({:.1}M params, {} layers, hidden {}, vocab {}), {} threads, ISA {:?}{}",
        model.origin,
        m.param_count() as f64 / 1e6,
        layers,
        m.hidden_size(),
        vocab,
        th.count(),
        lmrr_kernels::isa(),
        if lmrr_kernels::quant_avx512() {
            " (quantized matmuls: AVX-512)"
        } else {
            ""
        }
    );
    println!("model built/loaded in {load_s:.2}s");
    if on_gpu {
        println!(
            "moved to {:?} in {dev_s:.2}s (weights uploaded once)",
            m.device()
        );
    }

    // The physical limits: the host's read bandwidth, or on the device its
    // copy bandwidth and its FP32 FMA rate, measured in this run.
    let (bw, peak) = if on_gpu {
        device_limits(m, a.bandwidth_mib, r)?
    } else {
        (bandwidth(&th, a.bandwidth_mib, r), None)
    };
    let wbytes = m.weight_bytes_per_step() as f64;
    let floor = wbytes / bw;
    // FLOPs per prefill token in the matmuls of the layers (the output head
    // runs for one row per sequence only).
    let head_params = model.llama().map_or(0, |l| {
        let c = l.config();
        c.vocab_size * c.hidden_size * (1 + usize::from(!c.tie_word_embeddings))
    });
    let flops_per_token = 2.0 * m.param_count().saturating_sub(head_params) as f64;

    // Matmul GFLOP/s on an MLP-shaped matrix, 64 tokens, f32 and bf16.
    // (A mini-v4 model has no dense MLP: its shared expert's shape stands in.)
    let ffn = match (model.llama(), model.mini_v4()) {
        (Some(l), _) => l.config().intermediate_size,
        (None, Some(v)) => v.config().moe_intermediate_size,
        (None, None) => 4 * m.hidden_size(),
    };
    let (rows, cols, n) = (ffn, m.hidden_size(), 64);
    let (gflops, matvec) = if a.speed_only || on_gpu {
        (Vec::new(), Vec::new())
    } else {
        kernel_rates(&th, rows, cols, n, r)
    };

    let measured = measure_batches(a, &model, &th, &batches, on_gpu)?;

    let extras = if a.speed_only {
        None
    } else {
        Some((
            serving_hash_share(&model, &th, a.prompt_len, a.decode_steps)?,
            recording_overhead(&model, &th, r)?,
        ))
    };

    println!();
    println!("| measurement | value |");
    println!("|---|---|");
    if on_gpu {
        println!(
            "| device copy bandwidth ({} MiB, device to device, read + write) | {:.0} GB/s |",
            a.bandwidth_mib,
            bw / 1e9
        );
        if let Some(p) = peak {
            println!(
                "| device FP32 FMA rate (CUDA cores, measured) | {:.1} TFLOP/s |",
                p / 1e12
            );
        }
        if let Some((pages, up)) = model.llama().and_then(|l| l.device_stats()) {
            println!(
                "| resident on the device | every weight (uploaded once); {pages} KV pages held, {up} uploaded since load |"
            );
        }
        if let Some(t) = device_tuning(m) {
            println!("| kernel choice (same bits whichever) | {t} |");
        }
    } else {
        println!(
            "| memory read bandwidth ({} MiB buffer) | {:.2} GB/s |",
            a.bandwidth_mib,
            bw / 1e9
        );
    }
    println!(
        "| weights streamed per decode step | {:.1} MB |",
        wbytes / 1e6
    );
    println!(
        "| floor: time to stream them once | {:.2} ms |",
        floor * 1e3
    );
    for (label, g) in &gflops {
        println!("| matmul {label} ({n}×{cols} · {cols}×{rows}) | {g:.1} GFLOP/s |");
    }
    for (label, wns, gbs) in &matvec {
        println!(
            "| matvec {label} (1×{cols} · {cols}×{rows}, weights in cache) | {wns:.2} weights/ns ({gbs:.1} GB/s of storage) |"
        );
    }
    report_batches(&measured, a, peak, flops_per_token, floor);
    host_costs(&model, &th, r)?;
    let Some(((hash_s, total_s, steps), rf)) = extras else {
        return Ok(());
    };
    println!(
        "| serving: 4 requests × {} prompt (half shared) + {} decode, {steps} steps | hashing {:.1} ms of {:.0} ms = {:.2}% of step time |",
        a.prompt_len,
        a.decode_steps,
        hash_s * 1e3,
        total_s * 1e3,
        100.0 * hash_s / total_s
    );
    println!(
        "| session of 4 chat requests × 32 tokens: plain / recorded (medians, alternating) | {:.0} ms / {:.0} ms = {:+.2}% |",
        rf.plain_s * 1e3,
        rf.recorded_s * 1e3,
        100.0 * (rf.recorded_s / rf.plain_s - 1.0),
    );
    println!(
        "| one-time model identity (SHA-256 of {:.0} M weights as f32, {} cores; cached per process) | {:.0} ms |",
        model.net.named_tensors().iter().map(|t| t.1.iter().product::<usize>()).sum::<usize>() as f64 / 1e6,
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        rf.identity_s * 1e3
    );
    println!(
        "| bundle | {} bytes for {} tokens = {:.1} bytes/token; token data {:.2} bytes/token |",
        rf.bytes,
        rf.tokens,
        rf.bytes as f64 / rf.tokens as f64,
        rf.token_data_per_token
    );
    println!(
        "| bundle write (observer time) / read | {:.2} MB/s ({:.1} ms) / {:.1} MB/s ({} events in {:.2} ms) |",
        rf.bytes as f64 / rf.observe_s / 1e6,
        rf.observe_s * 1e3,
        rf.bytes as f64 / rf.read_s / 1e6,
        rf.events,
        rf.read_s * 1e3
    );
    Ok(())
}

/// Matmul GFLOP/s (`n` tokens, f32 and bf16) and decode-shaped matvec rates
/// per storage (weights in cache: the kernel's compute rate without the
/// memory system) on a `rows × cols` matrix: `(label, GFLOP/s)` and
/// `(label, Gweights/s, GB/s)`.
#[allow(clippy::type_complexity)]
fn kernel_rates(
    th: &Threads,
    rows: usize,
    cols: usize,
    n: usize,
    r: usize,
) -> (Vec<(&'static str, f64)>, Vec<(&'static str, f64, f64)>) {
    let x: Vec<f32> = (0..n * cols)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
        .collect();
    let wf: Vec<f32> = (0..rows * cols)
        .map(|i| ((i * 53 % 97) as f32 - 48.0) / 480.0)
        .collect();
    let wb: Vec<u16> = wf.iter().map(|&v| (v.to_bits() >> 16) as u16).collect();
    let mut y = vec![0.0; n * rows];
    let flops = 2.0 * (n * rows * cols) as f64;
    let mut gflops = Vec::new();
    let kernel_rows = vec![("f32", Weights::F32(&wf)), ("bf16", Weights::Bf16(&wb))];
    for (label, w) in kernel_rows {
        let mm = Matrix::new(w, rows, cols).expect("shape");
        let s = time(r + 4, || matmul(th, &x, n, &mm, &mut y));
        gflops.push((label, flops / s / 1e9));
    }
    // Decode-shaped matvec (one token) per storage, weights in cache: the
    // kernel's compute rate without the memory system.
    let blocks = |kind: QuantKind| -> Vec<u8> {
        let bb = kind.block_bytes();
        let mut q: Vec<u8> = (0..rows * kind.row_bytes(cols))
            .map(|i| (i * 7919 % 251) as u8)
            .collect();
        for b in q.chunks_exact_mut(bb) {
            b[..2].copy_from_slice(&0x2000u16.to_le_bytes()); // d = 2^-7
            if kind == QuantKind::Q4_1 || kind == QuantKind::Q4K {
                b[2..4].copy_from_slice(&0xa000u16.to_le_bytes()); // m = -2^-7
            }
            if kind == QuantKind::Q6K {
                b[208..].copy_from_slice(&0x2000u16.to_le_bytes()); // d last
            }
        }
        q
    };
    let (q41, q80) = (blocks(QuantKind::Q4_1), blocks(QuantKind::Q8_0));
    // K-quant rows are 256-weight super-blocks: the first `kcols` columns.
    let kcols = cols - cols % lmrr_kernels::QK_K;
    let kblocks = |kind: QuantKind| blocks(kind)[..rows * kind.row_bytes(kcols)].to_vec();
    let (q4k, q6k) = (kblocks(QuantKind::Q4K), kblocks(QuantKind::Q6K));
    let mut matvec = Vec::new();
    let mut y1 = vec![0.0; rows];
    let storages = [
        ("f32", Weights::F32(&wf)),
        ("bf16", Weights::Bf16(&wb)),
        ("Q4_1", Weights::Quant(QuantKind::Q4_1, &q41)),
        ("Q8_0", Weights::Quant(QuantKind::Q8_0, &q80)),
        ("Q4_K", Weights::Quant(QuantKind::Q4K, &q4k)),
        ("Q6_K", Weights::Quant(QuantKind::Q6K, &q6k)),
    ];
    for (label, w) in storages
        .into_iter()
        .filter(|(l, _)| kcols > 0 || !l.ends_with("_K"))
    {
        let c = if label.ends_with("_K") { kcols } else { cols };
        let mm = Matrix::new(w, rows, c).expect("shape");
        let reps = 20;
        let s = time(r + 4, || {
            for _ in 0..reps {
                matmul(th, &x[..c], 1, &mm, &mut y1)
            }
        }) / reps as f64;
        matvec.push((
            label,
            (rows * c) as f64 / s / 1e9,
            mm.storage_bytes() as f64 / s / 1e9,
        ));
    }
    (gflops, matvec)
}

/// The host-side costs beside the model's speed, one report row each:
/// handing out a batch-64 step's logits rows, digesting its written slots,
/// writing K/V rows into the paged pool, and a store's prepare and writes.
fn host_costs(model: &lmrr_engine::Model, th: &Threads, r: usize) -> Result<()> {
    let vocab = model.net.vocab_size();
    {
        // What a batch-64 step costs the host to hand out its logits rows:
        // 64 fresh vectors of `vocab` floats, copied and dropped, as
        // ModelFamily::forward returns them (main.rs keeps freed memory in
        // glibc's heap; without that each row is mapped and faulted in).
        let rows = 64;
        let src = vec![0.5f32; rows * vocab];
        let t = time(r + 4, || {
            let out: Vec<Vec<f32>> = src.chunks(vocab).map(|c| c.to_vec()).collect();
            std::hint::black_box(out);
        });
        println!(
            "| logits rows handed out per batch-64 step (64 × {vocab} floats as fresh vectors) | {:.2} ms ({:.1} GB/s) |",
            t * 1e3,
            (rows * vocab * 4) as f64 / t / 1e9,
        );
    }
    {
        // What a batch-64 decode step costs the host to digest its written
        // slots (every layer's K and V rows of 64 positions, SHA-256 each),
        // on one thread and across the engine's threads (the same digests).
        let (one, all) = slot_hashing(model, th, r)?;
        let l = model.net.kv_layout();
        println!(
            "| slot digests of a batch-64 decode step (64 slots × {} layers × {} floats) | one thread {:.2} ms, {} threads {:.2} ms |",
            l.layers,
            2 * l.kv_dim + l.aux_dim,
            one * 1e3,
            th.count(),
            all * 1e3
        );
    }
    {
        // What a step costs the host to put its K/V rows (brought back
        // from the device on the CUDA path) into the paged pool: one
        // `write` per (token, layer), token-outer as the GPU step once did;
        // one `write_run` per (layer, sequence), layer-outer; one
        // `write_step`, its layers spread over the engine's threads (the
        // same rows and digests). A 512-token prefill and a batch-64 decode.
        let l = model.net.kv_layout();
        let ps = lmrr_engine::EngineConfig::default().page_size;
        if l.kv_dim == 0 {
            // The MLA families keep no K/V rows: their stored rows are
            // auxiliary ones, which only the host executor writes.
            println!(
                "| host K/V writes | none: this model keeps no K/V rows (its {} floats a position and layer are an auxiliary row) |",
                l.aux_dim
            );
        }
        for (what, seqs, n) in (l.kv_dim > 0)
            .then_some([
                ("a 512-token step", 1, 512),
                ("a batch-64 decode step (64 sequences × 1 row)", 64, 1),
            ])
            .into_iter()
            .flatten()
        {
            let [rows, runs, step] = kv_writes(model, seqs, n, th, r)?;
            println!(
                "| host K/V writes of {what} ({} layers × 2 × {} floats, pages of {ps}) | per row {:.3} ms, runs {:.3} ms, step on {} threads {:.3} ms |",
                l.layers,
                l.kv_dim,
                rows * 1e3,
                runs * 1e3,
                th.count(),
                step * 1e3
            );
        }
    }
    {
        // What a single-sequence store costs a 512-token prefill before
        // and after its rows are computed: prepare (growing the buffers)
        // and write_step, in a fresh store against one whose removed
        // sequence left its buffers (as `lmrr bench`'s prefill repeats run).
        let [first, fresh, reused] = kv_store_reuse(model, 512, th, r)?;
        println!(
            "| SeqKvStore, a 512-token prefill's prepare + write_step ({} layers) | first store of its size in this process {:.2} ms; then a fresh store {:.2} ms, a removed sequence's buffers reused {:.2} ms |",
            model.net.kv_layout().layers,
            first * 1e3,
            fresh * 1e3,
            reused * 1e3
        );
    }
    Ok(())
}

/// A family's step time by part (`ModelFamily::profile`).
type Parts = Vec<(&'static str, f64)>;

/// Per batch size: prefill and decode tok/s, the first prefill into a fresh
/// store, the family's breakdown of step time, and on the device the
/// decode step's kernels timed by events (and batch 1 with graphs off).
#[derive(Default)]
struct Batches {
    /// (batch, prefill tok/s, decode tok/s, decode seconds a step).
    rows_out: Vec<(usize, f64, f64, f64)>,
    /// (batch, the first prefill's tok/s, into a fresh store).
    fresh_out: Vec<(usize, f64)>,
    /// (batch, prefill parts, decode parts).
    parts_out: Vec<(usize, Parts, Parts)>,
    /// Batch-1 decode seconds a step with CUDA graphs off.
    graphs_off: Option<f64>,
    /// (batch, device seconds of a decode step's kernels, its wall
    /// seconds, its parts).
    device_split: Vec<(usize, f64, f64, [f64; 5])>,
}

fn measure_batches(
    a: &BenchArgs,
    model: &lmrr_engine::Model,
    th: &Threads,
    batches: &[usize],
    on_gpu: bool,
) -> Result<Batches> {
    let (m, r) = (model.net(), a.repeats);
    let vocab = m.vocab_size();
    let new_kv = || SeqKvStore::new(m.kv_layout());
    let prompt = |s: u64| -> Vec<u32> {
        (0..a.prompt_len as u64)
            .map(|i| ((i * 7919 + s * 104_729) % (vocab as u64 - 3)) as u32 + 3)
            .collect()
    };
    let most = batches.iter().copied().max().unwrap_or(1) as u64;
    let prompts: Vec<Vec<u32>> = (0..most).map(prompt).collect();
    let mut rows_out = Vec::new();
    // Per batch, the first prefill's tok/s (into a fresh store).
    let mut fresh_out = Vec::new();
    // Per batch, the family's breakdown of prefill and decode time.
    let mut parts_out = Vec::new();
    m.reset_profile();
    // On the device, batch-1 decode is also measured with graphs off: what
    // capturing the step saves over launching its kernels one by one.
    let mut graphs_off = None;
    // (batch, device seconds of a decode step's kernels, its wall seconds).
    let mut device_split: Vec<(usize, f64, f64, [f64; 5])> = Vec::new();
    for &batch in batches {
        // Prefill: `batch` prompts in one step. The first into a fresh
        // store (its K/V memory allocated and first touched in the step);
        // then `r` into the same store with its sequences removed before
        // each, so their buffers are reused as a serving pool's pages are:
        // the median of those is the prefill figure.
        let spans: Vec<SeqSpan> = (0..batch)
            .map(|i| SeqSpan {
                seq: i as u64,
                start: 0,
                tokens: &prompts[i],
                logits: LogitsWanted::Last,
            })
            .collect();
        let mut kv = new_kv();
        let t = Instant::now();
        m.forward(&mut kv, &spans, th)?;
        let fresh_s = t.elapsed().as_secs_f64();
        m.reset_profile();
        let mut pre = Vec::new();
        for _ in 0..r.max(1) {
            for s in &spans {
                kv.remove(s.seq);
            }
            let t = Instant::now();
            m.forward(&mut kv, &spans, th)?;
            pre.push(t.elapsed().as_secs_f64());
        }
        let prefill_s = median(pre);
        let prefill_parts = m.profile();
        m.reset_profile();
        // Decode: `batch` sequences advance one token per step; each pass
        // is `decode_steps` steps, their wall seconds.
        let toks: Vec<u32> = (0..batch as u32).map(|i| 100 + i).collect();
        let mut decode_pass = || -> anyhow::Result<Vec<f64>> {
            let mut steps = Vec::with_capacity(a.decode_steps);
            for _ in 0..a.decode_steps {
                let spans: Vec<SeqSpan> = (0..batch)
                    .map(|i| SeqSpan {
                        seq: i as u64,
                        start: kv.len(i as u64),
                        tokens: std::slice::from_ref(&toks[i]),
                        logits: LogitsWanted::Last,
                    })
                    .collect();
                let t = Instant::now();
                m.forward(&mut kv, &spans, th)?;
                steps.push(t.elapsed().as_secs_f64());
            }
            Ok(steps)
        };
        let step_s = median(decode_pass()?);
        if on_gpu {
            // The same steps again, each one's kernels timed on the device by
            // events around them: what of the step is device time, and what
            // host work and copies.
            if let Some(l) = model.llama() {
                l.set_cuda_step_timing(true);
                let _ = l.take_cuda_step_device();
                let wall = decode_pass();
                l.set_cuda_step_timing(false);
                let wall = wall?;
                let dev = l.take_cuda_step_device();
                if !dev.is_empty() {
                    let med = |f: fn(&lmrr_engine::llama::StepSplit) -> f64| {
                        median(dev.iter().map(f).collect())
                    };
                    let parts = [
                        med(|s| s.before),
                        med(|s| s.launch),
                        med(|s| s.wait),
                        med(|s| s.copies),
                        med(|s| s.after),
                    ];
                    device_split.push((batch, med(|s| s.kernels), median(wall), parts));
                }
            }
        }
        if on_gpu && batch == 1 {
            if let Some(l) = model.llama() {
                l.set_cuda_graphs(false);
                let off = decode_pass();
                l.set_cuda_graphs(true);
                graphs_off = Some(median(off?));
            }
        }
        let decode_parts = m.profile();
        m.reset_profile();
        fresh_out.push((batch, (batch * a.prompt_len) as f64 / fresh_s));
        rows_out.push((
            batch,
            (batch * a.prompt_len) as f64 / prefill_s,
            batch as f64 / step_s,
            step_s,
        ));
        parts_out.push((batch, prefill_parts, decode_parts));
    }

    Ok(Batches {
        rows_out,
        fresh_out,
        parts_out,
        graphs_off,
        device_split,
    })
}

/// The report's rows of [`measure_batches`]' figures: per batch prefill and
/// decode against the floor (and the FP32 rate on the device), the device
/// split of a decode step, batch 1 with graphs off, and the step's parts.
fn report_batches(b: &Batches, a: &BenchArgs, peak: Option<f64>, flops_per_token: f64, floor: f64) {
    let Batches {
        rows_out,
        fresh_out,
        parts_out,
        graphs_off,
        device_split,
    } = b;
    for (batch, pre, dec, step) in rows_out {
        let of_peak = peak.map_or(String::new(), |p| {
            let rate = pre * flops_per_token;
            if a.numerics == "canonical" {
                format!(" ({:.2}% of the FP32 rate)", 100.0 * rate / p)
            } else {
                // Tensor cores: the FP32 CUDA-core rate is not their bound.
                format!(
                    " ({:.1} TFLOP/s on tensor cores, {:.2}× the FP32 CUDA-core rate)",
                    rate / 1e12,
                    rate / p
                )
            }
        });
        println!(
            "| prefill, batch {batch} × {} tokens (KV memory reused) | {pre:.1} tok/s{of_peak} |",
            a.prompt_len
        );
        if let Some((_, f)) = fresh_out.iter().find(|f| f.0 == *batch) {
            println!(
                "| prefill, batch {batch} × {} tokens, first, into a fresh KV store (one sample) | {f:.1} tok/s |",
                a.prompt_len
            );
        }
        println!(
            "| decode, batch {batch} (context ~{}) | {dec:.1} tok/s ({:.2} ms/step, {:.2}× the floor) |",
            a.prompt_len,
            step * 1e3,
            step / floor
        );
    }
    for (batch, dev, wall, [before, launch, wait, copies, after]) in device_split {
        println!(
            "| decode, batch {batch}: the step's kernels on the device (events around them) | {:.3} of {:.3} ms ({:.1}%; host work and copies {:.3} ms) |",
            dev * 1e3,
            wall * 1e3,
            100.0 * dev / wall,
            (wall - dev) * 1e3
        );
        println!(
            "| decode, batch {batch}: the step's parts (medians) | host before the launch {:.1} µs, launch calls {:.1} µs, waiting for the downloads {:.1} µs (of which the copies on the device {:.1} µs), host after {:.1} µs |",
            before * 1e6,
            launch * 1e6,
            wait * 1e6,
            copies * 1e6,
            after * 1e6
        );
    }
    if let Some(off) = graphs_off {
        println!(
            "| decode, batch 1, CUDA graphs off (kernels launched one by one) | {:.1} tok/s ({:.2} ms/step, {:.2}× the floor) |",
            1.0 / off,
            off * 1e3,
            off / floor
        );
    }
    for (batch, pre, dec) in parts_out {
        for (what, parts) in [("prefill", pre), ("decode", dec)] {
            let Some(&(_, step)) = parts.iter().find(|p| p.0 == "step") else {
                continue;
            };
            let named: Vec<&(&str, f64)> = parts.iter().filter(|p| p.0 != "step").collect();
            let other = step - named.iter().map(|p| p.1).sum::<f64>();
            let shares: Vec<String> = named
                .iter()
                .map(|(name, s)| format!("{name} {:.1}%", 100.0 * s / step))
                .chain(std::iter::once(format!(
                    "other (host work outside these parts: input packing, bookkeeping) {:.1}%",
                    100.0 * other / step
                )))
                .collect();
            println!(
                "| share of {what} step time, batch {batch} | {} |",
                shares.join(", ")
            );
        }
    }
}
