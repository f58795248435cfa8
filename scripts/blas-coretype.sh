#!/usr/bin/env bash
# Prints the OPENBLAS_CORETYPE this machine's OpenBLAS should run with, or nothing
# when its own choice is right (or it is not OpenBLAS, or nothing can be told).
#
#   export OPENBLAS_CORETYPE=$(scripts/blas-coretype.sh)   # then unset it if empty
#   eval "$(scripts/blas-coretype.sh --export)"             # the same, in one line
#
# OpenBLAS 0.3.21 (Debian 12) does not know every CPU model: on one it does not
# know (Emerald Rapids, say) it runs SSE3 "Prescott" kernels, 4-5x slower than
# OPENBLAS_CORETYPE=SkylakeX. It reads the variable only when it is loaded, so it
# must be in the environment before a program starts. The answer comes from
# lce::blas_info() (include/lce/host/blas_info.hpp), compiled once against the
# OpenBLAS pkg-config finds and cached under $XDG_CACHE_HOME/lce (or build/).
# An OPENBLAS_CORETYPE already set is printed back unchanged.
set -euo pipefail

export_form=false
[ "${1:-}" = "--export" ] && export_form=true

emit() {
  if $export_form; then
    [ -n "$1" ] && echo "export OPENBLAS_CORETYPE=$1"
  else
    [ -n "$1" ] && echo "$1"
  fi
  exit 0
}

[ -n "${OPENBLAS_CORETYPE:-}" ] && emit "$OPENBLAS_CORETYPE"

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
command -v pkg-config >/dev/null 2>&1 && pkg-config --exists openblas 2>/dev/null || emit ""
cxx=${CXX:-c++}
command -v "$cxx" >/dev/null 2>&1 || emit ""

cache=${XDG_CACHE_HOME:-$root/build}/lce
mkdir -p "$cache" 2>/dev/null || cache=$(mktemp -d)
header="$root/include/lce/host/blas_info.hpp"
# One probe per header version, compiler and OpenBLAS.
key=$( (cat "$header"; "$cxx" --version 2>/dev/null; pkg-config --modversion --cflags --libs openblas) | cksum | cut -d' ' -f1)
probe="$cache/blas-coretype-$key"
if [ ! -x "$probe" ]; then
  src="$cache/blas-coretype-$key.cpp"
  cat >"$src" <<'EOF'
#include <lce/host/blas_info.hpp>
#include <cblas.h>
#include <cstdio>
int main() {
  float a = 1, c = 0;  // one call: the library is loaded and used
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, 1, 1, 1, 1.0f, &a, 1, &a, 1, 0.0f, &c, 1);
  const lce::blas_report r = lce::blas_info();
  if (r.slow && r.coretype_settable) std::puts(r.recommended_coretype.c_str());
  return 0;
}
EOF
  # shellcheck disable=SC2046
  "$cxx" -std=c++20 -O1 -I"$root/include" "$src" -o "$probe.tmp.$$" $(pkg-config --cflags --libs openblas) -ldl \
    2>/dev/null || { rm -f "$probe.tmp.$$"; emit ""; }
  mv -f "$probe.tmp.$$" "$probe"
fi
emit "$(env -u OPENBLAS_CORETYPE "$probe" 2>/dev/null || true)"
