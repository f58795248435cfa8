// The host backend itself: the thread pool's exceptions, the default thread
// count (the CPU affinity mask), the per-call BLAS scope, and the GEMM tiling
// (every thread gets dX tiles, a 2-byte weight is widened into one block
// sized from the shapes, results bitwise identical across thread counts).
#include "support/harness.hpp"

#include <lce/host/detail/thread_pool.hpp>

#include <cblas.h>
#include <dlfcn.h>
#include <sched.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

using namespace lce_test;

// ---------------------------------------------------------------------------
// Two BLAS entry points, interposed for this binary: they forward to the
// library (next definition in the lookup order) and, while asked to, record
// what lce asked for. Nothing else changes for the other tests.
// ---------------------------------------------------------------------------
namespace {

struct gemm_call {
  int m, n, k;
  const float* b;
};

std::atomic<bool> recording{false};
std::mutex recorded_mutex;
std::vector<gemm_call> recorded_gemms;
std::atomic<int> set_threads_calls{0};

template <class Function>
Function next_definition(const char* name) {
  auto* function = reinterpret_cast<Function>(dlsym(RTLD_NEXT, name));
  if (function == nullptr) std::abort();
  return function;
}

struct record_scope {
  record_scope() {
    std::lock_guard lock(recorded_mutex);
    recorded_gemms.clear();
    set_threads_calls = 0;
    recording = true;
  }
  ~record_scope() { recording = false; }
  std::vector<gemm_call> gemms() const {
    std::lock_guard lock(recorded_mutex);
    return recorded_gemms;
  }
};

}  // namespace

extern "C" void cblas_sgemm(OPENBLAS_CONST enum CBLAS_ORDER order, OPENBLAS_CONST enum CBLAS_TRANSPOSE trans_a,
                            OPENBLAS_CONST enum CBLAS_TRANSPOSE trans_b, OPENBLAS_CONST blasint m,
                            OPENBLAS_CONST blasint n, OPENBLAS_CONST blasint k, OPENBLAS_CONST float alpha,
                            OPENBLAS_CONST float* a, OPENBLAS_CONST blasint lda, OPENBLAS_CONST float* b,
                            OPENBLAS_CONST blasint ldb, OPENBLAS_CONST float beta, float* c,
                            OPENBLAS_CONST blasint ldc) {
  using function = void (*)(CBLAS_ORDER, CBLAS_TRANSPOSE, CBLAS_TRANSPOSE, blasint, blasint, blasint, float,
                            const float*, blasint, const float*, blasint, float, float*, blasint);
  static const auto next = next_definition<function>("cblas_sgemm");
  if (recording) {
    std::lock_guard lock(recorded_mutex);
    recorded_gemms.push_back({static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), b});
  }
  next(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

extern "C" void openblas_set_num_threads(int threads) {
  static const auto next = next_definition<void (*)(int)>("openblas_set_num_threads");
  if (recording) ++set_threads_calls;
  next(threads);
}

namespace {

struct blas_threads_guard {
  int saved = openblas_get_num_threads();
  ~blas_threads_guard() { openblas_set_num_threads(saved); }
};

template <class Done>
bool wait_for(Done&& done, std::chrono::seconds limit = std::chrono::seconds(30)) {
  const auto start = std::chrono::steady_clock::now();
  while (!done()) {
    if (std::chrono::steady_clock::now() - start > limit) return false;
    std::this_thread::yield();
  }
  return true;
}

// Sum of [0, count) through the pool: checks it still works.
std::int64_t pool_sum(lce::detail::thread_pool& pool, std::int64_t count) {
  std::atomic<std::int64_t> sum{0};
  pool.parallel_for(count, 3, [&](std::int64_t begin, std::int64_t end, int) {
    std::int64_t s = 0;
    for (std::int64_t i = begin; i < end; ++i) s += i;
    sum += s;
  });
  return sum;
}

// A [rows, cols] matrix of values exactly representable in E, as doubles and as E.
template <class E>
struct test_matrix {
  std::int64_t rows, cols;
  std::vector<double> values;
  std::vector<E> data;
  test_matrix(std::int64_t r, std::int64_t c, std::uint64_t seed, double scale)
      : rows(r), cols(c), values(random_vector(r * c, seed, -scale, scale, rounder_for<E>())) {
    for (double v : values) data.push_back(to_elem<E>(v));
  }
  lce::matrix_view<const E> view() const { return {data.data(), rows, cols, cols}; }
};

// max |got - a b| over the elements, relative to the largest |a b|.
double product_error(const std::vector<float>& got, const std::vector<double>& a, const std::vector<double>& b,
                     std::int64_t m, std::int64_t k, std::int64_t n, bool b_transposed) {
  double worst = 0, largest = 0;
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      double want = 0;
      for (std::int64_t l = 0; l < k; ++l) want += a[i * k + l] * (b_transposed ? b[j * k + l] : b[l * n + j]);
      worst = std::max(worst, std::fabs(double(got[i * n + j]) - want));
      largest = std::max(largest, std::fabs(want));
    }
  return worst / std::max(largest, 1e-30);
}

}  // namespace

