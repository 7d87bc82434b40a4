//! `lmrr serve`'s logprobs, on the real binary over loopback: streamed and
//! whole chat logprobs are the engine's bits for every sampled token (held
//! against a solo greedy run of the engine itself), the legacy completions
//! shape, a stop sequence keeping the entry of the token that completed it,
//! and validation errors naming the field. The harness is `serve.rs`'s.

use serde_json::{json, Value};

use crate::serve::{chat_body, post, Server, MODEL};

/// The `data:` events of an SSE body, as JSON, without `[DONE]`.
fn sse_events(body: &str) -> Vec<Value> {
    assert!(body.ends_with("data: [DONE]\n\n"), "{body}");
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap_or_else(|e| panic!("{e}: {d}")))
        .collect()
}

/// A JSON logprob back to the engine's f32, as a client would read it.
fn f32_of(v: &Value) -> f32 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}")) as f32
}

/// The bytes of a chat logprob entry.
fn entry_bytes(e: &Value) -> Vec<u8> {
    e["bytes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| u8::try_from(b.as_u64().unwrap()).unwrap())
        .collect()
}

/// The tokens a solo greedy run of `prompt` samples on the test model, each
/// with its logits row (the engine directly: no server, no batch).
fn solo_greedy_rows(prompt: &[u32], max_tokens: usize) -> Vec<(u32, Vec<f32>)> {
    let model =
        lmrr_engine::Model::synthetic(lmrr_engine::SynthSpec::new(lmrr_engine::Preset::Tiny, 0))
            .unwrap();
    let mut sch = lmrr_engine::Scheduler::new(
        model.net(),
        lmrr_engine::EngineConfig::default(),
        lmrr_kernels::Threads::single(),
    )
    .unwrap();
    sch.set_keep_rows(true);
    sch.submit(lmrr_engine::scheduler::Request {
        id: 0,
        prompt: prompt.to_vec(),
        sampling: lmrr_engine::SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        },
        max_tokens,
        stop_at_eos: true,
    })
    .unwrap();
    let mut out = Vec::new();
    while !sch.is_idle() {
        let rep = sch.step().unwrap();
        for s in &rep.seqs {
            if let Some(t) = s.sampled {
                let (_, row) = sch.last_rows().iter().find(|(id, _)| *id == s.id).unwrap();
                out.push((t, row.clone()));
            }
        }
    }
    out
}

