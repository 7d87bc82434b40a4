#!/usr/bin/env bash
# Contract invariant I6 on a CUDA machine: the kernels' device mirror against
# the CPU fast path bit for bit (gpu_check), then whole generations whose
# digests must not depend on the device, the chunking or the thread count.
#
#   cargo build --release --features cuda
#   cargo build --release -p lmrr-kernels --features cuda --example gpu_check --example tc_probe
#   mkdir -p .gpu && cp target/release/lmrr target/release/examples/{gpu_check,tc_probe} .gpu/ && strip .gpu/*
#   scripts/device-check.sh .gpu          # on the GPU machine; exit 0 = all identical
#
# DEVICE_CHECK_GPU_CHECK=0 skips gpu_check (for a run whose kernels.cu
# compiles to the PTX an earlier gpu_check passed: say so where it is
# quoted); DEVICE_CHECK_TUNINGS="A=1 B=2;C=3" replaces the list of kernel
# choices the sessions are recorded under (';' between choices).
# DEVICE_CHECK_PART=core runs everything but those recordings, =tunings only
# them: on a machine lent 10 minutes a command the whole check (about 12
# minutes on an H100) takes three calls: gpu_check alone (over 330 s),
# DEVICE_CHECK_GPU_CHECK=0 DEVICE_CHECK_PART=core, then =tunings. =tc runs only the
# tensor-core section (part of core), =families the section of the
# families beyond llama (part of core).
set -uo pipefail
bin=${1:-.gpu}
part=${DEVICE_CHECK_PART:-all}
case $part in all|core|tunings|tc|families) ;; *) echo "DEVICE_CHECK_PART must be all, core, tunings, tc or families, not '$part'"; exit 2 ;; esac
# The long prompt of the generations below (206 tokens with the embedded
# tokenizer).
long="Inference engines keep a cache of keys and values so that each new token attends to every earlier one without recomputing it; a radix tree lets later requests reuse a shared prefix, and a scheduler batches the decode steps of many users with chunked prefill."
fail=0
tmp=$(mktemp -d)
prompt="The quick brown fox jumps over the lazy dog, and then"
if [ "$part" != tunings ] && [ "$part" != tc ] && [ "$part" != families ]; then
if [ "${DEVICE_CHECK_GPU_CHECK:-1}" = 0 ]; then
  echo "gpu_check: skipped (DEVICE_CHECK_GPU_CHECK=0)"
else
  "$bin/gpu_check" || fail=1
fi
# mini-v4's indexer reads every position while the context has no more than
# index_topk blocks (tiny: 4 blocks of 16 = 64 positions): its prompt and
# generation run well past that, so the sparse path (indexer scores, top-k
# blocks, gathered K/V) is on the device too.
for model in synthetic:tiny synthetic:small synthetic:mini-v4-tiny synthetic:mini-v4-small; do
  p=$prompt; max=24
  case $model in *mini-v4*) p=$long; max=64 ;; esac
  ref=""
  for run in "cpu 1 -" "cpu 2 5" "cuda 1 -" "cuda 1 7" "cuda 2 1"; do
    set -- $run
    chunk=(); [ "$3" != "-" ] && chunk=(--prefill-chunk "$3")
    out=$("$bin/lmrr" generate --model "$model" --prompt "$p" --max-tokens $max --device "$1" --threads "$2" "${chunk[@]}" 2>&1); d=$(echo "$out" | sed -n 's/^digest: //p'); [ -n "$d" ] || echo "$out" | tail -n 2
    [ -z "$ref" ] && ref=$d
    same=$([ -n "$d" ] && [ "$d" = "$ref" ] && echo same || echo DIFFERENT)
    [ "$same" = same ] || fail=1
    printf '%-22s device %-4s threads %s chunk %-2s  %s  %s\n' "$model" "$1" "$2" "$3" "${d:-<none>}" "$same"
  done
