//! `lmrr probe`, the real binary: on mini-v4 the early-exit indexer loses an
//! early needle that the reference reads, bit for bit, and each cell's bundle
//! replays; against a server (`lmrr serve` on loopback) the same sweep runs
//! through the proxy's client and leaves a traffic bundle; on SmolLM2 the
//! cache patch forgets the facts after an interrupted retry and the
//! reference recalls them.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

use crate::listening;

fn lmrr(args: &[&str], cwd: &Path) -> (i32, String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_lmrr"))
        .args(args)
        .current_dir(cwd)
        .env_clear()
        .output()
        .unwrap();
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).to_string(),
        String::from_utf8_lossy(&o.stderr).to_string(),
    )
}

fn cell<'a>(r: &'a Value, patches: &str, length: u64, depth: u64) -> &'a Value {
    r["needle"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["patches"] == patches && c["length"] == length && c["depth"] == depth)
        .unwrap_or_else(|| panic!("no cell {patches} {length} {depth}"))
}

#[test]
fn early_exit_loses_an_early_needle_the_reference_reads_and_each_cell_replays() {
    let tmp = tempfile::tempdir().unwrap();
    let (code, out, err) = lmrr(
        &[
            "probe",
            "--model",
            "synthetic:mini-v4-tiny",
            "--patches",
            "none,indexer-early-exit",
            "--lengths",
            "512",
            "--depths",
            "0,100",
            "--cuts",
            "",
            "--threads",
            "1",
            "--json",
            "--html",
            "heat.html",
        ],
        tmp.path(),
    );
    assert_eq!(code, 1, "a patch worse than none exits 1\n{out}\n{err}");
    let r: Value = serde_json::from_str(&out).unwrap();
    // The reference reads the needle wherever it is; early exit never scores
    // the first blocks of a long context.
    assert_eq!(cell(&r, "none", 512, 0)["read"], true);
    assert_eq!(cell(&r, "none", 512, 100)["read"], true);
    assert_eq!(cell(&r, "indexer-early-exit", 512, 0)["read"], false);
    assert_eq!(cell(&r, "indexer-early-exit", 512, 100)["read"], true);
    assert!(r["recall"].as_array().unwrap().is_empty());
    // The page has a panel per patch set, the lost cell marked, and links
    // to the bundles that exist.
    let html = std::fs::read_to_string(tmp.path().join("heat.html")).unwrap();
    assert!(html.contains("data-patches=\"none\""));
    assert!(html.contains("data-patches=\"indexer-early-exit\""));
    assert_eq!(html.matches("data-status=\"lost\"").count(), 1, "{html}");
    let bundle = PathBuf::from(
        cell(&r, "indexer-early-exit", 512, 0)["bundle"]
            .as_str()
            .unwrap(),
    );
    let bundle = tmp.path().join(bundle);
    assert!(
        html.contains(bundle.file_name().unwrap().to_str().unwrap()),
        "the cell links its bundle"
    );
    let (code, out, _) = lmrr(&["replay", bundle.to_str().unwrap()], tmp.path());
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("bit-exact"), "{out}");
}

