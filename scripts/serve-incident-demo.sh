#!/usr/bin/env bash
# The incident through `lmrr serve` with SmolLM2-135M-Instruct and the
# `openai` client: a harness-style system prompt, a stream cancelled
# mid-generation, the "to a file" follow-up; then the server's bundle replayed
# under each cache patch and the recorded session re-run from its script
# (`lmrr inspect --script`) under each, printing turn 2's answer.
#
#   scripts/serve-incident-demo.sh        (fetches SmolLM2 with get-smollm2.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
export LMRR=${LMRR:-target/release/lmrr}
[ -x "$LMRR" ] || cargo build --release --quiet
dir=$(scripts/get-smollm2.sh)
venv=target/serve-venv
if ! "$venv/bin/python" -c "import openai" 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check openai==3.51.0
fi
"$venv/bin/python" scripts/serve_incident_demo.py "$dir"
