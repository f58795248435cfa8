#pragma once
// lce's communicator concept (include/lce/comm/communicator.hpp) over a c10d
// ProcessGroup, so that the vocabulary shards of a tensor-parallel LM head
// talk through the same torch.distributed group as the rest of the model:
// gloo on the CPU, NCCL (or gloo) on CUDA.
//
// The group is resolved by name through c10d's registry
// (c10d::resolve_process_group), the name Python's ProcessGroup.group_name
// gives. Without a group (default constructed) it is one rank and every
// collective is the identity, as lce::comm::single.
//
//   process_group              the group and lce's two control collectives
//                              (all_agree, all_gather_host: host values)
//   process_group_comm         + the data collectives on CPU tensors
//   cuda_process_group_comm    + the data collectives on one CUDA device's
//                              tensors (lce's CUDA backend)
//
// Buffers are wrapped as tensors without a copy (at::from_blob). Every
// collective ends in work->wait(): on the CPU it blocks; on CUDA it makes the
// current stream (the one lce's CUDA backend runs on) wait for the collective
// (NCCL's without blocking the host). Host values travel on CPU tensors where the group
// has a CPU backend (gloo), otherwise through a small tensor on the call's
// CUDA device (an NCCL-only group), read back with one synchronisation. A c10d
// failure is raised as lce::error, so lce names the chunk it happened in.

#include <lce/comm/communicator.hpp>
#include <lce/core/backend.hpp>
#include <lce/core/error.hpp>

#include <ATen/ATen.h>
#include <ATen/detail/CUDAHooksInterface.h>
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

class process_group {
 public:
  process_group() = default;

  // `device` is where the call's tensors are. Throws lce::error when no
  // group of that name is registered.
  process_group(const std::string& group_name, at::Device device) : name_(group_name), device_(device) {
    try {
      group_ = c10d::resolve_process_group(group_name);
    } catch (const std::exception& e) {
      throw lce::error("lce: group '" + group_name + "' is not a registered torch.distributed process group (" +
                       first_line(e.what()) + ")");
    }
    rank_ = group_->getRank();
    size_ = group_->getSize();
    if (!group_->hasBackendForDeviceType(at::kCPU)) {
      if (device.is_cuda())
        control_ = device;
      else if (group_->hasBackendForDeviceType(at::kCUDA))
        control_ = at::Device(at::kCUDA, at::detail::getCUDAHooks().current_device());
    }
  }

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& name() const { return name_; }
  // Which group this is (null for one rank): operators are cached per group.
  const void* identity() const { return size_ > 1 ? group_.get() : nullptr; }

  bool all_agree(bool flag) const {
    if (size_ == 1 || !group_) return flag;
    std::int32_t value = flag ? 1 : 0;
    const at::Tensor host = on_host(&value, 1, at::kInt);
    std::vector<at::Tensor> tensors{to_control(host)};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::MIN;
    run("all_agree (all_reduce MIN)", [&] { return group_->allreduce(tensors, opts); });
    back_to(host, tensors[0]);
    return value != 0;
  }

  void all_gather_host(const std::int64_t* send, std::int64_t* receive, std::int64_t count) const {
    if (size_ == 1 || !group_) {
      if (send != receive && count > 0) std::memmove(receive, send, static_cast<std::size_t>(count) * sizeof *send);
      return;
    }
    if (count == 0) return;
    at::Tensor in = to_control(on_host(const_cast<std::int64_t*>(send), count, at::kLong));
    const at::Tensor host_out = on_host(receive, count * size_, at::kLong);
    at::Tensor out = control_.is_cpu() ? host_out : at::empty({count * size_}, in.options());
    run("all_gather (host values)", [&] { return group_->all_gather_single(out, in); });
    back_to(host_out, out);
  }

 protected:
  // The group's backend for the call's tensors, checked before any collective
  // (the same on every rank, so every rank raises together).
  void require_backend_for_data() const {
    if (size_ == 1 || !group_ || group_->hasBackendForDeviceType(device_.type())) return;
    throw lce::error("lce: group '" + name_ + "' (" + group_->getBackendName() + ") has no backend for " +
                     c10::DeviceTypeName(device_.type(), /*lower_case=*/true) +
                     " tensors: pass a group made for them (gloo on the CPU; NCCL or gloo on CUDA)");
  }