// ---- thread pool -----------------------------------------------------------

TEST_CASE("thread_pool: an exception thrown in a worker's grain reaches the caller, the pool stays usable") {
  for (int threads : {2, 3, 4}) {
    CAPTURE(threads);
    lce::detail::thread_pool pool(threads);
    for (int rep = 0; rep < 100; ++rep) {
      std::atomic<bool> worker_in{false};
      std::atomic<int> running{0};
      bool caught = false;
      try {
        pool.parallel_for(64, 1, [&](std::int64_t, std::int64_t, int part) {
          ++running;
          if (part != 0) {
            worker_in = true;
            --running;
            throw std::runtime_error("from a worker");
          }
          // The caller holds its grain until a worker has one, so a worker throws.
          wait_for([&] { return worker_in.load(); });
          --running;
        });
      } catch (const std::runtime_error& e) {
        caught = std::string(e.what()) == "from a worker";
      }
      REQUIRE(caught);
      CHECK(running == 0);
      if (rep % 50 == 0) CHECK(pool_sum(pool, 1000) == 999 * 1000 / 2);
    }
    CHECK(pool_sum(pool, 100000) == std::int64_t{99999} * 100000 / 2);
  }
}

TEST_CASE("thread_pool: an exception thrown on the caller waits for the workers, then reaches the caller") {
  for (int threads : {2, 3, 4}) {
    CAPTURE(threads);
    lce::detail::thread_pool pool(threads);
    for (int rep = 0; rep < 100; ++rep) {
      std::atomic<bool> worker_in{false}, caller_in{false};
      std::atomic<int> running{0};
      std::vector<int> touched(256, 0);  // the body's state: must not be used after parallel_for returns
      bool caught = false;
      try {
        pool.parallel_for(256, 1, [&](std::int64_t begin, std::int64_t, int part) {
          ++running;
          if (part == 0) {
            caller_in = true;
            wait_for([&] { return worker_in.load(); });
            --running;
            throw std::logic_error("from the caller");
          }
          worker_in = true;
          // Workers hold their grains until the caller has one (it may start late on a busy machine).
          wait_for([&] { return caller_in.load(); });
          for (int spin = 0; spin < 2000; ++spin) lce::detail::spin_pause();
          ++touched[static_cast<std::size_t>(begin)];
          --running;
        });
      } catch (const std::logic_error& e) {
        caught = std::string(e.what()) == "from the caller";
      }
      REQUIRE(caught);
      CHECK(running == 0);
    }
    CHECK(pool_sum(pool, 100000) == std::int64_t{99999} * 100000 / 2);
  }
}

TEST_CASE("thread_pool: after a failure no further grains are handed out; the first exception wins") {
  lce::detail::thread_pool pool(3);
  std::atomic<std::int64_t> started{0};
  const std::int64_t count = 4000;
  bool caught = false;
  try {
    pool.parallel_for(count, 1, [&](std::int64_t begin, std::int64_t, int) {
      ++started;
      if (begin == 5) throw std::runtime_error("grain 5");
      std::this_thread::sleep_for(std::chrono::microseconds(500));
    });
  } catch (const std::runtime_error& e) {
    caught = std::string(e.what()) == "grain 5";
  }
  CHECK(caught);
  CHECK(started < count / 2);  // 4000 grains of 0.5 ms each would take a second per thread

  // Several grains throwing, on every thread, many times over: one exception comes back each time.
  for (int threads : {2, 3, 4}) {
    lce::detail::thread_pool many(threads);
    for (int rep = 0; rep < 100; ++rep) {
      int thrown = 0;
      try {
        many.parallel_for(40, 1 + rep % 3, [&](std::int64_t begin, std::int64_t, int) {
          if ((begin + rep) % 7 == 0) throw begin;
        });
      } catch (std::int64_t grain) {
        thrown = 1;
        CHECK((grain + rep) % 7 == 0);
      }
      CHECK(thrown == 1);
    }
    CHECK(pool_sum(many, 12345) == std::int64_t{12344} * 12345 / 2);
  }
}

// ---- default thread count --------------------------------------------------

TEST_CASE("host{} takes its thread count from the CPU affinity mask") {
  cpu_set_t mine;
  CPU_ZERO(&mine);
  REQUIRE(sched_getaffinity(0, sizeof mine, &mine) == 0);
  CHECK(lce::host{}.threads() == CPU_COUNT(&mine));

  // A thread bound to one CPU (as under `taskset -c 0` or an MPI rank bound to a core).
  int first = 0;
  while (!CPU_ISSET(first, &mine)) ++first;
  bool bound = false;
  int threads = 0, explicit_threads = 0;
  std::thread probe([&] {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(first, &one);
    bound = sched_setaffinity(0, sizeof one, &one) == 0;
    threads = lce::host{}.threads();
    explicit_threads = lce::host{3}.threads();
  });
  probe.join();
  REQUIRE(bound);
  CHECK(threads == 1);
  CHECK(explicit_threads == 3);
}

// ---- per-call BLAS scope ---------------------------------------------------

