// A 3-D mdspan-shaped view where the hidden states (a matrix) go. Written
// without cuda::std::mdspan so that it runs everywhere; rank3_cuda_mdspan.cpp
// does the same with the real one.
// expect: lce: a matrix argument must be a rank-2 view
#include "common.hpp"

#include <cstddef>

#ifdef LCE_COMPILE_FAIL_CONTROL
constexpr std::size_t dims = 2;
#else
constexpr std::size_t dims = 3;
#endif

struct tensor {  // mdspan's shape: layout_right, extents 4 x 4 (x 1), strides 4, 1 (, 1)
  using element_type = const float;
  struct extents_type {
    static constexpr std::size_t rank() { return dims; }
  };
  const float* p;
  const float* data_handle() const { return p; }
  std::int64_t extent(std::size_t i) const { return i < 2 ? 4 : 1; }
  std::int64_t stride(std::size_t i) const { return i == 0 ? 4 : 1; }
};

void call() { cf::op.forward(tensor{cf::x}, cf::W, cf::Y, cf::LP, cf::LSE); }
