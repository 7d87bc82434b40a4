//! `lmrr serve`, the real binary on loopback, driven by a minimal HTTP/1.1
//! client: bad input gets OpenAI-shaped 4xx errors naming the field; long
//! prompts and large tool lists work up to the context; a client that stops
//! reading blocks nobody; SIGTERM completes the bundle and SIGKILL leaves it
//! readable; a server bundle replays bit-exactly and `inspect --script`
//! turns it into a script that records the very same events.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::listening;

pub(crate) const MODEL: &str = "synthetic:tiny:seed0";

pub(crate) struct Server {
    child: Child,
    pub(crate) port: u16,
    log: Arc<Mutex<String>>,
    dir: tempfile::TempDir,
}

impl Server {
    pub(crate) fn start(extra: &[&str]) -> Server {
        let dir = tempfile::tempdir().unwrap();
        let mut args = vec!["serve", "--addr", "127.0.0.1:0", "--threads", "1"];
        args.extend(extra);
        let (child, port, log) = listening::spawn(&args, dir.path());
        Server {
            child,
            port,
            log,
            dir,
        }
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    fn signal(&mut self, sig: &str) {
        let st = Command::new("kill")
            .args([sig, &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(st.success());
    }

    /// Waits for exit; the exit code.
    fn wait(&mut self) -> Option<i32> {
        let t0 = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s.code();
            }
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "server did not exit"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn bundles(&self) -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = std::fs::read_dir(self.dir.path().join("rec"))
            .map(|d| d.map(|e| e.unwrap().path()).collect())
            .unwrap_or_default();
        v.sort();
        v
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub(crate) struct Resp {
    pub(crate) status: u16,
    headers: String,
    pub(crate) body: String,
}

impl Resp {
    pub(crate) fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }

    /// OpenAI's error shape; returns `param`.
    pub(crate) fn error_param(&self) -> Option<String> {
        let v = self.json();
        let e = &v["error"];
        assert!(e["message"].is_string(), "{}", self.body);
        assert!(e["type"].is_string(), "{}", self.body);
        e["param"].as_str().map(str::to_string)
    }
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Some(nl) = b.windows(2).position(|w| w == b"\r\n") else {
            return out;
        };
        let n = usize::from_str_radix(std::str::from_utf8(&b[..nl]).unwrap().trim(), 16).unwrap();
        if n == 0 {
            return out;
        }
        out.extend_from_slice(&b[nl + 2..nl + 2 + n]);
        b = &b[nl + 2 + n + 2..];
    }
}

fn request(port: u16, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Resp {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        head += &format!("{k}: {v}\r\n");
    }
    head += "\r\n";
    s.write_all(head.as_bytes()).unwrap();
    // A server may answer (413) before reading a large body whole.
    let _ = s.write_all(body);
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("headers");
    let headers = String::from_utf8_lossy(&raw[..split]).to_string();
    let mut body = raw[split + 4..].to_vec();
    if headers
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        body = dechunk(&body);
    }
    let status = headers[9..12].parse().unwrap();
    Resp {
        status,
        headers,
        body: String::from_utf8_lossy(&body).to_string(),
    }
}

pub(crate) fn post(port: u16, path: &str, body: &Value) -> Resp {
    request(
        port,
        "POST",
        path,
        &[("Content-Type", "application/json")],
        body.to_string().as_bytes(),
    )
}

pub(crate) fn chat_body(content: &str, max_tokens: usize) -> Value {
    json!({"model": MODEL, "messages": [{"role": "user", "content": content}],
           "max_tokens": max_tokens, "temperature": 0})
}

fn lmrr(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_lmrr"))
        .args(args)
        .env_clear()
        .output()
        .unwrap()
}

#[test]
fn bad_input_gets_openai_errors_naming_the_field_and_the_server_lives_on() {
    let s = Server::start(&[]);
    let p = s.port;
    let chat = "/v1/chat/completions";
    let r = request(p, "POST", chat, &[], b"{\"model\": ");
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("not valid JSON"));
    for (body, param) in [
        (json!({"model": MODEL}), "messages"),
        (
            json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": "warm"}),
            "temperature",
        ),
        (
            json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 2}),
            "n",
        ),
        (
            json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}),
            "model",
        ),
        (
            json!({"model": MODEL, "messages": [{"role": "user", "content": ["x"]}]}),
            "messages[0].content[0]",
        ),
        (
            json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}),
            "max_tokens",
        ),
    ] {
        let r = post(p, chat, &body);
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        assert_eq!(r.error_param().as_deref(), Some(param), "{}", r.body);
    }
    // A prompt longer than the context (2048 on the tiny model).
    let long = "lorem ipsum dolor sit amet ".repeat(600);
    let r = post(p, chat, &chat_body(&long, 4));
    assert_eq!(r.status, 400);
    assert_eq!(r.error_param().as_deref(), Some("messages"));
    let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(msg.contains("the model's context is 2048"), "{msg}");
    let r = post(
        p,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": long}),
    );
    assert_eq!(r.error_param().as_deref(), Some("prompt"), "{}", r.body);
    // Token ids outside the vocabulary.
    let r = post(
        p,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": [1, 2, 99999]}),
    );
    assert_eq!(r.error_param().as_deref(), Some("prompt[2]"), "{}", r.body);
    // The body limit.
    let big = vec![b' '; 5 << 20];
    let r = request(p, "POST", chat, &[], &big);
    assert_eq!(r.status, 413);
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("4194304"));
    // Unknown routes and methods.
    assert_eq!(request(p, "GET", "/v1/nothing", &[], b"").status, 404);
    assert_eq!(request(p, "GET", chat, &[], b"").status, 405);
    // Still serving.
    let r = post(p, chat, &chat_body("hello", 3));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["choices"][0]["finish_reason"], "length");
    assert_eq!(request(p, "GET", "/health", &[], b"").status, 200);
}