TEST_CASE("host::call_scope: one BLAS setting per call, none per GEMM; nested and concurrent scopes share it") {
  blas_threads_guard guard;
  openblas_set_num_threads(2);
  lce::host backend{2};
  const test_matrix<float> x(96, 64, 1, 1.0), w(300, 64, 2, 0.2);
  std::vector<float> z(96 * 300), dx(96 * 64), dw(300 * 64, 0.0f);
  const lce::matrix_view<float> Z{z.data(), 96, 300, 300}, DX{dx.data(), 96, 64, 64}, DW{dw.data(), 300, 64, 64};
  {
    auto scope = backend.begin_call();
    CHECK(openblas_get_num_threads() == 1);
    record_scope record;
    for (int i = 0; i < 3; ++i) {
      backend.logits(x.view(), w.view(), 1.0f, Z, nullptr);
      backend.grad_hidden(lce::matrix_view<const float>(Z), w.view(), 1.0f, DX, nullptr);
      backend.grad_weight(lce::matrix_view<const float>(Z), x.view(), 1.0f, DW);
    }
    CHECK(set_threads_calls == 0);
    CHECK(openblas_get_num_threads() == 1);
    {
      auto nested = backend.begin_call();
      CHECK(set_threads_calls == 0);
    }
    CHECK(openblas_get_num_threads() == 1);
  }
  CHECK(openblas_get_num_threads() == 2);

  // Overlapping scopes on two threads: the setting comes back when the last one ends.
  std::atomic<int> phase{0};
  std::thread other([&] {
    lce::host mine{1};
    auto scope = mine.begin_call();
    phase = 1;
    wait_for([&] { return phase.load() == 2; });
  });
  wait_for([&] { return phase.load() == 1; });
  {
    auto scope = backend.begin_call();
    CHECK(openblas_get_num_threads() == 1);
  }
  CHECK(openblas_get_num_threads() == 1);  // the other thread's call is still running
  phase = 2;
  other.join();
  CHECK(openblas_get_num_threads() == 2);

  // Without a call scope each GEMM still runs the BLAS single-threaded (and puts the setting back).
  {
    record_scope record;
    backend.grad_hidden(lce::matrix_view<const float>(Z), w.view(), 1.0f, DX, nullptr);
    CHECK(set_threads_calls == 2);
  }
  CHECK(openblas_get_num_threads() == 2);
}

TEST_CASE("an operator call sets the BLAS threads once per call, not around every GEMM") {
  blas_threads_guard guard;
  openblas_set_num_threads(2);
  problem p = make_problem(64, 32, 300, 99, rounder_for<float>(), 1.0, 0.5, 0.1);
  const auto g = random_vector(p.n, 1, -1.0, 1.0, rounder_for<float>());
  const auto hg = random_vector(p.n, 2, -0.5, 0.5, rounder_for<float>());
  const auto pre = random_vector(p.v * p.h, 3, -1.0, 1.0, rounder_for<float>());
  auto op = make_op<float>(make_options(1.0f, 0.0f, 16), 2);  // 4 chunks, 28 GEMMs over the 3 calls
  record_scope record;
  exercise<float, float>(op, p, g, hg, pre);
  CHECK(set_threads_calls == 3 * 2);  // forward, backward, forward_backward: set 1, then put 2 back
  CHECK(record.gemms().size() >= 28);
  CHECK(openblas_get_num_threads() == 2);
}

// ---- GEMM tiling -----------------------------------------------------------

TEST_CASE("grad_hidden: dX is cut into tiles (from the shapes alone) for every thread") {
  const std::int64_t rows = 512, vocab = 200, hidden = 1024;
  const test_matrix<float> dz(rows, vocab, 11, 1.0), w(vocab, hidden, 12, 1.0);
  std::vector<float> reference;
  std::size_t tiles = 0;
  for (int threads : {1, 2, 3, 4}) {
    CAPTURE(threads);
    lce::host backend{threads};
    std::vector<float> dx(static_cast<std::size_t>(rows * hidden), -1.0f);
    std::vector<gemm_call> calls;
    {
      record_scope record;
      backend.grad_hidden(dz.view(), w.view(), 0.5f, lce::matrix_view<float>{dx.data(), rows, hidden, hidden}, nullptr);
      calls = record.gemms();
    }
    CHECK(calls.size() >= 4);  // enough for 4 threads (it was 2: halves of the rows)
    std::int64_t area = 0;
    for (const auto& c : calls) area += std::int64_t{c.m} * c.n;
    CHECK(area == rows * hidden);  // the tiles cover dX once
    if (threads == 1) {
      tiles = calls.size();
      reference = dx;
      std::vector<float> twice(dx.size());
      for (std::size_t i = 0; i < dx.size(); ++i) twice[i] = 2.0f * dx[i];
      CHECK(product_error(twice, dz.values, w.values, rows, vocab, hidden, false) < 1e-5);
    } else {
      CHECK(calls.size() == tiles);
      CHECK(std::memcmp(dx.data(), reference.data(), dx.size() * sizeof(float)) == 0);
    }
  }
}

