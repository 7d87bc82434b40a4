//! Kernel timings on resident operands: figures, not checks (the device is
//! shared), except that the kernels timed on one operand set must give one
//! set of bits, which is reported as a case.

use lmrr_kernels::cuda::resident::AttnKernel;
use lmrr_kernels::cuda::{Gpu, MatmulKernel};
use lmrr_kernels::*;

use crate::report::Report;
use crate::util::*;

/// Kernel timings on resident operands: the reference kernel (one
/// thread per output) against the warp kernel, same bits. Figures, not
/// checks: the device is shared.
pub fn matmuls(gpu: &Gpu, r: &mut Rng) {
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
        let q41 = blocks(r, QuantKind::Q4_1, rows * cols / 32);
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
}

/// Attention kernel time for a prefill of one sequence (the `small`
/// preset's 9/3 heads × 64 and the `8b` preset's 32/8 × 128, pages of 16):
/// each kernel that serves it, per launch (one layer) and over the
/// preset's layers.
pub fn attention_prefill(gpu: &Gpu, r: &mut Rng, rep: &mut Report) {
    let big = AttnShape {
        n_heads: 32,
        n_kv_heads: 8,
        head_dim: 128,
    };
    for (shape, layers) in [(smollm2_attn(), 30usize), (big, 32)] {
        attention_prefill_shape(gpu, r, rep, &shape, layers);
    }
}

fn attention_prefill_shape(
    gpu: &Gpu,
    r: &mut Rng,
    rep: &mut Report,
    shape: &AttnShape,
    layers: usize,
) {
    let shape = *shape;
    println!(
        "attention kernel time per launch (one layer of a prefill, {}/{} heads × {}, pages of 16, 20 launches):",
        shape.n_heads, shape.n_kv_heads, shape.head_dim
    );
    for &len in &[512usize, 2048] {
        let (kb, vb) = kv_blocks(r, len, shape.kv_dim());
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
        for (label, kernel) in attn_kernels(&shape) {
            if kernel == AttnKernel::Decode || kernel == AttnKernel::Split {
                continue;
            }
            let mut out = vec![f32::NAN; len * shape.q_dim()];
            let t = gpu
                .attention_resident_timed(&tasks, &shape, 0.125, None, 16, kernel, &mut out, 20)
                .unwrap_or_else(|e| panic!("timing {label}: {e}"));
            // The kernels give one set of bits; a timing of wrong output
            // would be no figure at all.
            match &first {
                None => first = Some(out),
                Some(f) => rep.case(
                    format!(
                        "{label} prefill {len} tokens, head_dim {} (timed) against attention_paged",
                        shape.head_dim
                    ),
                    diff(f, &out),
                    f.len(),
                ),
            }
            line += &format!(
                " {label} {:>8.1} µs ({:>6.2} ms for {layers} layers);",
                t * 1e6,
                layers as f64 * t * 1e3
            );
        }
        println!("{line}");
    }
}

/// Decode attention per launch: one token (9 blocks, batch 1) and 8
/// tokens of 8 sequences (72 blocks) at 64 and 512 positions, each
/// kernel that serves decode; the outputs held to attention_paged's.
pub fn attention_decode(gpu: &Gpu, r: &mut Rng, rep: &mut Report) {
    let shape = smollm2_attn();
    println!(
        "attention kernel time per launch (decode, 9/3 heads × 64, pages of 16, 50 launches):"
    );
    for &(tokens, len) in &[(1usize, 64usize), (8, 64), (1, 512), (8, 512)] {
        with_decode_tasks(r, &shape, tokens, len, |tasks| {
            let mut first: Option<Vec<f32>> = None;
            let mut line = format!("  batch {tokens}, {len:>3} positions:");
            for (label, kernel) in attn_kernels(&shape) {
                if kernel.is_prefill() {
                    continue;
                }
                let mut out = vec![f32::NAN; tokens * shape.q_dim()];
                let t = gpu
                    .attention_resident_timed(tasks, &shape, 0.125, None, 16, kernel, &mut out, 50)
                    .unwrap_or_else(|e| panic!("timing {label}: {e}"));
                match &first {
                None => first = Some(out),
                Some(f) => rep.case(
                    format!("{label} decode, batch {tokens}, {len} positions (timed) against attention_paged"),
                    diff(f, &out),
                    f.len(),
                ),
            }
                line += &format!(" {label} {:>6.1} µs;", t * 1e6);
            }
            println!("{line}");
        });
    }
}

