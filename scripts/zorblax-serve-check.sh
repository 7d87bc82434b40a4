#!/usr/bin/env bash
# The incident's scenario through `lmrr serve` on a real model, as an HTTP
# client sends it (scripts/zorblax_serve.py): the reference server recalls
# the facts, a server under `abort-frees-shared` forgets them, `replay
# --bisect` of the reference server's bundle names the patch, and `lmrr
# audit` of the patched server's proxied traffic flags the recall turn while
# passing the reference server's.
#
#   scripts/zorblax-serve-check.sh MODEL_DIR   (e.g. $(scripts/get-model.sh qwen2.5-coder-1.5b))
#
# LMRR=path/to/lmrr (default target/release/lmrr). Python 3 stdlib only.
set -uo pipefail
model=${1:?usage: scripts/zorblax-serve-check.sh MODEL_DIR}
export LMRR=${LMRR:-target/release/lmrr}
exec python3 "$(dirname "$0")/zorblax_serve.py" "$model"
