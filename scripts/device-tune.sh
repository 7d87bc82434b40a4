#!/usr/bin/env bash
# Which kernel choice is fastest on this device (`Tuning` in
# kernels/src/cuda/tuning.rs; every choice gives the same bits, which
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
echo "## matmul_gemm from N tokens (LMRR_CUDA_GEMM_MIN), batches 16, 64 and a 512-token prefill"
for g in 9 32 64 128 100000; do
  echo "# LMRR_CUDA_GEMM_MIN=$g"
  LMRR_CUDA_GEMM_MIN=$g b --prompt-len 64 --batches 16,64
  LMRR_CUDA_GEMM_MIN=$g b --prompt-len 512 --batches 1
done
echo "## programmatic dependent launch (LMRR_CUDA_PDL) against plain launches, batches 1, 8, 64 and prefill"
for pdl in 1 0; do
  echo "# LMRR_CUDA_PDL=$pdl"
  LMRR_CUDA_PDL=$pdl b --prompt-len 64 --batches 1,8,64
  LMRR_CUDA_PDL=$pdl b --prompt-len 512 --batches 1
done
echo "## attention_decode up to N blocks (LMRR_CUDA_ATTN_DECODE_MAX) against attention_paged, batches 1, 8, 16, 64"
for am in 132 0 100000; do
  echo "# LMRR_CUDA_ATTN_DECODE_MAX=$am"
  LMRR_CUDA_ATTN_DECODE_MAX=$am b --prompt-len 64 --batches 1,8,16,64
done
echo "## norm_reg_lf from N rows (LMRR_CUDA_LOADS_FIRST_MIN), batches 1, 8, 64 and prefill"
for lf in 0 1 128; do
  echo "# LMRR_CUDA_LOADS_FIRST_MIN=$lf"
  LMRR_CUDA_LOADS_FIRST_MIN=$lf b --prompt-len 64 --batches 1,8,64
  LMRR_CUDA_LOADS_FIRST_MIN=$lf b --prompt-len 512 --batches 1
done
echo "## matmul_rows4 for matrices of N rows or more (LMRR_CUDA_ROWS4_MIN), batches 1, 8, 64"
for r4 in 0 32768 1; do
  echo "# LMRR_CUDA_ROWS4_MIN=$r4"
  LMRR_CUDA_ROWS4_MIN=$r4 b --prompt-len 64 --batches 1,8,64
done
echo "## the K/V rows back layer by layer from N tokens (LMRR_CUDA_KV_OVERLAP_MIN)"
for ov in 0 64 256; do
  echo "# LMRR_CUDA_KV_OVERLAP_MIN=$ov"
  LMRR_CUDA_KV_OVERLAP_MIN=$ov b --prompt-len 64 --batches 64
  LMRR_CUDA_KV_OVERLAP_MIN=$ov b --prompt-len 512 --batches 1
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
