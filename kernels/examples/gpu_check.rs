//! Device check for contract invariant I6: every op of the CUDA mirror against
//! the CPU fast path, bit for bit, on awkward sizes and special values.
//!
//!     cargo build --release -p lmrr-kernels --features cuda --example gpu_check
//!     target/release/examples/gpu_check        # on a machine with a GPU
//!
//! Prints one line per case and a summary; exits 1 on any differing bit, 2
//! when no device can be opened.

use lmrr_kernels::cuda::resident::{AttnKernel, DecodeRopeCase, NormKernel, Tuning};
use lmrr_kernels::cuda::split::MultiKernel;
use lmrr_kernels::cuda::{
    compile_many, negative_controls, Control, Gpu, MatmulKernel, ANY_CASE, CONTROL_CASES,
};
use lmrr_kernels::*;

/// The paged attention kernels, each held to the CPU.
const ATTN_KERNELS: [(&str, AttnKernel); 4] = [
    ("attention_paged", AttnKernel::Paged),
    ("attention_decode", AttnKernel::Decode),
    ("attention_prefill", AttnKernel::Prefill),
    ("attention_prefill_hd64", AttnKernel::PrefillHd64),
];

type Rng = SplitMix64;

/// Blocks with realistic f16 scales (and a few special ones).
fn blocks(r: &mut Rng, kind: QuantKind, n: usize) -> Vec<u8> {
    let bb = kind.block_bytes();
    let mut out: Vec<u8> = (0..n * bb).map(|_| r.next_u64() as u8).collect();
    for (i, b) in out.chunks_exact_mut(bb).enumerate() {
        let h: u16 = match i % 97 {
            5 => 0x0001,  // subnormal scale
            11 => 0x8000, // -0
            _ => {
                ((r.next_u64() as u16 & 1) << 15)
                    | ((7 + (r.next_u64() % 3) as u16) << 10)
                    | (r.next_u64() as u16 & 0x3ff)
            }
        };
        b[..2].copy_from_slice(&h.to_le_bytes());
        if kind == QuantKind::Q4_1 {
            let m: u16 = ((r.next_u64() as u16 & 1) << 15)
                | ((9 + (r.next_u64() % 3) as u16) << 10)
                | (r.next_u64() as u16 & 0x3ff);
            b[2..4].copy_from_slice(&m.to_le_bytes());
        }
    }
    out
}

/// Random K (±3) and V (±1) rows for positions `0..len` in blocks of 16.
fn kv_blocks(r: &mut Rng, len: usize, kvd: usize) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let blocks = len.div_ceil(16);
    let kb = (0..blocks).map(|_| r.uniform_vec(16 * kvd, 3.0)).collect();
    let vb = (0..blocks).map(|_| r.uniform_vec(16 * kvd, 1.0)).collect();
    (kb, vb)
}

/// The blocks of [`kv_blocks`] as a KV view.
fn block_view<'a>(kb: &'a [Vec<f32>], vb: &'a [Vec<f32>]) -> KvView<'a> {
    KvView {
        block_len: 16,
        k: kb.iter().map(|b| b.as_slice()).collect(),
        v: vb.iter().map(|b| b.as_slice()).collect(),
    }
}

/// A decode step (9/3 heads × 64, pages of 16, tokens at `positions`, each
/// one sequence, pages listed out of order, the written slots NaN before
/// the step) run as `rope_kv` then attention and as
/// `attention_decode_rope` on the device: `(fused, rope_kv, outputs)`: the
/// differing bits of the two paths' outputs, rotated q, rotated K rows and
/// pages (the attention kernels are checked against the CPU elsewhere);
/// and of the rotated q and K rows of `rope_kv` and of the fused kernel
/// against the CPU's `rope` of the same rows.
fn decode_rope(gpu: &Gpu, r: &mut Rng, positions: &[usize]) -> (usize, usize, usize) {
    let (nh, nkv, hd, page_len) = (9usize, 3usize, 64usize, 16usize);
    let (qd, kvd, n) = (nh * hd, nkv * hd, positions.len());
    let pf = page_len * 2 * kvd;
    let counts: Vec<usize> = positions
        .iter()
        .map(|p| (p + 1).div_ceil(page_len))
        .collect();
    let total: usize = counts.iter().sum();
    let mut store = r.uniform_vec(total * pf, 2.0);
    let (mut index, mut seq_off, mut dst_page) = (Vec::new(), Vec::new(), Vec::new());
    let mut next = total;
    for (&p, &c) in positions.iter().zip(&counts) {
        seq_off.push(index.len() as u64);
        for _ in 0..c {
            next -= 1;
            index.push(next as u64);
        }
        let page = index[seq_off[seq_off.len() - 1] as usize + p / page_len] as usize;
        dst_page.push(page as u64);
        for which in 0..2 {
            let at = page * pf + which * page_len * kvd + (p % page_len) * kvd;
            store[at..at + kvd].fill(f32::NAN);
        }
    }
    let max_pos = positions.iter().max().copied().unwrap_or(0);
    let table = RopeTable::new(hd, 10_000.0, max_pos + 1);
    let (cos, sin) = table.tables();
    let pos: Vec<u64> = positions.iter().map(|&p| p as u64).collect();
    let (q, k, v) = (
        r.uniform_vec(n * qd, 2.0),
        r.uniform_vec(n * kvd, 2.0),
        r.uniform_vec(n * kvd, 1.0),
    );
    let case = DecodeRopeCase {
        n_heads: nh,
        n_kv_heads: nkv,
        head_dim: hd,
        page_len,
        q: &q,
        k: &k,
        v: &v,
        cos,
        sin,
        store: &store,
        index: &index,
        seq_off: &seq_off,
        pos: &pos,
        dst_page: &dst_page,
    };
    let [a, b] = case.run(gpu).expect("gpu attention_decode_rope");
    let d = a.iter().zip(&b).map(|(x, y)| diff(x, y)).sum();
    // The CPU's RoPE of each token's q and k rows at its position.
    let (mut qc, mut kc) = (q.clone(), k.clone());
    for (t, &p) in positions.iter().enumerate() {
        rope(&table, &mut qc[t * qd..(t + 1) * qd], p);
        rope(&table, &mut kc[t * kvd..(t + 1) * kvd], p);
    }
    let cpu = diff(&qc, &a[1]) + diff(&kc, &a[2]) + diff(&qc, &b[1]) + diff(&kc, &b[2]);
    (d, cpu, a.iter().map(Vec::len).sum())
}

fn diff(a: &[f32], b: &[f32]) -> usize {
    a.iter()
        .zip(b)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count()
        + a.len().abs_diff(b.len())
}

