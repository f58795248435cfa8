// A cuda::std::mdspan whose accessor is not plain memory (it scales each
// element on access): lce reads raw memory, so it refuses it.
// expect: lce: mdspan with a custom accessor: only plain-pointer accessors (default_accessor) are supported
#include "common.hpp"

#include <cuda/std/mdspan>

#include <cstddef>

struct scaling_accessor {
  using offset_policy = scaling_accessor;
  using element_type = const float;
  using reference = float;
  using data_handle_type = const float*;
  constexpr reference access(data_handle_type p, std::size_t i) const { return 2.0f * p[i]; }
  constexpr data_handle_type offset(data_handle_type p, std::size_t i) const { return p + i; }
};

using ext2 = cuda::std::dextents<std::int64_t, 2>;
#ifdef LCE_COMPILE_FAIL_CONTROL
using hidden_t = cuda::std::mdspan<const float, ext2>;
#else
using hidden_t = cuda::std::mdspan<const float, ext2, cuda::std::layout_right, scaling_accessor>;
#endif

void call() { cf::op.forward(hidden_t(cf::x, 4, 4), cf::W, cf::Y, cf::LP, cf::LSE); }
