#!/usr/bin/env bash
# GPU speed on the resident path, side by side with the anchors, in one run
# on the device machine (docs/PERFORMANCE.md quotes its table):
#
#   scripts/device-bench.sh .gpu [ANCHORS_DIR]   # ANCHORS_DIR: the HF anchors (optional;
#                                                 copy ../shared/anchors into a carried folder)
#
# The `small` preset (SmolLM2-135M's shape) in f32 and bf16: decode after a
# 64-token prompt at batch 1, 8 and 64 (batch 1 with CUDA graphs on and off),
# prefill of a 512-token prompt, each against the device's copy bandwidth and
# FP32 FMA rate measured in the same run; the wide gemm tiles against the
# narrow ones; the step's parts at batch 64. Then the anchors on the same
# models: HF eager with and without batch-invariant ops, HF compiled.
set -uo pipefail
bin=${1:-.gpu}
anchors=${2:-}
tmp=$(mktemp -d)
for dt in f32 bf16; do
  "$bin/lmrr" gen-model --preset small --dtype $dt --out "$tmp/small-$dt" >/dev/null || exit 1
done
echo "## lmrr bench --device cuda, small f32, decode after 64 tokens"
"$bin/lmrr" bench --device cuda --model "$tmp/small-f32" --prompt-len 64 --batches 1,8,64 --decode-steps 32 --repeats 5
echo "## lmrr bench --device cuda --speed-only, small bf16, decode after 64 tokens"
"$bin/lmrr" bench --device cuda --model "$tmp/small-bf16" --speed-only --prompt-len 64 --batches 1,8,64 --decode-steps 32 --repeats 5
for dt in f32 bf16; do
  echo "## lmrr bench --device cuda --speed-only, small $dt, prefill of 512 tokens"
  "$bin/lmrr" bench --device cuda --model "$tmp/small-$dt" --speed-only --prompt-len 512 --batches 1 --decode-steps 8 --repeats 5
done
echo "## the step's parts (each synchronized), small f32, batch 64"
LMRR_CUDA_PROFILE=1 "$bin/lmrr" bench --device cuda --model "$tmp/small-f32" --prompt-len 64 --batches 64 --decode-steps 8 --repeats 1 | grep -E "share of"
if [ -n "$anchors" ] && [ -d "$anchors" ]; then
  echo "## anchors on small f32 (the bf16 runs load the same f32 weights in bf16)"
  PYTHONUNBUFFERED=1 python3 "$anchors/hf_decode_anchor.py" "$tmp/small-f32" 2>&1 | grep -E "tok/s|max\|logit"
  PYTHONUNBUFFERED=1 python3 "$anchors/hf_compiled_anchor.py" "$tmp/small-f32" 2>&1 | grep -E "tok/s"
fi
