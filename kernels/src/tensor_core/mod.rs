//! A CPU model of the tensor core's inner product: what one
//! `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32` computes for each of
//! its outputs, `d = c + Σₖ a[k]·b[k]` over 16 bf16 pairs and an f32 addend,
//! bit for bit, so that a CPU can replay what the GPU's tensor cores did.
//!
//! The hardware is not IEEE: it does not round after each product or each
//! addition. The model ([`TcModel`]) is the family of designs described for
//! NVIDIA's matrix units (Fasi, Higham, Mikaitis and Pranesh 2021; Khattak
//! and Mikaitis 2025), with each feature a parameter:
//! - the products are exact (a bf16 product has 16 significant bits);
//! - `block` products and the running addend form one fused step; an
//!   instruction's 16 products are `16 / block` steps in k order, each step's
//!   result the next step's addend;
//! - in a step, every nonzero term (products and addend) is aligned to the
//!   largest exponent among them ([`Align`]: a product's exponent is the sum
//!   of its factors' exponent fields, though its significand may reach 4)
//!   and cut to `frac_bits` bits below it (toward zero, each term on its
//!   own): bits below that quantum never reach the adder;
//! - the cut terms are added exactly, and the sum becomes an f32 with
//!   [`Rounding`]; a result past f32's range is `overflow`'s value.
//!
//! Which parameters a given GPU has is measured, not assumed: `tc_probe`
//! (`kernels/examples/tc_probe`) runs the instruction on crafted and random
//! vectors ([`probe`]) and counts the mismatches of every candidate;
//! [`SM90_BF16`] is the one that matched everything, and the narrower or
//! round-to-nearest neighbours of it ([`negative_controls`]) must not.
//!
//! Specials follow IEEE: a NaN input, `∞·0` or `+∞ + -∞` gives NaN
//! (the canonical `0x7fff_ffff`), other infinities pass through. A sum that
//! is exactly zero is `+0`, whatever the signs of the zeros that made it
//! (the hardware does not keep IEEE's `-0 + -0 = -0`); a nonzero sum too
//! small for f32 is cut to a zero of its own sign (a case the probe's
//! crafted vectors do not pin).

mod fast;
pub mod gemm;
pub mod probe;

pub use gemm::tc_matmul;

/// The arithmetic the matmuls of a run follow, recorded in its bundle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Numerics {
    /// The canonical FMA order ([`crate::dot_ref`]) over f32 activations:
    /// every device, every ISA.
    #[default]
    Canonical,
    /// Activations rounded to bf16, bf16 weights, each output a chain of
    /// sm_90 tensor-core instructions ([`tc_dot`] under [`SM90_BF16`]): the
    /// GPU's tensor cores, or this model of them on a CPU.
    TensorCoreSm90,
}

impl Numerics {
    pub const ALL: [Numerics; 2] = [Numerics::Canonical, Numerics::TensorCoreSm90];

    /// The name bundles and the CLI use.
    pub fn name(self) -> &'static str {
        match self {
            Numerics::Canonical => "canonical",
            Numerics::TensorCoreSm90 => "tensor-core-sm90",
        }
    }

    /// The mode named `s` (see [`Numerics::name`]).
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|n| n.name() == s)
    }

    /// The tensor-core model this mode multiplies by, if any.
    pub fn model(self) -> Option<&'static TcModel> {
        match self {
            Numerics::Canonical => None,
            Numerics::TensorCoreSm90 => Some(&SM90_BF16),
        }
    }
}

impl std::fmt::Display for Numerics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// How the exact sum of a step's aligned terms becomes an f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Rounding {
    /// Cut toward zero (truncation).
    TowardZero,
    /// IEEE round to nearest, ties to even.
    NearestEven,
}

/// What a step's result is when it passes f32's largest finite value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Overflow {
    /// `±∞`.
    Infinity,
    /// `±f32::MAX` (what IEEE's round toward zero gives).
    Saturate,
}

