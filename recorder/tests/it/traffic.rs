//! Traffic bundles: same framing as session bundles, their own kind.

use lmrr_recorder::traffic::{self, Outcome, TrafficEvent, TrafficManifest, TrafficWriter};
use lmrr_recorder::{BundleError, Integrity};

fn manifest() -> TrafficManifest {
    TrafficManifest::new(
        "http://127.0.0.1:9",
        "127.0.0.1:8",
        5,
        "clients",
        "test",
        "none",
    )
}

fn events(n: u64) -> Vec<TrafficEvent> {
    let mut ev = Vec::new();
    for id in 0..n {
        ev.push(TrafficEvent::Request {
            id,
            at_us: id * 10,
            method: "POST".into(),
            path: "/v1/chat/completions".into(),
            body: format!("{{\"n\":{id}}}").into_bytes(),
            upstream_body: (id % 2 == 0).then(|| b"{}".to_vec()),
        });
        ev.push(TrafficEvent::Response {
            id,
            at_us: id * 10 + 1,
            status: 200,
            content_type: "text/event-stream".into(),
        });
        for c in 0..3 {
            ev.push(TrafficEvent::Chunk {
                id,
                at_us: id * 10 + 2 + c,
                data: format!("{{\"c\":{c}}}").into_bytes(),
            });
        }
        ev.push(TrafficEvent::End {
            id,
            at_us: id * 10 + 9,
            outcome: if id == 1 {
                Outcome::ClientGone
            } else {
                Outcome::Complete
            },
            chunks_delivered: if id == 1 { 2 } else { 3 },
        });
    }
    ev
}

fn write(ev: &[TrafficEvent]) -> Vec<u8> {
    let mut w = TrafficWriter::new(Vec::new(), &manifest(), 1).unwrap();
    for e in ev {
        w.push(e.clone()).unwrap();
    }
    w.finish().unwrap()
}

#[test]
fn traffic_round_trips_and_is_complete() {
    let ev = events(4);
    let bytes = write(&ev);
    let b = traffic::read(&bytes).unwrap();
    assert_eq!(b.events, ev);
    assert_eq!(b.manifest.upstream, "http://127.0.0.1:9");
    assert!(matches!(b.integrity, Integrity::Complete { .. }));
}

#[test]
fn a_killed_proxy_leaves_every_finished_request() {
    let ev = events(4);
    let bytes = write(&ev);
    // Cut inside the last frames: everything flushed before is still there.
    for cut in [bytes.len() - 1, bytes.len() - 40, bytes.len() / 2] {
        let b = traffic::read(&bytes[..cut]).unwrap();
        assert!(
            matches!(b.integrity, Integrity::Truncated { .. }),
            "cut {cut}"
        );
        assert_eq!(b.events[..], ev[..b.events.len()]);
    }
}

#[test]
fn the_two_kinds_refuse_each_other_by_name() {
    let bytes = write(&events(1));
    let e = lmrr_recorder::read(&bytes).unwrap_err();
    assert!(matches!(e, BundleError::WrongKind { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("traffic bundle") && msg.contains("lmrr audit"),
        "{msg}"
    );

    let session = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../replays/incident.lmrr"
    ))
    .unwrap();
    let e = traffic::read(&session).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("session bundle") && msg.contains("lmrr replay"),
        "{msg}"
    );
}

#[test]
fn a_flipped_byte_is_an_error_naming_the_frame() {
    let bytes = write(&events(3));
    for i in (16..bytes.len()).step_by(7) {
        let mut b = bytes.clone();
        b[i] ^= 0x40;
        match traffic::read(&b) {
            Err(BundleError::Corrupt { .. }) | Err(BundleError::WrongKind { .. }) => {}
            Ok(r) => assert!(
                !matches!(r.integrity, Integrity::Complete { .. }) || r.events != events(3),
                "byte {i} flipped and the bundle reads whole and equal"
            ),
            Err(e) => panic!("byte {i}: unexpected error {e}"),
        }
    }
}
