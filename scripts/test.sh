#!/usr/bin/env bash
# Build and test lce: the `release` preset (all tests, incl. consumer/packaging
# tests), then `debug-sanitize` (ASan+UBSan; consumer tests skipped).
# Works from any directory; rerunning reuses the build folders.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

"$root/scripts/install-deps.sh"

# OpenBLAS 0.3.21 runs SSE3 kernels on CPU models it does not know: test with the
# kernels this CPU allows (the ones users get from lce's programs and README advice).
eval "$("$root/scripts/blas-coretype.sh" --export)"
echo "OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-unset, the kernels OpenBLAS picks itself are right here}"

# OpenMPI refuses to run as root without these (CI containers run as root).
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

echo "== release =="
cmake --preset release
cmake --build --preset release -j2
ctest --preset release --output-on-failure -j2

echo "== debug-sanitize =="
cmake --preset debug-sanitize
cmake --build --preset debug-sanitize -j2
ctest --preset debug-sanitize --output-on-failure -j2 -LE consumer

"$root/scripts/test-torch.sh"   # lce_torch: PyTorch custom ops (installs torch==2.13.0 into build/torch-venv)
echo "PASS: lce release + debug-sanitize builds and tests"
