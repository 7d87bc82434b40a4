//! What the recompute oracle can and cannot see on mini-v4: the three mini-v4
//! patches are pure functions of a sequence's tokens (they keep every
//! invariance), so a bundle recorded under one of them agrees with a
//! cache-off recomputation under the same patch: the oracle finds nothing,
//! like the deployment's coherence checks. Only a replay against the
//! reference engine (or a bisect) shows them. A cache patch, by contrast, is
//! caught by the oracle on mini-v4 as on llama.

use crate::common;

use lmrr_engine::{EngineConfig, Model, PatchSet, Preset, SynthSpec};
use lmrr_kernels::Threads;
use lmrr_replays::{oracle, replay, ReplayOptions};

const SESSION: &str = include_str!("../../../examples/v4-agent.toml");

#[test]
fn the_oracle_is_blind_to_the_mini_v4_patches_and_replay_is_not() {
    let m = Model::synthetic(SynthSpec::new(Preset::MiniV4Tiny, 0)).unwrap();
    let th = Threads::new(2).unwrap();
    for p in ["mhc-bf16", "moe-routed-scaling", "indexer-early-exit"] {
        let set = PatchSet::parse(p).unwrap();
        let b = common::record(&m, SESSION, EngineConfig::default(), set.clone());
        let o = oracle(&b, &m, &ReplayOptions::new(set, th.clone())).unwrap();
        assert!(o.is_bit_exact(), "{p}: the oracle agrees with itself:\n{o}");
        let r = replay(&b, &m, &ReplayOptions::new(PatchSet::none(), th.clone())).unwrap();
        assert!(!r.is_bit_exact(), "{p}: the reference replay diverges");
    }
    // The cache path the incident implicates is caught by the oracle.
    let set = PatchSet::parse("abort-inserts-partial").unwrap();
    let b = common::record(&m, SESSION, EngineConfig::default(), set.clone());
    let o = oracle(&b, &m, &ReplayOptions::new(set, th)).unwrap();
    assert!(!o.is_bit_exact(), "abort-inserts-partial on mini-v4:\n{o}");
}