#[test]
fn a_server_is_probed_through_the_proxy_client_and_its_traffic_is_recorded() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut child, port, log) = listening::spawn(
        &["serve", "--addr", "127.0.0.1:0", "--threads", "1"],
        tmp.path(),
    );
    let url = format!("http://127.0.0.1:{port}");
    let (code, out, err) = lmrr(
        &[
            "probe",
            "--url",
            &url,
            "--served-model-name",
            "synthetic:tiny:seed0",
            "--lengths",
            "128",
            "--depths",
            "0,100",
            "--cuts",
            "4",
            "--json",
            "--record-dir",
            "traffic",
        ],
        tmp.path(),
    );
    // A server that refuses the requests stops the probe, naming the
    // request and the server's message (not a table of "lost" cells).
    let (bad_code, _, bad_err) = lmrr(
        &[
            "probe",
            "--url",
            &url,
            "--served-model-name",
            "no-such-model",
            "--lengths",
            "128",
            "--depths",
            "0",
            "--cuts",
            "",
            "--record-dir",
            "refused",
        ],
        tmp.path(),
    );
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(code, 0, "{out}\n{err}\n{}", log.lock().unwrap());
    assert_eq!(bad_code, 2, "{bad_err}");
    assert!(
        bad_err.contains("request 0") && bad_err.contains("no-such-model"),
        "{bad_err}"
    );
    let r: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(r["needle"].as_array().unwrap().len(), 2);
    let rows = r["recall"].as_array().unwrap();
    assert_eq!(rows.len(), 2, "{rows:?}");
    // Every request is in one traffic bundle: 2 per needle cell, 3 per
    // recall row; the interrupted retry is recorded as a client that left.
    let files: Vec<PathBuf> = std::fs::read_dir(tmp.path().join("traffic"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let t = lmrr_recorder::traffic::open(&files[0]).unwrap();
    let ends: Vec<&lmrr_recorder::traffic::Outcome> = t
        .events
        .iter()
        .filter_map(|e| match e {
            lmrr_recorder::traffic::TrafficEvent::End { outcome, .. } => Some(outcome),
            _ => None,
        })
        .collect();
    assert_eq!(ends.len(), 2 * 2 + 3 * 2);
    assert_eq!(
        ends.iter()
            .filter(|o| **o == &lmrr_recorder::traffic::Outcome::ClientGone)
            .count(),
        1
    );
    // `lmrr inspect` lists the traffic request by request.
    let (code, out, err) = lmrr(&["inspect", files[0].to_str().unwrap()], tmp.path());
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("10 requests"), "{out}");
    assert!(out.contains("client gone after 4 chunks"), "{out}");
}

/// SmolLM2's directory (`LMRR_SMOLLM2`, else the default cache).
fn smollm2() -> PathBuf {
    let dir = std::env::var_os("LMRR_SMOLLM2")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .map(|h| PathBuf::from(h).join(".cache/lmrr/smollm2-135m-instruct"))
        })
        .expect("LMRR_SMOLLM2 or HOME is set");
    assert!(
        dir.join("model.safetensors").is_file(),
        "no SmolLM2 at {} (run scripts/get-smollm2.sh, or set LMRR_SMOLLM2)",
        dir.display()
    );
    dir
}

#[test]
#[ignore = "needs SmolLM2: scripts/get-smollm2.sh, then --include-ignored"]
fn smollm2_forgets_the_facts_after_an_interrupt_under_abort_frees_shared() {
    let dir = smollm2();
    let tmp = tempfile::tempdir().unwrap();
    let (code, out, err) = lmrr(
        &[
            "probe",
            "--model",
            dir.to_str().unwrap(),
            "--patches",
            "none,abort-frees-shared",
            "--lengths",
            "",
            "--cuts",
            "8",
            "--json",
        ],
        tmp.path(),
    );
    assert_eq!(code, 1, "{out}\n{err}");
    let r: Value = serde_json::from_str(&out).unwrap();
    let row = |p: &str, interrupted: bool| {
        r["recall"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["patches"] == p && x["interrupted"] == interrupted)
            .cloned()
            .unwrap()
    };
    let all = ["Zorblax", "teal"];
    // The reference recalls both facts, interrupted or not; so does the
    // patch without an interrupt; after one it recalls neither.
    for (p, i) in [
        ("none", false),
        ("none", true),
        ("abort-frees-shared", false),
    ] {
        assert_eq!(row(p, i)["recalled"], serde_json::json!(all), "{p} {i}");
    }
    let bad = row("abort-frees-shared", true);
    assert_eq!(bad["recalled"], serde_json::json!([]), "{bad}");
    assert_eq!(bad["same_as_reference"], false);
}
