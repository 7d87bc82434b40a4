//! Each rank's slice of the weights, cut at load as a GPU rank would hold
//! it: whole output rows of a column-parallel matrix in their stored form
//! (rows are contiguous in every storage), input columns of a row-parallel
//! one — in their stored form where the cut falls on the storage's blocks,
//! else widened to f32, which is exact, so the slice's values are the
//! matrix's (the kernels' invariant: every storage of the same values gives
//! the same bits).
//!
//! A rank reads a sharded matrix only through its [`RankWeights`]; asking
//! for a slice the plan did not give it is an error, not a fallback to the
//! whole matrix.

use std::collections::HashMap;

use lmrr_kernels::{Matrix, QuantKind, Weights};

use super::plan::{Cut, Plan};
use crate::model::exec::program::{Mat, Tables};

/// A slice of a matrix, owned by one rank.
pub struct Slice {
    w: Owned,
    rows: usize,
    cols: usize,
}

enum Owned {
    F32(Vec<f32>),
    Bf16(Vec<u16>),
    Quant(QuantKind, Vec<u8>),
}

impl Slice {
    /// The slice as a kernel matrix.
    pub fn matrix(&self) -> Option<Matrix<'_>> {
        let w = match &self.w {
            Owned::F32(v) => Weights::F32(v),
            Owned::Bf16(v) => Weights::Bf16(v),
            Owned::Quant(k, v) => Weights::Quant(*k, v),
        };
        Matrix::new(w, self.rows, self.cols)
    }

    /// Rows `[a, b)` of `m`, in its storage.
    pub fn rows(m: &Matrix, a: usize, b: usize) -> Self {
        let c = m.cols;
        let w = match m.w {
            Weights::F32(s) => Owned::F32(s[a * c..b * c].to_vec()),
            Weights::Bf16(s) => Owned::Bf16(s[a * c..b * c].to_vec()),
            Weights::Quant(k, s) => {
                let rb = k.row_bytes(c);
                Owned::Quant(k, s[a * rb..b * rb].to_vec())
            }
        };
        Self {
            w,
            rows: b - a,
            cols: c,
        }
    }

    /// Columns `[a, b)` of every row of `m`: in its storage where `a` and
    /// `b` fall on its blocks, else widened exactly to f32.
    pub fn cols(m: &Matrix, a: usize, b: usize) -> Self {
        let (r, c) = (m.rows, m.cols);
        let w = match m.w {
            Weights::F32(s) => Owned::F32(
                (0..r)
                    .flat_map(|o| s[o * c + a..o * c + b].to_vec())
                    .collect(),
            ),
            Weights::Bf16(s) => Owned::Bf16(
                (0..r)
                    .flat_map(|o| s[o * c + a..o * c + b].to_vec())
                    .collect(),
            ),
            Weights::Quant(k, s)
                if a.is_multiple_of(k.block_weights()) && b.is_multiple_of(k.block_weights()) =>
            {
                let (rb, bw, bb) = (k.row_bytes(c), k.block_weights(), k.block_bytes());
                let (x, y) = (a / bw * bb, b / bw * bb);
                Owned::Quant(
                    k,
                    (0..r)
                        .flat_map(|o| s[o * rb + x..o * rb + y].to_vec())
                        .collect(),
                )
            }
            Weights::Quant(..) => {
                let mut row = vec![0.0; c];
                let mut out = Vec::with_capacity(r * (b - a));
                for o in 0..r {
                    m.row_into(o, &mut row, true);
                    out.extend_from_slice(&row[a..b]);
                }
                Owned::F32(out)
            }
        };
        Self {
            w,
            rows: r,
            cols: b - a,
        }
    }
}

/// One rank's slices of the sharded matrices.
#[derive(Default)]
pub struct RankWeights {
    slices: HashMap<(u32, Cut), Slice>,
}

impl RankWeights {
    /// Rank `rank`'s slices under `plan`, cut from `tables`.
    pub fn load(plan: &Plan, tables: &Tables, rank: usize) -> Self {
        let mut slices = HashMap::new();
        for (m, cuts) in &plan.cuts {
            let cut = cuts[rank];
            let whole = tables.mats[m.0 as usize].matrix();
            let s = match cut {
                Cut::Rows(a, b) => Slice::rows(&whole, a, b),
                Cut::Cols(a, b) => Slice::cols(&whole, a, b),
            };
            slices.insert((m.0, cut), s);
        }
        Self { slices }
    }

    /// The slice `cut` of `m`, if this rank holds it.
    pub fn get(&self, m: Mat, cut: Cut) -> Option<&Slice> {
        self.slices.get(&(m.0, cut))
    }

    /// Bytes the rank holds in slices.
    pub fn bytes(&self) -> usize {
        self.slices
            .values()
            .map(|s| match &s.w {
                Owned::F32(v) => v.len() * 4,
                Owned::Bf16(v) => v.len() * 2,
                Owned::Quant(_, v) => v.len(),
            })
            .sum()
    }
}
