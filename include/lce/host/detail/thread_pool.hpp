#pragma once
// A small fork-join pool for the row passes.
//
// Work is split into one contiguous range per thread, a pure function of the
// item count and the thread count; each item (a logit row) is computed the
// same way whichever thread runs it, so results do not depend on threads.
// Dispatch neither allocates nor copies the body: the hot loop stays free of
// allocations.

#include <lce/core/config.hpp>

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

LCE_BEGIN_NAMESPACE
namespace detail {

class thread_pool {
 public:
  explicit thread_pool(int threads) : size_(threads < 1 ? 1 : threads) {
    workers_.reserve(static_cast<std::size_t>(size_ - 1));
    for (int index = 1; index < size_; ++index) workers_.emplace_back([this, index] { work(index); });
  }

  thread_pool(const thread_pool&) = delete;
  thread_pool& operator=(const thread_pool&) = delete;

  ~thread_pool() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
      ++generation_;
    }
    wake_.notify_all();
    for (auto& worker : workers_) worker.join();
  }

  int size() const { return size_; }

  // Calls body(begin, end, part) over a partition of [0, count) into at most
  // size() parts, part in [0, size()) naming the thread's share (for
  // per-thread scratch); returns when all are done.
  template <class Body>
  void parallel_for(std::int64_t count, Body&& body) {
    if (count <= 0) return;
    const int used = count < size_ ? static_cast<int>(count) : size_;
    if (used == 1) {
      body(std::int64_t{0}, count, 0);
      return;
    }
    {
      std::lock_guard lock(mutex_);
      job_ = {&invoke<std::remove_reference_t<Body>>, static_cast<void*>(&body), count, used};
      pending_ = used - 1;
      ++generation_;
    }
    wake_.notify_all();
    run_share(job_, 0);
    std::unique_lock lock(mutex_);
    done_.wait(lock, [this] { return pending_ == 0; });
  }

 private:
  struct job {
    void (*call)(void*, std::int64_t, std::int64_t, int) = nullptr;
    void* body = nullptr;
    std::int64_t count = 0;
    int parts = 0;
  };

  template <class Body>
  static void invoke(void* body, std::int64_t begin, std::int64_t end, int part) {
    (*static_cast<Body*>(body))(begin, end, part);
  }

  static void run_share(const job& work, int index) {
    const std::int64_t begin = work.count * index / work.parts;
    const std::int64_t end = work.count * (index + 1) / work.parts;
    if (begin < end) work.call(work.body, begin, end, index);
  }

  void work(int index) {
    std::uint64_t seen = 0;
    for (;;) {
      job current;
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        if (stopping_) return;
        current = job_;
      }
      if (index < current.parts) {
        run_share(current, index);
        std::lock_guard lock(mutex_);
        if (--pending_ == 0) done_.notify_one();
      }
    }
  }

  int size_;
  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  job job_;
  int pending_ = 0;
  std::uint64_t generation_ = 0;
  bool stopping_ = false;
};

}  // namespace detail
LCE_END_NAMESPACE
