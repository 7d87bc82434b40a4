#!/usr/bin/env bash
# The per-row work of a wide step: 64 users sampled at once (temperature
# 0.8, top-p 0.9), so that every step samples, digests and hashes 64 rows of
# 49,152 logits, on the `small` preset cut to one layer so that the forward
# pass does not hide that work. Times `lmrr run` of the same session with
# each binary given (3 rounds, alternating) and checks that every binary
# gives the same session digest.
#
#   scripts/rows-bench.sh [LMRR ...]     # default: target/release/lmrr
set -euo pipefail
bins=("$@")
[ ${#bins[@]} -gt 0 ] || bins=(target/release/lmrr)
tmp=$(mktemp -d)
"${bins[0]}" gen-model --preset small --dtype f32 --out "$tmp/small1" >/dev/null
python3 - "$tmp" <<'PY'
import json, sys
d = sys.argv[1]
c = json.load(open(f"{d}/small1/config.json"))
c["num_hidden_layers"] = 1
json.dump(c, open(f"{d}/small1/config.json", "w"))
lines = ["[defaults]", "max_tokens = 24", "temperature = 0.8", "top_p = 0.9", ""]
for i in range(64):
    lines += ["[[request]]", f'id = "u{i}"', f"seed = {i}",
              f'prompt = "user {i} asks about request {i * 7} and its latency"', ""]
open(f"{d}/crowd.toml", "w").write("\n".join(lines))
PY
declare -A digest
for round in 1 2 3; do
  for b in "${bins[@]}"; do
    t0=$(date +%s%N)
    out=$("$b" run --model "$tmp/small1" --script "$tmp/crowd.toml" --max-batch-tokens 2048 2>&1)
    t1=$(date +%s%N)
    d=$(echo "$out" | sed -n 's/^digest: //p' | tail -n 1)
    printf '%-40s round %s: %6d ms  session digest %s\n' "$b" "$round" "$(( (t1 - t0) / 1000000 ))" "${d:0:16}"
    digest[$b]=$d
  done
done
first=${digest[${bins[0]}]}
for b in "${bins[@]}"; do
  [ "${digest[$b]}" = "$first" ] || { echo "DIFFERENT session digests"; exit 1; }
done
echo "same session digest from every binary"
