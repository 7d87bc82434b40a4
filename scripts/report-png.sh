#!/usr/bin/env bash
# Regenerates docs/report-incident.png, the picture in the README: the
# incident's HTML report under abort-inserts-partial, screenshotted by headless
# Chromium (installed by scripts/browser-test.sh when missing).
set -euo pipefail
cd "$(dirname "$0")/.."
L=${1:-./target/release/lmrr}
tmp=$(mktemp -d)
"$L" replay replays/incident.lmrr --patches abort-inserts-partial --html "$tmp/incident.html" >/dev/null 2>&1 || true
chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
  --disable-background-networking --disable-component-update --disable-sync \
  --user-data-dir="$tmp/profile" --window-size=1200,1250 --hide-scrollbars \
  --screenshot="$PWD/docs/report-incident.png" "file://$tmp/incident.html" 2>/dev/null
rm -rf "$tmp"
echo "docs/report-incident.png"