#[test]
fn streamed_chat_logprobs_are_the_engines_bits_for_every_sampled_token() {
    let s = Server::start(&[]);
    let content = "tell me about logprobs";
    let max_tokens = 40;
    let mut body = chat_body(content, max_tokens);
    body["stream"] = json!(true);
    body["logprobs"] = json!(true);
    body["top_logprobs"] = json!(5);
    body["stream_options"] = json!({"include_usage": true});
    let r = post(s.port, "/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let ev = sse_events(&r.body);
    // The role chunk and the usage chunk carry no logprobs.
    assert_eq!(ev[0]["choices"][0]["logprobs"], Value::Null);
    assert_eq!(ev.last().unwrap()["choices"], json!([]));
    let mut text = String::new();
    let mut entries = Vec::new();
    for e in &ev[1..ev.len() - 1] {
        let c = &e["choices"][0];
        if let Some(t) = c["delta"]["content"].as_str() {
            text.push_str(t);
            // A text chunk of a request with logprobs has the object.
            assert!(c["logprobs"]["content"].is_array(), "{e}");
        }
        if let Some(a) = c["logprobs"]["content"].as_array() {
            entries.extend(a.iter().cloned());
        }
    }
    let usage = &ev.last().unwrap()["usage"];
    let generated = usage["completion_tokens"].as_u64().unwrap() as usize;
    assert!(!entries.is_empty());
    // Greedy: every sampled token is its own top-1, five alternatives each.
    for e in &entries {
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 5, "{e}");
        assert_eq!(
            f32_of(&e["logprob"]).to_bits(),
            f32_of(&top[0]["logprob"]).to_bits()
        );
        assert_eq!(e["token"], top[0]["token"]);
        assert_eq!(e["bytes"], top[0]["bytes"]);
        for w in top.windows(2) {
            assert!(f32_of(&w[0]["logprob"]) >= f32_of(&w[1]["logprob"]), "{e}");
        }
    }
    // Entries joined are the text (lossily where the model wrote invalid
    // UTF-8, exactly otherwise).
    let bytes: Vec<u8> = entries.iter().flat_map(entry_bytes).collect();
    assert_eq!(String::from_utf8_lossy(&bytes), text);
    if std::str::from_utf8(&bytes).is_ok() {
        assert_eq!(bytes, text.as_bytes());
    }
    // Independently: the same prompt through the engine alone.
    let model =
        lmrr_engine::Model::synthetic(lmrr_engine::SynthSpec::new(lmrr_engine::Preset::Tiny, 0))
            .unwrap();
    let rendered = lmrr_serve::template::Renderer::new(&model)
        .unwrap()
        .render(
            &[lmrr_serve::api::ChatMessage {
                role: "user".into(),
                content: Some(content.into()),
                extra: Default::default(),
            }],
            None,
            None,
        )
        .unwrap();
    let prompt = model.tokenizer.encode(&rendered.text).unwrap();
    assert_eq!(usage["prompt_tokens"].as_u64(), Some(prompt.len() as u64));
    let solo = solo_greedy_rows(&prompt, max_tokens);
    assert_eq!(solo.len(), generated);
    let table = model.tokenizer.byte_table();
    // An EOS that ends the request has an entry only if it is text.
    let silent_eos = solo.last().is_some_and(|(t, _)| {
        model.net().is_eos(*t) && model.tokenizer.decode(&[*t]).unwrap().is_empty()
    });
    assert_eq!(entries.len(), generated - usize::from(silent_eos));
    for (i, (e, (t, row))) in entries.iter().zip(&solo).enumerate() {
        assert_eq!(entry_bytes(e), table[*t as usize], "token {i}");
        let want = lmrr_engine::scheduler::token_logprob(row, *t).unwrap();
        assert_eq!(
            f32_of(&e["logprob"]).to_bits(),
            want.to_bits(),
            "token {i}: {} vs {want}",
            e["logprob"]
        );
        let top = lmrr_engine::scheduler::top_logprobs(row, 5);
        for (j, (a, (tt, lp))) in e["top_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .zip(&top)
            .enumerate()
        {
            assert_eq!(entry_bytes(a), table[*tt as usize], "token {i} alt {j}");
            assert_eq!(
                f32_of(&a["logprob"]).to_bits(),
                lp.to_bits(),
                "token {i} alt {j}"
            );
        }
    }
}

#[test]
fn logprob_shapes_chat_whole_and_completions_legacy() {
    let s = Server::start(&[]);
    // Non-streaming chat: all entries in choices[0].logprobs.content.
    let mut body = chat_body("shapes", 8);
    body["ignore_eos"] = json!(true);
    body["logprobs"] = json!(true);
    let r = post(s.port, "/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let c = &v["choices"][0];
    let content = c["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 8);
    for e in content {
        assert!(e["token"].is_string() && e["logprob"].is_f64(), "{e}");
        assert_eq!(e["top_logprobs"], json!([]), "{e}");
    }
    let bytes: Vec<u8> = content.iter().flat_map(entry_bytes).collect();
    assert_eq!(
        String::from_utf8_lossy(&bytes),
        c["message"]["content"].as_str().unwrap()
    );
    // Without logprobs: null, as before, and a stream's chunks are the old
    // ones: the role, one per non-empty text piece, the finish.
    body["logprobs"] = json!(false);
    let v = post(s.port, "/v1/chat/completions", &body).json();
    assert_eq!(v["choices"][0]["logprobs"], Value::Null);
    body["stream"] = json!(true);
    let ev = sse_events(&post(s.port, "/v1/chat/completions", &body).body);
    for (i, e) in ev.iter().enumerate() {
        let c = &e["choices"][0];
        assert_eq!(c["logprobs"], Value::Null, "{e}");
        let keys: Vec<&String> = c["delta"].as_object().unwrap().keys().collect();
        match i {
            0 => assert_eq!(keys, ["content", "role"]),
            _ if i == ev.len() - 1 => assert!(keys.is_empty(), "{e}"),
            _ => assert_ne!(c["delta"]["content"], "", "{e}"),
        }
    }
    body["stream"] = json!(false);
    // Completions, legacy shape, whole and streamed.
    let cbody = json!({"model": MODEL, "prompt": "legacy", "max_tokens": 6,
                       "temperature": 0, "ignore_eos": true, "logprobs": 2});
    let r = post(s.port, "/v1/completions", &cbody);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let lp = &v["choices"][0]["logprobs"];
    let n = |k: &str| lp[k].as_array().unwrap().len();
    assert_eq!(
        (
            n("tokens"),
            n("token_logprobs"),
            n("top_logprobs"),
            n("text_offset")
        ),
        (6, 6, 6, 6),
        "{lp}"
    );
    assert_eq!(lp["text_offset"][0], 0);
    for (i, alts) in lp["top_logprobs"].as_array().unwrap().iter().enumerate() {
        let alts = alts.as_object().unwrap();
        // Two alternatives, fewer when two share their text.
        assert!((1..=2).contains(&alts.len()), "{alts:?}");
        // Greedy: the sampled token is the likeliest alternative.
        let best = alts.values().map(f32_of).fold(f32::NEG_INFINITY, f32::max);
        assert_eq!(best.to_bits(), f32_of(&lp["token_logprobs"][i]).to_bits());
    }
    let tokens: String = lp["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    let text = v["choices"][0]["text"].as_str().unwrap();
    if !text.contains('\u{FFFD}') {
        assert_eq!(tokens, text);
    }
    let mut sbody = cbody.clone();
    sbody["stream"] = json!(true);
    let r = post(s.port, "/v1/completions", &sbody);
    let ev = sse_events(&r.body);
    let mut streamed =
        json!({"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []});
    for e in &ev {
        let l = &e["choices"][0]["logprobs"];
        if l.is_null() {
            continue;
        }
        for k in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
            let more = l[k].as_array().unwrap().clone();
            streamed[k].as_array_mut().unwrap().extend(more);
        }
    }
    assert_eq!(
        &streamed, lp,
        "streamed chunks join into the whole response's logprobs"
    );
    // `logprobs: 0`: the sampled token alone.
    let mut z = cbody.clone();
    z["logprobs"] = json!(0);
    let v = post(s.port, "/v1/completions", &z).json();
    assert_eq!(v["choices"][0]["logprobs"]["top_logprobs"][0], json!({}));
    assert_eq!(
        v["choices"][0]["logprobs"]["token_logprobs"],
        lp["token_logprobs"]
    );
}

#[test]
fn a_stop_sequence_keeps_the_entry_of_the_token_that_completed_it() {
    let s = Server::start(&[]);
    // The greedy text of this prompt, then the same with a stop inside it.
    let mut body = chat_body("stop here", 30);
    body["ignore_eos"] = json!(true);
    body["logprobs"] = json!(true);
    let v = post(s.port, "/v1/chat/completions", &body).json();
    let full = v["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .clone();
    let text = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    // A stop sequence made of a token's whole (ASCII) text that does not
    // occur before it: the stop completes with that token, `k`.
    let (k, pos, stop) = (2..full.len())
        .find_map(|k| {
            let b = entry_bytes(&full[k]);
            let stop = std::str::from_utf8(&b).ok()?;
            if b.is_empty() || !b.iter().all(u8::is_ascii_graphic) {
                return None;
            }
            let before: Vec<u8> = full[..k].iter().flat_map(entry_bytes).collect();
            let pos = String::from_utf8_lossy(&before).len();
            (text[..pos + b.len()].find(stop) == Some(pos)).then(|| (k, pos, stop.to_string()))
        })
        .unwrap_or_else(|| panic!("no token of {text:?} can serve as a stop"));
    body["stop"] = json!([stop]);
    body["stream"] = json!(true);
    let r = post(s.port, "/v1/chat/completions", &body);
    let ev = sse_events(&r.body);
    let entries: Vec<Value> = ev
        .iter()
        .filter_map(|e| e["choices"][0]["logprobs"]["content"].as_array())
        .flatten()
        .cloned()
        .collect();
    let streamed: String = ev
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed, text[..pos]);
    assert_eq!(
        entries,
        full[..=k].to_vec(),
        "entries through the token that completed `{stop}`"
    );
    assert_eq!(ev.last().unwrap()["choices"][0]["finish_reason"], "stop");
}

#[test]
fn logprob_validation_errors_are_400s_naming_the_field() {
    let s = Server::start(&[]);
    let chat = |extra: Value| {
        let mut b = chat_body("x", 2);
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        post(s.port, "/v1/chat/completions", &b)
    };
    for (r, param, number) in [
        (
            chat(json!({"logprobs": true, "top_logprobs": 21})),
            "top_logprobs",
            "21",
        ),
        (chat(json!({"top_logprobs": 2})), "top_logprobs", "2"),
        (
            post(
                s.port,
                "/v1/completions",
                &json!({"model": MODEL, "prompt": "x", "logprobs": 6}),
            ),
            "logprobs",
            "6",
        ),
    ] {
        assert_eq!(r.status, 400, "{}", r.body);
        assert_eq!(r.error_param().as_deref(), Some(param), "{}", r.body);
        assert!(
            r.json()["error"]["message"]
                .as_str()
                .unwrap()
                .contains(number),
            "{}",
            r.body
        );
    }
}
