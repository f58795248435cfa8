#pragma once
// The one-rank communicator: every collective is the identity.

#include <lce/comm/communicator.hpp>
#include <lce/core/backend.hpp>
#include <lce/core/config.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>

LCE_BEGIN_NAMESPACE
namespace comm {

struct single {
  // Buffers of any backend: a single rank never touches them.
  using memory_space = void;

  constexpr int rank() const { return 0; }
  constexpr int size() const { return 1; }

  void all_gather_bytes(const void* send, void* receive, std::size_t bytes) const {
    if (send != receive && bytes > 0) std::memmove(receive, send, bytes);
  }
  template <class A>
  void all_reduce_sum(A*, std::int64_t) const {}
  template <class A>
  void reduce_scatter_sum(const A* send, A* receive, std::int64_t count) const {
    if (send != receive && count > 0) std::memmove(receive, send, static_cast<std::size_t>(count) * sizeof(A));
  }
  constexpr bool all_agree(bool flag) const { return flag; }
  void all_gather_host(const std::int64_t* send, std::int64_t* receive, std::int64_t count) const {
    all_gather_bytes(send, receive, static_cast<std::size_t>(count) * sizeof(std::int64_t));
  }
};

static_assert(communicator<single>);

}  // namespace comm
LCE_END_NAMESPACE