/// What a step's terms are aligned to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Align {
    /// The largest exponent field: a bf16 product's is the sum of its
    /// factors' (a significand in `[1, 4)`), the f32 addend's its own;
    /// subnormals count as the least normal exponent.
    ExponentField,
    /// The largest leading bit.
    LeadingBit,
}

/// One tensor-core design; see the module header for what each field means.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TcModel {
    pub block: usize,
    pub align: Align,
    pub frac_bits: u32,
    pub rounding: Rounding,
    pub overflow: Overflow,
    /// bf16 subnormal inputs read as zero.
    pub flush_inputs: bool,
    /// An f32 subnormal addend reads as zero and a subnormal result is zero.
    pub flush_f32: bool,
}

/// Products in one `m16n8k16` instruction.
pub const MMA_K: usize = 16;

/// The model of sm_90's `mma.sync.m16n8k16.f32.bf16.bf16.f32`: the candidate
/// that `tc_probe` found to match the hardware on every vector it ran (see
/// docs/REFERENCE.md for the runs, per GPU).
pub const SM90_BF16: TcModel = TcModel {
    block: 16,
    align: Align::ExponentField,
    frac_bits: 25,
    rounding: Rounding::TowardZero,
    overflow: Overflow::Infinity,
    flush_inputs: false,
    flush_f32: false,
};

/// Neighbours of `m` that a faithful probe must tell from it: the same
/// design rounding the other way, with one bit less kept, aligned by the
/// other exponent, and with steps of half the products. Each is named for
/// the report.
pub fn negative_controls(m: TcModel) -> Vec<(&'static str, TcModel)> {
    let mut v = vec![
        (
            "the other rounding",
            TcModel {
                rounding: match m.rounding {
                    Rounding::TowardZero => Rounding::NearestEven,
                    Rounding::NearestEven => Rounding::TowardZero,
                },
                ..m
            },
        ),
        (
            "one alignment bit fewer",
            TcModel {
                frac_bits: m.frac_bits - 1,
                ..m
            },
        ),
    ];
    v.push((
        "aligned by the other exponent",
        TcModel {
            align: match m.align {
                Align::ExponentField => Align::LeadingBit,
                Align::LeadingBit => Align::ExponentField,
            },
            ..m
        },
    ));
    if m.block > 1 {
        v.push((
            "steps of half the products",
            TcModel {
                block: m.block / 2,
                ..m
            },
        ));
    }
    v
}

/// The designs `tc_probe` tries: steps of 4, 8 or 16 products, either
/// alignment, 22 to 28 bits kept, either rounding, either overflow, with or
/// without flushing.
pub fn candidates() -> Vec<TcModel> {
    let mut v = Vec::new();
    for (block, align) in [16, 8, 4]
        .into_iter()
        .flat_map(|b| [(b, Align::ExponentField), (b, Align::LeadingBit)])
    {
        for frac_bits in 22..=28 {
            for rounding in [Rounding::TowardZero, Rounding::NearestEven] {
                for overflow in [Overflow::Infinity, Overflow::Saturate] {
                    for (flush_inputs, flush_f32) in [(false, false), (true, false), (true, true)] {
                        v.push(TcModel {
                            block,
                            align,
                            frac_bits,
                            rounding,
                            overflow,
                            flush_inputs,
                            flush_f32,
                        });
                    }
                }
            }
        }
    }
    v
}

/// A nonzero finite term: `(-1)^neg · sig · 2^exp`, with the exponent
/// field it is aligned by under [`Align::ExponentField`].
#[derive(Debug, Clone, Copy)]
struct Term {
    neg: bool,
    sig: u64,
    exp: i32,
    field: i32,
}

impl Term {
    /// The exponent this term is aligned by.
    fn align_exp(self, align: Align) -> i32 {
        match align {
            Align::ExponentField => self.field,
            Align::LeadingBit => self.exp + 63 - self.sig.leading_zeros() as i32,
        }
    }
}

