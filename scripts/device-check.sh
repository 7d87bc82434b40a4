#!/usr/bin/env bash
# Contract invariant I6 on a CUDA machine: the kernels' device mirror against
# the CPU fast path bit for bit (gpu_check), then whole generations whose
# digests must not depend on the device, the chunking or the thread count.
#
#   cargo build --release --features cuda
#   cargo build --release -p lmrr-kernels --features cuda --example gpu_check
#   mkdir -p .gpu && cp target/release/lmrr target/release/examples/gpu_check .gpu/ && strip .gpu/*
#   scripts/device-check.sh .gpu          # on the GPU machine; exit 0 = all identical
#
# DEVICE_CHECK_GPU_CHECK=0 skips gpu_check (for a run whose kernels.cu
# compiles to the PTX an earlier gpu_check passed: say so where it is
# quoted); DEVICE_CHECK_TUNINGS="A=1 B=2;C=3" replaces the list of kernel
# choices the sessions are recorded under (';' between choices).
# DEVICE_CHECK_PART=core runs everything but those recordings, =tunings only
# them: on a machine lent 10 minutes a command the whole check (about 11
# minutes on an H100) takes two calls, one of each.
set -uo pipefail
bin=${1:-.gpu}
part=${DEVICE_CHECK_PART:-all}
case $part in all|core|tunings) ;; *) echo "DEVICE_CHECK_PART must be all, core or tunings, not '$part'"; exit 2 ;; esac
fail=0
tmp=$(mktemp -d)
if [ "$part" != tunings ]; then
if [ "${DEVICE_CHECK_GPU_CHECK:-1}" = 0 ]; then
  echo "gpu_check: skipped (DEVICE_CHECK_GPU_CHECK=0)"
else
  "$bin/gpu_check" || fail=1
