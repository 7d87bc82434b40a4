//! The patch registry: named alternative code paths modelled on real
//! optimisations and real bugs of inference servers. The reference engine runs
//! with none; `--patches a,b` selects a set. Patches are allowed to break the
//! contract — detecting that is what replay is for — but never to panic.
//!
//! Each patch documents what it changes, the real-world code it is modelled on,
//! and when it fires (a patch that never fires in its own scenario is a bug;
//! `replays/tests/it/replay.rs`'s `every_catalog_patch_fires_in_its_scenario_and_the_others_are_inert`
//! holds one scenario per patch of a colocated engine;
//! `replays/tests/it/disagg.rs` one per patch of a disaggregated deployment).

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

/// One catalog entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Patch {
    /// Split-K decode attention whose split count follows the batch size.
    SplitkDecode,
    /// Approximate exp in the attention softmax.
    FastExp,
    /// An interrupted request's unfinished last page enters the radix tree.
    AbortInsertsPartial,
    /// An interrupted request frees the cached pages it shared with the tree.
    AbortFreesShared,
    /// mini-v4: the hyper-connection mixing GEMM in bf16.
    MhcBf16,
    /// mini-v4: the routed-scaling factor applied before normalisation in hash layers.
    MoeRoutedScaling,
    /// mini-v4: the sparse indexer stops scanning once its top-k looks full.
    IndexerEarlyExit,
    /// Disaggregated: an abort frees the decode side's reserved pages while
    /// the transfer still writes them.
    PdAbortReusesPages,
    /// Disaggregated: a prefill aborted mid-transfer reports the transfer
    /// complete; decode starts on K/V never fully written.
    PdAbortIncompleteKv,
    /// Disaggregated: a request aborted after its transfer, before
    /// admission, never frees its decode pages.
    PdAbortLeaks,
}

/// Class of a patch: what kind of divergence it produces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum PatchClass {
    /// Changes logits bits (numerics); behaviour usually survives.
    Numerical,
    /// Corrupts the KV cache or its accounting.
    CacheCorruption,
    /// Changes what the model computes (which experts' weight, which context
    /// it reads), not just rounding.
    Semantic,
}

impl Patch {
    /// The patches that act on a colocated engine (one scheduler), in listing
    /// order: every bundle's bisect searches these.
    pub const ALL: [Patch; 7] = [
        Patch::SplitkDecode,
        Patch::FastExp,
        Patch::AbortInsertsPartial,
        Patch::AbortFreesShared,
        Patch::MhcBf16,
        Patch::MoeRoutedScaling,
        Patch::IndexerEarlyExit,
    ];

    /// The patches that act only on a disaggregated deployment's abort and
    /// transfer paths (inert on a colocated engine); a disaggregated
    /// bundle's bisect searches these too.
    pub const DISAGGREGATED: [Patch; 3] = [
        Patch::PdAbortReusesPages,
        Patch::PdAbortIncompleteKv,
        Patch::PdAbortLeaks,
    ];

    /// The whole catalog, in listing order.
    pub const CATALOG: [Patch; 10] = [
        Patch::SplitkDecode,
        Patch::FastExp,
        Patch::AbortInsertsPartial,
        Patch::AbortFreesShared,
        Patch::MhcBf16,
        Patch::MoeRoutedScaling,
        Patch::IndexerEarlyExit,
        Patch::PdAbortReusesPages,
        Patch::PdAbortIncompleteKv,
        Patch::PdAbortLeaks,
    ];

