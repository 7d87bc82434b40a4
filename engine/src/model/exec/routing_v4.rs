//! MoE routing of the DeepSeek-V4 class (the mini-v4 family uses it): which
//! routed experts a token uses and with what gates.
//!
//! Score layers: `s_e = sigmoid(logit_e)` over the router's logits, the top-k
//! by score with ties to the lowest expert index. Hash layers (the first
//! `n_hash_layers`): the experts come from a fixed hash of the token id and
//! the layer (SplitMix64 draws, the first k distinct), the gates still from
//! the scores. Gates: the selected scores, in ascending expert order, divided
//! by their sum (sequential from `+0.0` in that order), times
//! `routed_scaling_factor`. Experts are returned ascending, which is the order
//! the combine adds them in.
//!
//! The patch `moe-routed-scaling` (hash layers only) multiplies the scores by
//! the factor *before* normalising: the factor cancels, and the routed
//! experts' contribution comes out `routed_scaling_factor` times too small.

use lmrr_kernels::{sigmoid, SplitMix64};

/// The experts and gates of one token, ascending by expert index.
#[derive(Debug, Clone, PartialEq)]
pub struct Route {
    pub experts: Vec<usize>,
    pub gates: Vec<f32>,
}

/// How a layer routes.
#[derive(Debug, Clone, Copy)]
pub struct Routing {
    pub n_experts: usize,
    pub top_k: usize,
    pub scale: f32,
    /// By hash of the token id (the first layers) rather than by score.
    pub hash_layer: Option<usize>,
    /// `moe-routed-scaling` active (acts on hash layers only).
    pub scale_before_norm: bool,
}

/// The `k` distinct experts a hash layer gives `token`, ascending.
pub fn hash_experts(token: u32, layer: usize, n_experts: usize, k: usize) -> Vec<usize> {
    let seed = (u64::from(token) << 20) ^ (layer as u64) ^ 0x6d69_6e69_7634_6873;
    let mut rng = SplitMix64(seed);
    let mut out: Vec<usize> = Vec::with_capacity(k);
    // k ≤ n_experts (checked at load), so this ends; the draw count is bounded
    // in expectation by the coupon-collector sum.
    while out.len() < k.min(n_experts) {
        let e = (rng.next_u64() % n_experts as u64) as usize;
        if !out.contains(&e) {
            out.push(e);
        }
    }
    out.sort_unstable();
    out
}

impl Routing {
    /// Routes one token from its router `logits` (`n_experts` values).
    pub fn route(&self, token: u32, logits: &[f32]) -> Route {
        let scores: Vec<f32> = logits.iter().map(|&x| sigmoid(x)).collect();
        let experts = match self.hash_layer {
            Some(layer) => hash_experts(token, layer, self.n_experts, self.top_k),
            None => {
                let mut idx: Vec<usize> = (0..self.n_experts).collect();
                // Descending score, ties (and NaN, which compares as equal) to
                // the lowest index: a stable sort keeps index order.
                idx.sort_by(|&a, &b| {
                    scores[b]
                        .partial_cmp(&scores[a])
                        .unwrap_or(std::cmp::Ordering::Equal)
                });
                let mut top: Vec<usize> = idx.into_iter().take(self.top_k).collect();
                top.sort_unstable();
                top
            }
        };
        let patched = self.scale_before_norm && self.hash_layer.is_some();
        let picked: Vec<f32> = experts
            .iter()
            .map(|&e| {
                if patched {
                    scores[e] * self.scale
                } else {
                    scores[e]
                }
            })
            .collect();
        let mut sum = 0.0f32;
        for &s in &picked {
            sum += s;
        }
        let gates = picked
            .iter()
            .map(|&s| {
                if patched {
                    s / sum
                } else {
                    s / sum * self.scale
                }
            })
            .collect();
        Route { experts, gates }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_experts_are_distinct_sorted_and_stable() {
        for token in 0..200u32 {
            let e = hash_experts(token, 0, 8, 2);
            assert_eq!(e.len(), 2);
            assert!(e[0] < e[1] && e[1] < 8);
            assert_eq!(e, hash_experts(token, 0, 8, 2));
        }
        assert_eq!(hash_experts(5, 0, 4, 4), vec![0, 1, 2, 3]);
    }

    #[test]
    fn top_k_ties_go_to_the_lowest_index() {
        let r = Routing {
            n_experts: 4,
            top_k: 2,
            scale: 2.5,
            hash_layer: None,
            scale_before_norm: false,
        };
        let route = r.route(0, &[1.0, 3.0, 3.0, 3.0]);
        assert_eq!(route.experts, vec![1, 2]);
        // Equal scores: equal gates, summing to the scaling factor.
        assert_eq!(route.gates[0].to_bits(), route.gates[1].to_bits());
        assert_eq!(
            (route.gates[0] + route.gates[1]).to_bits(),
            2.5f32.to_bits()
        );
    }

    #[test]
    fn the_patch_cancels_the_factor_on_hash_layers_only() {
        let mk = |hash_layer, scale_before_norm| Routing {
            n_experts: 8,
            top_k: 2,
            scale: 2.5,
            hash_layer,
            scale_before_norm,
        };
        let logits = [0.3, -0.2, 0.9, 0.1, -1.0, 0.4, 0.0, 0.7];
        let reference = mk(Some(0), false).route(7, &logits);
        let patched = mk(Some(0), true).route(7, &logits);
        assert_eq!(reference.experts, patched.experts);
        let total = |r: &Route| r.gates.iter().sum::<f32>();
        assert!((total(&reference) - 2.5).abs() < 1e-5);
        assert!((total(&patched) - 1.0).abs() < 1e-5);
        // A score layer is untouched by the patch.
        assert_eq!(
            mk(None, false).route(7, &logits),
            mk(None, true).route(7, &logits)
        );
    }
}
