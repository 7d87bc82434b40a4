"""The incident through `lmrr serve --disaggregate`, with SmolLM2 and the
standard library's HTTP client (run by scripts/serve-pd-incident.sh).

A loaded server (three other users' answers keep both engines stepping, so
K/V takes a while on the link): turn 1 ("write a tic tac toe html page",
under a harness system prompt) is sent and abandoned, as a user pressing
"interrupt" does, while its K/V is still being transferred; turn 2 follows
with the conversation and "to a file". Run on a correct deployment and
under `pd-abort-reuses-pages`; each server's bundle is replayed and checked
by the recompute oracle (no golden run), the correct one bisected over the
cache patches, and the patched one's HTML report written (a lane per
engine, the transfers, the writes that go on after the abort).

The moment turn 1 is abandoned (`HANG` seconds after it is sent) must fall
inside its transfer; `lmrr replay B --patches pd-abort-incomplete-kv` on the
correct server's bundle says at which stage the abort landed.
"""

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

LMRR = os.environ.get("LMRR", "target/release/lmrr")
MODEL_DIR = sys.argv[1]
HANG = float(os.environ.get("HANG", "3.0"))
SYSTEM = ("You are a coding agent working in the user's repository. You can read and write "
          "files, run commands and answer questions. Keep answers short and precise. When the "
          "user asks for code, write complete, working code. When the user refers to earlier "
          "messages, use the conversation so far. ") * 2
ASK = "write a tic tac toe html page"
OTHERS = ["write a long story about a lighthouse keeper",
          "explain how a compiler works in detail",
          "list the countries of Europe"]
CACHE_PATCHES = "abort-inserts-partial,abort-frees-shared,pd-abort-reuses-pages,pd-abort-incomplete-kv,pd-abort-leaks"


def lmrr(*args):
    p = subprocess.run([LMRR, *args, "--model", MODEL_DIR], capture_output=True, text=True)
    if p.returncode not in (0, 1):
        raise SystemExit(f"lmrr {' '.join(args)}: exit {p.returncode}\n{p.stderr}")
    return p.returncode, p.stdout


def session(patches, work):
    rec = os.path.join(work, f"rec-{patches}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = subprocess.Popen([LMRR, "serve", "--model", MODEL_DIR, "--addr", f"127.0.0.1:{port}",
                            "--record-dir", rec, "--disaggregate", "--page-size", "4",
                            "--patches", patches],
                           stderr=open(os.path.join(work, f"server-{patches}.log"), "w"))
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            break
        except OSError:
            time.sleep(0.1)
    model = json.loads(urllib.request.urlopen(
        f"http://127.0.0.1:{port}/v1/models").read())["data"][0]["id"]

    def post(body):
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        c.request("POST", "/v1/chat/completions", json.dumps(body),
                  {"Content-Type": "application/json"})
        r = c.getresponse()
        out = json.loads(r.read())
        if r.status != 200:
            raise SystemExit(f"HTTP {r.status}: {out}")
        return out

    busy = [threading.Thread(target=post, args=({
        "model": model, "temperature": 0, "max_tokens": 120,
        "messages": [{"role": "user", "content": q}]},)) for q in OTHERS]
    for b in busy:
        b.start()
    time.sleep(1.0)
    sysmsg = {"role": "system", "content": SYSTEM}
    turn1 = json.dumps({"model": model, "temperature": 0, "max_tokens": 100,
                        "messages": [sysmsg, {"role": "user", "content": ASK}]})
    raw = socket.create_connection(("127.0.0.1", port))
    raw.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: lmrr\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(turn1)}\r\n\r\n"
                 f"{turn1}").encode())
    time.sleep(HANG)
    raw.close()
    time.sleep(0.3)
    hist = [sysmsg, {"role": "user", "content": ASK}, {"role": "user", "content": "to a file"}]
    answer = post({"model": model, "temperature": 0, "max_tokens": 40,
                   "messages": hist})["choices"][0]["message"]["content"]
    for b in busy:
        b.join()
    srv.send_signal(signal.SIGTERM)
    srv.wait(timeout=120)
    return answer, os.path.join(rec, sorted(os.listdir(rec))[0])


def main():
    work = tempfile.mkdtemp(prefix="lmrr-serve-pd-incident-")
    for patches in ["none", "pd-abort-reuses-pages"]:
        answer, bundle = session(patches, work)
        print(f"== lmrr serve --disaggregate --patches {patches}")
        print(f"   turn 2 (\"to a file\") answers: {json.dumps(answer)}")
        print(f"   bundle: {bundle}")
        print("   replay: " + lmrr("replay", bundle)[1].strip().splitlines()[-1])
        code, out = lmrr("replay", bundle, "--oracle", "recompute")
        print("   recompute oracle: " + ("clean" if code == 0 else
              "\n     " + "\n     ".join(out.strip().splitlines()[1:4])))
        if patches == "none":
            code, out = lmrr("replay", bundle, "--patches", "pd-abort-incomplete-kv")
            stage = [l for l in out.splitlines() if "abort " in l and "before step" in l]
            print("   " + (stage[0].strip() if stage else "turn 1's abort: " + out.strip().splitlines()[-1]))
            code, out = lmrr("replay", bundle, "--bisect", "--good", "none", "--bad", CACHE_PATCHES)
            print("   bisect over the cache patches:\n     "
                  + "\n     ".join(l for l in out.splitlines() if "culprit" in l))
        else:
            html = os.path.join(work, "pd-incident.html")
            lmrr("replay", bundle, "--patches", "none", "--html", html)
            print(f"   HTML report: {html}")
    print(f"files: {work}")


if __name__ == "__main__":
    main()
