#pragma once
// The CPU's operators for the kernels of kernel_bodies.hpp: lce's host
// backend on this package's GEMM providers (torch_gemm.hpp), with a
// communicator over the op's torch.distributed group (process_group_comm.hpp),
// one per thread for (T, options, group, threads).

#include "process_group_comm.hpp"
#include "tensor_views.hpp"
#include "torch_gemm.hpp"

#include <lce/lce.hpp>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <memory>
#include <type_traits>
#include <utility>
#include <variant>

namespace lce_torch {

struct cpu_device {
  template <class T, class Gemm = torch_gemm>
  using op_t = lce::ChunkedHiddenToLogprobs<process_group_comm, T, lce::budget_chunk, lce::basic_host<Gemm>>;

  // A bfloat16 operator on the provider of the bf16 GEMM chosen now (torch_gemm.hpp): with a
  // bf16 GEMM, all three GEMMs read bf16 operands; widening, the host backend's own fp32 path
  // (torch_widening_gemm). Hence a variant of the two for bfloat16, one operator otherwise.
  template <class T>
  static decltype(auto) op(const config& c) {
    if constexpr (std::is_same_v<T, lce::bfloat16>) {
      using either = std::variant<op_t<T>*, op_t<T, torch_widening_gemm>*>;
      return bf16_gemm_widens() ? either{&cached<T, torch_widening_gemm>(c)} : either{&cached<T, torch_gemm>(c)};
    } else {
      return cached<T, torch_gemm>(c);
    }
  }

  // Host memory needs no device made current.
  struct no_guard {};
  static no_guard guard(const at::Tensor&) { return {}; }

 private:
  template <class T, class Gemm>
  static op_t<T, Gemm>& cached(const config& c) {
    process_group_comm comm = c.group_name ? process_group_comm(*c.group_name, at::kCPU) : process_group_comm();
    const int threads = at::get_num_threads();
    const void* group = comm.identity();
    thread_local operator_table<op_t<T, Gemm>, std::pair<const void*, int>> table;
    const lce::options o = c.to_options();
    // The scratch is given back after each call (keep_workspace), so each call maps it
    // afresh: on the allocator's own pages, not transparent huge ones (lce::scratch_pages).
    return table.get(o, {group, threads}, [&] {
      return std::make_unique<op_t<T, Gemm>>(std::move(comm), o,
                                             lce::basic_host<Gemm>{threads, lce::scratch_pages::base});
    });
  }
};

}  // namespace lce_torch
