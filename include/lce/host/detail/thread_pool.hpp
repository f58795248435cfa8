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
//
// An exception thrown by the body on any thread (a worker or the caller) is
// caught; the first one is kept, no further grains are handed out, and once
// every thread has left the job it is rethrown on the calling thread. The
// pool stays usable afterwards.

#include <lce/core/config.hpp>

#include <atomic>
#include <chrono>
#include <cerrno>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#endif

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

// The CPUs this process may run on: its affinity mask (taskset, cgroups'
// cpusets, an MPI launcher's binding), else all hardware threads.
inline int available_cpus() {
#if defined(__linux__) && defined(CPU_COUNT_S)
  // The mask may be wider than cpu_set_t (over 1024 CPUs): grow until it fits.
  for (int cpus = CPU_SETSIZE; cpus <= (1 << 20); cpus *= 2) {
    cpu_set_t* set = CPU_ALLOC(cpus);
    if (set == nullptr) break;
    const std::size_t bytes = CPU_ALLOC_SIZE(cpus);
    CPU_ZERO_S(bytes, set);
    const int status = sched_getaffinity(0, bytes, set);
    const int count = status == 0 ? CPU_COUNT_S(bytes, set) : 0;
    CPU_FREE(set);
    if (status == 0) {
      if (count > 0) return count;
      break;
    }
    if (errno != EINVAL) break;
  }
#endif
  const unsigned hardware = std::thread::hardware_concurrency();
  return hardware > 0 ? static_cast<int>(hardware) : 1;
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

  // The workers sleep now instead of spinning for the next job: the caller is
  // about to hand the cores to someone else's threads (a GEMM provider that
  // parallelises itself) for longer than a spin is worth.
  void rest() { resting_.store(true, std::memory_order_relaxed); }

  // Calls body(begin, end, part) on the grains [k * grain, (k + 1) * grain)
  // of [0, count), each on whichever thread takes it; part in [0, size())
  // names that thread (for per-thread scratch). Returns when all are done;
  // if a grain threw, rethrows the first exception once all threads are out.
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
      resting_.store(false, std::memory_order_relaxed);
      failed_.store(false, std::memory_order_relaxed);
      error_ = nullptr;
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
    // Every worker has counted itself out (acquire above): error_ is settled.
    if (failed_.load(std::memory_order_relaxed)) std::rethrow_exception(std::exchange(error_, nullptr));
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

  // Takes grains until none are left or one has thrown (on any thread).
  void take_grains(const job& work, int part) noexcept {
    try {
      while (!failed_.load(std::memory_order_relaxed)) {
        const std::int64_t begin = next_grain_.fetch_add(1, std::memory_order_relaxed) * work.grain;
        if (begin >= work.count) return;
        work.call(work.body, begin, begin + work.grain < work.count ? begin + work.grain : work.count, part);
      }
    } catch (...) {
      // The first failure is kept; it is read after this thread's release of pending_ (or on this thread).
      if (!failed_.exchange(true, std::memory_order_relaxed)) error_ = std::current_exception();
    }
  }

  void work(int index) {
    std::uint64_t seen = 0;
    for (;;) {
      const auto new_job = [&] { return generation_.load(std::memory_order_acquire) != seen; };
      if (!spin_until([&] { return new_job() || resting_.load(std::memory_order_relaxed); }) || !new_job()) {
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
  std::atomic<bool> resting_{false};  // rest(): sleep until the next job rather than spin
  std::atomic<bool> failed_{false};  // a grain of the current job threw
  std::exception_ptr error_;         // the first exception of the current job
  bool stopping_ = false;  // written under mutex_ before the last generation bump
};

}  // namespace detail
LCE_END_NAMESPACE
