#!/usr/bin/env bash
# Which kernel choice is fastest on this device (`Tuning` in
# kernels/src/cuda/resident.rs; every choice gives the same bits, which
# device-check.sh holds to the CPU): the `small` preset in f32, decode and
# prefill at each batch under each choice, then an Nsight Compute summary of
# the main kernels when `ncu` is on the machine.
#
#   scripts/device-tune.sh .gpu      # on the GPU machine
set -uo pipefail
bin=${1:-.gpu}
tmp=$(mktemp -d)
"$bin/lmrr" gen-model --preset small --dtype f32 --out "$tmp/small" >/dev/null || exit 1
b() { "$bin/lmrr" bench --device cuda --model "$tmp/small" --speed-only --decode-steps 32 --repeats 5 "$@" 2>&1 | grep -E "^\| (prefill|decode)"; }
echo "## fused steps (LMRR_CUDA_FUSED_MAX) against the separate kernels, batches 1, 2, 4, 8"
for f in 0 1 2 4 8; do
  echo "# LMRR_CUDA_FUSED_MAX=$f"
  LMRR_CUDA_FUSED_MAX=$f b --prompt-len 64 --batches 1,2,4,8
done
echo "## SwiGLU in gate/up's epilogue (LMRR_CUDA_SWIGLU_MAX) against its own kernel, batches 1, 2, 4, 8"
for sw in 0 8; do
  echo "# LMRR_CUDA_SWIGLU_MAX=$sw"
  LMRR_CUDA_SWIGLU_MAX=$sw b --prompt-len 64 --batches 1,2,4,8
done
echo "## matmul_gemm from N tokens (LMRR_CUDA_GEMM_MIN), split below B blocks (LMRR_CUDA_SPLIT_BLOCKS), batches 16, 64"
for g in 9 32 100000; do
  for sb in 0 512 1024 4096; do
    [ $g = 100000 ] && [ $sb != 0 ] && continue
    echo "# LMRR_CUDA_GEMM_MIN=$g LMRR_CUDA_SPLIT_BLOCKS=$sb"
    LMRR_CUDA_GEMM_MIN=$g LMRR_CUDA_SPLIT_BLOCKS=$sb b --prompt-len 64 --batches 16,64
  done
done
echo "## programmatic dependent launch (LMRR_CUDA_PDL) against plain launches, batches 1, 8, 64 and prefill"
for pdl in 1 0; do
  echo "# LMRR_CUDA_PDL=$pdl"
  LMRR_CUDA_PDL=$pdl b --prompt-len 64 --batches 1,8,64
  LMRR_CUDA_PDL=$pdl b --prompt-len 512 --batches 1
done
echo "## weights before the PDL wait (LMRR_CUDA_PDL_PREFETCH) against every kernel waiting first, batches 1, 8, 64 and prefill"
for pp in 1 0 1 0; do
  echo "# LMRR_CUDA_PDL_PREFETCH=$pp"
  LMRR_CUDA_PDL_PREFETCH=$pp b --prompt-len 64 --batches 1,8,64
  LMRR_CUDA_PDL_PREFETCH=$pp b --prompt-len 512 --batches 1
done
echo "## attention_decode's inputs and earlier steps' K/V rows before the wait (LMRR_CUDA_ATTN_PREFETCH), batches 1, 8 and after 512"
for ap in 1 0 1 0; do
  echo "# LMRR_CUDA_ATTN_PREFETCH=$ap"
  LMRR_CUDA_ATTN_PREFETCH=$ap b --prompt-len 64 --batches 1,8
  LMRR_CUDA_ATTN_PREFETCH=$ap b --prompt-len 512 --batches 1
done
echo "## attention_decode up to N blocks (LMRR_CUDA_ATTN_DECODE_MAX) against attention_paged, batches 1, 8, 16, 64"
for am in 132 0 100000; do
  echo "# LMRR_CUDA_ATTN_DECODE_MAX=$am"
  LMRR_CUDA_ATTN_DECODE_MAX=$am b --prompt-len 64 --batches 1,8,16,64
