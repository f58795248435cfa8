#pragma once
// What the engine plans from in lce::cuda_backend, apart from its passes:
// its memory space, GEMM operands, block bound and dW tiles. Plain C++ (no
// CUDA headers), so that the host compiler tests the CUDA plan with a
// stand-in backend built on the same traits
// (tests/support/device_shaped_backend.hpp).

#include <lce/core/backend.hpp>
#include <lce/core/config.hpp>

#include <climits>
#include <cstddef>
#include <cstdint>

LCE_BEGIN_NAMESPACE
namespace detail {

struct cuda_plan_traits {
  using memory_space = device_memory;
  // bf16 / fp16 rows go to the GEMMs as stored (fp32 accumulation).
  template <class T>
  using gemm_operand = T;
  // dz = -g exp(z - lse) recomputed in the gradient pass costs less than a
  // second read-modify-write of the block in the statistics pass.
  static constexpr bool reuses_exp_block = false;
  // The vocabulary order's blocks as large as the budget allows.
  static constexpr std::size_t vocabulary_block_bytes = SIZE_MAX;
  // cublasGemmEx counts in int.
  static constexpr std::int64_t max_gemm_extent = INT_MAX;

  // dW into a 2-byte grad_weight of the inputs' own type
  // (adds_weight_gradient_tiles): cuBLAS sums the product in fp32 onto it and
  // rounds into it once, so its tiles need no scratch.
  template <class A>
  static constexpr std::int64_t weight_gradient_tile_elements(std::int64_t, std::int64_t, std::int64_t) {
    return 0;
  }
  static constexpr int weight_gradient_tile_slots() { return 1; }
};

}  // namespace detail
LCE_END_NAMESPACE