/// Differing bits, except that two NaNs count as equal whatever their
/// payloads: `(differing, NaN payload only)`. x86 propagates an operand's NaN
/// payload (and makes `-NaN` for `inf − inf`); NVIDIA GPUs return the
/// canonical `0x7fffffff`. NaN where the CPU has a number (or the reverse)
/// still counts as differing.
fn diff_nan(a: &[f32], b: &[f32]) -> (usize, usize) {
    let mut d = a.len().abs_diff(b.len());
    let mut payload = 0;
    for (x, y) in a.iter().zip(b) {
        if x.to_bits() == y.to_bits() {
            continue;
        }
        if x.is_nan() && y.is_nan() {
            payload += 1;
        } else {
            d += 1;
        }
    }
    (d, payload)
}

/// Random mini-v4 operands for one hyper-connection / MoE / indexer case.
struct Hyper {
    h: usize,
    d: usize,
    n: usize,
    raw: Vec<f32>,
    x: Vec<f32>,
    y: Vec<f32>,
}

impl Hyper {
    fn new(r: &mut Rng, n: usize, h: usize, d: usize) -> Self {
        Self {
            h,
            d,
            n,
            raw: r.uniform_vec(n * hyper::hc_raw_width(h), 4.0),
            x: r.uniform_vec(n * h * d, 2.0),
            y: r.uniform_vec(n * d, 2.0),
        }
    }

    /// `[pre, post, res]` of the CPU and of the device.
    fn coeffs(&self, gpu: &Gpu, iters: usize) -> ([Vec<f32>; 3], [Vec<f32>; 3]) {
        let (n, h) = (self.n, self.h);
        let z = || [vec![0.0; n * h], vec![0.0; n * h], vec![0.0; n * h * h]];
        let (mut c, mut g) = (z(), z());
        let [cp, cq, cr] = &mut c;
        hc_coeffs(&self.raw, h, iters, cp, cq, cr);
        let [gp, gq, gr] = &mut g;
        gpu.hc_coeffs(&self.raw, h, iters, gp, gq, gr)
            .expect("gpu hc_coeffs");
        (c, g)
    }

    /// hc_pre then hc_post with the CPU's coefficients: `(cpu, device)` of
    /// each.
    fn mixes(&self, gpu: &Gpu, coeffs: &[Vec<f32>; 3]) -> [(Vec<f32>, Vec<f32>); 2] {
        let (n, h, d) = (self.n, self.h, self.d);
        let [pre, post, res] = coeffs;
        let (mut c1, mut g1) = (vec![0.0; n * d], vec![f32::NAN; n * d]);
        hc_pre(&self.x, pre, h, d, &mut c1);
        gpu.hc_pre(&self.x, pre, h, d, &mut g1).expect("gpu hc_pre");
        let (mut c2, mut g2) = (vec![0.0; n * h * d], vec![f32::NAN; n * h * d]);
        hc_post(&self.x, res, post, &self.y, h, d, &mut c2);
        gpu.hc_post(&self.x, res, post, &self.y, h, d, &mut g2)
            .expect("gpu hc_post");
        [(c1, g1), (c2, g2)]
    }
}

/// `(cpu, device)` of the expert combine of one token with `k` experts of
/// width `d`.
fn combine(gpu: &Gpu, r: &mut Rng, k: usize, d: usize) -> (Vec<f32>, Vec<f32>) {
    let base = r.uniform_vec(d, 2.0);
    let gates = r.uniform_vec(k, 1.5);
    let rows: Vec<Vec<f32>> = (0..k).map(|_| r.uniform_vec(d, 3.0)).collect();
    let ys: Vec<&[f32]> = rows.iter().map(|v| v.as_slice()).collect();
    let (mut cpu, mut dev) = (vec![0.0; d], vec![f32::NAN; d]);
    moe_combine(&base, &gates, &ys, &mut cpu);
    gpu.moe_combine(&base, &gates, &ys, &mut dev)
        .expect("gpu moe_combine");
    (cpu, dev)
}

/// `(cpu, device)` of the indexer scores of one query (`heads × dim`)
/// against `m` keys; weights of both signs, keys scaled by `key_scale`.
fn scores(
    gpu: &Gpu,
    r: &mut Rng,
    heads: usize,
    dim: usize,
    m: usize,
    key_scale: f32,
) -> (Vec<f32>, Vec<f32>) {
    let q = r.uniform_vec(heads * dim, 1.0);
    let w = r.uniform_vec(heads, 2.0);
    let rows: Vec<Vec<f32>> = (0..m).map(|_| r.uniform_vec(dim, key_scale)).collect();
    let keys: Vec<&[f32]> = rows.iter().map(|v| v.as_slice()).collect();
    let (mut cpu, mut dev) = (vec![0.0; m], vec![f32::NAN; m]);
    index_scores(&q, &w, dim, &keys, &mut cpu);
    gpu.index_scores(&q, &w, dim, &keys, &mut dev)
        .expect("gpu index_scores");
    (cpu, dev)
}

