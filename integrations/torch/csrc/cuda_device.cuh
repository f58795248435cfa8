#pragma once
// The CUDA operators for the kernels of kernel_bodies.hpp: lce::cuda_backend
// on PyTorch's current stream of the tensors' device, one per thread for
// (T, options, device, stream). Compiled by nvcc only (cuda_ops.cu), where
// lce_torch is built with the CUDA toolkit.
//
// Tensor parallel: the communicator runs lce's collectives on the op's
// torch.distributed group (process_group_comm.hpp) with device tensors,
// ordered with the current stream: NCCL's communicator and stream stay
// PyTorch's, so lce never needs its own NCCL (nor one matching torch's).
//
// The scratch comes from PyTorch's CUDA caching allocator on the op's stream
// (lce::cuda_backend_options::allocate), so it shares PyTorch's pool and
// torch.cuda.max_memory_allocated counts it; as on the CPU, it is given back
// after each call unless set_keep_workspace(True).

#include "process_group_comm.hpp"
#include "tensor_views.hpp"

#include <lce/cuda.cuh>

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <memory>
#include <tuple>
#include <utility>

namespace lce_torch {

struct cuda_device {
  template <class T>
  using op_t = lce::ChunkedHiddenToLogprobs<cuda_process_group_comm, T, lce::budget_chunk, lce::cuda_backend>;

  // The caller holds guard(hidden), so the current device is the tensors'.
  template <class T>
  static op_t<T>& op(const config& c) {
    const lce::options o = c.to_options();
    const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream();
    const cudaStream_t stream = current.stream();
    const at::Device device(at::kCUDA, current.device_index());
    cuda_process_group_comm comm =
        c.group_name ? cuda_process_group_comm(*c.group_name, device) : cuda_process_group_comm(device);
    // The table is never destroyed: at exit the CUDA runtime may be gone
    // before this thread's objects are, and an operator's destructor calls
    // into it (cuBLAS handle, stream-ordered frees). PyTorch keeps its own
    // handles so. While the program runs, the table evicts its oldest
    // operator past 8 (operator_table in tensor_views.hpp).
    using key = std::tuple<const void*, int, cudaStream_t>;
    thread_local auto* table = new operator_table<op_t<T>, key>();
    return table->get(o, key{comm.identity(), current.device_index(), stream}, [&] {
      lce::cuda_backend_options scratch;
      scratch.allocate = &allocate;
      scratch.deallocate = &deallocate;
      return std::make_unique<op_t<T>>(std::move(comm), o, lce::cuda_backend{stream, scratch});
    });
  }

  static c10::cuda::CUDAGuard guard(const at::Tensor& t) { return c10::cuda::CUDAGuard(t.device()); }

 private:
  // PyTorch's caching allocator; out of memory is lce's to report (nullptr:
  // lce::error naming the scratch and the bytes).
  static void* allocate(std::size_t bytes, cudaStream_t stream, void*) {
    try {
      return c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(bytes, stream);
    } catch (const c10::OutOfMemoryError&) {
      return nullptr;
    }
  }
  static void deallocate(void* pointer, std::size_t, cudaStream_t, void*) {
    c10::cuda::CUDACachingAllocator::raw_delete(pointer);
  }
};

}  // namespace lce_torch
