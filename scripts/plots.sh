#!/usr/bin/env bash
# Regenerate every plot and results file under docs/plots/ (the README's figures):
#   plan.md, plan.json                  lce_plan --table: memory per TP rank, longest sequence in 80 GiB
#   memory.json, memory.md              lce_bench_memory, 1 rank: materialised vs lce, planned vs measured
#   single-V<V>-memory.svg, -time.svg   its plots: peak memory and time against tokens, H = 1024
#   memory_mpi_sp.json, .md             lce_bench_memory_mpi, 2 ranks, sequence parallel: planned vs measured
#   distributed.json, wire.svg          lce_bench_distributed --ranks 1,2,3,4: bytes on the wire per token
#   bench.json, bench.md                lce_bench: lce / bare GEMMs (the README's Performance table)
# The measured-vs-planned runs use --check 0.10: the script fails if the planner is more than
# 10% off. Builds what it needs (Release, build/plots). About 10 minutes on 2 cores.
#   scripts/plots.sh [--quick]    (--quick: smaller sizes, for a try-out; writes to build/plots/out)
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
quick=0
[[ "${1:-}" == "--quick" ]] && quick=1

"$root/scripts/install-deps.sh"
eval "$("$root/scripts/blas-coretype.sh" --export)"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

build="$root/build/plots"
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DLCE_BUILD_TESTS=OFF -DLCE_BUILD_EXAMPLES=OFF \
  -DLCE_BUILD_BENCH=ON > "$build.configure.log" 2>&1 || { cat "$build.configure.log"; exit 1; }
targets=(lce_plan lce_bench lce_bench_memory)
mpi=0
target_list=$(cmake --build "$build" --target help 2>/dev/null || true)
if [[ "$target_list" == *lce_bench_memory_mpi* ]]; then
  mpi=1
  targets+=(lce_bench_memory_mpi lce_bench_distributed)
fi
cmake --build "$build" -j2 --target "${targets[@]}"

out="$root/docs/plots"
[[ $quick == 1 ]] && out="$build/out"
mkdir -p "$out"
bin="$build/bench"
oversubscribe=""
mpiexec --version 2>&1 | grep -q "Open MPI\|OpenRTE" && oversubscribe="--oversubscribe"

step() { echo; echo "== $* =="; }

step "planner table (80 GiB, TP 1/2/4/8, bf16, sequence parallel)"
"$build/tools/lce_plan" --table --budget 80GiB --dtype bf16 --sp on --tokens 131072 --json "$out/plan.json" \
  | tee "$out/plan.md"

if [[ $quick == 1 ]]; then
  mem_args=(--hidden 256 --vocab 8000,16000 --tokens 512,1024,2048)
  mpi_args=(--hidden 256 --vocab 8000 --tokens 512,1024)
  dist_args=(--tokens 512 --hidden 256 --vocab 8000)
  bench_shapes=256x8000x1024,512x8000x1024
else
  mem_args=(--hidden 1024 --vocab 32000,128256 --tokens 512,1024,2048,4096)
  mpi_args=(--hidden 1024 --vocab 32000 --tokens 2048,4096)
  dist_args=(--tokens 1024 --hidden 1024 --vocab 32000)
  bench_shapes=512x32000x4096,1024x32000x4096,1024x32000x16384,1024x128256x4096,2048x32000x4096
fi

step "peak memory and time against tokens, 1 rank (materialised vs lce; planned vs measured)"
"$bin/lce_bench_memory" "${mem_args[@]}" --reps 1 --check 0.10 \
  --json "$out/memory.json" --markdown "$out/memory.md" --svg "$out/single"

if [[ $mpi == 1 ]]; then
  step "planned vs measured, 2 MPI ranks, sequence parallel"
  OPENBLAS_NUM_THREADS=1 mpiexec -n 2 $oversubscribe "$bin/lce_bench_memory_mpi" --sp "${mpi_args[@]}" --reps 1 \
    --check 0.10 --json "$out/memory_mpi_sp.json" --markdown "$out/memory_mpi_sp.md"

  step "bytes on the wire per token against ranks"
  OPENBLAS_NUM_THREADS=1 mpiexec -n 4 $oversubscribe "$bin/lce_bench_distributed" --ranks 1,2,3,4 --reps 1 \
    "${dist_args[@]}" --json "$out/distributed.json" --svg "$out/wire.svg"
else
  echo "(no MPI: the 2-rank check and the wire plot are skipped)"
fi

step "lce / bare GEMMs (the Performance table)"
"$bin/lce_bench" --shapes "$bench_shapes" --reps 1 --json "$out/bench.json" --markdown "$out/bench.md"

echo
echo "wrote:"; ls -1 "$out"
