#!/usr/bin/env bash
# Build and run lce's demo (examples/, target lce_demo) in the `release` preset.
# Arguments are passed to the demo. Works from any directory.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

"$root/scripts/install-deps.sh" >&2

cmake --preset release >&2
cmake --build --preset release -j2 --target lce_demo >&2
exec "$root/build/release/examples/lce_demo" "$@"