/// Differing bits, per op, between the CPU and a (mutated) device build over
/// a few matmuls, RMSNorm, RoPE and the mini-v4 ops.
fn control(gpu: &Gpu) -> Vec<(&'static str, usize)> {
    let th = Threads::new(2).expect("threads");
    let mut r = SplitMix64(7);
    let (rows, cols, n) = (64, 576, 2);
    let x = r.uniform_vec(n * cols, 2.0);
    let q41 = blocks(&mut r, QuantKind::Q4_1, rows * cols / 32);
    let wf = r.uniform_vec(rows * cols, 0.5);
    let mut out = Vec::new();
    let (mut mm, mut warp, mut tile, mut rowsk, mut rows4, mut gemm) = (0, 0, 0, 0, 0, 0);
    for w in [Weights::F32(&wf), Weights::Quant(QuantKind::Q4_1, &q41)] {
        let m = Matrix::new(w, rows, cols).expect("shape");
        let (mut cpu, mut dev) = (vec![0.0; n * rows], vec![0.0; n * rows]);
        matmul(&th, &x, n, &m, &mut cpu);
        gpu.matmul_with(MatmulKernel::Thread, &x, n, &m, &mut dev, 1)
            .expect("gpu matmul");
        mm += diff(&cpu, &dev);
        gpu.matmul_with(MatmulKernel::Warp, &x, n, &m, &mut dev, 1)
            .expect("gpu matmul_warp");
        warp += diff(&cpu, &dev);
        gpu.matmul_with(MatmulKernel::Tile, &x, n, &m, &mut dev, 1)
            .expect("gpu matmul_tile");
        tile += diff(&cpu, &dev);
        gpu.matmul_with(MatmulKernel::Rows, &x, n, &m, &mut dev, 1)
            .expect("gpu matmul_rows");
        rowsk += diff(&cpu, &dev);
        gpu.matmul_with(MatmulKernel::Rows4, &x, n, &m, &mut dev, 1)
            .expect("gpu matmul_rows4");
        rows4 += diff(&cpu, &dev);
        gpu.matmul_with(MatmulKernel::Gemm, &x, n, &m, &mut dev, 1)
            .expect("gpu matmul_gemm");
        gemm += diff(&cpu, &dev);
        for k in [
            MatmulKernel::GemmSplit(1),
            MatmulKernel::GemmWide,
            MatmulKernel::GemmWideSplit(2),
        ] {
            gpu.matmul_with(k, &x, n, &m, &mut dev, 1)
                .expect("gpu matmul_gemm variant");
            gemm += diff(&cpu, &dev);
        }
    }
    out.push(("matmul", mm));
    out.push(("matmul_warp", warp));
    out.push(("matmul_tile", tile));
    out.push(("matmul_rows", rowsk));
    out.push(("matmul_rows4", rows4));
    out.push(("matmul_gemm", gemm));
    {
        // One launch over two matrices of other row counts (q, k; gate, up),
        // the gemm whole and split.
        let w2 = r.uniform_vec(32 * cols, 0.5);
        let m1 = Matrix::new(Weights::F32(&wf), rows, cols).expect("shape");
        let m2 = Matrix::new(Weights::F32(&w2), 32, cols).expect("shape");
        let mut want = Vec::new();
        for m in [&m1, &m2] {
            let mut cpu = vec![0.0; n * m.rows];
            matmul(&th, &x, n, m, &mut cpu);
            want.push(cpu);
        }
        for (label, k) in [
            ("matmul_gemm_multi", MultiKernel::Gemm),
            ("matmul_gemm_multi split", MultiKernel::GemmSplit),
        ] {
            let got = gpu
                .multi_resident(k, &x, n, &[&m1, &m2])
                .expect("gpu one-launch matmuls");
            out.push((label, diff(&want[0], &got[0]) + diff(&want[1], &got[1])));
        }
    }
    let (fused, cpu_rope, _) = decode_rope(gpu, &mut r, &[5, 64, 100]);
    out.push(("attention_decode_rope_qs", fused));
    out.push(("rope_kv", cpu_rope));
    let w = r.uniform_vec(cols, 1.5);
    let (mut cpu, mut dev) = (vec![0.0; x.len()], vec![0.0; x.len()]);
    rms_norm(&x, &w, 1e-5, &mut cpu);
    gpu.rms_norm(&x, &w, 1e-5, &mut dev).expect("gpu rms_norm");
    out.push(("rms_norm", diff(&cpu, &dev)));
    for (label, kernel) in [
        ("rms_norm_warp", NormKernel::Warp),
        ("norm_block", NormKernel::Block),
        ("norm_reg", NormKernel::Reg),
        ("norm_reg_lf", NormKernel::RegLf),
    ] {
        gpu.rms_norm_resident(&x, None, &w, 1e-5, kernel, &mut dev)
            .expect(label);
        out.push((label, diff(&cpu, &dev)));
    }
    {
        let shape = AttnShape {
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 64,
        };
        let kb = r.uniform_vec(80 * shape.kv_dim(), 3.0);
        let vb = r.uniform_vec(80 * shape.kv_dim(), 1.0);
        let view = KvView {
            block_len: 80,
            k: vec![&kb],
            v: vec![&vb],
        };
        let q = r.uniform_vec(shape.q_dim(), 2.0);
        let tasks = [AttnTask {
            q: &q,
            kv: &view,
            pos: 70,
        }];
        let (mut cpu, mut dev) = (vec![0.0; shape.q_dim()], vec![0.0; shape.q_dim()]);
        attention(&th, &tasks, &shape, 0.125, &mut cpu);
        for (label, kernel) in ATTN_KERNELS {
            gpu.attention_resident(&tasks, &shape, 0.125, 16, kernel, &mut dev)
                .expect(label);
            out.push((label, diff(&cpu, &dev)));
        }
    }
    let table = RopeTable::new(64, 100_000.0, 1024);
    let (mut cpu, mut dev) = (x[..576].to_vec(), x[..576].to_vec());
    rope(&table, &mut cpu, 777);
    gpu.rope(&table, &mut dev, 777).expect("gpu rope");
    out.push(("rope", diff(&cpu, &dev)));
    let hy = Hyper::new(&mut r, 9, 4, 100);
    let (c, g) = hy.coeffs(gpu, 20);
    let cd: usize = c.iter().zip(&g).map(|(a, b)| diff(a, b)).sum();
    out.push(("hc_coeffs", cd));
    let [(c1, g1), (c2, g2)] = hy.mixes(gpu, &c);
    out.push(("hc_pre", diff(&c1, &g1)));
    out.push(("hc_post", diff(&c2, &g2)));
    let (c, g) = combine(gpu, &mut r, 6, 200);
    out.push(("moe_combine", diff(&c, &g)));
    let (c, g) = scores(gpu, &mut r, 4, 100, 64, 3.0);
    out.push(("index_scores", diff(&c, &g)));
    out
}

