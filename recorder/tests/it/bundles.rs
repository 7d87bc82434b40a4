//! Bundles as untrusted input: round trip, then hand-corrupted copies — a bit
//! flip in every region, truncation at every frame boundary and inside frames,
//! oversized lengths, foreign files, wrong versions. Nothing may panic; every
//! failure names what and where; truncation keeps what was complete. The
//! tests of recorded content run on a session of each family's tiny model.

#[macro_use]
#[path = "../../../engine/tests/common/families.rs"]
mod families;

use lmrr_engine::session::SessionEvent;
use lmrr_engine::{run_session, EngineConfig, PatchSet, Preset, Scheduler, Script};
use lmrr_kernels::Threads;
use lmrr_recorder::format::{FRAME_HEADER_LEN, HEADER_LEN, MAX_FRAME_COMPRESSED, MAX_FRAME_RAW};
use lmrr_recorder::{read, BundleError, Event, Integrity, Manifest, Recorder, Summary};

const SCRIPT: &str = r#"
[[request]]
id = "a"
messages = [{ role = "user", content = "hello, tell me all about the sea and its tides" }]
max_tokens = 12
ignore_eos = true

[[request]]
id = "b"
after = "a"
messages = [{ role = "user", content = "hello, tell me all about the sea and its tides" }, { role = "assistant", from = "a" }, { role = "user", content = "more" }]
max_tokens = 20
interrupt_after_tokens = 7
"#;

per_family!(
    a_bundle_round_trips_every_event,
    a_bit_flip_anywhere_is_an_error_or_a_flagged_truncation_never_a_panic,
    truncation_at_every_frame_boundary_keeps_the_complete_frames,
    truncation_at_every_byte_never_panics,
);

/// Records [`SCRIPT`] on the family's tiny model.
fn record(p: Preset) -> (Vec<u8>, Vec<Event>) {
    let m = families::model(p);
    let script = Script::parse(SCRIPT, "t.toml").unwrap();
    let cfg = EngineConfig {
        page_size: 4,
        ..Default::default()
    };
    let manifest = Manifest::for_session(
        m,
        cfg,
        &PatchSet::none(),
        "t.toml",
        SCRIPT,
        5,
        1,
        "test",
        "test",
    );
    let mut sch = Scheduler::new(m.net(), cfg, Threads::single()).unwrap();
    sch.set_top_logprobs(5);
    let mut rec = Recorder::new(Vec::new(), &manifest).unwrap();
    let mut seen = Vec::new();
    run_session(m, &script, &mut sch, |e: SessionEvent| {
        seen.push(match &e {
            SessionEvent::Arrival {
                step,
                name,
                request,
            } => Event::Arrival {
                step: *step,
                name: name.to_string(),
                request: (*request).clone(),
            },
            SessionEvent::Interrupt { step, name, id } => Event::Interrupt {
                step: *step,
                name: name.to_string(),
                id: *id,
            },
            SessionEvent::Step(r) => Event::Step((*r).clone()),
            SessionEvent::PdStep(r) => Event::PdStep(Box::new((*r).clone())),
        });
        rec.observe(e)
    })
    .unwrap();
    (rec.finish().unwrap(), seen)
}

/// Byte offsets where frames start (the header ends at HEADER_LEN).
fn frame_starts(b: &[u8]) -> Vec<usize> {
    let mut out = Vec::new();
    let mut off = HEADER_LEN;
    while off + FRAME_HEADER_LEN <= b.len() {
        out.push(off);
        let len = u32::from_le_bytes(b[off + 4..off + 8].try_into().unwrap()) as usize;
        off += FRAME_HEADER_LEN + len;
    }
    out
}

