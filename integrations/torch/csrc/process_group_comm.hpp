#pragma once
// lce_torch::process_group_comm: lce's communicator concept
// (include/lce/comm/communicator.hpp) over a c10d ProcessGroup, so that the
// vocabulary shards of a tensor-parallel LM head talk through the same
// torch.distributed group as the rest of the model (gloo on the CPU).
//
// The group is resolved by name through c10d's registry
// (c10d::resolve_process_group), the name Python's ProcessGroup.group_name
// gives. Without a group (default constructed) it is one rank and every
// collective is the identity, as lce::comm::single.
//
// Every collective is blocking (work->wait()) and runs on host memory: the
// buffers are wrapped as CPU tensors without a copy (torch::from_blob). A c10d
// failure is raised as lce::error, so lce names the chunk it happened in.
//
// CUDA / NCCL: the memory space is the host's, so this communicator pairs with
// lce::host only. With lce's CUDA backend the same class would declare
// lce::device_memory and wrap device pointers (from_blob on the stream's
// device) for ProcessGroupNCCL; see the README's PyTorch section.

#include <lce/comm/communicator.hpp>
#include <lce/core/backend.hpp>
#include <lce/core/error.hpp>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace lce_torch {

class process_group_comm {
 public:
  using memory_space = lce::host_memory;

  process_group_comm() = default;

  // Throws lce::error when no group of that name is registered.
  explicit process_group_comm(const std::string& group_name) : name_(group_name) {
    try {
      group_ = c10d::resolve_process_group(group_name);
    } catch (const std::exception& e) {
      throw lce::error("lce: group '" + group_name + "' is not a registered torch.distributed process group (" +
                       first_line(e.what()) + ")");
    }
    rank_ = group_->getRank();
    size_ = group_->getSize();
  }

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& name() const { return name_; }
  // Which group this is (null for one rank): operators are cached per group.
  const void* identity() const { return group_.get(); }

  void all_gather_bytes(const void* send, void* receive, std::size_t bytes) const {
    if (size_ == 1 || !group_) {
      if (send != receive && bytes > 0) std::memmove(receive, send, bytes);
      return;
    }
    if (bytes == 0) return;  // every rank gathers the same byte count: all skip together
    auto in = wrap(const_cast<void*>(send), static_cast<std::int64_t>(bytes), at::kByte);
    auto out = wrap(receive, static_cast<std::int64_t>(bytes) * size_, at::kByte);
    run("all_gather", [&] { return group_->all_gather_single(out, in); });
  }

  template <class A>
  void all_reduce_sum(A* data, std::int64_t count) const {
    if (size_ == 1 || !group_ || count == 0) return;
    std::vector<at::Tensor> tensors{wrap(data, count, scalar<A>())};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    run("all_reduce", [&] { return group_->allreduce(tensors, opts); });
  }

  template <class A>
  void reduce_scatter_sum(const A* send, A* receive, std::int64_t count) const {
    if (size_ == 1 || !group_) {
      if (send != receive && count > 0) std::memmove(receive, send, static_cast<std::size_t>(count) * sizeof(A));
      return;
    }
    if (count == 0) return;
    auto in = wrap(const_cast<A*>(send), count * size_, scalar<A>());
    auto out = wrap(receive, count, scalar<A>());
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    run("reduce_scatter", [&] { return group_->reduce_scatter_single(out, in, opts); });
  }

  bool all_agree(bool flag) const {
    if (size_ == 1 || !group_) return flag;
    std::int32_t value = flag ? 1 : 0;
    std::vector<at::Tensor> tensors{wrap(&value, 1, at::kInt)};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::MIN;
    run("all_agree (all_reduce MIN)", [&] { return group_->allreduce(tensors, opts); });
    return value != 0;
  }

  void all_gather_host(const std::int64_t* send, std::int64_t* receive, std::int64_t count) const {
    all_gather_bytes(send, receive, static_cast<std::size_t>(count) * sizeof(std::int64_t));
  }

 private:
  template <class A>
  static constexpr at::ScalarType scalar() {
    static_assert(std::is_same_v<A, float> || std::is_same_v<A, double>, "sums are over float or double");
    return std::is_same_v<A, float> ? at::kFloat : at::kDouble;
  }

  static at::Tensor wrap(void* data, std::int64_t count, at::ScalarType type) {
    return at::from_blob(data, {count}, at::TensorOptions().dtype(type).device(at::kCPU));
  }

  static std::string first_line(const char* text) {
    std::string s(text);
    const auto end = s.find('\n');
    return end == std::string::npos ? s : s.substr(0, end);
  }

  template <class Start>
  void run(const char* what, Start&& start) const {
    try {
      auto work = start();
      work->wait();
    } catch (const lce::error&) {
      throw;
    } catch (const std::exception& e) {
      throw lce::error(std::string("lce: torch.distributed ") + what + " on group '" + name_ + "' (" +
                       group_->getBackendName() + ", rank " + std::to_string(rank_) + " of " +
                       std::to_string(size_) + ") failed: " + first_line(e.what()));
    }
  }

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::string name_;
  int rank_ = 0;
  int size_ = 1;
};

static_assert(lce::communicator<process_group_comm>);

}  // namespace lce_torch