/// A bf16's significand and exponent, `None` for a zero (or a flushed
/// subnormal); the caller has removed infinities and NaNs.
fn bf16_term(b: u16, flush: bool) -> Option<Term> {
    let (e, m) = (((b >> 7) & 0xff) as i32, (b & 0x7f) as u64);
    let neg = b & 0x8000 != 0;
    match e {
        0 if m == 0 || flush => None,
        0 => Some(Term {
            neg,
            sig: m,
            exp: 1 - 127 - 7,
            field: -126,
        }),
        _ => Some(Term {
            neg,
            sig: m | 0x80,
            exp: e - 127 - 7,
            field: e - 127,
        }),
    }
}

/// An f32's significand and exponent, `None` for a zero (or a flushed
/// subnormal); finite input.
fn f32_term(x: f32, flush: bool) -> Option<Term> {
    let b = x.to_bits();
    let (e, m) = (((b >> 23) & 0xff) as i32, (b & 0x7f_ffff) as u64);
    let neg = b & 0x8000_0000 != 0;
    match e {
        0 if m == 0 || flush => None,
        0 => Some(Term {
            neg,
            sig: m,
            exp: 1 - 127 - 23,
            field: -126,
        }),
        _ => Some(Term {
            neg,
            sig: m | 0x80_0000,
            exp: e - 127 - 23,
            field: e - 127,
        }),
    }
}

fn bf16_is_special(b: u16) -> bool {
    b & 0x7f80 == 0x7f80
}

/// The canonical NaN NVIDIA's arithmetic returns.
pub const CANONICAL_NAN: u32 = 0x7fff_ffff;

/// IEEE's answer for a step that has an infinity or a NaN among its inputs.
fn special_step(c: f32, a: &[u16], b: &[u16]) -> f32 {
    let nan = f32::from_bits(CANONICAL_NAN);
    let (mut pos, mut neg) = (false, false);
    let mut note = |v: f32| {
        if v.is_nan() {
            (pos, neg) = (true, true);
        } else if v == f32::INFINITY {
            pos = true;
        } else if v == f32::NEG_INFINITY {
            neg = true;
        }
    };
    note(c);
    for (&x, &y) in a.iter().zip(b) {
        let (x, y) = (crate::matmul::bf16_to_f32(x), crate::matmul::bf16_to_f32(y));
        let special = x.is_nan() || y.is_nan() || x.is_infinite() || y.is_infinite();
        if special {
            // ∞·0 is NaN; otherwise the product is an infinity of the sign
            // of x·y (a NaN stays a NaN).
            note((x as f64 * y as f64) as f32);
        }
    }
    match (pos, neg) {
        (true, true) => nan,
        (true, false) => f32::INFINITY,
        (false, true) => f32::NEG_INFINITY,
        (false, false) => unreachable!("special_step runs only on a step with a special"),
    }
}

/// One fused step: `c + Σ a[k]·b[k]` over `a.len()` (≤ 16) pairs.
fn step(m: &TcModel, c: f32, a: &[u16], b: &[u16]) -> f32 {
    if !c.is_finite() || a.iter().chain(b).any(|&x| bf16_is_special(x)) {
        return special_step(c, a, b);
    }
    let mut terms = [Term {
        neg: false,
        sig: 0,
        exp: 0,
        field: 0,
    }; MMA_K + 1];
    let mut n = 0;
    if let Some(t) = f32_term(c, m.flush_f32) {
        terms[n] = t;
        n += 1;
    }
    for (&x, &y) in a.iter().zip(b) {
        if let (Some(p), Some(q)) = (bf16_term(x, m.flush_inputs), bf16_term(y, m.flush_inputs)) {
            terms[n] = Term {
                neg: p.neg != q.neg,
                sig: p.sig * q.sig,
                exp: p.exp + q.exp,
                field: p.field + q.field,
            };
            n += 1;
        }
    }
    let terms = &terms[..n];
    let Some(emax) = terms.iter().map(|t| t.align_exp(m.align)).max() else {
        return 0.0;
    };
    // The quantum every term is cut to: `frac_bits` below the largest
    // alignment exponent.
    let q = emax - m.frac_bits as i32;
    let mut sum: i128 = 0;
    for t in terms {
        let shift = t.exp - q;
        let v = if shift >= 0 {
            (t.sig as u128) << shift
        } else if -shift >= 64 {
            0
        } else {
            (t.sig >> -shift) as u128
        };
        sum += if t.neg { -(v as i128) } else { v as i128 };
    }
    to_f32(m, sum < 0, sum.unsigned_abs(), q)
}