#[test]
fn an_api_key_is_required_off_loopback_and_checked_when_set() {
    let o = Command::new(env!("CARGO_BIN_EXE_lmrr"))
        .args(["serve", "--addr", "0.0.0.0:0"])
        .env_clear()
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("without --api-key"));
    let s = Server::start(&["--api-key", "sesame"]);
    let body = chat_body("hi", 2).to_string();
    let r = request(s.port, "POST", "/v1/chat/completions", &[], body.as_bytes());
    assert_eq!(r.status, 401);
    let r = request(
        s.port,
        "POST",
        "/v1/chat/completions",
        &[("Authorization", "Bearer nope")],
        body.as_bytes(),
    );
    assert_eq!(r.status, 401);
    let r = request(
        s.port,
        "POST",
        "/v1/chat/completions",
        &[("Authorization", "Bearer sesame")],
        body.as_bytes(),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(request(s.port, "GET", "/v1/models", &[], b"").status, 401);
}

#[test]
fn long_system_prompts_and_tens_of_kb_of_tools_work_up_to_the_context() {
    let s = Server::start(&[]);
    // ~1,900 tokens of system prompt on a 2,048 context; 40 KB of tools
    // (the built-in ChatML template ignores them, with a warning).
    let system = "You are an agent. Follow the rules. ".repeat(75);
    let tools: Vec<Value> = (0..60)
        .map(|i| {
            json!({"type": "function", "function": {"name": format!("tool_{i}"),
                "description": "d".repeat(500),
                "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}})
        })
        .collect();
    let body = json!({"model": MODEL, "temperature": 0, "max_tokens": 100000,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "go"}],
        "tools": tools, "tool_choice": "auto"});
    assert!(body.to_string().len() > 40_000);
    let r = post(s.port, "/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap();
    let gen = v["usage"]["completion_tokens"].as_u64().unwrap();
    assert!(prompt > 1500, "{prompt}");
    // max_tokens clamped to what the context leaves; the finish is `length`
    // unless EOS came first.
    assert!(prompt + gen <= 2049, "{prompt} + {gen}");
    let fin = v["choices"][0]["finish_reason"].as_str().unwrap();
    assert!(fin == "length" || fin == "stop");
    assert!(
        s.log().contains("`tools` ignored"),
        "no warning in {}",
        s.log()
    );
}

/// Reads an SSE response up to `n` data lines or `[DONE]`; returns them.
fn read_events(r: &mut BufReader<TcpStream>, n: usize) -> Vec<String> {
    let mut out = Vec::new();
    let mut line = String::new();
    while out.len() < n {
        line.clear();
        if r.read_line(&mut line).unwrap() == 0 {
            break;
        }
        if let Some(d) = line.trim_end().strip_prefix("data: ") {
            out.push(d.to_string());
            if d == "[DONE]" {
                break;
            }
        }
    }
    out
}

fn open_stream(port: u16, body: &Value) -> BufReader<TcpStream> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let b = body.to_string();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{b}",
        b.len()
    )
    .unwrap();
    BufReader::new(s)
}