// The engine's first touch of grad_weight's bytes that will hold kept logits
// (core/backend.hpp: touches_pages): a zero into every page the range
// reaches, from its first byte on, and nothing outside it, whatever the
// threads and however the range sits on the pages.
TEST_CASE("touch_pages: a zero byte into every page of the range, nothing outside it") {
  constexpr std::size_t page = 4096, size = 40 * page;
  const std::size_t starts[] = {0, 1, 100, page - 1, page};
  const std::size_t lengths[] = {1, 63, page, page + 1, 17 * page + 5, 30 * page};
  for (int threads : {1, 2, 3}) {
    lce::host backend{threads};
    for (const std::size_t start : starts)
      for (const std::size_t length : lengths) {
        CAPTURE(threads);
        CAPTURE(start);
        CAPTURE(length);
        std::vector<unsigned char> memory(size + page, 0xAB);
        // The buffer's own page boundaries, so that the pages are known.
        auto* const base = reinterpret_cast<unsigned char*>(
            (reinterpret_cast<std::uintptr_t>(memory.data()) + page - 1) / page * page);
        unsigned char* const first = base + start;
        backend.touch_pages(first, length);
        std::size_t outside = 0, missed = 0;
        for (std::size_t i = 0; i < size; ++i) {
          const bool in_range = i >= start && i < start + length;
          const bool page_start = i == start || (in_range && i % page == 0);
          if (!in_range) outside += base[i] != 0xAB;
          else if (page_start) missed += base[i] != 0;
          else outside += base[i] != 0xAB;
        }
        CHECK(outside == 0);
        CHECK(missed == 0);
      }
  }
}

TEST_CASE_TEMPLATE("2-byte weight: widened once per vocabulary tile into one block sized from the shapes", T,
                   lce::bfloat16, lce::float16) {
  const std::int64_t rows = 192, vocab = 3100, hidden = 256;
  CHECK(lce::host{1}.weight_block_elements<T>(hidden, vocab) == lce::host{3}.weight_block_elements<T>(hidden, vocab));
  CHECK(lce::host{1}.weight_block_elements<float>(hidden, vocab) == 0);
  const test_matrix<T> w(vocab, hidden, 21, 0.1);
  const test_matrix<float> x(rows, hidden, 22, 1.0), dz(rows, vocab, 23, 1.0);
  std::vector<float> z_first, dx_first;
  for (int threads : {1, 2, 3}) {
    CAPTURE(threads);
    lce::host backend{threads};
    const std::int64_t elements = backend.weight_block_elements<T>(hidden, vocab);
    REQUIRE(elements >= hidden);
    std::vector<float> block(static_cast<std::size_t>(elements));
    std::vector<float> z(static_cast<std::size_t>(rows * vocab)), dx(static_cast<std::size_t>(rows * hidden));
    std::vector<gemm_call> calls;
    {
      record_scope record;
      backend.logits(x.view(), w.view(), 1.0f, lce::matrix_view<float>{z.data(), rows, vocab, vocab}, block.data());
      backend.grad_hidden(dz.view(), w.view(), 1.0f, lce::matrix_view<float>{dx.data(), rows, hidden, hidden},
                          block.data());
      calls = record.gemms();
    }
    // Every GEMM reads its weight rows from inside the one block.
    for (const auto& c : calls) {
      CHECK(c.b >= block.data());
      CHECK(c.b < block.data() + elements);
    }
    if (threads == 1) {
      CHECK(product_error(z, x.values, w.values, rows, hidden, vocab, true) < 1e-5);
      CHECK(product_error(dx, dz.values, w.values, rows, vocab, hidden, false) < 1e-5);
      z_first = z;
      dx_first = dx;
    } else {
      CHECK(std::memcmp(z.data(), z_first.data(), z.size() * sizeof(float)) == 0);
      CHECK(std::memcmp(dx.data(), dx_first.data(), dx.size() * sizeof(float)) == 0);
    }
  }
}

TEST_CASE_TEMPLATE("dX tiles and widened weight tiles: bitwise identical for 1, 2, 3 threads (V = 3000)", T, float,
                   lce::bfloat16) {
  using O = out_t<T>;
  blas_threads_guard guard;
  // H = 512: two 256-column pieces of dX per chunk (tiles are at least 256 x 256).
  problem p = make_problem(410, 512, 3000, 777, rounder_for<T>(), 1.0, 0.1, 0.1);
  const auto g = random_vector(p.n, 5, -1.0, 1.0, rounder_for<O>());
  const auto hg = random_vector(p.n, 6, -0.5, 0.5, rounder_for<O>());
  const auto pre = random_vector(p.v * p.h, 7, -1.0, 1.0, rounder_for<float>());
  // chunk 0: the budget policy under a limit that binds (3 chunks of 137 tokens; bf16: 2 of 205)
  for (std::int64_t chunk : {std::int64_t{200}, std::int64_t{260}, std::int64_t{0}}) {
    CAPTURE(chunk);
    auto opt = make_options(1.0f, 0.0f, chunk);
    if (chunk == 0) opt.workspace_limit_bytes = std::size_t{5} << 20;
    openblas_set_num_threads(2);
    auto base_op = make_op<T>(opt, 1);
    if (chunk == 0) CHECK((base_op.chunk_tokens(p.n, p.h, p.v) >= 100 && base_op.chunk_tokens(p.n, p.h, p.v) < p.n));
    const auto base = exercise<T, float>(base_op, p, g, hg, pre);
    for (int threads : {2, 3}) {
      CAPTURE(threads);
      auto op = make_op<T>(opt, threads);
      CHECK(op.chunk_tokens(p.n, p.h, p.v) == base_op.chunk_tokens(p.n, p.h, p.v));
      std::vector<gemm_call> calls;
      const auto diff = [&] {
        record_scope record;
        auto d = exercise<T, float>(op, p, g, hg, pre).bitwise_diff(base);
        calls = record.gemms();
        return d;
      }();
      CHECK_MESSAGE(diff.empty(), "host{" << threads << "} vs host{1}: " << diff);
      // The comparison means something only where dX is cut into pieces (bf16's
      // logits and dX GEMMs may run on oneDNN, which this does not record).
      if constexpr (std::is_same_v<T, float>)
        CHECK(std::ranges::any_of(calls, [&](const gemm_call& c) { return 2 * c.n <= p.h; }));
    }
  }
}

