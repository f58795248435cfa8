// The row terms beyond log-probs (lce::row_outputs / lce::row_gradients):
// dL/dlse (a z-loss), the mean logit and dL/d(mean logit) (label smoothing),
// and the fused forward_backward that also returns lse and entropy and takes
// dL/dentropy, against the materialised long-double reference.
#include "support/harness.hpp"

using namespace lce_test;

TEST_CASE_TEMPLATE("backward with row_gradients: dL/dlse (z-loss) and dL/d(mean logit) match the reference", T,
                   float, double, lce::bfloat16) {
  using O = out_t<T>;
  const std::int64_t n = 13, h = 24, v = 97;
  for (const auto& s : scalings) {
    for (const int terms : {1, 2, 3, 7}) {  // bits: lse, mean logit, entropy
      const bool with_lse = terms & 1, with_mean = terms & 2, with_entropy = terms & 4;
      CAPTURE(s.tau);
      CAPTURE(s.cap);
      CAPTURE(terms);
      problem p = make_problem(n, h, v, 41, rounder_for<T>(), 1.5, 0.5);
      p.tau = s.tau;
      p.cap = s.cap;
      const forward_result ref = reference_forward(p);
      const std::vector<double> g = random_vector(n, 5, -1, 1);
      const std::vector<double> hg = with_entropy ? random_vector(n, 6, -0.5, 0.5) : std::vector<double>{};
      const std::vector<double> q = with_lse ? random_vector(n, 7, -0.3, 0.8) : std::vector<double>{};
      const std::vector<double> m = with_mean ? random_vector(n, 8, -2.0, 2.0) : std::vector<double>{};

      auto op = make_op<T>(make_options(s.tau, s.cap, s.chunk));
      const auto X = make_matrix<T>(p.x, n, h, h + 3);
      const auto W = make_matrix<T>(p.w, v, h);
      const auto Y = make_targets<std::int64_t>(p.y);
      vector_buf<O> lp(n), lse(n);
      op.forward(X.cview(), W.cview(), Y.cview(), lp.view(), lse.view());
      const vector_buf<O> G(g), HG(hg), Q(q), M(m);
      matrix_buf<O> gh(n, h), gw(v, h);
      gw.fill(O(0));
      op.backward(X.cview(), W.cview(), Y.cview(), lse.cview(),
                  lce::row_gradients<O>{G.cview(), HG.cview(), Q.cview(), M.cview()}, gh.view(), gw.view());

      const gradients want = reference_with_terms(p, ref, g, hg, q, m);
      LCE_CHECK_CMP(compare_gradient("dX", gh, want.dx, gradient_tol<T>()));
      LCE_CHECK_CMP(compare_gradient("dW", gw, want.dw, gradient_tol<T>()));
      CHECK(gh.padding_intact());

      // The extra terms must matter: without them the same call is far off.
      const gradients without = reference_backward(p, ref, g, hg);
      CHECK_FALSE(compare_gradient("dW without the terms", gw, without.dw, gradient_tol<T>()).ok);
    }
  }
}

TEST_CASE_TEMPLATE("forward with row_outputs: the mean logit, and only what is asked for", T, float, double,
                   lce::float16) {
  using O = out_t<T>;
  const std::int64_t n = 11, h = 16, v = 75;
  for (const auto& s : scalings) {
    CAPTURE(s.tau);
    CAPTURE(s.cap);
    problem p = make_problem(n, h, v, 47, rounder_for<T>(), 2.0, 0.5);
    p.tau = s.tau;
    p.cap = s.cap;
    const forward_result ref = reference_forward(p);
    const std::vector<double> mean = reference_mean_logit(p, ref);
    auto op = make_op<T>(make_options(s.tau, s.cap, s.chunk));
    const auto X = make_matrix<T>(p.x, n, h);
    const auto W = make_matrix<T>(p.w, v, h);
    const auto Y = make_targets<std::int32_t>(p.y);
    vector_buf<O> ml(n), ent(n);
    op.forward(X.cview(), W.cview(), Y.cview(), lce::row_outputs<O>{{}, {}, ent.view(), ml.view()});
    const double tol = base_tol<T>() * 10;
    LCE_CHECK_CMP(compare(
        "mean_logit", n, [&](std::int64_t i) { return ml.get(i); }, [&](std::int64_t i) { return mean[i]; },
        [&](std::int64_t, double w) { return tol * (1 + std::fabs(w)); }));
    LCE_CHECK_CMP(compare(
        "entropy", n, [&](std::int64_t i) { return ent.get(i); },
        [&](std::int64_t i) { return static_cast<double>(ref.ent[i]); },
        [&](std::int64_t, double w) { return tol * (1 + std::fabs(w)); }));
    CHECK(ml.padding_intact());
  }
}

