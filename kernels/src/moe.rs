//! Mixture-of-experts routing of the HF MoE families: which experts a token
//! uses and with what gates, from its router logits.
//!
//! Two kinds, after transformers' routers:
//! - [`softmax_topk`] (`MixtralTopKRouter`, `Qwen3MoeTopKRouter`): `p =`
//!   [`crate::softmax`] of the logits (canonical max, `det_exp`, canonical
//!   sum, IEEE division); the `k` largest `p`; gates `p_e`, or with
//!   `norm_topk_prob` `p_e / Σ p` over the chosen.
//! - [`sigmoid_group_topk`] (`DeepseekV3TopkRouter`): `s_e =`
//!   [`crate::sigmoid`] of the logits; selection by `c_e = s_e + bias_e`
//!   (`e_score_correction_bias`, for selection only): each of the `n_group`
//!   equal groups scores the sum of its two largest `c` (one add, largest
//!   first), the `topk_group` best groups stay, and the `k` largest `c` among
//!   their experts are chosen; gates from the unbiased `s_e`, with
//!   `norm_topk_prob` divided by `Σ s + 1e-20` (as transformers writes it),
//!   then times `routed_scaling_factor`.
//!
//! Canonical choices where transformers leaves the order to its kernels:
//! every top-k takes the largest value first and breaks ties to the lowest
//! index (a NaN ranks below every number); the chosen experts are returned
//! ascending, and every sum over them runs sequentially from `+0.0` in that
//! ascending order. A route is a function of one token's logits only, so it
//! never depends on the token's batch-mates (I2). The combine of the expert
//! outputs is [`crate::moe_combine`]: the shared experts' output (or `+0.0`)
//! first, then one fma per routed expert, ascending.

use crate::hyper::sigmoid;
use crate::softmax::softmax;

/// The experts and gates of one token, ascending by expert index.
#[derive(Debug, Clone, PartialEq)]
pub struct Route {
    pub experts: Vec<usize>,
    pub gates: Vec<f32>,
}

/// Ranking key: a NaN ranks below every number.
fn key(v: f32) -> f32 {
    if v.is_nan() {
        f32::NEG_INFINITY
    } else {
        v
    }
}

/// The indices of the `k` largest of `v` among those `allowed`, largest
/// first, ties to the lowest index (a scan per pick: `k · len` compares).
pub fn top_k_indices(v: &[f32], k: usize, allowed: impl Fn(usize) -> bool) -> Vec<usize> {
    let mut taken = vec![false; v.len()];
    let mut out = Vec::with_capacity(k);
    for _ in 0..k {
        let mut best: Option<usize> = None;
        for (i, &x) in v.iter().enumerate() {
            if taken[i] || !allowed(i) {
                continue;
            }
            if best.is_none_or(|b| key(x) > key(v[b])) {
                best = Some(i);
            }
        }
        match best {
            Some(b) => {
                taken[b] = true;
                out.push(b);
            }
            None => break,
        }
    }
    out
}

/// Sequential sum from `+0.0` in the order given.
fn seq_sum(v: impl Iterator<Item = f32>) -> f32 {
    let mut s = 0.0f32;
    for x in v {
        s += x;
    }
    s
}

/// Softmax top-k routing of one token's router `logits` (module docs).
pub fn softmax_topk(logits: &[f32], k: usize, norm_topk_prob: bool) -> Route {
    assert!(
        k >= 1 && k <= logits.len(),
        "softmax_topk: k {k} of {} experts",
        logits.len()
    );
    let mut p = vec![0.0f32; logits.len()];
    softmax(logits, &mut p);
    let mut experts = top_k_indices(&p, k, |_| true);
    experts.sort_unstable();
    let picked: Vec<f32> = experts.iter().map(|&e| p[e]).collect();
    let gates = if norm_topk_prob {
        let s = seq_sum(picked.iter().copied());
        picked.iter().map(|&x| x / s).collect()
    } else {
        picked
    };
    Route { experts, gates }
}

/// The shape of a group-limited sigmoid routing.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GroupTopK {
    pub k: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f32,
}

impl GroupTopK {
    /// Whether the shape is routable over `n_experts`: groups of equal size
    /// (at least 2, for the top-2 group score), `topk_group` of them holding
    /// at least `k` experts. `Err` names the field that is not.
    pub fn check(&self, n_experts: usize) -> Result<(), String> {
        if self.n_group == 0
            || !n_experts.is_multiple_of(self.n_group)
            || n_experts / self.n_group < 2
        {
            return Err(format!(
                "n_group {} must split {n_experts} experts into equal groups of at least 2",
                self.n_group
            ));
        }
        if self.topk_group == 0 || self.topk_group > self.n_group {
            return Err(format!(
                "topk_group {} must be in 1..={}",
                self.topk_group, self.n_group
            ));
        }
        let reachable = self.topk_group * (n_experts / self.n_group);
        if self.k == 0 || self.k > reachable {
            return Err(format!(
                "num_experts_per_tok {} must be in 1..={reachable} (the experts of topk_group groups)",
                self.k
            ));
        }
        Ok(())
    }
}

