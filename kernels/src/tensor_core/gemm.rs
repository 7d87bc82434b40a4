//! The tensor-core matmul on the CPU: `y[t][o] = x[t] · W[o]` as a GEMM of
//! `mma.sync.m16n8k16` computes it on the GPU (`kernels/cuda/tc/gemm.cu`),
//! so a CPU replays a tensor-core run bit for bit.
//!
//! Invariant: each output is [`tc_dot`] of the token's activations rounded
//! to bf16 (nearest even, [`f32_to_bf16`]) and the bf16 weight row:
//! instructions over k in order from `+0`, 16 products each, the tail
//! padded with zeros. No tiling, batch, split or thread count enters it,
//! which is why the GPU's tiles may be anything that keeps k in order.
//!
//! Under [`SM90_BF16`] the outputs come from [`super::fast`] (operands
//! decoded once, SIMD where the CPU has it), bitwise the same as the
//! general path here ([`general_matmul`], [`tc_dot`] per output), which
//! every other model takes.

use super::{f32_to_bf16, fast, tc_dot, TcModel, SM90_BF16};
use crate::threads::{SendPtr, Threads};

/// `y = x · Wᵀ` with `x` `(n, cols)` f32 and `w` `(rows, cols)` bf16 bits,
/// `y` `(n, rows)`, under model `m`. Panics if a slice's length does not
/// match the shape (the caller's shapes come from a checked model).
#[allow(clippy::too_many_arguments)]
pub fn tc_matmul(
    threads: &Threads,
    m: &TcModel,
    x: &[f32],
    n: usize,
    w: &[u16],
    rows: usize,
    cols: usize,
    y: &mut [f32],
) {
    assert_eq!(x.len(), n * cols, "tc_matmul: x is not (n, cols)");
    assert_eq!(w.len(), rows * cols, "tc_matmul: w is not (rows, cols)");
    assert_eq!(y.len(), n * rows, "tc_matmul: y is not (n, rows)");
    if n == 0 || rows == 0 {
        return;
    }
    let xb: Vec<u16> = x.iter().map(|&v| f32_to_bf16(v)).collect();
    if *m == SM90_BF16 {
        return fast::matmul(threads, &xb, n, w, rows, cols, y);
    }
    general_matmul(threads, m, &xb, n, w, rows, cols, y);
}

/// `y = x · Wᵀ` with `xb` the activations already in bf16: [`tc_dot`] per
/// output, for any model (the specification the fast path is tested
/// against).
#[allow(clippy::too_many_arguments)]
pub(super) fn general_matmul(
    threads: &Threads,
    m: &TcModel,
    xb: &[u16],
    n: usize,
    w: &[u16],
    rows: usize,
    cols: usize,
    y: &mut [f32],
) {
    let yp = SendPtr(y.as_mut_ptr());
    let grain = threads.grain(rows, 8);
    threads.for_ranges(rows, grain, |range| {
        for o in range {
            let wr = &w[o * cols..(o + 1) * cols];
            for t in 0..n {
                let v = tc_dot(m, &xb[t * cols..(t + 1) * cols], wr);
                // SAFETY: each worker owns outputs `o` of its range for every
                // token; `t * rows + o < n * rows = y.len()`.
                unsafe { *yp.get().add(t * rows + o) = v };
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::super::SM90_BF16;
    use super::*;
    use crate::splitmix::SplitMix64;

    #[test]
    fn batch_and_threads_change_no_bit() {
        let (n, rows, cols) = (5, 37, 70);
        let mut r = SplitMix64(3);
        let x = r.uniform_vec(n * cols, 2.0);
        let w: Vec<u16> = r
            .uniform_vec(rows * cols, 0.1)
            .into_iter()
            .map(f32_to_bf16)
            .collect();
        let mut all = vec![0.0; n * rows];
        tc_matmul(
            &Threads::new(3).unwrap(),
            &SM90_BF16,
            &x,
            n,
            &w,
            rows,
            cols,
            &mut all,
        );
        for t in 0..n {
            let mut one = vec![0.0; rows];
            let xt = &x[t * cols..(t + 1) * cols];
            tc_matmul(
                &Threads::single(),
                &SM90_BF16,
                xt,
                1,
                &w,
                rows,
                cols,
                &mut one,
            );
            let got: Vec<u32> = all[t * rows..(t + 1) * rows]
                .iter()
                .map(|v| v.to_bits())
                .collect();
            assert_eq!(
                got,
                one.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "token {t}"
            );
        }
    }

    #[test]
    fn close_to_the_exact_product_of_the_rounded_operands() {
        // Not a bit check (that is tc_probe's against the hardware): the
        // model's error stays within a few truncations of the f64 dot.
        let (rows, cols) = (16, 256);
        let mut r = SplitMix64(5);
        let x = r.uniform_vec(cols, 1.0);
        let w: Vec<u16> = r
            .uniform_vec(rows * cols, 1.0)
            .into_iter()
            .map(f32_to_bf16)
            .collect();
        let mut y = vec![0.0; rows];
        tc_matmul(
            &Threads::single(),
            &SM90_BF16,
            &x,
            1,
            &w,
            rows,
            cols,
            &mut y,
        );
        for o in 0..rows {
            let exact: f64 = (0..cols)
                .map(|k| {
                    let a = crate::matmul::bf16_to_f32(f32_to_bf16(x[k])) as f64;
                    a * crate::matmul::bf16_to_f32(w[o * cols + k]) as f64
                })
                .sum();
            let bound = 16.0 * 4.0 * 2f64.powi(-23) * 64.0;
            assert!(
                (y[o] as f64 - exact).abs() < bound,
                "row {o}: {} vs {exact}",
                y[o]
            );
        }
    }
}
