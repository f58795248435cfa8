#!/usr/bin/env bash
# Install the Debian packages lce's build, tests, examples and benchmarks need.
# Idempotent: does nothing (not even apt-get update) when all are present.
set -euo pipefail

# libdnnl-dev: oneDNN, for bfloat16 GEMMs on the CPU's bf16 instructions (LCE_BF16_GEMM=auto|onednn).
# ocl-icd-opencl-dev: dnnl-config.cmake finds OpenCL; only a Recommends of libdnnl-dev, which
# --no-install-recommends leaves out, so a bare machine failed to configure without it.
packages=(cmake g++ make pkg-config libopenblas-dev doctest-dev libopenmpi-dev openmpi-bin libeigen3-dev libdnnl-dev ocl-icd-opencl-dev)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg -s "$p" 2>/dev/null | grep -q '^Status: install ok installed'; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all packages present (${packages[*]})"
  exit 0
fi

sudo=()
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then
    sudo=(sudo)
  else
    echo "install-deps: missing ${missing[*]}, not root and no sudo; install them and rerun" >&2
    exit 1
  fi
fi

echo "install-deps: installing ${missing[*]}"
"${sudo[@]}" apt-get update
"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
  apt-get install -y --no-install-recommends "${missing[@]}"
