"""The incident through `lmrr serve`, with SmolLM2 and the `openai` client
(run by scripts/serve-incident-demo.sh, which fetches the model).

An agent harness sends the same system prompt with every request. Turn 0
warms the prefix cache with it; turn 1 ("write a tic tac toe html page") is
streamed and cancelled mid-generation, as a user pressing "interrupt" does;
turn 2 sends the history — with the partial answer the client saw — and
"to a file". The server records it all; the bundle is then replayed under
each cache patch, and the recorded session is re-run from its script under
each patch to show turn 2's answer.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import openai

LMRR = os.environ.get("LMRR", "target/release/lmrr")
MODEL_DIR = sys.argv[1]
SYSTEM = ("You are a coding agent working in the user's repository. You can read and write "
          "files, run commands and answer questions. Keep answers short and precise. When the "
          "user asks for code, write complete, working code. When the user refers to earlier "
          "messages, use the conversation so far. ") * 3
ASK = "write a tic tac toe html page"


def sh(*args, ok=(0, 1)):
    p = subprocess.run([LMRR, *args], capture_output=True, text=True)
    if p.returncode not in ok:
        raise SystemExit(f"lmrr {' '.join(args)}: exit {p.returncode}\n{p.stderr}")
    return p.returncode, p.stdout


def main():
    work = tempfile.mkdtemp(prefix="lmrr-serve-incident-")
    rec = os.path.join(work, "rec")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(os.path.join(work, "server.log"), "w")
    srv = subprocess.Popen([LMRR, "serve", "--model", MODEL_DIR, "--addr", f"127.0.0.1:{port}",
                            "--record-dir", rec], stderr=log)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            break
        except OSError:
            time.sleep(0.1)
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    model = c.models.list().data[0].id
    sysmsg = {"role": "system", "content": SYSTEM}

    print("1. turn 0 warms the prefix cache with the harness's system prompt")
    c.chat.completions.create(model=model, temperature=0, max_tokens=8,
                              messages=[sysmsg, {"role": "user", "content": "hi"}])

    print(f"2. turn 1 streams \"{ASK}\", cancelled after 60 chunks")
    s = c.chat.completions.create(model=model, temperature=0, max_tokens=400, stream=True,
                                  messages=[sysmsg, {"role": "user", "content": ASK}])
    partial = ""
    for i, ch in enumerate(s):
        partial += ch.choices[0].delta.content or ""
        if i == 60:
            break
    s.close()
    print("   the client saw: " + json.dumps(partial[:160]) + " …")
    time.sleep(0.5)

    print("3. turn 2 sends the history and \"to a file\"")
    hist = [sysmsg, {"role": "user", "content": ASK}, {"role": "assistant", "content": partial},
            {"role": "user", "content": "to a file"}]
    r = c.chat.completions.create(model=model, temperature=0, max_tokens=60, messages=hist)
    print("   answer: " + json.dumps(r.choices[0].message.content))
    print(f"   ({r.usage.prompt_tokens} prompt tokens, "
          f"{r.usage.prompt_tokens_details.cached_tokens} from the prefix cache)")

    srv.send_signal(signal.SIGTERM)
    srv.wait(timeout=60)
    bundle = os.path.join(rec, sorted(os.listdir(rec))[0])
    print(f"\n4. the server's bundle: {bundle}")
    print(sh("inspect", bundle)[1])
    code, out = sh("replay", bundle, "--model", MODEL_DIR)
    print("   replay:", out.strip().splitlines()[-1])
    script = os.path.join(work, "session.toml")
    sh("inspect", bundle, "--script", script, "--model", MODEL_DIR)
    turn2 = None
    for patch in ["abort-inserts-partial", "abort-frees-shared"]:
        print(f"\n5. replay under {patch}")
        code, out = sh("replay", bundle, "--model", MODEL_DIR, "--patches", patch)
        print("   " + "\n   ".join(out.strip().splitlines()[:6]))
        code, out = sh("run", "--script", script, "--model", MODEL_DIR, "--patches", patch,
                       "--pool-pages", "2048")
        blocks = out.split("=== ")
        turn2 = blocks[-1].split("--- output\n")[1].split("\ndigest:")[0]
        print(f"   the recorded session re-run under {patch}: turn 2 answers")
        print("   " + json.dumps(turn2))
        bad = os.path.join(work, f"{patch}.lmrr")
        sh("run", "--script", script, "--model", MODEL_DIR, "--patches", patch,
           "--pool-pages", "2048", "--record", bad)
        code, out = sh("replay", bad, "--model", MODEL_DIR, "--oracle", "recompute")
        print(f"   recompute oracle on that run (no golden recording): "
              + ("clean" if code == 0 else "\n   " + "\n   ".join(out.strip().splitlines()[:4])))
    print(f"\nreference answer (no patch): {json.dumps(r.choices[0].message.content)}")
    print(f"files: {work}")


if __name__ == "__main__":
    main()