// A problem with a grad_weight of another type than the compute type (T's
// own for a 2-byte T, float for double), its row gradients and prefill, and
// what the fp32 (double) [V, H] accumulator of its dW would hold.
template <class T>
struct narrow_gradient_case {
  using G = std::conditional_t<std::is_same_v<T, double>, float, T>;
  using O = out_t<T>;
  problem p;
  std::vector<double> g, hg, pre;
  std::size_t accumulator;

  narrow_gradient_case(std::int64_t n, std::int64_t h, std::int64_t v, std::uint64_t seed)
      : p(make_problem(n, h, v, seed, rounder_for<T>(), 1.0, 0.1, 0.1)),
        g(random_vector(p.n, seed + 1, -1.0, 1.0, rounder_for<O>())),
        hg(random_vector(p.n, seed + 2, -0.5, 0.5, rounder_for<O>())),
        pre(random_vector(p.v * p.h, seed + 3, -1.0, 1.0, rounder_for<G>())),
        accumulator(static_cast<std::size_t>(p.v * p.h) * sizeof(lce::compute_t<T>)) {}

  // What a forward alone holds: the sweep's buffer, nothing for dW.
  std::size_t forward_held_bytes(const lce::options& opt) const {
    auto op = make_op<T>(opt, 3);
    const auto X = make_matrix<T>(p.x, p.n, p.h);
    const auto W = make_matrix<T>(p.w, p.v, p.h);
    const auto Y = make_targets<std::int64_t>(p.y);
    vector_buf<O> lp(p.n), lse(p.n);
    op.forward(X.cview(), W.cview(), Y.cview(), lp.view(), lse.view());
    return op.held_workspace_bytes();
  }
};

// A call whose tokens fit in one chunk (one rank) sums each vocabulary tile
// of dW in a per-thread scratch and adds it straight into a grad_weight of
// another element type than the compute type: no [V_local, H] accumulator.
// Against the long double reference (onto a prefill: += semantics), over a
// shard of 16 tiles with a ragged last one; bitwise the same for 1 and 3
// threads; and the workspace: below the accumulator alone, where a call of
// several chunks still holds one. The chunk of all 40 tokens is fixed: under
// the budget alone, a shard this wide would take the vocabulary order.
TEST_CASE_TEMPLATE("one-chunk calls add dW tiles straight into a narrower grad_weight: no V x H accumulator", T,
                   lce::bfloat16, lce::float16, double) {
  using G = typename narrow_gradient_case<T>::G;
  const narrow_gradient_case<T> c(40, 32, 10001, 31);
  const auto& [p, g, hg, pre, accumulator] = c;
  const auto sweep_bytes = [&](const lce::options& opt) { return c.forward_held_bytes(opt); };
  const lce::options whole = make_options(1.0f, 0.0f, p.n);

  auto one_chunk = make_op<T>(whole, 3);
  REQUIRE(one_chunk.chunk_tokens(p.n, p.h, p.v) >= p.n);
  const auto tiled = exercise<T, G>(one_chunk, p, g, hg, pre);
  check_against_reference(tiled, p, g, hg, pre);
  const std::size_t one_chunk_sweep = sweep_bytes(whole);
  // lce's own bf16 kernel rounds a bf16 grad_weight's tiles into it itself: no fp32 tiles then.
  if (std::same_as<T, lce::bfloat16> && lce::cblas_gemm{}.gemm_into_bf16_available())
    CHECK(one_chunk.held_workspace_bytes() == one_chunk_sweep);
  else
    CHECK(one_chunk.held_workspace_bytes() > one_chunk_sweep);
  CHECK(one_chunk.held_workspace_bytes() - one_chunk_sweep < accumulator / 4);
  CHECK(one_chunk.workspace_bytes(p.n, p.h, p.v) == one_chunk.held_workspace_bytes());

  auto one_thread = make_op<T>(whole, 1);
  const auto diff = exercise<T, G>(one_thread, p, g, hg, pre).bitwise_diff(tiled);
  CHECK_MESSAGE(diff.empty(), "host{1} vs host{3}: " << diff);

  auto chunked = make_op<T>(make_options(1.0f, 0.0f, 7), 3);
  const auto accumulated = exercise<T, G>(chunked, p, g, hg, pre);
  check_against_reference(accumulated, p, g, hg, pre);
  CHECK(chunked.held_workspace_bytes() - sweep_bytes(make_options(1.0f, 0.0f, 7)) >= accumulator);
  CHECK(chunked.workspace_bytes(p.n, p.h, p.v) == chunked.held_workspace_bytes());
}

