#pragma once
// lce::comm::nccl: an NCCL communicator (CMake target lce::nccl).
//
//   lce::comm::nccl comm{nccl_comm, stream};
//
// Data collectives are enqueued on `stream` and act on device memory; the
// two control collectives (all_agree, all_gather_host) take host values,
// stage them through a small device buffer and synchronise the stream. The
// operator neither owns nor destroys the ncclComm_t or the stream. The
// communicator must be blocking (NCCL's default).

#include <lce/comm/communicator.hpp>
#include <lce/core/backend.hpp>
#include <lce/core/config.hpp>
#include <lce/core/error.hpp>
#include <lce/cuda/error.cuh>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <type_traits>

LCE_BEGIN_NAMESPACE
namespace detail {

// NCCL has a string for each result but no name.
constexpr const char* nccl_result_name(ncclResult_t status) {
  switch (status) {
    case ncclSuccess: return "ncclSuccess";
    case ncclUnhandledCudaError: return "ncclUnhandledCudaError";
    case ncclSystemError: return "ncclSystemError";
    case ncclInternalError: return "ncclInternalError";
    case ncclInvalidArgument: return "ncclInvalidArgument";
    case ncclInvalidUsage: return "ncclInvalidUsage";
    case ncclRemoteError: return "ncclRemoteError";
    case ncclInProgress: return "ncclInProgress";
    default: return "ncclResult_t (unknown)";
  }
}

inline void check_nccl(ncclResult_t status, const char* call, const char* file, int line) {
  if (status == ncclSuccess) return;
  // A non-blocking communicator (ncclConfig_t::blocking = 0) returns this and finishes later; lce's
  // collectives are enqueued in order with its kernels and cannot wait on it.
  const char* why = status == ncclInProgress ? "; lce::comm::nccl needs a blocking communicator "
                                               "(ncclConfig_t::blocking = 1, NCCL's default)"
                                             : "";
  fail("NCCL: ", call, " failed: ", nccl_result_name(status), " (", ncclGetErrorString(status), ") at ", file, ":",
       line, why);
}

}  // namespace detail
LCE_END_NAMESPACE

#define LCE_NCCL_TRY(call) ::lce::detail::check_nccl((call), #call, __FILE__, __LINE__)

LCE_BEGIN_NAMESPACE
namespace comm {

class nccl {
 public:
  using memory_space = device_memory;

  // The staging buffer of the control collectives is allocated here, on the communicator's
  // device, not inside them: a cudaMalloc failing on one rank in the middle of an agreement
  // would raise on that rank alone and leave the others waiting in its all-gather, and
  // cudaMalloc / cudaFree there would synchronise the device while NCCL kernels of another
  // stream may be waiting on peers.
  nccl(ncclComm_t comm, cudaStream_t stream) : comm_(comm), stream_(stream) {
    LCE_NCCL_TRY(ncclCommUserRank(comm_, &rank_));
    LCE_NCCL_TRY(ncclCommCount(comm_, &size_));
    int device = 0;
    LCE_NCCL_TRY(ncclCommCuDevice(comm_, &device));
    staging_ = std::make_shared<staging>(
        device, control_values * sizeof(std::int64_t) * static_cast<std::size_t>(size_ + 1));
  }

  int rank() const { return rank_; }
  int size() const { return size_; }
  ncclComm_t handle() const { return comm_; }
  cudaStream_t stream() const { return stream_; }

  void all_gather_bytes(const void* send, void* receive, std::size_t bytes) const {
    LCE_NCCL_TRY(ncclAllGather(send, receive, bytes, ncclUint8, comm_, stream_));
  }

  template <class A>
  void all_reduce_sum(A* data, std::int64_t count) const {
    LCE_NCCL_TRY(ncclAllReduce(data, data, static_cast<std::size_t>(count), type_of<A>(), ncclSum, comm_, stream_));
  }

  template <class A>
  void reduce_scatter_sum(const A* send, A* receive, std::int64_t count) const {
    LCE_NCCL_TRY(
        ncclReduceScatter(send, receive, static_cast<std::size_t>(count), type_of<A>(), ncclSum, comm_, stream_));
  }

  void all_gather_host(const std::int64_t* send, std::int64_t* receive, std::int64_t count) const {
    const auto bytes = static_cast<std::size_t>(count) * sizeof(std::int64_t);
    auto* device = static_cast<char*>(staging_->at_least(bytes * static_cast<std::size_t>(size_ + 1)));
    LCE_CUDA_TRY(cudaMemcpyAsync(device, send, bytes, cudaMemcpyHostToDevice, stream_));
    LCE_NCCL_TRY(ncclAllGather(device, device + bytes, bytes, ncclUint8, comm_, stream_));
    LCE_CUDA_TRY(cudaMemcpyAsync(receive, device + bytes, bytes * static_cast<std::size_t>(size_),
                                 cudaMemcpyDeviceToHost, stream_));
    LCE_CUDA_TRY(cudaStreamSynchronize(stream_));
  }

  bool all_agree(bool flag) const {
    auto* device = static_cast<std::int32_t*>(staging_->at_least(sizeof(std::int32_t)));
    std::int32_t value = flag ? 1 : 0;
    LCE_CUDA_TRY(cudaMemcpyAsync(device, &value, sizeof value, cudaMemcpyHostToDevice, stream_));
    LCE_NCCL_TRY(ncclAllReduce(device, device, 1, ncclInt32, ncclMin, comm_, stream_));
    LCE_CUDA_TRY(cudaMemcpyAsync(&value, device, sizeof value, cudaMemcpyDeviceToHost, stream_));
    LCE_CUDA_TRY(cudaStreamSynchronize(stream_));
    return value != 0;
  }

 private:
  template <class A>
  static ncclDataType_t type_of() {
    static_assert(std::is_same_v<A, float> || std::is_same_v<A, double>, "sums are over float or double");
    return std::is_same_v<A, float> ? ncclFloat32 : ncclFloat64;
  }

  // The most values a control collective gathers from each rank: the operator's call record
  // (detail::call_record::values) and a loss's token count fit with room to spare.
  static constexpr std::size_t control_values = 32;

  // The control collectives' device buffer, made once on the communicator's device and shared
  // by copies.
  struct staging {
    void* data = nullptr;
    std::size_t bytes = 0;
    staging(int device, std::size_t size) {
      int current = 0;
      LCE_CUDA_TRY(cudaGetDevice(&current));
      LCE_CUDA_TRY(cudaSetDevice(device));
      const cudaError_t allocated = cudaMalloc(&data, size);
      cudaSetDevice(current);
      detail::check_cuda(allocated, "cudaMalloc(&data, size) (lce::comm::nccl's staging buffer)", __FILE__, __LINE__);
      bytes = size;
    }
    staging(const staging&) = delete;
    staging& operator=(const staging&) = delete;
    ~staging() { cudaFree(data); }
    // The same size on every rank (values x ranks), so every rank raises here alike.
    void* at_least(std::size_t wanted) const {
      detail::expects(wanted <= bytes, "lce::comm::nccl: a control collective of ", wanted, " bytes exceeds its ",
                      bytes, "-byte staging buffer (", control_values, " values per rank)");
      return data;
    }
  };

  ncclComm_t comm_;
  cudaStream_t stream_;
  int rank_ = 0;
  int size_ = 1;
  std::shared_ptr<staging> staging_;
};

static_assert(communicator<nccl>);

}  // namespace comm
LCE_END_NAMESPACE