fn a_bundle_round_trips_every_event(p: Preset) {
    let (bytes, events) = record(p);
    let b = read(&bytes).unwrap();
    assert!(matches!(b.integrity, Integrity::Complete { .. }));
    assert_eq!(b.events, events);
    let longest = b
        .events
        .iter()
        .filter_map(|e| match e {
            Event::Arrival { request, .. } => Some(request.prompt.len()),
            _ => None,
        })
        .max()
        .unwrap();
    families::assert_reaches_sparse(families::model(p), longest, "the longest prompt");
    assert_eq!(b.frames, frame_starts(&bytes).len());
    let s = Summary::of(&b);
    assert_eq!(
        (s.requests, s.turns, s.interrupts, s.generated_tokens),
        (2, 1, 1, 12 + 7)
    );
    assert!(
        s.token_data_bytes_per_token < 4.0,
        "{}",
        s.token_data_bytes_per_token
    );
    // Top-5 logprobs recorded and ordered.
    let tops: Vec<_> = b
        .events
        .iter()
        .filter_map(|e| {
            if let Event::Step(r) = e {
                r.seqs
                    .iter()
                    .find(|s| s.sampled.is_some())
                    .map(|s| s.top_logprobs.clone())
            } else {
                None
            }
        })
        .collect();
    assert!(tops
        .iter()
        .all(|t| t.len() == 5 && t.windows(2).all(|w| w[0].1 >= w[1].1)));
}

fn a_bit_flip_anywhere_is_an_error_or_a_flagged_truncation_never_a_panic(p: Preset) {
    let (bytes, _) = record(p);
    let starts = frame_starts(&bytes);
    for i in 0..bytes.len() {
        for bit in [0u8, 3, 7] {
            let mut c = bytes.clone();
            c[i] ^= 1 << bit;
            match read(&c) {
                Ok(b) => {
                    // Only a flip in a length field can look like a truncation,
                    // and then it must say so.
                    assert!(
                        matches!(b.integrity, Integrity::Truncated { .. }),
                        "flip at byte {i} bit {bit} went unnoticed"
                    );
                }
                Err(e) => {
                    let msg = e.to_string();
                    if let BundleError::Corrupt { frame, offset, .. } = &e {
                        assert!(
                            *frame <= starts.len() && (*offset as usize) < bytes.len(),
                            "{msg}"
                        );
                    }
                    assert!(!msg.is_empty());
                }
            }
        }
    }
}

fn truncation_at_every_frame_boundary_keeps_the_complete_frames(p: Preset) {
    let (bytes, events) = record(p);
    let starts = frame_starts(&bytes);
    for (k, &cut) in starts.iter().enumerate().skip(1) {
        let b = read(&bytes[..cut]).unwrap();
        assert_eq!(b.frames, k);
        match &b.integrity {
            Integrity::Truncated { frames, offset, .. } => {
                assert_eq!((*frames, *offset as usize), (k, cut))
            }
            other => panic!("cut at {cut}: {other:?}"),
        }
        assert_eq!(b.events[..], events[..b.events.len()], "cut at {cut}");
        // And inside the next frame: same events, still flagged.
        for inside in [
            cut + 1,
            cut + FRAME_HEADER_LEN - 1,
            cut + FRAME_HEADER_LEN + 1,
        ] {
            if inside < bytes.len() {
                let t = read(&bytes[..inside]).unwrap();
                assert_eq!(t.events.len(), b.events.len());
                assert!(matches!(t.integrity, Integrity::Truncated { .. }));
            }
        }
    }
    // Before the manifest is complete there is nothing to read.
    for cut in [0, 5, HEADER_LEN, HEADER_LEN + 3, starts[1] - 1] {
        let e = read(&bytes[..cut]).unwrap_err();
        assert!(
            matches!(
                e,
                BundleError::NoManifest { .. } | BundleError::Foreign { .. }
            ),
            "cut {cut}: {e}"
        );
    }
}

fn truncation_at_every_byte_never_panics(p: Preset) {
    let (bytes, _) = record(p);
    for cut in 0..bytes.len() {
        let _ = read(&bytes[..cut]);
    }
}