// A provider that never rounds dW into a bf16 grad_weight itself: the host then sums each
// tile in fp32 scratch and adds it in a pass of its own.
struct cblas_gemm_without_rounding_into : lce::cblas_gemm {
  bool gemm_into_bf16_available() const { return false; }
};

// On lce's own bf16 kernel, a bf16 grad_weight's dW tiles are rounded into it as their sums
// are done (no scratch): bit for bit what the fp32 tiles added in give, in the token order (one
// chunk) and the vocabulary order (the budget alone), on 1 and 3 threads; and the workspace
// is smaller by the tiles.
TEST_CASE("a bf16 grad_weight: dW tiles rounded in by lce's bf16 kernel equal fp32 tiles added in, bit for bit") {
  if (!lce::cblas_gemm{}.gemm_into_bf16_available()) {
    MESSAGE("skipped: no AMX or AVX512-BF16 on this CPU (or OS), so no provider rounds into grad_weight here");
    return;
  }
  using T = lce::bfloat16;
  using scratch_host = lce::basic_host<cblas_gemm_without_rounding_into>;
  const narrow_gradient_case<T> c(300, 64, 5000, 41);
  const auto& [p, g, hg, pre, accumulator] = c;
  for (const std::int64_t chunk : {p.n, std::int64_t{0}}) {
    CAPTURE(chunk);
    const lce::options opt = make_options(1.0f, 0.0f, chunk);
    for (const int threads : {1, 3}) {
      CAPTURE(threads);
      auto rounded_in = make_op<T>(opt, threads);
      lce::ChunkedHiddenToLogprobs<lce::comm::single, T, lce::budget_chunk, scratch_host> added_in(
          lce::comm::single{}, opt, scratch_host(threads));
      const auto direct = exercise<T, T>(rounded_in, p, g, hg, pre);
      check_against_reference(direct, p, g, hg, pre);
      const auto diff = exercise<T, T>(added_in, p, g, hg, pre).bitwise_diff(direct);
      CHECK_MESSAGE(diff.empty(), "rounded in vs added in: " << diff);
      CHECK(rounded_in.workspace_bytes(p.n, p.h, p.v) < added_in.workspace_bytes(p.n, p.h, p.v));
    }
  }
}

// The host's float -> bf16 spans (dz's rounding, a 2-byte grad_weight's sums)
// run a SIMD pack at a time: bit for bit the scalar rounding of
// core/dtypes.hpp, at every length (whole packs and the tail), for ties,
// NaNs (signalling ones made quiet), infinities, overflow to infinity,
// signed zeros and subnormals.
TEST_CASE("convert_span / add_span / split_to_bf16 float -> bf16: the scalar rounding's bits, specials included") {
  std::vector<std::uint32_t> patterns = {0x00000000u, 0x80000000u, 0x3f808000u, 0x3f818000u, 0x3f80ffffu, 0x7f800000u,
                                         0xff800000u, 0x7f7fffffu, 0xff7fffffu, 0x7f800001u, 0x7fc00000u, 0xffbfffffu,
                                         0x00000001u, 0x807fffffu, 0x00400000u, 0x3f7fffffu, 0x477fff00u};
  std::uint32_t state = 12345u;
  while (patterns.size() < 203) {
    state = state * 1664525u + 1013904223u;
    patterns.push_back(state);
  }
  const auto as_float = [](std::uint32_t bits) {
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  };
  std::vector<float> source;
  for (auto bits : patterns) source.push_back(as_float(bits));
  const auto bits_of = [](lce::bfloat16 b) {
    std::uint16_t raw;
    std::memcpy(&raw, &b, sizeof raw);
    return raw;
  };
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{15}, std::size_t{16}, std::size_t{17},
                        std::size_t{64}, source.size()}) {
    CAPTURE(n);
    std::vector<lce::bfloat16> rounded(n);
    lce::detail::convert_span(source.data(), rounded.data(), static_cast<std::int64_t>(n));
    std::vector<lce::bfloat16> sums(n);
    for (std::size_t j = 0; j < n; ++j) sums[j] = lce::bfloat16(source[(j * 7 + 3) % source.size()]);
    std::vector<lce::bfloat16> before = sums;
    lce::detail::add_span(source.data(), sums.data(), static_cast<std::int64_t>(n));
    std::vector<lce::bfloat16> hi(n), lo(n);
    lce::detail::split_to_bf16(source.data(), hi.data(), lo.data(), static_cast<std::int64_t>(n));
    for (std::size_t j = 0; j < n; ++j) {
      CAPTURE(j);
      CHECK(bits_of(rounded[j]) == bits_of(lce::bfloat16(source[j])));
      CHECK(bits_of(sums[j]) == bits_of(lce::bfloat16(static_cast<float>(before[j]) + source[j])));
      // dz's split: hi = bf16(x), lo = bf16(x - hi), lo = 0 where hi is infinite or NaN.
      const float high = static_cast<float>(lce::bfloat16(source[j]));
      CHECK(bits_of(hi[j]) == bits_of(lce::bfloat16(source[j])));
      CHECK(bits_of(lo[j]) == bits_of(lce::bfloat16(std::isfinite(high) ? source[j] - high : 0.0f)));
    }
  }
}

