#!/usr/bin/env bash
# Refresh the dashboard's vendored charting library (uPlot, MIT) from the npm registry.
# The service runs on machines without internet, so the files are committed, not fetched.
set -euo pipefail
VERSION="${1:-1.6.32}"
DEST="$(dirname "$0")/../service/dashboard/vendor/uplot"
TMP="$(mktemp -d)"; trap 'rm -rf "$TMP"' EXIT
(cd "$TMP" && npm pack --silent "uplot@$VERSION" >/dev/null && tar xzf uplot-*.tgz)
cp "$TMP/package/dist/uPlot.esm.js" "$TMP/package/dist/uPlot.min.css" "$TMP/package/LICENSE" "$DEST/"
echo "$VERSION" > "$DEST/VERSION"
echo "uPlot $VERSION -> $DEST"