fn main() {
    // Negative control first: with multiply-add contraction allowed, or with
    // the lane tree reassociated, some output must change — else the check
    // below could not see a broken mirror.
    let controls = match negative_controls() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    };
    // GPU_CHECK_CONTROLS: only the controls whose label holds one of these
    // comma-separated words ("none": none), for a run that must fit a device
    // budget (each control is a whole-module compile: about 55 s apiece on
    // the H200 machine one after another; they now compile on every core at
    // once, below); unset: all.
    let only: Option<Vec<String>> = std::env::var("GPU_CHECK_CONTROLS")
        .ok()
        .map(|v| v.split(',').map(|w| w.trim().to_string()).collect());
    let all = controls.len();
    let controls: Vec<Control> = controls
        .into_iter()
        .filter(|c| {
            only.as_ref().is_none_or(|ws| {
                ws.iter()
                    .any(|w| !w.is_empty() && c.label.contains(w.as_str()))
            })
        })
        .collect();
    if controls.len() < all {
        println!(
            "negative controls: {} of {all} run (GPU_CHECK_CONTROLS={:?})",
            controls.len(),
            only.map(|w| w.join(",")).unwrap_or_default()
        );
    }
    // Every control's source compiled first, on the machine's cores at once
    // (each is a whole-module NVRTC compile, tens of seconds apiece), then
    // each loaded and checked in turn.
    let threads = std::thread::available_parallelism().map_or(4, |n| n.get());
    let t0 = std::time::Instant::now();
    let items: Vec<(&str, bool)> = controls
        .iter()
        .map(|c| (c.source.as_str(), c.fmad))
        .collect();
    let ptxs = compile_many(&items, threads);
    if !controls.is_empty() {
        println!(
            "negative controls: {} sources compiled on {threads} threads in {:.1} s",
            controls.len(),
            t0.elapsed().as_secs_f64()
        );
    }
    // Controls the check could not see: each is reported, the cases still
    // run (one device call shows every blind spot and every case), and the
    // check fails at the end.
    let mut blind: Vec<&'static str> = Vec::new();
    for (
        Control {
            label,
            kernel,
            source: src,
            fmad,
        },
        ptx,
    ) in controls.into_iter().zip(ptxs)
    {
        // Plain launches: the kernels compiled once, at the default
        // architecture (a control shows the check sees a broken kernel; the
        // build users run is the one checked below).
        let plain = Tuning {
            pdl: false,
            ..Tuning::default()
        };
        let opened = ptx.and_then(|ptx| Gpu::open_compiled(0, &src, fmad, ptx, plain));
        match opened {
            Ok(g) => {
                let per_op = control(&g);
                let names: Vec<&str> = per_op.iter().map(|x| x.0).collect();
                assert_eq!(names, CONTROL_CASES, "control()'s cases are CONTROL_CASES");
                let n: usize = per_op.iter().map(|x| x.1).sum();
                // The case of the kernel the control breaks must differ
                // (`any` for the control that changes only the options).
                let named = if kernel == ANY_CASE {
                    n
                } else {
                    per_op.iter().filter(|x| x.0 == kernel).map(|x| x.1).sum()
                };
                let seen: Vec<String> = per_op
                    .iter()
                    .filter(|x| x.1 > 0)
                    .map(|(op, d)| format!("{op} {d}"))
                    .collect();
                println!(
                    "negative control, {label}: {named} differing bits in {kernel} (must be > 0), {n} in all [{}]",
                    seen.join(", ")
                );
                if named == 0 {
                    println!("  the check cannot see this broken {kernel}");
                    blind.push(label);
                }
            }
            Err(e) => {
                eprintln!("SKIPPED: no device: {e}");
                std::process::exit(2);
            }
        }
    }
    let gpu = match Gpu::open(0) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("SKIPPED: no device: {e}");
            std::process::exit(2);
        }
    };
    println!("device: {}", gpu.name());
    let th = Threads::new(2).expect("threads");
    let mut r = SplitMix64(2026);
    let mut cases = 0usize;
    let mut bad = 0usize;
    let mut report = |name: String, d: usize, of: usize| {
        cases += 1;
        if d > 0 {
            bad += 1;
        }
        println!("{:<58} {:>9} outputs  {:>6} differing bits", name, of, d);
    };
    // Matmul over every storage, decode and prefill shapes, SmolLM2's too.
    let shapes = [
        (1usize, 32usize, 1usize),
        (7, 96, 3),
        (37, 576, 1),
        (13, 160, 5),
        (576, 576, 4),
        (1536, 576, 2),
        (576, 1536, 1),
        (64, 2048, 9),
        (1536, 576, 64),
        (576, 1536, 17),
        (100, 4096, 8),
        (33, 100, 23),
        (577, 1000, 130),
    ];
    for &(rows, cols, n) in &shapes {
        let x = r.uniform_vec(n * cols, 2.0);
        let wf = r.uniform_vec(rows * cols, 0.5);
        let wb: Vec<u16> = wf.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
        let q40 = blocks(&mut r, QuantKind::Q4_0, rows * cols / 32);
        let q41 = blocks(&mut r, QuantKind::Q4_1, rows * cols / 32);
        let q80 = blocks(&mut r, QuantKind::Q8_0, rows * cols / 32);
        let mut storages = vec![("f32", Weights::F32(&wf)), ("bf16", Weights::Bf16(&wb))];
        // Quantized rows are whole 32-value blocks: a ragged width (100,
        // 1000: the gemm tiles' edges) is covered by f32 and bf16 only.
        if cols % 32 == 0 {
            storages.push(("Q4_0", Weights::Quant(QuantKind::Q4_0, &q40)));
            storages.push(("Q4_1", Weights::Quant(QuantKind::Q4_1, &q41)));
            storages.push(("Q8_0", Weights::Quant(QuantKind::Q8_0, &q80)));
        }
        for (label, w) in storages {
            let m = Matrix::new(w, rows, cols).expect("shape");
            let mut cpu = vec![0.0; n * rows];
            matmul(&th, &x, n, &m, &mut cpu);
            let mut dev = vec![f32::NAN; n * rows];
            gpu.matmul_with(MatmulKernel::Thread, &x, n, &m, &mut dev, 1)
                .expect("gpu matmul");
            report(
                format!("matmul {label} {n}×{cols} · {cols}×{rows}"),
                diff(&cpu, &dev),
                cpu.len(),
            );
            let mut warp = vec![f32::NAN; n * rows];
            gpu.matmul_with(MatmulKernel::Warp, &x, n, &m, &mut warp, 1)
                .expect("gpu matmul_warp");
            report(
                format!("matmul_warp {label} {n}×{cols} · {cols}×{rows}"),
                diff(&cpu, &warp),
                cpu.len(),
            );
            let mut tile = vec![f32::NAN; n * rows];
            gpu.matmul_with(MatmulKernel::Tile, &x, n, &m, &mut tile, 1)
                .expect("gpu matmul_tile");
            report(
                format!("matmul_tile {label} {n}×{cols} · {cols}×{rows}"),
                diff(&cpu, &tile),
                cpu.len(),
            );
            let mut rk = vec![f32::NAN; n * rows];
            gpu.matmul_with(MatmulKernel::Rows, &x, n, &m, &mut rk, 1)
                .expect("gpu matmul_rows");
            report(
                format!("matmul_rows {label} {n}×{cols} · {cols}×{rows}"),
                diff(&cpu, &rk),
                cpu.len(),
            );
            if cols.div_ceil(64) <= lmrr_kernels::cuda::resident::MR4_MAX_CHUNKS {
                let mut r4 = vec![f32::NAN; n * rows];
                gpu.matmul_with(MatmulKernel::Rows4, &x, n, &m, &mut r4, 1)
                    .expect("gpu matmul_rows4");
                report(
                    format!("matmul_rows4 {label} {n}×{cols} · {cols}×{rows}"),
                    diff(&cpu, &r4),
                    cpu.len(),
                );
            }
            let mut gm = vec![f32::NAN; n * rows];
            gpu.matmul_with(MatmulKernel::Gemm, &x, n, &m, &mut gm, 1)
                .expect("gpu matmul_gemm");
            report(
                format!("matmul_gemm {label} {n}×{cols} · {cols}×{rows}"),
                diff(&cpu, &gm),
                cpu.len(),
            );
            for (what, k) in [
                ("matmul_gemm split 1", MatmulKernel::GemmSplit(1)),
                ("matmul_gemm split 3", MatmulKernel::GemmSplit(3)),
                ("matmul_gemm_wide", MatmulKernel::GemmWide),
                ("matmul_gemm_wide split 2", MatmulKernel::GemmWideSplit(2)),
            ] {
                let mut gs = vec![f32::NAN; n * rows];
                gpu.matmul_with(k, &x, n, &m, &mut gs, 1)
                    .expect("gpu matmul_gemm variant");
                report(
                    format!("{what} {label} {n}×{cols} · {cols}×{rows}"),
                    diff(&cpu, &gs),
                    cpu.len(),
                );
            }
        }
    }
    // Up to three matmuls of one input in one launch (q/k/v, gate/up; o and
    // down alone), each matrix's output against the CPU's matmul: the
    // decode kernel (matmul_multi) and the gemm's one-launch
    // form, whole and split (its partials summed).
    let multi_shapes: [(usize, usize, &[usize]); 6] = [
        (1, 576, &[576, 192, 192]),
        (3, 224, &[131, 33, 9]),
        (5, 576, &[1536, 1536]),
        (70, 576, &[576, 192, 192]),
        (130, 1536, &[576]),
        (64, 224, &[130, 33]),
    ];
    for &(n, cols, rows) in &multi_shapes {
        let x = r.uniform_vec(n * cols, 2.0);
        let wf: Vec<Vec<f32>> = rows.iter().map(|&o| r.uniform_vec(o * cols, 0.5)).collect();
        let q41: Vec<Vec<u8>> = rows
            .iter()
            .map(|&o| blocks(&mut r, QuantKind::Q4_1, o * cols / 32))
            .collect();
        for (label, quant) in [("f32", false), ("Q4_1", true)] {
            let ms: Vec<Matrix> = (0..rows.len())
                .map(|i| {
                    let w = if quant {
                        Weights::Quant(QuantKind::Q4_1, &q41[i])
                    } else {
                        Weights::F32(&wf[i])
                    };
                    Matrix::new(w, rows[i], cols).expect("shape")
                })
                .collect();
            let refs: Vec<&Matrix> = ms.iter().collect();
            let want: Vec<Vec<f32>> = ms
                .iter()
                .map(|m| {
                    let mut cpu = vec![0.0; n * m.rows];
                    matmul(&th, &x, n, m, &mut cpu);
                    cpu
                })
                .collect();
            let total: usize = want.iter().map(Vec::len).sum();
            for (kname, k) in [
                ("matmul_multi", MultiKernel::Rows),
                ("matmul_gemm_multi", MultiKernel::Gemm),
                ("matmul_gemm_multi split", MultiKernel::GemmSplit),
            ] {
                if k == MultiKernel::Rows && n >= 8 {
                    continue; // below the gemm only
                }
                let got = gpu
                    .multi_resident(k, &x, n, &refs)
                    .unwrap_or_else(|e| panic!("gpu {kname}: {e}"));
                let d: usize = want.iter().zip(&got).map(|(a, b)| diff(a, b)).sum();
                report(
                    format!("{kname} {label} {n}×{cols} · {cols}×{rows:?}"),
                    d,
                    total,
                );
            }
        }
    }
    // Empty batches (a prefill chunk that wants no logits) are no-ops.
    let wf = r.uniform_vec(8 * 64, 1.0);
    let m = Matrix::new(Weights::F32(&wf), 8, 64).expect("shape");
    let empty_ok = gpu.matmul(&[], 0, &m, &mut []).is_ok()
        && gpu.rms_norm(&[], &wf[..64], 1e-5, &mut []).is_ok()
        && gpu.swiglu(&[], &[], &mut []).is_ok();
    report(
        "empty matmul / rms_norm / swiglu are no-ops".into(),
        usize::from(!empty_ok),
        0,
    );
    // RMSNorm.
    for &(rows, d) in &[(1usize, 576usize), (5, 100), (3, 1536), (2, 7)] {
        let x = r.uniform_vec(rows * d, 3.0);
        let w = r.uniform_vec(d, 1.5);
        let mut cpu = vec![0.0; x.len()];
        rms_norm(&x, &w, 1e-5, &mut cpu);
        let mut dev = vec![0.0; x.len()];
        gpu.rms_norm(&x, &w, 1e-5, &mut dev).expect("gpu rms_norm");
        report(format!("rms_norm {rows}×{d}"), diff(&cpu, &dev), cpu.len());
        let kernels = [
            ("rms_norm_warp", "add_norm", NormKernel::Warp),
            ("norm_block", "norm_block + add", NormKernel::Block),
            ("norm_reg", "norm_reg + add", NormKernel::Reg),
            ("norm_reg_lf", "norm_reg_lf + add", NormKernel::RegLf),
        ];
        for (label, _, kernel) in kernels {
            let mut got = vec![0.0; x.len()];
            gpu.rms_norm_resident(&x, None, &w, 1e-5, kernel, &mut got)
                .expect(label);
            report(format!("{label} {rows}×{d}"), diff(&cpu, &got), cpu.len());
        }
        // The residual add first (add_norm, norm_block's add): x + y, then
        // the norm of the sum, against the CPU's add and norm.
        let y = r.uniform_vec(rows * d, 1.0);
        let sum_cpu: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a + b).collect();
        let mut cpu2 = vec![0.0; x.len()];
        rms_norm(&sum_cpu, &w, 1e-5, &mut cpu2);
        for (_, label, kernel) in kernels {
            let (mut sum, mut dev2) = (vec![f32::NAN; x.len()], vec![f32::NAN; x.len()]);
            gpu.rms_norm_resident(&x, Some((&y, &mut sum)), &w, 1e-5, kernel, &mut dev2)
                .expect(label);
            report(
                format!("{label} {rows}×{d} (sum and norm)"),
                diff(&sum_cpu, &sum) + diff(&cpu2, &dev2),
                2 * cpu.len(),
            );
        }
    }
    // A decode step's RoPE, page writes and attention in one launch
    // (attention_decode_rope) against rope_kv then attention: tokens at
    // positions inside a first page, on a page edge and past several pages.
    // The rotated q and K rows of both against the CPU's rope.
    for positions in [&[0usize][..], &[5, 64, 100], &[15, 16, 17, 300]] {
        let (d, cpu, count) = decode_rope(&gpu, &mut r, positions);
        report(
            format!(
                "attention_decode_rope_qs at positions {positions:?} against rope_kv + attention"
            ),
            d,
            count,
        );
        report(
            format!("rope_kv and attention_decode_rope_qs at positions {positions:?}: q, K rows against the CPU's rope"),
            cpu,
            4 * positions.len() * 12 * 64,
        );
    }
    // det_exp over a wide range and the special values.
    let mut x: Vec<f32> = (0..200_000).map(|i| -100.0 + i as f32 * 0.001).collect();
    x.extend([
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        0.0,
        -0.0,
        88.0,
        88.01,
        -87.0,
        -87.01,
        1e-40,
        -1e-40,
        f32::MAX,
        f32::MIN,
    ]);
    x.extend((0..100_000).map(|_| f32::from_bits(r.next_u64() as u32)));
    let mut cpu = vec![0.0; x.len()];
    exp_slice(&x, &mut cpu);
    let mut dev = vec![0.0; x.len()];
    gpu.exp_slice(&x, &mut dev).expect("gpu exp");
    report(
        "det_exp: [-100, 100), specials, random bit patterns".into(),
        diff(&cpu, &dev),
        cpu.len(),
    );
    // SwiGLU.
    let g = r.uniform_vec(100_003, 12.0);
    let u = r.uniform_vec(100_003, 4.0);
    let mut cpu = vec![0.0; g.len()];
    swiglu(&g, &u, &mut cpu);
    let mut dev = vec![0.0; g.len()];
    gpu.swiglu(&g, &u, &mut dev).expect("gpu swiglu");
    report("swiglu 100003".into(), diff(&cpu, &dev), cpu.len());
    // RoPE at several positions (SmolLM2: head_dim 64, theta 1e5).
    let table = RopeTable::new(64, 100_000.0, 8192);
    for pos in [0usize, 1, 17, 511, 8191] {
        let x0 = r.uniform_vec(9 * 64, 2.0);
        let mut cpu = x0.clone();
        rope(&table, &mut cpu, pos);
        let mut dev = x0.clone();
        gpu.rope(&table, &mut dev, pos).expect("gpu rope");
        report(
            format!("rope 9 heads × 64 at position {pos}"),
            diff(&cpu, &dev),
            cpu.len(),
        );
    }
    // Attention: GQA 9/3 × 64 (SmolLM2), positions across tile boundaries,
    // KV in paged blocks of 16 positions, several tasks at once.
    let shape = AttnShape {
        n_heads: 9,
        n_kv_heads: 3,
        head_dim: 64,
    };
    // The last: a prefill's 80 tokens of one sequence (attention_prefill's
    // groups of 16, the second 40 past a super-chunk of 2,048 positions).
    let prefill: Vec<usize> = (0..40).chain(2030..2070).collect();
    for &positions in &[
        &[0usize][..],
        &[31, 32, 33],
        &[5, 100, 511, 64],
        &prefill[..],
    ] {
        let cap = positions.iter().max().unwrap() + 1;
        let (kb, vb) = kv_blocks(&mut r, cap, shape.kv_dim());
        let view = block_view(&kb, &vb);
        let qs: Vec<Vec<f32>> = positions
            .iter()
            .map(|_| r.uniform_vec(shape.q_dim(), 2.0))
            .collect();
        let tasks: Vec<AttnTask> = positions
            .iter()
            .zip(&qs)
            .map(|(&pos, q)| AttnTask { q, kv: &view, pos })
            .collect();
        let mut cpu = vec![0.0; tasks.len() * shape.q_dim()];
        attention(&th, &tasks, &shape, 0.125, &mut cpu);
        let mut dev = vec![0.0; cpu.len()];
        gpu.attention(&tasks, &shape, 0.125, &mut dev)
            .expect("gpu attention");
        report(
            format!("attention 9/3 heads × 64, positions {positions:?}"),
            diff(&cpu, &dev),
            cpu.len(),
        );
        for page_len in [1usize, 7, 16, 64] {
            for (label, kernel) in ATTN_KERNELS {
                let mut paged = vec![f32::NAN; cpu.len()];
                gpu.attention_resident(&tasks, &shape, 0.125, page_len, kernel, &mut paged)
                    .expect(label);
                report(
                    format!("{label} pages of {page_len}, positions {positions:?}"),
                    diff(&cpu, &paged),
                    cpu.len(),
                );
            }
        }
    }
    // Paged attention with head_dim 128 and 256 (two chunks and more per
    // score) and MHA.
    for &(nh, nkv, hd, pos) in &[
        (4usize, 4usize, 128usize, 200usize),
        (2, 1, 256, 40),
        (3, 3, 80, 95),
    ] {
        let shape = AttnShape {
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
        };
        let kb = r.uniform_vec((pos + 1) * shape.kv_dim(), 3.0);
        let vb = r.uniform_vec((pos + 1) * shape.kv_dim(), 1.0);
        let view = KvView {
            block_len: pos + 1,
            k: vec![&kb],
            v: vec![&vb],
        };
        let q = r.uniform_vec(shape.q_dim(), 2.0);
        let tasks = [AttnTask {
            q: &q,
            kv: &view,
            pos,
        }];
        let mut cpu = vec![0.0; shape.q_dim()];
        attention(&th, &tasks, &shape, 0.088, &mut cpu);
        for (label, kernel) in ATTN_KERNELS {
            if (kernel == AttnKernel::Prefill && hd > lmrr_kernels::cuda::resident::PF_MAXHD)
                || (kernel == AttnKernel::PrefillHd64 && hd != 64)
            {
                continue;
            }
            let mut paged = vec![f32::NAN; cpu.len()];
            gpu.attention_resident(&tasks, &shape, 0.088, 16, kernel, &mut paged)
                .expect(label);
            report(
                format!("{label} {nh}/{nkv} heads × {hd}, position {pos}"),
                diff(&cpu, &paged),
                cpu.len(),
            );
        }
    }
    // mini-v4: hyper-connection coefficients (sigmoid + Sinkhorn) over odd
    // stream counts, zero and many rounds; the stream mixes with d not a
    // multiple of 8; the expert combine; indexer scores with dims over 64.
    for &(n, h, d, iters) in &[
        (1usize, 1usize, 7usize, 20usize),
        (37, 3, 100, 20),
        (5, 4, 128, 0),
        (5, 4, 128, 1),
        (13, 5, 13, 7),
        (3, 4, 512, 20),
    ] {
        let hy = Hyper::new(&mut r, n, h, d);
        let (c, g) = hy.coeffs(&gpu, iters);
        for (name, (a, b)) in ["pre", "post", "res"].iter().zip(c.iter().zip(&g)) {
            report(
                format!("hc_coeffs {n} tokens, h {h}, {iters} Sinkhorn rounds: {name}"),
                diff(a, b),
                a.len(),
            );
        }
        let [(c1, g1), (c2, g2)] = hy.mixes(&gpu, &c);
        report(
            format!("hc_pre {n} tokens, h {h}, d {d}"),
            diff(&c1, &g1),
            c1.len(),
        );
        report(
            format!("hc_post {n} tokens, h {h}, d {d}"),
            diff(&c2, &g2),
            c2.len(),
        );
    }
    // Sigmoid and Sinkhorn on special and large values: NaN, ±inf, ±1e30,
    // ±f32::MAX, around det_exp's cut-offs, -0, subnormals, random bits.
    {
        let h = 3;
        let w = hyper::hc_raw_width(h);
        let specials = [
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            1e30,
            -1e30,
            f32::MAX,
            f32::MIN,
            88.0,
            88.01,
            -87.0,
            -87.01,
            100.0,
            -100.0,
            0.0,
            -0.0,
            1e-40,
            -1e-40,
        ];
        let mut raw = Vec::new();
        // One special in every slot of a token; then pairs; then one token
        // of all-equal specials each; then random bit patterns.
        for (i, &v) in specials.iter().enumerate() {
            for slot in 0..w {
                let mut t = r.uniform_vec(w, 4.0);
                t[slot] = v;
                t[(slot + 1 + i) % w] = specials[(i * 7 + slot) % specials.len()];
                raw.extend(t);
            }
            raw.extend(std::iter::repeat_n(v, w));
        }
        raw.extend((0..64 * w).map(|_| f32::from_bits(r.next_u64() as u32)));
        let n = raw.len() / w;
        let z = || [vec![0.0; n * h], vec![0.0; n * h], vec![0.0; n * h * h]];
        let (mut c, mut g) = (z(), z());
        {
            let [cp, cq, cr] = &mut c;
            hc_coeffs(&raw, h, 20, cp, cq, cr);
            let [gp, gq, gr] = &mut g;
            gpu.hc_coeffs(&raw, h, 20, gp, gq, gr)
                .expect("gpu hc_coeffs");
        }
        for (name, (a, b)) in ["pre", "post", "res"].iter().zip(c.iter().zip(&g)) {
            let (dd, payload) = diff_nan(a, b);
            let nans = a.iter().filter(|v| v.is_nan()).count();
            report(
                format!(
                    "hc_coeffs specials, {n} tokens, h 3: {name} ({nans} NaN, {payload} payload-only)"
                ),
                dd,
                a.len(),
            );
        }
        // The sigmoid alone, through pre, on a dense sweep plus specials.
        let mut xs: Vec<f32> = (0..200_001).map(|i| -100.0 + i as f32 * 0.001).collect();
        xs.extend(specials);
        let (h1, n1) = (1, xs.len());
        let raw1: Vec<f32> = xs.iter().flat_map(|&v| [v, -v, 0.0]).collect();
        let z = || [vec![0.0; n1 * h1], vec![0.0; n1 * h1], vec![0.0; n1]];
        let (mut c, mut g) = (z(), z());
        {
            let [cp, cq, cr] = &mut c;
            hc_coeffs(&raw1, h1, 1, cp, cq, cr);
            let [gp, gq, gr] = &mut g;
            gpu.hc_coeffs(&raw1, h1, 1, gp, gq, gr)
                .expect("gpu hc_coeffs");
        }
        let (d1, p1) = diff_nan(&c[0], &g[0]);
        let (d2, p2) = diff_nan(&c[1], &g[1]);
        report(
            format!(
                "sigmoid [-100, 100) + specials (pre, 2·post; {} payload-only)",
                p1 + p2
            ),
            d1 + d2 + diff(&c[2], &g[2]),
            2 * n1 + n1,
        );
    }
    for &(k, d) in &[(0usize, 100usize), (1, 7), (2, 100), (6, 512), (3, 1)] {
        let (c, g) = combine(&gpu, &mut r, k, d);
        report(
            format!("moe_combine {k} experts × {d}"),
            diff(&c, &g),
            c.len(),
        );
    }
    {
        // Several tokens in one launch, with different expert counts.
        let d = 77;
        let base = r.uniform_vec(4 * d, 2.0);
        let counts = [2usize, 0, 5, 1];
        let gates: Vec<Vec<f32>> = counts.iter().map(|&k| r.uniform_vec(k, 1.5)).collect();
        let rows: Vec<Vec<Vec<f32>>> = counts
            .iter()
            .map(|&k| (0..k).map(|_| r.uniform_vec(d, 3.0)).collect())
            .collect();
        let ys: Vec<Vec<&[f32]>> = rows
            .iter()
            .map(|t| t.iter().map(|v| v.as_slice()).collect())
            .collect();
        let mut cpu = vec![0.0; 4 * d];
        for t in 0..4 {
            moe_combine(
                &base[t * d..(t + 1) * d],
                &gates[t],
                &ys[t],
                &mut cpu[t * d..(t + 1) * d],
            );
        }
        let tokens: Vec<(&[f32], &[&[f32]])> = gates
            .iter()
            .zip(&ys)
            .map(|(g, y)| (g.as_slice(), y.as_slice()))
            .collect();
        let mut dev = vec![f32::NAN; 4 * d];
        gpu.moe_combine_many(d, &base, &tokens, &mut dev)
            .expect("gpu moe_combine_many");
        report(
            "moe_combine 4 tokens × 77 in one launch (2, 0, 5, 1 experts)".into(),
            diff(&cpu, &dev),
            cpu.len(),
        );
    }
    for &(heads, dim, m, ks) in &[
        (1usize, 7usize, 5usize, 1.0f32),
        (2, 16, 16, 1.0),
        (3, 100, 37, 3.0),
        (4, 64, 64, 1.0),
        (4, 130, 33, 1e20),
        (5, 200, 129, 0.01),
    ] {
        let (c, g) = scores(&gpu, &mut r, heads, dim, m, ks);
        report(
            format!("index_scores {heads} heads × {dim}, {m} keys (scale {ks:e})"),
            diff(&c, &g),
            c.len(),
        );
    }
    // Kernel timings on resident operands: the reference kernel (one
    // thread per output) against the warp kernel, same bits. Figures, not
    // checks: the device is shared.
    println!("matmul kernel time per launch (operands resident, 50 launches, f32 and Q4_1):");
    for &(rows, cols, n, what) in &[
        (1536usize, 576usize, 1usize, "b1 gate/up (small)"),
        (576, 1536, 1, "b1 down (small)"),
        (49152, 576, 1, "b1 lm head (small)"),
        (1536, 576, 64, "b64 gate/up (small)"),
        (576, 1536, 64, "b64 down (small)"),
        (49152, 576, 64, "b64 lm head (small)"),
        (1536, 576, 512, "prefill 512 gate/up"),
        (1536, 576, 4096, "prefill 64×64 gate/up"),
    ] {
        let x = r.uniform_vec(n * cols, 2.0);
        let wf = r.uniform_vec(rows * cols, 0.5);
        let q41 = blocks(&mut r, QuantKind::Q4_1, rows * cols / 32);
        for (label, w, bytes) in [
            ("f32", Weights::F32(&wf), rows * cols * 4),
            ("Q4_1", Weights::Quant(QuantKind::Q4_1, &q41), q41.len()),
        ] {
            let m = Matrix::new(w, rows, cols).expect("shape");
            let mut y = vec![0.0; n * rows];
            let reps = 50;
            let mut per_launch = |k: MatmulKernel| {
                gpu.matmul_with(k, &x, n, &m, &mut y, reps)
                    .unwrap_or_else(|e| panic!("timing {k:?}: {e}"))
                    / reps as f64
            };
            let t = per_launch(MatmulKernel::Thread);
            let tw = per_launch(MatmulKernel::Warp);
            let tt = per_launch(MatmulKernel::Tile);
            let tr = per_launch(MatmulKernel::Rows);
            let tr4 = per_launch(MatmulKernel::Rows4);
            let tg = per_launch(MatmulKernel::Gemm);
            let ts = per_launch(MatmulKernel::GemmSplit(1));
            let tw2 = per_launch(MatmulKernel::GemmWide);
            let tws = per_launch(MatmulKernel::GemmWideSplit(1));
            println!(
                "  {what:<22} {label:<5} {n:>3}×{cols}·{cols}×{rows}: thread {:>8.1} µs, warp {:>7.1} µs ({:>5.1}×), tile {:>7.1} µs ({:>5.1}×), rows {:>7.1} µs ({:>5.1}×), gemm {:>7.1} µs ({:>5.1}×, {:>5.2} TFLOP/s), gemm split {:>7.1} µs ({:>5.2} TFLOP/s), wide {:>7.1} µs ({:>5.2} TFLOP/s), wide split {:>7.1} µs ({:>5.2} TFLOP/s); rows reads weights at {:>6.0} GB/s, rows4 {:>7.1} µs ({:>6.0} GB/s)",
                t * 1e6,
                tw * 1e6,
                t / tw,
                tt * 1e6,
                t / tt,
                tr * 1e6,
                t / tr,
                tg * 1e6,
                t / tg,
                2.0 * (n * rows * cols) as f64 / tg / 1e12,
                ts * 1e6,
                2.0 * (n * rows * cols) as f64 / ts / 1e12,
                tw2 * 1e6,
                2.0 * (n * rows * cols) as f64 / tw2 / 1e12,
                tws * 1e6,
                2.0 * (n * rows * cols) as f64 / tws / 1e12,
                bytes as f64 / tr / 1e9,
                tr4 * 1e6,
                bytes as f64 / tr4 / 1e9
            );
        }
    }
    // Attention kernel time for a prefill of one sequence (the `small`
    // preset's 9/3 heads × 64, pages of 16): each kernel that serves it,
    // per launch (one layer) and over the preset's 30 layers.
    println!("attention kernel time per launch (one layer of a prefill, 9/3 heads × 64, pages of 16, 20 launches):");
    for &len in &[512usize, 2048] {
        let (kb, vb) = kv_blocks(&mut r, len, shape.kv_dim());
        let view = block_view(&kb, &vb);
        let qs: Vec<Vec<f32>> = (0..len)
            .map(|_| r.uniform_vec(shape.q_dim(), 2.0))
            .collect();
        let tasks: Vec<AttnTask> = qs
            .iter()
            .enumerate()
            .map(|(pos, q)| AttnTask { q, kv: &view, pos })
            .collect();
        let mut first: Option<Vec<f32>> = None;
        let mut line = format!("  prefill {len:>4} tokens:");
        for (label, kernel) in ATTN_KERNELS {
            if kernel == AttnKernel::Decode {
                continue;
            }
            let mut out = vec![f32::NAN; len * shape.q_dim()];
            let t = gpu
                .attention_resident_timed(&tasks, &shape, 0.125, 16, kernel, &mut out, 20)
                .unwrap_or_else(|e| panic!("timing {label}: {e}"));
            // The kernels give one set of bits; a timing of wrong output
            // would be no figure at all.
            match &first {
                None => first = Some(out),
                Some(f) => report(
                    format!("{label} prefill {len} tokens (timed) against attention_paged"),
                    diff(f, &out),
                    f.len(),
                ),
            }
            line += &format!(
                " {label} {:>8.1} µs ({:>6.2} ms for 30 layers);",
                t * 1e6,
                30.0 * t * 1e3
            );
        }
        println!("{line}");
    }
    // Decode attention per launch: one token (9 blocks, batch 1) and 8
    // tokens of 8 sequences (72 blocks) at 64 and 512 positions, each
    // kernel that serves decode; the outputs held to attention_paged's.
    println!(
        "attention kernel time per launch (decode, 9/3 heads × 64, pages of 16, 50 launches):"
    );
    for &(tokens, len) in &[(1usize, 64usize), (8, 64), (1, 512), (8, 512)] {
        let blocks: Vec<_> = (0..tokens)
            .map(|_| kv_blocks(&mut r, len, shape.kv_dim()))
            .collect();
        let views: Vec<KvView> = blocks.iter().map(|(k, v)| block_view(k, v)).collect();
        let qs: Vec<Vec<f32>> = (0..tokens)
            .map(|_| r.uniform_vec(shape.q_dim(), 2.0))
            .collect();
        let tasks: Vec<AttnTask> = qs
            .iter()
            .zip(&views)
            .map(|(q, kv)| AttnTask {
                q,
                kv,
                pos: len - 1,
            })
            .collect();
        let mut first: Option<Vec<f32>> = None;
        let mut line = format!("  batch {tokens}, {len:>3} positions:");
        for (label, kernel) in ATTN_KERNELS {
            if kernel.is_prefill() {
                continue;
            }
            let mut out = vec![f32::NAN; tokens * shape.q_dim()];
            let t = gpu
                .attention_resident_timed(&tasks, &shape, 0.125, 16, kernel, &mut out, 50)
                .unwrap_or_else(|e| panic!("timing {label}: {e}"));
            match &first {
                None => first = Some(out),
                Some(f) => report(
                    format!("{label} decode, batch {tokens}, {len} positions (timed) against attention_paged"),
                    diff(f, &out),
                    f.len(),
                ),
            }
            line += &format!(" {label} {:>6.1} µs;", t * 1e6);
        }
        println!("{line}");
    }
    println!(
        "summary: {} of {cases} cases bit-identical (CPU ISA {:?} vs {})",
        cases - bad,
        isa(),
        gpu.name()
    );
    if !blind.is_empty() {
        println!(
            "the check cannot see {} negative control(s): {}",
            blind.len(),
            blind.join("; ")
        );
    }
    std::process::exit(if bad == 0 && blind.is_empty() { 0 } else { 1 });
}