    /// Whether the patch acts only on a disaggregated deployment.
    pub fn disaggregated_only(self) -> bool {
        Self::DISAGGREGATED.contains(&self)
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::SplitkDecode => "splitk-decode",
            Self::FastExp => "fast-exp",
            Self::AbortInsertsPartial => "abort-inserts-partial",
            Self::AbortFreesShared => "abort-frees-shared",
            Self::MhcBf16 => "mhc-bf16",
            Self::MoeRoutedScaling => "moe-routed-scaling",
            Self::IndexerEarlyExit => "indexer-early-exit",
            Self::PdAbortReusesPages => "pd-abort-reuses-pages",
            Self::PdAbortIncompleteKv => "pd-abort-incomplete-kv",
            Self::PdAbortLeaks => "pd-abort-leaks",
        }
    }

    pub fn class(self) -> PatchClass {
        match self {
            Self::SplitkDecode | Self::FastExp => PatchClass::Numerical,
            Self::AbortInsertsPartial | Self::AbortFreesShared => PatchClass::CacheCorruption,
            Self::MhcBf16 => PatchClass::Numerical,
            Self::MoeRoutedScaling | Self::IndexerEarlyExit => PatchClass::Semantic,
            Self::PdAbortReusesPages | Self::PdAbortIncompleteKv | Self::PdAbortLeaks => {
                PatchClass::CacheCorruption
            }
        }
    }

    /// The model family whose structure the patch changes (`None`: every
    /// family: attention patches act in the attention every family has, cache
    /// patches in the scheduler). On another family the patch is inert.
    pub fn family(self) -> Option<crate::model::Family> {
        match self {
            Self::MhcBf16 | Self::MoeRoutedScaling | Self::IndexerEarlyExit => {
                Some(crate::model::Family::MiniV4)
            }
            _ => None,
        }
    }

    /// Whether the patch can act on a model of `family`.
    pub fn applies_to(self, family: crate::model::Family) -> bool {
        self.family().is_none_or(|f| f == family)
    }

    /// What the patch does and what it is modelled on.
    pub fn doc(self) -> &'static str {
        match self {
            Self::SplitkDecode => {
                "Decode attention (one query token) splits the keys into as many parts as there are \
                 sequences in the batch (at most 4) and merges the partial softmax states as a tree, \
                 not in tile order. Modelled on split-K / flash-decoding kernels whose split count is \
                 picked from the batch shape. Breaks I2: a sequence's logits change with its batch-mates. \
                 Fires on decode steps with two or more sequences."
            }
            Self::FastExp => {
                "The attention softmax uses a cheaper exp (degree-3 polynomial after the same range \
                 reduction, ~1e-4 relative error) instead of det_exp. Modelled on fast-math exp \
                 approximations in fused attention kernels. Changes logits bits from the first step."
            }
            Self::AbortInsertsPartial => {
                "When a request is interrupted, its unfinished last page is inserted into the radix tree \
                 as a partial node keyed by the tokens it covers — including the last sampled token, whose \
                 K/V was never computed — and later requests whose tokens continue that prefix reuse it, \
                 writing into the shared page. Modelled on SGLang #38319 / PR #22790 (abort path inserts \
                 unfinished pages into the radix cache). Fires on every interrupt after at least one token."
            }
            Self::AbortFreesShared => {
                "When a request is interrupted, the pages it had matched from the prefix cache are released \
                 to the free list although the tree still references them; the next allocations reuse them \
                 and overwrite cached K/V. Modelled on TensorRT-LLM PR #15018 and SGLang PR #32564 (abort \
                 frees pages still shared). Fires when an interrupted request had a prefix-cache hit."
            }
            Self::MhcBf16 => {
                "mini-v4: the hyper-connection mixing projection (the \"MHC mixing GEMM\", every layer, \
                 both sub-blocks, prefill and decode) runs with its weights and its normalised inputs \
                 rounded to bf16, products accumulated in f32, as a bf16 tensor-core GEMM does. \
                 Modelled on a deployment patch that cast the fp32 mixing weights to bf16 for speed. \
                 Changes logits bits from the first step."
            }
            Self::MoeRoutedScaling => {
                "mini-v4: in the hash-routed layers (the first n_hash_layers), the routed-scaling factor \
                 multiplies the expert scores before the gates are normalised instead of after, so it \
                 cancels: the routed experts contribute routed_scaling_factor times too little. Modelled \
                 on a rewrite of the routed-scaling step in a hash_topk routing kernel. Fires on every \
                 token (every token passes the hash layers)."
            }
            Self::IndexerEarlyExit => {
                "mini-v4: the sparse-attention indexer scans index blocks from the newest backwards and \
                 stops once index_topk scanned blocks score above a threshold, so on a long context the \
                 early blocks are never considered and attention never reads them. Exact while the \
                 context has index_topk blocks or fewer, which is how it passed single-turn coherence \
                 checks. Modelled on an early-exit-per-page sparse indexer kernel. Fires once a query's \
                 context exceeds index_topk blocks."
            }
            Self::PdAbortReusesPages => {
                "Disaggregated deployments: when a request is aborted while its K/V is being transferred, \
                 the decode side returns the pages it reserved for it to the free list at once, but the \
                 transfer is not cancelled: the prefill side goes on writing the remaining pages into the \
                 page ids it was given, which the next reservation or decode step has taken. The next \
                 request reads another request's K/V. Modelled on SGLang issue #24527 (decode reuses KV \
                 pages before the prefill transfer writer finishes). Fires when an abort lands with pages \
                 still to transfer."
            }
            Self::PdAbortIncompleteKv => {
                "Disaggregated deployments: a request aborted on the prefill side while its K/V is being \
                 transferred concludes the transfer as a success: the decode side is told the K/V is \
                 complete, admits the request and decodes it on pages of which only the transferred ones \
                 were written (the rest hold whatever an earlier request left). Modelled on SGLang issue \
                 #30233 (aborted prefill requests make decode generate garbage from an incomplete KV \
                 cache). Fires when an abort lands with pages still to transfer."
            }
            Self::PdAbortLeaks => {
                "Disaggregated deployments: a request aborted after its K/V was transferred but before the \
                 decode side admitted it is dropped from the admission queue without releasing its \
                 reserved pages. Each such abort leaks a request's worth of decode pages until no \
                 reservation fits and the deployment stops making progress (a livelock whose report names \
                 the leaked pages). Modelled on SGLang PR #9817 (decode-side KV leak of requests aborted \
                 in the transfer queue). Fires when an abort lands between a transfer's completion and \
                 the admission."
            }
        }
    }
}

