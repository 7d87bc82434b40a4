//! `lmrr proxy` and `lmrr audit`, the real binaries on loopback: an
//! unreachable upstream is a 502; an upstream that sends malformed SSE or
//! breaks off mid-event gives the client an error event while the traffic
//! keeps every byte and the reason; logprobs the proxy asked for never reach
//! the client; a client that leaves is recorded with the chunks it was handed;
//! `lmrr serve` as the upstream is judged bit-faithful; traffic for another
//! tokenizer is refused naming the first piece that does not round-trip.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lmrr_recorder::traffic::{self, Outcome, TrafficEvent, TrafficManifest, TrafficWriter};
use serde_json::{json, Value};

use crate::listening;

const MODEL: &str = "synthetic:tiny:seed0";

/// A child `lmrr` that prints `http://127.0.0.1:PORT` when it listens.
struct Proc {
    child: Child,
    port: u16,
    log: Arc<Mutex<String>>,
}

impl Proc {
    fn start(args: &[&str], cwd: &Path) -> Proc {
        let (child, port, log) = listening::spawn(args, cwd);
        Proc { child, port, log }
    }

    /// SIGTERM, then the exit code.
    fn stop(&mut self) -> Option<i32> {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let t0 = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s.code();
            }
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "did not exit: {}",
                self.log.lock().unwrap()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn proxy(upstream: &str, dir: &Path) -> Proc {
    Proc::start(
        &[
            "proxy",
            "--upstream",
            upstream,
            "--listen",
            "127.0.0.1:0",
            "--record-dir",
            "rec",
        ],
        dir,
    )
}

fn traffic_file(dir: &Path) -> PathBuf {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir.join("rec"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(v.len(), 1, "{v:?}");
    v.remove(0)
}

/// Status, headers, body (de-chunked).
fn post(port: u16, path: &str, body: &Value) -> (u16, String, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let body = body.to_string();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("headers");
    let headers = String::from_utf8_lossy(&raw[..split]).to_string();
    let mut b = &raw[split + 4..];
    let mut body = Vec::new();
    if headers
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        while let Some(nl) = b.windows(2).position(|w| w == b"\r\n") {
            let n =
                usize::from_str_radix(std::str::from_utf8(&b[..nl]).unwrap().trim(), 16).unwrap();
            if n == 0 {
                break;
            }
            body.extend_from_slice(&b[nl + 2..nl + 2 + n]);
            b = &b[nl + 2 + n + 2..];
        }
    } else {
        body = b.to_vec();
    }
    (
        headers[9..12].parse().unwrap(),
        headers,
        String::from_utf8_lossy(&body).to_string(),
    )
}

/// `data:` payloads of an SSE body.
fn data_lines(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter_map(|e| e.strip_prefix("data: ").map(str::to_string))
        .collect()
}

/// A fake upstream: answers every connection with `respond(request body)`
/// written raw (close-delimited), then closes.
fn fake_upstream(respond: fn(&Value) -> Vec<Vec<u8>>) -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for conn in l.incoming() {
            let Ok(mut c) = conn else { continue };
            std::thread::spawn(move || {
                let mut r = BufReader::new(c.try_clone().unwrap());
                let mut len = 0;
                loop {
                    let mut line = String::new();
                    if r.read_line(&mut line).unwrap_or(0) == 0 {
                        return;
                    }
                    if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                        len = v.trim().parse().unwrap();
                    }
                    if line == "\r\n" {
                        break;
                    }
                }
                let mut body = vec![0; len];
                r.read_exact(&mut body).unwrap();
                let req: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                for part in respond(&req) {
                    if c.write_all(&part).is_err() {
                        return;
                    }
                    let _ = c.flush();
                    std::thread::sleep(Duration::from_millis(2));
                }
            });
        }
    });
    port
}

const SSE_HEAD: &[u8] =
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n";

