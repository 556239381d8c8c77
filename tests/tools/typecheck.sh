#!/usr/bin/env bash
# mypy cannot follow setuptools' package-dir mapping (ridethrough.collector lives in collector/),
# so build a tree of symlinks shaped like the installed package and check that.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
tree="$root/.typecheck"
rm -rf "$tree" && mkdir -p "$tree/ridethrough"
for f in "$root"/ridethrough/*; do ln -s "$f" "$tree/ridethrough/"; done
for d in collector exporters detectors actuators dashboards lab; do ln -s "$root/$d" "$tree/ridethrough/$d"; done
cd "$tree"
exec "$root/.venv/bin/mypy" --config-file "$root/pyproject.toml" -p ridethrough
