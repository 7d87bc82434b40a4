//! The vectors `tc_probe` runs through the tensor cores, and the tally of a
//! model against what the hardware returned.
//!
//! A [`Tile`] is one `m16n8k16` instruction's operands: `A` (16 × 16, row
//! `i` holds output row `i`'s 16 values), `B` (8 columns of 16, column `j`
//! contiguous) and the addends `C` (16 × 8); all 128 outputs
//! `D[i][j] = C[i][j] + Σₖ A[i][k]·B[j][k]` are inner products to check.
//! Tiles come in [`Class`]es, each aimed at one feature of the design
//! (alignment, cancellation, the addend's weight, subnormals, the range's
//! ends, specials), drawn from a seeded stream so that the CPU regenerates
//! exactly what the GPU ran. [`crafted`] adds named distinguishing vectors.

use super::{mma_dot, TcModel, MMA_K};
use crate::splitmix::SplitMix64;

/// Outputs of one instruction.
pub const OUTPUTS: usize = 16 * 8;

/// One instruction's operands (bf16 as bits).
#[derive(Debug, Clone)]
pub struct Tile {
    pub a: [u16; 16 * MMA_K],
    pub b: [u16; 8 * MMA_K],
    pub c: [f32; OUTPUTS],
}

impl Tile {
    fn zero() -> Self {
        Self {
            a: [0; 16 * MMA_K],
            b: [0; 8 * MMA_K],
            c: [0.0; OUTPUTS],
        }
    }

    /// Output `o` (row-major over 16 × 8) under model `m`.
    pub fn model(&self, m: &TcModel, o: usize) -> f32 {
        let (i, j) = (o / 8, o % 8);
        mma_dot(
            m,
            self.c[o],
            &self.a[i * MMA_K..(i + 1) * MMA_K],
            &self.b[j * MMA_K..(j + 1) * MMA_K],
        )
    }
}

/// What a class of random tiles aims at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// Values near 1: the common case.
    Normal,
    /// Exponents over ±30 (addends ±60): long alignment shifts.
    Wide,
    /// Products that cancel in pairs, some off by one ulp: sums far below
    /// their terms, where normalisation and cut bits show.
    Cancel,
    /// bf16 and f32 subnormals, and products in f32's subnormal range.
    Subnormal,
    /// Exponents at both ends of the range: overflow, and huge beside tiny.
    Extreme,
    /// Zeros of both signs, infinities and NaNs among ordinary values.
    Specials,
}

impl Class {
    pub const ALL: [Class; 6] = [
        Class::Normal,
        Class::Wide,
        Class::Cancel,
        Class::Subnormal,
        Class::Extreme,
        Class::Specials,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Class::Normal => "normal",
            Class::Wide => "wide exponents",
            Class::Cancel => "cancellation",
            Class::Subnormal => "subnormals",
            Class::Extreme => "extreme exponents",
            Class::Specials => "zeros, inf, NaN",
        }
    }
}

/// A bf16 of random sign and mantissa, exponent uniform in `[lo, hi]`
/// (clamped to the normal range).
fn bf16_exp(r: &mut SplitMix64, lo: i32, hi: i32) -> u16 {
    let x = r.next_u64();
    let e = lo + (x % (hi - lo + 1) as u64) as i32;
    let e = e.clamp(-126, 127);
    let sign = ((x >> 32) & 1) as u16;
    let mant = ((x >> 40) & 0x7f) as u16;
    (sign << 15) | (((e + 127) as u16) << 7) | mant
}

/// An f32 likewise.
fn f32_exp(r: &mut SplitMix64, lo: i32, hi: i32) -> f32 {
    let x = r.next_u64();
    let e = (lo + (x % (hi - lo + 1) as u64) as i32).clamp(-126, 127);
    let sign = ((x >> 32) & 1) as u32;
    let mant = ((x >> 33) & 0x7f_ffff) as u32;
    f32::from_bits((sign << 31) | (((e + 127) as u32) << 23) | mant)
}

