#!/usr/bin/env python3
"""lmrr against llama.cpp on a real GGUF: greedy continuations agree.

For each prompt, llama.cpp (llama-cpp-python) generates greedily from the
GGUF, keeping its logits at every step. lmrr then scores the same token
sequence teacher-forced (`lmrr score` on the imported model directory) and
the two are compared along llama.cpp's path:

- top-1: lmrr's argmax equals llama.cpp's token at every position whose
  llama.cpp top-2 margin is at least NEAR_TIE logits (teacher-forced, both
  engines read the same context at every position; at a near-tie they may
  rightly pick differently);
- KL: the mean KL(llama.cpp || lmrr) over llama.cpp's top TOPK tokens
  (renormalised), per position.

The engines differ on purpose: llama.cpp rounds activations to 8 bits for
its integer dot products, lmrr keeps f32 in its canonical order. So this is
a tolerance check against an outside engine, with named tolerances.

    scripts/agree-llamacpp.py --lmrr target/release/lmrr --python PY \\
        --gguf FILE.gguf --model DIR [--tokens 64] [--json OUT]

PY is a Python with llama_cpp installed (scripts/proxy-test.sh builds one
under target/llama-venv). Exit 0 when every prompt agrees, 1 otherwise.
"""

import argparse
import json
import math
import os
import struct
import subprocess
import sys
import tempfile

# Logits: a llama.cpp top-2 margin below this is a near-tie, past which the
# engines' greedy paths may part without either being wrong.
NEAR_TIE = 0.5
# Tokens whose probabilities the KL compares (llama.cpp's top ones).
TOPK = 20
# Mean KL above this fails a prompt: the distributions no longer agree.
KL_MAX = 0.05

PROMPTS = [
    "The capital of France is",
    "def reverse_list(xs):\n    ",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "import numpy as np\n\n# Compute the mean of an array\n",
]

LLAMA_SIDE = r"""
import json, sys
import numpy as np
from llama_cpp import Llama
gguf, n_new, prompts = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
llm = Llama(model_path=gguf, n_ctx=512, logits_all=True, verbose=False, n_threads=2)
out = []
for p in prompts:
    toks = llm.tokenize(p.encode(), add_bos=True, special=False)
    llm.reset()
    llm.eval(toks)
    gen, rows = [], []
    for _ in range(n_new):
        row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64)
        t = int(row.argmax())
        rows.append(row)
        gen.append(t)
        if t == llm.token_eos():
            break
        llm.eval([t])
    top = []
    for row in rows:
        idx = np.argsort(-row)[: %(topk)d]
        top.append([[int(i), float(row[i])] for i in idx])
    out.append({"prompt_ids": toks, "gen": gen, "top": top,
                "text": llm.detokenize(gen).decode("utf-8", "replace")})
print(json.dumps(out))
""" % {"topk": TOPK}


def lmrr_scores(lmrr, model, text):
    """Token ids and logits rows of `text` teacher-forced on lmrr."""
    with tempfile.TemporaryDirectory() as d:
        tf, of = os.path.join(d, "t.txt"), os.path.join(d, "s.bin")
        with open(tf, "w", encoding="utf-8") as f:
            f.write(text)
        subprocess.run([lmrr, "score", "--model", model, "--text-file", tf, "--out", of],
                       check=True, stdout=subprocess.DEVNULL)
        data = open(of, "rb").read()
    (n,) = struct.unpack_from("<I", data, 0)
    ids = list(struct.unpack_from("<%dI" % n, data, 4))
    vocab = (len(data) - 4 - 4 * n) // (4 * n)
    rows = []
    off = 4 + 4 * n
    for p in range(n):
        rows.append(struct.unpack_from("<%df" % vocab, data, off + 4 * vocab * p))
    return ids, rows


def kl_top(top, row):
    """KL(llama.cpp || lmrr) over llama.cpp's top tokens, both renormalised."""
    ids = [i for i, _ in top]
    a = [v for _, v in top]
    b = [row[i] for i in ids]

    def probs(v):
        m = max(v)
        e = [math.exp(x - m) for x in v]
        s = sum(e)
        return [x / s for x in e]

    p, q = probs(a), probs(b)
    return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q) if pi > 0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lmrr", required=True)
    ap.add_argument("--python", required=True, help="a Python with llama_cpp")
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--model", required=True, help="the GGUF imported by lmrr import-gguf")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json")
    a = ap.parse_args()
    side = subprocess.run([a.python, "-c", LLAMA_SIDE, a.gguf, str(a.tokens), json.dumps(PROMPTS)],
                          check=True, capture_output=True, text=True)
    runs = json.loads(side.stdout)
    results, ok = [], True
    for prompt, r in zip(PROMPTS, runs):
        ids, rows = lmrr_scores(a.lmrr, a.model, prompt + r["text"])
        want = r["prompt_ids"] + r["gen"]
        same_ids = ids[: len(want)] == want
        agree, clear, kls, first_diff = 0, 0, [], None
        if same_ids:
            p0 = len(r["prompt_ids"]) - 1
            for j, top in enumerate(r["top"]):
                row = rows[p0 + j]
                if top[0][1] - top[1][1] >= NEAR_TIE:
                    clear += 1
                    best = max(range(len(row)), key=row.__getitem__)
                    if best == top[0][0]:
                        agree += 1
                    elif first_diff is None:
                        first_diff = j
                kls.append(kl_top(top, row))
        mean_kl = sum(kls) / len(kls) if kls else float("nan")
        good = same_ids and first_diff is None and mean_kl <= KL_MAX
        ok &= good
        results.append({
            "prompt": prompt, "tokens": len(r["gen"]), "same_token_ids": same_ids,
            "top1_equal": agree, "clear_positions": clear,
            "first_disagreement": first_diff, "mean_kl_top%d" % TOPK: mean_kl, "ok": good,
        })
        print("%-4s %-48r tokens %2d, top-1 equal at %2d of %2d clear positions, mean KL %.5f%s" % (
            "ok" if good else "FAIL", prompt[:46], len(r["gen"]), agree, clear,
            mean_kl, "" if same_ids else " (token ids differ: tokenizers disagree)"))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"near_tie": NEAR_TIE, "topk": TOPK, "kl_max": KL_MAX, "prompts": results}, f, indent=1)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