done
echo "## SwiGLU in down's input (LMRR_CUDA_DOWN_SWIGLU) against the swiglu kernel, batches 1, 8"
for ds in 0 1; do
  echo "# LMRR_CUDA_DOWN_SWIGLU=$ds"
  LMRR_CUDA_DOWN_SWIGLU=$ds b --prompt-len 64 --batches 1,8
done
echo "## pipelined staging (LMRR_CUDA_GEMM_PIPELINED) against the wide tiles, batch 64 and prefill"
for pf in 1 0; do
  echo "# LMRR_CUDA_GEMM_PIPELINED=$pf"
  LMRR_CUDA_GEMM_PIPELINED=$pf b --prompt-len 64 --batches 64
  LMRR_CUDA_GEMM_PIPELINED=$pf b --prompt-len 512 --batches 1
done
echo "## q/k/v and gate/up in one launch (LMRR_CUDA_GEMM_MULTI), split sums folded into their readers (LMRR_CUDA_FOLD_SUMS), alternating, batches 16, 64 and prefill"
for rep in 1 2; do
  for mf in "0 0" "1 0" "0 1" "1 1"; do
    set -- $mf
    echo "# LMRR_CUDA_GEMM_MULTI=$1 LMRR_CUDA_FOLD_SUMS=$2 (round $rep)"
    LMRR_CUDA_GEMM_MULTI=$1 LMRR_CUDA_FOLD_SUMS=$2 b --prompt-len 64 --batches 16,64
    LMRR_CUDA_GEMM_MULTI=$1 LMRR_CUDA_FOLD_SUMS=$2 b --prompt-len 512 --batches 1
  done
done
echo "## RoPE and the K/V page writes inside decode attention (LMRR_CUDA_ROPE_ATTN), alternating, batches 1, 8 and after 512 tokens"
for ra in 0 1 0 1; do
  echo "# LMRR_CUDA_ROPE_ATTN=$ra"
  LMRR_CUDA_ROPE_ATTN=$ra b --prompt-len 64 --batches 1,8
  LMRR_CUDA_ROPE_ATTN=$ra b --prompt-len 512 --batches 1
done
echo "## attention_decode_hd64 (LMRR_CUDA_ATTN_DECODE_HD64) against attention_decode, alternating, batches 1, 8 and after 512 tokens"
for ad in 0 1 0 1; do
  echo "# LMRR_CUDA_ATTN_DECODE_HD64=$ad"
  LMRR_CUDA_ATTN_DECODE_HD64=$ad b --prompt-len 64 --batches 1,8
  LMRR_CUDA_ATTN_DECODE_HD64=$ad b --prompt-len 512 --batches 1
done
echo "## matmul_chunk (LMRR_CUDA_CHUNK_MAX) for the decode matmuls, alone and in fused steps, against matmul_rows, batches 1, 8"
for fm in 0 8; do
  for cm in 0 8; do
    echo "# LMRR_CUDA_CHUNK_MAX=$cm LMRR_CUDA_FUSED_MAX=$fm"
    LMRR_CUDA_CHUNK_MAX=$cm LMRR_CUDA_FUSED_MAX=$fm b --prompt-len 64 --batches 1,8
  done
done
echo "## attention_prefill_hd64 (LMRR_CUDA_ATTN_PREFILL_HD64) against attention_prefill, alternating, prefill of 512 and 2048 tokens and 64 × 64"
for ah in 0 1 0 1; do
  echo "# LMRR_CUDA_ATTN_PREFILL_HD64=$ah"
  LMRR_CUDA_ATTN_PREFILL_HD64=$ah b --prompt-len 512 --batches 1
  LMRR_CUDA_ATTN_PREFILL_HD64=$ah b --prompt-len 2048 --batches 1
  LMRR_CUDA_ATTN_PREFILL_HD64=$ah b --prompt-len 64 --batches 64
