// Bounded memory: with N x V >= 2^28 logits (1 GiB in fp32), the bytes the op
// allocates through operator new during forward / backward / forward_backward
// must stay within workspace_bytes(N, H, V) (+ 64 KiB slack) — far below N x V.
//
// Every global operator new / delete is replaced by a counting version
// (support/allocation_counter.cpp). Note:
// allocations that bypass operator new (malloc, mmap, OpenBLAS's own buffers)
// are not seen; the first test checks the op's scratch is seen at all.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <lce/lce.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "allocation_counter.hpp"
#include "support/reference.hpp"

// Linked with support/allocation_counter.cpp: every operator new is counted.
namespace counting = lce_support::allocations;

namespace {

template <class T>
T to_storage(double d) {
  if constexpr (std::is_same_v<T, float>) return static_cast<float>(d);
  else if constexpr (std::is_same_v<T, lce::bfloat16>)
    return std::bit_cast<lce::bfloat16>(lce_test::float_to_bf16_bits(static_cast<float>(d)));
  else
    return std::bit_cast<lce::float16>(lce_test::float_to_fp16_bits(static_cast<float>(d)));
}

constexpr std::size_t slack = std::size_t{64} << 10;

template <class T>
void bounded_memory_case() {
  using op_type = lce::ChunkedHiddenToLogprobs<lce::comm::single, T>;
  const std::int64_t n = 8192, v = 32768, h = 16;
  static_assert(std::int64_t{8192} * 32768 >= (std::int64_t{1} << 28));
  const std::size_t logits_bytes = static_cast<std::size_t>(n) * static_cast<std::size_t>(v) * sizeof(float);

  // inputs and outputs, allocated before measuring
  lce_test::rounder rnd = std::is_same_v<T, float> ? lce_test::round_to_float
                          : std::is_same_v<T, lce::bfloat16> ? lce_test::round_to_bf16
                                                             : lce_test::round_to_fp16;
  lce_test::problem p = lce_test::make_problem(n, h, v, 2024, rnd, 1.0, 1.0, 0.1);
  std::vector<T> x(static_cast<std::size_t>(n * h)), w(static_cast<std::size_t>(v * h));
  for (std::size_t k = 0; k < x.size(); ++k) x[k] = to_storage<T>(p.x[k]);
  for (std::size_t k = 0; k < w.size(); ++k) w[k] = to_storage<T>(p.w[k]);
  std::vector<std::int64_t> y = p.y;
  std::vector<float> lp(n), lse(n), ent(n), g(n, -1.0f), ge(n, 0.25f), gx(static_cast<std::size_t>(n * h)),
      gw(static_cast<std::size_t>(v * h), 0.0f);
  const lce::matrix_view<const T> X{x.data(), n, h};
  const lce::matrix_view<const T> W{w.data(), v, h};
  const lce::vector_view<const std::int64_t> Y{y.data(), n};
  const lce::vector_view<float> LP{lp.data(), n}, LSE{lse.data(), n}, ENT{ent.data(), n};
  const lce::vector_view<const float> G{g.data(), n}, GE{ge.data(), n}, LSEc{lse.data(), n};
  const lce::matrix_view<float> GX{gx.data(), n, h}, GW{gw.data(), v, h};

  std::vector<float> lp_fwd(n), lse_fwd(n), ent_fresh(n);  // copies of results, allocated up front
  lce::options opt;
  opt.workspace_limit_bytes = std::size_t{16} << 20;
  std::size_t ws = 0;
  {
    op_type probe(lce::comm::single{}, opt);
    ws = probe.workspace_bytes(n, h, v);
  }
  INFO("workspace_bytes(" << n << ", " << h << ", " << v << ") = " << ws);
  CHECK(ws > 0);
  // the budget policy keeps a chunk's scratch within the limit; a 2-byte T also
  // reports the [V, H] fp32 dW accumulator a grad_weight of type T needs (dW
  // accumulates in fp32 across chunks), which no chunk size can shrink (or, in
  // the vocabulary order, an [N, H] sum of dX instead, where that is smaller)
  const std::size_t accumulator = sizeof(T) == 2 ? static_cast<std::size_t>(v * h) * sizeof(float) : 0;
  CHECK(ws <= opt.workspace_limit_bytes + accumulator);
  CHECK(ws < logits_bytes / 16);

  // A bf16 GEMM provider (oneDNN) keeps a small cache of GEMM primitives per
  // thread (a primitive may not move between threads), filled by the first
  // GEMM of each shape: the GEMM library's memory, not the operator's
  // scratch. Each operator's pool has threads of its own, so before counting,
  // the call runs on the operator (twice: GEMM tiles go to whichever thread
  // is free) and its scratch is given back: the counted call allocates all
  // its scratch again, on warm threads.
  const auto warm_threads = [](op_type& op, auto&& body) {
    body(op);
    body(op);
    op.release_workspace();
  };
  auto measure = [&](const char* what, auto&& body) {
    std::size_t delta = 0;
    {
      op_type op(lce::comm::single{}, opt);
      warm_threads(op, body);
      REQUIRE(op.held_workspace_bytes() == 0);  // no scratch cached for the counted call
      counting::scope s;
      body(op);
      delta = static_cast<std::size_t>(s.peak_delta());
    }
    INFO(std::string(what) << ": peak bytes allocated during the call " << delta << " (workspace_bytes " << ws << ")");
    MESSAGE(std::string(what) << ": peak bytes allocated during the call " << delta << " (workspace_bytes " << ws << ")");
    CHECK(delta <= ws + slack);
    CHECK(delta < logits_bytes / 16);
    return delta;
  };

  // Gradients stored as T (dW still accumulated in fp32 by the op: here in
  // the vocabulary order, a tile's [4,096, H] accumulator at a time).
  std::vector<T> gx_t(static_cast<std::size_t>(n * h)), gw_t(static_cast<std::size_t>(v * h), to_storage<T>(0.0));
  const lce::matrix_view<T> GXt{gx_t.data(), n, h}, GWt{gw_t.data(), v, h};
  // a fresh op for each call, its scratch given back before counting
  const auto fwd = measure("forward with entropy", [&](op_type& op) { op.forward(X, W, Y, LP, LSE, ENT); });
  CHECK_MESSAGE(fwd > 0, "no scratch seen through operator new (malloc/mmap allocations are not counted)");
  std::copy(ent.begin(), ent.end(), ent_fresh.begin());
  measure("backward with entropy", [&](op_type& op) { op.backward(X, W, Y, LSEc, G, GE, GX, GW); });
  measure("forward_backward", [&](op_type& op) { op.forward_backward(X, W, Y, G, LP, GX, GW); });
  if constexpr (!std::is_same_v<T, float>) {
    measure("backward, gradients of element T", [&](op_type& op) { op.backward(X, W, Y, LSEc, G, GE, GXt, GWt); });
    measure("forward_backward, gradients of element T",
            [&](op_type& op) { op.forward_backward(X, W, Y, G, LP, GXt, GWt); });
  }

  {
    // one op across calls (scratch may be cached): each call, and all of
    // them together, stay within the workspace
    op_type op(lce::comm::single{}, opt);
    warm_threads(op, [&](op_type& o) {
      o.forward(X, W, Y, LP, LSE);
      o.backward(X, W, Y, LSEc, G, GX, GW);
      o.forward_backward(X, W, Y, G, LP, GX, GW);
    });
    counting::scope life;
    auto call = [&](const char* what, auto&& body) {
      counting::scope s;
      body();
      const auto delta = static_cast<std::size_t>(s.peak_delta());
      INFO(std::string(what) << " (same op): peak " << delta << " (workspace_bytes " << ws << ")");
      CHECK(delta <= ws + slack);
    };
    call("forward", [&] { op.forward(X, W, Y, LP, LSE); });
    std::copy(lp.begin(), lp.end(), lp_fwd.begin());  // preallocated: no allocation inside the scope
    std::copy(lse.begin(), lse.end(), lse_fwd.begin());
    call("backward", [&] { op.backward(X, W, Y, LSEc, G, GX, GW); });
    call("forward_backward", [&] { op.forward_backward(X, W, Y, G, LP, GX, GW); });
    const auto delta = static_cast<std::size_t>(life.peak_delta());
    INFO("one op, all calls: peak " << delta << " (workspace_bytes " << ws << ")");
    CHECK(delta <= ws + slack);

    // the results at this size are still right (a few rows against the reference)
    for (std::int64_t i : {std::int64_t{0}, std::int64_t{1}, std::int64_t{4097}, n - 1}) {
      CAPTURE(i);
      const auto st = lce_test::reference_forward_row(p, i);
      const double tol = 1e-4 * std::max(1.0, std::fabs(static_cast<double>(st.lse)));
      CHECK(std::fabs(lse_fwd[i] - static_cast<double>(st.lse)) <= tol);
      CHECK(std::fabs(lp_fwd[i] - static_cast<double>(st.logp)) <= tol);
      CHECK(std::fabs(lp[i] - static_cast<double>(st.logp)) <= tol);  // forward_backward's
      CHECK(std::fabs(ent_fresh[i] - static_cast<double>(st.ent)) <= tol);
    }
  }
}

}  // namespace

TEST_CASE("bounded memory: float, N x V = 2^28") { bounded_memory_case<float>(); }
TEST_CASE("bounded memory: bfloat16, N x V = 2^28") { bounded_memory_case<lce::bfloat16>(); }
