#pragma once
// The CPU's operators for the kernels of kernel_bodies.hpp: lce's host
// backend on this package's GEMM provider (torch_gemm.hpp), with a
// communicator over the op's torch.distributed group (process_group_comm.hpp),
// one per thread for (T, options, group, threads).

#include "process_group_comm.hpp"
#include "tensor_views.hpp"
#include "torch_gemm.hpp"

#include <lce/lce.hpp>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <memory>
#include <utility>

namespace lce_torch {

struct cpu_device {
  using backend_t = lce::basic_host<torch_gemm>;
  template <class T>
  using op_t = lce::ChunkedHiddenToLogprobs<process_group_comm, T, lce::budget_chunk, backend_t>;

  template <class T>
  static op_t<T>& op(const config& c) {
    process_group_comm comm = c.group_name ? process_group_comm(*c.group_name, at::kCPU) : process_group_comm();
    const int threads = at::get_num_threads();
    const void* group = comm.identity();
    thread_local operator_table<op_t<T>, std::pair<const void*, int>> table;
    const lce::options o = c.to_options();
    // The scratch is given back after each call (keep_workspace), so each call maps it
    // afresh: on the allocator's own pages, not transparent huge ones (lce::scratch_pages).
    return table.get(o, {group, threads}, [&] {
      return std::make_unique<op_t<T>>(std::move(comm), o, backend_t{threads, lce::scratch_pages::base});
    });
  }

  // Host memory needs no device made current.
  struct no_guard {};
  static no_guard guard(const at::Tensor&) { return {}; }
};

}  // namespace lce_torch