/// The canonical FP32 GEMM at the `8b` preset's shapes (bf16 weights, a
/// prefill of 512 tokens): `matmul_gemm_wide`'s time per launch, its rate
/// and its share of the device's FP32 FMA rate (`fma_peak`, same run).
pub fn gemm_8b(gpu: &Gpu, r: &mut Rng) {
    let peak = gpu.fma_peak(5).unwrap_or_else(|e| panic!("fma_peak: {e}"));
    println!(
        "canonical gemm at the 8b shapes (bf16 weights, 512 tokens, median of 5 × 3 launches; FP32 FMA rate {:.1} TFLOP/s):",
        peak / 1e12
    );
    let n = 512usize;
    for &(rows, cols, what) in &[
        (6144usize, 4096usize, "qkv"),
        (28672, 4096, "gate+up"),
        (4096, 14336, "down"),
    ] {
        let x = r.uniform_vec(n * cols, 2.0);
        let w: Vec<u16> = r
            .uniform_vec(rows * cols, 0.05)
            .iter()
            .map(|v| (v.to_bits() >> 16) as u16)
            .collect();
        let m = Matrix::new(Weights::Bf16(&w), rows, cols).expect("shape");
        let mut y = vec![f32::NAN; n * rows];
        let mut t: Vec<f64> = (0..5)
            .map(|_| {
                gpu.matmul_with(MatmulKernel::GemmWide, &x, n, &m, &mut y, 3)
                    .unwrap_or_else(|e| panic!("timing matmul_gemm_wide: {e}"))
                    / 3.0
            })
            .collect();
        t.sort_by(f64::total_cmp);
        let rate = 2.0 * (n * rows * cols) as f64 / t[2];
        println!(
            "  {what:<8} {rows:>5} × {cols:>5}: matmul_gemm_wide {:>8.1} µs ({:>5.2} TFLOP/s, {:>4.1}% of the FMA rate)",
            t[2] * 1e6,
            rate / 1e12,
            100.0 * rate / peak
        );
    }
}

/// Decode attention at long contexts on the `8b` preset's shape (32/8
/// heads × 128, and `small`'s 9/3 × 64; pages of 16), one layer:
/// `attention_decode` (a block per (token, head)) against the split over
/// the KV length, from 512 to 32,768 positions, beside the floor of reading the K/V rows
/// once at the device's copy bandwidth (same run); the two kernels' outputs
/// held to each other's bits.
pub fn attention_long(gpu: &Gpu, r: &mut Rng, rep: &mut Report) {
    let shape = |n_heads, n_kv_heads, head_dim| AttnShape {
        n_heads,
        n_kv_heads,
        head_dim,
    };
    let bw = gpu
        .copy_bandwidth(1 << 30, 5)
        .unwrap_or_else(|e| panic!("copy_bandwidth: {e}"));
    println!(
        "decode attention at long contexts (pages of 16, one layer, 10 launches; copy bandwidth {:.0} GB/s):",
        bw / 1e9
    );
    // The 8B shape from 512 positions (where the split starts to pay) to
    // 32k; `small`'s (9/3 heads × 64) at the batches its resident steps
    // take the split at (up to attn_decode_max = 132 blocks: 14 tokens).
    let runs: [(AttnShape, &[(usize, usize)]); 2] = [
        (
            shape(32, 8, 128),
            &[
                (1, 512),
                (1, 1024),
                (1, 2048),
                (1, 4096),
                (4, 4096),
                (1, 32768),
                (4, 32768),
            ],
        ),
        (
            shape(9, 3, 64),
            &[(1, 1024), (1, 4096), (8, 1024), (8, 4096)],
        ),
    ];
    for (shape, lens) in runs {
        let name = format!(
            "{}/{} × {}",
            shape.n_heads, shape.n_kv_heads, shape.head_dim
        );
        for &(tokens, len) in lens {
            with_decode_tasks(r, &shape, tokens, len, |tasks| {
                let floor = (tokens * len * 2 * shape.kv_dim() * 4) as f64 / bw;
                let mut first: Option<Vec<f32>> = None;
                let mut line = format!(
                    "  {name}, batch {tokens}, {len:>5} positions (K/V read floor {:>7.1} µs):",
                    floor * 1e6
                );
                for (label, kernel) in [
                    ("attention_decode", AttnKernel::Decode),
                    ("attention_split", AttnKernel::Split),
                ] {
                    let mut out = vec![f32::NAN; tokens * shape.q_dim()];
                    let t = gpu
                        .attention_resident_timed(
                            tasks, &shape, 0.088, None, 16, kernel, &mut out, 10,
                        )
                        .unwrap_or_else(|e| panic!("timing {label}: {e}"));
                    match &first {
                        None => first = Some(out),
                        Some(f) => rep.case(
                            format!("{label} decode, batch {tokens}, {len} positions, {name} (timed) against attention_decode"),
                            diff(f, &out),
                            f.len(),
                        ),
                    }
                    line += &format!(
                        " {label} {:>8.1} µs ({:>5.2}× the floor);",
                        t * 1e6,
                        t / floor
                    );
                }
                println!("{line}");
            });
        }
    }
}
