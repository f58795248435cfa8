// backward() and forward_backward(): gradients against the analytic reference,
// the analytic reference against finite differences, and the fused sweep
// against the two-call form. The typed bodies are in cases/backward_cases.hpp
// (the CUDA suite runs them too).
#include "cases/backward_cases.hpp"

using namespace lce_test;

using namespace lce_test::cases;

// ---------------------------------------------------------------------------
// The reference's analytic gradient is itself checked by finite differences.
// ---------------------------------------------------------------------------
TEST_CASE("reference: analytic gradients agree with central finite differences") {
  std::uint64_t seed = 500;
  for (const auto& c : grad_configs) {
    CAPTURE(c.tau);
    CAPTURE(c.cap);
    CAPTURE(c.entropy);
    problem p = make_problem(6, 5, 9, ++seed, round_identity, c.x_scale, 1.0, 0.2);
    p.y[1] = p.ignore_index;  // at least one ignored row
    p.tau = c.tau;
    p.cap = c.cap;
    const auto g = random_vector(p.n, seed * 3, -1.0, 1.0);
    const auto hg = c.entropy ? random_vector(p.n, seed * 5, -0.7, 0.7) : std::vector<double>{};
    const auto ref = reference_forward(p);
    const auto an = reference_backward(p, ref, g, hg);
    const auto fd = finite_difference_gradients(p, g, hg, 1e-5);
    const double sx = std::max(1.0, max_abs(fd.dx)), sw = std::max(1.0, max_abs(fd.dw));
    REQUIRE(max_abs(fd.dx) > 1e-3);  // the check is not vacuous
    LCE_CHECK_CMP(compare(
        "reference dX vs finite differences", static_cast<std::int64_t>(an.dx.size()),
        [&](std::int64_t k) { return an.dx[k]; }, [&](std::int64_t k) { return fd.dx[k]; },
        [&](std::int64_t, double) { return 1e-7 * sx; }));
    LCE_CHECK_CMP(compare(
        "reference dW vs finite differences", static_cast<std::int64_t>(an.dw.size()),
        [&](std::int64_t k) { return an.dw[k]; }, [&](std::int64_t k) { return fd.dw[k]; },
        [&](std::int64_t, double) { return 1e-7 * sw; }));
    // ignored row: zero gradient
    for (std::int64_t k = 0; k < p.h; ++k) CHECK(an.dx[1 * p.h + k] == 0.0);
  }
}

TEST_CASE("double: library gradients agree with central finite differences") {
  std::uint64_t seed = 900;
  for (const auto& c : grad_configs) {
    CAPTURE(c.tau);
    CAPTURE(c.cap);
    CAPTURE(c.entropy);
    problem p = make_problem(7, 5, 11, ++seed, round_identity, c.x_scale, 1.0, 0.2);
    p.tau = c.tau;
    p.cap = c.cap;
    const auto g = random_vector(p.n, seed * 3, -1.0, 1.0);
    const auto hg = c.entropy ? random_vector(p.n, seed * 5, -0.7, 0.7) : std::vector<double>{};
    const auto fd = finite_difference_gradients(p, g, hg, 1e-5);
    const double sx = std::max(1.0, max_abs(fd.dx)), sw = std::max(1.0, max_abs(fd.dw));
    const auto ref = reference_forward(p);

    const auto X = make_matrix<double>(p.x, p.n, p.h);
    const auto W = make_matrix<double>(p.w, p.v, p.h);
    const auto Y = make_targets<std::int64_t>(p.y);
    auto op = make_op<double>(make_options(c.tau, c.cap, 3));
    vector_buf<double> lse(to_doubles(ref.lse)), G(g);
    vector_buf<double> HG(c.entropy ? hg : std::vector<double>(static_cast<std::size_t>(p.n), 0.0));
    matrix_buf<double> gh(p.n, p.h), gw(p.v, p.h);
    gh.fill(garbage<double>());
    gw.fill(0.0);
    if (c.entropy)
      op.backward(X.cview(), W.cview(), Y.cview(), lse.cview(), G.cview(), HG.cview(), gh.view(), gw.view());
    else
      op.backward(X.cview(), W.cview(), Y.cview(), lse.cview(), G.cview(), gh.view(), gw.view());
    LCE_CHECK_CMP(compare(
        "backward dX vs finite differences", p.n * p.h, [&](std::int64_t k) { return gh.get(k / p.h, k % p.h); },
        [&](std::int64_t k) { return fd.dx[k]; }, [&](std::int64_t, double) { return 1e-7 * sx; }));
    LCE_CHECK_CMP(compare(
        "backward dW vs finite differences", p.v * p.h, [&](std::int64_t k) { return gw.get(k / p.h, k % p.h); },
        [&](std::int64_t k) { return fd.dw[k]; }, [&](std::int64_t, double) { return 1e-7 * sw; }));

    if (!c.entropy) {
      vector_buf<double> lp(p.n);
      gh.fill(garbage<double>());
      gw.fill(0.0);
      op.forward_backward(X.cview(), W.cview(), Y.cview(), G.cview(), lp.view(), gh.view(), gw.view());
      LCE_CHECK_CMP(compare(
          "forward_backward dX vs finite differences", p.n * p.h,
          [&](std::int64_t k) { return gh.get(k / p.h, k % p.h); }, [&](std::int64_t k) { return fd.dx[k]; },
          [&](std::int64_t, double) { return 1e-7 * sx; }));
      LCE_CHECK_CMP(compare(
          "forward_backward dW vs finite differences", p.v * p.h,
          [&](std::int64_t k) { return gw.get(k / p.h, k % p.h); }, [&](std::int64_t k) { return fd.dw[k]; },
          [&](std::int64_t, double) { return 1e-7 * sw; }));
    }
  }
}

// ---------------------------------------------------------------------------
// backward / forward_backward against the reference, every element type,
// gradients of element float and of element T.
// ---------------------------------------------------------------------------
TEST_CASE_TEMPLATE("backward matches the reference gradients", T, float, double, lce::bfloat16, lce::float16) {
  cases::backward_matches_reference<host_env, T>();
}

TEST_CASE_TEMPLATE("forward_backward matches the reference", T, float, double, lce::bfloat16, lce::float16) {
  cases::forward_backward_matches_reference<host_env, T>();
}

TEST_CASE_TEMPLATE("forward_backward equals forward then backward", T, float, double, lce::bfloat16, lce::float16) {
  cases::forward_backward_equals_two_calls<host_env, T>();
}

// ---------------------------------------------------------------------------
// A vocabulary of 5,000 rows spans several GEMM tiles (1,024-4,096 rows each)
// in every GEMM, so a tile offset that is wrong in the logits, dX or dW GEMM
// shows up here (at V <= 1024 every GEMM is one tile).
// ---------------------------------------------------------------------------
TEST_CASE_TEMPLATE("gradients over a vocabulary of several GEMM tiles", T, float, lce::bfloat16) {
  cases::gradients_over_several_tiles<host_env, T>();
}
