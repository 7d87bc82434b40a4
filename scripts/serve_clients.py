"""Real clients against `lmrr serve` (run by scripts/serve-test.sh).

    python serve_clients.py clients   # openai (streaming, non-streaming,
                                      # logprobs, a cancellation then "to a
                                      # file") and curl
    python serve_clients.py load      # 32 concurrent streaming clients, random
                                      # arrivals and disconnects, <= 2 minutes
    python serve_clients.py bench     # figures for docs/PERFORMANCE.md

Each starts its own server on a free loopback port with the tiny synthetic
model, recording into a temporary directory, stops it with SIGTERM and checks
the bundle with the lmrr CLI: every request and every disconnect is in it, it
replays bit-exactly, `inspect --script` + `run --script` gives the same
digests, and every completed greedy response equals a solo `lmrr generate` of
the same prompt (digest = tokens and logits bits). Exit status 0 = all held.
"""

import asyncio
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.request

import openai

LMRR = os.environ.get("LMRR", "target/release/lmrr")
MODEL = "synthetic:tiny:seed0"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *extra):
        self.dir = tempfile.mkdtemp(prefix="lmrr-serve-")
        self.rec = os.path.join(self.dir, "rec")
        self.port = free_port()
        self.log = open(os.path.join(self.dir, "server.log"), "w+")
        self.proc = subprocess.Popen(
            [LMRR, "serve", "--model", MODEL, "--addr", f"127.0.0.1:{self.port}",
             "--record-dir", self.rec, *extra],
            stdout=subprocess.DEVNULL, stderr=self.log)
        self.url = f"http://127.0.0.1:{self.port}"
        for _ in range(300):
            try:
                urllib.request.urlopen(self.url + "/health", timeout=1)
                return
            except OSError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.1)
        raise SystemExit(f"server did not start:\n{self.text()}")

    def text(self):
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def health(self):
        return json.load(urllib.request.urlopen(self.url + "/health", timeout=5))

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=60)
        check(code == 0, f"server exit code {code} after SIGTERM\n{self.text()[-2000:]}")
        bundles = sorted(os.listdir(self.rec))
        check(len(bundles) == 1, f"one bundle expected, found {bundles}")
        return os.path.join(self.rec, bundles[0])


failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print(f"FAIL: {what}", flush=True)


def lmrr(*args, ok=(0,)):
    p = subprocess.run([LMRR, *args], capture_output=True, text=True)
    check(p.returncode in ok, f"lmrr {' '.join(args)} exited {p.returncode}: {p.stderr[-1500:]}")
    return p.stdout


def bundle_facts(bundle, workdir):
    """Requests, interrupts and per-request run results of a bundle."""
    out = lmrr("replay", bundle)
    check("bit-exact" in out, f"replay of {bundle} is not bit-exact:\n{out}")
    script = os.path.join(workdir, "session.toml")
    lmrr("inspect", bundle, "--script", script)
    with open(script, "rb") as f:
        reqs = tomllib.load(f)["request"]
    info = json.loads(lmrr("inspect", bundle, "--json"))
    engine = info["manifest"]["engine"]
    run = lmrr("run", "--script", script, "--model", MODEL,
               "--pool-pages", str(engine["pool_pages"]),
               "--max-batch-tokens", str(engine["max_batch_tokens"]),
               "--page-size", str(engine["page_size"]))
    results = {}
    cur = None
    for line in run.splitlines():
        m = re.match(r"=== (\S+) · arrived at step (\d+) · .* · generated (\d+) · (\w+)", line)
        if m:
            cur = m.group(1)
            results[cur] = {"generated": int(m.group(3)), "finish": m.group(4)}
        elif line.startswith("digest: ") and cur:
            results[cur]["digest"] = line.split()[1]
    return {r["id"]: r for r in reqs}, results, info


def solo_digest(message, max_tokens, ignore_eos):
    args = ["generate", "--model", MODEL, "--chat", "--prompt", message,
            "--max-tokens", str(max_tokens), "--temperature", "0"]
    if ignore_eos:
        args.append("--ignore-eos")
    out = lmrr(*args)
    return out.strip().splitlines()[-1].split()[-1]


def curl(url, body, *extra):
    p = subprocess.run(["curl", "-sS", "-N", url, "-H", "Content-Type: application/json",
                        "-d", json.dumps(body), *extra], capture_output=True, text=True, timeout=60)
    check(p.returncode == 0, f"curl failed: {p.stderr}")
    return p.stdout