  static at::Tensor wrap(void* data, std::int64_t count, at::ScalarType type, at::Device device) {
    return at::from_blob(data, {count}, at::TensorOptions().dtype(type).device(device));
  }
  static at::Tensor on_host(void* data, std::int64_t count, at::ScalarType type) {
    return wrap(data, count, type, at::kCPU);
  }
  at::Tensor to_control(const at::Tensor& host) const { return control_.is_cpu() ? host : host.to(control_); }
  // After the collective's wait(): a device-to-host copy on the current
  // stream, which it synchronises.
  void back_to(const at::Tensor& host, const at::Tensor& staged) const {
    if (!control_.is_cpu()) host.copy_(staged);
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

  static std::string first_line(const char* text) {
    std::string s(text);
    const auto end = s.find('\n');
    return end == std::string::npos ? s : s.substr(0, end);
  }

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::string name_;
  int rank_ = 0;
  int size_ = 1;
  at::Device device_ = at::kCPU;   // the data collectives' tensors
  at::Device control_ = at::kCPU;  // the control collectives' tensors
};

// MemorySpace: lce::host_memory (CPU tensors) or lce::device_memory (the
// tensors of one CUDA device, in stream order on its current stream).
template <class MemorySpace>
class basic_process_group_comm : public process_group {
  static_assert(std::is_same_v<MemorySpace, lce::host_memory> || std::is_same_v<MemorySpace, lce::device_memory>);
  static constexpr bool on_cuda = std::is_same_v<MemorySpace, lce::device_memory>;

 public:
  using memory_space = MemorySpace;

  basic_process_group_comm() requires(!on_cuda) = default;
  // One rank on `device`.
  explicit basic_process_group_comm(at::Device device) { device_ = checked(device); }
  // Throws lce::error when the group is not registered or has no backend for
  // `device`'s tensors.
  basic_process_group_comm(const std::string& group_name, at::Device device)
      : process_group(group_name, checked(device)) {
    require_backend_for_data();
  }

  void all_gather_bytes(const void* send, void* receive, std::size_t bytes) const {
    const auto count = static_cast<std::int64_t>(bytes);
    if (size_ == 1 || !group_) {
      copy(send, receive, count, at::kByte);
      return;
    }
    if (bytes == 0) return;  // every rank gathers the same byte count: all skip together
    auto in = wrap(const_cast<void*>(send), count, at::kByte, device_);
    auto out = wrap(receive, count * size_, at::kByte, device_);
    run("all_gather", [&] { return group_->all_gather_single(out, in); });
  }

  template <class A>
  void all_reduce_sum(A* data, std::int64_t count) const {
    if (size_ == 1 || !group_ || count == 0) return;
    std::vector<at::Tensor> tensors{wrap(data, count, scalar<A>(), device_)};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    run("all_reduce", [&] { return group_->allreduce(tensors, opts); });
  }

  template <class A>
  void reduce_scatter_sum(const A* send, A* receive, std::int64_t count) const {
    if (size_ == 1 || !group_) {
      copy(send, receive, count, scalar<A>());
      return;
    }
    if (count == 0) return;
    auto in = wrap(const_cast<A*>(send), count * size_, scalar<A>(), device_);
    auto out = wrap(receive, count, scalar<A>(), device_);
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    run("reduce_scatter", [&] { return group_->reduce_scatter_single(out, in, opts); });
  }

 private:
  static at::Device checked(at::Device device) {
    if (on_cuda != device.is_cuda())
      throw lce::error(std::string("lce_torch: a communicator for ") + (on_cuda ? "CUDA" : "CPU") +
                       " tensors was given device " + device.str());
    return device;
  }

  template <class A>
  static constexpr at::ScalarType scalar() {
    static_assert(std::is_same_v<A, float> || std::is_same_v<A, double>, "sums are over float or double");
    return std::is_same_v<A, float> ? at::kFloat : at::kDouble;
  }

  // One rank: receive = send (on the device, in stream order).
  void copy(const void* send, void* receive, std::int64_t count, at::ScalarType type) const {
    if (send == receive || count == 0) return;
    if constexpr (on_cuda)
      wrap(receive, count, type, device_).copy_(wrap(const_cast<void*>(send), count, type, device_));
    else
      std::memmove(receive, send, static_cast<std::size_t>(count) * c10::elementSize(type));
  }
};

using process_group_comm = basic_process_group_comm<lce::host_memory>;
using cuda_process_group_comm = basic_process_group_comm<lce::device_memory>;

static_assert(lce::communicator<process_group_comm>);
static_assert(lce::communicator<cuda_process_group_comm>);

}  // namespace lce_torch
