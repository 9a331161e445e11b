#!/usr/bin/env bash
# Rebuild the bundled profiles of real machines from the captures in tests/fixtures/.
# tests/test_bundled_captures.py checks that the bundled files equal a fresh build.
set -euo pipefail
cd "$(dirname "$0")/.."
for dir in tests/fixtures/*/; do
  name=$(basename "$dir")
  moment profile --from "$dir" --name "$name" --out "topology_profiles/$name.yaml"
done
