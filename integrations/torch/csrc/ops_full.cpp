// kernels<float> and kernels<double> on the CPU (see kernels.hpp).
#include "cpu_device.hpp"
#include "kernel_bodies.hpp"

namespace lce_torch {
template struct kernels<float, cpu_device>;
template struct kernels<double, cpu_device>;
}  // namespace lce_torch
