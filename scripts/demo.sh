#!/usr/bin/env bash
# Build and run lce's demo (examples/, target lce_demo) in the `release` preset.
# Arguments are passed to the demo. Works from any directory.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

"$root/scripts/install-deps.sh" >&2

# The OpenBLAS kernels this CPU allows (OpenBLAS 0.3.21 falls back to SSE3 on CPU
# models it does not know); the demo would otherwise restart itself to set this.
eval "$("$root/scripts/blas-coretype.sh" --export)"

cmake --preset release >&2
cmake --build --preset release -j2 --target lce_demo >&2
exec "$root/build/release/examples/lce_demo" "$@"
