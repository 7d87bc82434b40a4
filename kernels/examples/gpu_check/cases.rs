//! The comparisons: each op of the CUDA mirror against the CPU fast path,
//! one function per op family, in the order `main` runs them (they share
//! one random stream, so the order fixes every operand). Each case reports
//! its differing bits through [`Report::case`].

use lmrr_kernels::cuda::resident::{AttnKernel, NormKernel};
use lmrr_kernels::cuda::split::MultiKernel;
use lmrr_kernels::cuda::{Gpu, MatmulKernel};
use lmrr_kernels::*;

use crate::report::Report;
use crate::util::*;

/// Matmul over every storage and every kernel, decode and prefill shapes,
/// SmolLM2's too.
pub fn matmuls(gpu: &Gpu, th: &Threads, r: &mut Rng, rep: &mut Report) {
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
        let q40 = blocks(r, QuantKind::Q4_0, rows * cols / 32);
        let q41 = blocks(r, QuantKind::Q4_1, rows * cols / 32);
        let q80 = blocks(r, QuantKind::Q8_0, rows * cols / 32);
        let q4k = blocks(r, QuantKind::Q4K, rows * cols / 256);
        let q6k = blocks(r, QuantKind::Q6K, rows * cols / 256);
        let mut storages = vec![("f32", Weights::F32(&wf)), ("bf16", Weights::Bf16(&wb))];
        // Quantized rows are whole 32-value blocks: a ragged width (100,
        // 1000: the gemm tiles' edges) is covered by f32 and bf16 only.
        if cols % 32 == 0 {
            storages.push(("Q4_0", Weights::Quant(QuantKind::Q4_0, &q40)));
            storages.push(("Q4_1", Weights::Quant(QuantKind::Q4_1, &q41)));
            storages.push(("Q8_0", Weights::Quant(QuantKind::Q8_0, &q80)));
        }
        // Q4_K and Q6_K rows are whole super-blocks of 256.
        if cols % 256 == 0 {
            storages.push(("Q4_K", Weights::Quant(QuantKind::Q4K, &q4k)));
            storages.push(("Q6_K", Weights::Quant(QuantKind::Q6K, &q6k)));
        }
        for (label, w) in storages {
            let m = Matrix::new(w, rows, cols).expect("shape");
            let mut cpu = vec![0.0; n * rows];
            matmul(th, &x, n, &m, &mut cpu);
            let mut dev = vec![f32::NAN; n * rows];
            gpu.matmul_with(MatmulKernel::Thread, &x, n, &m, &mut dev, 1)
                .expect("gpu matmul");
            rep.case(
                format!("matmul {label} {n}×{cols} · {cols}×{rows}"),
                diff(&cpu, &dev),
                cpu.len(),
            );
            let mut warp = vec![f32::NAN; n * rows];
            gpu.matmul_with(MatmulKernel::Warp, &x, n, &m, &mut warp, 1)
                .expect("gpu matmul_warp");
            rep.case(
                format!("matmul_warp {label} {n}×{cols} · {cols}×{rows}"),
                diff(&cpu, &warp),
                cpu.len(),
            );
            let mut tile = vec![f32::NAN; n * rows];
            gpu.matmul_with(MatmulKernel::Tile, &x, n, &m, &mut tile, 1)
                .expect("gpu matmul_tile");
            rep.case(
                format!("matmul_tile {label} {n}×{cols} · {cols}×{rows}"),
                diff(&cpu, &tile),
                cpu.len(),
            );
            let mut rk = vec![f32::NAN; n * rows];
            gpu.matmul_with(MatmulKernel::Rows, &x, n, &m, &mut rk, 1)
                .expect("gpu matmul_rows");
            rep.case(
                format!("matmul_rows {label} {n}×{cols} · {cols}×{rows}"),
                diff(&cpu, &rk),
                cpu.len(),
            );
            if cols.div_ceil(64) <= lmrr_kernels::cuda::resident::MR4_MAX_CHUNKS {
                let mut r4 = vec![f32::NAN; n * rows];
                gpu.matmul_with(MatmulKernel::Rows4, &x, n, &m, &mut r4, 1)
                    .expect("gpu matmul_rows4");
                rep.case(
                    format!("matmul_rows4 {label} {n}×{cols} · {cols}×{rows}"),
                    diff(&cpu, &r4),
                    cpu.len(),
                );
            }
            let mut gm = vec![f32::NAN; n * rows];
            gpu.matmul_with(MatmulKernel::Gemm, &x, n, &m, &mut gm, 1)
                .expect("gpu matmul_gemm");
            rep.case(
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
                rep.case(
                    format!("{what} {label} {n}×{cols} · {cols}×{rows}"),
                    diff(&cpu, &gs),
                    cpu.len(),
                );
            }
        }
    }
}