/// Group-limited sigmoid top-k routing of one token's router `logits` with
/// the selection bias `bias` (module docs). The shape must pass
/// [`GroupTopK::check`].
pub fn sigmoid_group_topk(logits: &[f32], bias: &[f32], g: &GroupTopK) -> Route {
    let n = logits.len();
    assert_eq!(bias.len(), n, "sigmoid_group_topk: bias length");
    if let Err(e) = g.check(n) {
        panic!("sigmoid_group_topk: {e}");
    }
    let s: Vec<f32> = logits.iter().map(|&x| sigmoid(x)).collect();
    let c: Vec<f32> = s.iter().zip(bias).map(|(&a, &b)| a + b).collect();
    let size = n / g.n_group;
    let group_scores: Vec<f32> = c
        .chunks(size)
        .map(|grp| {
            let t = top_k_indices(grp, 2, |_| true);
            grp[t[0]] + grp[t[1]]
        })
        .collect();
    let groups = top_k_indices(&group_scores, g.topk_group, |_| true);
    let mut experts = top_k_indices(&c, g.k, |e| groups.contains(&(e / size)));
    experts.sort_unstable();
    let picked: Vec<f32> = experts.iter().map(|&e| s[e]).collect();
    let gates = if g.norm_topk_prob {
        let denom = seq_sum(picked.iter().copied()) + 1e-20f32;
        picked
            .iter()
            .map(|&x| x / denom * g.routed_scaling_factor)
            .collect()
    } else {
        picked
            .iter()
            .map(|&x| x * g.routed_scaling_factor)
            .collect()
    };
    Route { experts, gates }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_takes_the_largest_first_ties_to_the_lowest_index_nan_last() {
        let v = [1.0, 3.0, f32::NAN, 3.0, 2.0];
        assert_eq!(top_k_indices(&v, 3, |_| true), vec![1, 3, 4]);
        assert_eq!(top_k_indices(&v, 5, |_| true), vec![1, 3, 4, 0, 2]);
        assert_eq!(top_k_indices(&v, 2, |i| i != 1), vec![3, 4]);
    }

    #[test]
    fn softmax_topk_renormalises_the_chosen_probabilities() {
        let logits = [0.5, -1.0, 2.0, 0.1, 2.0, -3.0];
        let r = softmax_topk(&logits, 2, true);
        assert_eq!(r.experts, vec![2, 4]);
        assert_eq!(r.gates[0].to_bits(), r.gates[1].to_bits());
        assert_eq!(r.gates[0], 0.5);
        let raw = softmax_topk(&logits, 3, false);
        assert_eq!(raw.experts, vec![0, 2, 4]);
        let mut p = [0.0; 6];
        crate::softmax_ref(&logits, &mut p);
        let want: Vec<u32> = [p[0], p[2], p[4]].iter().map(|x| x.to_bits()).collect();
        let got: Vec<u32> = raw.gates.iter().map(|x| x.to_bits()).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn group_routing_selects_by_biased_scores_and_gates_by_unbiased_ones() {
        // Four groups of two. The bias lifts expert 6 (group 3) over the
        // rest; groups by their top-2 sums: group 3, then group 0.
        let logits = [1.0, 0.8, -2.0, -2.0, 0.9, -3.0, -1.0, -1.0];
        let bias = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0, 0.0];
        let g = GroupTopK {
            k: 2,
            n_group: 4,
            topk_group: 2,
            norm_topk_prob: true,
            routed_scaling_factor: 2.5,
        };
        let r = sigmoid_group_topk(&logits, &bias, &g);
        // Expert 4 (0.9) is excluded with its group; 6 (biased) and 0 win.
        assert_eq!(r.experts, vec![0, 6]);
        let (s0, s6) = (sigmoid(1.0), sigmoid(-1.0));
        let d = (0.0 + s0 + s6) + 1e-20f32;
        assert_eq!(r.gates[0].to_bits(), (s0 / d * 2.5).to_bits());
        assert_eq!(r.gates[1].to_bits(), (s6 / d * 2.5).to_bits());
        let plain = sigmoid_group_topk(
            &logits,
            &bias,
            &GroupTopK {
                norm_topk_prob: false,
                ..g
            },
        );
        assert_eq!(plain.gates[0].to_bits(), (s0 * 2.5).to_bits());
    }

    #[test]
    fn group_shapes_that_cannot_route_are_refused_by_name() {
        let g = GroupTopK {
            k: 5,
            n_group: 4,
            topk_group: 2,
            norm_topk_prob: true,
            routed_scaling_factor: 1.0,
        };
        assert!(g.check(8).unwrap_err().contains("num_experts_per_tok 5"));
        assert!(g.check(6).unwrap_err().contains("n_group 4"));
        assert!(GroupTopK { topk_group: 5, ..g }
            .check(8)
            .unwrap_err()
            .contains("topk_group"));
        assert!(GroupTopK { k: 4, ..g }.check(8).is_ok());
    }
}
