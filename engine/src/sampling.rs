//! Seeded sampling on the host from f32 logits (contract invariant I7: the
//! token drawn at (request seed, absolute position) depends only on those and
//! the logits).
//!
//! - `temperature == 0`: greedy, ties to the lowest token id.
//! - otherwise: `s[i] = logits[i] / temperature` (NaN dropped); candidates in
//!   order of (score descending, id ascending); keep the first `top_k` (0 = all);
//!   weights `e[j] = det_exp(s[j] − s[0])`; keep the shortest prefix whose
//!   running sum (sequential, in candidate order) reaches `top_p · Σe` (canonical
//!   sum); draw `u` from the counter-based generator of [`uniform`] and pick the
//!   first candidate whose running sum exceeds `u · Σkept`.
//!
//! No state is carried between draws: batch-mates, step numbers and earlier
//! draws cannot change a token.

use serde::{Deserialize, Serialize};

use lmrr_kernels::{argmax, det_exp, sum_ref};

/// Per-request sampling parameters.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// 0 = greedy.
    pub temperature: f32,
    /// 0 = no top-k cut.
    pub top_k: usize,
    /// 1 = no nucleus cut.
    pub top_p: f32,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Checks ranges; the message names the field and the value.
    pub fn validate(&self) -> Result<(), crate::EngineError> {
        let bad =
            |name: &'static str, value: String, why: &str| crate::EngineError::InvalidOption {
                name,
                value,
                why: why.into(),
            };
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(bad(
                "temperature",
                self.temperature.to_string(),
                "must be finite and >= 0",
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(bad("top_p", self.top_p.to_string(), "must be in (0, 1]"));
        }
        Ok(())
    }
}

/// SplitMix64 finaliser.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The counter-based generator: a uniform `f32` in `[0, 1)` with 24 random
/// bits, a pure function of `(seed, position)`:
/// `mix(mix(seed + φ) ^ (position + 1)·φ)` with φ = 0x9E3779B97F4A7C15.
pub fn uniform(seed: u64, position: u64) -> f32 {
    const PHI: u64 = 0x9E37_79B9_7F4A_7C15;
    let z = mix(mix(seed.wrapping_add(PHI)) ^ position.wrapping_add(1).wrapping_mul(PHI));
    (z >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
}

/// Draws the token for absolute `position` (the position the token will occupy).
/// Returns 0 for an all-NaN row (never happens with finite weights).
pub fn sample(logits: &[f32], p: &SamplingParams, position: u64) -> u32 {
    if p.temperature == 0.0 {
        return argmax(logits).unwrap_or(0) as u32;
    }
    let mut cand: Vec<(f32, u32)> = logits
        .iter()
        .enumerate()
        .filter(|(_, v)| !v.is_nan())
        .map(|(i, &v)| (v / p.temperature, i as u32))
        .collect();
    if cand.is_empty() {
        return 0;
    }
    let order = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
    if p.top_k > 0 && p.top_k < cand.len() {
        cand.select_nth_unstable_by(p.top_k - 1, order);
        cand.truncate(p.top_k);
    }
    cand.sort_unstable_by(order);
    let top = cand[0].0;
    let e: Vec<f32> = cand.iter().map(|&(s, _)| det_exp(s - top)).collect();
    let mut keep = e.len();
    if p.top_p < 1.0 {
        let target = p.top_p * sum_ref(&e);
        let mut run = 0.0f32;
        for (j, &w) in e.iter().enumerate() {
            run += w;
            if run >= target {
                keep = j + 1;
                break;
            }
        }
    }
    let mut kept_total = 0.0f32;
    for &w in &e[..keep] {
        kept_total += w;
    }
    let target = uniform(p.seed, position) * kept_total;
    let mut run = 0.0f32;
    for (j, &w) in e[..keep].iter().enumerate() {
        run += w;
        if run > target {
            return cand[j].1;
        }
    }
    cand[keep - 1].1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_ties_go_to_lowest_id() {
        let l = [0.0, 3.0, 1.0, 3.0];
        assert_eq!(sample(&l, &SamplingParams::default(), 5), 1);
    }

    #[test]
    fn top_k_one_is_greedy_whatever_the_seed() {
        let l = [0.5, 2.0, 1.9, 2.0, -1.0];
        for seed in 0..50 {
            let p = SamplingParams {
                temperature: 1.3,
                top_k: 1,
                top_p: 1.0,
                seed,
            };
            assert_eq!(sample(&l, &p, seed * 7), 1);
        }
    }

    #[test]
    fn draws_follow_the_distribution() {
        // Two tokens with weights 1 : e ≈ 0.269 : 0.731; 4000 positions.
        let l = [0.0f32, 1.0];
        let p = SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: 42,
        };
        let ones = (0..4000).filter(|&pos| sample(&l, &p, pos) == 1).count();
        let frac = ones as f64 / 4000.0;
        let want = 1.0f64.exp() / (1.0 + 1.0f64.exp());
        assert!((frac - want).abs() < 0.03, "frac {frac}, want {want}");
    }

    #[test]
    fn top_p_cuts_the_tail() {
        // Probabilities ~ [0.66, 0.24, 0.09, ...]: top_p 0.5 keeps only the first.
        let l = [3.0f32, 2.0, 1.0, 0.0];
        for pos in 0..200 {
            let p = SamplingParams {
                temperature: 1.0,
                top_k: 0,
                top_p: 0.5,
                seed: 3,
            };
            assert_eq!(sample(&l, &p, pos), 0);
        }
    }

    #[test]
    fn uniform_depends_on_seed_and_position_only() {
        assert_eq!(uniform(1, 2).to_bits(), uniform(1, 2).to_bits());
        assert_ne!(uniform(1, 2).to_bits(), uniform(1, 3).to_bits());
        assert_ne!(uniform(1, 2).to_bits(), uniform(2, 2).to_bits());
        let u: Vec<f32> = (0..1000).map(|i| uniform(9, i)).collect();
        assert!(u.iter().all(|&x| (0.0..1.0).contains(&x)));
        let mean = u.iter().map(|&x| x as f64).sum::<f64>() / 1000.0;
        assert!((mean - 0.5).abs() < 0.05, "mean {mean}");
    }
}
