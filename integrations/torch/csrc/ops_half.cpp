// kernels<bfloat16> and kernels<float16> (see kernels.hpp).
#include "kernels.hpp"

namespace lce_torch {
template struct kernels<c10::BFloat16>;
template struct kernels<c10::Half>;
}  // namespace lce_torch
