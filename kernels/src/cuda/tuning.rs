//! The resident path's kernel-choice table: which kernel serves a step or a
//! matmul of a given shape, and the few environment variables that may move
//! a choice to measure another.
//!
//! Owns [`Tuning`] (one field per choice that is still a choice, each
//! documented with why it exists) and the host-side planning that depends on
//! it only through constants: [`prefill_groups`] and [`longest_first`].
//!
//! Invariant: every choice here moves speed only, never bits. Every kernel
//! a choice can pick computes each output in the CPU's canonical order
//! (`device-check.sh` holds each one to the CPU), so a step's bits are the
//! same whatever the table says. The measurements behind each default live
//! in docs/PERFORMANCE.md, not here; variants that lost a measurement are
//! deleted, not kept as switches.

use super::launch::{MM_TOKENS, PF_TQ};
use super::GpuError;

/// Which kernel the resident path takes for a step or a matmul.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tuning {
    /// `LMRR_CUDA_PDL` (0/1, default 1; sm_90 and later, ignored before):
    /// programmatic dependent launch. Each resident kernel is launched while
    /// the one ahead of it runs and waits for it inside (`PDL_ENTRY`); the
    /// resident module is then compiled for sm_90 with its weights and step
    /// inputs loaded before that wait (`PDL_PREFETCH`, `ATTN_EARLY`). Exists
    /// so that the plain-launch form, the one pre-Hopper devices run, can be
    /// checked and timed on a Hopper device.
    pub pdl: bool,
    /// `LMRR_CUDA_GEMM_MIN` (tokens, default 64): matmuls of at least this
    /// many tokens take the staged tiles of `matmul_gemm` (and its wide and
    /// multi forms); smaller ones the latency kernels (`matmul_rows`,
    /// `matmul_multi`). The crossover depends on the device's SM count and
    /// the model's widths.
    pub gemm_min: usize,
    /// From this many tokens the gemm tiles are `matmul_gemm_wide`'s (64
    /// rows × 32 tokens, 256 threads) rather than `matmul_gemm`'s (32 × 16,
    /// 64 threads). Not a variable: it follows `gemm_min` on every device
    /// measured.
    pub gemm_wide_min: usize,
    /// A gemm whose tiles are fewer than this many blocks is split over its
    /// 64-chunks (partials summed in chunk order by the kernel that reads
    /// them) until it has about this many: a batch-64 decode's tiles alone
    /// leave most SMs idle. Not a variable.
    pub split_blocks: usize,
    /// `LMRR_CUDA_ATTN_DECODE_MAX` (blocks, default 132): attention steps of
    /// at most this many blocks (tokens × heads) take `attention_decode`
    /// (a group's K/V loads in flight together, more registers) rather than
    /// `attention_paged`; 0: never. It is about the device's SM count, so a
    /// device with other SMs wants another value.
    pub attn_decode_max: usize,
    /// `LMRR_CUDA_KV_OVERLAP_MIN` (tokens, default 256; 0: never): steps of
    /// at least this many tokens that are not replayed from a graph copy
    /// each layer's K/V rows to the host on a second stream as soon as the
    /// layer has made them ([`super::overlap`]), so the host writes its KV
    /// store while later layers run. Depends on the host's copy speed.
    pub kv_overlap_min: usize,
    /// Steps of at least this many tokens (and not overlapped layer by
    /// layer) copy their K/V rows to the host right after the last layer,
    /// so that the host writes them while the head runs (decode graphs
    /// capture the layers and the head apart for it); 0: after the step.
    /// Not a variable: 1, every step.
    pub kv_early_min: usize,
    /// `LMRR_CUDA_LOADS_FIRST_MIN` (rows, default 128; 0: never): norms of
    /// at least this many rows take `norm_reg_lf`, which loads the whole
    /// residual row before storing its sums (the same values): faster alone
    /// and in prefill, slower inside a batch-1 decode chain, so the cut is
    /// a step size.
    pub loads_first_min: usize,
    /// `LMRR_CUDA_ROWS4_MIN` (rows, default 32,768; 0: never): matrices of
    /// at least this many rows, in steps of at least
    /// [`Tuning::rows4_tokens`] tokens that take `matmul_rows`, take
    /// `matmul_rows4` (four rows a block, their loads in flight together;
    /// rows of at most `64 · MR4_MAX_CHUNKS` columns). The default reaches
    /// an lm head and no layer's matrix.
    pub rows4_min: usize,
    /// The fewest tokens a step has for [`Tuning::rows4_min`] to apply
    /// (one full token tile; at batch 1 `matmul_rows4` is no faster). Not
    /// a variable.
    pub rows4_tokens: usize,
    /// `LMRR_CUDA_SPLIT_KV_MIN` (positions; 0: never): decode steps of at
    /// most [`Tuning::attn_decode_max`] blocks whose longest context
    /// reaches this many positions take the attention split over the KV
    /// length (`attention_split_*`, the same bits) instead of one block per
    /// (token, head). The default is the shortest context docs/PERFORMANCE.md
    /// timed, where the split already led.
    pub split_kv_min: usize,
}

