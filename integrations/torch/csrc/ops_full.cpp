// kernels<float> and kernels<double> (see kernels.hpp).
#include "kernels.hpp"

namespace lce_torch {
template struct kernels<float>;
template struct kernels<double>;
}  // namespace lce_torch
