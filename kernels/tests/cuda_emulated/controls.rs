//! The negative controls: the tests can fail. Each control is the CUDA
//! source with one detail broken (an order of a sum, a rounding, an index,
//! or contraction allowed); its emulation, built and run as the tests'
//! own, must give other bits than the reference on a small case of the
//! kernel it breaks. The device source's controls are
//! `cuda_source::negative_controls` (shared with `gpu_check`); the
//! program-op kernels' are this file's own.

use std::path::PathBuf;

use crate::attention::decode_rope_inputs;
use crate::harness::*;
use crate::program_ops::*;
use lmrr_kernels::*;

/// The device-source kernels' tests (matmul.rs, norm.rs, attention.rs) can
/// fail: every negative control that breaks one of the kernels they run (its source built and run the same way) gives other bits
/// on a small case of that kernel. Contraction (`fmad=true` on the device)
/// is played by the host compiler's own (`-ffp-contract=fast -mfma`).
#[test]
fn the_emulation_sees_each_broken_kernel() {
    if !have_gxx() {
        return;
    }
    let th = Threads::new(2).expect("threads");
    let mut r = SplitMix64(9);
    // One small case per kernel family, with its CPU answer.
    let (rows, cols, n) = (40usize, 1088usize, 20usize);
    let x = r.uniform_vec(n * cols, 2.0);
    let wf = r.uniform_vec(rows * cols, 0.5);
    let m = Matrix::new(Weights::F32(&wf), rows, cols).expect("shape");
    let mut mm_cpu = vec![0.0; n * rows];
    matmul(&th, &x, n, &m, &mut mm_cpu);
    let (dn, nr) = (1100usize, 2usize);
    let nx = r.uniform_vec(nr * dn, 3.0);
    let nw = r.uniform_vec(dn, 1.5);
    let mut norm_cpu = vec![0.0; nx.len()];
    rms_norm(&nx, &nw, 1e-5, &mut norm_cpu);
    // Scores of one size (keys small): many p of a tile alike, so that the
    // order of their sum shows.
    let shape = AttnShape {
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: 64,
    };
    let pos = 100usize;
    let k = r.uniform_vec((pos + 1) * 128, 0.3);
    let v = r.uniform_vec((pos + 1) * 128, 1.0);
    let view = KvView {
        block_len: pos + 1,
        k: vec![&k],
        v: vec![&v],
    };
    let q = r.uniform_vec(256, 2.0);
    let mut at_cpu = vec![0.0; 256];
    attention(
        &th,
        &[AttnTask {
            q: &q,
            kv: &view,
            pos,
        }],
        &shape,
        0.125,
        &mut at_cpu,
    );
    let store: Vec<f32> = [k.as_slice(), v.as_slice()].concat();
    // Folded sums: partials of 3 chunks read by the norms, swiglu_split and
    // add_rows (CPU: the chunk-order sum, then the op).
    let (fr, fd, fc) = (2usize, 130usize, 3usize);
    let fx = r.uniform_vec(fr * fd, 3.0);
    let fp = r.uniform_vec(fc * fr * fd, 1.0);
    let fnw = r.uniform_vec(fd, 1.5);
    let fy = chunk_sums(&fp, fc, fr * fd);
    let fsum: Vec<f32> = fx.iter().zip(&fy).map(|(a, b)| a + b).collect();
    let mut fnorm = vec![0.0; fsum.len()];
    rms_norm(&fsum, &fnw, 1e-5, &mut fnorm);
    let mut fsw = vec![0.0; fsum.len()];
    swiglu(&fy, &fy, &mut fsw);
    let folded_cpu = [&fnorm, &fsum, &fnorm, &fsum, &fsw, &fsum];
    // Two matrices of x in one matmul_gemm_multi launch (the first split).
    let w2 = r.uniform_vec(70 * cols, 0.5);
    let m2 = Matrix::new(Weights::F32(&w2), 70, cols).expect("shape");
    let mut multi_cpu = vec![0.0; n * 70];
    matmul(&th, &x, n, &m2, &mut multi_cpu);
    // A decode step through attention_decode_rope_qs against rope_kv then
    // attention_decode (the job runs both).
    let (rope_line, rope_arrays) = decode_rope_inputs(&mut r, 9, 3, 64, 16, &[5, 64, 100]);
    let rope_refs: Vec<&[u8]> = rope_arrays.iter().map(|a| a.as_slice()).collect();
    let controls = lmrr_kernels::cuda_source::negative_controls().unwrap_or_else(|e| panic!("{e}"));
    let mut seen = 0;
    for (i, c) in controls.iter().enumerate() {
        // Controls of kernels these tests do not run (the one-thread
        // references' lane tree, the mini-v4 ops, sigmoid) are gpu_check's.
        let what = c.label;
        let ours = [
            "matmul_warp",
            "matmul_tile",
            "matmul_rows",
            "matmul_gemm",
            "matmul_gemm_multi",
            "attention_paged",
            "attention_decode",
            "attention_prefill",
            "attention_decode_rope_qs",
            "attention_split",
            "norm_block",
            "norm_reg",
            "fmad",
        ]
        .iter()
        .any(|p| what.contains(p));
        if !ours {
            continue;
        }
        let bin = build(&format!("control_{i}"), &c.source, c.fmad);
        let mut d = 0;
        for kernel in [
            "warp",
            "tile",
            "rows",
            "rows4",
            "gemm",
            "gemm_split1",
            "gemm_wide",
        ] {
            let out = job_on(
                &bin,
                &format!("matmul {kernel} 0 {n} {rows} {cols}"),
                &[&bytes(&x), &bytes(&wf)],
            );
            d += differing(&mm_cpu, &floats(&out[0]));
        }
        for kernel in ["warp", "block", "reg"] {
            let out = job_on(
                &bin,
                &format!("norm {kernel} {nr} {dn} 0 {}", 1e-5f32.to_bits()),
                &[&bytes(&nx), &bytes(&nx), &bytes(&nw)],
            );
            d += differing(&norm_cpu, &floats(&out[0]));
        }
        {
            let out = job_on(
                &bin,
                &format!("split_consumers {fr} {fd} {fc} {}", 1e-5f32.to_bits()),
                &[
                    &bytes(&fx),
                    &bytes(&fp),
                    &bytes(&fnw),
                    &bytes(&fp),
                    &bytes(&fp),
                ],
            );
            for (want, got) in folded_cpu.iter().zip(&out) {
                d += differing(want, &floats(got));
            }
            let out = job_on(
                &bin,
                &format!("gemm_multi 0 {n} {cols} {rows} 70 0 2 0 0"),
                &[&bytes(&x), &bytes(&wf), &bytes(&w2), &[]],
            );
            d += differing(&mm_cpu, &floats(&out[0])) + differing(&multi_cpu, &floats(&out[1]));
        }
        for decode in [0, 1, 2, 3, 7] {
            let out = job_on(
                &bin,
                &format!(
                    "attention 1 4 2 64 {} {} {decode}",
                    pos + 1,
                    0.125f32.to_bits()
                ),
                &[
                    &bytes(&q),
                    &bytes(&store),
                    &bytes64(&[0]),
                    &bytes64(&[0]),
                    &bytes64(&[pos as u64]),
                ],
            );
            d += differing(&at_cpu, &floats(&out[0]));
        }
        {
            let out = job_on(&bin, &rope_line, &rope_refs);
            for i in 0..4 {
                d += differing(&floats(&out[i]), &floats(&out[4 + i]));
            }
        }
        println!("negative control `{what}`: {d} differing bits");
        assert!(
            d > 0,
            "control `{what}`: the emulated kernels give the CPU's bits anyway"
        );
        seen += 1;
    }
    assert!(seen >= 8, "{seen} controls run");
}

