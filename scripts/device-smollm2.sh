#!/usr/bin/env bash
# The real SmolLM2-135M-Instruct on a GPU machine: its Q4_1 GGUF (what
# scripts/get-smollm2.sh fetches) imported there in f32, greedy generations
# whose digests must be the same on the CPU and on CUDA (and at another
# prefill chunking and thread count), a session (examples/zorblax.toml)
# recorded on the GPU that must replay bit-exactly on the CPU, and its speed:
# the f32 import and the Q4_1 blocks kept (dequantized in the kernels).
#
#   scripts/device-smollm2.sh .gpu FILE.gguf     # on the GPU machine; exit 0 = all identical
#
# The GGUF is 98 MB; a device call that carries at most 64 MiB can bring it
# in two parts (`split -n 2 -d FILE .gpu/smol.` here, one part a call, the
# machine kept warm between them; then `cat .gpu/smol.00 .gpu/smol.01`).
# CPU-only machines: DEVS=cpu checks the CPU side alone.
set -uo pipefail
bin=${1:-.gpu}
gguf=${2:?usage: scripts/device-smollm2.sh BIN_DIR FILE.gguf}
devs=${DEVS:-cpu cuda}
last=${devs##* }
tmp=$(mktemp -d)
fail=0
"$bin/lmrr" import-gguf "$gguf" --out "$tmp/f32" --dtype f32 | tail -n 1 || exit 1
declare -A refs
check() {  # label, group, then generate's arguments: every digest of a group must be its first one
  local label=$1 group=$2 d
  shift 2
  for dev in $devs; do
    d=$("$bin/lmrr" generate --model "$tmp/f32" "$@" --device "$dev" 2>&1 | sed -n 's/^digest: //p')
    [ -z "${refs[$group]:-}" ] && refs[$group]=$d
    local ref=${refs[$group]}
    printf '%-44s %-4s %s  %s\n' "$label" "$dev" "${d:-<none>}" "$([ -n "$d" ] && [ "$d" = "$ref" ] && echo same || echo DIFFERENT)"
    [ -n "$d" ] && [ "$d" = "$ref" ] || fail=1
  done
}
check "chat: the capital of France, 24 tokens" chat --chat --prompt "What is the capital of France?" --max-tokens 24
check "96 tokens past EOS" long --prompt "The history of the printing press" --max-tokens 96 --ignore-eos
check "96 tokens, prefill chunks of 3, 3 threads" long --prompt "The history of the printing press" --max-tokens 96 --ignore-eos --prefill-chunk 3 --threads 3
"$bin/lmrr" run --model "$tmp/f32" --script examples/zorblax.toml --device "$last" --record "$tmp/z.lmrr" >/dev/null 2>&1 || fail=1
out=$("$bin/lmrr" replay "$tmp/z.lmrr" --model "$tmp/f32" --device cpu 2>&1); rc=$?
printf 'examples/zorblax.toml recorded on %s, replayed on cpu: exit %s  %s\n' "$last" "$rc" "$(echo "$out" | grep -m1 -E 'bit-exact|DIVERGED|error')"
[ $rc = 0 ] || fail=1
if [ "$last" = cuda ]; then
  b() { "$bin/lmrr" bench --device cuda --model "$1" --speed-only --repeats 5 "${@:2}" 2>&1; }
  echo "## speed, f32 import"
  b "$tmp/f32" --decode-steps 32 --prompt-len 64 --batches 1,8,64 | grep -E "^\| (decode|device copy|device FP32|weights|floor)" | grep -v "graphs off"
  b "$tmp/f32" --decode-steps 8 --prompt-len 512 --batches 1 | grep -E "prefill, batch 1 × 512 tokens \("
  echo "## speed, Q4_1 blocks kept (dequantized in the kernels)"
  "$bin/lmrr" import-gguf "$gguf" --out "$tmp/q41" --dtype keep | tail -n 1
  b "$tmp/q41" --decode-steps 32 --prompt-len 64 --batches 1,8,64 | grep -E "^\| decode, batch [0-9]+ \("
fi
echo "smollm2 device check: $([ $fail = 0 ] && echo 'all bit-identical' || echo FAILED)"
exit $fail
