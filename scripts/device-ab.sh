#!/usr/bin/env bash
# Each kernel choice left in the table (Tuning in kernels/src/cuda/tuning.rs)
# moved off its default, against the default in alternating rounds on the
# `small` preset in f32 (every choice gives the same bits:
# scripts/device-check.sh holds each to the CPU; run it first, or with
# them). One set is sized for one device call (under 10 minutes):
#
#   scripts/device-ab.sh .gpu                       # DEVICE_AB_SET=decode (default)
#   DEVICE_AB_SET=prefill scripts/device-ab.sh .gpu
#
# `decode`: plain launches (LMRR_CUDA_PDL=0), attention_decode off and for
# every step (LMRR_CUDA_ATTN_DECODE_MAX), norm_reg_lf for every norm
# (LMRR_CUDA_LOADS_FIRST_MIN=1), the lm head by matmul_rows
# (LMRR_CUDA_ROWS4_MIN=0), at batches 1, 8 and 64.
# `prefill`: the gemm from more tokens (LMRR_CUDA_GEMM_MIN), norm_reg_lf
# for no norm (LMRR_CUDA_LOADS_FIRST_MIN=0), the K/V rows back after the step
# rather than layer by layer (LMRR_CUDA_KV_OVERLAP_MIN=0), in 512- and
# 2,048-token prefills.
set -uo pipefail
bin=${1:-.gpu}
rounds=${DEVICE_AB_ROUNDS:-2}
set=${DEVICE_AB_SET:-decode}
case $set in decode|prefill) ;; *) echo "DEVICE_AB_SET must be decode or prefill, not '$set'"; exit 2 ;; esac
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
if [ "$set" = decode ]; then
  ab "LMRR_CUDA_PDL=0" "plain launches: batches 1, 8, 64" --prompt-len 64 --batches 1,8,64
  ab "LMRR_CUDA_ATTN_DECODE_MAX=0" "attention_paged for every decode step: batches 1, 8, 64" --prompt-len 64 --batches 1,8,64
  ab "LMRR_CUDA_LOADS_FIRST_MIN=1" "norm_reg_lf for every norm: batches 1, 8, 64" --prompt-len 64 --batches 1,8,64
  ab "LMRR_CUDA_ROWS4_MIN=0" "the lm head by matmul_rows: batches 1, 8, 64" --prompt-len 64 --batches 1,8,64
  exit 0
fi
ab "LMRR_CUDA_GEMM_MIN=128" "matmul_gemm from 128 tokens: batch 64 and a 512-token prefill" --prompt-len 64 --batches 64
ab "LMRR_CUDA_LOADS_FIRST_MIN=0" "norm_reg_lf for no norm: prefill of 512 tokens" --prompt-len 512 --batches 1
ab "LMRR_CUDA_KV_OVERLAP_MIN=0" "the K/V rows back after the last layer, not layer by layer: prefill of 512 and 2048 tokens" --prompt-len 512 --batches 1
ab "LMRR_CUDA_KV_OVERLAP_MIN=0" "the K/V rows back after the last layer: prefill of 2048 tokens" --prompt-len 2048 --batches 1
