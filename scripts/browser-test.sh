#!/usr/bin/env bash
# Renders HTML reports of the committed bundles in headless Chromium and checks
# them: the page loads with no console errors and no script error, and the
# timeline, the divergence marker (for a diverging replay), the drift plots
# and the harmed request (a replay whose outputs change) are in the DOM; then
# `lmrr probe`'s heat map on mini-v4 (two panels, the lost needle, links). Screenshots are kept under target/report-pngs/ (CI artifacts).
# Installs Debian's `chromium` when missing. Usage: scripts/browser-test.sh
# [LMRR_BINARY]; LMRR_REPORT_DIR overrides the output folder.
set -euo pipefail
cd "$(dirname "$0")/.."
L=${1:-./target/release/lmrr}
OUT=${LMRR_REPORT_DIR:-target/report-pngs}
mkdir -p "$OUT"
if ! command -v chromium >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null || true
  command -v chromium >/dev/null || { echo "FAIL: no chromium, and installing Debian's failed" >&2; exit 1; }
fi
# Without the background-networking flags Chromium dials out at start, which
# a closed network refuses (and logs as errors).
chrome() {
  local prof
  prof=$(mktemp -d)
  chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
    --disable-background-networking --disable-component-update --disable-sync \
    --user-data-dir="$prof" --enable-logging=stderr --v=0 "$@"
  rm -rf "$prof"
}
fail=0
# A bundle whose writer died: the first two thirds of the incident.
head -c 15600 replays/incident.lmrr >"$OUT/truncated.lmrr"
# name | lmrr arguments | must show a divergence marker
cases=(
  "incident-clean|replay replays/incident.lmrr|no"
  "incident-abort-inserts-partial|replay replays/incident.lmrr --patches abort-inserts-partial|yes"
  "incident-fast-exp|replay replays/incident.lmrr --patches fast-exp|yes"
  "multi-user-abort-inserts-partial|replay replays/multi-user.lmrr --patches abort-inserts-partial|yes"
  "incident-bisect|replay replays/incident.lmrr --bisect|yes"
  "incident-inspect|inspect replays/incident.lmrr|no"
  "truncated|replay $OUT/truncated.lmrr --patches abort-inserts-partial|yes"
)
for c in "${cases[@]}"; do
  IFS='|' read -r name args marker <<<"$c"
  html="$OUT/$name.html"
  # shellcheck disable=SC2086
  "$L" $args --html "$html" >/dev/null 2>&1 || true
  [[ -s "$html" ]] || { echo "FAIL $name: no report written"; fail=1; continue; }
  url="file://$(realpath "$html")"
  dom=$(chrome --dump-dom "$url" 2>"$OUT/$name.log")
  chrome --window-size=1280,1800 --hide-scrollbars --screenshot="$OUT/$name.png" "$url" >/dev/null 2>>"$OUT/$name.log"
  problems=()
  grep -q 'data-lmrr-ready="1"' <<<"$dom" || problems+=("page script did not finish")
  grep -q 'data-lmrr-error' <<<"$dom" && problems+=("script error: $(grep -o 'data-lmrr-error="[^"]*"' <<<"$dom")")
  grep -qi 'CONSOLE.*error\|Uncaught' "$OUT/$name.log" && problems+=("console error: $(grep -i 'CONSOLE.*error\|Uncaught' "$OUT/$name.log" | head -1)")
  grep -q 'id="timeline"' <<<"$dom" || problems+=("no timeline")
  grep -q 'class="lane' <<<"$dom" || problems+=("no timeline lanes")
  if [[ $marker == yes ]]; then
    grep -q 'id="divergence-marker"' <<<"$dom" || problems+=("no divergence marker")
    grep -q 'id="drift-plots"' <<<"$dom" || problems+=("no drift plots")
  fi
  # A replay under another patch set whose outputs change leads with the
  # harmed request.
  if [[ $name == incident-abort-inserts-partial ]]; then
    grep -q 'id="harm"' <<<"$dom" || problems+=("no harmed-request section")
  fi
  if [[ $name == truncated ]]; then
    grep -q 'id="truncated"' <<<"$dom" || problems+=("no truncation banner")
  fi
  [[ -s "$OUT/$name.png" ]] || problems+=("no screenshot")
  load=$(grep -o 'data-lmrr-load-ms="[0-9]*"' <<<"$dom" | grep -o '[0-9]*' || echo "?")
  if ((${#problems[@]})); then
    echo "FAIL $name: ${problems[*]}"
    fail=1
  else
    echo "ok   $name ($(stat -c %s "$html") bytes, load ${load} ms) -> $OUT/$name.png"
  fi
done
# `lmrr probe`'s heat map (a page with no script): a panel per patch set, the
# needle the early-exit indexer loses marked, every cell a link.
probe_dir=$(mktemp -d)
html="$OUT/probe-mini-v4.html"
"$L" probe --model synthetic:mini-v4-tiny --patches none,indexer-early-exit --lengths 512 \
  --depths 0,100 --cuts 8 --record-dir "$probe_dir" --html "$html" >/dev/null 2>&1 || true
if [[ -s "$html" ]]; then
  url="file://$(realpath "$html")"
  dom=$(chrome --dump-dom "$url" 2>"$OUT/probe-mini-v4.log")
  chrome --window-size=1280,900 --hide-scrollbars --screenshot="$OUT/probe-mini-v4.png" "$url" >/dev/null 2>>"$OUT/probe-mini-v4.log"
  problems=()
  grep -qi 'CONSOLE.*error\|Uncaught' "$OUT/probe-mini-v4.log" && problems+=("console error")
  [[ $(grep -o 'class="panel"' <<<"$dom" | wc -l) == 2 ]] || problems+=("not two panels")
  [[ $(grep -o 'data-status="lost"' <<<"$dom" | wc -l) == 1 ]] || problems+=("not one lost needle")
  [[ $(grep -o '<td class="cell[^>]*><a href="[^"]*lmrr"' <<<"$dom" | wc -l) == 4 ]] || problems+=("cells without bundle links")
  grep -q 'id="recall"' <<<"$dom" || problems+=("no recall table")
  [[ -s "$OUT/probe-mini-v4.png" ]] || problems+=("no screenshot")
  if ((${#problems[@]})); then
    echo "FAIL probe-mini-v4: ${problems[*]}"
    fail=1
  else
    echo "ok   probe-mini-v4 ($(stat -c %s "$html") bytes) -> $OUT/probe-mini-v4.png"
  fi
else
  echo "FAIL probe-mini-v4: no heat map written"
  fail=1
fi
rm -rf "$probe_dir"
exit $fail