impl Default for Tuning {
    /// The choices docs/PERFORMANCE.md measured fastest on an H100 and an
    /// H200.
    fn default() -> Self {
        Self {
            pdl: true,
            gemm_min: 64,
            gemm_wide_min: 64,
            split_blocks: 4096,
            attn_decode_max: 132,
            kv_overlap_min: 256,
            kv_early_min: 1,
            loads_first_min: 128,
            rows4_min: 32_768,
            rows4_tokens: MM_TOKENS,
            split_kv_min: 512,
        }
    }
}

/// The environment variables [`Tuning::from_vars`] reads (with
/// [`OTHER_VARIABLES`], the whole set of `LMRR_CUDA_*` knobs).
pub const VARIABLES: [&str; 7] = [
    "LMRR_CUDA_PDL",
    "LMRR_CUDA_GEMM_MIN",
    "LMRR_CUDA_ATTN_DECODE_MAX",
    "LMRR_CUDA_KV_OVERLAP_MIN",
    "LMRR_CUDA_LOADS_FIRST_MIN",
    "LMRR_CUDA_ROWS4_MIN",
    "LMRR_CUDA_SPLIT_KV_MIN",
];

/// The `LMRR_CUDA_*` variables that choose no kernel, each with why it
/// exists: with [`VARIABLES`], every `LMRR_CUDA_*` knob.
pub const OTHER_VARIABLES: [(&str, &str); 3] = [
    (
        "LMRR_CUDA_GRAPHS",
        "0 replays no CUDA graph (read by the engine): to compare a step's \
         launches with its graph",
    ),
    (
        "LMRR_CUDA_PROFILE",
        "1 synchronizes and times every part of a step (read by the engine)",
    ),
    (
        super::cache::CACHE_VAR,
        "0 compiles the kernels at every start instead of loading them from the \
         on-disk module cache (cuda/cache.rs): to time a fresh compile, or where \
         the cache folder must not be written",
    ),
];