def clients():
    srv = Server()
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    check([m.id for m in c.models.list().data] == [MODEL], "GET /v1/models")
    ask = "write a tic tac toe html page"

    # Non-streaming.
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}],
                                  max_tokens=12, temperature=0)
    check(r.object == "chat.completion" and r.choices[0].finish_reason == "length"
          and r.usage.completion_tokens == 12, f"non-streaming chat: {r}")
    check(r.model_extra["lmrr"]["digest"] == solo_digest("hello", 12, False),
          "non-streaming chat differs from a solo lmrr generate")
    names = {r.id}

    # Streaming with usage.
    s = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}],
                                  max_tokens=12, temperature=0, stream=True,
                                  stream_options={"include_usage": True})
    chunks = list(s)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    check(chunks[0].choices[0].delta.role == "assistant", "first chunk carries the role")
    check([ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length",
          "finish_reason length")
    check(chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12,
          f"usage chunk: {chunks[-1]}")
    check(text == r.choices[0].message.content, "streamed text == non-streamed text")
    names.add(chunks[0].id)

    # Logprobs, streamed: every sampled token once, in order, the top-3 of
    # each, its logprob its own top-1 (greedy), its bytes joined the text.
    s = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}],
                                  max_tokens=12, temperature=0, stream=True,
                                  logprobs=True, top_logprobs=3)
    chunks = list(s)
    names.add(chunks[0].id)
    entries = [e for ch in chunks if ch.choices and ch.choices[0].logprobs
               for e in ch.choices[0].logprobs.content]
    lp_text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    check(len(entries) == 12 and all(len(e.top_logprobs) == 3 for e in entries),
          f"streamed logprobs: 12 entries of top-3 expected, got {entries}")
    check(all(e.logprob == e.top_logprobs[0].logprob and e.token == e.top_logprobs[0].token
              for e in entries), "greedy: each token is its own top-1")
    check(bytes(b for e in entries for b in e.bytes).decode("utf-8", "replace") == lp_text
          and lp_text == text, "logprob bytes joined are the streamed text")

    # Completions, with a stop sequence.
    cr = c.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=40,
                              temperature=0)
    check(cr.object == "text_completion" and cr.choices[0].text, f"completions: {cr}")
    names.add(cr.id)
    stop = cr.choices[0].text[5:7]
    if stop.strip():
        cs = c.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=40,
                                  temperature=0, stop=[stop])
        check(cs.choices[0].finish_reason == "stop"
              and cs.choices[0].text == cr.choices[0].text.split(stop)[0],
              f"stop sequence {stop!r}: {cs.choices[0]}")
        names.add(cs.id)

    # The incident through the API: a stream cancelled mid-generation, then
    # the follow-up turn carrying the partial answer.
    s = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ask}],
                                  max_tokens=400, temperature=0, stream=True,
                                  extra_body={"ignore_eos": True})
    partial = ""
    for i, ch in enumerate(s):
        names.add(ch.id)
        partial += ch.choices[0].delta.content or ""
        if i == 30:
            break
    s.close()
    cancelled = ch.id
    time.sleep(0.3)
    r2 = c.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=30,
        messages=[{"role": "user", "content": ask}, {"role": "assistant", "content": partial},
                  {"role": "user", "content": "to a file"}])
    names.add(r2.id)
    check(r2.usage.prompt_tokens_details.cached_tokens > 0,
          "the follow-up turn is served from the prefix cache")

    # Errors come back as OpenAI errors.
    try:
        c.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
        check(False, "unknown model accepted")
    except openai.BadRequestError as e:
        check(e.body["param"] == "model", f"unknown model error: {e.body}")
    try:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=2)
        check(False, "n=2 accepted")
    except openai.BadRequestError as e:
        check(e.body["param"] == "n", f"n=2 error: {e.body}")

    # curl, streaming and not.
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 12,
            "temperature": 0}
    v = json.loads(curl(srv.url + "/v1/chat/completions", body))
    check(v["choices"][0]["message"]["content"] == r.choices[0].message.content, "curl chat")
    names.add(v["id"])
    raw = curl(srv.url + "/v1/chat/completions", {**body, "stream": True})
    events = [l[6:] for l in raw.split("\n") if l.startswith("data: ")]
    check(events[-1] == "[DONE]" and raw.endswith("data: [DONE]\n\n"), "curl SSE ends in [DONE]")
    names.add(json.loads(events[0])["id"])
    h = subprocess.run(["curl", "-sS", srv.url + "/health"], capture_output=True, text=True)
    check(json.loads(h.stdout or "{}").get("status") == "ok", f"curl /health: {h.stdout}")

    bundle = srv.stop()
    reqs, results, info = bundle_facts(bundle, srv.dir)
    check(set(reqs) == names, f"bundle requests {sorted(reqs)} != client ids {sorted(names)}")
    check("interrupt_at_step" in reqs.get(cancelled, {}), f"cancelled {cancelled} not interrupted")
    check(info["summary"]["interrupts"] >= 1, "an interrupt is recorded")
    print(f"clients: {len(names)} requests, bundle {bundle}: replays bit-exactly; "
          f"the cancelled stream {cancelled} is an interrupt at step "
          f"{reqs[cancelled].get('interrupt_at_step')}; follow-up served "
          f"{r2.usage.prompt_tokens_details.cached_tokens} prompt tokens from the cache")