TEST_CASE_TEMPLATE("forward_backward with row terms: lse, entropy, mean logit out; dL/dentropy, dL/dlse, "
                   "dL/d(mean logit) in; one sweep", T, float, double, lce::bfloat16, lce::float16) {
  using O = out_t<T>;
  const std::int64_t n = 17, h = 16, v = 131;
  for (const auto& s : scalings) {
    CAPTURE(s.tau);
    CAPTURE(s.cap);
    problem p = make_problem(n, h, v, 43, rounder_for<T>(), 2.0, 0.5);
    p.tau = s.tau;
    p.cap = s.cap;
    const forward_result ref = reference_forward(p);
    const std::vector<double> g = random_vector(n, 8, -1, 1);
    const std::vector<double> hg = random_vector(n, 9, -0.5, 0.5);
    const std::vector<double> q = random_vector(n, 10, 0.0, 0.3);
    const std::vector<double> m = random_vector(n, 11, -0.3, 0.0);

    auto op = make_op<T>(make_options(s.tau, s.cap, s.chunk));
    const auto X = make_matrix<T>(p.x, n, h);
    const auto W = make_matrix<T>(p.w, v, h, h + 5);
    const auto Y = make_targets<std::int32_t>(p.y);
    const vector_buf<O> G(g), HG(hg), Q(q), M(m);
    vector_buf<O> lp(n), lse(n), ent(n), ml(n);
    matrix_buf<T> gh(n, h);
    matrix_buf<O> gw(v, h);
    gw.fill(O(0));
    op.forward_backward(X.cview(), W.cview(), Y.cview(),
                        lce::row_gradients<O>{G.cview(), HG.cview(), Q.cview(), M.cview()},
                        lce::row_outputs<O>{lp.view(), lse.view(), ent.view(), ml.view()}, gh.view(), gw.view());

    check_row_outputs(p, ref, lp, lse, ent, ml, base_tol<T>() * 10);

    const gradients want = reference_with_terms(p, ref, g, hg, q, m);
    // grad_hidden is stored in T: one rounding to T on top of the fp32 result.
    const double dx_tol = gradient_tol<T>() + (is_2byte_v<T> ? ulp_of<T>(1.0) : 0.0);
    LCE_CHECK_CMP(compare_gradient("dX", gh, want.dx, dx_tol));
    LCE_CHECK_CMP(compare_gradient("dW", gw, want.dw, gradient_tol<T>()));
    CHECK(lp.padding_intact());
    CHECK(lse.padding_intact());
    CHECK(ent.padding_intact());
    CHECK(ml.padding_intact());

    // The entropy term must matter.
    const gradients without = reference_with_terms(p, ref, g, {}, q, m);
    CHECK_FALSE(compare_gradient("dW without hg", gw, without.dw, gradient_tol<T>()).ok);
  }
}

