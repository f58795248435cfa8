// An LM head with a bias (lce::with_bias): s = x . w + b. The bodies shared with
// the CUDA suite are in cases/bias_cases.hpp; here, what only the host checks.
#include "cases/bias_cases.hpp"
#include "cases/vocabulary_order_cases.hpp"
#include "support/harness.hpp"

#include <limits>

using namespace lce_test;


TEST_CASE_TEMPLATE("with_bias: forward, backward and forward_backward equal the head with the bias as a column", T,
                   float, double, lce::bfloat16) {
  cases::bias::matches_bias_as_a_column<host_env, T>();
}

TEST_CASE("with_bias: a bias or grad_bias of the wrong size raises lce::error naming it, nothing written") {
  const std::int64_t n = 5, h = 8, v = 11;
  problem p = make_problem(n, h, v, 53, rounder_for<float>());
  const auto X = make_matrix<float>(p.x, n, h);
  const auto W = make_matrix<float>(p.w, v, h);
  const auto Y = make_targets<std::int64_t>(p.y);
  auto op = make_op<float>(make_options());
  std::vector<float> bias(static_cast<std::size_t>(v + 1), 0.25f);
  vector_buf<float> lp(n), lse(n);
  const auto before = lp.bytes();
  CHECK_THROWS_WITH_AS(op.forward(X.cview(), lce::with_bias{W.cview(), lce::vector_view<const float>{bias.data(), v + 1}},
                                  Y.cview(), lp.view(), lse.view()),
                       doctest::Contains("bias: size 12 does not match the 11 rows of weight"), lce::error);
  CHECK(lp.bytes() == before);
  op.forward(X.cview(), lce::with_bias{W.cview(), lce::vector_view<const float>{bias.data(), v}}, Y.cview(), lp.view(),
             lse.view());
  const vector_buf<float> G(random_vector(n, 54, -1, 1));
  matrix_buf<float> gh(n, h), gw(v, h);
  gw.fill(0.0f);
  std::vector<float> gb(static_cast<std::size_t>(v), 3.0f);
  const auto gw_before = gw.bytes();
  CHECK_THROWS_WITH_AS(op.backward(X.cview(), lce::with_bias{W.cview(), lce::vector_view<const float>{bias.data(), v}},
                                   Y.cview(), lse.cview(), G.cview(), gh.view(),
                                   lce::with_bias{gw.view(), lce::vector_view<float>{gb.data(), v - 1}}),
                       doctest::Contains("grad_bias: size 10 does not match the 11 rows of weight"), lce::error);
  CHECK(gw.bytes() == gw_before);
  for (float e : gb) CHECK(e == 3.0f);
}

// Code that serves heads with and without a bias through one instantiation
// (lce_torch does) passes empty views: with_bias{weight, {}} is the plain head,
// bit for bit, and an empty grad_bias is not written.
TEST_CASE_TEMPLATE("with_bias: empty bias and grad_bias views are the head without a bias, bit for bit", T, float,
                   lce::bfloat16) {
  using O = out_t<T>;
  const std::int64_t n = 9, h = 8, v = 21;
  const problem p = make_problem(n, h, v, 55, rounder_for<T>());
  const auto X = make_matrix<T>(p.x, n, h);
  const auto W = make_matrix<T>(p.w, v, h);
  const auto Y = make_targets<std::int64_t>(p.y);
  auto op = make_op<T>(make_options(1.0, 0.0, 4));
  const lce::with_bias no_bias{W.cview(), lce::vector_view<const T>{}};
  vector_buf<O> lp(n), lse(n), lp0(n), lse0(n);
  op.forward(X.cview(), no_bias, Y.cview(), lp.view(), lse.view());
  op.forward(X.cview(), W.cview(), Y.cview(), lp0.view(), lse0.view());
  CHECK(lp.bytes() == lp0.bytes());
  CHECK(lse.bytes() == lse0.bytes());

  const vector_buf<O> G(random_vector(n, 56, -1, 1));
  matrix_buf<O> gh(n, h), gw(v, h), gh0(n, h), gw0(v, h);
  gw.fill(O(0));
  gw0.fill(O(0));
  op.backward(X.cview(), no_bias, Y.cview(), lse.cview(), G.cview(), gh.view(),
              lce::with_bias{gw.view(), lce::vector_view<O>{}});
  op.backward(X.cview(), W.cview(), Y.cview(), lse0.cview(), G.cview(), gh0.view(), gw0.view());
  CHECK(gh.bytes() == gh0.bytes());
  CHECK(gw.bytes() == gw0.bytes());

  gw.fill(O(0));
  gw0.fill(O(0));
  op.forward_backward(X.cview(), no_bias, Y.cview(), G.cview(), lp.view(), gh.view(),
                      lce::with_bias{gw.view(), lce::vector_view<O>{}});
  op.forward_backward(X.cview(), W.cview(), Y.cview(), G.cview(), lp0.view(), gh0.view(), gw0.view());
  CHECK(lp.bytes() == lp0.bytes());
  CHECK(gh.bytes() == gh0.bytes());
  CHECK(gw.bytes() == gw0.bytes());
}

TEST_CASE_TEMPLATE("with_bias: a bias of -inf masks its columns: the head without them, entropy included", T, float,
                   double, lce::bfloat16) {
  cases::bias::masks_columns<host_env, T>();
}

TEST_CASE_TEMPLATE("with_bias: a bias of -inf masking whole vocabulary tiles (the vocabulary order)", T, lce::bfloat16,
                   double) {
  namespace vo = cases::vocabulary_order;
  // Every column from 4,000 on: whatever the tile width (4,096 to 12,000), one tile or more holds
  // masked columns alone.
  const auto masked = [](std::int64_t j) { return j >= 4000 || j % 5 == 1; };
  for (const vo::tiling l : vo::tilings) {
    CAPTURE(int(l));
    cases::bias::masked_columns<host_env, T, vo::narrow_t<T>>(
        vo::tokens, vo::hidden - 1, vo::vocab, vo::budget_options<T>(0.8f, 0.0f, l), masked, 71,
        [&](const auto& op) { vo::check_took_vocabulary_order<std::remove_cvref_t<decltype(op)>, T>(op, l, vo::hidden - 1); });
  }
}
