#!/usr/bin/env bash
# The incident's scenario (examples/zorblax.toml: two facts, a retry served
# from the prefix cache, an interrupted answer, "to a file", a recall
# question) on a real model: the reference engine recalls both facts, the
# `abort-frees-shared` patch forgets them, and `replay --bisect` over that
# patch and a numerical one names the cache patch as the culprit.
#
#   scripts/zorblax-check.sh MODEL_DIR     (e.g. $(scripts/get-model.sh qwen2.5-coder-1.5b))
#
# LMRR=path/to/lmrr (default target/release/lmrr). Exit 0 when all three
# hold, 1 otherwise (what was seen is printed).
set -uo pipefail
model=${1:?usage: scripts/zorblax-check.sh MODEL_DIR}
lmrr=${LMRR:-target/release/lmrr}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0

# The recall turn's answer: the text after the last `--- output` line, up
# to its digest line.
recall() {
  awk '/^--- output$/ {buf=""; on=1; next} /^digest: / {if (on) last=buf; on=0} on {buf=buf $0 "\n"} END {printf "%s", last}' "$1"
}

"$lmrr" run --model "$model" --script examples/zorblax.toml --record "$tmp/ref.lmrr" >"$tmp/ref.txt" 2>&1 || {
  tail -n 5 "$tmp/ref.txt"; echo "zorblax: the reference run failed"; exit 1; }
ans=$(recall "$tmp/ref.txt")
if grep -q Zorblax <<<"$ans" && grep -qi teal <<<"$ans"; then
  echo "reference recalls: $ans"
else
  echo "REFERENCE FORGOT: $ans"; fail=1
fi

"$lmrr" run --model "$model" --script examples/zorblax.toml --patches abort-frees-shared >"$tmp/bad.txt" 2>&1 || {
  tail -n 5 "$tmp/bad.txt"; echo "zorblax: the patched run failed"; exit 1; }
ans=$(recall "$tmp/bad.txt")
if grep -q Zorblax <<<"$ans"; then
  echo "PATCHED RUN STILL RECALLS (abort-frees-shared): $ans"; fail=1
else
  echo "abort-frees-shared forgets: $ans"
fi

out=$("$lmrr" replay "$tmp/ref.lmrr" --model "$model" --bisect --patches abort-frees-shared,fast-exp 2>&1)
culprits=$(grep -E '^  culprits? ' <<<"$out" | tail -n 1)
if grep -q 'abort-frees-shared' <<<"$culprits" && ! grep -q 'fast-exp' <<<"$culprits"; then
  echo "bisect: $culprits"
else
  echo "$out" | tail -n 12; echo "BISECT DID NOT NAME abort-frees-shared ALONE"; fail=1
fi
exit $fail