TEST_CASE("label smoothing in one forward_backward equals PyTorch's definition, materialised") {
  // loss_i = (1 - eps) (-logp_i) + eps (lse_i - mean_i)  (= eps times the mean over v of -log p_v),
  // summed over counted tokens: dL/dlogp = -(1 - eps), dL/dlse = eps, dL/dmean = -eps.
  const std::int64_t n = 9, h = 12, v = 50;
  const double eps = 0.1;
  const problem p = make_problem(n, h, v, 53, round_to_float, 2.0, 0.5);
  const forward_result ref = reference_forward(p);
  std::vector<double> g(n, -(1 - eps)), q(n, eps), m(n, -eps);
  auto op = make_op<float>(make_options(1.0f, 0.0f, 4));
  const auto X = make_matrix<float>(p.x, n, h);
  const auto W = make_matrix<float>(p.w, v, h);
  const auto Y = make_targets<std::int64_t>(p.y);
  const vector_buf<float> G(g), Q(q), M(m);
  vector_buf<float> lp(n), lse(n), ml(n);
  matrix_buf<float> gh(n, h), gw(v, h);
  gw.fill(0.0f);
  op.forward_backward(X.cview(), W.cview(), Y.cview(), lce::row_gradients<float>{G.cview(), {}, Q.cview(), M.cview()},
                      lce::row_outputs<float>{lp.view(), lse.view(), {}, ml.view()}, gh.view(), gw.view());
  // The loss from the outputs against -sum_v log p_v / V computed from the logits.
  for (std::int64_t i = 0; i < n; ++i) {
    if (p.ignored(i)) continue;
    real mean_neg_logp = 0;
    for (std::int64_t j = 0; j < v; ++j) mean_neg_logp += ref.lse[i] - ref.z[i * v + j];
    mean_neg_logp /= v;
    const double want = (1 - eps) * -static_cast<double>(ref.logp[i]) + eps * static_cast<double>(mean_neg_logp);
    const double got = (1 - eps) * -lp.get(i) + eps * (lse.get(i) - ml.get(i));
    CHECK(got == doctest::Approx(want).epsilon(1e-5));
  }
  // The gradient against the materialised reference of that loss.
  const gradients want = reference_with_terms(p, ref, g, {}, q, m);
  LCE_CHECK_CMP(compare_gradient("dX", gh, want.dx, 2e-5));
  LCE_CHECK_CMP(compare_gradient("dW", gw, want.dw, 2e-5));
}

TEST_CASE("row terms: a row vector of the wrong length is an error naming it, nothing written") {
  const std::int64_t n = 6, h = 8, v = 20;
  const problem p = make_problem(n, h, v, 3, round_to_float);
  auto op = make_op<float>(make_options());
  const auto X = make_matrix<float>(p.x, n, h);
  const auto W = make_matrix<float>(p.w, v, h);
  const auto Y = make_targets<std::int64_t>(p.y);
  const vector_buf<float> lse(std::vector<double>(n, 3.0)), G(std::vector<double>(n, 1.0)),
      short_q(std::vector<double>(n - 1, 1.0));
  matrix_buf<float> gh(n, h), gw(v, h);
  gw.fill(0.0f);
  const auto gh_before = gh.bytes(), gw_before = gw.bytes();
  CHECK_THROWS_WITH_AS(op.backward(X.cview(), W.cview(), Y.cview(), lse.cview(),
                                   lce::row_gradients<float>{G.cview(), {}, short_q.cview(), {}}, gh.view(), gw.view()),
                       doctest::Contains("grad_lse: size 5"), lce::error);
  CHECK_THROWS_WITH_AS(op.backward(X.cview(), W.cview(), Y.cview(), lse.cview(),
                                   lce::row_gradients<float>{G.cview(), {}, {}, short_q.cview()}, gh.view(), gw.view()),
                       doctest::Contains("grad_mean_logit"), lce::error);
  CHECK(gh.bytes() == gh_before);
  CHECK(gw.bytes() == gw_before);

  vector_buf<float> lp(n), ls(n), ent(n), short_out(n - 1);
  const auto lp_before = lp.bytes();
  CHECK_THROWS_WITH_AS(op.forward_backward(X.cview(), W.cview(), Y.cview(),
                                           lce::row_gradients<float>{G.cview(), short_q.cview(), {}, {}},
                                           lce::row_outputs<float>{lp.view(), ls.view(), ent.view(), {}}, gh.view(),
                                           gw.view()),
                       doctest::Contains("grad_entropy"), lce::error);
  CHECK_THROWS_WITH_AS(op.forward(X.cview(), W.cview(), Y.cview(),
                                  lce::row_outputs<float>{lp.view(), {}, {}, short_out.view()}),
                       doctest::Contains("mean_logit"), lce::error);
  // An output overlapping another is refused too.
  CHECK_THROWS_WITH_AS(op.forward(X.cview(), W.cview(), Y.cview(), lce::row_outputs<float>{lp.view(), {}, {}, lp.view()}),
                       doctest::Contains("overlaps"), lce::error);
  CHECK(lp.bytes() == lp_before);
  CHECK(gh.bytes() == gh_before);
  CHECK(gw.bytes() == gw_before);
}

