// The CUDA backend's host-side logic, compiled by the host compiler so it runs
// without nvcc or a GPU: the kernels' grid shapes
// (include/lce/cuda/detail/launch_shape.hpp, simulated with the kernels' own
// index math) and the workspace plan of a device-style backend (GEMM operand
// = T, dz in its own operand block, no widening stage).
#include "support/device_shaped_backend.hpp"
#include "support/harness.hpp"

#include <lce/cuda/detail/launch_shape.hpp>

#include <climits>
#include <cstdlib>
#include <new>
#include <vector>

using namespace lce_test;

namespace {

namespace launch = lce::detail::cuda_launch;

// Every (row, column) an elementwise kernel touches, counted, with the
// kernels' loop: block b takes tiles b, b + grid, ...; tile -> row
// tile / per_row, first column (tile % per_row) * tile_elements; thread t,
// item k -> column first + k * block_threads + t, when < cols.
std::vector<int> elementwise_visits(std::int64_t rows, std::int64_t cols, const launch::tiles& t,
                                    std::int64_t grid) {
  std::vector<int> visits(static_cast<std::size_t>(rows * cols), 0);
  for (std::int64_t block = 0; block < grid; ++block)
    for (std::int64_t tile = block; tile < t.count; tile += grid) {
      const std::int64_t r = tile / t.per_row;
      const std::int64_t first = (tile % t.per_row) * launch::tile_elements;
      REQUIRE(r < rows);
      for (int thread = 0; thread < t.launch.threads; ++thread)
        for (int k = 0; k < launch::items_per_thread; ++k) {
          const std::int64_t j = first + std::int64_t{k} * launch::block_threads + thread;
          if (j < cols) ++visits[static_cast<std::size_t>(r * cols + j)];
        }
    }
  return visits;
}

}  // namespace

TEST_CASE("cuda launch shapes: constants") {
  CHECK(launch::block_threads % 32 == 0);
  CHECK(launch::block_threads <= 1024);
  CHECK(launch::tile_elements == std::int64_t{launch::block_threads} * launch::items_per_thread);
  CHECK(launch::max_blocks == 2147483647);  // gridDim.x
}

TEST_CASE("cuda launch shapes: one block per row") {
  CHECK(launch::one_block_per_row(0).blocks == 0);
  CHECK(launch::one_block_per_row(-3).blocks == 0);
  CHECK(launch::one_block_per_row(1).blocks == 1);
  CHECK(launch::one_block_per_row(1000).blocks == 1000);
  CHECK(launch::one_block_per_row(1000).threads == launch::block_threads);
  // The row kernels take their row from blockIdx.x alone: every row needs its
  // own block. Rows reach the kernels through GEMMs of int extents
  // (cuda_backend::max_gemm_extent = INT_MAX, checked before any launch), so
  // the grid limit is never the one that binds...
  CHECK(launch::one_block_per_row(INT_MAX).blocks == INT_MAX);
  // ...and past it the shape stays a legal grid.
  CHECK(launch::one_block_per_row(std::int64_t{1} << 40).blocks == launch::max_blocks);
}

TEST_CASE("cuda launch shapes: one thread per item") {
  CHECK(launch::one_thread_per_item(0).blocks == 0);
  CHECK(launch::one_thread_per_item(-1).blocks == 0);
  CHECK(launch::one_thread_per_item(1).blocks == 1);
  CHECK(launch::one_thread_per_item(launch::block_threads).blocks == 1);
  CHECK(launch::one_thread_per_item(launch::block_threads + 1).blocks == 2);
  for (std::int64_t items : {std::int64_t{1}, std::int64_t{255}, std::int64_t{256}, std::int64_t{257},
                             std::int64_t{100000}, std::int64_t{INT_MAX}}) {
    CAPTURE(items);
    const auto s = launch::one_thread_per_item(items);
    CHECK(s.threads == launch::block_threads);
    CHECK(s.blocks <= launch::max_blocks);
    CHECK(s.blocks * s.threads >= items);                  // every item has a thread
    CHECK((s.blocks - 1) * s.threads < items);             // no block without one
  }
  CHECK(launch::one_thread_per_item(std::int64_t{1} << 50).blocks == launch::max_blocks);
}

