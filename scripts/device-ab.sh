#!/usr/bin/env bash
# The kernel paths built and held bit-identical without a device, each
# against the default in alternating rounds on the `small` preset in f32
# (every choice gives the same bits: scripts/device-check.sh holds each to
# the CPU; run it first). Sized for one device call (under 10 minutes):
#
#   scripts/device-ab.sh .gpu            # on the GPU machine
#
# Prints, per flag, each round's tok/s for the shapes it is meant for, and
# last all six on together against the default.
set -uo pipefail
bin=${1:-.gpu}
rounds=${DEVICE_AB_ROUNDS:-2}
tmp=$(mktemp -d)
"$bin/lmrr" gen-model --preset small --dtype f32 --out "$tmp/small" >/dev/null || exit 1
b() { "$bin/lmrr" bench --device cuda --model "$tmp/small" --speed-only --decode-steps 32 --repeats 5 "$@" 2>&1 | grep -E "^\| (prefill|decode)"; }
ab() {
  # ab "VAR=1 VAR2=1" LABEL ARGS... : the default, then the flags, `rounds` times.
  local flags=$1 label=$2
  shift 2
  echo "## $label"
  for r in $(seq "$rounds"); do
    echo "# default (round $r)"
    b "$@"
    echo "# $flags (round $r)"
    env $flags "$bin/lmrr" bench --device cuda --model "$tmp/small" --speed-only --decode-steps 32 --repeats 5 "$@" 2>&1 | grep -E "^\| (prefill|decode)"
  done
}
ab "LMRR_CUDA_ROPE_ATTN=1" "RoPE inside decode attention: batches 1, 8" --prompt-len 64 --batches 1,8
ab "LMRR_CUDA_GEMM_MULTI=1 LMRR_CUDA_FOLD_SUMS=1" "one gemm launch for q/k/v and gate/up, split sums folded: batch 64" --prompt-len 64 --batches 64
ab "LMRR_CUDA_FOLD_SUMS=1" "split sums folded alone: batch 64" --prompt-len 64 --batches 64
ab "LMRR_CUDA_ATTN_PREFILL_HD64=1" "attention_prefill_hd64: prefill of 512 tokens" --prompt-len 512 --batches 1
ab "LMRR_CUDA_ATTN_PREFILL_HD64=1" "attention_prefill_hd64: prefill of 2048 tokens" --prompt-len 2048 --batches 1
ab "LMRR_CUDA_KV_OVERLAP_MIN=256" "K/V rows copied back layer by layer during the step: prefill of 512 tokens" --prompt-len 512 --batches 1
ab "LMRR_CUDA_KV_EARLY_MIN=16" "K/V rows copied back during the head: batches 8, 64" --prompt-len 64 --batches 8,64
all="LMRR_CUDA_ROPE_ATTN=1 LMRR_CUDA_GEMM_MULTI=1 LMRR_CUDA_FOLD_SUMS=1 LMRR_CUDA_ATTN_PREFILL_HD64=1 LMRR_CUDA_KV_OVERLAP_MIN=256 LMRR_CUDA_KV_EARLY_MIN=16"
ab "$all" "all six: batches 1, 64" --prompt-len 64 --batches 1,64
ab "$all" "all six: prefill of 512 tokens" --prompt-len 512 --batches 1
