//! Starting an `lmrr` that listens (`serve`, `proxy`) from a test: the child,
//! the port it printed (`… on http://127.0.0.1:PORT …` on stderr), and its
//! stderr collected as it runs.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Spawns `lmrr ARGS` in `cwd` with an empty environment; waits (60 s at
/// most) for the port it listens on.
pub fn spawn(args: &[&str], cwd: &Path) -> (Child, u16, Arc<Mutex<String>>) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_lmrr"))
        .args(args)
        .current_dir(cwd)
        .env_clear()
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let log = Arc::new(Mutex::new(String::new()));
    let (tx, rx) = std::sync::mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    let l2 = log.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if let Some(rest) = line.split("on http://127.0.0.1:").nth(1) {
                let port: u16 = rest.split(' ').next().unwrap().parse().unwrap();
                let _ = tx.send(port);
            }
            l2.lock().unwrap().push_str(&(line + "\n"));
        }
    });
    let port = rx
        .recv_timeout(Duration::from_secs(60))
        .unwrap_or_else(|_| panic!("lmrr {args:?} did not start: {}", log.lock().unwrap()));
    (child, port, log)
}
