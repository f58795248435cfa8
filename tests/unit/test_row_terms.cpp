// The per-row terms beyond log-probs: dL/dlse in backward (a z-loss) and the
// fused forward_backward that also returns lse and entropy and takes
// dL/dentropy, against the materialised long-double reference.
#include "support/harness.hpp"

using namespace lce_test;

namespace {

// dX, dW of L = sum_i g_i logp_i + hg_i ent_i + q_i lse_i, materialised:
// the g and hg parts from reference_backward, the q part here (dlse/dz = p,
// so dL/dz[i,v] gains q_i p[i,v]; ignored rows contribute nothing).
gradients reference_with_lse(const problem& p, const forward_result& r, const std::vector<double>& g,
                             const std::vector<double>& hg, const std::vector<double>& q) {
  gradients out = reference_backward(p, r, g, hg);
  for (std::int64_t i = 0; i < p.n; ++i) {
    if (p.ignored(i)) continue;
    for (std::int64_t j = 0; j < p.v; ++j) {
      const real prob = std::exp(r.z[i * p.v + j] - r.lse[i]);
      const real ds = static_cast<real>(q[i]) * prob * r.dzds[i * p.v + j];
      for (std::int64_t k = 0; k < p.h; ++k) {
        out.dx[i * p.h + k] += static_cast<double>(ds * static_cast<real>(p.w[j * p.h + k]));
        out.dw[j * p.h + k] += static_cast<double>(ds * static_cast<real>(p.x[i * p.h + k]));
      }
    }
  }
  return out;
}

// |got - want| <= tol (1 + |want|) over a gradient, relative to its largest element.
template <class G>
comparison compare_gradient(const std::string& what, const matrix_buf<G>& got, const std::vector<double>& want,
                            double tol) {
  const double scale = 1 + max_abs(want);
  return compare(
      what, got.rows * got.cols, [&](std::int64_t k) { return got.get(k / got.cols, k % got.cols); },
      [&](std::int64_t k) { return want[static_cast<std::size_t>(k)]; },
      [&](std::int64_t, double) { return tol * scale; });
}

template <class T>
double gradient_tol() {
  return std::is_same_v<T, double> ? 1e-10 : 2e-5;
}

struct scaling {
  float tau, cap;
  std::int64_t chunk;
};
constexpr scaling scalings[] = {{1.0f, 0.0f, 0}, {0.7f, 0.0f, 5}, {0.8f, 4.0f, 3}};

}  // namespace

TEST_CASE_TEMPLATE("backward with grad_lse (z-loss) matches the reference", T, float, double, lce::bfloat16) {
  using O = out_t<T>;
  const std::int64_t n = 13, h = 24, v = 97;
  for (const auto& s : scalings) {
    for (const bool with_entropy : {false, true}) {
      CAPTURE(s.tau);
      CAPTURE(s.cap);
      CAPTURE(with_entropy);
      problem p = make_problem(n, h, v, 41, rounder_for<T>(), 1.5, 0.5);
      p.tau = s.tau;
      p.cap = s.cap;
      const forward_result ref = reference_forward(p);
      const std::vector<double> g = random_vector(n, 5, -1, 1);
      const std::vector<double> hg = with_entropy ? random_vector(n, 6, -0.5, 0.5) : std::vector<double>{};
      const std::vector<double> q = random_vector(n, 7, -0.3, 0.8);

      auto op = make_op<T>(make_options(s.tau, s.cap, s.chunk));
      const auto X = make_matrix<T>(p.x, n, h, h + 3);
      const auto W = make_matrix<T>(p.w, v, h);
      const auto Y = make_targets<std::int64_t>(p.y);
      vector_buf<O> lp(n), lse(n);
      op.forward(X.cview(), W.cview(), Y.cview(), lp.view(), lse.view());
      const vector_buf<O> G(g), Q(q);
      const vector_buf<O> HG = with_entropy ? vector_buf<O>(hg) : vector_buf<O>(0);
      matrix_buf<O> gh(n, h), gw(v, h);
      gw.fill(O(0));
      op.backward(X.cview(), W.cview(), Y.cview(), lse.cview(), G.cview(), HG.cview(), Q.cview(), gh.view(), gw.view());

      const gradients want = reference_with_lse(p, ref, g, hg, q);
      LCE_CHECK_CMP(compare_gradient("dX", gh, want.dx, gradient_tol<T>()));
      LCE_CHECK_CMP(compare_gradient("dW", gw, want.dw, gradient_tol<T>()));
      CHECK(gh.padding_intact());

      // The z-loss term must matter: without it the same call is far off.
      const gradients without = reference_backward(p, ref, g, hg);
      CHECK_FALSE(compare_gradient("dX without q", gh, without.dx, gradient_tol<T>()).ok);
    }
  }
}

