// lce::cuda_backend's carving of a caller's buffer (cuda_backend_options::workspace),
// tested with g++: detail::caller_workspace on its own, then behind the real
// engine with the CUDA plan (tests/support/device_shaped_backend.hpp) over a
// buffer of exactly workspace_bytes, in both call orders.

#include "support/device_shaped_backend.hpp"

#include <lce/cuda/detail/caller_workspace.hpp>
#include <lce/lce.hpp>

#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <vector>

namespace {

using lce::detail::caller_workspace;
constexpr std::size_t line = lce::detail::workspace_alignment;

std::size_t offset_of(const std::vector<char>& buffer, void* p) {
  return static_cast<std::size_t>(static_cast<char*>(p) - buffer.data());
}

// Live blocks lie inside the buffer, apart, each at a whole cache line.
void check_blocks(const caller_workspace& carver, std::size_t size) {
  std::size_t end = 0;
  for (const auto& [at, stop] : carver.blocks()) {
    CHECK(at % line == 0);
    CHECK(at >= end);
    CHECK(stop <= size);
    end = stop;
  }
}

}  // namespace

TEST_CASE("caller workspace: a block regrown while the other lives takes the end it freed") {
  // Scratch of up to 10 lines and an accumulator of 20: workspace_bytes counts 30.
  const std::size_t size = 30 * line;
  std::vector<char> buffer(size);
  caller_workspace carver(buffer.data(), size);

  void* scratch = carver.carve(4 * line);
  CHECK(offset_of(buffer, scratch) == 0);
  void* accumulator = carver.carve(20 * line);
  CHECK(offset_of(buffer, accumulator) == 10 * line);  // against the back
  carver.give_back(scratch);
  scratch = carver.carve(10 * line);  // first fit would have put it after the accumulator: 40 lines
  CHECK(offset_of(buffer, scratch) == 0);
  check_blocks(carver, size);

  carver.give_back(accumulator);
  accumulator = carver.carve(20 * line);
  CHECK(offset_of(buffer, accumulator) == 10 * line);
  check_blocks(carver, size);

  // Full: nothing more, and the live blocks stay as they were.
  CHECK_THROWS_AS(carver.carve(line), std::bad_alloc);
  CHECK(carver.blocks().size() == 2);

  // The accumulator first (both freed, then taken in the other order).
  carver.give_back(scratch);
  carver.give_back(accumulator);
  CHECK(carver.blocks().empty());
  accumulator = carver.carve(20 * line);
  CHECK(offset_of(buffer, accumulator) == 0);
  scratch = carver.carve(3 * line);
  CHECK(offset_of(buffer, scratch) == 27 * line);
  carver.give_back(scratch);
  scratch = carver.carve(10 * line);
  CHECK(offset_of(buffer, scratch) == 20 * line);
  check_blocks(carver, size);
}

TEST_CASE("caller workspace: a buffer of no whole number of lines, and one too small") {
  const std::size_t size = 12 * line + 40;
  std::vector<char> buffer(size);
  caller_workspace carver(buffer.data(), size);
  void* front = carver.carve(5 * line);
  void* back = carver.carve(7 * line);  // top-down, rounded down to a line: 5 lines in
  CHECK(offset_of(buffer, front) == 0);
  CHECK(offset_of(buffer, back) == 5 * line);
  check_blocks(carver, size);
  carver.give_back(back);
  CHECK_THROWS_AS(carver.carve(7 * line + 64), std::bad_alloc);
  CHECK_THROWS_AS(caller_workspace(buffer.data(), size).carve(size + 1), std::bad_alloc);
}

namespace {

// The CUDA plan with its scratch from a caller_workspace (its passes do
// nothing: only the blocks the engine asks for matter here).
struct carving_backend : lce_test::device_shaped_backend<lce::host_memory> {
  std::shared_ptr<caller_workspace> carver;
  void* allocate(std::size_t bytes) { return carver->carve(bytes); }
  void deallocate(void* pointer, std::size_t) noexcept { carver->give_back(pointer); }
};

template <class T>
using carving_op = lce::ChunkedHiddenToLogprobs<lce::comm::single, T, lce::budget_chunk, carving_backend>;

// A call order on one operator over a buffer of exactly workspace_bytes(n, h, v).
template <class T>
void run_calls(std::int64_t n, std::int64_t h, std::int64_t v, std::size_t limit, bool backward_first) {
  CAPTURE(n);
  CAPTURE(h);
  CAPTURE(v);
  CAPTURE(limit);
  CAPTURE(backward_first);
  lce::options opt;
  opt.workspace_limit_bytes = limit;
  const std::size_t bytes = carving_op<T>(lce::comm::single{}, opt, carving_backend{}).workspace_bytes(n, h, v);
  std::vector<char> buffer(bytes);
  auto carver = std::make_shared<caller_workspace>(buffer.data(), bytes);
  carving_op<T> op(lce::comm::single{}, opt, carving_backend{{}, carver});

  std::vector<T> x(static_cast<std::size_t>(n * h)), w(static_cast<std::size_t>(v * h)),
      grad_x(static_cast<std::size_t>(n * h)), grad_w(static_cast<std::size_t>(v * h));
  std::vector<std::int64_t> y(static_cast<std::size_t>(n), 1);
  std::vector<float> g(static_cast<std::size_t>(n), 1.0f), logprobs(static_cast<std::size_t>(n)),
      lse(static_cast<std::size_t>(n));
  const lce::matrix_view<const T> X{x.data(), n, h}, W{w.data(), v, h};
  const lce::vector_view<const std::int64_t> Y{y.data(), n};
  const lce::vector_view<const float> G{g.data(), n};
  const lce::vector_view<float> LP{logprobs.data(), n}, LSE{lse.data(), n};
  const lce::matrix_view<T> GX{grad_x.data(), n, h}, GW{grad_w.data(), v, h};
  const auto forward = [&] { op.forward(X, W, Y, LP, LSE); };
  const auto forward_backward = [&] { op.forward_backward(X, W, Y, G, LP, GX, GW); };
  if (backward_first) {
    CHECK_NOTHROW(forward_backward());
    CHECK_NOTHROW(forward());
  } else {
    CHECK_NOTHROW(forward());
    CHECK_NOTHROW(forward_backward());
  }
  CHECK(op.held_workspace_bytes() <= bytes);
  check_blocks(*carver, bytes);
}

}  // namespace

TEST_CASE_TEMPLATE("caller workspace: workspace_bytes holds every call, in either order, behind the engine", T,
                   lce::bfloat16, lce::float16, float) {
  // The grid takes in both dW routes of 2-byte inputs (the [V, H] accumulator and the
  // vocabulary order's tiles) and sweeps whose scratch differs between the two calls.
  for (const std::int64_t n : {48, 100, 300, 1000})
    for (const std::int64_t h : {40, 64, 256})
      for (const std::int64_t v : {301, 5000, 12001, 40000})
        for (const std::size_t kib : {256, 512, 1280, 4096, 16384})
          for (const bool backward_first : {true, false}) run_calls<T>(n, h, v, kib << 10, backward_first);
}