/// A bf16 subnormal (nonzero mantissa) of random sign.
fn bf16_sub(r: &mut SplitMix64) -> u16 {
    let x = r.next_u64();
    (((x >> 8) & 1) as u16) << 15 | ((x % 127) as u16 + 1)
}

/// The `bf16` next to `b` away from zero (one ulp more in magnitude).
fn ulp_up(b: u16) -> u16 {
    if b & 0x7f80 == 0x7f00 && b & 0x7f == 0x7f {
        b
    } else {
        b + 1
    }
}

fn chance(r: &mut SplitMix64, num: u64, den: u64) -> bool {
    r.next_u64() % den < num
}

/// One random tile of `class`.
pub fn tile(class: Class, r: &mut SplitMix64) -> Tile {
    let mut t = Tile::zero();
    match class {
        Class::Normal => {
            t.a.iter_mut().for_each(|v| *v = bf16_exp(r, -3, 3));
            t.b.iter_mut().for_each(|v| *v = bf16_exp(r, -3, 3));
            for c in t.c.iter_mut() {
                *c = if chance(r, 1, 8) {
                    0.0
                } else {
                    f32_exp(r, -3, 6)
                };
            }
        }
        Class::Wide => {
            for v in t.a.iter_mut().chain(t.b.iter_mut()) {
                *v = if chance(r, 1, 10) {
                    0
                } else {
                    bf16_exp(r, -30, 30)
                };
            }
            t.c.iter_mut().for_each(|c| *c = f32_exp(r, -60, 60));
        }
        Class::Cancel => {
            // Row i: a[k + 8] = a[k]; column j: b[k + 8] = -b[k], one time in
            // four an ulp larger, so that products cancel pair by pair and
            // leave residues at scattered scales.
            for i in 0..16 {
                for k in 0..8 {
                    let v = bf16_exp(r, -2, 2);
                    t.a[i * MMA_K + k] = v;
                    t.a[i * MMA_K + k + 8] = v;
                }
            }
            for j in 0..8 {
                for k in 0..8 {
                    let v = bf16_exp(r, -2, 2);
                    let neg = v ^ 0x8000;
                    t.b[j * MMA_K + k] = v;
                    t.b[j * MMA_K + k + 8] = if chance(r, 1, 4) { ulp_up(neg) } else { neg };
                }
            }
            for c in t.c.iter_mut() {
                *c = match r.next_u64() % 3 {
                    0 => 0.0,
                    1 => f32_exp(r, -24, -8),
                    _ => f32_exp(r, -2, 4),
                };
            }
        }
        Class::Subnormal => {
            for v in t.a.iter_mut() {
                *v = if chance(r, 1, 2) {
                    bf16_sub(r)
                } else {
                    bf16_exp(r, -126, -100)
                };
            }
            for v in t.b.iter_mut() {
                *v = if chance(r, 1, 4) {
                    bf16_sub(r)
                } else {
                    bf16_exp(r, -30, 10)
                };
            }
            for c in t.c.iter_mut() {
                *c = match r.next_u64() % 3 {
                    0 => f32::from_bits(
                        ((r.next_u64() & 1) as u32) << 31
                            | (r.next_u64() as u32 & 0x7f_ffff).max(1),
                    ),
                    1 => f32_exp(r, -126, -110),
                    _ => 0.0,
                };
            }
        }
        Class::Extreme => {
            for v in t.a.iter_mut().chain(t.b.iter_mut()) {
                *v = if chance(r, 1, 2) {
                    bf16_exp(r, 50, 127)
                } else {
                    bf16_exp(r, -126, -60)
                };
            }
            for c in t.c.iter_mut() {
                *c = if chance(r, 1, 2) {
                    f32_exp(r, 100, 127)
                } else {
                    f32_exp(r, -126, 127)
                };
            }
        }
        Class::Specials => {
            const B: [u16; 6] = [0x0000, 0x8000, 0x7f80, 0xff80, 0x7fc0, 0x3f80];
            for v in t.a.iter_mut().chain(t.b.iter_mut()) {
                *v = if chance(r, 1, 12) {
                    B[(r.next_u64() % 6) as usize]
                } else {
                    bf16_exp(r, -4, 4)
                };
            }
            const C: [f32; 4] = [0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY];
            for c in t.c.iter_mut() {
                *c = match r.next_u64() % 8 {
                    k @ 0..=3 => C[k as usize],
                    4 => f32::NAN,
                    _ => f32_exp(r, -4, 4),
                };
            }
        }
    }
    t
}