#[test]
fn oversized_lengths_are_refused_before_allocating() {
    let (bytes, _) = record(Preset::Tiny);
    let starts = frame_starts(&bytes);
    let at = starts[1];
    let mut c = bytes.clone();
    c[at + 4..at + 8].copy_from_slice(&u32::MAX.to_le_bytes());
    let e = read(&c).unwrap_err().to_string();
    assert!(
        e.contains("frame 1") && e.contains(&MAX_FRAME_COMPRESSED.to_string()),
        "{e}"
    );
    let mut c = bytes.clone();
    c[at + 8..at + 12].copy_from_slice(&u32::MAX.to_le_bytes());
    let e = read(&c).unwrap_err().to_string();
    assert!(
        e.contains("frame 1") && e.contains(&MAX_FRAME_RAW.to_string()),
        "{e}"
    );
    assert!(e.contains(&format!("byte {at}")), "{e}");
}

#[test]
fn foreign_files_and_other_versions_are_named() {
    let e = read(b"PK\x03\x04 this is a zip file").unwrap_err();
    assert!(matches!(e, BundleError::Foreign { .. }), "{e}");
    assert!(e.to_string().contains("PK"), "{e}");
    let (mut bytes, _) = record(Preset::Tiny);
    let supported = lmrr_recorder::FORMAT_VERSION;
    bytes[8..12].copy_from_slice(&(supported + 5).to_le_bytes());
    let e = read(&bytes).unwrap_err().to_string();
    assert!(
        e.contains(&format!("version {}", supported + 5))
            && e.contains(&format!(
                "reads versions {} to {supported}",
                lmrr_recorder::MIN_READ_VERSION
            ))
            && e.contains("newer lmrr"),
        "{e}"
    );
    // A bundle of format 1 (file-hash identities) is refused with the reason.
    bytes[8..12].copy_from_slice(&1u32.to_le_bytes());
    let e = read(&bytes).unwrap_err().to_string();
    assert!(
        e.contains("format version 1,") && e.contains("older lmrr") && e.contains("by content"),
        "{e}"
    );
    assert!(read(b"").is_err());
}

#[test]
fn bytes_after_the_trailer_are_corruption() {
    let (mut bytes, _) = record(Preset::Tiny);
    bytes.extend_from_slice(b"junk");
    let e = read(&bytes).unwrap_err().to_string();
    assert!(e.contains("after the trailer"), "{e}");
}

#[test]
fn continued_histories_counts_strict_extensions_and_scales_linearly() {
    use lmrr_recorder::summary::continued_histories;
    use std::collections::BTreeMap;
    let prompts: BTreeMap<u64, Vec<u32>> = [
        (0, vec![1, 2]),
        (1, vec![1, 2, 3, 4, 5]),    // extends 0's history [1, 2, 3]
        (2, vec![1, 2, 3]),          // equals 0's history: not a strict extension
        (3, vec![1, 2, 3, 9, 9, 9]), // extends 0 and 2 ([1, 2, 3] + no output)
    ]
    .into_iter()
    .collect();
    let outputs: BTreeMap<u64, Vec<u32>> = [(0, vec![3]), (1, vec![6])].into_iter().collect();
    let c = continued_histories(&[0, 1, 2, 3], &prompts, &outputs);
    assert_eq!(c.values().copied().collect::<Vec<_>>(), vec![0, 1, 0, 2]);
    // 100,000 arrivals of one prompt: quadratic in requests would not finish.
    let n = 100_000u64;
    let prompts: BTreeMap<u64, Vec<u32>> = (0..n).map(|i| (i, vec![7, 8, 9])).collect();
    let order: Vec<u64> = (0..n).collect();
    let c = continued_histories(&order, &prompts, &BTreeMap::new());
    assert!(c.values().all(|&k| k == 0));
    let prompts: BTreeMap<u64, Vec<u32>> = (0..n)
        .map(|i| (i, if i == 0 { vec![7] } else { vec![7, 8] }))
        .collect();
    let c = continued_histories(&order, &prompts, &BTreeMap::new());
    assert_eq!(c[&(n - 1)], 1);
}
