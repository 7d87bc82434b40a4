#!/usr/bin/env python3
"""lmrr against a peer engine, llama.cpp (through llama-cpp-python), on the
same GGUF: tokenizer ids for 200 varied strings, teacher-forced logits, and
prefill/decode speed with the same thread count.

    pip install llama-cpp-python          # builds llama.cpp from source (~8 min on 2 cores)
    python3 scripts/compare_llamacpp.py MODEL.gguf MODEL_DIR [--lmrr target/release/lmrr]

MODEL_DIR is the lmrr import of MODEL.gguf (scripts/get-smollm2.sh).
"""
import argparse
import json
import subprocess
import sys
import tempfile
import time

import numpy as np
from llama_cpp import Llama

# llama.cpp rounds activations to 8 bits for quantized matmuls and keeps its KV
# cache in f16, which moves its logits by up to ~1.5 (it does not even match
# itself between batched and token-by-token prefill). So the comparison is
# statistical: the mean |Δlogit| per position must stay under MEAN_BOUND, and
# top-1 must agree wherever llama.cpp's own top-2 gap exceeds GAP_BOUND.
MEAN_BOUND = 0.5
GAP_BOUND = 1.5
THREADS = 2


def strings():
    rng = np.random.default_rng(7)
    base = [
        "Hello, world!", "  leading spaces", "trailing spaces   ", "tabs\tand\nnewlines\n\n",
        "fn main() { println!(\"{}\", 42); }", "def f(x):\n    return x ** 2\n", "SELECT * FROM t WHERE a = 'b';",
        "12345 678.90 1,000,000", "2026-11-30T06:11:18Z", "café naïve résumé", "数字と文字", "🚀🔥 emoji",
        "<|im_start|>user\nhi<|im_end|>", "<|endoftext|>", "a<|im_end|>b", "   ", "\n", "x" * 50,
        "The quick brown fox jumps over the lazy dog.", "don't won't can't I'm you're",
    ]
    words = ["the", "cache", "radix", " tree", "123", "\t", "  ", "é", "漢", "<|im_start|>", "{", "}", "==", "\n",
             "model", "Zorblax", "teal", "😀", "'s", "0.5", "--", "x"]
    out = list(base)
    while len(out) < 200:
        k = int(rng.integers(1, 12))
        out.append("".join(words[int(i)] if rng.random() < 0.8 else " " for i in rng.integers(0, len(words), k)))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf")
    ap.add_argument("model_dir")
    ap.add_argument("--lmrr", default="target/release/lmrr")
    ap.add_argument("--text", default="docs/reference-text.txt")
    a = ap.parse_args()
    llm = Llama(model_path=a.gguf, n_ctx=2048, n_batch=512, n_threads=THREADS, logits_all=True, verbose=False)
    ok = True

    # 1. Tokenizer.
    ss = strings()
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(ss, f)
    ours = json.loads(subprocess.check_output([a.lmrr, "tokenize", "--model", a.model_dir, "--strings-file", f.name]))
    theirs = [llm.tokenize(s.encode(), add_bos=False, special=True) for s in ss]
    same = sum(o == t for o, t in zip(ours, theirs))
    print(f"tokenizer: {same}/{len(ss)} strings give identical ids")
    for s, o, t in zip(ss, ours, theirs):
        if o != t:
            print(f"  differs: {s!r}: lmrr {o[:12]} llama.cpp {t[:12]}")
    ok &= same == len(ss)

    # 2. Teacher-forced logits on the same ids.
    with tempfile.NamedTemporaryFile(suffix=".bin", delete=False) as f:
        out = f.name
    subprocess.check_call([a.lmrr, "score", "--model", a.model_dir, "--text-file", a.text, "--out", out],
                          stdout=subprocess.DEVNULL)
    raw = open(out, "rb").read()
    n = int(np.frombuffer(raw, "<u4", 1)[0])
    ids = np.frombuffer(raw, "<u4", n, 4).tolist()
    mine = np.frombuffer(raw, "<f4", offset=4 + 4 * n).reshape(n, -1).astype(np.float64)
    llm.reset()
    llm.eval(ids)
    peer = np.array(llm.scores[:n], dtype=np.float64)
    d = np.abs(mine - peer)
    mean_pos = d.mean(-1)
    srt = np.sort(peer, -1)
    gap = srt[:, -1] - srt[:, -2]
    agree = mine.argmax(-1) == peer.argmax(-1)
    confident = gap > GAP_BOUND
    print(f"logits over {n} positions: mean |dlogit| per position max {mean_pos.max():.3f}, overall {d.mean():.3f}; "
          f"max |dlogit| {d.max():.3f}")
    print(f"top-1 agreement: {agree.sum()}/{n} overall, {agree[confident].sum()}/{confident.sum()} "
          f"where llama.cpp's top-2 gap > {GAP_BOUND}")
    ok &= mean_pos.max() <= MEAN_BOUND and bool(agree[confident].all())

    # 3. Speed: 512-token prefill, then 128 decode steps, same threads.
    prompt = (ids * 4)[:512]
    llm.reset()
    t = time.perf_counter()
    llm.eval(prompt)
    pre = time.perf_counter() - t
    tok = prompt[-1]
    t = time.perf_counter()
    for _ in range(128):
        llm.eval([tok])
    dec = time.perf_counter() - t
    print(f"llama.cpp ({THREADS} threads): prefill {512 / pre:.1f} tok/s, decode {128 / dec:.1f} tok/s")
    bench = subprocess.check_output([a.lmrr, "bench", "--model", a.model_dir, "--threads", str(THREADS),
                                     "--prompt-len", "512", "--decode-steps", "128", "--repeats", "1",
                                     "--bandwidth-mib", "512"], text=True)
    for line in bench.splitlines():
        if "prefill, batch 1" in line or "decode, batch 1" in line:
            print("lmrr " + line.strip())
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
