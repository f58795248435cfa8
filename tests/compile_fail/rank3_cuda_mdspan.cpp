// A 3-D cuda::std::mdspan where the hidden states (a matrix) go.
// expect: lce: a matrix argument must be a rank-2 view
#include "common.hpp"

#include <cuda/std/mdspan>

#ifdef LCE_COMPILE_FAIL_CONTROL
using hidden_t = cuda::std::mdspan<const float, cuda::std::dextents<std::int64_t, 2>>;
void call() { cf::op.forward(hidden_t(cf::x, 4, 4), cf::W, cf::Y, cf::LP, cf::LSE); }
#else
using hidden_t = cuda::std::mdspan<const float, cuda::std::dextents<std::int64_t, 3>>;
void call() { cf::op.forward(hidden_t(cf::x, 4, 4, 1), cf::W, cf::Y, cf::LP, cf::LSE); }
#endif
