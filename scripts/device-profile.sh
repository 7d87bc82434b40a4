#!/usr/bin/env bash
# Where a step's device time goes, kernel by kernel: Nsight Compute's
# duration of every kernel of one batch-1 decode step, one batch-64 decode
# step and one 512-token prefill of the `small` preset (graphs off, so each
# kernel is its own launch; steps are told apart by their `embed_rows`), summed
# per kernel name, against the step's wall time in `lmrr bench`. The sum is
# the kernels' own time; the wall time minus it is launch gaps and host work.
#
#   scripts/device-profile.sh .gpu      # on the GPU machine
set -uo pipefail
bin=${1:-.gpu}
tmp=$(mktemp -d)
"$bin/lmrr" gen-model --preset small --dtype f32 --out "$tmp/small" >/dev/null || exit 1
ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
[ -n "$ncu" ] || { echo "## ncu: not on this machine"; exit 0; }
# DEVICE_PROFILE_SHAPES="1 64;1 512" picks the shapes ("batch prompt", ';' between).
IFS=';' read -r -a shapes <<<"${DEVICE_PROFILE_SHAPES:-1 64;64 64;1 512}"
for shape in "${shapes[@]}"; do
  set -- $shape
  echo "## batch $1, prompt $2: the last step's kernels (decode when the prompt is 64, the prefill itself when 512)"
  LMRR_CUDA_GRAPHS=0 "$ncu" --cache-control none --clock-control none --metrics gpu__time_duration.sum --csv --page raw \
    "$bin/lmrr" bench --device cuda --model "$tmp/small" --speed-only --batches "$1" \
    --prompt-len "$2" --decode-steps 1 --repeats 1 --bandwidth-mib 16 >"$tmp/k.csv" 2>"$tmp/k.err"
  python3 - "$tmp/k.csv" "$2" <<'PY'
import csv, sys, collections
# ncu's CSV follows the program's own output: start at its header row.
rows = list(csv.reader(open(sys.argv[1])))
hi = next((i for i, r in enumerate(rows) if "Kernel Name" in r and "gpu__time_duration.sum" in r), None)
if hi is None:
    print(open(sys.argv[1]).read()[-1500:]); sys.exit()
rows = [r for r in rows[hi:] if len(r) == len(rows[hi])]
h = rows[0]
ki, ti = h.index("Kernel Name"), h.index("gpu__time_duration.sum")
unit = rows[1][ti]
ks = [(r[ki], float(r[ti].replace(",", ""))) for r in rows[2:]]
steps, cur = [], None
for name, t in ks:
    if name.startswith("embed_rows"):
        cur = []; steps.append(cur)
    if cur is not None:
        cur.append((name, t))
want = steps[-1] if sys.argv[2] != "512" else steps[0]
scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}.get(unit, float("nan"))
tot = collections.OrderedDict()
for name, t in want:
    n = name.split("(")[0]
    c, s = tot.get(n, (0, 0.0)); tot[n] = (c + 1, s + t * scale)
all_us = sum(s for _, s in tot.values())
print(f"{len(steps)} steps seen; this one: {len(want)} kernels, {all_us:.1f} us of kernel time")
for n, (c, s) in sorted(tot.items(), key=lambda kv: -kv[1][1]):
    print(f"  {n:<26} x{c:<4} {s:9.1f} us  {s / c:7.2f} us each  {100 * s / all_us:5.1f}%")
PY
  tail -n 3 "$tmp/k.err" | grep -v '^==PROF' || true
done
