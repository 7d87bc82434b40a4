#!/usr/bin/env bash
# GPU speed at a real model's shape, both numerics, beside transformers on the
# same weights in the same run (the device machine; docs/PERFORMANCE.md
# quotes its table):
#
#   scripts/device-bench-scale.sh .gpu 1b|8b [ANCHORS_DIR]
#
# `lmrr gen-model --preset 1b|8b` (bf16, the shapes of Llama 3.2 1B and
# Llama 3 8B), then `lmrr bench --device cuda --speed-only` in canonical and
# tensor-core-sm90 numerics: decode after a 64-token prompt at batch 1 and
# 64, prefill of 512 tokens. With ANCHORS_DIR (a carried copy of the
# anchors), scale_anchor.py on the same directory: HF eager prefill of 512,
# eager and static-cache compiled decode at batch 1 and 64, bf16.
#
# BENCH_LONG=N (positions, e.g. 32000; at most the preset's context less
# the decode steps) adds batch-1 decode after an N-token prompt in
# tensor-core numerics, with the decode attention split over the KV length
# (LMRR_CUDA_SPLIT_KV_MIN=1) and without it (=0), one prefill each: the
# long-context figure docs/PERFORMANCE.md sets against the K/V read floor.
set -uo pipefail
bin=${1:-.gpu}
preset=${2:-1b}
anchors=${3:-}
case $preset in 1b|8b) ;; *) echo "preset must be 1b or 8b, not '$preset'"; exit 2 ;; esac
dir=$(mktemp -d)/$preset
"$bin/lmrr" gen-model --preset "$preset" --out "$dir" >/dev/null || exit 1
for numerics in tensor-core-sm90 canonical; do
  echo "## lmrr bench --device cuda --speed-only, $preset bf16, $numerics: decode after 64 tokens"
  "$bin/lmrr" bench --device cuda --model "$dir" --numerics $numerics --speed-only --prompt-len 64 --batches 1,64 --decode-steps 16 --repeats 3 | grep -E "^\| decode, batch|floor"
  echo "## the same, prefill of 512 tokens"
  "$bin/lmrr" bench --device cuda --model "$dir" --numerics $numerics --speed-only --prompt-len 512 --batches 1 --decode-steps 2 --repeats 3 | grep -E "^\| prefill, batch" | grep -v first
done
if [ -n "${BENCH_LONG:-}" ]; then
  for split in 1 0; do
    echo "## decode after $BENCH_LONG tokens, $preset bf16, tensor-core-sm90, LMRR_CUDA_SPLIT_KV_MIN=$split"
    LMRR_CUDA_SPLIT_KV_MIN=$split "$bin/lmrr" bench --device cuda --model "$dir" --numerics tensor-core-sm90 --speed-only --prompt-len "$BENCH_LONG" --batches 1 --decode-steps 8 --repeats 1 | grep -E "^\| (decode|prefill), batch" | grep -v first
  done
fi
if [ -n "$anchors" ] && [ -f "$anchors/scale_anchor.py" ]; then
  echo "## transformers on the same weights (bf16)"
  PYTHONUNBUFFERED=1 python3 "$anchors/scale_anchor.py" "$dir" 2>&1 | grep -E "HF|Error"
fi
rm -rf "$dir"
