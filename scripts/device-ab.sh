#!/usr/bin/env bash
# Paths built without a device, each turned on (or a default turned back)
# against the default in alternating rounds on the `small` preset in f32
# (every choice gives the same bits: scripts/device-check.sh holds each to
# the CPU; run it first, or with them). Sized for one device call (under
# 10 minutes) per set:
#
#   scripts/device-ab.sh .gpu                      # DEVICE_AB_SET=loads (default)
#   DEVICE_AB_SET=rows4 scripts/device-ab.sh .gpu  # matmul_rows4 (the head's default from 8 tokens since 2026-12-06)
#   DEVICE_AB_SET=qs scripts/device-ab.sh .gpu     # attention_decode_rope_qs (the default since 2026-12-06)
#   DEVICE_AB_SET=multi4 scripts/device-ab.sh .gpu # matmul_multi4 (built 2026-12-06, not yet measured)
#   DEVICE_AB_SET=lb scripts/device-ab.sh .gpu     # launch bounds (LMRR_CUDA_LB_*), the early attention inputs (2026-12-06b)
#   DEVICE_AB_SET=pf scripts/device-ab.sh .gpu     # prefill attention groups longest first (the default since 2026-12-06c)
#   DEVICE_AB_SET=rn scripts/device-ab.sh .gpu     # o and down with the norm after them (matmul_rows_norm, built 2026-12-06c)
#   DEVICE_AB_SET=new scripts/device-ab.sh .gpu    # the four paths built on 2026-12-05e
#   DEVICE_AB_SET=six scripts/device-ab.sh .gpu    # the six paths made defaults on 2026-12-05
#
# `loads`: norm_reg_lf (the residual row loaded before its stores) for
# every norm (LMRR_CUDA_LOADS_FIRST_MIN=1) at batches 1, 8 and 64, and for
# none (=0) in a 512-token prefill, against the default (norms of 128 rows
# or more: measured on 2026-12-05f, prefill gained and batch-1 decode
# lost); and the head's add and norm as three launches
# (LMRR_CUDA_HEAD_DIRECT=0) against the one of the default.
# `rows4`: the lm head by matmul_rows (LMRR_CUDA_ROWS4_MIN=0) against the
# default (matmul_rows4 for heads of 32,768 rows or more from 8 tokens) at
# batches 1, 8 and 64; matmul_rows4 at batch 1 too (LMRR_CUDA_ROWS4_TOKENS=1);
# and for every matmul_rows matrix (=1) at batch 8.
# `qs`: decode attention reloading q from global memory
# (LMRR_CUDA_ROPE_QS=0) against the default (q handed over in shared
# memory) at batches 1, 8 and 64.
# `multi4`: q/k/v and gate/up four rows a block (LMRR_CUDA_MULTI4=1) at
# batches 1 and 8, alone and with every matmul_rows matrix by matmul_rows4
# (LMRR_CUDA_ROWS4_MIN=1 LMRR_CUDA_ROWS4_TOKENS=1: o, down and the head),
# and with o and down by matmul_rows4 but the head by matmul_rows
# (LMRR_CUDA_ROWS4_MAX=32767).
# `lb`: the decode attention kernels with launch bounds of 4 blocks an SM,
# matmul_rows4 of 8 and matmul_multi of 16 (LMRR_CUDA_LB_ATTN_DECODE=4
# LMRR_CUDA_LB_ROWS4=8 LMRR_CUDA_LB_MULTI=16: fewer registers, more blocks
# an SM) at batches 1, 8 and 64 (measured 2026-12-06b on an H200: slower
# with the early inputs at batch 1, no gain at 64 or in prefill); decode
# attention's step inputs loaded after the PDL wait (LMRR_CUDA_ATTN_EARLY=0,
# the form before 2026-12-06b) at the same batches; then
# attention_prefill_hd64 with 4 and with 3 in a 512-token prefill. Each
# distinct module costs the driver's JIT once (about 50 s on an H100).
# `pf`: a prefill's attention groups listed longest first
# (LMRR_CUDA_PF_LONGEST_FIRST=1) against span order, in prefills of 512
# and 2,048 tokens and of 8 and 64 sequences of 64.
# `rn`: o and down each one launch with the residual add and RMSNorm
# after them (LMRR_CUDA_ROWS_NORM_MAX: matmul_rows_norm, the last block to
# finish adds and norms) at batch 1 (=1) and at batches 1 and 8 (=8).
# `new` (built 2026-12-05e, measured 2026-12-05f: docs/PERFORMANCE.md): gate
# and up with SwiGLU in one launch (LMRR_CUDA_GATE_UP_SWIGLU), the head's add
# and norm in one launch (LMRR_CUDA_HEAD_DIRECT, since made the default),
# SwiGLU four elements a thread (LMRR_CUDA_SWIGLU4), loads first
# (LMRR_CUDA_LOADS_FIRST_MIN=1, for every norm; then a module-wide switch), the four
# together; and the K/V copy during the head for every step
# (LMRR_CUDA_KV_EARLY_MIN=1, the default since 2026-12-05e) against 16.
# Prints, per flag, each round's tok/s for the shapes it is meant for.
set -uo pipefail
bin=${1:-.gpu}
rounds=${DEVICE_AB_ROUNDS:-2}
set=${DEVICE_AB_SET:-loads}
case $set in loads|rows4|qs|multi4|lb|pf|rn|new|six) ;; *) echo "DEVICE_AB_SET must be loads, rows4, qs, multi4, lb, pf, rn, new or six, not '$set'"; exit 2 ;; esac
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
if [ "$set" = loads ]; then
  ab "LMRR_CUDA_LOADS_FIRST_MIN=1" "norm_reg_lf for every norm: batches 1, 8, 64" --prompt-len 64 --batches 1,8,64
  ab "LMRR_CUDA_LOADS_FIRST_MIN=0" "norm_reg_lf for no norm: prefill of 512 tokens" --prompt-len 512 --batches 1
  ab "LMRR_CUDA_HEAD_DIRECT=0" "the head's add and norm as three launches (the default before): batches 1, 8" --prompt-len 64 --batches 1,8
  exit 0
