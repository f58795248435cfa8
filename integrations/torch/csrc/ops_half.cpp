// kernels<bfloat16> and kernels<float16> on the CPU (see kernels.hpp).
#include "cpu_device.hpp"
#include "kernel_bodies.hpp"

namespace lce_torch {
template struct kernels<c10::BFloat16, cpu_device>;
template struct kernels<c10::Half, cpu_device>;
}  // namespace lce_torch