TEST_CASE("cuda launch shapes: element tiles of an empty block launch nothing") {
  for (const auto& rc : {std::pair<std::int64_t, std::int64_t>{0, 0}, {0, 7}, {7, 0}, {-1, 5}, {5, -1}}) {
    CAPTURE(rc.first);
    CAPTURE(rc.second);
    const auto t = launch::element_tiles(rc.first, rc.second);
    CHECK(t.count == 0);
    CHECK(t.per_row == 0);
    CHECK(t.launch.blocks == 0);
  }
}

TEST_CASE("cuda launch shapes: element tiles cover every element exactly once") {
  const std::int64_t te = launch::tile_elements;
  for (std::int64_t rows : {std::int64_t{1}, std::int64_t{3}, std::int64_t{7}}) {
    for (std::int64_t cols : {std::int64_t{1}, std::int64_t{255}, std::int64_t{256}, std::int64_t{257}, te - 1, te,
                              te + 1, 3 * te + 17, std::int64_t{5000}}) {
      CAPTURE(rows);
      CAPTURE(cols);
      const auto t = launch::element_tiles(rows, cols);
      CHECK(t.per_row == (cols + te - 1) / te);
      CHECK(t.per_row * te >= cols);
      CHECK((t.per_row - 1) * te < cols);
      CHECK(t.count == rows * t.per_row);
      CHECK(t.launch.blocks == t.count);
      CHECK(t.launch.threads == launch::block_threads);
      // the launched grid, and smaller grids (the grid-stride loop past the grid limit)
      for (std::int64_t grid : {t.launch.blocks, std::int64_t{1}, std::int64_t{2}, std::int64_t{5}}) {
        CAPTURE(grid);
        const auto visits = elementwise_visits(rows, cols, t, std::min(grid, t.count));
        std::int64_t wrong = 0;
        for (int v : visits) wrong += v != 1;
        CHECK_MESSAGE(wrong == 0, wrong << " elements not visited exactly once");
      }
    }
  }
}

TEST_CASE("cuda launch shapes: element tiles past the grid limit") {
  // 3e9 rows of one tile each: more tiles than gridDim.x holds; the grid is
  // capped and the kernels stride over the rest.
  const std::int64_t rows = 3'000'000'000;
  const auto t = launch::element_tiles(rows, 10);
  CHECK(t.per_row == 1);
  CHECK(t.count == rows);
  CHECK(t.launch.blocks == launch::max_blocks);
  // rows x tiles beyond int64: the count saturates instead of wrapping
  const auto huge = launch::element_tiles(INT64_MAX / 2, 5 * launch::tile_elements);
  CHECK(huge.per_row == 5);
  CHECK(huge.count == INT64_MAX);
  CHECK(huge.launch.blocks == launch::max_blocks);
}

// ---------------------------------------------------------------------------
// The workspace plan of a device-style backend
// ---------------------------------------------------------------------------
namespace {

using fake_device_backend = lce_test::device_shaped_backend<>;
static_assert(lce::backend<fake_device_backend>);
// cuda_backend's optional concepts, as its own static_asserts (lce/cuda/backend.cuh) state them.
static_assert(lce::adds_grad_hidden<fake_device_backend, lce::bfloat16, lce::bfloat16, float>);
static_assert(lce::adds_weight_gradient_tiles<fake_device_backend, lce::bfloat16, float, lce::bfloat16>);
static_assert(lce::rounds_accumulated_weight_gradient<fake_device_backend, lce::float16, float, lce::float16>);
static_assert(!lce::adds_weight_gradient_tiles<fake_device_backend, double, double, float>);
static_assert(std::is_same_v<lce::gemm_operand_t<fake_device_backend, lce::bfloat16>, lce::bfloat16>);
static_assert(!lce::reuses_exp_block<fake_device_backend>());

template <class T>
using device_operator = lce::ChunkedHiddenToLogprobs<lce::comm::single, T, lce::budget_chunk, fake_device_backend>;

constexpr std::size_t align64(std::size_t b) { return (b + 63) / 64 * 64; }

// The plan's bytes for `chunk` rows, from the layout written out by hand.
std::size_t expected_plan_bytes(std::int64_t chunk, std::int64_t h, std::int64_t v, std::size_t operand_bytes) {
  const auto c = static_cast<std::size_t>(chunk);
  const auto ld = static_cast<std::size_t>((v + 15) / 16 * 16);  // fp32: 16 per 64-byte line
  const auto hh = static_cast<std::size_t>(h);
  return align64(c * ld * 4)                                     // logit block
         + align64(c * hh * 4)                                   // dX stage
         + align64(c * sizeof(lce::detail::row_partial<float>))  // partials
         + align64(c * lce::detail::row_arrays * 4)              // per-row arrays
         + align64(c * ld * operand_bytes);                      // dz in the GEMMs' operand type
}

}  // namespace

