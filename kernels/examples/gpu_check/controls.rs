//! The negative controls: the CUDA source with one canonical-order detail
//! broken (or multiply-add contraction allowed), each compiled and opened,
//! the control cases run on it. Each control must make the case of the
//! kernel it names differ from the CPU (any case, for the control that only
//! changes the compile options); one that does not is a blind spot of the
//! check, reported and failing the run at the end.

use lmrr_kernels::cuda::resident::{NormKernel, Tuning};
use lmrr_kernels::cuda::split::MultiKernel;
use lmrr_kernels::cuda::{
    compile_many, negative_controls, Control, Gpu, MatmulKernel, ANY_CASE, CONTROL_CASES,
};
use lmrr_kernels::*;

use crate::util::*;

/// The controls `GPU_CHECK_CONTROLS` selects, each compiled, opened and
/// checked; returns the labels of those the check could not see. Exits 1
/// when the controls cannot be made, 2 when no device can be opened.
pub fn run() -> Vec<&'static str> {
    let controls = selected();
    // Every control's source compiled first, on the machine's cores at once
    // (each is a whole-module NVRTC compile), then
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
                if !seen(&g, label, kernel) {
                    blind.push(label);
                }
            }
            Err(e) => {
                eprintln!("SKIPPED: no device: {e}");
                std::process::exit(2);
            }
        }
    }
    blind
}

/// The negative controls, narrowed by `GPU_CHECK_CONTROLS`.
fn selected() -> Vec<Control> {
    let controls = match negative_controls() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    };
    // GPU_CHECK_CONTROLS: only the controls whose label holds one of these
    // comma-separated words ("none": none), for a run that must fit a device
    // budget (each control is a whole-module compile; `run` compiles them on
    // every core at once); unset: all.
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
    controls
}

/// Runs the control cases on `gpu` (a control's build) and prints what
/// differs: whether the case of `kernel` (the one the control breaks) does.
fn seen(gpu: &Gpu, label: &str, kernel: &str) -> bool {
    let per_op = control(gpu);
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
    }
    named > 0
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
    let mut out = matmuls(gpu, &th, &x, &wf, &q41, (rows, cols, n));
    out.extend(multi(gpu, &th, &mut r, &x, &wf, (rows, cols, n)));
    let (fused, cpu_rope, _) = decode_rope(gpu, &mut r, &[5, 64, 100], None);
    out.push(("attention_decode_rope_qs", fused));
    out.push(("rope_kv", cpu_rope));
    out.extend(norms_and_attention(gpu, &th, &mut r, &x));
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