TEST_CASE_TEMPLATE("row_gradients::lse_squared: a z-loss known before the forward, in backward and forward_backward", T,
                   float, double, lce::bfloat16) {
  using O = out_t<T>;
  const std::int64_t n = 13, h = 20, v = 89;
  for (const auto& s : scalings) {
    CAPTURE(s.tau);
    CAPTURE(s.cap);
    problem p = make_problem(n, h, v, 43, rounder_for<T>(), 1.5, 0.5);
    p.tau = s.tau;
    p.cap = s.cap;
    const forward_result ref = reference_forward(p);
    const std::vector<double> g = random_vector(n, 15, -1, 1);
    const std::vector<double> q_given = random_vector(n, 16, -0.2, 0.2);
    const std::vector<double> lambda = random_vector(n, 17, 0.0, 0.3);
    // dL/dlse = given + 2 lambda lse, with the reference's lse
    std::vector<double> q(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i)
      q[static_cast<std::size_t>(i)] = q_given[static_cast<std::size_t>(i)] +
                                       2 * lambda[static_cast<std::size_t>(i)] * static_cast<double>(ref.lse[i]);
    const gradients want = reference_with_terms(p, ref, g, {}, q, {});

    auto op = make_op<T>(make_options(s.tau, s.cap, s.chunk));
    const auto X = make_matrix<T>(p.x, n, h);
    const auto W = make_matrix<T>(p.w, v, h);
    const auto Y = make_targets<std::int64_t>(p.y);
    const vector_buf<O> G(g), Q(q_given), L(lambda);
    vector_buf<O> lp(n), lse(n);
    matrix_buf<O> gh(n, h), gw(v, h);
    gw.fill(O(0));
    op.forward_backward(X.cview(), W.cview(), Y.cview(), lce::row_gradients<O>{G.cview(), {}, Q.cview(), {}, L.cview()},
                        lce::row_outputs<O>{lp.view(), lse.view(), {}, {}}, gh.view(), gw.view());
    LCE_CHECK_CMP(compare_gradient("dX fused", gh, want.dx, gradient_tol<T>()));
    LCE_CHECK_CMP(compare_gradient("dW fused", gw, want.dw, gradient_tol<T>()));

    matrix_buf<O> gh2(n, h), gw2(v, h);
    gw2.fill(O(0));
    op.backward(X.cview(), W.cview(), Y.cview(), lse.cview(),
                lce::row_gradients<O>{G.cview(), {}, Q.cview(), {}, L.cview()}, gh2.view(), gw2.view());
    LCE_CHECK_CMP(compare_gradient("dX", gh2, want.dx, gradient_tol<T>()));
    LCE_CHECK_CMP(compare_gradient("dW", gw2, want.dw, gradient_tol<T>()));

    // Without the z-loss term the same call is far off.
    const gradients without = reference_with_terms(p, ref, g, {}, q_given, {});
    CHECK_FALSE(compare_gradient("dW without lse_squared", gw, without.dw, gradient_tol<T>()).ok);
  }
}