fi
if [ "$set" = rows4 ]; then
  ab "LMRR_CUDA_ROWS4_MIN=0" "the lm head by matmul_rows: batches 1, 8, 64" --prompt-len 64 --batches 1,8,64
  ab "LMRR_CUDA_ROWS4_TOKENS=1" "matmul_rows4 for the lm head at batch 1 too" --prompt-len 64 --batches 1
  ab "LMRR_CUDA_ROWS4_MIN=1" "matmul_rows4 for every matmul_rows matrix from 8 tokens: batch 8" --prompt-len 64 --batches 8
  exit 0
fi
if [ "$set" = qs ]; then
  ab "LMRR_CUDA_ROPE_QS=0" "q reloaded from global memory by decode attention: batches 1, 8, 64" --prompt-len 64 --batches 1,8,64
  exit 0
fi
if [ "$set" = multi4 ]; then
  ab "LMRR_CUDA_MULTI4=1" "q/k/v and gate/up four rows a block: batches 1, 8" --prompt-len 64 --batches 1,8
  ab "LMRR_CUDA_MULTI4=1 LMRR_CUDA_ROWS4_MIN=1 LMRR_CUDA_ROWS4_TOKENS=1" "every decode matmul four rows a block: batches 1, 8" --prompt-len 64 --batches 1,8
  ab "LMRR_CUDA_MULTI4=1 LMRR_CUDA_ROWS4_MIN=1 LMRR_CUDA_ROWS4_TOKENS=1 LMRR_CUDA_ROWS4_MAX=32767" "every layer matmul four rows a block, the head by matmul_rows: batch 1" --prompt-len 64 --batches 1
  exit 0
fi
if [ "$set" = lb ]; then
  ab "LMRR_CUDA_LB_ATTN_DECODE=4 LMRR_CUDA_LB_ROWS4=8 LMRR_CUDA_LB_MULTI=16" "decode attention at 4 blocks an SM, matmul_rows4 at 8, matmul_multi at 16: batches 1, 8, 64" --prompt-len 64 --batches 1,8,64
  ab "LMRR_CUDA_ATTN_EARLY=0" "decode attention's step inputs after the PDL wait (the form before 2026-12-06b): batches 1, 8, 64" --prompt-len 64 --batches 1,8,64
  ab "LMRR_CUDA_LB_ATTN_PREFILL=4" "attention_prefill_hd64 at 4 blocks an SM: prefill of 512 tokens" --prompt-len 512 --batches 1
  ab "LMRR_CUDA_LB_ATTN_PREFILL=3" "attention_prefill_hd64 at 3 blocks an SM: prefill of 512 tokens" --prompt-len 512 --batches 1
  exit 0
