//! Chunk partials of a matmul, and their sum in chunk order: the two halves
//! of [`crate::matmul`] that a split of the reduction axis puts on different
//! workers (tensor-parallel ranks, `engine`'s rank simulator).
//!
//! `matmul_partials` writes, per token `t`, output row `o` and chunk `c` of
//! the matrix's `cols`, the canonical partial of that chunk: the [`LANES`]
//! FMA chains from `+0.0` joined by [`crate::lane_tree`]. `sum_partials` adds
//! a list of partials sequentially from `+0.0`. Invariant: for any matrix,
//! `sum_partials` over every chunk of a row, in chunk order, is the bits of
//! [`crate::matmul`]'s output (the same adds in the same order), and the
//! partials of a matrix cut into column slices on [`CHUNK`] boundaries are
//! the partials of the whole one, slice by slice. A partial is never `-0.0`
//! (each lane starts at `+0.0` and stays off `-0.0`), so the one-chunk
//! canonical dot `0.0 + partial` is the partial itself: the fast form uses
//! [`crate::dot`] on one chunk.

use crate::matmul::Matrix;
use crate::{CHUNK, LANES};

/// Chunks of a reduction of `cols` elements.
pub fn chunks_of(cols: usize) -> usize {
    cols.div_ceil(CHUNK)
}

fn check(x: &[f32], n: usize, w: &Matrix, out: &[f32]) {
    assert_eq!(x.len(), n * w.cols, "matmul_partials: x is not (n, cols)");
    assert_eq!(
        out.len(),
        n * w.rows * chunks_of(w.cols),
        "matmul_partials: out is not (n, rows, chunks)"
    );
}

/// Scalar reference: `out[(t·rows + o)·chunks + c]` is chunk `c`'s partial of
/// `dot(x[t], W[o])`.
pub fn matmul_partials_ref(x: &[f32], n: usize, w: &Matrix, out: &mut [f32]) {
    check(x, n, w, out);
    let nc = chunks_of(w.cols);
    for o in 0..w.rows {
        let row = w.row_f32(o);
        for t in 0..n {
            let xt = &x[t * w.cols..(t + 1) * w.cols];
            for (c, (cx, cw)) in xt.chunks(CHUNK).zip(row.chunks(CHUNK)).enumerate() {
                let mut lanes = [0.0f32; LANES];
                for (i, (&a, &b)) in cx.iter().zip(cw).enumerate() {
                    lanes[i % LANES] = a.mul_add(b, lanes[i % LANES]);
                }
                out[(t * w.rows + o) * nc + c] = crate::lane_tree(&lanes);
            }
        }
    }
}

/// Fast [`matmul_partials_ref`], bitwise equal to it: each row widened once
/// (SIMD dequantization), each chunk one canonical [`crate::dot`].
pub fn matmul_partials(x: &[f32], n: usize, w: &Matrix, out: &mut [f32]) {
    check(x, n, w, out);
    let nc = chunks_of(w.cols);
    let mut row = vec![0.0f32; w.cols];
    for o in 0..w.rows {
        w.row_into(o, &mut row, true);
        for t in 0..n {
            let xt = &x[t * w.cols..(t + 1) * w.cols];
            for (c, (cx, cw)) in xt.chunks(CHUNK).zip(row.chunks(CHUNK)).enumerate() {
                out[(t * w.rows + o) * nc + c] = crate::dot(cx, cw);
            }
        }
    }
}

/// The partials added sequentially, in the order given, from `+0.0`: the
/// chunk sum of every canonical reduction.
pub fn sum_partials(partials: impl IntoIterator<Item = f32>) -> f32 {
    let mut total = 0.0f32;
    for p in partials {
        total += p;
    }
    total
}