/// The control cases of the single-matrix matmul kernels, over an f32 and
/// a Q4_1 matrix of `rows × cols`, `n` tokens.
fn matmuls(
    gpu: &Gpu,
    th: &Threads,
    x: &[f32],
    wf: &[f32],
    q41: &[u8],
    (rows, cols, n): (usize, usize, usize),
) -> Vec<(&'static str, usize)> {
    let mut out = Vec::new();
    let (mut mm, mut warp, mut tile, mut rowsk, mut rows4, mut gemm) = (0, 0, 0, 0, 0, 0);
    for w in [Weights::F32(wf), Weights::Quant(QuantKind::Q4_1, q41)] {
        let m = Matrix::new(w, rows, cols).expect("shape");
        let (mut cpu, mut dev) = (vec![0.0; n * rows], vec![0.0; n * rows]);
        matmul(th, x, n, &m, &mut cpu);
        gpu.matmul_with(MatmulKernel::Thread, x, n, &m, &mut dev, 1)
            .expect("gpu matmul");
        mm += diff(&cpu, &dev);
        gpu.matmul_with(MatmulKernel::Warp, x, n, &m, &mut dev, 1)
            .expect("gpu matmul_warp");
        warp += diff(&cpu, &dev);
        gpu.matmul_with(MatmulKernel::Tile, x, n, &m, &mut dev, 1)
            .expect("gpu matmul_tile");
        tile += diff(&cpu, &dev);
        gpu.matmul_with(MatmulKernel::Rows, x, n, &m, &mut dev, 1)
            .expect("gpu matmul_rows");
        rowsk += diff(&cpu, &dev);
        gpu.matmul_with(MatmulKernel::Rows4, x, n, &m, &mut dev, 1)
            .expect("gpu matmul_rows4");
        rows4 += diff(&cpu, &dev);
        gpu.matmul_with(MatmulKernel::Gemm, x, n, &m, &mut dev, 1)
            .expect("gpu matmul_gemm");
        gemm += diff(&cpu, &dev);
        for k in [
            MatmulKernel::GemmSplit(1),
            MatmulKernel::GemmWide,
            MatmulKernel::GemmWideSplit(2),
        ] {
            gpu.matmul_with(k, x, n, &m, &mut dev, 1)
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
    out
}

/// The one-launch matmul cases: two matrices of other row counts (q, k;
/// gate, up), the gemm whole and split.
fn multi(
    gpu: &Gpu,
    th: &Threads,
    r: &mut Rng,
    x: &[f32],
    wf: &[f32],
    (rows, cols, n): (usize, usize, usize),
) -> Vec<(&'static str, usize)> {
    let mut out = Vec::new();
    {
        // One launch over two matrices of other row counts (q, k; gate, up),
        // the gemm whole and split.
        let w2 = r.uniform_vec(32 * cols, 0.5);
        let m1 = Matrix::new(Weights::F32(wf), rows, cols).expect("shape");
        let m2 = Matrix::new(Weights::F32(&w2), 32, cols).expect("shape");
        let mut want = Vec::new();
        for m in [&m1, &m2] {
            let mut cpu = vec![0.0; n * m.rows];
            matmul(th, x, n, m, &mut cpu);
            want.push(cpu);
        }
        for (label, k) in [
            ("matmul_gemm_multi", MultiKernel::Gemm),
            ("matmul_gemm_multi split", MultiKernel::GemmSplit),
        ] {
            let got = gpu
                .multi_resident(k, x, n, &[&m1, &m2])
                .expect("gpu one-launch matmuls");
            out.push((label, diff(&want[0], &got[0]) + diff(&want[1], &got[1])));
        }
    }
    out
}

/// The control cases of the norms and the attention kernels.
fn norms_and_attention(
    gpu: &Gpu,
    th: &Threads,
    r: &mut Rng,
    x: &[f32],
) -> Vec<(&'static str, usize)> {
    let cols = 576;
    let mut out = Vec::new();
    let w = r.uniform_vec(cols, 1.5);
    let (mut cpu, mut dev) = (vec![0.0; x.len()], vec![0.0; x.len()]);
    rms_norm(x, &w, 1e-5, &mut cpu);
    gpu.rms_norm(x, &w, 1e-5, &mut dev).expect("gpu rms_norm");
    out.push(("rms_norm", diff(&cpu, &dev)));
    for (label, kernel) in [
        ("rms_norm_warp", NormKernel::Warp),
        ("norm_block", NormKernel::Block),
        ("norm_reg", NormKernel::Reg),
        ("norm_reg_lf", NormKernel::RegLf),
    ] {
        gpu.rms_norm_resident(x, None, &w, 1e-5, kernel, &mut dev)
            .expect(label);
        out.push((label, diff(&cpu, &dev)));
    }
    // Every attention kernel at head_dim 64, then the one compiled for 128.
    for hd in [64, 128] {
        let shape = AttnShape {
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: hd,
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
        attention(th, &tasks, &shape, 0.125, &mut cpu);
        for (label, kernel) in
            attn_kernels(&shape).filter(|(_, k)| hd == 64 || k.fixed_head_dim().is_some())
        {
            gpu.attention_resident(&tasks, &shape, 0.125, None, 16, kernel, &mut dev)
                .expect(label);
            out.push((label, diff(&cpu, &dev)));
        }
    }
    out
}
