// An LM head with a bias (lce::with_bias): s = x . w + b. The reference is the
// materialised one of a problem with one more hidden column: x' = [x, 1] and
// w' = [w, b] give the same logits, and dW' holds dW and, in its last column, db.
#include "support/harness.hpp"

using namespace lce_test;


TEST_CASE_TEMPLATE("with_bias: forward, backward and forward_backward equal the head with the bias as a column", T,
                   float, double, lce::bfloat16) {
  using O = out_t<T>;
  const std::int64_t n = 13, h = 16, v = 77;
  for (const auto& s : scalings) {
    CAPTURE(s.tau);
    CAPTURE(s.cap);
    problem p = make_problem(n, h + 1, v, 51, rounder_for<T>(), 1.5, 0.5);
    p.tau = s.tau;
    p.cap = s.cap;
    for (std::int64_t i = 0; i < n; ++i) p.x[static_cast<std::size_t>(i * (h + 1) + h)] = 1.0;
    const forward_result ref = reference_forward(p);
    const std::vector<double> g = random_vector(n, 52, -1, 1);
    const gradients want = reference_backward(p, ref, g, {});

    const auto X = make_matrix<T>(p.x, n, h + 1);
    const auto W = make_matrix<T>(p.w, v, h + 1);
    const lce::matrix_view<const T> hidden{X.ptr(), n, h, h + 1}, weight{W.ptr(), v, h, h + 1};
    std::vector<T> bias(static_cast<std::size_t>(v));
    for (std::int64_t j = 0; j < v; ++j) bias[static_cast<std::size_t>(j)] = W.at(j, h);
    const lce::vector_view<const T> b{bias.data(), v};
    const auto Y = make_targets<std::int64_t>(p.y);
    auto op = make_op<T>(make_options(s.tau, s.cap, s.chunk));

    vector_buf<O> lp(n), lse(n);
    op.forward(hidden, lce::with_bias{weight, b}, Y.cview(), lp.view(), lse.view());
    const double tol = base_tol<T>() * 10;
    LCE_CHECK_CMP(compare(
        "logprobs", n, [&](std::int64_t i) { return lp.get(i); }, [&](std::int64_t i) { return double(ref.logp[i]); },
        [&](std::int64_t, double w) { return tol * (1 + std::fabs(w)); }));

    // The gradients: dX is x's columns of dX', dW w's columns of dW', db its last.
    const auto check_gradients = [&](const char* what, const matrix_buf<O>& gh, const matrix_buf<O>& gw,
                                     const std::vector<O>& gb) {
      CAPTURE(what);
      const double scale_x = 1 + max_abs(want.dx), scale_w = 1 + max_abs(want.dw);
      LCE_CHECK_CMP(compare(
          "dX", n * h, [&](std::int64_t e) { return gh.get(e / h, e % h); },
          [&](std::int64_t e) { return want.dx[static_cast<std::size_t>((e / h) * (h + 1) + e % h)]; },
          [&](std::int64_t, double) { return gradient_tol<T>() * scale_x; }));
      LCE_CHECK_CMP(compare(
          "dW", v * h, [&](std::int64_t e) { return gw.get(e / h, e % h); },
          [&](std::int64_t e) { return want.dw[static_cast<std::size_t>((e / h) * (h + 1) + e % h)]; },
          [&](std::int64_t, double) { return gradient_tol<T>() * scale_w; }));
      LCE_CHECK_CMP(compare(
          "db", v, [&](std::int64_t j) { return double(gb[static_cast<std::size_t>(j)]) - 0.5; },
          [&](std::int64_t j) { return want.dw[static_cast<std::size_t>(j * (h + 1) + h)]; },
          [&](std::int64_t, double) { return gradient_tol<T>() * scale_w; }));
    };
    const vector_buf<O> G(g);
    {
      matrix_buf<O> gh(n, h), gw(v, h);
      gw.fill(O(0));
      std::vector<O> gb(static_cast<std::size_t>(v), O(0.5));  // accumulated onto
      op.backward(hidden, lce::with_bias{weight, b}, Y.cview(), lse.cview(), G.cview(), gh.view(),
                  lce::with_bias{gw.view(), lce::vector_view<O>{gb.data(), v}});
      check_gradients("backward", gh, gw, gb);
    }
    {
      matrix_buf<O> gh(n, h), gw(v, h);
      gw.fill(O(0));
      std::vector<O> gb(static_cast<std::size_t>(v), O(0.5));
      vector_buf<O> lp_fb(n);
      op.forward_backward(hidden, lce::with_bias{weight, b}, Y.cview(), G.cview(), lp_fb.view(), gh.view(),
                          lce::with_bias{gw.view(), lce::vector_view<O>{gb.data(), v}});
      check_gradients("forward_backward", gh, gw, gb);
    }
    // Without the bias the log-probs differ: the bias is not ignored.
    vector_buf<O> lp0(n), lse0(n);
    op.forward(hidden, weight, Y.cview(), lp0.view(), lse0.view());
    bool differs = false;
    for (std::int64_t i = 0; i < n; ++i) differs |= !p.ignored(i) && std::fabs(lp0.get(i) - lp.get(i)) > 1e-3;
    CHECK(differs);
  }
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