/// 2^128: the least magnitude past f32's range once cut to 24 bits.
const F32_OVERFLOW: f64 = 340_282_366_920_938_463_463_374_607_431_768_211_456.0;

/// `(-1)^neg · mag · 2^q` as an f32 under `m`'s rounding and overflow.
fn to_f32(m: &TcModel, neg: bool, mag: u128, q: i32) -> f32 {
    if mag == 0 {
        return 0.0;
    }
    let len = 128 - mag.leading_zeros() as i32;
    let lead = q + len - 1;
    // Exponent of the result's last kept bit (24 bits, or fewer below
    // f32's normal range).
    let lsb = (lead - 23).max(-149);
    let kept: u128 = if lsb > q {
        let drop = (lsb - q) as u32;
        let (t, rem, half) = if drop >= 128 {
            (0, mag, None)
        } else {
            (
                mag >> drop,
                mag & ((1u128 << drop) - 1),
                Some(1u128 << (drop - 1)),
            )
        };
        match (m.rounding, half) {
            (Rounding::NearestEven, Some(h)) if rem > h || (rem == h && t & 1 == 1) => t + 1,
            _ => t,
        }
    } else {
        mag << (q - lsb)
    };
    // kept < 2^25 and lsb ≥ -149: exact in f64, then exact in f32 unless
    // past the range.
    // 2^lsb built from its bits: lsb is in f64's normal range.
    let v = kept as f64 * f64::from_bits(((lsb + 1023) as u64) << 52);
    let r = if v >= F32_OVERFLOW {
        match m.overflow {
            Overflow::Infinity => f32::INFINITY,
            Overflow::Saturate => f32::MAX,
        }
    } else if m.flush_f32 && v < f32::MIN_POSITIVE as f64 {
        0.0
    } else {
        v as f32
    };
    if neg {
        -r
    } else {
        r
    }
}

