//! The step's kernel choices ([`Choice`]): fused RoPE attention or not,
//! the split decode attention's scratch, graphs, and when K/V rows go back
//! to the host. Invariant: every choice moves speed only, never bits.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use lmrr_kernels::cuda::resident::SplitKv;

use super::{Plan, Resident, SeqSpan, Staged, State};

/// The step's kernel choices.
#[derive(Debug, Clone, Copy)]
pub(super) struct Choice {
    /// Every row wanted, in stacked order: the head reads them in place.
    pub(super) direct: bool,
    /// The fused decode attention (RoPE and page writes in its blocks).
    pub(super) rope_attn: bool,
    /// Launched from (or captured as) a graph.
    pub(super) graphs: bool,
    /// K/V rows copied back layer by layer while later layers run.
    pub(super) per_layer: bool,
    /// K/V rows copied back after the last attention.
    pub(super) early: bool,
}

impl Resident {
    /// The tiles a row of the split decode attention's scratch holds for
    /// this step (the longest walk's, rounded up to a power of two), or 0
    /// where the step does not take it: only a decode step of plain
    /// attention ops, of at most [`Tuning::attn_decode_max`] blocks, whose
    /// longest context reaches [`Tuning::split_kv_min`] (0: never).
    ///
    /// [`Tuning::attn_decode_max`]: lmrr_kernels::cuda::resident::Tuning::attn_decode_max
    /// [`Tuning::split_kv_min`]: lmrr_kernels::cuda::resident::Tuning::split_kv_min
    pub(super) fn split_tiles(
        &self,
        st: &State,
        plan: &Plan,
        spans: &[SeqSpan],
        n: usize,
    ) -> usize {
        let t = self.gpu.tuning();
        let decode = spans.iter().all(|s| s.tokens.len() == 1);
        if t.split_kv_min == 0
            || !decode
            || !plan.fusable_attention
            || n * plan.heads > t.attn_decode_max
        {
            return 0;
        }
        // The step's positions (stage_inputs packs them after the ids).
        let longest = st.host_in[n..2 * n].iter().copied().max().unwrap_or(0) as usize;
        if longest + 1 < t.split_kv_min {
            return 0;
        }
        SplitKv::tiles_for(longest).next_power_of_two()
    }

    /// The step's kernel choices.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn choose(
        &self,
        st: &State,
        plan: &Plan,
        spans: &[SeqSpan],
        rows: &[usize],
        n: usize,
        w: usize,
        staged: &Staged,
        split_tiles: usize,
    ) -> Choice {
        let gpu = &*self.gpu;
        let adim = plan.kv.aux_dim;
        let decode = spans.iter().all(|s| s.tokens.len() == 1);
        // Every token's logits row wanted, in stacked order: the head reads
        // the residual rows where they are.
        let direct = w == n && rows.iter().enumerate().all(|(i, &r)| r == i);
        // A decode step has its attention blocks make RoPE and the page
        // writes only where no block can read a row that another block
        // writes: every token's page is in no other span's page list (a
        // shared page is a prefix, never written; only cache-corruption
        // patches write one, or send a token to the sink page). A step that
        // fails this is launched without graphs, so that no graph captured
        // from a fused step replays for it.
        let crossed = decode && {
            let dsts = &st.host_in[3 * n..4 * n];
            let mut refs: HashMap<u64, usize> = HashMap::new();
            for p in &staged.pages {
                *refs.entry(*p).or_insert(0) += 1;
            }
            dsts.iter()
                .any(|d| *d == staged.sink || refs.get(d).copied().unwrap_or(0) != 1)
        };
        let rope_attn = {
            let t = gpu.tuning();
            decode
                && split_tiles == 0
                && !crossed
                && staged.n_groups == 0
                && plan.fusable_attention
                && n * plan.heads <= t.attn_decode_max
                && n < t.gemm_min.max(1)
        };
        let graphs = self.graphs_on.load(Ordering::Relaxed)
            && decode
            && !self.profiling
            && !crossed
            && !plan.has_moe;
        // A long step not replayed from a graph (Tuning::kv_overlap_min)
        // copies its K/V rows back layer by layer, and the host writes layer
        // l while the device runs the layers after it. Otherwise
        // (Tuning::kv_early_min) a step of that many tokens copies them back
        // after its last attention, and the host writes them while the rest
        // runs and its logits come back (graphs capture the two parts
        // apart for it). The same bytes as one download after the step.
        let (per_layer, early) = {
            let t = gpu.tuning();
            let on = |min: usize| min > 0 && n >= min && !self.profiling && adim == 0;
            let per_layer = on(t.kv_overlap_min) && !graphs;
            (per_layer, on(t.kv_early_min) && !per_layer)
        };
        Choice {
            direct,
            rope_attn,
            graphs,
            per_layer,
            early,
        }
    }
}