// Under the budget policy, a call whose budget chunk is below its token
// count would hold the [V, H] accumulator on top of that chunk; when all its
// tokens in one chunk (with the dW tiles) hold less, it takes one chunk.
// A chunk the user fixed is kept (and so is the accumulator then).
TEST_CASE_TEMPLATE("narrow grad_weight: one chunk instead of several plus the accumulator when that holds less", T,
                   lce::bfloat16, double) {
  using G = typename narrow_gradient_case<T>::G;
  const narrow_gradient_case<T> c(64, 256, 3000, 41);
  const auto& [p, g, hg, pre, accumulator] = c;

  // A budget whose chunk is about half the tokens.
  lce::options budget;
  std::int64_t chunk = 0;
  for (std::size_t limit = std::size_t{1} << 16; limit < (std::size_t{64} << 20); limit += std::size_t{1} << 14) {
    budget.workspace_limit_bytes = limit;
    chunk = make_op<T>(budget, 2).chunk_tokens(p.n, p.h, p.v);
    if (chunk >= p.n / 2) break;
  }
  REQUIRE(chunk >= p.n / 2);
  REQUIRE(chunk < p.n);

  const std::size_t budget_sweep = c.forward_held_bytes(budget);

  auto op = make_op<T>(budget, 2);
  const auto o = exercise<T, G>(op, p, g, hg, pre);
  check_against_reference(o, p, g, hg, pre);
  CHECK(op.held_workspace_bytes() == op.workspace_bytes(p.n, p.h, p.v));
  CHECK(op.held_workspace_bytes() < budget_sweep + accumulator);

  lce::options fixed = budget;
  fixed.chunk_tokens = chunk;
  auto fixed_op = make_op<T>(fixed, 2);
  check_against_reference(exercise<T, G>(fixed_op, p, g, hg, pre), p, g, hg, pre);
  CHECK(fixed_op.held_workspace_bytes() >= budget_sweep + accumulator);
  CHECK(fixed_op.workspace_bytes(p.n, p.h, p.v) == fixed_op.held_workspace_bytes());
}

// ---------------------------------------------------------------------------
// Large scratch blocks ask for transparent huge pages (host/detail/huge_pages.hpp):
// a fresh block per call otherwise costs one page fault per 4 KiB.
// ---------------------------------------------------------------------------
namespace {

std::string transparent_huge_pages_mode() {
  std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string line;
  std::getline(f, line);
  const auto open = line.find('['), close = line.find(']');
  return open == std::string::npos || close == std::string::npos ? "" : line.substr(open + 1, close - open - 1);
}

// AnonHugePages (bytes) of the mappings that overlap [begin, end), from /proc/self/smaps.
std::size_t anon_huge_page_bytes(std::uintptr_t begin, std::uintptr_t end) {
  std::ifstream f("/proc/self/smaps");
  std::string line;
  bool inside = false;
  std::size_t total = 0;
  while (std::getline(f, line)) {
    unsigned long lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2 && line.find(':') > line.find(' ')) {
      inside = lo < end && hi > begin;
    } else if (inside && line.rfind("AnonHugePages:", 0) == 0) {
      total += std::stoul(line.substr(14)) * 1024;
    }
  }
  return total;
}

}  // namespace

TEST_CASE("host::allocate: a large block is backed by transparent huge pages where the kernel offers them") {
  const std::string mode = transparent_huge_pages_mode();
  if (mode != "madvise" && mode != "always") {
    MESSAGE("transparent huge pages are '" << mode << "' here: nothing to check");
    return;
  }
  lce::host backend{1};
  const std::size_t bytes = std::size_t{64} << 20;
  // The kernel may lack free 2 MiB pages at that moment (other tests run beside this one under
  // ctest -j): three tries, a second apart, each beside a control block mapped and advised here
  // by hand. At least half the block is expected wherever the control gets as much (64 MiB, 30
  // huge pages in the aligned interior).
  const auto huge_bytes_of = [&](unsigned char* block) {
    std::memset(block, 1, bytes);  // first touch: the faults that map the pages
    const auto begin = reinterpret_cast<std::uintptr_t>(block);
    return anon_huge_page_bytes(begin, begin + bytes);
  };
  std::size_t huge = 0, control = 0;
  for (int attempt = 0; attempt < 3 && huge < bytes / 2; ++attempt) {
    if (attempt > 0) std::this_thread::sleep_for(std::chrono::seconds(1));
    auto* block = static_cast<unsigned char*>(backend.allocate(bytes));
    huge = huge_bytes_of(block);
    backend.deallocate(block, bytes);
    void* advised = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    REQUIRE(advised != MAP_FAILED);
    madvise(advised, bytes, MADV_HUGEPAGE);
    control = huge_bytes_of(static_cast<unsigned char*>(advised));
    munmap(advised, bytes);
  }
  CAPTURE(mode);
  CAPTURE(control);
  if (huge < bytes / 2 && control < bytes / 2) {
    MESSAGE("the kernel gave no huge pages to an advised block of its own either (" << control
            << " bytes of 64 MiB): nothing to check now");
    return;
  }
  CHECK(huge >= bytes / 2);
}

