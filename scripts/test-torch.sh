#!/usr/bin/env bash
# Build and test lce_torch (integrations/torch): lce as PyTorch custom ops.
#
# Creates or reuses a virtual environment (build/torch-venv; LCE_TORCH_VENV=<dir> to use
# another, e.g. one that already has torch), installs torch==2.13.0 there when it is
# missing (plain `pip install` from PyPI; LCE_TORCH_INDEX_URL=<url> for another index,
# e.g. https://download.pytorch.org/whl/cpu), pytest and ninja, pip-installs the package
# against that torch (--no-build-isolation) and runs its pytest suite.
# Works from any directory; needs python3 with venv and headers, g++, OpenBLAS
# (scripts/install-deps.sh brings the last two).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

torch_version=2.13.0
venv=${LCE_TORCH_VENV:-$root/build/torch-venv}
py=$venv/bin/python

echo "== torch integration (venv $venv) =="
if [ ! -x "$py" ]; then
  if ! python3 -m venv "$venv" 2>/dev/null; then
    # Debian's python3 has no ensurepip without python3-venv.
    if command -v apt-get >/dev/null 2>&1; then
      sudo_cmd=""
      [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
      $sudo_cmd apt-get update -qq
      DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq python3-venv python3-dev >/dev/null
    fi
    rm -rf "$venv"
    python3 -m venv "$venv"
  fi
fi
# Python headers, for the extension module.
inc=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
if [ ! -f "$inc/Python.h" ] && command -v apt-get >/dev/null 2>&1; then
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq python3-dev >/dev/null
fi

pip=("$py" -m pip --disable-pip-version-check --no-input)
have=$("$py" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)
if [ "$have" != "$torch_version" ]; then
  echo "installing torch==$torch_version (have: ${have:-none})"
  index=()
  [ -n "${LCE_TORCH_INDEX_URL:-}" ] && index=(--index-url "$LCE_TORCH_INDEX_URL")
  "${pip[@]}" install -q "${index[@]}" "torch==$torch_version"
fi
"$py" -c 'import pytest, numpy, ninja, setuptools' 2>/dev/null || "${pip[@]}" install -q pytest numpy ninja "setuptools>=64"

# The kernels OpenBLAS would pick itself may be slow on this CPU (see README, "The BLAS").
eval "$("$root/scripts/blas-coretype.sh" --export)"

echo "pip install integrations/torch"
MAX_JOBS=${MAX_JOBS:-2} "${pip[@]}" install -q --no-build-isolation "$root/integrations/torch"

# The tests import the installed package: run from elsewhere than integrations/torch (whose
# source lce_torch/ would shadow it), with its pytest settings.
mkdir -p "$root/build" && cd "$root/build"
"$py" -c 'import lce_torch; print(lce_torch.blas_info()); print("CUDA kernels:", lce_torch.built_with_cuda())'
# LCE_TORCH_TESTS: the test files to run (default: all of them), e.g. test_cuda.py.
tests=()
for t in ${LCE_TORCH_TESTS:-}; do tests+=("$root/integrations/torch/tests/$t"); done
[ ${#tests[@]} -eq 0 ] && tests=("$root/integrations/torch/tests")
# -rs: why each skipped test was skipped (here: the CUDA ones, for want of a device).
"$py" -m pytest -q -rs -p no:cacheprovider -c "$root/integrations/torch/pyproject.toml" \
  --rootdir "$root/integrations/torch" "${tests[@]}"
echo "PASS: lce_torch (PyTorch $("$py" -c 'import torch; print(torch.__version__)'))"
