#!/usr/bin/env bash
# The GPU check, on a machine with an NVIDIA GPU and the CUDA toolkit:
#   1. builds lce's CUDA tests and benchmark for the local GPU's architecture;
#   2. runs the CUDA tests (and the README's CUDA quickstart), then the backend's
#      suite again under compute-sanitizer (memcheck, racecheck);
#   3. runs the benchmark: N = 8,192, H = 4,096, V = 128,256 in bf16 against
#      materialised cuBLAS logits and the bare GEMMs, and the longest sequence
#      in a device-memory budget at H = 3,584, V = 152,064.
# With LCE_GPU_CHECK_TORCH=1 also lce_torch's CUDA kernels: builds the package with them
# (scripts/test-torch.sh: a venv with torch==2.13.0, from PyPI unless LCE_TORCH_VENV names one
# that has it, as a machine without network needs), runs integrations/torch/tests/test_cuda.py
# and test_cuda_distributed.py (tensor parallel on CUDA tensors: gloo on one GPU, NCCL on two),
# and bench/torch_op_bench.py --device cuda at N = 8,192, H = 4,096, V = 128,256, bf16.
# Output: the terminal, and build/gpu/gpu-check.json. Exit 77 when no GPU is found.
#   scripts/gpu-check.sh [extra flags for lce_bench_cuda]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

export PATH="/usr/local/cuda/bin:$PATH"
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L; then
  echo "gpu-check: no NVIDIA GPU here (nvidia-smi finds none): nothing to check"
  exit 77
fi
command -v cmake >/dev/null || "$root/scripts/install-deps.sh"

build="$root/build/gpu"
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=native
# Every test labelled cuda (the backend's suite, the NCCL communicator's where
# NCCL is, the README's CUDA quickstart) and the benchmark; nothing else.
targets=(lce_bench_cuda)
for test in $(ctest --test-dir "$build" -N -L cuda | sed -n 's/^ *Test *#[0-9]*: //p'); do
  case "$test" in
    example.cuda_quickstart) targets+=(lce_cuda_quickstart) ;;
    *) targets+=("$test") ;;
  esac
done
cmake --build "$build" -j"$(nproc)" --target "${targets[@]}"

echo "== CUDA tests =="
ctest --test-dir "$build" -L cuda --output-on-failure

tests="$build/tests/cuda/lce_cuda_backend_test"
if command -v compute-sanitizer >/dev/null; then
  echo "== CUDA tests under compute-sanitizer (memcheck, racecheck) =="
  compute-sanitizer --tool memcheck --error-exitcode 1 "$tests"
  compute-sanitizer --tool racecheck --error-exitcode 1 "$tests"
else
  echo "compute-sanitizer not found: skipped"
fi

if [ "${LCE_GPU_CHECK_TORCH:-0}" = 1 ]; then
  echo "== lce_torch on CUDA (tests/test_cuda.py, tests/test_cuda_distributed.py) =="
  LCE_TORCH_CUDA=1 LCE_TORCH_REQUIRE_CUDA=1 LCE_TORCH_TESTS="test_cuda.py test_cuda_distributed.py" MAX_JOBS=$(nproc) "$root/scripts/test-torch.sh"
  echo "== lce_torch against PyTorch on the GPU (bench/torch_op_bench.py --device cuda) =="
  "${LCE_TORCH_VENV:-$root/build/torch-venv}/bin/python" "$root/bench/torch_op_bench.py" --device cuda \
    --hidden 4096 --vocab 128256 --tokens 8192 --dtypes bfloat16 --variants plain,torch_chunked,lce,lce_2sweep \
    --reps 3 --json "$build/torch_op_bench_cuda.json"
fi

echo "== benchmark =="
"$build/bench/cuda/lce_bench_cuda" --json "$build/gpu-check.json" "$@"
echo "gpu-check: done ($build/gpu-check.json)"
