//! The RMSNorm kernels (`rms_norm_warp`/`add_norm`, `norm_block`,
//! `norm_reg`, `norm_reg_lf`, with and without the residual add) against
//! the CPU's norm, and the kernels that fold a split matmul's chunk sums
//! into their loads (the norms, `swiglu_split`, `add_rows`) against the
//! chunk-order sum then the op.

use crate::harness::*;
use lmrr_kernels::*;

#[test]
fn norm_kernels_match_the_cpu() {
    if emulator().is_none() {
        return;
    }
    let mut r = SplitMix64(7);
    let eps = 1e-5f32;
    for &(rows, d) in &[(3usize, 100usize), (2, 576), (1, 1100), (4, 7)] {
        let x = r.uniform_vec(rows * d, 3.0);
        let y = r.uniform_vec(rows * d, 1.0);
        let w = r.uniform_vec(d, 1.5);
        let sum: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a + b).collect();
        for add in [false, true] {
            let src = if add { &sum } else { &x };
            let mut cpu = vec![0.0; src.len()];
            rms_norm(src, &w, eps, &mut cpu);
            let variants = [
                ("warp", emulator()),
                ("block", emulator()),
                ("reg", emulator()),
                ("reg_lf", emulator()),
            ];
            for (kernel, bin) in variants {
                let Some(bin) = bin else { continue };
                let out = job_on(
                    bin,
                    &format!(
                        "norm {kernel} {rows} {d} {} {}",
                        u8::from(add),
                        eps.to_bits()
                    ),
                    &[&bytes(&x), &bytes(&y), &bytes(&w)],
                );
                let what = format!("{kernel} norm {rows}×{d}, add {add}");
                assert_eq!(differing(&cpu, &floats(&out[0])), 0, "{what}");
                assert_eq!(
                    differing(src, &floats(&out[1])),
                    0,
                    "{what}: the sum written back"
                );
            }
        }
    }
}

/// The kernels that fold a split matmul's sum into their own loads
/// (`norm_reg`, `norm_block`, `swiglu_split`, `add_rows` reading partials
/// through `split_value`) against the CPU's chunk-order sum, then its op.
#[test]
fn folded_sums_match_sum_chunks_then_the_op() {
    if emulator().is_none() {
        return;
    }
    let mut r = SplitMix64(22);
    let eps = 1e-5f32;
    for &(rows, d, chunks) in &[(3usize, 200usize, 7usize), (2, 576, 24), (1, 64, 2)] {
        let count = rows * d;
        let x = r.uniform_vec(count, 3.0);
        let part = r.uniform_vec(chunks * count, 1.0);
        let w = r.uniform_vec(d, 1.5);
        let gp = r.uniform_vec(chunks * count, 2.0);
        let up = r.uniform_vec(chunks * count, 2.0);
        let out = job(
            &format!("split_consumers {rows} {d} {chunks} {}", eps.to_bits()),
            &[
                &bytes(&x),
                &bytes(&part),
                &bytes(&w),
                &bytes(&gp),
                &bytes(&up),
            ],
        );
        let y = chunk_sums(&part, chunks, count);
        let sum: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a + b).collect();
        let mut norm = vec![0.0; count];
        rms_norm(&sum, &w, eps, &mut norm);
        let mut sw = vec![0.0; count];
        swiglu(
            &chunk_sums(&gp, chunks, count),
            &chunk_sums(&up, chunks, count),
            &mut sw,
        );
        let what = format!("{rows}×{d}, {chunks} chunks");
        for (i, (label, want)) in [
            ("norm_reg out", &norm),
            ("norm_reg x + y", &sum),
            ("norm_block out", &norm),
            ("norm_block x + y", &sum),
            ("swiglu_split", &sw),
            ("add_rows", &sum),
            ("norm_reg_lf out", &norm),
            ("norm_reg_lf x + y", &sum),
        ]
        .iter()
        .enumerate()
        {
            assert_eq!(differing(want, &floats(&out[i])), 0, "{label}, {what}");
        }
    }
}