TEST_CASE("host::allocate with scratch_pages::base: no huge-page advice (the pages the allocator gives)") {
  const std::string mode = transparent_huge_pages_mode();
  if (mode != "madvise") {
    MESSAGE("transparent huge pages are '" << mode << "' here: only 'madvise' tells advice from none");
    return;
  }
  lce::host backend{1, lce::scratch_pages::base};
  const std::size_t bytes = std::size_t{64} << 20;
  auto* block = static_cast<unsigned char*>(backend.allocate(bytes));
  std::memset(block, 1, bytes);
  const auto begin = reinterpret_cast<std::uintptr_t>(block);
  const std::size_t huge = anon_huge_page_bytes(begin, begin + bytes);
  backend.deallocate(block, bytes);
  CHECK(huge == 0);
}

// The vocabulary order's logits kept in 2 bytes (keeps_logit_ratios): each row
// comes back from its bf16 ratios and centre, checked here against the logits
// themselves in double: the row's largest exactly (its p may be near 1, where
// 1 - p would lose its digits), every logit whose ratio is normal within the
// bf16 rounding of exp(z - c) (2^-8 of p, so about 2^-8 in absolute terms), -inf as -inf, a row of -inf back as -inf (centre 0), a NaN as a NaN,
// and rows of every length around the SIMD width (the scalar tail).
TEST_CASE("host keep_logit_ratios / expand_logit_ratios: logits back within bf16's rounding of p, the largest exact") {
  lce::host backend{2};
  const float inf = std::numeric_limits<float>::infinity();
  for (const std::int64_t cols : {1, 15, 16, 17, 40, 1000}) {
    CAPTURE(cols);
    const std::int64_t rows = 5;
    std::vector<float> logits(static_cast<std::size_t>(rows * cols));
    std::uint64_t state = 12345u + static_cast<std::uint64_t>(cols);
    for (auto& z : logits) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      z = 40.0f * (static_cast<float>(state >> 40) / 16777216.0f) - 25.0f;  // [-25, 15): ratios from 1 to e^-40
    }
    const auto at = [&](std::int64_t r, std::int64_t j) -> float& { return logits[static_cast<std::size_t>(r * cols + j)]; };
    at(1, cols / 2) = -inf;                                  // a masked column
    for (std::int64_t j = 0; j < cols; ++j) at(2, j) = -inf;  // a row of -inf
    at(3, 0) = std::numeric_limits<float>::quiet_NaN();
    at(4, cols - 1) = 1.0e4f;  // one huge logit: every other ratio 0
    std::vector<lce::bfloat16> ratios(logits.size());
    std::vector<float> centres(static_cast<std::size_t>(rows)), back(logits.size(), 7.0f);
    backend.keep_logit_ratios(lce::matrix_view<const float>{logits.data(), rows, cols, cols},
                              lce::matrix_view<lce::bfloat16>{ratios.data(), rows, cols, cols}, centres.data());
    backend.expand_logit_ratios(lce::matrix_view<const lce::bfloat16>{ratios.data(), rows, cols, cols}, centres.data(),
                                lce::matrix_view<float>{back.data(), rows, cols, cols});
    for (const std::int64_t r : {0, 1, 4}) {
      CAPTURE(r);
      float largest = -inf;
      for (std::int64_t j = 0; j < cols; ++j) largest = std::max(largest, at(r, j));
      CHECK(centres[static_cast<std::size_t>(r)] == (largest == -inf ? 0.0f : largest));
      for (std::int64_t j = 0; j < cols; ++j) {
        CAPTURE(j);
        const float z = at(r, j), got = back[static_cast<std::size_t>(r * cols + j)];
        if (z == largest) {
          CHECK(got == z);
        } else if (z == -inf || z - largest < -87.0f) {
          CHECK(std::exp(static_cast<double>(got) - largest) < 1e-37);  // p as good as 0, as fp32's exp gives it
        } else {
          // |log(1 + e)| <= 2^-8 / (1 - 2^-8) for the ratio's rounding (half a bf16 ulp), plus fp32's
          // rounding of z itself.
          CHECK(std::fabs(static_cast<double>(got) - z) <= 1.0 / 255 + 4e-7 * std::fabs(z));
        }
      }
    }
    CHECK(centres[2] == 0.0f);
    for (std::int64_t j = 0; j < cols; ++j) CHECK(back[static_cast<std::size_t>(2 * cols + j)] == -inf);
    CHECK(std::isnan(back[static_cast<std::size_t>(3 * cols)]));
  }
}
