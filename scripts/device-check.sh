#!/usr/bin/env bash
# Contract invariant I6 on a CUDA machine: the kernels' device mirror against
# the CPU fast path bit for bit (gpu_check), then whole generations whose
# digests must not depend on the device, the chunking or the thread count.
#
#   cargo build --release --features cuda
#   cargo build --release -p lmrr-kernels --features cuda --example gpu_check
#   mkdir -p .gpu && cp target/release/lmrr target/release/examples/gpu_check .gpu/ && strip .gpu/*
#   scripts/device-check.sh .gpu          # on the GPU machine; exit 0 = all identical
set -uo pipefail
bin=${1:-.gpu}
fail=0
"$bin/gpu_check" || fail=1
prompt="The quick brown fox jumps over the lazy dog, and then"
for model in synthetic:tiny synthetic:small; do
  ref=""
  for run in "cpu 1 -" "cpu 2 5" "cuda 1 -" "cuda 1 7" "cuda 2 1"; do
    set -- $run
    chunk=(); [ "$3" != "-" ] && chunk=(--prefill-chunk "$3")
    out=$("$bin/lmrr" generate --model "$model" --prompt "$prompt" --max-tokens 24 --device "$1" --threads "$2" "${chunk[@]}" 2>&1); d=$(echo "$out" | sed -n 's/^digest: //p'); [ -n "$d" ] || echo "$out" | tail -n 2
    [ -z "$ref" ] && ref=$d
    same=$([ -n "$d" ] && [ "$d" = "$ref" ] && echo same || echo DIFFERENT)
    [ "$same" = same ] || fail=1
    printf '%-16s device %-4s threads %s chunk %-2s  %s  %s\n' "$model" "$1" "$2" "$3" "${d:-<none>}" "$same"
  done
done
echo "device check: $([ $fail = 0 ] && echo 'all bit-identical' || echo FAILED)"
exit $fail
