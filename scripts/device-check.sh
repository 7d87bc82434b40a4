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
# Bundles recorded on the CPU replay bit-exactly on the GPU, a session recorded
# on the GPU replays bit-exactly on the CPU, and the cache bug is still found.
for b in replays/*.lmrr; do
  out=$("$bin/lmrr" replay "$b" --device cuda 2>&1); rc=$?
  printf 'replay %-26s on cuda: exit %s  %s\n' "$b" "$rc" "$(echo "$out" | grep -m1 -E 'bit-exact|DIVERGED|error')"
  [ $rc = 0 ] || fail=1
done
tmp=$(mktemp -d)
"$bin/lmrr" run --script examples/incident.toml --device cuda --record "$tmp/gpu.lmrr" >/dev/null 2>&1 || fail=1
out=$("$bin/lmrr" replay "$tmp/gpu.lmrr" --device cpu 2>&1); rc=$?
printf 'record on cuda, replay on cpu: exit %s  %s\n' "$rc" "$(echo "$out" | grep -m1 -E 'bit-exact|DIVERGED|error')"
[ $rc = 0 ] || fail=1
# `lmrr serve --device cuda`: a served session (greedy, sampled, a stream
# cancelled mid-generation) replays bit-exactly on the GPU and on the CPU.
"$bin/lmrr" serve --device cuda --record-dir "$tmp/serve" --addr 127.0.0.1:8020 --quiet 2>"$tmp/serve.log" &
pid=$!
python3 scripts/serve_device_client.py 8020 >/dev/null || fail=1
kill -TERM $pid; wait $pid || fail=1
for b in "$tmp"/serve/*.lmrr; do
  for dev in cuda cpu; do
    out=$("$bin/lmrr" replay "$b" --device $dev 2>&1); rc=$?
    printf 'served on cuda, replay on %-4s: exit %s  %s\n' "$dev" "$rc" "$(echo "$out" | grep -m1 -E 'bit-exact|DIVERGED|error')"
    [ $rc = 0 ] || fail=1
  done
done
out=$("$bin/lmrr" replay replays/incident.lmrr --device cuda --patches abort-inserts-partial 2>&1); rc=$?
printf 'replay incident on cuda under abort-inserts-partial: exit %s  %s\n' "$rc" "$(echo "$out" | grep -m1 -E 'DIVERGED|bit-exact|error')"
[ $rc = 1 ] || fail=1
echo "device check: $([ $fail = 0 ] && echo 'all bit-identical' || echo FAILED)"
exit $fail
