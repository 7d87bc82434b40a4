//! Device check for contract invariant I6: every op of the CUDA mirror against
//! the CPU fast path, bit for bit, on awkward sizes and special values.
//!
//!     cargo build --release -p lmrr-kernels --features cuda --example gpu_check
//!     target/release/examples/gpu_check        # on a machine with a GPU
//!
//! Prints one line per case and a summary; exits 1 on any differing bit, 2
//! when no device can be opened.

use lmrr_kernels::cuda::{Gpu, SOURCE};
use lmrr_kernels::*;

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

fn diff(a: &[f32], b: &[f32]) -> usize {
    a.iter()
        .zip(b)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count()
        + a.len().abs_diff(b.len())
}

/// Differing bits between the CPU and a (mutated) device build over a few
/// matmuls, RMSNorm, SwiGLU and RoPE.
fn control(gpu: &Gpu) -> usize {
    let th = Threads::new(2).expect("threads");
    let mut r = SplitMix64(7);
    let (rows, cols, n) = (64, 576, 2);
    let x = r.uniform_vec(n * cols, 2.0);
    let q41 = blocks(&mut r, QuantKind::Q4_1, rows * cols / 32);
    let wf = r.uniform_vec(rows * cols, 0.5);
    let mut total = 0;
    for w in [Weights::F32(&wf), Weights::Quant(QuantKind::Q4_1, &q41)] {
        let m = Matrix::new(w, rows, cols).expect("shape");
        let (mut cpu, mut dev) = (vec![0.0; n * rows], vec![0.0; n * rows]);
        matmul(&th, &x, n, &m, &mut cpu);
        gpu.matmul(&x, n, &m, &mut dev).expect("gpu matmul");
        total += diff(&cpu, &dev);
    }
    let w = r.uniform_vec(cols, 1.5);
    let (mut cpu, mut dev) = (vec![0.0; x.len()], vec![0.0; x.len()]);
    rms_norm(&x, &w, 1e-5, &mut cpu);
    gpu.rms_norm(&x, &w, 1e-5, &mut dev).expect("gpu rms_norm");
    total += diff(&cpu, &dev);
    let table = RopeTable::new(64, 100_000.0, 1024);
    let (mut cpu, mut dev) = (x[..576].to_vec(), x[..576].to_vec());
    rope(&table, &mut cpu, 777);
    gpu.rope(&table, &mut dev, 777).expect("gpu rope");
    total + diff(&cpu, &dev)
}

fn main() {
    // Negative control first: with multiply-add contraction allowed, or with
    // the lane tree reassociated, some output must change — else the check
    // below could not see a broken mirror.
    let controls = [
        ("fmad=true", SOURCE.to_string(), true),
        (
            "lane tree (l0+l1)+(l2+l3)…",
            SOURCE.replace(
                "float t0 = l[0] + l[4], t1 = l[1] + l[5], t2 = l[2] + l[6], t3 = l[3] + l[7];",
                "float t0 = l[0] + l[1], t1 = l[4] + l[5], t2 = l[2] + l[3], t3 = l[6] + l[7];",
            ),
            false,
        ),
    ];
    for (label, src, fmad) in controls {
        assert_ne!(src.len(), 0);
        match Gpu::open_with(0, &src, fmad) {
            Ok(g) => {
                let n = control(&g);
                println!("negative control, {label}: {n} differing bits (must be > 0)");
                if n == 0 {
                    eprintln!("the check cannot see a broken mirror");
                    std::process::exit(1);
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
    ];
    for &(rows, cols, n) in &shapes {
        let x = r.uniform_vec(n * cols, 2.0);
        let wf = r.uniform_vec(rows * cols, 0.5);
        let wb: Vec<u16> = wf.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
        let q40 = blocks(&mut r, QuantKind::Q4_0, rows * cols / 32);
        let q41 = blocks(&mut r, QuantKind::Q4_1, rows * cols / 32);
        let q80 = blocks(&mut r, QuantKind::Q8_0, rows * cols / 32);
        let storages = [
            ("f32", Weights::F32(&wf)),
            ("bf16", Weights::Bf16(&wb)),
            ("Q4_0", Weights::Quant(QuantKind::Q4_0, &q40)),
            ("Q4_1", Weights::Quant(QuantKind::Q4_1, &q41)),
            ("Q8_0", Weights::Quant(QuantKind::Q8_0, &q80)),
        ];
        for (label, w) in storages {
            let m = Matrix::new(w, rows, cols).expect("shape");
            let mut cpu = vec![0.0; n * rows];
            matmul(&th, &x, n, &m, &mut cpu);
            let mut dev = vec![f32::NAN; n * rows];
            gpu.matmul(&x, n, &m, &mut dev).expect("gpu matmul");
            report(
                format!("matmul {label} {n}×{cols} · {cols}×{rows}"),
                diff(&cpu, &dev),
                cpu.len(),
            );
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
    for &positions in &[&[0usize][..], &[31, 32, 33], &[5, 100, 511, 64]] {
        let cap = positions.iter().max().unwrap() + 1;
        let blocks = cap.div_ceil(16);
        let kb: Vec<Vec<f32>> = (0..blocks)
            .map(|_| r.uniform_vec(16 * shape.kv_dim(), 3.0))
            .collect();
        let vb: Vec<Vec<f32>> = (0..blocks)
            .map(|_| r.uniform_vec(16 * shape.kv_dim(), 1.0))
            .collect();
        let view = KvView {
            block_len: 16,
            k: kb.iter().map(|b| b.as_slice()).collect(),
            v: vb.iter().map(|b| b.as_slice()).collect(),
        };
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
    }
    println!(
        "summary: {} of {cases} cases bit-identical (CPU ISA {:?} vs {})",
        cases - bad,
        isa(),
        gpu.name()
    );
    std::process::exit(if bad == 0 { 0 } else { 1 });
}
