#!/usr/bin/env bash
# Real clients against `lmrr serve` on loopback (run by .ci/run): the `openai`
# Python package (streaming, non-streaming, a cancellation mid-stream followed
# by a "to a file" turn), curl, and a bounded load test (32 concurrent
# streaming clients, random arrivals and disconnects, at most 2 minutes), each
# checked against the bundle the server recorded (scripts/serve_clients.py).
#
#   scripts/serve-test.sh [clients|load|bench]...   default: clients load
#                                             (bench: docs/PERFORMANCE.md's figures)
#   LMRR=path/to/lmrr                         default: target/release/lmrr
#
# The client runs in a virtual environment under target/ with a pinned
# `openai`, so nothing is installed into the system's Python.
set -euo pipefail
cd "$(dirname "$0")/.."
export LMRR=${LMRR:-target/release/lmrr}
[ -x "$LMRR" ] || cargo build --release --quiet
venv=target/serve-venv
py="$venv/bin/python"
if ! "$py" -c "import openai" 2>/dev/null; then
  if python3 -m venv "$venv" 2>/dev/null; then
    "$py" -m pip install --quiet --disable-pip-version-check openai==3.51.0
  else
    # No venv module (Debian without python3-venv): install into a private
    # directory under target/ and put it on the path instead.
    lib=target/serve-pylib
    python3 -m pip install --quiet --disable-pip-version-check --target "$lib" openai==3.51.0
    export PYTHONPATH="$PWD/$lib${PYTHONPATH:+:$PYTHONPATH}"
    py=python3
  fi
fi
tests=("$@")
[ ${#tests[@]} -gt 0 ] || tests=(clients load)
for t in "${tests[@]}"; do
  timeout 600 "$py" scripts/serve_clients.py "$t"
done
