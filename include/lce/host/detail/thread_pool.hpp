#pragma once
// A small fork-join pool for the GEMM tiles and the row passes.
//
// Work is cut into grains that depend on the item count and the grain size
// only, and the threads take grains as they come free: a core slowed by
// another process (common on shared machines) just takes fewer grains. Each
// item is computed the same way whichever thread runs it, so results do not
// depend on the threads. Dispatch neither allocates nor copies the body: the
// hot loop stays free of allocations.
//
// Between jobs a worker spins for a short while before it sleeps: the gaps
// inside one operator call are microseconds, and a thread that sleeps there
// hands its core to the operating system (or, in a virtual machine, its
// virtual core to the host), which then takes milliseconds to get it back
// up to speed.

#include <lce/core/config.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

LCE_BEGIN_NAMESPACE
namespace detail {

inline void spin_pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Spins until done() or until the spin window has passed; returns done().
template <class Done>
bool spin_until(Done&& done) {
  constexpr auto window = std::chrono::microseconds(2000);
  const auto start = std::chrono::steady_clock::now();
  for (unsigned i = 1;; ++i) {
    if (done()) return true;
    spin_pause();
    if (i % 256 == 0 && std::chrono::steady_clock::now() - start > window) return done();
  }
}

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
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    for (auto& worker : workers_) worker.join();
  }

  int size() const { return size_; }

  // Calls body(begin, end, part) on the grains [k * grain, (k + 1) * grain)
  // of [0, count), each on whichever thread takes it; part in [0, size())
  // names that thread (for per-thread scratch). Returns when all are done.
  template <class Body>
  void parallel_for(std::int64_t count, std::int64_t grain, Body&& body) {
    if (count <= 0) return;
    if (grain < 1) grain = 1;
    if (size_ == 1 || count <= grain) {
      body(std::int64_t{0}, count, 0);
      return;
    }
    {
      std::lock_guard lock(mutex_);
      job_ = {&invoke<std::remove_reference_t<Body>>, static_cast<void*>(&body), count, grain};
      next_grain_.store(0, std::memory_order_relaxed);
      pending_.store(size_ - 1, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    take_grains(job_, 0);
    const auto all_done = [this] { return pending_.load(std::memory_order_acquire) == 0; };
    if (!spin_until(all_done)) {
      std::unique_lock lock(mutex_);
      done_.wait(lock, all_done);
    }
  }

 private:
  struct job {
    void (*call)(void*, std::int64_t, std::int64_t, int) = nullptr;
    void* body = nullptr;
    std::int64_t count = 0;
    std::int64_t grain = 1;
  };

  template <class Body>
  static void invoke(void* body, std::int64_t begin, std::int64_t end, int part) {
    (*static_cast<Body*>(body))(begin, end, part);
  }

  void take_grains(const job& work, int part) {
    for (;;) {
      const std::int64_t begin = next_grain_.fetch_add(1, std::memory_order_relaxed) * work.grain;
      if (begin >= work.count) return;
      work.call(work.body, begin, begin + work.grain < work.count ? begin + work.grain : work.count, part);
    }
  }

  void work(int index) {
    std::uint64_t seen = 0;
    for (;;) {
      const auto new_job = [&] { return generation_.load(std::memory_order_acquire) != seen; };
      if (!spin_until(new_job)) {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, new_job);
      }
      seen = generation_.load(std::memory_order_acquire);
      if (stopping_) return;
      // job_ is not rewritten before this thread has counted itself done below.
      take_grains(job_, index);
      if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard lock(mutex_);
        done_.notify_one();
      }
    }
  }

  int size_;
  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  job job_;
  std::atomic<std::int64_t> next_grain_{0};
  std::atomic<int> pending_{0};
  std::atomic<std::uint64_t> generation_{0};
  bool stopping_ = false;  // written under mutex_ before the last generation bump
};

}  // namespace detail
LCE_END_NAMESPACE
