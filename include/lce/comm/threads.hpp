#pragma once
// An in-process group of ranks, one thread each: the communicator for tests
// and for running several vocabulary shards inside one process.
//
//   lce::comm::thread_group group(4);
//   // in thread r:
//   lce::comm::threads comm{group, r};
//
// Every collective is a barrier-separated exchange through shared pointers;
// sums run in rank order, so every rank gets bitwise the same result.

#include <lce/comm/communicator.hpp>
#include <lce/core/backend.hpp>
#include <lce/core/config.hpp>
#include <lce/core/error.hpp>

#include <barrier>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

LCE_BEGIN_NAMESPACE
namespace comm {

class thread_group {
 public:
  explicit thread_group(int ranks)
      : ranks_(ranks), barrier_(ranks), sends_(static_cast<std::size_t>(ranks)), flags_(static_cast<std::size_t>(ranks)) {
    detail::expects(ranks >= 1, "thread_group: ranks must be >= 1, got ", ranks);
  }
  thread_group(const thread_group&) = delete;
  thread_group& operator=(const thread_group&) = delete;

  int size() const { return ranks_; }

 private:
  friend class threads;

  int ranks_;
  std::barrier<> barrier_;
  std::vector<const void*> sends_;
  std::vector<char> flags_;
  std::vector<char> sums_;  // all_reduce_sum results, grown on demand
};

class threads {
 public:
  using memory_space = host_memory;

  threads(thread_group& group, int rank) : group_(&group), rank_(rank) {
    detail::expects(rank >= 0 && rank < group.size(), "threads: rank ", rank, " is outside [0, ", group.size(), ")");
  }

  int rank() const { return rank_; }
  int size() const { return group_->size(); }

  void all_gather_bytes(const void* send, void* receive, std::size_t bytes) const {
    publish(send);
    for (int r = 0; r < size(); ++r)
      if (bytes > 0) std::memmove(static_cast<char*>(receive) + r * bytes, group_->sends_[r], bytes);
    group_->barrier_.arrive_and_wait();
  }

  template <class A>
  void all_reduce_sum(A* data, std::int64_t count) const {
    if (rank_ == 0 && group_->sums_.size() < static_cast<std::size_t>(count) * sizeof(A))
      group_->sums_.resize(static_cast<std::size_t>(count) * sizeof(A));
    publish(data);
    // Rank r sums its share of the elements over all ranks, in rank order.
    auto* sums = reinterpret_cast<A*>(group_->sums_.data());
    const std::int64_t begin = count * rank_ / size(), end = count * (rank_ + 1) / size();
    for (std::int64_t i = begin; i < end; ++i) {
      A total = static_cast<const A*>(group_->sends_[0])[i];
      for (int r = 1; r < size(); ++r) total += static_cast<const A*>(group_->sends_[r])[i];
      sums[i] = total;
    }
    group_->barrier_.arrive_and_wait();
    if (count > 0) std::memcpy(data, sums, static_cast<std::size_t>(count) * sizeof(A));
    group_->barrier_.arrive_and_wait();
  }

  template <class A>
  void reduce_scatter_sum(const A* send, A* receive, std::int64_t count) const {
    publish(send);
    for (std::int64_t i = 0; i < count; ++i) {
      const std::int64_t at = rank_ * count + i;
      A total = static_cast<const A*>(group_->sends_[0])[at];
      for (int r = 1; r < size(); ++r) total += static_cast<const A*>(group_->sends_[r])[at];
      receive[i] = total;
    }
    group_->barrier_.arrive_and_wait();
  }

  void all_gather_host(const std::int64_t* send, std::int64_t* receive, std::int64_t count) const {
    all_gather_bytes(send, receive, static_cast<std::size_t>(count) * sizeof(std::int64_t));
  }

  bool all_agree(bool flag) const {
    group_->flags_[static_cast<std::size_t>(rank_)] = flag;
    group_->barrier_.arrive_and_wait();
    bool all = true;
    for (char f : group_->flags_) all = all && f;
    group_->barrier_.arrive_and_wait();
    return all;
  }

 private:
  // Shares this rank's pointer; on return every rank's pointer is visible.
  void publish(const void* pointer) const {
    group_->sends_[static_cast<std::size_t>(rank_)] = pointer;
    group_->barrier_.arrive_and_wait();
  }

  thread_group* group_;
  int rank_;
};

static_assert(communicator<threads>);

}  // namespace comm
LCE_END_NAMESPACE