/// [`step`] for [`SM90_BF16`] over one whole instruction, specialised:
/// integer decoding, one pass, no term list (the CPU replay's hot loop).
/// `None` where an input is an infinity or a NaN (the general step answers).
/// Bitwise equal to `step(&SM90_BF16, ..)` (tested on every probe class).
fn sm90_step(c: f32, a: &[u16], b: &[u16]) -> Option<f32> {
    // Exponent fields (biased; a subnormal's is 1), significands, signs.
    let cb = c.to_bits();
    let ce = ((cb >> 23) & 0xff) as i32;
    if ce == 0xff {
        return None;
    }
    let csig = (cb & 0x7f_ffff) as i64 | if ce != 0 { 0x80_0000 } else { 0 };
    let cfield = ce.max(1) - 127;
    let mut sigs = [0i64; MMA_K];
    let mut fields = [i32::MIN; MMA_K];
    let mut emax = if csig != 0 { cfield } else { i32::MIN };
    for k in 0..MMA_K {
        let (x, y) = (a[k], b[k]);
        let (ex, ey) = (((x >> 7) & 0xff) as i32, ((y >> 7) & 0xff) as i32);
        if ex == 0xff || ey == 0xff {
            return None;
        }
        let sx = (x & 0x7f) as i64 | if ex != 0 { 0x80 } else { 0 };
        let sy = (y & 0x7f) as i64 | if ey != 0 { 0x80 } else { 0 };
        let p = sx * sy;
        if p != 0 {
            let f = ex.max(1) + ey.max(1) - 254;
            sigs[k] = if (x ^ y) & 0x8000 != 0 { -p } else { p };
            fields[k] = f;
            emax = emax.max(f);
        }
    }
    if emax == i32::MIN {
        return Some(0.0);
    }
    let frac = SM90_BF16.frac_bits as i32;
    // Each term cut toward zero to the quantum 2^(emax - frac): a product
    // sig·2^(field - 14), the addend csig·2^(cfield - 23).
    let cut = |sig: i64, shift: i32| -> i64 {
        if shift >= 0 {
            sig << shift
        } else if shift <= -63 {
            0
        } else {
            let m = sig.unsigned_abs() >> -shift;
            if sig < 0 {
                -(m as i64)
            } else {
                m as i64
            }
        }
    };
    let mut sum = 0i64;
    if csig != 0 {
        let s = if cb & 0x8000_0000 != 0 { -csig } else { csig };
        sum += cut(s, cfield - 23 - (emax - frac));
    }
    for k in 0..MMA_K {
        if sigs[k] != 0 {
            sum += cut(sigs[k], fields[k] - 14 - (emax - frac));
        }
    }
    Some(to_f32(
        &SM90_BF16,
        sum < 0,
        sum.unsigned_abs() as u128,
        emax - frac,
    ))
}

/// One instruction's output: `c + Σ a[k]·b[k]` over [`MMA_K`] pairs, in
/// `m.block`-product steps, in k order.
pub fn mma_dot(m: &TcModel, c: f32, a: &[u16], b: &[u16]) -> f32 {
    debug_assert!(a.len() == MMA_K && b.len() == MMA_K);
    if *m == SM90_BF16 {
        if let Some(v) = sm90_step(c, a, b) {
            return v;
        }
    }
    let mut acc = c;
    for (ca, cb) in a.chunks(m.block).zip(b.chunks(m.block)) {
        acc = step(m, acc, ca, cb);
    }
    acc
}

/// A dot product as a tensor-core GEMM computes it: instructions over k in
/// order from `+0`, each one's output the next one's addend. A tail shorter
/// than [`MMA_K`] is padded with zero products (which change no bit).
pub fn tc_dot(m: &TcModel, a: &[u16], b: &[u16]) -> f32 {
    assert_eq!(a.len(), b.len(), "tc_dot: length mismatch");
    let mut acc = 0.0f32;
    for (ca, cb) in a.chunks(MMA_K).zip(b.chunks(MMA_K)) {
        if ca.len() == MMA_K {
            acc = mma_dot(m, acc, ca, cb);
        } else {
            let (mut pa, mut pb) = ([0u16; MMA_K], [0u16; MMA_K]);
            pa[..ca.len()].copy_from_slice(ca);
            pb[..cb.len()].copy_from_slice(cb);
            acc = mma_dot(m, acc, &pa, &pb);
        }
    }
    acc
}

