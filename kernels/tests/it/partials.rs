//! Chunk partials (`matmul_partials`) and their sum in chunk order
//! (`sum_partials`) against the canonical matmul, bit for bit, for every
//! weight storage: what lets a tensor-parallel rank compute a slice of the
//! reduction and another add the partials without changing a bit.

use lmrr_kernels::partials::chunks_of;
use lmrr_kernels::*;

use super::quant::realistic;

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn bf16_round(x: f32) -> u16 {
    let b = x.to_bits();
    ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) as u16
}

/// `sum_partials` of each output's partials in chunk order, `(n, rows)`.
fn summed(p: &[f32], n: usize, rows: usize, nc: usize) -> Vec<f32> {
    (0..n * rows)
        .map(|i| sum_partials(p[i * nc..(i + 1) * nc].iter().copied()))
        .collect()
}

/// Checks one matrix: fast partials ≡ reference partials, and their sum in
/// chunk order ≡ the canonical matmul.
fn check(x: &[f32], n: usize, m: &Matrix, what: &str) {
    let nc = chunks_of(m.cols);
    let mut want = vec![0.0; n * m.rows];
    matmul_ref(x, n, m, &mut want);
    let mut pr = vec![f32::NAN; n * m.rows * nc];
    matmul_partials_ref(x, n, m, &mut pr);
    let mut pf = vec![f32::NAN; n * m.rows * nc];
    matmul_partials(x, n, m, &mut pf);
    assert_eq!(bits(&pf), bits(&pr), "{what}: fast partials");
    assert_eq!(
        bits(&summed(&pr, n, m.rows, nc)),
        bits(&want),
        "{what}: partials summed in chunk order"
    );
}

#[test]
fn partials_summed_in_chunk_order_are_the_matmul_for_f32_and_bf16() {
    let mut r = SplitMix64(11);
    for &(rows, cols) in &[(1usize, 5usize), (7, 63), (13, 65), (9, 128), (33, 200)] {
        for &n in &[1usize, 2, 5] {
            let x = r.uniform_vec(n * cols, 2.0);
            let wf = r.uniform_vec(rows * cols, 0.5);
            let wb: Vec<u16> = wf.iter().map(|&v| bf16_round(v)).collect();
            for w in [Weights::F32(&wf), Weights::Bf16(&wb)] {
                let m = Matrix::new(w, rows, cols).unwrap();
                check(&x, n, &m, &format!("rows={rows} cols={cols} n={n}"));
            }
        }
    }
}

#[test]
fn partials_summed_in_chunk_order_are_the_matmul_for_every_block_format() {
    let mut r = SplitMix64(12);
    for kind in QuantKind::ALL {
        let cols = 2 * kind.block_weights().max(64) + kind.block_weights();
        let rows = 5;
        let q = realistic(&mut r, kind, rows * cols / kind.block_weights());
        let m = Matrix::new(Weights::Quant(kind, &q), rows, cols).unwrap();
        for n in [1usize, 3] {
            let x = r.uniform_vec(n * cols, 2.0);
            check(&x, n, &m, &format!("{kind:?} n={n}"));
        }
    }
}

#[test]
fn a_column_slice_on_chunk_boundaries_has_the_whole_matrix_partials() {
    let mut r = SplitMix64(13);
    let (rows, cols, n) = (6usize, 64 * 5 + 17, 3usize);
    let x = r.uniform_vec(n * cols, 2.0);
    let w = r.uniform_vec(rows * cols, 0.5);
    let whole = Matrix::new(Weights::F32(&w), rows, cols).unwrap();
    let nc = chunks_of(cols);
    let mut pw = vec![0.0; n * rows * nc];
    matmul_partials(&x, n, &whole, &mut pw);
    // Slices [0, 128), [128, 192), [192, cols): chunks 0-1, 2, 3-5.
    for (a, b) in [(0usize, 128usize), (128, 192), (192, cols)] {
        let ws: Vec<f32> = (0..rows)
            .flat_map(|o| w[o * cols + a..o * cols + b].to_vec())
            .collect();
        let xs: Vec<f32> = (0..n)
            .flat_map(|t| x[t * cols + a..t * cols + b].to_vec())
            .collect();
        let m = Matrix::new(Weights::F32(&ws), rows, b - a).unwrap();
        let snc = chunks_of(b - a);
        let mut ps = vec![0.0; n * rows * snc];
        matmul_partials(&xs, n, &m, &mut ps);
        for i in 0..n * rows {
            for c in 0..snc {
                assert_eq!(
                    ps[i * snc + c].to_bits(),
                    pw[i * nc + a / 64 + c].to_bits(),
                    "slice [{a}, {b}) output {i} chunk {c}"
                );
            }
        }
    }
}

#[test]
fn partials_summed_out_of_chunk_order_differ_from_the_matmul() {
    // The order is observable: the same partials added last chunk first do
    // not give the matmul's bits for some output, so a test of chunk order
    // can fail.
    let mut r = SplitMix64(14);
    let (rows, cols, n) = (64usize, 64 * 8, 2usize);
    let x = r.uniform_vec(n * cols, 2.0);
    let w = r.uniform_vec(rows * cols, 0.5);
    let m = Matrix::new(Weights::F32(&w), rows, cols).unwrap();
    let nc = chunks_of(cols);
    let mut p = vec![0.0; n * rows * nc];
    matmul_partials(&x, n, &m, &mut p);
    let mut want = vec![0.0; n * rows];
    matmul_ref(&x, n, &m, &mut want);
    let reversed: Vec<f32> = (0..n * rows)
        .map(|i| sum_partials(p[i * nc..(i + 1) * nc].iter().rev().copied()))
        .collect();
    assert_ne!(bits(&reversed), bits(&want));
}
