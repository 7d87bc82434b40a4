//! `lmrr audit` on hostile traffic: whatever the chunks hold, the audit
//! returns a report (turns it cannot read are skipped with the reason) or a
//! clear error; it never panics.

use lmrr_engine::synth::{Preset, SynthSpec};
use lmrr_engine::Model;
use lmrr_kernels::Threads;
use lmrr_recorder::traffic::{self, Outcome, TrafficEvent, TrafficManifest, TrafficWriter};
use lmrr_serve::audit::{audit, Thresholds, Verdict};
use proptest::prelude::*;
use serde_json::json;

/// Path, body, status, chunks, end.
type Req = (
    String,
    Vec<u8>,
    Option<u16>,
    Vec<Vec<u8>>,
    Option<(Outcome, u32)>,
);

fn bundle(requests: Vec<Req>) -> traffic::TrafficBundle {
    let m = TrafficManifest::new("http://127.0.0.1:1", "x", 5, "clients", "t", "t");
    let mut w = TrafficWriter::new(Vec::new(), &m, 1).unwrap();
    for (id, (path, body, status, chunks, end)) in requests.into_iter().enumerate() {
        let id = id as u64;
        w.push(TrafficEvent::Request {
            id,
            at_us: 0,
            method: "POST".into(),
            path,
            body,
            upstream_body: None,
        })
        .unwrap();
        if let Some(status) = status {
            w.push(TrafficEvent::Response {
                id,
                at_us: 0,
                status,
                content_type: "text/event-stream".into(),
            })
            .unwrap();
        }
        for data in chunks {
            w.push(TrafficEvent::Chunk { id, at_us: 0, data }).unwrap();
        }
        if let Some((outcome, chunks_delivered)) = end {
            w.push(TrafficEvent::End {
                id,
                at_us: 0,
                outcome,
                chunks_delivered,
            })
            .unwrap();
        }
    }
    traffic::read(&w.finish().unwrap()).unwrap()
}

fn model() -> Model {
    Model::synthetic(SynthSpec::new(Preset::Tiny, 0)).unwrap()
}

#[test]
fn unreadable_turns_are_skipped_with_their_reason() {
    let m = model();
    let chat = |c: &str| {
        json!({"model": "m", "messages": [{"role": "user", "content": c}]})
            .to_string()
            .into_bytes()
    };
    let t = bundle(vec![
        // No end: the proxy stopped mid-request.
        (
            "/v1/chat/completions".into(),
            chat("a"),
            Some(200),
            vec![],
            None,
        ),
        // Not a request lmrr understands.
        (
            "/v1/chat/completions".into(),
            b"{not json".to_vec(),
            Some(200),
            vec![],
            Some((Outcome::Complete, 0)),
        ),
        // An error status, with the upstream's message.
        (
            "/v1/chat/completions".into(),
            chat("b"),
            Some(400),
            vec![json!({"error": {"message": "nope, 42 tokens"}})
                .to_string()
                .into_bytes()],
            Some((Outcome::Complete, 1)),
        ),
        // Prompt ids outside the vocabulary.
        (
            "/v1/completions".into(),
            json!({"model": "m", "prompt": [1, 2, 99999]})
                .to_string()
                .into_bytes(),
            Some(200),
            vec![],
            Some((Outcome::Complete, 0)),
        ),
        // Garbage chunks: no tokens.
        (
            "/v1/chat/completions".into(),
            chat("c"),
            Some(200),
            vec![
                b"\xff\xfe".to_vec(),
                b"[DONE]".to_vec(),
                b"{\"choices\": 3}".to_vec(),
            ],
            Some((Outcome::Complete, 3)),
        ),
    ]);
    let r = audit(
        &m,
        &t,
        "t",
        &Threads::new(1).unwrap(),
        Thresholds::default(),
    )
    .unwrap();
    let why: Vec<&str> = r.turns.iter().map(|t| t.why.as_str()).collect();
    assert!(
        r.turns.iter().all(|t| t.verdict == Verdict::Skipped),
        "{why:?}"
    );
    assert!(why[0].contains("no end"), "{why:?}");
    assert!(why[1].contains("not understood"), "{why:?}");
    assert!(
        why[2].contains("400") && why[2].contains("nope, 42 tokens"),
        "{why:?}"
    );
    assert!(
        why[3].contains("99999") && why[3].contains("1024"),
        "{why:?}"
    );
    assert!(why[4].contains("no output tokens"), "{why:?}");
    assert!(!r.all_faithful(), "nothing audited is not a pass");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn arbitrary_chunks_never_panic(
        chunks in prop::collection::vec(prop_oneof![
            prop::collection::vec(any::<u8>(), 0..40),
            (0u32..1024, -20.0f64..0.0, "[a-z ]{0,6}").prop_map(|(b, lp, s)| json!({"choices": [{"index": 0,
                "delta": {"content": s}, "logprobs": {"content": [{"token": s, "logprob": lp,
                "bytes": [b % 256], "top_logprobs": [{"token": "x", "logprob": lp, "bytes": null}]}]}}]})
                .to_string().into_bytes()),
        ], 0..8),
        delivered in 0u32..10,
        gone in any::<bool>(),
    ) {
        let m = model();
        let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0})
            .to_string().into_bytes();
        let outcome = if gone { Outcome::ClientGone } else { Outcome::Complete };
        let t = bundle(vec![("/v1/chat/completions".into(), body, Some(200), chunks, Some((outcome, delivered)))]);
        // A report or a clear error; never a panic.
        if let Ok(r) = audit(&m, &t, "t", &Threads::new(1).unwrap(), Thresholds::default()) {
            prop_assert_eq!(r.turns.len(), 1);
        }
    }
}