fn chunk(req: &Value, text: &str) -> Vec<u8> {
    let lp = if req["logprobs"] == json!(true) {
        json!({"content": [{"token": text, "bytes": null, "logprob": -0.5,
                            "top_logprobs": [{"token": text, "logprob": -0.5, "bytes": null}]}]})
    } else {
        Value::Null
    };
    let c = json!({"id": "x", "object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {"content": text}, "logprobs": lp, "finish_reason": null}]});
    format!("data: {c}\n\n").into_bytes()
}

#[test]
fn an_unreachable_upstream_is_a_502_and_is_recorded() {
    let dir = tempfile::tempdir().unwrap();
    // A port nobody listens on: bind, note, close.
    let dead = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut p = proxy(&format!("http://127.0.0.1:{dead}"), dir.path());
    let (status, _, body) = post(
        p.port,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "stream": true}),
    );
    assert_eq!(status, 502, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["type"], "upstream_error");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains(&dead.to_string()),
        "{body}"
    );
    assert_eq!(p.stop(), Some(0));
    let t = traffic::open(&traffic_file(dir.path())).unwrap();
    assert!(matches!(
        t.integrity,
        lmrr_recorder::Integrity::Complete { .. }
    ));
    assert!(t.events.iter().any(|e| matches!(
        e,
        TrafficEvent::End {
            outcome: Outcome::UpstreamUnreachable { .. },
            ..
        }
    )));
}

#[test]
fn malformed_sse_is_an_error_event_for_the_client_and_kept_in_the_traffic() {
    let dir = tempfile::tempdir().unwrap();
    let up = fake_upstream(|req| {
        let mut v = vec![SSE_HEAD.to_vec(), chunk(req, "Hello"), chunk(req, " world")];
        match req["model"].as_str() {
            Some("not-json") => v.push(b"data: {\"choices\": [oops\n\n".to_vec()),
            Some("cut") => v.push(b"data: {\"choices\": [{\"ind".to_vec()),
            _ => v.push(b"data: [DONE]\n\n".to_vec()),
        }
        v
    });
    let mut p = proxy(&format!("http://127.0.0.1:{up}"), dir.path());
    for (model, want) in [
        ("not-json", "is not JSON"),
        ("cut", "inside an event"),
        ("fine", ""),
    ] {
        let (status, _, body) = post(
            p.port,
            "/v1/chat/completions",
            &json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": true}),
        );
        assert_eq!(status, 200);
        let data = data_lines(&body);
        // Logprobs the proxy asked for are null for the client.
        let first: Value = serde_json::from_str(&data[0]).unwrap();
        assert_eq!(first["choices"][0]["logprobs"], Value::Null, "{body}");
        assert_eq!(first["choices"][0]["delta"]["content"], "Hello");
        let last = data.last().unwrap();
        if want.is_empty() {
            assert_eq!(last, "[DONE]");
        } else {
            let e: Value = serde_json::from_str(last).unwrap();
            assert!(
                e["error"]["message"].as_str().unwrap().contains(want),
                "{body}"
            );
        }
    }
    // The proxy lives on.
    let (status, _, _) = post(
        p.port,
        "/v1/chat/completions",
        &json!({"model": "fine", "messages": []}),
    );
    assert_eq!(status, 200);
    assert_eq!(p.stop(), Some(0));
    let t = traffic::open(&traffic_file(dir.path())).unwrap();
    let ends: Vec<&Outcome> = t
        .events
        .iter()
        .filter_map(|e| match e {
            TrafficEvent::End { outcome, .. } => Some(outcome),
            _ => None,
        })
        .collect();
    assert_eq!(ends.len(), 4);
    assert!(matches!(ends[0], Outcome::UpstreamBroken { error } if error.contains("not JSON")));
    assert!(
        matches!(ends[1], Outcome::UpstreamBroken { error } if error.contains("inside an event"))
    );
    assert_eq!(ends[2], &Outcome::Complete);
    // Every byte the upstream sent is in the traffic: the bad chunk, and the
    // logprobs that were stripped for the client.
    let chunks: Vec<String> = t
        .events
        .iter()
        .filter_map(|e| match e {
            TrafficEvent::Chunk { id: 0, data, .. } => {
                Some(String::from_utf8_lossy(data).into_owned())
            }
            _ => None,
        })
        .collect();
    assert_eq!(chunks.len(), 3);
    assert!(chunks[0].contains("\"logprob\":-0.5"), "{}", chunks[0]);
    assert_eq!(chunks[2], "{\"choices\": [oops");
    // The proxy asked for logprobs on the client's behalf.
    let asked = t.events.iter().find_map(|e| match e {
        TrafficEvent::Request {
            upstream_body: Some(b),
            ..
        } => Some(serde_json::from_slice::<Value>(b).unwrap()),
        _ => None,
    });
    assert_eq!(asked.unwrap()["top_logprobs"], 5);
}