/// Up to three matmuls of one input in one launch (q/k/v, gate/up; o and
/// down alone), each matrix's output against the CPU's matmul: the
/// decode kernel (matmul_multi) and the gemm's one-launch
/// form, whole and split (its partials summed).
pub fn multi(gpu: &Gpu, th: &Threads, r: &mut Rng, rep: &mut Report) {
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
            .map(|&o| blocks(r, QuantKind::Q4_1, o * cols / 32))
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
                    matmul(th, &x, n, m, &mut cpu);
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
                rep.case(
                    format!("{kname} {label} {n}×{cols} · {cols}×{rows:?}"),
                    d,
                    total,
                );
            }
        }
    }
}

/// Empty batches (a prefill chunk that wants no logits) are no-ops.
pub fn empty(gpu: &Gpu, r: &mut Rng, rep: &mut Report) {
    let wf = r.uniform_vec(8 * 64, 1.0);
    let m = Matrix::new(Weights::F32(&wf), 8, 64).expect("shape");
    let empty_ok = gpu.matmul(&[], 0, &m, &mut []).is_ok()
        && gpu.rms_norm(&[], &wf[..64], 1e-5, &mut []).is_ok()
        && gpu.swiglu(&[], &[], &mut []).is_ok();
    rep.case(
        "empty matmul / rms_norm / swiglu are no-ops".into(),
        usize::from(!empty_ok),
        0,
    );
}

/// RMSNorm: the reference kernel and the resident ones, alone and after
/// the residual add.
pub fn norms(gpu: &Gpu, r: &mut Rng, rep: &mut Report) {
    for &(rows, d) in &[(1usize, 576usize), (5, 100), (3, 1536), (2, 7)] {
        let x = r.uniform_vec(rows * d, 3.0);
        let w = r.uniform_vec(d, 1.5);
        let mut cpu = vec![0.0; x.len()];
        rms_norm(&x, &w, 1e-5, &mut cpu);
        let mut dev = vec![0.0; x.len()];
        gpu.rms_norm(&x, &w, 1e-5, &mut dev).expect("gpu rms_norm");
        rep.case(format!("rms_norm {rows}×{d}"), diff(&cpu, &dev), cpu.len());
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
            rep.case(format!("{label} {rows}×{d}"), diff(&cpu, &got), cpu.len());
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
            rep.case(
                format!("{label} {rows}×{d} (sum and norm)"),
                diff(&sum_cpu, &sum) + diff(&cpu2, &dev2),
                2 * cpu.len(),
            );
        }
    }
}

/// A decode step's RoPE, page writes and attention in one launch
/// (attention_decode_rope_qs) against rope_kv then attention: tokens at
/// positions inside a first page, on a page edge and past several pages.
/// The rotated q and K rows of both against the CPU's rope. Then under
/// sliding windows: one that cuts a tile, one of a whole tile, one of one
/// position (each token's walk starts elsewhere, and with ATTN_EARLY its
/// first batch's pages are loaded from there).
pub fn decode_rope_steps(gpu: &Gpu, r: &mut Rng, rep: &mut Report) {
    let cases: [(&[usize], Option<usize>); 6] = [
        (&[0], None),
        (&[5, 64, 100], None),
        (&[15, 16, 17, 300], None),
        (&[5, 64, 100, 300], Some(20)),
        (&[31, 32, 200], Some(32)),
        (&[0, 17, 300], Some(1)),
    ];
    for (positions, window) in cases {
        let (d, cpu, count) = decode_rope(gpu, r, positions, window);
        let w = window.map_or(String::new(), |w| format!(", window {w}"));
        rep.case(
            format!(
                "attention_decode_rope_qs at positions {positions:?}{w} against rope_kv + attention"
            ),
            d,
            count,
        );
        rep.case(
            format!("rope_kv and attention_decode_rope_qs at positions {positions:?}{w}: q, K rows against the CPU's rope"),
            cpu,
            4 * positions.len() * 12 * 64,
        );
    }
}

/// det_exp over a wide range and the special values.
pub fn det_exp(gpu: &Gpu, r: &mut Rng, rep: &mut Report) {
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
    rep.case(
        "det_exp: [-100, 100), specials, random bit patterns".into(),
        diff(&cpu, &dev),
        cpu.len(),
    );
}

/// SwiGLU.
pub fn swiglu_long(gpu: &Gpu, r: &mut Rng, rep: &mut Report) {
    let g = r.uniform_vec(100_003, 12.0);
    let u = r.uniform_vec(100_003, 4.0);
    let mut cpu = vec![0.0; g.len()];
    swiglu(&g, &u, &mut cpu);
    let mut dev = vec![0.0; g.len()];
    gpu.swiglu(&g, &u, &mut dev).expect("gpu swiglu");
    rep.case("swiglu 100003".into(), diff(&cpu, &dev), cpu.len());
}

