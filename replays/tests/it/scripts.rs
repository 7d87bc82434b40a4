//! Session scripts end to end through the recorder and the replayer: an
//! interrupt in the middle of a chunked prefill (`interrupt_at_step`) is
//! recorded and replays bit-exactly on every family, and today's script
//! driver still produces every committed bundle's session event for event.

use crate::common;

use common::families;
use common::model;
use lmrr_engine::scheduler::Decision;
use lmrr_engine::{EngineConfig, Model, PatchSet, Preset};
use lmrr_kernels::Threads;
use lmrr_recorder::{Bundle, Event};
use lmrr_replays::{replay, Outcome, ReplayOptions};

fn record(m: &Model, src: &str, cfg: EngineConfig, patches: PatchSet) -> Bundle {
    common::record_then(m, src, cfg, patches, |sch| {
        sch.check_accounting().unwrap();
        assert_eq!(sch.pages_held_by_requests(), 0);
        assert_eq!(sch.free_pages() + sch.cached_pages(), cfg.pool_pages);
    })
}

/// A client that disconnects while its long prompt is still being prefilled
/// in 8-token chunks, a retry with the same prompt, and a bystander decoding
/// alongside.
const DISCONNECT: &str = r#"
[[request]]
id = "bystander"
prompt = "hello"
max_tokens = 12
ignore_eos = true

[[request]]
id = "long"
prompt = "the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the lazy dog."
max_tokens = 8
interrupt_at_step = 3

[[request]]
id = "retry"
after = "long"
prompt = "the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the lazy dog."
max_tokens = 6
"#;

per_family!(an_interrupt_in_the_middle_of_a_chunked_prefill_is_recorded_and_replays_bit_exactly);

fn an_interrupt_in_the_middle_of_a_chunked_prefill_is_recorded_and_replays_bit_exactly(p: Preset) {
    let m = families::model(p);
    let cfg = EngineConfig {
        page_size: 4,
        pool_pages: 64,
        max_batch_tokens: 8,
        prefix_cache: true,
    };
    let b = record(m, DISCONNECT, cfg, PatchSet::none());
    // Recorded: the interrupt event before step 3, and step 3's decision.
    let interrupts: Vec<(u64, &str)> = b
        .events
        .iter()
        .filter_map(|e| match e {
            Event::Interrupt { step, name, .. } => Some((*step, name.as_str())),
            _ => None,
        })
        .collect();
    assert_eq!(interrupts, [(3, "long")]);
    let steps: Vec<_> = b
        .events
        .iter()
        .filter_map(|e| match e {
            Event::Step(r) => Some(r),
            _ => None,
        })
        .collect();
    assert!(steps[3].decisions.contains(&Decision::Interrupt { id: 1 }));
    // Mid-prefill: `long` computed part of its prompt and sampled nothing.
    let prompt_len = b
        .events
        .iter()
        .find_map(|e| match e {
            Event::Arrival { name, request, .. } if name == "long" => Some(request.prompt.len()),
            _ => None,
        })
        .unwrap();
    let computed: usize = steps
        .iter()
        .flat_map(|r| &r.decisions)
        .filter_map(|d| match d {
            Decision::Schedule { id: 1, len, .. } => Some(*len),
            _ => None,
        })
        .sum();
    assert!(
        computed > 0 && computed < prompt_len,
        "{computed} of {prompt_len}"
    );
    // The retry (the same prompt) runs past mini-v4's first sparse position.
    families::assert_reaches_sparse(m, prompt_len, "the retry");
    assert!(steps
        .iter()
        .flat_map(|r| &r.seqs)
        .all(|s| s.id != 1 || s.sampled.is_none()));
    // Replays bit-exactly, on any thread count.
    for t in [1, 2] {
        match replay(
            &b,
            m,
            &ReplayOptions::new(PatchSet::none(), Threads::new(t).unwrap()),
        )
        .unwrap()
        {
            Outcome::BitExact { truncated, .. } => assert!(!truncated),
            o => panic!("{o}"),
        }
    }
}

/// An event without its top-k logprobs: those are for reports, computed
/// with the platform's f64 `ln` outside the contract, and may differ in the
/// last bit between the recording host and this one.
fn contract_part(e: &Event) -> Event {
    let mut e = e.clone();
    if let Event::Step(r) = &mut e {
        for s in &mut r.seqs {
            s.top_logprobs.clear();
        }
    }
    e
}

#[test]
fn the_script_driver_still_produces_every_committed_session() {
    let m = model();
    for name in ["incident", "long-recall", "multi-user", "sampled"] {
        let path = format!("{}/{name}.lmrr", env!("CARGO_MANIFEST_DIR"));
        let old = lmrr_recorder::open(std::path::Path::new(&path)).unwrap();
        let patches = PatchSet::parse(&old.manifest.patches.join(",")).unwrap();
        let new = record(
            &m,
            &old.manifest.source.script,
            old.manifest.engine,
            patches,
        );
        assert_eq!(old.events.len(), new.events.len(), "{name}");
        let differs = |i: &usize| contract_part(&old.events[*i]) != contract_part(&new.events[*i]);
        if let Some(i) = (0..old.events.len()).find(differs) {
            panic!(
                "{name}: event {i} differs\nrecorded {:?}\nnow      {:?}",
                old.events[i], new.events[i]
            );
        }
    }
}