/// `n` tiles of `class` from `seed` (the same on every machine).
pub fn tiles(class: Class, seed: u64, n: usize) -> Vec<Tile> {
    let mut r = SplitMix64(seed ^ (class as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    (0..n).map(|_| tile(class, &mut r)).collect()
}

/// A named distinguishing vector: `c + Σ a[k]·b[k]` with the pairs given
/// (the rest of the instruction's 16 are zero).
#[derive(Debug, Clone)]
pub struct Crafted {
    pub name: &'static str,
    pub c: f32,
    pub pairs: Vec<(f32, f32)>,
}

/// Vectors each of which separates two neighbouring designs (the test that
/// reads them names which).
pub fn crafted() -> Vec<Crafted> {
    let p = |e: i32| 2f32.powi(e);
    let v = |name, c, pairs: &[(f32, f32)]| Crafted {
        name,
        c,
        pairs: pairs.to_vec(),
    };
    vec![
        v(
            "1 + 2^-24 + 2^-24 (bits below 2^-23)",
            1.0,
            &[(p(-12), p(-12)), (p(-12), p(-12))],
        ),
        v(
            "1 + 2^-25 ×4 (bits below 2^-24)",
            1.0,
            &[(p(-12), p(-13)); 4],
        ),
        v(
            "1 + 2^-26 ×8 (bits below 2^-25)",
            1.0,
            &[(p(-13), p(-13)); 8],
        ),
        v(
            "1 + 1.5·2^-23 (rounding of a tie)",
            1.0,
            &[(p(-12), 3.0 * p(-12))],
        ),
        v(
            "1 + 1.75·2^-23 (rounding above half)",
            1.0,
            &[(p(-11), 1.75 * p(-12))],
        ),
        v(
            "-1 - 1.75·2^-23 (rounding, negative)",
            -1.0,
            &[(-p(-11), 1.75 * p(-12))],
        ),
        v("2^-24 after 1 - 1 in the first 8 (step size)", 0.0, &{
            let mut s = vec![(1.0, 1.0), (1.0, -1.0)];
            s.resize(8, (0.0, 0.0));
            s.push((p(-12), p(-12)));
            s
        }),
        v(
            "c = 2^-24 with products 1 - 1 (addend aligned)",
            p(-24),
            &[(1.0, 1.0), (1.0, -1.0)],
        ),
        v("2^127 + 2^127 (overflow)", p(127), &[(p(127), 1.0)]),
        v("2^-70 · 2^-70 (subnormal result)", 0.0, &[(p(-70), p(-70))]),
        v(
            "bf16 subnormal × 2 (subnormal input)",
            0.0,
            &[(f32::from_bits(0x0001_0000), 2.0)],
        ),
        v("c subnormal (f32) alone", f32::from_bits(1), &[]),
        v(
            "-0 + 16 × (-0·1) (sign of zero; all designs agree)",
            -0.0,
            &[(-0.0, 1.0); MMA_K],
        ),
    ]
}

impl Crafted {
    /// As a tile: the vector in row 0 and column 0 (output 0), zeros
    /// elsewhere.
    pub fn tile(&self) -> Tile {
        let mut t = Tile::zero();
        for (k, &(x, y)) in self.pairs.iter().enumerate() {
            t.a[k] = super::f32_to_bf16(x);
            t.b[k] = super::f32_to_bf16(y);
        }
        t.c[0] = self.c;
        t
    }
}

/// Whether two results are the same: equal bits, or both NaN (a NaN's
/// payload is reported apart, see [`nan_payloads_differ`]).
pub fn same(model: f32, hw: f32) -> bool {
    model.to_bits() == hw.to_bits() || (model.is_nan() && hw.is_nan())
}

/// Whether the hardware's NaN is not the canonical one the model returns.
pub fn nan_payloads_differ(hw: f32) -> bool {
    hw.is_nan() && hw.to_bits() != super::CANONICAL_NAN
}

/// Mismatches of `m` over `tiles` against `hw` (128 outputs a tile), and the
/// first mismatching (tile, output) if any.
pub fn mismatches(m: &TcModel, tiles: &[Tile], hw: &[f32]) -> (usize, Option<(usize, usize)>) {
    let mut n = 0;
    let mut first = None;
    for (ti, t) in tiles.iter().enumerate() {
        for o in 0..OUTPUTS {
            if !same(t.model(m, o), hw[ti * OUTPUTS + o]) {
                n += 1;
                first.get_or_insert((ti, o));
            }
        }
    }
    (n, first)
}

#[cfg(test)]
mod tests {
    use super::super::{candidates, negative_controls, SM90_BF16};
    use super::*;

    #[test]
    fn tiles_are_reproducible_and_classes_differ() {
        for class in Class::ALL {
            let (x, y) = (tiles(class, 7, 3), tiles(class, 7, 3));
            assert_eq!(x[2].a, y[2].a);
            assert_eq!(x[2].c.map(f32::to_bits), y[2].c.map(f32::to_bits));
        }
        assert_ne!(
            tiles(Class::Normal, 7, 1)[0].a,
            tiles(Class::Wide, 7, 1)[0].a
        );
    }

    #[test]
    fn the_classes_reach_what_they_aim_at() {
        let sub = tiles(Class::Subnormal, 1, 4);
        assert!(sub
            .iter()
            .any(|t| t.a.iter().any(|&v| v & 0x7f80 == 0 && v & 0x7f != 0)));
        let ext = tiles(Class::Extreme, 1, 4);
        let m = SM90_BF16;
        assert!(ext
            .iter()
            .any(|t| (0..OUTPUTS).any(|o| t.model(&m, o).is_infinite())));
        let can = tiles(Class::Cancel, 1, 4);
        // Some sums are far smaller than their largest product.
        assert!(can.iter().any(|t| (0..OUTPUTS).any(|o| {
            let d = t.model(&m, o);
            d != 0.0 && d.abs() < 2f32.powi(-8) && t.c[o] == 0.0
        })));
    }

    #[test]
    fn every_crafted_vector_separates_some_candidates() {
        // A vector all candidates agree on teaches nothing.
        let cands = candidates();
        for v in crafted()
            .iter()
            .filter(|v| !v.name.contains("all designs agree"))
        {
            let t = v.tile();
            let first = t.model(&cands[0], 0);
            let split = cands.iter().any(|m| !same(t.model(m, 0), first));
            assert!(split, "{} does not separate any two candidates", v.name);
        }
    }

    #[test]
    fn random_tiles_separate_the_model_from_its_controls() {
        // Against the model's own outputs standing in for the hardware's,
        // each control must mismatch somewhere: the probe can see them.
        let m = SM90_BF16;
        for (name, ctl) in negative_controls(m) {
            let mut seen = false;
            for class in [Class::Normal, Class::Cancel, Class::Wide] {
                let ts = tiles(class, 11, 64);
                let hw: Vec<f32> = ts
                    .iter()
                    .flat_map(|t| (0..OUTPUTS).map(move |o| t.model(&m, o)))
                    .collect();
                assert_eq!(mismatches(&m, &ts, &hw).0, 0);
                seen |= mismatches(&ctl, &ts, &hw).0 > 0;
            }
            assert!(seen, "control '{name}' is never told from the model");
        }
    }
}
