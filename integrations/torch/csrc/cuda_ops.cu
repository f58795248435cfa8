// kernels<float>, kernels<bfloat16> and kernels<float16> on CUDA (see
// kernels.hpp): lce::cuda_backend on the current stream (cuda_device.cuh).
#include "cuda_device.cuh"
#include "kernel_bodies.hpp"

namespace lce_torch {
template struct kernels<float, cuda_device>;
template struct kernels<c10::BFloat16, cuda_device>;
template struct kernels<c10::Half, cuda_device>;
}  // namespace lce_torch