/// RoPE at several positions (SmolLM2: head_dim 64, theta 1e5).
pub fn rope_positions(gpu: &Gpu, r: &mut Rng, rep: &mut Report) {
    let table = RopeTable::new(64, 100_000.0, 8192);
    for pos in [0usize, 1, 17, 511, 8191] {
        let x0 = r.uniform_vec(9 * 64, 2.0);
        let mut cpu = x0.clone();
        rope(&table, &mut cpu, pos);
        let mut dev = x0.clone();
        gpu.rope(&table, &mut dev, pos).expect("gpu rope");
        rep.case(
            format!("rope 9 heads × 64 at position {pos}"),
            diff(&cpu, &dev),
            cpu.len(),
        );
    }
}

/// Random K/V in blocks up to the largest of `positions` and a random query
/// at each position: `f` gets the attention tasks.
fn with_attn_tasks(
    r: &mut Rng,
    shape: &AttnShape,
    positions: &[usize],
    f: impl FnOnce(&[AttnTask]),
) {
    let cap = positions.iter().max().map_or(1, |m| m + 1);
    let (kb, vb) = kv_blocks(r, cap, shape.kv_dim());
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
    f(&tasks)
}

/// Attention: GQA 9/3 × 64 (SmolLM2), positions across tile boundaries,
/// KV in paged blocks of 16 positions, several tasks at once.
pub fn attention_gqa(gpu: &Gpu, th: &Threads, r: &mut Rng, rep: &mut Report) {
    let shape = smollm2_attn();
    // The last: a prefill's 80 tokens of one sequence (attention_prefill's
    // groups of 16, the second 40 past a super-chunk of 2,048 positions).
    let prefill: Vec<usize> = (0..40).chain(2030..2070).collect();
    for &positions in &[
        &[0usize][..],
        &[31, 32, 33],
        &[5, 100, 511, 64],
        &prefill[..],
    ] {
        with_attn_tasks(r, &shape, positions, |tasks| {
            let mut cpu = vec![0.0; tasks.len() * shape.q_dim()];
            attention(th, tasks, &shape, 0.125, &mut cpu);
            let mut dev = vec![0.0; cpu.len()];
            gpu.attention(tasks, &shape, 0.125, &mut dev)
                .expect("gpu attention");
            rep.case(
                format!("attention 9/3 heads × 64, positions {positions:?}"),
                diff(&cpu, &dev),
                cpu.len(),
            );
            for page_len in [1usize, 7, 16, 64] {
                for (label, kernel) in attn_kernels(&shape) {
                    let mut paged = vec![f32::NAN; cpu.len()];
                    gpu.attention_resident(
                        tasks, &shape, 0.125, None, page_len, kernel, &mut paged,
                    )
                    .expect(label);
                    rep.case(
                        format!("{label} pages of {page_len}, positions {positions:?}"),
                        diff(&cpu, &paged),
                        cpu.len(),
                    );
                }
            }
        });
    }
}

/// Paged attention with head_dim 128 and 256 (two chunks and more per
/// score) and MHA.
pub fn attention_wide(gpu: &Gpu, th: &Threads, r: &mut Rng, rep: &mut Report) {
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
        attention(th, &tasks, &shape, 0.088, &mut cpu);
        for (label, kernel) in attn_kernels(&shape) {
            if kernel == AttnKernel::Prefill && hd > lmrr_kernels::cuda::resident::PF_MAXHD {
                continue;
            }
            let mut paged = vec![f32::NAN; cpu.len()];
            gpu.attention_resident(&tasks, &shape, 0.088, None, 16, kernel, &mut paged)
                .expect(label);
            rep.case(
                format!("{label} {nh}/{nkv} heads × {hd}, position {pos}"),
                diff(&cpu, &paged),
                cpu.len(),
            );
        }
    }
}