// What the engine's shape_of (detail/engine.hpp) says for a backend whose
// GEMM operand is T, written out: no widened hidden stage, dz in T.
template <class T>
lce::detail::workspace_shape device_shape(std::int64_t h, std::int64_t v) {
  lce::detail::workspace_shape s;
  s.hidden = h;
  s.vocab_local = v;
  s.ranks = 1;
  s.widen_hidden = false;
  s.operand_bytes = sizeof(T);
  s.gradient_operand_bytes = std::is_same_v<T, float> ? 0 : sizeof(T);
  s.storage_bytes = sizeof(T);
  s.weight_block_elements = 0;
  return s;
}

TEST_CASE_TEMPLATE("device-style workspace plan: dz operand block of T, no hidden widening stage", T,
                   lce::bfloat16, lce::float16) {
  for (const auto& shape : {std::array<std::int64_t, 4>{23, 40, 301, 6}, std::array<std::int64_t, 4>{1000, 64, 5000, 128},
                            std::array<std::int64_t, 4>{7, 8, 1, 7}}) {
    const std::int64_t n = shape[0], h = shape[1], v = shape[2], chunk = shape[3];
    CAPTURE(n);
    CAPTURE(h);
    CAPTURE(v);
    CAPTURE(chunk);
    const auto opt = make_options(1.0f, 0.0f, chunk);
    const device_operator<T> op(lce::comm::single{}, opt, fake_device_backend{});
    CHECK(op.chunk_tokens(n, h, v) == chunk);

    const auto plan = lce::detail::workspace_plan<float>::make(device_shape<T>(h, v), chunk);
    const auto ld = static_cast<std::size_t>(plan.logits_ld);
    CHECK(ld >= static_cast<std::size_t>(v));
    CHECK(plan.hidden_gather == plan.hidden_stage);  // no widening stage
    // the dz operand block: rows x padded ld x sizeof(T), last in the buffer
    CHECK(plan.bytes - plan.gradient_operand == align64(static_cast<std::size_t>(chunk) * ld * sizeof(T)));
    CHECK(plan.bytes == expected_plan_bytes(chunk, h, v, sizeof(T)));

    // workspace_bytes: that plan plus, for a call of several chunks, the fp32
    // [V, H] accumulator of a T grad_weight; a call of one chunk (on one
    // rank) has cuBLAS round dW straight into grad_weight: no dW scratch.
    // Whole cache lines, like the plan's blocks (v * h * 4 = 48,160 is not).
    const std::size_t accumulator = n > chunk ? align64(static_cast<std::size_t>(v * h) * sizeof(float)) : 0;
    CHECK(op.workspace_bytes(n, h, v) == expected_plan_bytes(chunk, h, v, sizeof(T)) + accumulator);
  }
}

TEST_CASE("device-style workspace plan: float keeps dz in the logit block") {
  const std::int64_t n = 23, h = 40, v = 301, chunk = 6;
  const auto opt = make_options(1.0f, 0.0f, chunk);
  const auto plan = lce::detail::workspace_plan<float>::make(device_shape<float>(h, v), chunk);
  CHECK(plan.bytes == plan.gradient_operand);  // an empty operand block
  CHECK(plan.bytes == expected_plan_bytes(chunk, h, v, 0));
  const device_operator<float> op(lce::comm::single{}, opt, fake_device_backend{});
  CHECK(op.workspace_bytes(n, h, v) == plan.bytes);  // no accumulator for float
}

TEST_CASE("device-style workspace plan: the chunk policy counts the dz operand block") {
  // budget_chunk under a workspace limit: the chosen chunk's plan (dz block
  // included) fits the limit, and one more row would not have.
  const std::int64_t n = 100000, h = 256, v = 32000;
  for (std::size_t limit : {std::size_t{8} << 20, std::size_t{64} << 20}) {
    CAPTURE(limit);
    auto opt = make_options(1.0f, 0.0f, 0);
    opt.workspace_limit_bytes = limit;
    const device_operator<lce::bfloat16> op(lce::comm::single{}, opt, fake_device_backend{});
    const std::int64_t chunk = op.chunk_tokens(n, h, v);
    CAPTURE(chunk);
    REQUIRE(chunk >= 1);
    const auto shape = device_shape<lce::bfloat16>(h, v);
    CHECK(lce::detail::workspace_plan<float>::make(shape, chunk).bytes <= limit);
    // without the dz block the policy would have taken more rows
    auto no_operand = shape;
    no_operand.gradient_operand_bytes = 0;
    CHECK(lce::detail::workspace_plan<float>::make(no_operand, chunk + chunk / 8 + 1).bytes <= limit);
  }
}

