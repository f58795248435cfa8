#pragma once
// Turning CUDA and cuBLAS status codes into lce::error with the call and its
// file:line (as cuCollections' CUCO_CUDA_TRY does). NCCL's is in comm/nccl.cuh.

#include <lce/core/config.hpp>
#include <lce/core/error.hpp>

#include <cuda_runtime_api.h>

LCE_BEGIN_NAMESPACE
namespace detail {

inline void check_cuda(cudaError_t status, const char* call, const char* file, int line) {
  if (status == cudaSuccess) return;
  fail("CUDA: ", call, " failed: ", cudaGetErrorName(status), " (", cudaGetErrorString(status), ") at ", file, ":",
       line);
}

}  // namespace detail
LCE_END_NAMESPACE

#define LCE_CUDA_TRY(call) ::lce::detail::check_cuda((call), #call, __FILE__, __LINE__)