#[test]
fn a_client_that_leaves_is_recorded_with_the_chunks_it_was_handed() {
    let dir = tempfile::tempdir().unwrap();
    let up = fake_upstream(|req| {
        let mut v = vec![SSE_HEAD.to_vec()];
        for i in 0..400 {
            v.push(chunk(req, &format!("w{i} ")));
        }
        v.push(b"data: [DONE]\n\n".to_vec());
        v
    });
    let mut p = proxy(&format!("http://127.0.0.1:{up}"), dir.path());
    let mut s = TcpStream::connect(("127.0.0.1", p.port)).unwrap();
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "stream": true}).to_string();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut r = BufReader::new(s);
    let mut seen = 0;
    while seen < 10 {
        let mut line = String::new();
        r.read_line(&mut line).unwrap();
        if line.starts_with("data: ") {
            seen += 1;
        }
    }
    drop(r);
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(p.stop(), Some(0));
    let t = traffic::open(&traffic_file(dir.path())).unwrap();
    let end = t
        .events
        .iter()
        .find_map(|e| match e {
            TrafficEvent::End {
                outcome,
                chunks_delivered,
                ..
            } => Some((outcome.clone(), *chunks_delivered)),
            _ => None,
        })
        .unwrap();
    assert_eq!(end.0, Outcome::ClientGone);
    // At least what the client read; far from all (socket buffers hold a few).
    assert!((10..300).contains(&end.1), "{end:?}");
}

#[test]
fn lmrr_serve_as_the_upstream_is_bit_faithful_and_survives_a_resend() {
    let dir = tempfile::tempdir().unwrap();
    let mut serve = Proc::start(
        &[
            "serve",
            "--model",
            MODEL,
            "--addr",
            "127.0.0.1:0",
            "--threads",
            "1",
        ],
        dir.path(),
    );
    let mut p = proxy(&format!("http://127.0.0.1:{}", serve.port), dir.path());
    let user = json!({"role": "user", "content": "Tell me about the sea and the sky."});
    let (s1, _, b1) = post(
        p.port,
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": [user], "max_tokens": 12, "temperature": 0}),
    );
    assert_eq!(s1, 200, "{b1}");
    let v: Value = serde_json::from_str(&b1).unwrap();
    assert_eq!(v["choices"][0]["logprobs"], Value::Null, "{b1}");
    let answer = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let (s2, _, b2) = post(
        p.port,
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": [user, {"role": "assistant", "content": answer},
                 {"role": "user", "content": "and the wind?"}],
                "max_tokens": 12, "temperature": 0, "stream": true}),
    );
    assert_eq!(s2, 200, "{b2}");
    let (s3, _, b3) = post(
        p.port,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "The sea is", "max_tokens": 8, "temperature": 0.8, "seed": 3}),
    );
    assert_eq!(s3, 200, "{b3}");
    assert_eq!(p.stop(), Some(0));
    let file = traffic_file(dir.path());
    let out = Command::new(env!("CARGO_BIN_EXE_lmrr"))
        .args([
            "audit",
            file.to_str().unwrap(),
            "--model",
            MODEL,
            "--threads",
            "1",
            "--json",
        ])
        .env_clear()
        .output()
        .unwrap();
    let report: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
    assert_eq!(out.status.code(), Some(0), "{report:#}");
    let turns = report["turns"].as_array().unwrap();
    assert_eq!(turns.len(), 3);
    for t in turns {
        assert_eq!(t["verdict"], "faithful", "{t:#}");
        let s = &t["stats"];
        assert!(s["tokens"].as_u64().unwrap() > 0);
        // Every logprob lmrr serve returned has the reference's bits.
        assert_eq!(s["identical_logprobs"], s["tokens"], "{t:#}");
        // Chat entries carry `bytes`; the legacy completions shape has only
        // (lossy) texts, settled against the text and the logprobs.
        let from = if t["endpoint"] == "/v1/completions" {
            "logprob tokens"
        } else {
            "logprob bytes"
        };
        assert_eq!(t["ids_from"], from, "{t:#}");
        assert_eq!(s["mean_kl"], 0.0);
    }
    for t in &turns[..2] {
        assert_eq!(t["stats"]["rank1"], t["stats"]["tokens"], "{t:#}");
        assert!(
            t["why"].as_str().unwrap().starts_with("bit-faithful"),
            "{t:#}"
        );
    }
    // The second turn has history and uses it.
    assert_eq!(turns[1]["fidelity"]["history_messages"], 2);
    serve.stop();
}

