#!/usr/bin/env bash
# Bare sgemm GFLOP/s of every CBLAS found on this machine, side by side, at lce's
# three GEMM layouts (bench/blas_compare.cpp): OpenBLAS with its own kernel choice and
# with OPENBLAS_CORETYPE forced, Debian's BLIS (pthread and OpenMP builds), MKL from a
# Python environment (pip install mkl), and PyTorch's torch.mm when torch imports.
#
#   bench/blas_compare.sh [BLAS_COMPARE_BINARY] [-- extra lce_blas_compare flags]
#
# Environment: PYTHON (default python3) whose environment holds MKL's wheel and torch
# (or MKL_PYTHON and TORCH_PYTHON, one for each); BLAS_COMPARE_ROUNDS
# (default 1): run the whole table this many times, keep each number's best (the cores
# may be shared); BLAS_COMPARE_ONLY: an extended regex, only the rows whose label
# matches (e.g. 'SkylakeX|MKL'). Rows whose library is absent are skipped.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bin=${1:-$root/build/release/bench/lce_blas_compare}
shift $(( $# > 0 ? 1 : 0 ))
[ "${1:-}" = "--" ] && shift
extra=("$@")
python=${PYTHON:-python3}
mkl_python=${MKL_PYTHON:-$python}
torch_python=${TORCH_PYTHON:-$python}
rounds=${BLAS_COMPARE_ROUNDS:-1}
only=${BLAS_COMPARE_ONLY:-.}
lib=/usr/lib/$(gcc -dumpmachine 2>/dev/null || echo x86_64-linux-gnu)

rows=()  # "label|env|library"
openblas=$(ls "$lib"/openblas-pthread/libopenblas.so.0 "$lib"/libopenblas.so.0 2>/dev/null | head -1 || true)
if [ -n "$openblas" ]; then
  rows+=("OpenBLAS, own choice||$openblas")
  for core in SkylakeX Cooperlake Haswell; do
    rows+=("OpenBLAS, OPENBLAS_CORETYPE=$core|OPENBLAS_CORETYPE=$core|$openblas")
  done
fi
for flavour in pthread openmp; do
  [ -e "$lib/blis-$flavour/libblis.so.4" ] && rows+=("BLIS ($flavour)||$lib/blis-$flavour/libblis.so.4")
done
mkl_dir=$("$mkl_python" - <<'EOF' 2>/dev/null || true
import glob, os, sys
for d in [os.path.join(sys.prefix, "lib")] + sys.path:
    hits = sorted(glob.glob(os.path.join(d, "libmkl_rt.so*")))
    if hits: print(hits[-1]); break
EOF
)
[ -n "$mkl_dir" ] && rows+=("MKL (mkl_rt, pip)|LD_LIBRARY_PATH=$(dirname "$mkl_dir")|$mkl_dir")

declare -A best  # key "label|threads" -> "6 numbers|kernels", each the best of the rounds
keep_best() {  # key "6 numbers" kernels
  local key=$1 kernels=$3 old
  old=${best[$key]:-"0 0 0 0 0 0|"}
  best[$key]="$(awk -v a="$2" -v b="${old%%|*}" 'BEGIN{split(a,x," ");split(b,y," ");
    for (i = 1; i <= 6; ++i) printf "%.1f ", (x[i] + 0 > y[i] + 0 ? x[i] : y[i])}')|$kernels"
}
for ((r = 0; r < rounds; ++r)); do
  for row in "${rows[@]}"; do
    IFS='|' read -r label envs path <<<"$row"
    grep -qE -- "$only" <<<"$label" || continue
    while IFS='|' read -r name kernels threads n1 n2 n3 n4 n5 n6; do
      [ -n "$threads" ] || continue
      keep_best "$label|${threads// /}" "$(echo $n1 $n2 $n3 $n4 $n5 $n6)" "$(echo $kernels)"
    done < <(env $envs "$bin" --lib "$path" "${extra[@]}" 2>/dev/null || true)
  done
  if grep -qE -- "$only" <<<"PyTorch" && "$torch_python" -c "import torch" 2>/dev/null; then
    while IFS='|' read -r name kernels threads n1 n2 n3 n4 n5 n6; do
      [ -n "$threads" ] || continue
      keep_best "PyTorch torch.mm ($(echo $name))|${threads// /}" "$(echo $n1 $n2 $n3 $n4 $n5 $n6)" "$(echo $kernels)"
    done < <("$torch_python" -W ignore "$root/bench/blas_compare_torch.py" 2>/dev/null || true)
  fi
done

echo "sgemm, C = 1024 tokens, H = 1024, V = 32000 (NT: m=C n=V k=H; NN: m=C n=H k=V; TN: m=V n=H k=C);"
echo "GFLOP/s of wall time, and GFLOP per second of process CPU time ('CPU'); each the best of $rounds round(s)"
printf '| %-40s | %-12s | %7s | %6s | %6s | %6s | %6s | %6s | %6s |\n' library kernels threads NT NN TN "CPU NT" "CPU NN" "CPU TN"
printf '|%s|%s|%s|%s|%s|%s|%s|%s|%s|\n' "$(printf -- '-%.0s' {1..42})" "$(printf -- '-%.0s' {1..14})" "--------:" \
  "-------:" "-------:" "-------:" "-------:" "-------:" "-------:"
for key in $(printf '%s\n' "${!best[@]}" | tr ' ' '\a' | sort -t'|' -k1,1 -k2,2n); do
  key=${key//$'\a'/ }
  IFS='|' read -r label threads <<<"$key"
  value=${best[$key]}
  read -r n1 n2 n3 n4 n5 n6 <<<"${value%%|*}"
  printf '| %-40s | %-12s | %7s | %6s | %6s | %6s | %6s | %6s | %6s |\n' "$label" "${value##*|}" "$threads" \
    "$n1" "$n2" "$n3" "$n4" "$n5" "$n6"
done
