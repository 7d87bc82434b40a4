//! How a served request ends, on the real binary: an EOS that ends a request
//! is not in its `content` (nor streamed), and a non-streaming client that
//! hangs up before its answer is an interrupt, recorded in the bundle like a
//! streaming client's, which replays bit-exactly.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::listening;

const MODEL: &str = "synthetic:tiny:seed0";

struct Server {
    child: Child,
    port: u16,
    log: std::sync::Arc<std::sync::Mutex<String>>,
    dir: tempfile::TempDir,
}

impl Server {
    fn start() -> Server {
        let dir = tempfile::tempdir().unwrap();
        let args = [
            "serve",
            "--addr",
            "127.0.0.1:0",
            "--threads",
            "1",
            "--record-dir",
            "rec",
        ];
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

    /// SIGTERM, then the one bundle it recorded.
    fn stop(mut self) -> (std::path::PathBuf, tempfile::TempDir) {
        let st = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(st.success());
        let t0 = Instant::now();
        while self.child.try_wait().unwrap().is_none() {
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "server did not exit"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let mut v: Vec<_> = std::fs::read_dir(self.dir.path().join("rec"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert_eq!(v.len(), 1, "{v:?}");
        let dir = std::mem::replace(&mut self.dir, tempfile::tempdir().unwrap());
        (v.remove(0), dir)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sends `body` to the chat endpoint; the raw response (headers and body).
fn send(port: u16, body: &Value) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let b = body.to_string();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{b}",
        b.len()
    )
    .unwrap();
    s
}

fn read_all(mut s: TcpStream) -> String {
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    String::from_utf8_lossy(&raw).to_string()
}

/// The JSON body of a non-streaming answer (chunked or not).
fn json_body(raw: &str) -> Value {
    let body = &raw[raw.find("\r\n\r\n").expect("headers") + 4..];
    let start = body.find('{').expect("a JSON body");
    let end = body.rfind('}').expect("a JSON body");
    serde_json::from_str(&body[start..=end]).unwrap_or_else(|e| panic!("{e}: {body}"))
}

#[test]
fn an_eos_that_ends_a_request_is_not_in_its_content() {
    let s = Server::start();
    // The synthetic model's EOS is `<|im_end|>` (id 2); sampling at
    // temperature 1 reaches it within a few thousand tokens for some seed.
    let body = |seed: u64, stream: bool| {
        json!({"model": MODEL, "messages": [{"role": "user", "content": "hello"}],
               "max_tokens": 1500, "temperature": 1.0, "seed": seed, "stream": stream,
               "logprobs": true})
    };
    let mut found = None;
    for seed in 0..40 {
        let v = json_body(&read_all(send(s.port, &body(seed, false))));
        if v["choices"][0]["finish_reason"] == "stop" {
            found = Some((seed, v));
            break;
        }
    }
    let (seed, v) = found.expect("no seed of 40 ended in EOS: the test proves nothing");
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(!content.contains("<|im_end|>"), "{content:?}");
    // The logprob entries spell the content: no entry for the EOS either.
    let entries = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    let spelled: Vec<u8> = entries
        .iter()
        .flat_map(|e| {
            e["bytes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b.as_u64().unwrap() as u8)
                .collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(String::from_utf8_lossy(&spelled), content);
    // The usage still counts the EOS the engine sampled.
    assert_eq!(
        v["usage"]["completion_tokens"].as_u64(),
        Some(entries.len() as u64 + 1)
    );
    // Streamed, the same request sends the same text and no EOS.
    let raw = read_all(send(s.port, &body(seed, true)));
    let streamed: String = raw
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|v| {
            v["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_string)
        })
        .collect();
    assert_eq!(streamed, content, "{}", s.log());
}

#[test]
fn a_non_streaming_client_that_disconnects_is_an_interrupt() {
    let s = Server::start();
    let long = json!({"model": MODEL, "messages": [{"role": "user", "content": "write a tic tac toe html page"}],
                      "max_tokens": 1900, "temperature": 0, "ignore_eos": true});
    let c = send(s.port, &long);
    // Leave while it generates (its answer comes whole at the end).
    std::thread::sleep(Duration::from_millis(300));
    drop(c);
    let t0 = Instant::now();
    while !s.log().contains("chatcmpl-0-0 ") {
        assert!(t0.elapsed() < Duration::from_secs(60), "{}", s.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    let log = s.log();
    assert!(log.contains("interrupted: client gone"), "{log}");
    assert!(!log.contains("1900 generated"), "{log}");
    let (bundle, _dir) = s.stop();
    let b = lmrr_recorder::open(&bundle).unwrap();
    let interrupts: Vec<&str> = b
        .events
        .iter()
        .filter_map(|e| match e {
            lmrr_recorder::Event::Interrupt { name, .. } => Some(name.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(interrupts, ["chatcmpl-0-0"], "{log}");
    let o = Command::new(env!("CARGO_BIN_EXE_lmrr"))
        .args(["replay", bundle.to_str().unwrap()])
        .env_clear()
        .output()
        .unwrap();
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
}
