//! Drives `replay` (under the bundle's own patches and another set) and the
//! recompute oracle on the tiny model with structure-aware mutations of real
//! bundles. The input's first byte picks the seed recording and the other
//! patch set; the rest is a list of mutation operations
//! (`replays/tests/mutator`), applied to the decoded bundle, which is then
//! framed again with valid checksums so that it reaches validation and the
//! replayer. Any outcome but a panic, a hang or an abort is fine.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use lmrr_engine::{Model, PatchSet};
use lmrr_recorder::Bundle;

#[path = "../../tests/mutator/mod.rs"]
mod mutator;

struct Fixture {
    model: Model,
    seeds: Vec<Bundle>,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let model = mutator::model();
        let seeds = ["none", "abort-frees-shared", "abort-inserts-partial"]
            .iter()
            .map(|p| mutator::seed_bundle(&model, PatchSet::parse(p).expect("catalog patch")))
            .collect();
        Fixture { model, seeds }
    })
}

fuzz_target!(|data: &[u8]| {
    let f = fixture();
    let Some((&pick, ops)) = data.split_first() else {
        return;
    };
    let seed = &f.seeds[pick as usize % f.seeds.len()];
    let other = ["none", "fast-exp", "splitk-decode", "abort-inserts-partial"][(pick >> 4) as usize % 4];
    let (manifest, events) = mutator::mutate(seed, ops);
    let bytes = mutator::reframe(&manifest, events);
    mutator::exercise(&f.model, &bytes, PatchSet::parse(other).expect("catalog patch"));
});