WORDS = ("tic tac toe board game html page file write read cache token model engine "
         "replay bundle step interrupt stream client server request answer").split()


async def load(clients_n=32, per_client=4, budget_s=110):
    srv = Server("--quiet")
    c = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0,
                           timeout=120)
    rng = random.Random(13)
    t_start = time.monotonic()
    records = []

    async def one_client(k):
        r = random.Random(k)
        for j in range(per_client):
            await asyncio.sleep(r.uniform(0, 1.5))
            if time.monotonic() - t_start > budget_s:
                return
            msg = " ".join(r.choice(WORDS) for _ in range(r.randint(3, 40)))
            max_tokens = r.randint(16, 96)
            sampled = r.random() < 0.25
            ignore_eos = r.random() < 0.5
            quit_after = r.randint(1, max_tokens // 3) if r.random() < 0.3 else None
            rec = {"msg": msg, "max_tokens": max_tokens, "sampled": sampled,
                   "ignore_eos": ignore_eos, "quit_after": quit_after, "id": None,
                   "finish": None, "digest": None, "tokens": 0, "ttft": None}
            t0 = time.monotonic()
            kw = {"temperature": 0.9, "seed": k * 100 + j} if sampled else {"temperature": 0}
            s = await c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": msg}], max_tokens=max_tokens,
                stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": ignore_eos}, **kw)
            n = 0
            async for ch in s:
                rec["id"] = ch.id
                if ch.choices and ch.choices[0].delta.content:
                    n += 1
                    if rec["ttft"] is None:
                        rec["ttft"] = time.monotonic() - t0
                if ch.choices and ch.choices[0].finish_reason:
                    rec["finish"] = ch.choices[0].finish_reason
                    rec["digest"] = ch.model_extra["lmrr"]["digest"]
                if ch.usage:
                    rec["tokens"] = ch.usage.completion_tokens
                if quit_after is not None and n >= quit_after:
                    break
            await s.close()
            rec["elapsed"] = time.monotonic() - t0
            records.append(rec)

    await asyncio.gather(*(one_client(k) for k in range(clients_n)))
    wall = time.monotonic() - t_start
    health = srv.health()
    check(health["status"] == "ok", f"server health after the load: {health}")
    bundle = srv.stop()
    reqs, results, info = bundle_facts(bundle, srv.dir)

    ids = {r["id"] for r in records}
    check(None not in ids and ids == set(reqs),
          f"{len(ids)} client requests, {len(reqs)} in the bundle")
    quitters = [r for r in records if r["quit_after"] is not None and r["finish"] is None]
    interrupted = [r for r in quitters if "interrupt_at_step" in reqs.get(r["id"], {})]
    # A quitter the engine had already finished before it noticed (the
    # tokens were in its channel) has no interrupt: it ended on its own.
    for r in quitters:
        res = results.get(r["id"], {})
        check("interrupt_at_step" in reqs.get(r["id"], {}) or res.get("finish") in ("length", "eos"),
              f"disconnect of {r['id']} is not in the bundle ({res})")
    done = [r for r in records if r["finish"] is not None]
    for r in done:
        check(results.get(r["id"], {}).get("digest") == r["digest"],
              f"{r['id']}: lmrr run --script of the bundle gives another digest")
    greedy = [r for r in done if not r["sampled"]]
    for r in greedy:
        solo = solo_digest(r["msg"], r["max_tokens"], r["ignore_eos"])
        check(solo == r["digest"], f"{r['id']}: differs from a solo lmrr generate")
    ttft = sorted(r["ttft"] for r in records if r["ttft"] is not None)
    p = lambda q: ttft[min(len(ttft) - 1, int(q * len(ttft)))] * 1000
    toks = sum(results[r["id"]]["generated"] for r in records if r["id"] in results)
    print(f"load: {len(records)} streaming requests from {clients_n} concurrent clients in "
          f"{wall:.1f} s; {len(quitters)} disconnected mid-stream ({len(interrupted)} interrupts "
          f"recorded, the rest had already ended), {len(done)} completed, {len(greedy)} greedy "
          f"ones equal to a solo lmrr generate; bundle replays bit-exactly "
          f"({info['summary']['steps']} steps)")
    print(f"load: TTFT p50 {p(0.5):.1f} ms, p99 {p(0.99):.1f} ms; {toks} tokens generated, "
          f"{toks / wall:.0f} tok/s over the whole run")


async def bench(clients_n=32, per_client=4, max_tokens=64):
    """Throughput and latency: every client sends its requests back to back
    (greedy, `max_tokens` each, EOS ignored, no disconnects); then the
    bundle's script is run with `lmrr run` for the same session without HTTP.
    The engine gets `LMRR_BENCH_THREADS` threads (default 1, leaving a core
    to the Python client and HTTP on a 2-core machine), `lmrr run` the same."""
    threads = os.environ.get("LMRR_BENCH_THREADS", "1")
    srv = Server("--threads", threads)
    c = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0,
                           timeout=300)
    recs = []

    async def one_client(k):
        r = random.Random(k)
        for j in range(per_client):
            msg = " ".join(r.choice(WORDS) for _ in range(r.randint(3, 40)))
            t0 = time.monotonic()
            s = await c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": msg}], max_tokens=max_tokens,
                temperature=0, stream=True, extra_body={"ignore_eos": True})
            ttft = None
            async for ch in s:
                if ttft is None and ch.choices and ch.choices[0].delta.content:
                    ttft = time.monotonic() - t0
            recs.append((t0, ttft, time.monotonic()))

    t_start = time.monotonic()
    await asyncio.gather(*(one_client(k) for k in range(clients_n)))
    wall = time.monotonic() - t_start
    h = srv.health()
    log = srv.text()
    bundle = srv.stop()
    engine_ttft = sorted(int(m) for m in re.findall(r"first token (\d+) ms", log))
    ttft = sorted(t for _, t, _ in recs if t is not None)
    q = lambda xs, p: xs[min(len(xs) - 1, int(p * len(xs)))]
    toks = clients_n * per_client * max_tokens
    script = os.path.join(srv.dir, "session.toml")
    lmrr("inspect", bundle, "--script", script)
    info = json.loads(lmrr("inspect", bundle, "--json"))
    runs = []
    for _ in range(3):
        p = subprocess.run([LMRR, "run", "--script", script, "--model", MODEL, "--pool-pages",
                            str(info["manifest"]["engine"]["pool_pages"]), "--threads", threads,
                            "--record", os.path.join(srv.dir, "run.lmrr")],
                           capture_output=True, text=True)
        runs.append(float(re.search(r" · ([\d.]+)s · ", p.stderr).group(1)))
    run_s = statistics.median(runs)
    print(f"bench: {len(recs)} streaming requests ({clients_n} concurrent clients x {per_client}, "
          f"{max_tokens} tokens each, greedy), {h['steps']} steps, engine threads {threads}")
    print(f"bench: wall {wall:.2f} s, {toks / wall:.0f} tok/s through HTTP (client: openai, "
          f"same machine)")
    print(f"bench: TTFT at the client p50 {q(ttft, 0.5) * 1000:.1f} ms, p99 "
          f"{q(ttft, 0.99) * 1000:.1f} ms; at the engine (arrival to first token) p50 "
          f"{q(engine_ttft, 0.5)} ms, p99 {q(engine_ttft, 0.99)} ms")
    print(f"bench: engine loop busy {h['busy_ms']} ms, of which steps {h['step_ms']} ms "
          f"({100 * (h['busy_ms'] - h['step_ms']) / max(h['step_ms'], 1):.1f}% loop overhead: "
          f"boundaries, recording, detokenization, channels)")
    print(f"bench: the same session by `lmrr run --script --record` (no HTTP): {run_s:.2f} s "
          f"(median of 3), {toks / run_s:.0f} tok/s; server wall / run = {wall / run_s:.2f}x")


def main():
    what = sys.argv[1] if len(sys.argv) > 1 else "clients"
    if what == "clients":
        clients()
    elif what == "load":
        asyncio.run(load())
    elif what == "bench":
        asyncio.run(bench())
    else:
        raise SystemExit(f"unknown test {what!r} (clients, load)")
    if failures:
        print(f"0 passed, {len(failures)} failed", flush=True)
        sys.exit(1)
    print(f"serve {what}: all checks held")


if __name__ == "__main__":
    main()