done
echo "## tokens per attention_prefill group (LMRR_CUDA_ATTN_PREFILL_GROUP) under each kernel, prefill of 512 and 2048 tokens"
for ah in 0 1; do
  for gs in 16 8 4; do
    echo "# LMRR_CUDA_ATTN_PREFILL_HD64=$ah LMRR_CUDA_ATTN_PREFILL_GROUP=$gs"
    LMRR_CUDA_ATTN_PREFILL_HD64=$ah LMRR_CUDA_ATTN_PREFILL_GROUP=$gs b --prompt-len 512 --batches 1
    LMRR_CUDA_ATTN_PREFILL_HD64=$ah LMRR_CUDA_ATTN_PREFILL_GROUP=$gs b --prompt-len 2048 --batches 1
  done
done
echo "## the K/V rows back while the device runs: layer by layer from N tokens (LMRR_CUDA_KV_OVERLAP_MIN), during the head from M (LMRR_CUDA_KV_EARLY_MIN)"
for ov in 0 64 256; do
  for ea in 0 1 16 64; do
    echo "# LMRR_CUDA_KV_OVERLAP_MIN=$ov LMRR_CUDA_KV_EARLY_MIN=$ea"
    LMRR_CUDA_KV_OVERLAP_MIN=$ov LMRR_CUDA_KV_EARLY_MIN=$ea b --prompt-len 64 --batches 1,8,64
    LMRR_CUDA_KV_OVERLAP_MIN=$ov LMRR_CUDA_KV_EARLY_MIN=$ea b --prompt-len 512 --batches 1
  done
done
echo "## prefill of 512 tokens"
for g in 9 100000; do
  for sb in 0 1024; do
    [ $g = 100000 ] && [ $sb != 0 ] && continue
    echo "# LMRR_CUDA_GEMM_MIN=$g LMRR_CUDA_SPLIT_BLOCKS=$sb"
    LMRR_CUDA_GEMM_MIN=$g LMRR_CUDA_SPLIT_BLOCKS=$sb b --prompt-len 512 --batches 1
  done
done
ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
if [ -n "$ncu" ]; then
  echo "## ncu: a 64-token prefill and batch-1 decode, then batch-64 decode steps"
  "$ncu" --kernel-name regex:'matmul|attention|norm|rope|sum_chunks|swiglu' --launch-count 40 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --csv --page raw \
    --metrics gpu__time_duration.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,launch__grid_size \
    "$bin/lmrr" generate --model "$tmp/small" --device cuda --prompt "$(printf 'word %.0s' $(seq 60))" --max-tokens 4 >"$tmp/ncu1.csv" 2>&1
  python3 - "$tmp/ncu1.csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if not rows:
    print(open(sys.argv[1]).read()[-2000:]); sys.exit()
h = rows[0]
def col(name):
    return h.index(name) if name in h else None
ki, gi = col("Kernel Name"), col("launch__grid_size")
ti = col("gpu__time_duration.sum")
si = col("sm__throughput.avg.pct_of_peak_sustained_elapsed")
di = col("dram__throughput.avg.pct_of_peak_sustained_elapsed")
wi = col("sm__warps_active.avg.pct_of_peak_sustained_active")
for r in rows[2:]:
    g = lambda i: r[i] if i is not None else "?"
    unit = rows[1][ti] if ti is not None else ""
    # The three largest stall reasons (WarpStateStats), warps per issue.
    stalls = []
    for i, name in enumerate(h):
        if "issue_stalled" in name and name.endswith("per_issue_active.ratio"):
            try:
                stalls.append((float(r[i].replace(",", "")), name.split("issue_stalled_")[1].split("_per_issue")[0]))
            except (ValueError, IndexError):
                pass
    top = ", ".join(f"{n} {v:.1f}" for v, n in sorted(stalls, reverse=True)[:3])
    print(f"{g(ki)[:28]:<28} grid {g(gi):>7}  {g(ti):>9} {unit}  SM {g(si):>6}%  DRAM {g(di):>6}%  warps active {g(wi):>6}%  stalls: {top}")
PY
else
  echo "## ncu: not on this machine"
fi