/// Sliding-window attention (`attention_window`) by the one-thread kernel
/// and every paged kernel: windows that cut the first tile mid-tile, that
/// are one tile, one position, or wider than the context; one decode token
/// and a prefill's tokens of one sequence (attention_prefill's groups).
pub fn attention_window(gpu: &Gpu, th: &Threads, r: &mut Rng, rep: &mut Report) {
    let shape = smollm2_attn();
    let prefill: Vec<usize> = (0..40).chain(90..130).collect();
    for &(positions, window) in &[
        (&[100usize][..], 20usize),
        (&[100], 32),
        (&[100], 1),
        (&[100], 500),
        (&prefill[..], 20),
        (&prefill[..], 64),
        (&prefill[..], 1),
    ] {
        with_attn_tasks(r, &shape, positions, |tasks| {
            let mut cpu = vec![0.0; tasks.len() * shape.q_dim()];
            lmrr_kernels::attention_window(th, tasks, &shape, 0.125, Some(window), &mut cpu);
            let what = format!(
                "{} tokens to position {}, window {window}",
                tasks.len(),
                positions.iter().max().unwrap_or(&0)
            );
            let mut dev = vec![0.0; cpu.len()];
            gpu.attention_window(tasks, &shape, 0.125, Some(window), &mut dev)
                .expect("gpu attention_window");
            rep.case(format!("attention, {what}"), diff(&cpu, &dev), cpu.len());
            for page_len in [7usize, 16] {
                for (label, kernel) in attn_kernels(&shape) {
                    let mut paged = vec![f32::NAN; cpu.len()];
                    gpu.attention_resident(
                        tasks,
                        &shape,
                        0.125,
                        Some(window),
                        page_len,
                        kernel,
                        &mut paged,
                    )
                    .expect(label);
                    rep.case(
                        format!("{label} pages of {page_len}, {what}"),
                        diff(&cpu, &paged),
                        cpu.len(),
                    );
                }
            }
        });
    }
}

/// mini-v4: hyper-connection coefficients (sigmoid + Sinkhorn) over odd
/// stream counts, zero and many rounds; the stream mixes with d not a
/// multiple of 8; the expert combine; indexer scores with dims over 64.
pub fn hyper_mixes(gpu: &Gpu, r: &mut Rng, rep: &mut Report) {
    for &(n, h, d, iters) in &[
        (1usize, 1usize, 7usize, 20usize),
        (37, 3, 100, 20),
        (5, 4, 128, 0),
        (5, 4, 128, 1),
        (13, 5, 13, 7),
        (3, 4, 512, 20),
    ] {
        let hy = Hyper::new(r, n, h, d);
        let (c, g) = hy.coeffs(gpu, iters);
        for (name, (a, b)) in ["pre", "post", "res"].iter().zip(c.iter().zip(&g)) {
            rep.case(
                format!("hc_coeffs {n} tokens, h {h}, {iters} Sinkhorn rounds: {name}"),
                diff(a, b),
                a.len(),
            );
        }
        let [(c1, g1), (c2, g2)] = hy.mixes(gpu, &c);
        rep.case(
            format!("hc_pre {n} tokens, h {h}, d {d}"),
            diff(&c1, &g1),
            c1.len(),
        );
        rep.case(
            format!("hc_post {n} tokens, h {h}, d {d}"),
            diff(&c2, &g2),
            c2.len(),
        );
    }
}

/// Sigmoid and Sinkhorn on special and large values: NaN, ±inf, ±1e30,
/// ±f32::MAX, around det_exp's cut-offs, -0, subnormals, random bits.
pub fn hyper_specials(gpu: &Gpu, r: &mut Rng, rep: &mut Report) {
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
        rep.case(
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
    rep.case(
        format!(
            "sigmoid [-100, 100) + specials (pre, 2·post; {} payload-only)",
            p1 + p2
        ),
        d1 + d2 + diff(&c[2], &g[2]),
        2 * n1 + n1,
    );
}

/// The expert combine of one token, then of several tokens in one launch
/// with different expert counts.
pub fn moe_combines(gpu: &Gpu, r: &mut Rng, rep: &mut Report) {
    for &(k, d) in &[(0usize, 100usize), (1, 7), (2, 100), (6, 512), (3, 1)] {
        let (c, g) = combine(gpu, r, k, d);
        rep.case(
            format!("moe_combine {k} experts × {d}"),
            diff(&c, &g),
            c.len(),
        );
    }
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
    rep.case(
        "moe_combine 4 tokens × 77 in one launch (2, 0, 5, 1 experts)".into(),
        diff(&cpu, &dev),
        cpu.len(),
    );
}

/// Indexer scores with dims over 64 and keys of several scales.
pub fn indexer_scores(gpu: &Gpu, r: &mut Rng, rep: &mut Report) {
    for &(heads, dim, m, ks) in &[
        (1usize, 7usize, 5usize, 1.0f32),
        (2, 16, 16, 1.0),
        (3, 100, 37, 3.0),
        (4, 64, 64, 1.0),
        (4, 130, 33, 1e20),
        (5, 200, 129, 0.01),
    ] {
        let (c, g) = scores(gpu, r, heads, dim, m, ks);
        rep.case(
            format!("index_scores {heads} heads × {dim}, {m} keys (scale {ks:e})"),
            diff(&c, &g),
            c.len(),
        );
    }
}
