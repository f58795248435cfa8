// How the shared test bodies (tests/cases/*.hpp) get an operator: an "Env"
// type. Every case is a function template over <Env, T>; the CPU TUs run
// them with host_env, tests/cuda/test_cuda_backend.cu with a device mirror
// (tests/cuda/device_env.cuh) whose operator takes the same host buffers,
// copies them to the device, calls lce::cuda_backend and copies back.
//
// An Env provides:
//   Env::make_op<T, Chunk = lce::budget_chunk>(options, threads = 0)
//       an object with forward / backward / forward_backward over the
//       harness's host views (lce::matrix_view / lce::vector_view), and
//       workspace_bytes / chunk_tokens;
//   Env::gradient_operand_unit<T>, Env::gradient_operand_floor<T>
//       the unit roundoff u, and the absolute floor eta (half the subnormal
//       spacing), of the element type dz is rounded to before the two
//       gradient GEMMs; 0 where dz stays in the compute type (the host
//       widens 2-byte rows to fp32 instead). See
//       reference_operand_rounding_bounds in support/reference.hpp.
#pragma once

#include "support/harness.hpp"

namespace lce_test {

struct host_env {
  static constexpr const char* name = "host";

  template <class T, class Chunk = lce::budget_chunk>
  static op_t<T, Chunk> make_op(const lce::options& opt, int threads = 0) {
    return lce_test::make_op<T, Chunk>(opt, threads);
  }

  template <class T>
  static constexpr double gradient_operand_unit = 0.0;
  template <class T>
  static constexpr double gradient_operand_floor = 0.0;
};

}  // namespace lce_test
