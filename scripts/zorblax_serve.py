"""The incident's scenario (examples/zorblax.toml) through `lmrr serve`, as an
HTTP client sends it (run by scripts/zorblax-serve-check.sh; stdlib only).

Per server: the facts and a poem request with 4 tokens, the same request
again streamed and hung up on after 30 chunks (the retry is served from the
prefix cache; the hang-up is the interrupt), the history with the partial
answer the client saw and "to a file", then the recall question. Run twice:
against the reference server, and against a server under
`abort-frees-shared` behind `lmrr proxy`. Then:

1. the reference server's recall names Zorblax and teal;
2. the patched server's does not name Zorblax;
3. `lmrr replay --bisect` of the reference server's bundle over
   abort-frees-shared and fast-exp names abort-frees-shared alone;
4. `lmrr audit` of the patched server's traffic does not call the recall
   turn faithful, and of the reference server's (also proxied) calls every
   turn faithful.

Exit 0 when all four hold, 1 otherwise; what was seen is printed.
"""

import glob
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

LMRR = os.environ.get("LMRR", "target/release/lmrr")
MODEL_DIR = sys.argv[1]
FACTS = ("My name is Zorblax and my favourite colour is teal. "
         "Please write a short poem about the sea.")
RECALL = "What is my name and my favourite colour?"
INTERRUPT_AFTER = 30
MODEL = {"id": None}  # the served name (GET /v1/models), set once a server is up


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(port, proc, what):
    for _ in range(1200):
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode} before it listened")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
                MODEL["id"] = json.load(r)["data"][0]["id"]
            return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"{what} did not answer on port {port} within 120 s")


def post(port, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        raise SystemExit(f"POST /v1/chat/completions: HTTP {e.code}: {e.read().decode()[:500]}")


def chat(port, messages, max_tokens):
    r = post(port, {"model": MODEL["id"], "messages": messages,
                    "max_tokens": max_tokens, "temperature": 0})
    return r["choices"][0]["message"]["content"]


def chat_interrupted(port, messages, max_tokens, chunks):
    """Streams and hangs up after `chunks` content chunks: the text seen."""
    body = json.dumps({"model": MODEL["id"], "messages": messages, "max_tokens": max_tokens,
                       "temperature": 0, "stream": True})
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    c.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    seen, n = "", 0
    while n < chunks:
        line = r.fp.readline()
        if not line:
            break
        line = line.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        delta = json.loads(line[6:])["choices"][0].get("delta", {}).get("content")
        if delta:
            seen += delta
            n += 1
    c.sock.shutdown(socket.SHUT_RDWR)
    c.close()
    return seen


def scenario(port):
    """The turns; the recall answer."""
    user = {"role": "user", "content": FACTS}
    chat(port, [user], 4)
    poem = chat_interrupted(port, [user], 200, INTERRUPT_AFTER)
    time.sleep(0.5)  # the server sees the hang-up and aborts before the next turn
    hist = [user, {"role": "assistant", "content": poem}, {"role": "user", "content": "to a file"}]
    to_file = chat(port, hist, 40)
    hist += [{"role": "assistant", "content": to_file}, {"role": "user", "content": RECALL}]
    return chat(port, hist, 40)


def served(work, name, patches):
    """One server behind a proxy, the scenario through the proxy: (recall
    answer, the server's bundle, the proxy's traffic bundle)."""
    rec, traffic = os.path.join(work, f"{name}-rec"), os.path.join(work, f"{name}-traffic")
    sport, pport = free_port(), free_port()
    log = open(os.path.join(work, f"{name}.log"), "w")
    cmd = [LMRR, "serve", "--model", MODEL_DIR, "--addr", f"127.0.0.1:{sport}", "--record-dir", rec]
    if patches:
        cmd += ["--patches", patches]
    srv = subprocess.Popen(cmd, stderr=log, stdout=log)
    prx = subprocess.Popen([LMRR, "proxy", "--upstream", f"http://127.0.0.1:{sport}",
                            "--listen", f"127.0.0.1:{pport}", "--record-dir", traffic],
                           stderr=log, stdout=log)
    try:
        wait_up(sport, srv, f"lmrr serve ({name})")
        wait_up(pport, prx, f"lmrr proxy ({name})")
        answer = scenario(pport)
    finally:
        for p in (prx, srv):
            p.send_signal(signal.SIGTERM)
        for p in (prx, srv):
            p.wait(timeout=120)
    bundles = sorted(glob.glob(os.path.join(rec, "*.lmrr")))
    trafs = sorted(glob.glob(os.path.join(traffic, "*.lmrr")))
    if not bundles or not trafs:
        raise SystemExit(f"{name}: no bundle written (server {bundles}, proxy {trafs}); "
                         f"log: {open(log.name).read()[-2000:]}")
    return answer, bundles[-1], trafs[-1]


def lmrr(*args):
    p = subprocess.run([LMRR, *args], capture_output=True, text=True)
    return p.returncode, p.stdout + p.stderr


def audit(traffic):
    """(exit code, the turns' verdicts in order, the report's verdict)."""
    code, out = lmrr("audit", traffic, "--model", MODEL_DIR, "--json")
    if code == 2:
        raise SystemExit(f"lmrr audit {traffic}: {out[-2000:]}")
    report = json.loads(out[out.index("{"):])
    verdicts = [t.get("verdict") for t in report.get("turns", [])]
    return code, verdicts, report.get("verdict"), report


def main():
    work = tempfile.mkdtemp(prefix="lmrr-zorblax-serve-")
    fail = False
    ref, ref_bundle, ref_traffic = served(work, "reference", "")
    if "Zorblax" in ref and "teal" in ref.lower():
        print(f"reference server recalls: {json.dumps(ref)}")
    else:
        print(f"REFERENCE SERVER FORGOT: {json.dumps(ref)}")
        fail = True
    bad, _, bad_traffic = served(work, "patched", "abort-frees-shared")
    if "Zorblax" in bad:
        print(f"PATCHED SERVER STILL RECALLS (abort-frees-shared): {json.dumps(bad)}")
        fail = True
    else:
        print(f"abort-frees-shared server forgets: {json.dumps(bad)}")

    code, out = lmrr("replay", ref_bundle, "--model", MODEL_DIR, "--bisect",
                     "--patches", "abort-frees-shared,fast-exp")
    culprits = [l for l in out.splitlines() if l.startswith("  culprit")]
    last = culprits[-1] if culprits else ""
    if "abort-frees-shared" in last and "fast-exp" not in last:
        print(f"bisect of the reference server's bundle: {last.strip()}")
    else:
        print(out[-1500:])
        print("BISECT DID NOT NAME abort-frees-shared ALONE")
        fail = True

    rcode, rturns, rverdict, _ = audit(ref_traffic)
    print(f"audit of the reference server: exit {rcode}, verdict {rverdict}, turns {rturns}")
    if rcode != 0:
        print("THE AUDIT FLAGS THE REFERENCE SERVER")
        fail = True
    pcode, pturns, pverdict, report = audit(bad_traffic)
    print(f"audit of the patched server: exit {pcode}, verdict {pverdict}, turns {pturns}")
    change = report.get("change")
    if change:
        print(f"  change point: {json.dumps(change)[:300]}")
    if pcode != 1 or not pturns or pturns[-1] == "faithful":
        print("THE AUDIT DOES NOT FLAG THE PATCHED SERVER'S RECALL TURN")
        fail = True
    print(f"files: {work}")
    sys.exit(1 if fail else 0)


if __name__ == "__main__":
    main()