done
# Bundles recorded on the CPU replay bit-exactly on the GPU, a session recorded
# on the GPU replays bit-exactly on the CPU, and the cache bug is still found.
for b in replays/*.lmrr; do
  out=$("$bin/lmrr" replay "$b" --device cuda 2>&1); rc=$?
  printf 'replay %-26s on cuda: exit %s  %s\n' "$b" "$rc" "$(echo "$out" | grep -m1 -E 'bit-exact|DIVERGED|error')"
  [ $rc = 0 ] || fail=1
done
# Every llama example session, recorded on the GPU (resident path: weights and
# KV pages on the device, decode steps as CUDA graphs), replays bit-exactly
# on the CPU.
for s in incident long-recall multi-user sampled; do
  rm -f "$tmp/gpu.lmrr"
  "$bin/lmrr" run --script "examples/$s.toml" --device cuda --record "$tmp/gpu.lmrr" >/dev/null 2>&1 || fail=1
  out=$("$bin/lmrr" replay "$tmp/gpu.lmrr" --device cpu 2>&1); rc=$?
  printf 'record examples/%s.toml on cuda, replay on cpu: exit %s  %s\n' "$s" "$rc" "$(echo "$out" | grep -m1 -E 'bit-exact|DIVERGED|error')"
  [ $rc = 0 ] || fail=1
done
# Page-size, batch, chunk and cache invariance on the resident path: the
# incident recorded on the GPU under other page sizes (device pages of 1, 7,
# 64 positions), step budgets (chunked prefill, smaller batches) and with the
# prefix cache off replays bit-exactly on the CPU, and the recompute oracle,
# run on the GPU, finds every sampled token's logits equal to a cache-off,
# batch-of-one recomputation there; graphs off gives the same bundle bits.
for cfg in "--page-size 1" "--page-size 7 --max-batch-tokens 40" "--page-size 64 --max-batch-tokens 9" "--no-prefix-cache" "--max-batch-tokens 3"; do
  rm -f "$tmp/inv.lmrr"
  "$bin/lmrr" run --script examples/multi-user.toml --device cuda $cfg --record "$tmp/inv.lmrr" >/dev/null 2>&1 || fail=1
  out=$("$bin/lmrr" replay "$tmp/inv.lmrr" --device cpu 2>&1); rc=$?
  printf 'multi-user on cuda %-36s replay on cpu: exit %s  %s\n' "$cfg," "$rc" "$(echo "$out" | grep -m1 -E 'bit-exact|DIVERGED|error')"
  [ $rc = 0 ] || fail=1
  out=$("$bin/lmrr" replay "$tmp/inv.lmrr" --device cuda --oracle recompute 2>&1); rc=$?
  printf 'multi-user on cuda %-36s oracle on cuda: exit %s  %s\n' "$cfg," "$rc" "$(echo "$out" | grep -m1 -E 'bit-exact|DIVERGED|mismatch|error')"
  [ $rc = 0 ] || fail=1
done
fi  # the core part, before tensor cores
if [ "$part" != tunings ] && [ "$part" != families ]; then
# Tensor-core numerics (bf16 mma chains on the GPU, the CPU's model of them):
# the same contract. tc_probe first (the model against the instruction on
# 6.3M inner products, the GEMM kernels against the model), then digests on
# both devices and chunkings, and sessions recorded on the GPU under other
# page sizes, budgets and cache settings replayed on the CPU, and the
# committed tensor-core bundles (recorded on a CPU) replayed on the GPU.
# DEVICE_CHECK_PART=tc runs this section alone.
if [ -x "$bin/tc_probe" ]; then
  out=$("$bin/tc_probe" 2>&1); rc=$?
  printf 'tc_probe: exit %s  %s\n' "$rc" "$(echo "$out" | grep -m1 '^result')"
  [ $rc = 0 ] || fail=1
else
  echo "tc_probe: missing from $bin (cargo build --release -p lmrr-kernels --features cuda --example tc_probe)"; fail=1
fi
for model in synthetic:tiny synthetic:small; do
  ref=""
  for run in "cpu 2 -" "cuda 1 -" "cuda 1 7"; do
    set -- $run
    chunk=(); [ "$3" != "-" ] && chunk=(--prefill-chunk "$3")
    out=$("$bin/lmrr" generate --model "$model" --numerics tensor-core-sm90 --prompt "$prompt" --max-tokens 24 --device "$1" --threads "$2" "${chunk[@]}" 2>&1); d=$(echo "$out" | sed -n 's/^digest: //p'); [ -n "$d" ] || echo "$out" | tail -n 2
    [ -z "$ref" ] && ref=$d
    same=$([ -n "$d" ] && [ "$d" = "$ref" ] && echo same || echo DIFFERENT)
    [ "$same" = same ] || fail=1
    printf '%-22s tensor cores, device %-4s chunk %-2s  %s  %s\n' "$model" "$1" "$3" "${d:-<none>}" "$same"
  done
done
for cfg in "" "--page-size 7 --max-batch-tokens 40" "--no-prefix-cache" "--max-batch-tokens 3"; do
  rm -f "$tmp/tc.lmrr"
  "$bin/lmrr" run --script examples/multi-user.toml --numerics tensor-core-sm90 --device cuda $cfg --record "$tmp/tc.lmrr" >/dev/null 2>&1 || fail=1
  out=$("$bin/lmrr" replay "$tmp/tc.lmrr" --device cpu 2>&1); rc=$?
  printf 'multi-user on cuda, tensor cores %-36s replay on cpu: exit %s  %s\n' "$cfg," "$rc" "$(echo "$out" | grep -m1 -E 'bit-exact|DIVERGED|error')"
  [ $rc = 0 ] || fail=1
done
for b in replays/tc-*.lmrr; do
  out=$("$bin/lmrr" replay "$b" --device cuda 2>&1); rc=$?
  printf '%-32s (tensor cores, recorded on a cpu) replay on cuda: exit %s  %s\n' "$b" "$rc" "$(echo "$out" | grep -m1 -E 'bit-exact|DIVERGED|error')"
  [ $rc = 0 ] || fail=1
done
rm -f "$tmp/tc.lmrr"
"$bin/lmrr" run --script examples/incident.toml --numerics tensor-core-sm90 --device cuda --record "$tmp/tc.lmrr" >/dev/null 2>&1 || fail=1
out=$("$bin/lmrr" replay "$tmp/tc.lmrr" --device cpu 2>&1); rc=$?
printf 'incident on cuda, tensor cores, replay on cpu: exit %s  %s\n' "$rc" "$(echo "$out" | grep -m1 -E 'bit-exact|DIVERGED|error')"
[ $rc = 0 ] || fail=1
fi  # tensor cores
if [ "$part" != tunings ] && [ "$part" != tc ] && [ "$part" != families ]; then
rm -f "$tmp/g1.lmrr" "$tmp/g0.lmrr"
"$bin/lmrr" run --script examples/incident.toml --device cuda --record "$tmp/g1.lmrr" >/dev/null 2>&1 || fail=1
LMRR_CUDA_GRAPHS=0 "$bin/lmrr" run --script examples/incident.toml --device cuda --record "$tmp/g0.lmrr" >/dev/null 2>&1 || fail=1
out=$("$bin/lmrr" replay "$tmp/g1.lmrr" --device cuda 2>&1); rc=$?
printf 'incident on cuda, graphs on, replayed with graphs on: exit %s  %s\n' "$rc" "$(echo "$out" | grep -m1 -E 'bit-exact|DIVERGED|error')"
[ $rc = 0 ] || fail=1
out=$(LMRR_CUDA_GRAPHS=0 "$bin/lmrr" replay "$tmp/g1.lmrr" --device cuda 2>&1); rc=$?
printf 'incident on cuda, graphs on, replayed with graphs off: exit %s  %s\n' "$rc" "$(echo "$out" | grep -m1 -E 'bit-exact|DIVERGED|error')"
[ $rc = 0 ] || fail=1
# mini-v4 (no example session of its own): a long turn that goes sparse, a
# follow-up served from the prefix cache, a sampled request; recorded on the
# GPU, replayed on the CPU.
cat >"$tmp/mini-v4.toml" <<TOML
[defaults]
temperature = 0.0
max_tokens = 40

[[request]]
id = "long"
messages = [{ role = "user", content = "$long $long" }]

[[request]]
id = "follow-up"
after = "long"
messages = [
  { role = "user", content = "$long $long" },
  { role = "assistant", from = "long" },
  { role = "user", content = "Say that again, shorter." },
]

[[request]]
id = "sampled"
seed = 7
temperature = 0.8
top_p = 0.9
prompt = "$long"
TOML
for model in synthetic:mini-v4-tiny synthetic:mini-v4-small; do
  rm -f "$tmp/v4.lmrr"  # a failed recording must not replay the last one
  "$bin/lmrr" run --model "$model" --script "$tmp/mini-v4.toml" --device cuda --record "$tmp/v4.lmrr" >/dev/null 2>&1 || fail=1
  out=$("$bin/lmrr" replay "$tmp/v4.lmrr" --device cpu 2>&1); rc=$?
  printf 'record %s on cuda, replay on cpu: exit %s  %s\n' "$model" "$rc" "$(echo "$out" | grep -m1 -E 'bit-exact|DIVERGED|error')"
  [ $rc = 0 ] || fail=1
done
# The committed mini-v4 sessions, recorded on the GPU, replayed on the CPU.
for s in v4-batch v4-agent v4-long-context; do
  extra=(); [ $s = v4-batch ] && extra=(--max-batch-tokens 64)
  rm -f "$tmp/$s.lmrr"
  "$bin/lmrr" run --model synthetic:mini-v4-tiny --script "examples/$s.toml" "${extra[@]}" --device cuda --record "$tmp/$s.lmrr" >/dev/null 2>&1 || fail=1
  out=$("$bin/lmrr" replay "$tmp/$s.lmrr" --device cpu 2>&1); rc=$?
  printf 'record examples/%s.toml on cuda, replay on cpu: exit %s  %s\n' "$s" "$rc" "$(echo "$out" | grep -m1 -E 'bit-exact|DIVERGED|error')"
  [ $rc = 0 ] || fail=1
done
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
# Negative controls: the patches are still found on the device.
for case in "incident abort-inserts-partial" "v4-batch mhc-bf16" "v4-agent moe-routed-scaling" "v4-long-context indexer-early-exit"; do
  set -- $case
  out=$("$bin/lmrr" replay "replays/$1.lmrr" --device cuda --patches "$2" 2>&1); rc=$?
  printf 'replay %s on cuda under %s: exit %s  %s\n' "$1" "$2" "$rc" "$(echo "$out" | grep -m1 -E 'DIVERGED|bit-exact|error')"
  [ $rc = 1 ] || fail=1
done
fi  # the core part
# Families beyond llama, each as a user runs it: the conformance fixtures
# of gemma3_text (sliding and global layers) and mistral, windows of 16
# positions, so that a window's first key cuts the tiles of 32; deepseek_v3
# (latent attention, group-limited routing); and a llama whose matrices are
# Q4_K and Q6_K blocks (scripts/tiny_kquant_gguf.py, imported keeping the
# blocks). Prompt 206 tokens, 40 more generated. Digests CPU against CUDA
# at several chunkings and thread counts; the multi-user session recorded
# on the GPU under other page sizes, step budgets and with the prefix cache
# off replayed on the CPU (and by the recompute oracle on the GPU);
# recorded on the CPU, replayed on the GPU. DEVICE_CHECK_PART=families runs
# this section alone.
if [ "$part" = all ] || [ "$part" = core ] || [ "$part" = families ]; then
kq="$tmp/llama_q4k_q6k"
python3 scripts/tiny_kquant_gguf.py "$tmp/kq.gguf" && "$bin/lmrr" import-gguf "$tmp/kq.gguf" --out "$kq" >/dev/null || { echo "K-quant model: not built"; fail=1; }
for model in engine/tests/fixtures/conformance/gemma3_text engine/tests/fixtures/conformance/mistral engine/tests/fixtures/conformance/deepseek_v3 "$kq"; do
  fam=$(basename "$model")
  ref=""
  for run in "cpu 1 -" "cpu 2 5" "cuda 1 -" "cuda 1 7" "cuda 2 1"; do
    set -- $run
    chunk=(); [ "$3" != "-" ] && chunk=(--prefill-chunk "$3")
    out=$("$bin/lmrr" generate --model "$model" --prompt "$long" --max-tokens 40 --device "$1" --threads "$2" "${chunk[@]}" 2>&1 | tr -d '\000'); d=$(echo "$out" | sed -n 's/^digest: //p'); [ -n "$d" ] || echo "$out" | tail -n 2
    [ -z "$ref" ] && ref=$d
    same=$([ -n "$d" ] && [ "$d" = "$ref" ] && echo same || echo DIFFERENT)
    [ "$same" = same ] || fail=1
    printf '%-22s device %-4s threads %s chunk %-2s  %s  %s\n' "$fam" "$1" "$2" "$3" "${d:-<none>}" "$same"
  done
  for cfg in "" "--page-size 1" "--page-size 7 --max-batch-tokens 40" "--no-prefix-cache" "--max-batch-tokens 3"; do
    rm -f "$tmp/win.lmrr"
    "$bin/lmrr" run --model "$model" --script examples/multi-user.toml --device cuda $cfg --record "$tmp/win.lmrr" >/dev/null 2>&1 || fail=1
    out=$("$bin/lmrr" replay "$tmp/win.lmrr" --model "$model" --device cpu 2>&1); rc=$?
    printf '%s multi-user on cuda %-36s replay on cpu: exit %s  %s\n' "$fam" "$cfg," "$rc" "$(echo "$out" | grep -m1 -E 'bit-exact|DIVERGED|error')"
    [ $rc = 0 ] || fail=1
    out=$("$bin/lmrr" replay "$tmp/win.lmrr" --model "$model" --device cuda --oracle recompute 2>&1); rc=$?
    printf '%s multi-user on cuda %-36s oracle on cuda: exit %s  %s\n' "$fam" "$cfg," "$rc" "$(echo "$out" | grep -m1 -E 'bit-exact|DIVERGED|mismatch|error')"
    [ $rc = 0 ] || fail=1
  done
  rm -f "$tmp/win.lmrr"
  "$bin/lmrr" run --model "$model" --script examples/multi-user.toml --device cpu --record "$tmp/win.lmrr" >/dev/null 2>&1 || fail=1
  out=$("$bin/lmrr" replay "$tmp/win.lmrr" --model "$model" --device cuda 2>&1); rc=$?
  printf '%s multi-user on cpu, replay on cuda: exit %s  %s\n' "$fam" "$rc" "$(echo "$out" | grep -m1 -E 'bit-exact|DIVERGED|error')"
  [ $rc = 0 ] || fail=1
done
fi  # families
# Every kernel choice left in the table (Tuning in kernels/src/cuda/tuning.rs)
# gives the same bits: sessions recorded on the GPU under each replay
# bit-exactly on the CPU (gemma3_text's too, for its windowed attention),
# and committed bundles replay under each:
# matmul_gemm from 9 tokens (split over chunks where its tiles are few);
# matmul_rows for every step; attention_paged for every step, and
# attention_decode for every step; plain launches instead of programmatic
# dependent launch (the kernels at NVRTC's default architecture, the form a
# pre-Hopper device runs), with matmul_rows and with gemm from 9 tokens;
# each layer's K/V rows copied back on the second stream while later layers
# run, for every step, graphs off; every norm by norm_reg_lf, with and
# without programmatic dependent launch; matmul_rows4 for every matrix of
# 1,000 rows or more (the embedded model's lm head), graphs on and off;
# decode attention split over the KV length for every small decode step,
# graphs on and off, and never (the default splits from 512 positions).
tunings="LMRR_CUDA_GEMM_MIN=9;LMRR_CUDA_GEMM_MIN=1000000"
tunings+=";LMRR_CUDA_ATTN_DECODE_MAX=0;LMRR_CUDA_ATTN_DECODE_MAX=100000"
tunings+=";LMRR_CUDA_PDL=0;LMRR_CUDA_PDL=0 LMRR_CUDA_GEMM_MIN=9"
tunings+=";LMRR_CUDA_KV_OVERLAP_MIN=1 LMRR_CUDA_GRAPHS=0"
tunings+=";LMRR_CUDA_LOADS_FIRST_MIN=1;LMRR_CUDA_LOADS_FIRST_MIN=1 LMRR_CUDA_PDL=0"
tunings+=";LMRR_CUDA_ROWS4_MIN=1000;LMRR_CUDA_ROWS4_MIN=1000 LMRR_CUDA_GRAPHS=0"
tunings+=";LMRR_CUDA_SPLIT_KV_MIN=1;LMRR_CUDA_SPLIT_KV_MIN=1 LMRR_CUDA_GRAPHS=0;LMRR_CUDA_SPLIT_KV_MIN=0"
IFS=';' read -r -a tuning_list <<<"${DEVICE_CHECK_TUNINGS:-$tunings}"
case $part in core|tc|families) tuning_list=() ;; esac
# gpu_check under plain launches: the resident kernels as a pre-Hopper
# device compiles them (the default run above has programmatic dependent
# launch), each against the CPU or its reference.
if [ "$part" != core ] && [ "$part" != tc ] && [ "$part" != families ] && [ "${DEVICE_CHECK_GPU_CHECK:-1}" != 0 ]; then
  out=$(env LMRR_CUDA_PDL=0 GPU_CHECK_CONTROLS=none "$bin/gpu_check" 2>&1); rc=$?
  printf '%-72s gpu_check: exit %s  %s\n' "LMRR_CUDA_PDL=0:" "$rc" "$(echo "$out" | grep -m1 -E 'cases bit-identical|FAIL')"
  [ $rc = 0 ] || fail=1
fi
for tun in "${tuning_list[@]}"; do
  for s in incident multi-user; do
    rm -f "$tmp/tun.lmrr"
    env $tun "$bin/lmrr" run --script "examples/$s.toml" --device cuda --record "$tmp/tun.lmrr" >/dev/null 2>&1 || fail=1
    out=$("$bin/lmrr" replay "$tmp/tun.lmrr" --device cpu 2>&1); rc=$?
    printf '%-72s record examples/%s.toml on cuda, replay on cpu: exit %s  %s\n' "$tun:" "$s" "$rc" "$(echo "$out" | grep -m1 -E 'bit-exact|DIVERGED|error')"
    [ $rc = 0 ] || fail=1
  done
  rm -f "$tmp/tun.lmrr"
  win=engine/tests/fixtures/conformance/gemma3_text
  env $tun "$bin/lmrr" run --model "$win" --script examples/multi-user.toml --device cuda --record "$tmp/tun.lmrr" >/dev/null 2>&1 || fail=1
  out=$("$bin/lmrr" replay "$tmp/tun.lmrr" --model "$win" --device cpu 2>&1); rc=$?
  printf '%-72s record gemma3_text multi-user on cuda, replay on cpu: exit %s  %s\n' "$tun:" "$rc" "$(echo "$out" | grep -m1 -E 'bit-exact|DIVERGED|error')"
  [ $rc = 0 ] || fail=1
  out=$(env $tun "$bin/lmrr" replay replays/long-recall.lmrr --device cuda 2>&1); rc=$?
  printf '%-72s replay replays/long-recall.lmrr on cuda: exit %s  %s\n' "$tun:" "$rc" "$(echo "$out" | grep -m1 -E 'bit-exact|DIVERGED|error')"
  [ $rc = 0 ] || fail=1
done
echo "device check: $([ $fail = 0 ] && echo 'all bit-identical' || echo FAILED)"
exit $fail
