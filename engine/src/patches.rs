//! The patch registry: named alternative code paths modelled on real
//! optimisations and real bugs of inference servers. The reference engine runs
//! with none; `--patches a,b` selects a set. Patches are allowed to break the
//! contract — detecting that is what replay is for — but never to panic.
//!
//! Each patch documents what it changes, the real-world code it is modelled on,
//! and when it fires (a patch that never fires in its own scenario is a bug;
//! `engine/tests/patches.rs` holds one scenario per patch).

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
}

/// Class of a patch: what kind of divergence it produces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum PatchClass {
    /// Changes logits bits (numerics); behaviour usually survives.
    Numerical,
    /// Corrupts the KV cache or its accounting.
    CacheCorruption,
}

impl Patch {
    /// The whole llama-family catalog, in listing order.
    pub const ALL: [Patch; 4] = [
        Patch::SplitkDecode,
        Patch::FastExp,
        Patch::AbortInsertsPartial,
        Patch::AbortFreesShared,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Self::SplitkDecode => "splitk-decode",
            Self::FastExp => "fast-exp",
            Self::AbortInsertsPartial => "abort-inserts-partial",
            Self::AbortFreesShared => "abort-frees-shared",
        }
    }

    pub fn class(self) -> PatchClass {
        match self {
            Self::SplitkDecode | Self::FastExp => PatchClass::Numerical,
            Self::AbortInsertsPartial | Self::AbortFreesShared => PatchClass::CacheCorruption,
        }
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
        Patch::ALL
            .iter()
            .copied()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Patch::ALL.iter().map(|p| p.name()).collect();
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
        Self(Patch::ALL.into_iter().collect())
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