TEST_CASE_TEMPLATE("forward_backward with entropy: lse, entropy out, dL/dentropy in, one sweep", T, float, double,
                   lce::bfloat16, lce::float16) {
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

    auto op = make_op<T>(make_options(s.tau, s.cap, s.chunk));
    const auto X = make_matrix<T>(p.x, n, h);
    const auto W = make_matrix<T>(p.w, v, h, h + 5);
    const auto Y = make_targets<std::int32_t>(p.y);
    const vector_buf<O> G(g), HG(hg);
    vector_buf<O> lp(n), lse(n), ent(n);
    matrix_buf<T> gh(n, h);
    matrix_buf<O> gw(v, h);
    gw.fill(O(0));
    op.forward_backward(X.cview(), W.cview(), Y.cview(), G.cview(), HG.cview(), lp.view(), lse.view(), ent.view(),
                        gh.view(), gw.view());

    const double tol = base_tol<T>() * 10;
    LCE_CHECK_CMP(compare(
        "logprobs", n, [&](std::int64_t i) { return lp.get(i); },
        [&](std::int64_t i) { return static_cast<double>(ref.logp[i]); }, [&](std::int64_t, double w) { return tol * (1 + std::fabs(w)); }));
    LCE_CHECK_CMP(compare(
        "lse", n, [&](std::int64_t i) { return lse.get(i); },
        [&](std::int64_t i) { return static_cast<double>(ref.lse[i]); }, [&](std::int64_t, double w) { return tol * (1 + std::fabs(w)); }));
    LCE_CHECK_CMP(compare(
        "entropy", n, [&](std::int64_t i) { return ent.get(i); },
        [&](std::int64_t i) { return static_cast<double>(ref.ent[i]); }, [&](std::int64_t, double w) { return tol * (1 + std::fabs(w)); }));

    const gradients want = reference_backward(p, ref, g, hg);
    // grad_hidden is stored in T: one rounding to T on top of the fp32 result.
    const double dx_tol = gradient_tol<T>() + (is_2byte_v<T> ? ulp_of<T>(1.0) : 0.0);
    LCE_CHECK_CMP(compare_gradient("dX", gh, want.dx, dx_tol));
    LCE_CHECK_CMP(compare_gradient("dW", gw, want.dw, gradient_tol<T>()));
    CHECK(lp.padding_intact());
    CHECK(lse.padding_intact());
    CHECK(ent.padding_intact());

    // The entropy term must matter.
    const gradients without = reference_backward(p, ref, g, {});
    CHECK_FALSE(compare_gradient("dW without hg", gw, without.dw, gradient_tol<T>()).ok);
  }
}

TEST_CASE("row terms: a grad_lse or grad_entropy of the wrong length is an error, nothing written") {
  const std::int64_t n = 6, h = 8, v = 20;
  const problem p = make_problem(n, h, v, 3, round_to_float);
  auto op = make_op<float>(make_options());
  const auto X = make_matrix<float>(p.x, n, h);
  const auto W = make_matrix<float>(p.w, v, h);
  const auto Y = make_targets<std::int64_t>(p.y);
  const vector_buf<float> lse(std::vector<double>(n, 3.0)), G(std::vector<double>(n, 1.0)), short_q(std::vector<double>(n - 1, 1.0));
  matrix_buf<float> gh(n, h), gw(v, h);
  gw.fill(0.0f);
  const auto gh_before = gh.bytes(), gw_before = gw.bytes();
  CHECK_THROWS_WITH_AS(op.backward(X.cview(), W.cview(), Y.cview(), lse.cview(), G.cview(), vector_buf<float>(0).cview(),
                                   short_q.cview(), gh.view(), gw.view()),
                       doctest::Contains("grad_lse"), lce::error);
  CHECK(gh.bytes() == gh_before);
  CHECK(gw.bytes() == gw_before);

  vector_buf<float> lp(n), ls(n), ent(n);
  const auto lp_before = lp.bytes();
  CHECK_THROWS_WITH_AS(op.forward_backward(X.cview(), W.cview(), Y.cview(), G.cview(), short_q.cview(), lp.view(),
                                           ls.view(), ent.view(), gh.view(), gw.view()),
                       doctest::Contains("grad_entropy"), lce::error);
  CHECK(lp.bytes() == lp_before);
  CHECK(gh.bytes() == gh_before);
  CHECK(gw.bytes() == gw_before);
}