fi
prompt="The quick brown fox jumps over the lazy dog, and then"
# mini-v4's indexer reads every position while the context has no more than
# index_topk blocks (tiny: 4 blocks of 16 = 64 positions): its prompt and
# generation run well past that, so the sparse path (indexer scores, top-k
# blocks, gathered K/V) is on the device too.
long="Inference engines keep a cache of keys and values so that each new token attends to every earlier one without recomputing it; a radix tree lets later requests reuse a shared prefix, and a scheduler batches the decode steps of many users with chunked prefill."
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
# Every kernel choice (Tuning in kernels/src/cuda/resident.rs) gives the
# same bits: sessions recorded on the GPU under each replay bit-exactly on
# the CPU, and committed bundles replay under each: fused steps
# (matmul_fused) up to 8 tokens; SwiGLU in gate/up's epilogue up to 8
# tokens; matmul_gemm from 9 tokens, unsplit;
# matmul_gemm_wide from 9 tokens, always split over chunks;
# matmul_gemm_wide unpipelined from 9 tokens; matmul_rows for every step;
# SwiGLU in down's input loads with attention_paged for every step (the
# defaults keep the swiglu kernel and take attention_decode for small
# steps); attention_decode for every step; plain launches instead of
# programmatic dependent launch (the kernels at NVRTC's default
# architecture, not sm_90), with matmul_rows and with gemm from 9 tokens;
# every kernel waiting before its weight loads (LMRR_CUDA_PDL_PREFETCH=0,
# the default loads them first); fused steps with graphs off;
# attention_decode loading earlier steps' K/V rows before its wait
# (LMRR_CUDA_ATTN_PREFETCH=1), also for every attention step (prefill
# chunks: rows of the step's own span must wait) with graphs off; each
# layer's K/V rows copied back on the second stream while later layers run
# (LMRR_CUDA_KV_OVERLAP_MIN), for every step with graphs off; all of them
# copied back after the step (LMRR_CUDA_KV_EARLY_MIN=0; the default copies
# them after the last layer while the head runs, decode graphs captured as
# layers and head apart); decode matmuls by
# matmul_chunk (a thread per row and chunk), alone and in fused steps
# (norms, residual adds and SwiGLU inside it), graphs on and off; decode
# attention by attention_decode_hd64 (fused with RoPE, and alone); gate and
# up row by row in one block with SwiGLU in its epilogue (gate_up_swiglu),
# graphs on and off; the head's add and norm as add_rows, gather_rows and
# norm_reg (LMRR_CUDA_HEAD_DIRECT=0; the default is one norm_reg launch) with
# SwiGLU four elements a thread; those four elements with gate_up_swiglu and
# the one-launch head, graphs off;
# every norm by norm_reg_lf (the residual row loaded before its stores;
# by default only norms of 128 rows or more), with and without programmatic
# dependent launch; matmul_rows4 (four rows a block) for every matrix
# that takes matmul_rows in every step, and for the lm head alone (the
# embedded model's 1,024 rows) with graphs off (by default only heads of
# 32,768 rows or more in steps of 8 tokens or more); decode attention with
# q reloaded from global memory (LMRR_CUDA_ROPE_QS=0; the default hands the
# rotated q head over in shared memory), graphs on and off; q/k/v and
# gate/up four rows a block (LMRR_CUDA_MULTI4), alone and with every
# matmul_rows matrix by matmul_rows4 with graphs off; the kernels
# compiled with launch bounds (LMRR_CUDA_LB_*: fewer registers, more blocks
# an SM) with q/k/v and gate/up four rows a block; decode attention's step
# inputs loaded after the PDL wait (LMRR_CUDA_ATTN_EARLY=0; the default
# loads them before it), graphs on and off; a prefill's attention groups
# in span order (LMRR_CUDA_PF_LONGEST_FIRST=0; the default lists them
# longest first); o and down with the add and norm after them in one
# launch (LMRR_CUDA_ROWS_NORM_MAX, matmul_rows_norm), graphs on and off.
tunings="LMRR_CUDA_FUSED_MAX=8;LMRR_CUDA_SWIGLU_MAX=8;LMRR_CUDA_GEMM_MIN=9 LMRR_CUDA_SPLIT_BLOCKS=0"
tunings+=";LMRR_CUDA_GEMM_MIN=9 LMRR_CUDA_GEMM_WIDE_MIN=9 LMRR_CUDA_SPLIT_BLOCKS=1000000"
tunings+=";LMRR_CUDA_GEMM_MIN=9 LMRR_CUDA_GEMM_PIPELINED=0;LMRR_CUDA_GEMM_MIN=1000000"
tunings+=";LMRR_CUDA_DOWN_SWIGLU=1 LMRR_CUDA_ATTN_DECODE_MAX=0;LMRR_CUDA_ATTN_DECODE_MAX=100000"
tunings+=";LMRR_CUDA_PDL=0;LMRR_CUDA_PDL=0 LMRR_CUDA_GEMM_MIN=9"
tunings+=";LMRR_CUDA_PDL_PREFETCH=0;LMRR_CUDA_FUSED_MAX=8 LMRR_CUDA_GRAPHS=0"
tunings+=";LMRR_CUDA_ATTN_PREFETCH=1;LMRR_CUDA_ATTN_PREFETCH=1 LMRR_CUDA_GRAPHS=0 LMRR_CUDA_ATTN_DECODE_MAX=100000"
tunings+=";LMRR_CUDA_GEMM_MULTI=1 LMRR_CUDA_FOLD_SUMS=1;LMRR_CUDA_GEMM_MIN=9 LMRR_CUDA_GEMM_WIDE_MIN=9 LMRR_CUDA_GEMM_MULTI=1 LMRR_CUDA_FOLD_SUMS=1"
tunings+=";LMRR_CUDA_ATTN_PREFILL_HD64=1;LMRR_CUDA_ATTN_PREFILL_HD64=1 LMRR_CUDA_ATTN_PREFILL_GROUP=5"
tunings+=";LMRR_CUDA_ROPE_ATTN=1;LMRR_CUDA_ROPE_ATTN=1 LMRR_CUDA_GRAPHS=0 LMRR_CUDA_ATTN_DECODE_MAX=100000"
tunings+=";LMRR_CUDA_KV_OVERLAP_MIN=1 LMRR_CUDA_GRAPHS=0;LMRR_CUDA_KV_EARLY_MIN=0"
tunings+=";LMRR_CUDA_ATTN_DECODE_HD64=1;LMRR_CUDA_ATTN_DECODE_HD64=1 LMRR_CUDA_GRAPHS=0 LMRR_CUDA_ROPE_ATTN=0"
tunings+=";LMRR_CUDA_CHUNK_MAX=8;LMRR_CUDA_CHUNK_MAX=8 LMRR_CUDA_FUSED_MAX=8;LMRR_CUDA_CHUNK_MAX=8 LMRR_CUDA_FUSED_MAX=8 LMRR_CUDA_GRAPHS=0"
tunings+=";LMRR_CUDA_GATE_UP_SWIGLU=1;LMRR_CUDA_GATE_UP_SWIGLU=1 LMRR_CUDA_GRAPHS=0"
tunings+=";LMRR_CUDA_HEAD_DIRECT=0 LMRR_CUDA_SWIGLU4=1;LMRR_CUDA_GATE_UP_SWIGLU=1 LMRR_CUDA_HEAD_DIRECT=1 LMRR_CUDA_SWIGLU4=1 LMRR_CUDA_GRAPHS=0"
tunings+=";LMRR_CUDA_LOADS_FIRST_MIN=1;LMRR_CUDA_LOADS_FIRST_MIN=1 LMRR_CUDA_PDL=0"
tunings+=";LMRR_CUDA_ROWS4_MIN=1 LMRR_CUDA_ROWS4_TOKENS=1;LMRR_CUDA_ROWS4_MIN=1000 LMRR_CUDA_ROWS4_TOKENS=1 LMRR_CUDA_GRAPHS=0"
tunings+=";LMRR_CUDA_ROPE_QS=0;LMRR_CUDA_ROPE_QS=0 LMRR_CUDA_GRAPHS=0"
tunings+=";LMRR_CUDA_MULTI4=1;LMRR_CUDA_MULTI4=1 LMRR_CUDA_ROWS4_MIN=1 LMRR_CUDA_ROWS4_TOKENS=1 LMRR_CUDA_GRAPHS=0"
tunings+=";LMRR_CUDA_LB_ATTN_DECODE=4 LMRR_CUDA_LB_ATTN_PREFILL=4 LMRR_CUDA_LB_ROWS4=8 LMRR_CUDA_LB_MULTI=16 LMRR_CUDA_MULTI4=1"
tunings+=";LMRR_CUDA_ATTN_EARLY=0;LMRR_CUDA_ATTN_EARLY=0 LMRR_CUDA_GRAPHS=0;LMRR_CUDA_PF_LONGEST_FIRST=0"
tunings+=";LMRR_CUDA_ROWS_NORM_MAX=8;LMRR_CUDA_ROWS_NORM_MAX=8 LMRR_CUDA_GRAPHS=0"
tunings+=";LMRR_CUDA_GEMM_MIN=9 LMRR_CUDA_FOLD_SUMS=1;LMRR_CUDA_GEMM_MIN=9 LMRR_CUDA_GEMM_WIDE_MIN=9 LMRR_CUDA_GEMM_MULTI=1 LMRR_CUDA_SPLIT_BLOCKS=1000000"
IFS=';' read -r -a tuning_list <<<"${DEVICE_CHECK_TUNINGS:-$tunings}"
[ "$part" = core ] && tuning_list=()
# The resident module as compiled under other defines, each kernel against
# the CPU or its reference as gpu_check checks the defaults: with launch
# bounds, and with decode attention's inputs read after the wait (the form
# before the default; these change the module, not the negative controls'
# sources, which ran above).
if [ "$part" != core ] && [ "${DEVICE_CHECK_GPU_CHECK:-1}" != 0 ]; then
  for defs in "LMRR_CUDA_LB_ATTN_DECODE=4 LMRR_CUDA_LB_ATTN_PREFILL=4 LMRR_CUDA_LB_ROWS4=8 LMRR_CUDA_LB_MULTI=16" \
    "LMRR_CUDA_ATTN_EARLY=0"; do
    out=$(env $defs GPU_CHECK_CONTROLS=none "$bin/gpu_check" 2>&1); rc=$?
    printf '%-72s gpu_check: exit %s  %s\n' "$defs:" "$rc" "$(echo "$out" | grep -m1 -E 'cases bit-identical|FAIL')"
    [ $rc = 0 ] || fail=1
  done
fi
for tun in "${tuning_list[@]}"; do
  for s in incident multi-user; do
    rm -f "$tmp/tun.lmrr"
    env $tun "$bin/lmrr" run --script "examples/$s.toml" --device cuda --record "$tmp/tun.lmrr" >/dev/null 2>&1 || fail=1
    out=$("$bin/lmrr" replay "$tmp/tun.lmrr" --device cpu 2>&1); rc=$?
    printf '%-72s record examples/%s.toml on cuda, replay on cpu: exit %s  %s\n' "$tun:" "$s" "$rc" "$(echo "$out" | grep -m1 -E 'bit-exact|DIVERGED|error')"
    [ $rc = 0 ] || fail=1
  done
  out=$(env $tun "$bin/lmrr" replay replays/long-recall.lmrr --device cuda 2>&1); rc=$?
  printf '%-72s replay replays/long-recall.lmrr on cuda: exit %s  %s\n' "$tun:" "$rc" "$(echo "$out" | grep -m1 -E 'bit-exact|DIVERGED|error')"
  [ $rc = 0 ] || fail=1
done
echo "device check: $([ $fail = 0 ] && echo 'all bit-identical' || echo FAILED)"
exit $fail