/// The program-op tests (program_ops.rs) can fail: each mutation below breaks one
/// detail of one program-op kernel (the rounding of an operation, the
/// order or start of a sum, an index), and the check of that kernel, run
/// on the mutated source's emulation, must find differing values. These
/// controls are the emulation's own: `gpu_check`'s control run
/// (`cuda_source::negative_controls`) does not cover these kernels.
#[test]
fn the_emulation_sees_each_broken_program_op() {
    if !have_gxx() {
        return;
    }
    type Check = fn(&PathBuf) -> Found;
    let controls: &[(&str, &str, &str, Check)] = &[
        (
            "geglu: a·x²·x + x as mul + add, not fmaf",
            "float v = fmaf(a * (x * x), x, x);",
            "float v = a * (x * x) * x + x;",
            geglu_check,
        ),
        (
            "round_bf16: ties away from zero",
            "((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16)",
            "((b + 0x8000u) >> 16)",
            round_bf16_check,
        ),
        (
            "round_bf16: a NaN's quiet bit not set",
            "((b >> 16) | 0x40u)",
            "(b >> 16)",
            round_bf16_check,
        ),
        (
            "stream_mean: the sum starts from the first stream",
            "float acc = 0.0f;\n    for (int j = 0; j < s; ++j) acc = acc + x[(t * s + j) * d + c];",
            "float acc = x[t * s * d + c];\n    for (int j = 1; j < s; ++j) acc = acc + x[(t * s + j) * d + c];",
            stream_mean_check,
        ),
        (
            "moe_combine_idx: mul + add, not fmaf",
            "acc = fmaf(gates[e], ys[(long long)idx[e] * d + c], acc);",
            "acc = gates[e] * ys[(long long)idx[e] * d + c] + acc;",
            moe_combine_idx_check,
        ),
        (
            "kv_write_aux: slots kvd floats apart",
            "+ (long long)slot[t] * aux;",
            "+ (long long)slot[t] * kvd;",
            kv_write_aux_check,
        ),
        (
            "add_bias: the bias of the next column",
            "y[i] = y[i] + b[i % cols];",
            "y[i] = y[i] + b[(i + 1) % cols];",
            add_scale_repeat_check,
        ),
        (
            "scale_elems: divided by the reciprocal",
            "x[i] = x[i] * by;",
            "x[i] = x[i] / (1.0f / by);",
            add_scale_repeat_check,
        ),
        (
            "repeat_rows: each repeat shifted by one column",
            "out[idx] = x[t * d + c % d];",
            "out[idx] = x[t * d + (c + 1) % d];",
            add_scale_repeat_check,
        ),
    ];
    let source = lmrr_kernels::cuda_source::SOURCE;
    for (i, &(label, from, to, check)) in controls.iter().enumerate() {
        assert_eq!(
            source.matches(from).count(),
            1,
            "control `{label}`: its target is not once in the CUDA source"
        );
        let bin = build(&format!("op_control_{i}"), &source.replace(from, to), false);
        let d: usize = check(&bin).iter().map(|(_, d)| d).sum();
        println!("negative control `{label}`: {d} differing values");
        assert!(
            d > 0,
            "control `{label}`: the emulated kernel gives the reference's bits anyway"
        );
    }
}