#[test]
fn a_client_that_stops_reading_blocks_no_one_and_disconnects_are_interrupts() {
    let mut s = Server::start(&["--record-dir", "rec"]);
    let long = |max: usize| {
        json!({"model": MODEL, "messages": [{"role": "user", "content": "write a tic tac toe html page"}],
               "max_tokens": max, "temperature": 0, "ignore_eos": true, "stream": true})
    };
    // A client that sends a request, reads its first chunk (the engine has
    // taken the request), and then stops reading.
    let mut stalled = open_stream(s.port, &long(1500));
    assert_eq!(read_events(&mut stalled, 1).len(), 1);
    // Others are served meanwhile, quickly.
    let t0 = Instant::now();
    for _ in 0..3 {
        let r = post(s.port, "/v1/chat/completions", &chat_body("hi", 20));
        assert_eq!(r.status, 200);
    }
    assert!(t0.elapsed() < Duration::from_secs(30));
    // A client that reads a few chunks, then hangs up.
    let mut quitter = open_stream(s.port, &long(1500));
    let ev = read_events(&mut quitter, 3);
    assert_eq!(ev.len(), 3, "{ev:?}");
    drop(quitter);
    // The stalled request ran to its end; its client reads it all now.
    let t0 = Instant::now();
    while !s.log().contains("chatcmpl-0-0 ") {
        assert!(t0.elapsed() < Duration::from_secs(60), "{}", s.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(s.log().contains("1500 generated"), "{}", s.log());
    let ev = read_events(&mut stalled, 100_000);
    assert_eq!(ev.last().map(String::as_str), Some("[DONE]"));
    let text: String = ev
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter_map(|v| {
            v["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_string)
        })
        .collect();
    assert!(!text.is_empty());
    s.signal("-TERM");
    assert_eq!(s.wait(), Some(0), "{}", s.log());
    let bundles = s.bundles();
    assert_eq!(bundles.len(), 1);
    let b = lmrr_recorder::open(&bundles[0]).unwrap();
    assert!(matches!(
        b.integrity,
        lmrr_recorder::Integrity::Complete { .. }
    ));
    let interrupts: Vec<&str> = b
        .events
        .iter()
        .filter_map(|e| match e {
            lmrr_recorder::Event::Interrupt { name, .. } => Some(name.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(interrupts, ["chatcmpl-0-4"], "{}", s.log());
    let o = lmrr(&["replay", bundles[0].to_str().unwrap()]);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
}

fn events(path: &Path) -> Vec<lmrr_recorder::Event> {
    lmrr_recorder::open(path).unwrap().events
}

#[test]
fn a_server_bundle_replays_and_its_script_records_the_same_events() {
    let mut s = Server::start(&["--record-dir", "rec", "--max-batch-tokens", "24"]);
    // Concurrent requests: a chunked prefill, greedy and sampled, a stop
    // sequence, a follow-up turn, a disconnect mid-prefill or mid-decode.
    let p = s.port;
    let threads: Vec<_> = (0..6)
        .map(|i| {
            std::thread::spawn(move || {
                let mut b = chat_body(
                    &format!("request {i}: {}", "tell me more ".repeat(i * 3)),
                    30 + i,
                );
                if i % 2 == 1 {
                    b["temperature"] = json!(0.8);
                    b["seed"] = json!(i);
                }
                if i == 4 {
                    b["stop"] = json!(["e", "a"]);
                }
                post(p, "/v1/chat/completions", &b)
            })
        })
        .collect();
    let mut quitter = open_stream(
        p,
        &json!({"model": MODEL, "messages": [{"role": "user", "content": "x ".repeat(300)}],
                "max_tokens": 500, "temperature": 0, "stream": true}),
    );
    let _ = read_events(&mut quitter, 1);
    drop(quitter);
    for t in threads {
        let r = t.join().unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        assert!(r.headers.contains("x-lmrr-request"), "{}", r.headers);
        assert!(v["lmrr"]["digest"].as_str().unwrap().len() == 64);
    }
    s.signal("-INT");
    assert_eq!(s.wait(), Some(0), "{}", s.log());
    let bundle = s.bundles().remove(0);
    let bs = bundle.to_str().unwrap();
    let o = lmrr(&["replay", bs]);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
    assert!(String::from_utf8_lossy(&o.stdout).contains("bit-exact"));
    let script = s.dir.path().join("s.toml");
    let o = lmrr(&["inspect", bs, "--script", script.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let again = s.dir.path().join("again.lmrr");
    let o = lmrr(&[
        "run",
        "--script",
        script.to_str().unwrap(),
        "--model",
        MODEL,
        "--pool-pages",
        "512",
        "--max-batch-tokens",
        "24",
        "--record",
        again.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let a = events(&bundle);
    let b = events(&again);
    assert!(a
        .iter()
        .any(|e| matches!(e, lmrr_recorder::Event::Interrupt { .. })));
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert_eq!(x, y, "event {i}");
    }
}

#[test]
fn sigkill_leaves_a_bundle_readable_up_to_its_last_frame() {
    let mut s = Server::start(&["--record-dir", "rec"]);
    let mut generated = 0;
    for i in 0..3 {
        let r = post(
            s.port,
            "/v1/chat/completions",
            &chat_body(&format!("q{i}"), 40),
        );
        assert_eq!(r.status, 200);
        generated += r.json()["usage"]["completion_tokens"].as_u64().unwrap();
    }
    // Idle now: everything recorded so far has been handed to the OS.
    std::thread::sleep(Duration::from_millis(200));
    s.signal("-KILL");
    s.wait();
    let bundle = s.bundles().remove(0);
    let o = lmrr(&["inspect", bundle.to_str().unwrap()]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("TRUNCATED"), "{out}");
    assert!(out.contains("3 requests"), "{out}");
    assert!(out.contains(&format!("{generated} generated")), "{out}");
    let o = lmrr(&["replay", bundle.to_str().unwrap()]);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
}

#[test]
fn bundles_rotate_by_request_count_and_each_replays_alone() {
    let mut s = Server::start(&["--record-dir", "rec", "--rotate-requests", "2"]);
    let mut seen = Vec::new();
    for i in 0..5 {
        let r = post(
            s.port,
            "/v1/chat/completions",
            &chat_body(&format!("q{i}"), 6),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        seen.push((
            v["id"].as_str().unwrap().to_string(),
            v["lmrr"]["bundle"].as_str().unwrap().to_string(),
        ));
    }
    s.signal("-TERM");
    assert_eq!(s.wait(), Some(0), "{}", s.log());
    let ids: Vec<&str> = seen.iter().map(|(i, _)| i.as_str()).collect();
    assert_eq!(
        ids,
        [
            "chatcmpl-0-0",
            "chatcmpl-0-1",
            "chatcmpl-1-0",
            "chatcmpl-1-1",
            "chatcmpl-2-0"
        ]
    );
    let bundles = s.bundles();
    assert_eq!(bundles.len(), 3, "{bundles:?}");
    for (k, b) in bundles.iter().enumerate() {
        let name = b.file_name().unwrap().to_str().unwrap();
        assert!(name.ends_with(&format!("-{:04}.lmrr", k + 1)), "{name}");
        assert_eq!(seen[2 * k].1, name);
        let o = lmrr(&["replay", b.to_str().unwrap()]);
        assert_eq!(
            o.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&o.stdout)
        );
        let o = lmrr(&["inspect", b.to_str().unwrap()]);
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(out.contains("integrity   complete"), "{out}");
        assert!(
            out.contains(if k < 2 { "2 requests" } else { "1 request " }),
            "{out}"
        );
    }
}

#[test]
fn a_server_bundle_diverges_under_a_cache_patch_like_a_scripted_one() {
    let mut s = Server::start(&["--record-dir", "rec"]);
    // A harness's system prompt, cached by a first turn; a second turn with
    // it is streamed and cancelled (its cached pages are shared with the
    // tree when it aborts); a third turn follows.
    let system = "You are a coding agent. Keep answers short. ".repeat(4);
    let turn = |user: &str, max: usize, stream: bool| {
        json!({"model": MODEL, "temperature": 0, "max_tokens": max, "stream": stream,
               "ignore_eos": true,
               "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]})
    };
    assert_eq!(
        post(s.port, "/v1/chat/completions", &turn("hi", 4, false)).status,
        200
    );
    let mut quitter = open_stream(s.port, &turn("write a tic tac toe html page", 1500, true));
    assert_eq!(read_events(&mut quitter, 5).len(), 5);
    drop(quitter);
    std::thread::sleep(Duration::from_millis(300));
    let r = post(
        s.port,
        "/v1/chat/completions",
        &turn("to a file", 30, false),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    s.signal("-TERM");
    assert_eq!(s.wait(), Some(0), "{}", s.log());
    let b = s.bundles().remove(0);
    let b = b.to_str().unwrap();
    let o = lmrr(&["replay", b]);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
    let o = lmrr(&["replay", b, "--patches", "abort-frees-shared"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(1), "{out}");
    assert!(out.contains("DIVERGED"), "{out}");
    let o = lmrr(&["replay", b, "--bisect"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("culprit") && out.contains("abort-frees-shared"),
        "{out}"
    );
}

/// `lmrr serve --disaggregate`: every request's digest (its tokens and
/// logits bits) is the colocated server's; the bundle starts with the
/// deployment, replays bit-exactly, and its script re-run on the same
/// deployment records the same events.
#[test]
fn a_disaggregated_server_answers_with_the_colocated_bits_and_its_bundle_replays() {
    let pd = [
        "--disaggregate",
        "--page-size",
        "4",
        "--decode-page-size",
        "8",
        "--decode-pool-pages",
        "300",
        "--transfer-pages-per-step",
        "2",
    ];
    let mut args = vec!["--record-dir", "rec", "--max-batch-tokens", "24"];
    args.extend(pd);
    let mut s = Server::start(&args);
    let colocated = Server::start(&["--max-batch-tokens", "24"]);
    let bodies: Vec<Value> = (0..4)
        .map(|i| {
            let mut b = chat_body(&format!("request {i}: {}", "go on ".repeat(i * 4)), 12 + i);
            if i % 2 == 1 {
                b["temperature"] = json!(0.8);
                b["seed"] = json!(i);
            }
            b
        })
        .collect();
    let ask = |port: u16| -> Vec<String> {
        let threads: Vec<_> = bodies
            .iter()
            .cloned()
            .map(|b| std::thread::spawn(move || post(port, "/v1/chat/completions", &b)))
            .collect();
        threads
            .into_iter()
            .map(|t| {
                let r = t.join().unwrap();
                assert_eq!(r.status, 200, "{}", r.body);
                r.json()["lmrr"]["digest"].as_str().unwrap().to_string()
            })
            .collect()
    };
    let split = ask(s.port);
    let mut quitter = open_stream(
        s.port,
        &json!({"model": MODEL, "messages": [{"role": "user", "content": "x ".repeat(200)}],
                "max_tokens": 300, "temperature": 0, "stream": true}),
    );
    let _ = read_events(&mut quitter, 1);
    drop(quitter);
    assert_eq!(split, ask(colocated.port), "digests of the two deployments");
    s.signal("-INT");
    assert_eq!(s.wait(), Some(0), "{}", s.log());
    let bundle = s.bundles().remove(0);
    let a = events(&bundle);
    assert!(matches!(a[0], lmrr_recorder::Event::Disaggregated(_)));
    assert!(a
        .iter()
        .any(|e| matches!(e, lmrr_recorder::Event::PdStep(_))));
    let bs = bundle.to_str().unwrap();
    let o = lmrr(&["replay", bs]);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
    assert!(String::from_utf8_lossy(&o.stdout).contains("bit-exact"));
    let script = s.dir.path().join("s.toml");
    let o = lmrr(&["inspect", bs, "--script", script.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = std::fs::read_to_string(&script).unwrap();
    assert!(
        text.contains("--disaggregate --decode-page-size 8"),
        "{text}"
    );
    let again = s.dir.path().join("again.lmrr");
    let mut run = vec![
        "run",
        "--script",
        script.to_str().unwrap(),
        "--model",
        MODEL,
        "--pool-pages",
        "512",
        "--max-batch-tokens",
        "24",
        "--record",
        again.to_str().unwrap(),
    ];
    run.extend(pd);
    let o = lmrr(&run);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let b = events(&again);
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert_eq!(x, y, "event {i}");
    }
}