namespace {

// The device-style backend with memory that allocates (host memory, 64-byte
// aligned), so that a call runs through the engine's plan and reserves its
// scratch; every pass stays empty.
template <std::size_t VocabularyBlockBytes>
struct allocating_device_backend : lce_test::device_shaped_backend<lce::device_memory, VocabularyBlockBytes> {
  void* allocate(std::size_t bytes) {
    void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!p) throw std::bad_alloc();
    return p;
  }
  void deallocate(void* p, std::size_t) noexcept { std::free(p); }
};

// What a bf16 backward with a bf16 grad_weight holds on a backend of that block bound.
template <std::size_t VocabularyBlockBytes>
std::size_t held_by_backward(std::int64_t n, std::int64_t h, std::int64_t v, const lce::options& opt) {
  using backend_t = allocating_device_backend<VocabularyBlockBytes>;
  using B = lce::bfloat16;
  lce::ChunkedHiddenToLogprobs<lce::comm::single, B, lce::budget_chunk, backend_t> op(lce::comm::single{}, opt,
                                                                                      backend_t{});
  std::vector<B> x(static_cast<std::size_t>(n * h)), w(static_cast<std::size_t>(v * h)), gx(x.size()), gw(w.size());
  std::vector<std::int64_t> y(static_cast<std::size_t>(n), 1);
  std::vector<float> lse(static_cast<std::size_t>(n)), g(static_cast<std::size_t>(n));
  op.backward(lce::matrix_view<const B>{x.data(), n, h}, lce::matrix_view<const B>{w.data(), v, h},
              lce::vector_view<const std::int64_t>{y.data(), n}, lce::vector_view<const float>{lse.data(), n},
              lce::vector_view<const float>{g.data(), n}, lce::matrix_view<B>{gx.data(), n, h},
              lce::matrix_view<B>{gw.data(), v, h});
  return op.held_workspace_bytes();
}

}  // namespace

TEST_CASE("device-style workspace plan: the vocabulary order's block is bounded by the budget, not 16 MiB") {
  // bf16, one rank, a backward whose tokens would take several budget
  // chunks: all N tokens over vocabulary tiles hold less than that plus the
  // fp32 [V, H] accumulator. The host's block bound (16 MiB of logits) takes
  // 4,096-column tiles; cuda_backend's (the budget alone) the widest tile
  // within the budget: fewer, larger GEMMs.
  const std::int64_t n = 1024, h = 64, v = 128000;
  auto opt = make_options(1.0f, 0.0f, 0);
  opt.workspace_limit_bytes = std::size_t{64} << 20;
  const std::size_t accumulator = static_cast<std::size_t>(v * h) * sizeof(float);
  const std::size_t dx_sum = static_cast<std::size_t>(n * h) * sizeof(float);
  const std::size_t tile_block = static_cast<std::size_t>(n) * 4096 * (sizeof(float) + sizeof(lce::bfloat16));
  const std::size_t bounded = held_by_backward<std::size_t{16} << 20>(n, h, v, opt);
  constexpr std::size_t cuda_bound = lce::detail::cuda_plan_traits::vocabulary_block_bytes;  // cuda_backend's own
  const std::size_t budget_only = held_by_backward<cuda_bound>(n, h, v, opt);
  CAPTURE(bounded);
  CAPTURE(budget_only);
  // Both took the vocabulary order: less than the accumulator alone.
  CHECK(bounded < accumulator);
  CHECK(budget_only < opt.workspace_limit_bytes + dx_sum);
  // 16 MiB: about one 4,096-column tile of every token (logits and dz) and the dX sum.
  CHECK(bounded >= tile_block + dx_sum);
  CHECK(bounded < tile_block + dx_sum + (std::size_t{1} << 20));
  // The budget: wider tiles, most of it.
  CHECK(budget_only > 2 * tile_block);
  CHECK(budget_only > opt.workspace_limit_bytes / 2);
}