/// Variables of choices that are no longer choices: the variant was deleted
/// after it measured slower, or the winner is now fixed. Setting one is an
/// error that says so (a script that still sets it measures nothing).
pub const RETIRED: [&str; 33] = [
    "LMRR_CUDA_FUSED_MAX",
    "LMRR_CUDA_SWIGLU_MAX",
    "LMRR_CUDA_GEMM_WIDE_MIN",
    "LMRR_CUDA_GEMM_PIPELINED",
    "LMRR_CUDA_DOWN_SWIGLU",
    "LMRR_CUDA_PDL_PREFETCH",
    "LMRR_CUDA_ATTN_PREFETCH",
    "LMRR_CUDA_ATTN_PREFILL",
    "LMRR_CUDA_ATTN_PREFILL_GROUP",
    "LMRR_CUDA_ATTN_PREFILL_HD64",
    "LMRR_CUDA_ROPE_ATTN",
    "LMRR_CUDA_SPLIT_BLOCKS",
    "LMRR_CUDA_GEMM_MULTI",
    "LMRR_CUDA_FOLD_SUMS",
    "LMRR_CUDA_KV_EARLY_MIN",
    "LMRR_CUDA_CHUNK_MAX",
    "LMRR_CUDA_CHUNK_THREADS",
    "LMRR_CUDA_ATTN_DECODE_HD64",
    "LMRR_CUDA_GATE_UP_SWIGLU",
    "LMRR_CUDA_HEAD_DIRECT",
    "LMRR_CUDA_SWIGLU4",
    "LMRR_CUDA_LOADS_FIRST",
    "LMRR_CUDA_ROWS4_TOKENS",
    "LMRR_CUDA_ROWS4_MAX",
    "LMRR_CUDA_ROPE_QS",
    "LMRR_CUDA_MULTI4",
    "LMRR_CUDA_LB_ATTN_DECODE",
    "LMRR_CUDA_LB_ATTN_PREFILL",
    "LMRR_CUDA_LB_ROWS4",
    "LMRR_CUDA_LB_MULTI",
    "LMRR_CUDA_ATTN_EARLY",
    "LMRR_CUDA_PF_LONGEST_FIRST",
    "LMRR_CUDA_ROWS_NORM_MAX",
];

impl Tuning {
    /// The defaults, with any of the environment variables applied.
    pub fn from_env() -> Result<Self, GpuError> {
        Self::from_vars(|var| std::env::var(var).ok())
    }

    /// The defaults, with the variables `get` returns applied. A value that
    /// is not a count (or 0/1 for `LMRR_CUDA_PDL`) is an error naming it;
    /// so is any [`RETIRED`] variable that is set.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Self, GpuError> {
        let retired: Vec<&str> = RETIRED.into_iter().filter(|v| get(v).is_some()).collect();
        if !retired.is_empty() {
            return Err(GpuError::Config(format!(
                "{} no longer exist{}: each was a kernel choice that is now fixed or deleted \
                 (docs/PERFORMANCE.md lists them); the choices left are {}",
                retired.join(", "),
                if retired.len() == 1 { "s" } else { "" },
                VARIABLES.join(", ")
            )));
        }
        let mut t = Self::default();
        for (var, slot) in [
            ("LMRR_CUDA_GEMM_MIN", &mut t.gemm_min),
            ("LMRR_CUDA_ATTN_DECODE_MAX", &mut t.attn_decode_max),
            ("LMRR_CUDA_KV_OVERLAP_MIN", &mut t.kv_overlap_min),
            ("LMRR_CUDA_LOADS_FIRST_MIN", &mut t.loads_first_min),
            ("LMRR_CUDA_ROWS4_MIN", &mut t.rows4_min),
            ("LMRR_CUDA_SPLIT_KV_MIN", &mut t.split_kv_min),
        ] {
            if let Some(v) = get(var) {
                *slot = v.trim().parse().map_err(|_| {
                    GpuError::Config(format!("{var}={v:?} is not a count (want 0, 1, 2, …)"))
                })?;
            }
        }
        if let Some(v) = get("LMRR_CUDA_PDL") {
            t.pdl = match v.trim() {
                "1" => true,
                "0" => false,
                _ => {
                    return Err(GpuError::Config(format!(
                        "LMRR_CUDA_PDL={v:?}: want 0 or 1"
                    )))
                }
            };
        }
        // The wide tiles never start below the gemm.
        t.gemm_wide_min = t.gemm_wide_min.max(t.gemm_min);
        Ok(t)
    }

    /// The table in words, each choice with its variable (`lmrr bench`).
    pub fn describe(&self) -> String {
        let yes = |b: bool| if b { "yes" } else { "no" };
        format!(
            "programmatic dependent launch: {} (LMRR_CUDA_PDL); matmul_gemm from {} tokens \
             (LMRR_CUDA_GEMM_MIN), its wide tiles from {}, split over chunks below {} blocks; \
             attention_decode to {} blocks (LMRR_CUDA_ATTN_DECODE_MAX); norm_reg_lf from {} rows \
             (LMRR_CUDA_LOADS_FIRST_MIN); matmul_rows4 for matrices of {} rows or more \
             (LMRR_CUDA_ROWS4_MIN) in steps of {} tokens or more; K/V copied back layer by layer \
             from {} tokens (LMRR_CUDA_KV_OVERLAP_MIN), during the head from {}; decode attention \
             split over the KV length from {} positions (LMRR_CUDA_SPLIT_KV_MIN, 0: never)",
            yes(self.pdl),
            self.gemm_min,
            self.gemm_wide_min,
            self.split_blocks,
            self.attn_decode_max,
            self.loads_first_min,
            self.rows4_min,
            self.rows4_tokens,
            self.kv_overlap_min,
            self.kv_early_min,
            self.split_kv_min,
        )
    }
}