fn write_traffic(path: &Path, chunks: &[Value]) {
    write_traffic_for(path, "m", chunks)
}

fn write_traffic_for(path: &Path, model: &str, chunks: &[Value]) {
    let m = TrafficManifest::new(
        "http://127.0.0.1:1",
        "127.0.0.1:2",
        5,
        "clients",
        "test",
        "none",
    );
    let mut w = TrafficWriter::new(std::fs::File::create(path).unwrap(), &m, 1).unwrap();
    let body = json!({"model": model, "messages": [{"role": "user", "content": "Who are you?"}], "stream": true});
    w.push(TrafficEvent::Request {
        id: 0,
        at_us: 0,
        method: "POST".into(),
        path: "/v1/chat/completions".into(),
        body: body.to_string().into_bytes(),
        upstream_body: None,
    })
    .unwrap();
    w.push(TrafficEvent::Response {
        id: 0,
        at_us: 1,
        status: 200,
        content_type: "text/event-stream".into(),
    })
    .unwrap();
    for c in chunks {
        w.push(TrafficEvent::Chunk {
            id: 0,
            at_us: 2,
            data: c.to_string().into_bytes(),
        })
        .unwrap();
    }
    w.push(TrafficEvent::End {
        id: 0,
        at_us: 3,
        outcome: Outcome::Complete,
        chunks_delivered: chunks.len() as u32,
    })
    .unwrap();
    w.finish().unwrap();
}

#[test]
fn traffic_for_another_tokenizer_is_refused_naming_the_first_piece() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.lmrr");
    let entry = |tok: &str| {
        json!({"choices": [{"index": 0, "delta": {"content": tok},
        "logprobs": {"content": [{"token": tok, "logprob": -0.1, "bytes": null, "top_logprobs": []}]}}]})
    };
    // " t" is a token of the synthetic vocabulary; "Zorblaxium" is not.
    write_traffic(&path, &[entry(" t"), entry("Zorblaxium")]);
    let out = Command::new(env!("CARGO_BIN_EXE_lmrr"))
        .args([
            "audit",
            path.to_str().unwrap(),
            "--model",
            MODEL,
            "--threads",
            "1",
        ])
        .env_clear()
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("\"Zorblaxium\"") && err.contains("output token 1"),
        "{err}"
    );
    assert!(
        err.contains("does not match this model's tokenizer"),
        "{err}"
    );
    // A session bundle given to audit says what it is.
    let out = Command::new(env!("CARGO_BIN_EXE_lmrr"))
        .args([
            "audit",
            concat!(env!("CARGO_MANIFEST_DIR"), "/replays/incident.lmrr"),
        ])
        .env_clear()
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("session bundle") && err.contains("lmrr replay"),
        "{err}"
    );
}

#[test]
fn audit_without_a_model_takes_the_one_the_traffic_names_or_refuses() {
    let dir = tempfile::tempdir().unwrap();
    let entry = |tok: &str| {
        json!({"choices": [{"index": 0, "delta": {"content": tok},
        "logprobs": {"content": [{"token": tok, "logprob": -0.1, "bytes": null, "top_logprobs": []}]}}]})
    };
    let audit = |path: &Path| {
        let out = Command::new(env!("CARGO_BIN_EXE_lmrr"))
            .args(["audit", path.to_str().unwrap(), "--threads", "1"])
            .env_clear()
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    // A served name is not a model lmrr can load: refused, naming it.
    let named = dir.path().join("named.lmrr");
    write_traffic_for(&named, "smollm2", &[entry(" t")]);
    let (code, _, err) = audit(&named);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("`smollm2`") && err.contains("--model"),
        "{err}"
    );
    // A synthetic model the traffic names is the reference.
    let synth = dir.path().join("synth.lmrr");
    write_traffic_for(&synth, MODEL, &[entry(" t")]);
    let (code, out, err) = audit(&synth);
    assert!(matches!(code, Some(0 | 1)), "{err}");
    assert!(out.contains(&format!("reference {MODEL}")), "{out}");
    assert!(err.contains("as the traffic names it"), "{err}");
}