/// f32 → bf16 bits, round to nearest even (NaN kept quiet): how activations
/// enter a tensor-core GEMM.
pub fn f32_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    let round = 0x7fff + ((b >> 16) & 1);
    (b.wrapping_add(round) >> 16) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bf(x: f32) -> u16 {
        let b = f32_to_bf16(x);
        assert_eq!(crate::matmul::bf16_to_f32(b), x, "{x} is not a bf16");
        b
    }

    fn dot_of(m: &TcModel, c: f32, pairs: &[(f32, f32)]) -> f32 {
        let (mut a, mut b) = ([0u16; MMA_K], [0u16; MMA_K]);
        for (k, &(x, y)) in pairs.iter().enumerate() {
            (a[k], b[k]) = (bf(x), bf(y));
        }
        mma_dot(m, c, &a, &b)
    }

    #[test]
    fn exact_sums_are_exact_in_every_design() {
        // Small integers: every design must give the exact answer.
        let pairs: Vec<(f32, f32)> = (0..16).map(|k| (k as f32 - 7.0, 3.0)).collect();
        let exact: f32 = 1.5 + pairs.iter().map(|(x, y)| x * y).sum::<f32>();
        for m in candidates() {
            assert_eq!(dot_of(&m, 1.5, &pairs).to_bits(), exact.to_bits(), "{m:?}");
        }
    }

    #[test]
    fn bits_below_the_quantum_are_cut_per_term() {
        // 1 + 2^-24 + 2^-24: kept with 24 bits below the lead (sum 1 + 2^-23),
        // both cut with 23 (sum 1).
        let t = 2f32.powi(-12);
        let pairs = [(t, t), (t, t)];
        let m24 = TcModel {
            frac_bits: 24,
            ..SM90_BF16
        };
        let m23 = TcModel {
            frac_bits: 23,
            ..SM90_BF16
        };
        assert_eq!(dot_of(&m24, 1.0, &pairs), 1.0 + 2f32.powi(-23));
        assert_eq!(dot_of(&m23, 1.0, &pairs), 1.0);
    }

    #[test]
    fn products_align_by_their_exponent_fields() {
        // 1.5·1.5 = 2.25 has exponent field 0 but leads at 2^1. With 25 bits
        // below the field, 2^-25 survives and 2.25 - 1 - 1 + 2^-25 is exact; 25
        // bits below the lead cut it.
        let pairs = [
            (1.5, 1.5),
            (-1.0, 1.0),
            (-1.0, 1.0),
            (2f32.powi(-12), 2f32.powi(-13)),
        ];
        let lead = TcModel {
            align: Align::LeadingBit,
            ..SM90_BF16
        };
        assert_eq!(dot_of(&SM90_BF16, 0.0, &pairs), 0.25 + 2f32.powi(-25));
        assert_eq!(dot_of(&lead, 0.0, &pairs), 0.25);
    }

    #[test]
    fn the_final_rounding_is_the_models() {
        // 1 + 3·2^-25·... : the exact sum 1 + 1.5·2^-23 truncates to
        // 1 + 2^-23 and rounds to nearest (a tie to even) to 1 + 2^-22.
        let pairs = [(2f32.powi(-12), 2f32.powi(-12) * 3.0)];
        let rz = TcModel {
            frac_bits: 26,
            ..SM90_BF16
        };
        let rn = TcModel {
            rounding: Rounding::NearestEven,
            ..rz
        };
        assert_eq!(dot_of(&rz, 1.0, &pairs), 1.0 + 2f32.powi(-23));
        assert_eq!(dot_of(&rn, 1.0, &pairs), 1.0 + 2f32.powi(-22));
        // Toward zero on a negative sum cuts toward zero too.
        assert_eq!(
            dot_of(&rz, -1.0, &[(-2f32.powi(-12), 2f32.powi(-12) * 3.0)]),
            -(1.0 + 2f32.powi(-23))
        );
    }

    #[test]
    fn steps_differ_from_one_fused_block() {
        // 1 - 1 + 2^-24: one block of 16 cuts 2^-24 against the lead of
        // the ±1 products; steps of 8 cancel the ±1 first, then keep it.
        let mut pairs = vec![(1.0, 1.0), (1.0, -1.0)];
        pairs.resize(8, (0.0, 0.0));
        pairs.push((2f32.powi(-12), 2f32.powi(-12)));
        let m16 = TcModel {
            frac_bits: 23,
            ..SM90_BF16
        };
        let m8 = TcModel { block: 8, ..m16 };
        // One block: lead is 2^0 (from the ±1 products), 2^-24 is cut: 0.
        assert_eq!(dot_of(&m16, 0.0, &pairs), 0.0);
        // Two steps: the second holds only 2^-24 (and a +0 addend).
        assert_eq!(dot_of(&m8, 0.0, &pairs), 2f32.powi(-24));
    }

    #[test]
    fn specials_follow_ieee() {
        let m = SM90_BF16;
        assert!(dot_of(&m, f32::INFINITY, &[(1.0, f32::NEG_INFINITY)]).is_nan());
        assert!(dot_of(&m, 0.0, &[(0.0, f32::INFINITY)]).is_nan());
        assert_eq!(dot_of(&m, 1.0, &[(2.0, f32::INFINITY)]), f32::INFINITY);
        // A zero result is +0, even from -0 terms only.
        assert_eq!(dot_of(&m, -0.0, &[(-0.0, 1.0); MMA_K]).to_bits(), 0);
        assert_eq!(dot_of(&m, -0.0, &[(0.0, 1.0)]).to_bits(), 0);
        assert_eq!(dot_of(&m, 1.0, &[(1.0, -1.0)]).to_bits(), 0);
    }

    #[test]
    fn overflow_and_subnormals() {
        let big = 2f32.powi(127);
        let m = SM90_BF16;
        let sat = TcModel {
            overflow: Overflow::Saturate,
            ..m
        };
        assert_eq!(dot_of(&m, big, &[(big, 1.0)]), f32::INFINITY);
        assert_eq!(dot_of(&sat, big, &[(big, 1.0)]), f32::MAX);
        // A product deep in f32's subnormal range is kept exactly, or
        // flushed by a flushing design.
        let t = 2f32.powi(-70);
        let flush = TcModel {
            flush_f32: true,
            ..m
        };
        assert_eq!(dot_of(&m, 0.0, &[(t, t)]), 2f32.powi(-140));
        assert_eq!(dot_of(&flush, 0.0, &[(t, t)]), 0.0);
    }

    #[test]
    fn the_specialised_sm90_step_is_the_general_one() {
        // Every probe class (specials fall back to the general step).
        use super::probe::{tiles, Class, OUTPUTS};
        let m = SM90_BF16;
        for class in Class::ALL {
            for t in tiles(class, 99, 48) {
                for o in 0..OUTPUTS {
                    let (i, j) = (o / 8, o % 8);
                    let (a, b) = (
                        &t.a[i * MMA_K..(i + 1) * MMA_K],
                        &t.b[j * MMA_K..(j + 1) * MMA_K],
                    );
                    let general = step(&m, t.c[o], a, b);
                    let fast = mma_dot(&m, t.c[o], a, b);
                    assert!(
                        general.to_bits() == fast.to_bits() || (general.is_nan() && fast.is_nan()),
                        "{}: {general:e} vs {fast:e}",
                        class.name()
                    );
                }
            }
        }
    }

    #[test]
    fn tc_dot_chains_instructions_and_pads_the_tail() {
        let a: Vec<u16> = (0..40).map(|k| bf(k as f32 * 0.25)).collect();
        let b: Vec<u16> = (0..40).map(|_| bf(2.0)).collect();
        let exact: f32 = (0..40).map(|k| k as f32 * 0.5).sum();
        assert_eq!(tc_dot(&SM90_BF16, &a, &b), exact);
    }

    #[test]
    fn f32_to_bf16_rounds_to_nearest_even() {
        assert_eq!(f32_to_bf16(1.0), 0x3f80);
        // 1 + 2^-8 is a tie between 1 and 1 + 2^-7: even is 1.
        assert_eq!(f32_to_bf16(1.0 + 2f32.powi(-8)), 0x3f80);
        assert_eq!(f32_to_bf16(1.0 + 3.0 * 2f32.powi(-8)), 0x3f82);
        assert!(crate::matmul::bf16_to_f32(f32_to_bf16(f32::NAN)).is_nan());
    }
}
