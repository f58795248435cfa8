// CUDA, cuBLAS and NCCL failures become lce::error naming the call, the
// error's name and file:line; and lce::cuda_backend on a machine without a
// usable device raises lce::error at construction, before any launch. These
// run everywhere (no device needed: every call below fails by design, or
// succeeds only where a device is), so CI checks them on its GPU-less runners;
// and cuda_backend_options that contradict themselves raise before any CUDA call.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <lce/cuda.cuh>
#if LCE_TEST_WITH_NCCL
#include <lce/comm/nccl.cuh>
#endif

#include "support/error_of.hpp"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <string>

namespace {

using lce_test::error_of;

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("LCE_CUDA_TRY: a failing runtime call raises lce::error with the call, the error's name and file:line") {
  const cudaError_t status = cudaSetDevice(-1);  // no device -1, with or without a GPU
  REQUIRE(status != cudaSuccess);
  (void)cudaGetLastError();
  const int line = __LINE__ + 1;
  const std::string message = error_of([] { LCE_CUDA_TRY(cudaSetDevice(-1)); });
  (void)cudaGetLastError();
  INFO(message);
  CHECK(has(message, "cudaSetDevice(-1)"));
  CHECK(has(message, cudaGetErrorName(status)));
  CHECK(has(message, "test_cuda_errors.cu:" + std::to_string(line)));
  CHECK(error_of([] { LCE_CUDA_TRY(cudaSuccess); }).empty());
}

TEST_CASE("LCE_CUBLAS_TRY: a failing cuBLAS call raises lce::error with the call, the status's name and file:line") {
  const int line = __LINE__ + 1;
  const std::string message = error_of([] { LCE_CUBLAS_TRY(cublasSetStream(nullptr, nullptr)); });  // no handle
  INFO(message);
  CHECK(has(message, "cublasSetStream(nullptr, nullptr)"));
  CHECK(has(message, "CUBLAS_STATUS_NOT_INITIALIZED"));
  CHECK(has(message, "test_cuda_errors.cu:" + std::to_string(line)));
}

#if LCE_TEST_WITH_NCCL
TEST_CASE("LCE_NCCL_TRY: a failing NCCL call raises lce::error with the call, the result's name and file:line") {
  const int line = __LINE__ + 1;
  const std::string message = error_of([] { LCE_NCCL_TRY(ncclCommCount(nullptr, nullptr)); });  // no communicator
  INFO(message);
  CHECK(has(message, "ncclCommCount(nullptr, nullptr)"));
  CHECK(has(message, "ncclInvalidArgument"));
  CHECK(has(message, "test_cuda_errors.cu:" + std::to_string(line)));
  CHECK(!has(message, "blocking"));
}

TEST_CASE("LCE_NCCL_TRY: ncclInProgress (a non-blocking communicator) says lce needs a blocking one") {
  const std::string message = error_of([] { LCE_NCCL_TRY(ncclInProgress); });
  INFO(message);
  CHECK(has(message, "ncclInProgress"));
  CHECK(has(message, "needs a blocking communicator"));
}
#endif

TEST_CASE("cuda_backend: without a usable device, construction raises lce::error naming the failing call") {
  int devices = 0;
  const cudaError_t status = cudaGetDeviceCount(&devices);
  (void)cudaGetLastError();
  const std::string message = error_of([] { lce::cuda_backend backend{nullptr}; });
  INFO(message);
  if (status == cudaSuccess && devices > 0) {
    CHECK_MESSAGE(message.empty(), "a device is here, so the backend must construct");
  } else {
    CHECK((has(message, "cudaGetDevice") || has(message, "cublasCreate") || has(message, "cudaMalloc")));
    CHECK(has(message, "backend.cuh:"));
  }
}

TEST_CASE("cuda_backend_options: allocate without deallocate, beside a workspace, or a misaligned workspace, raises before any CUDA call") {
  void* (*allocate)(std::size_t, cudaStream_t, void*) = [](std::size_t, cudaStream_t, void*) -> void* {
    return nullptr;
  };
  void (*deallocate)(void*, std::size_t, cudaStream_t, void*) = [](void*, std::size_t, cudaStream_t, void*) {};
  std::string message = error_of([&] { lce::cuda_backend backend{nullptr, {.allocate = allocate}}; });
  INFO(message);
  CHECK(has(message, "allocate and deallocate go together (allocate set, deallocate null)"));
  message = error_of([&] { lce::cuda_backend backend{nullptr, {.deallocate = deallocate}}; });
  CHECK(has(message, "allocate and deallocate go together (allocate null, deallocate set)"));
  char buffer[64];
  message = error_of([&] {
    lce::cuda_backend backend{nullptr, {.workspace = buffer, .workspace_bytes = sizeof buffer, .allocate = allocate,
                                        .deallocate = deallocate}};
  });
  CHECK(has(message, "workspace and allocate are two sources of the scratch"));
  alignas(64) char lines[128];
  message = error_of([&] { lce::cuda_backend backend{nullptr, {.workspace = lines + 8, .workspace_bytes = 64}}; });
  CHECK(has(message, "cuda_backend_options::workspace"));
  CHECK(has(message, "is not aligned to 64 bytes"));
}
