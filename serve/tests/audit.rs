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
    typed_bundle(requests, "text/event-stream")
}

/// [`bundle`] with every response of `content_type`.
fn typed_bundle(requests: Vec<Req>, content_type: &str) -> traffic::TrafficBundle {
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
                content_type: content_type.into(),
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

/// An answer that is a tool call with text around it, as a server with
/// `tools` shows it: content only the text outside the call (trimmed), the
/// call in `tool_calls`, logprob entries for every token sampled.
#[test]
fn a_tool_call_turn_is_audited_from_its_logprob_entries() {
    let m = model();
    let output = "Checking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\nDone.";
    let ids = m.tokenizer.encode(output).unwrap();
    let table = m.tokenizer.byte_table();
    let body = json!({"model": "m", "temperature": 0,
        "messages": [{"role": "user", "content": "weather in Paris?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]})
    .to_string()
    .into_bytes();
    let call = json!({"id": "call_x_0", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}});
    // With `bytes` (lmrr serve, OpenAI) or the token's text alone.
    let entries = |with_bytes: bool| -> Vec<serde_json::Value> {
        ids.iter()
            .map(|&t| {
                let b = &table[t as usize];
                json!({"token": String::from_utf8_lossy(b), "logprob": -1.0,
                       "bytes": if with_bytes { json!(b) } else { json!(null) },
                       "top_logprobs": []})
            })
            .collect()
    };
    let whole = |with_bytes: bool| -> Vec<Vec<u8>> {
        vec![json!({"choices": [{"index": 0,
            "message": {"role": "assistant", "content": "Checking.\n\nDone.", "tool_calls": [call]},
            "logprobs": {"content": entries(with_bytes)}, "finish_reason": "tool_calls"}]})
        .to_string()
        .into_bytes()]
    };
    let streamed = |with_bytes: bool| -> Vec<Vec<u8>> {
        let e = entries(with_bytes);
        let (a, b) = e.split_at(2);
        let mut call = call.clone();
        call["index"] = json!(0);
        [
            json!({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]}),
            json!({"choices": [{"index": 0, "delta": {"content": "Checking."}, "logprobs": {"content": a}, "finish_reason": null}]}),
            json!({"choices": [{"index": 0, "delta": {"tool_calls": [call]}, "logprobs": {"content": b}, "finish_reason": null}]}),
            json!({"choices": [{"index": 0, "delta": {"content": "\n\nDone."}, "logprobs": {"content": []}, "finish_reason": null}]}),
            json!({"choices": [{"index": 0, "delta": {}, "logprobs": null, "finish_reason": "tool_calls"}]}),
        ]
        .iter()
        .map(|v| v.to_string().into_bytes())
        .chain([b"[DONE]".to_vec()])
        .collect()
    };
    let req = |chunks: Vec<Vec<u8>>| -> Req {
        let n = chunks.len() as u32;
        (
            "/v1/chat/completions".into(),
            body.clone(),
            Some(200),
            chunks,
            Some((Outcome::Complete, n)),
        )
    };
    let run = |t: traffic::TrafficBundle| {
        audit(
            &m,
            &t,
            "t",
            &Threads::new(1).unwrap(),
            Thresholds::default(),
        )
        .unwrap()
    };
    let streams = run(bundle(vec![req(streamed(true)), req(streamed(false))]));
    let wholes = run(typed_bundle(
        vec![req(whole(true)), req(whole(false))],
        "application/json",
    ));
    for (i, t) in streams.turns.iter().chain(&wholes.turns).enumerate() {
        assert_ne!(t.verdict, Verdict::Skipped, "turn {i}: {}", t.why);
        let audited: Vec<u32> = t.tokens.iter().map(|x| x.id).collect();
        assert_eq!(audited, ids, "turn {i}: {:?}", t.notes);
        let from = if i % 2 == 0 {
            "logprob bytes"
        } else {
            "logprob tokens"
        };
        assert_eq!(t.ids_from, from, "turn {i}");
        assert_eq!(t.answer, "Checking.\n\nDone.", "turn {i}");
        assert_eq!(t.finish_reason.as_deref(), Some("tool_calls"), "turn {i}");
        assert!(
            t.notes
                .iter()
                .any(|n| n.contains("1 tool call(s) (get_weather)")),
            "turn {i}: {:?}",
            t.notes
        );
    }
    // No entries: the text outside the call is not the output; skipped.
    let mut chunks = whole(true);
    let mut v: serde_json::Value = serde_json::from_slice(&chunks[0]).unwrap();
    v["choices"][0]["logprobs"] = json!(null);
    chunks[0] = v.to_string().into_bytes();
    let r = run(typed_bundle(vec![req(chunks)], "application/json"));
    assert_eq!(r.turns[0].verdict, Verdict::Skipped);
    assert!(
        r.turns[0].why.contains("no logprob entries"),
        "{}",
        r.turns[0].why
    );
}

/// A turn of `tokens` tokens, `identical` of whose returned logprobs have
/// the reference's bits, at `verdict` with `mean_kl`.
fn turn(
    n: usize,
    tokens: usize,
    identical: usize,
    verdict: Verdict,
    mean_kl: Option<f64>,
) -> lmrr_serve::audit::Turn {
    lmrr_serve::audit::Turn {
        turn: n,
        request: n as u64,
        endpoint: "/v1/chat/completions".into(),
        asks: String::new(),
        temperature: 0.0,
        interrupted_after_chunks: None,
        after_interrupt: false,
        cached_tokens: None,
        prompt_tokens: 10,
        upstream_prompt_tokens: None,
        ids_from: "logprob bytes".into(),
        answer: String::new(),
        finish_reason: None,
        stats: lmrr_serve::audit::TurnStats {
            tokens,
            rank1: tokens,
            identical_logprobs: identical,
            returned_logprobs: tokens,
            mean_kl,
            ..Default::default()
        },
        verdict,
        why: String::new(),
        fidelity: None,
        notes: Vec::new(),
        tokens: Vec::new(),
    }
}

#[test]
fn a_bit_faithful_upstream_that_stops_matching_after_an_interrupt_is_broken_after_interrupt() {
    use lmrr_serve::audit::change::{judge, Event, UpstreamVerdict};
    let th = Thresholds::default();
    // Turn 1 is cut by its client; turn 2 follows it and, though still
    // "faithful" by level (a small KL), no longer has the reference's bits.
    let mut t = vec![
        turn(0, 4, 4, Verdict::Faithful, Some(0.0)),
        turn(1, 30, 30, Verdict::Faithful, Some(0.0)),
        turn(2, 40, 0, Verdict::Faithful, Some(0.01)),
        turn(3, 30, 0, Verdict::Drifted, Some(0.25)),
    ];
    t[1].interrupted_after_chunks = Some(30);
    t[1].cached_tokens = Some(16);
    t[2].after_interrupt = true;
    let (cal, change, v) = judge(&t, &th);
    assert_eq!(v, UpstreamVerdict::BrokenAfterInterrupt);
    let cal = cal.expect("turn 0 calibrates");
    assert_eq!(cal.turns, [0], "turn 1's cache hit ends the calibration");
    assert!(cal.bit_faithful);
    let c = change.expect("a change point");
    assert_eq!(c.turn, 2);
    assert!(c.right_after);
    assert_eq!(
        c.event,
        Some(Event::Interrupt {
            turn: 1,
            request: 1,
            after_chunks: 30
        })
    );
    // The same traffic with the interrupt's turn matching: no change point,
    // the level verdict stands.
    t[2].stats.identical_logprobs = 40;
    t[3].stats.identical_logprobs = 30;
    t[3].verdict = Verdict::Faithful;
    let (_, change, v) = judge(&t, &th);
    assert!(change.is_none(), "{change:?}");
    assert_eq!(v, UpstreamVerdict::Faithful);
}

#[test]
fn a_steady_upstream_with_its_own_arithmetic_has_no_change_point() {
    use lmrr_serve::audit::change::{judge, UpstreamVerdict, CHANGE_FACTOR};
    let th = Thresholds::default();
    // llama.cpp-like: never the reference's bits, a small steady KL.
    let mut t = vec![
        turn(0, 4, 0, Verdict::Faithful, Some(0.0015)),
        turn(1, 30, 0, Verdict::Faithful, Some(0.0013)),
        turn(2, 40, 0, Verdict::Faithful, Some(0.0017)),
    ];
    t[1].interrupted_after_chunks = Some(30);
    t[2].after_interrupt = true;
    let (cal, change, v) = judge(&t, &th);
    assert!(!cal.expect("calibrated").bit_faithful);
    assert!(change.is_none(), "{change:?}");
    assert_eq!(v, UpstreamVerdict::Faithful);
    // A turn worse than the calibration by level and by KL is a change.
    t[2].verdict = Verdict::Drifted;
    t[2].stats.mean_kl = Some(th.kl_drift.max(CHANGE_FACTOR * 0.0015) * 2.0);
    let (_, change, v) = judge(&t, &th);
    assert_eq!(change.map(|c| c.turn), Some(2));
    assert_eq!(v, UpstreamVerdict::BrokenAfterInterrupt);
    // Worse by level but within the calibrated KL: noise, not a change.
    t[2].stats.mean_kl = Some(0.0016);
    let (_, change, v) = judge(&t, &th);
    assert!(change.is_none(), "{change:?}");
    assert_eq!(v, UpstreamVerdict::Drifted);
}