/// A step's `attention_prefill` groups: each span (consecutive stacked
/// tokens of one sequence, lengths `span_lens`) cut into runs of up to
/// `group` tokens (at most [`PF_TQ`]), each `first token << 32 | count`;
/// `None` where groups would not pay (a decode step, or groups that would
/// carry more than twice the step's tokens: mostly short spans).
pub fn prefill_groups(
    span_lens: impl Iterator<Item = usize> + Clone,
    group: usize,
) -> Option<Vec<u64>> {
    let group = group.clamp(1, PF_TQ);
    let n: usize = span_lens.clone().sum();
    let count: usize = span_lens.clone().map(|l| l.div_ceil(group)).sum();
    if n == 0 || count * group > 2 * n || n > u32::MAX as usize {
        return None;
    }
    let mut out = Vec::with_capacity(count);
    let mut first = 0usize;
    for len in span_lens {
        let mut at = 0;
        while at < len {
            let c = group.min(len - at);
            out.push(((first + at) as u64) << 32 | c as u64);
            at += c;
        }
        first += len;
    }
    Some(out)
}

/// Orders `groups` ([`prefill_groups`]' `first << 32 | count`) longest
/// first: by the position of each group's last token (`pos`, a position per
/// stacked token), descending, ties in their order. The blocks that walk the
/// most K/V tiles are then dispatched first, not left waiting for a second
/// wave; which block serves which group moves no bit (each writes its own
/// tokens' rows). A group whose tokens are past `pos` keeps its place among
/// the shortest.
pub fn longest_first(groups: &mut [u64], pos: &[u64]) {
    let last = |g: u64| {
        let (first, count) = ((g >> 32) as usize, (g & 0xffff_ffff) as usize);
        (first + count)
            .checked_sub(1)
            .and_then(|i| pos.get(i))
            .copied()
            .unwrap_or(0)
    };
    groups.sort_by_key(|&g| std::cmp::Reverse(last(g)));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(vars: &[(&str, &str)]) -> Result<Tuning, GpuError> {
        Tuning::from_vars(|k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        })
    }

    #[test]
    fn variables_set_each_choice() {
        let t = with(&[
            ("LMRR_CUDA_PDL", "0"),
            ("LMRR_CUDA_GEMM_MIN", " 9 "),
            ("LMRR_CUDA_ATTN_DECODE_MAX", "0"),
            ("LMRR_CUDA_KV_OVERLAP_MIN", "512"),
            ("LMRR_CUDA_LOADS_FIRST_MIN", "1"),
            ("LMRR_CUDA_ROWS4_MIN", "1000"),
            ("LMRR_CUDA_SPLIT_KV_MIN", "4096"),
        ])
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            t,
            Tuning {
                pdl: false,
                gemm_min: 9,
                gemm_wide_min: 64,
                split_blocks: 4096,
                attn_decode_max: 0,
                kv_overlap_min: 512,
                kv_early_min: 1,
                loads_first_min: 1,
                rows4_min: 1000,
                rows4_tokens: MM_TOKENS,
                split_kv_min: 4096,
            }
        );
        assert_eq!(with(&[]).ok(), Some(Tuning::default()));
        // The wide tiles follow a gemm moved above them.
        let t = with(&[("LMRR_CUDA_GEMM_MIN", "100")]).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((t.gemm_min, t.gemm_wide_min), (100, 100));
        assert!(t.describe().contains("from 100 tokens"), "{}", t.describe());
    }

    #[test]
    fn about_eight_variables_remain_and_none_is_retired() {
        // Seven kernel choices (the split decode attention's until a device
        // has measured where it pays), graphs, profiling and the module cache.
        assert!(
            VARIABLES.len() + OTHER_VARIABLES.len() <= 10,
            "{VARIABLES:?} and {OTHER_VARIABLES:?}"
        );
        for v in VARIABLES.into_iter().chain(OTHER_VARIABLES.map(|(v, _)| v)) {
            assert!(!RETIRED.contains(&v), "{v} is both");
        }
    }

    #[test]
    fn a_retired_variable_is_an_error_naming_it_and_the_choices_left() {
        for var in RETIRED {
            match with(&[(var, "1")]) {
                Err(GpuError::Config(m)) => {
                    assert!(m.contains(var) && m.contains("LMRR_CUDA_GEMM_MIN"), "{m}")
                }
                other => panic!("{var}=1: {other:?}"),
            }
        }
    }

    #[test]
    fn a_bad_value_is_an_error_naming_the_variable() {
        for (var, v) in [
            ("LMRR_CUDA_GEMM_MIN", "lots"),
            ("LMRR_CUDA_PDL", "yes"),
            ("LMRR_CUDA_LOADS_FIRST_MIN", "some"),
            ("LMRR_CUDA_ROWS4_MIN", "4.5"),
        ] {
            match with(&[(var, v)]) {
                Err(GpuError::Config(m)) => assert!(m.contains(var) && m.contains(v), "{m}"),
                other => panic!("{var}={v}: {other:?}"),
            }
        }
    }

    #[test]
    fn longest_first_orders_groups_by_their_last_position() {
        // Two spans: 20 tokens at positions 0.. and 20 at 100.. (a chunk
        // after a cached prefix), in groups of 8.
        let pos: Vec<u64> = (0..20).chain(100..120).collect();
        let mut g = prefill_groups([20usize, 20].into_iter(), 8).expect("groups");
        let parts = |v: &[u64]| -> Vec<(u64, u64)> {
            v.iter().map(|x| (x >> 32, x & 0xffff_ffff)).collect()
        };
        longest_first(&mut g, &pos);
        assert_eq!(
            parts(&g),
            vec![(36, 4), (28, 8), (20, 8), (16, 4), (8, 8), (0, 8)]
        );
        // Equal last positions keep their order; a group past `pos` sorts last.
        let mut h = vec![1u64 << 32 | 1, 2u64 << 32 | 1, 9u64 << 32 | 1, 1];
        longest_first(&mut h, &[5, 7, 7]);
        assert_eq!(parts(&h), vec![(1, 1), (2, 1), (0, 1), (9, 1)]);
    }

    #[test]
    fn prefill_groups_cut_spans_and_skip_short_ones() {
        let g = |lens: &[usize], group| prefill_groups(lens.iter().copied(), group);
        let parts = |v: Vec<u64>| -> Vec<(u64, u64)> {
            v.iter().map(|x| (x >> 32, x & 0xffff_ffff)).collect()
        };
        assert_eq!(
            g(&[40, 1, 16], 16).map(parts),
            Some(vec![(0, 16), (16, 16), (32, 8), (40, 1), (41, 16)])
        );
        assert_eq!(g(&[20], 8).map(parts), Some(vec![(0, 8), (8, 8), (16, 4)]));
        // Above PF_TQ, the kernel's limit.
        assert_eq!(g(&[17], 64).map(parts), Some(vec![(0, 16), (16, 1)]));
        // Decode steps and mostly-short steps: no groups.
        assert_eq!(g(&[1; 64], 16), None);
        assert_eq!(g(&[3, 3, 3, 20], 16), None);
        assert_eq!(g(&[], 16), None);
    }
}
