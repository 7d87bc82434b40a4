#!/usr/bin/env bash
# The incident through `lmrr serve --disaggregate` with SmolLM2-135M-Instruct:
# turn 1 abandoned while its K/V is on the link between the prefill and the
# decode engine, turn 2 "to a file" right after; a correct deployment, then
# one under pd-abort-reuses-pages (scripts/serve_pd_incident.py says more).
#
#   scripts/serve-pd-incident.sh        (fetches SmolLM2 with get-smollm2.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
export LMRR=${LMRR:-target/release/lmrr}
[ -x "$LMRR" ] || cargo build --release --quiet
dir=$(scripts/get-smollm2.sh)
python3 scripts/serve_pd_incident.py "$dir"