fi
if [ "$set" = pf ]; then
  ab "LMRR_CUDA_PF_LONGEST_FIRST=1" "prefill attention groups longest first: 512 tokens" --prompt-len 512 --batches 1
  ab "LMRR_CUDA_PF_LONGEST_FIRST=1" "prefill attention groups longest first: 2048 tokens" --prompt-len 2048 --batches 1
  ab "LMRR_CUDA_PF_LONGEST_FIRST=1" "prefill attention groups longest first: 8 × 64 and 64 × 64 tokens" --prompt-len 64 --batches 8,64
  exit 0
fi
if [ "$set" = rn ]; then
  ab "LMRR_CUDA_ROWS_NORM_MAX=1" "o and down with the norm after them, batch 1" --prompt-len 64 --batches 1
  ab "LMRR_CUDA_ROWS_NORM_MAX=8" "o and down with the norm after them, to 8 tokens: batches 1, 8" --prompt-len 64 --batches 1,8
  exit 0
fi
if [ "$set" = new ]; then
  ab "LMRR_CUDA_GATE_UP_SWIGLU=1" "gate and up with SwiGLU in one launch: batches 1, 8" --prompt-len 64 --batches 1,8
  ab "LMRR_CUDA_HEAD_DIRECT=0" "the head's add and norm as three launches: batches 1, 8" --prompt-len 64 --batches 1,8
  ab "LMRR_CUDA_SWIGLU4=1" "SwiGLU four a thread: prefill of 512 tokens" --prompt-len 512 --batches 1
  ab "LMRR_CUDA_LOADS_FIRST_MIN=1" "norm_reg_lf for every norm: batches 1, 8" --prompt-len 64 --batches 1,8
  all="LMRR_CUDA_GATE_UP_SWIGLU=1 LMRR_CUDA_SWIGLU4=1 LMRR_CUDA_LOADS_FIRST_MIN=1"
  ab "$all" "the four together: batches 1, 8, 64" --prompt-len 64 --batches 1,8,64
  ab "$all" "the four together: prefill of 512 tokens" --prompt-len 512 --batches 1
  ab "LMRR_CUDA_KV_EARLY_MIN=16" "K/V rows copied during the head from 16 tokens (the default before), not 1: batches 1, 8" --prompt-len 64 --batches 1,8
  exit 0
fi
ab "LMRR_CUDA_ROPE_ATTN=0" "without RoPE inside decode attention: batches 1, 8" --prompt-len 64 --batches 1,8
ab "LMRR_CUDA_GEMM_MULTI=0 LMRR_CUDA_FOLD_SUMS=0" "a gemm launch per matrix, sum_chunks after each split: batch 64" --prompt-len 64 --batches 64
ab "LMRR_CUDA_GEMM_MULTI=0" "split sums folded, a launch per matrix: batch 64" --prompt-len 64 --batches 64
ab "LMRR_CUDA_ATTN_PREFILL_HD64=0" "attention_prefill for head_dim 64: prefill of 512 tokens" --prompt-len 512 --batches 1
ab "LMRR_CUDA_ATTN_PREFILL_HD64=0" "attention_prefill for head_dim 64: prefill of 2048 tokens" --prompt-len 2048 --batches 1
ab "LMRR_CUDA_KV_OVERLAP_MIN=0" "K/V rows downloaded after the step, not layer by layer: prefill of 512 tokens" --prompt-len 512 --batches 1
ab "LMRR_CUDA_KV_EARLY_MIN=0" "K/V rows downloaded after the step, not during the head: batches 1, 8, 64" --prompt-len 64 --batches 1,8,64
off="LMRR_CUDA_ROPE_ATTN=0 LMRR_CUDA_GEMM_MULTI=0 LMRR_CUDA_FOLD_SUMS=0 LMRR_CUDA_ATTN_PREFILL_HD64=0 LMRR_CUDA_KV_OVERLAP_MIN=0 LMRR_CUDA_KV_EARLY_MIN=0"
ab "$off" "all six off (the defaults before 2026-12-05): batches 1, 64" --prompt-len 64 --batches 1,64
ab "$off" "all six off: prefill of 512 tokens" --prompt-len 512 --batches 1