impl std::fmt::Display for Patch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Patch {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Patch::CATALOG
            .iter()
            .copied()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Patch::CATALOG.iter().map(|p| p.name()).collect();
                format!("unknown patch `{s}` (known: {})", names.join(", "))
            })
    }
}

/// A set of patches.
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct PatchSet(BTreeSet<Patch>);

impl PatchSet {
    pub fn none() -> Self {
        Self::default()
    }

    pub fn all() -> Self {
        Self(Patch::CATALOG.into_iter().collect())
    }

    /// Every patch that can act on a model of `family`, the default search
    /// space of a bisect.
    pub fn all_for(family: crate::model::Family) -> Self {
        Self(
            Patch::ALL
                .into_iter()
                .filter(|p| p.applies_to(family))
                .collect(),
        )
    }

    /// The default search space of a bisect on a bundle of `family`: with
    /// `disaggregated`, the patches of a disaggregated deployment too.
    pub fn all_for_deployment(family: crate::model::Family, disaggregated: bool) -> Self {
        let mut s = Self::all_for(family);
        if disaggregated {
            s.0.extend(Patch::DISAGGREGATED);
        }
        s
    }

    /// The patches of this set that cannot act on `family` (inert there).
    pub fn inert_for(&self, family: crate::model::Family) -> Vec<Patch> {
        self.iter().filter(|p| !p.applies_to(family)).collect()
    }

    pub fn contains(&self, p: Patch) -> bool {
        self.0.contains(&p)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn iter(&self) -> impl Iterator<Item = Patch> + '_ {
        self.0.iter().copied()
    }

    /// Parses `a,b,c` (empty string or `none` = no patches, `all` = the catalog).
    pub fn parse(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if s.is_empty() || s == "none" {
            return Ok(Self::none());
        }
        if s == "all" {
            return Ok(Self::all());
        }
        s.split(',')
            .map(|x| x.trim().parse())
            .collect::<Result<BTreeSet<_>, _>>()
            .map(Self)
    }

    /// Names, sorted, as stored in bundles.
    pub fn names(&self) -> Vec<String> {
        self.0.iter().map(|p| p.name().to_string()).collect()
    }
}

impl FromIterator<Patch> for PatchSet {
    fn from_iter<I: IntoIterator<Item = Patch>>(iter: I) -> Self {
        Self(iter.into_iter().collect())
    }
}

impl std::fmt::Display for PatchSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0.is_empty() {
            return f.write_str("none");
        }
        f.write_str(&self.names().join(","))
    }
}
