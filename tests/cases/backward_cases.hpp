// The bodies of the gradient tests (tests/unit/test_backward.cpp), shared
// with the CUDA suite (tests/cuda/test_cuda_backend.cu): backward and
// forward_backward against the analytic long double reference, gradients of
// element float and of element T, grad_weight accumulated onto a prefill.
// Env: see cases/host_env.hpp; with Env::gradient_operand_unit<T> == 0 (the
// host) every tolerance is exactly the CPU suite's.
#pragma once

#include "cases/host_env.hpp"

namespace lce_test::cases {

struct grad_config {
  float tau;
  float cap;
  bool entropy;
  double x_scale;
};

inline constexpr grad_config grad_configs[] = {
    {1.0f, 0.0f, false, 1.0},  //
    {1.0f, 0.0f, true, 1.0},   //
    {0.7f, 5.0f, false, 1.0},  //
    {0.7f, 5.0f, true, 1.0},   //
    {1.3f, 2.0f, true, 2.0},   // saturating softcap
    {0.7f, 0.0f, true, 2.5},   // wider logits
};

// Tolerance for a gradient entry of element G computed from inputs of type T.
template <class T, class G>
double grad_base_tol() {
  return (std::is_same_v<T, double> && std::is_same_v<G, double>) ? 1e-10 : 1e-5;
}

template <class G>
std::vector<double> prefill_values(std::int64_t count, std::uint64_t seed) {
  return random_vector(count, seed, -2.0, 2.0, rounder_for<G>());
}

// grad_hidden (overwritten) against dx_ref.
// `rounding` (empty: none): reference_operand_rounding_bounds(...).dx, for a
// backend that rounds dz to a narrower GEMM operand (see Env).
template <class T, class G>
comparison compare_grad_hidden(const matrix_buf<G>& gh, const std::vector<double>& dx_ref,
                               const std::vector<double>& rounding = {}) {
  const double scale = std::max(1.0, max_abs(dx_ref));
  const double bt = grad_base_tol<T, G>() * scale;
  return compare(
      std::string("grad_hidden<") + type_name<G>() + ">", gh.rows * gh.cols,
      [&](std::int64_t k) { return gh.get(k / gh.cols, k % gh.cols); },
      [&](std::int64_t k) { return dx_ref[static_cast<std::size_t>(k)]; },
      [&](std::int64_t k, double w) {
        return bt + ulp_of<G>(w) + (rounding.empty() ? 0.0 : rounding[static_cast<std::size_t>(k)]);
      });
}

// grad_weight (accumulated onto prefill) against prefill + dw_ref.
template <class T, class G>
comparison compare_grad_weight(const matrix_buf<G>& gw, const std::vector<double>& prefill,
                               const std::vector<double>& dw_ref, const std::vector<double>& rounding = {}) {
  const double scale = std::max(1.0, max_abs(dw_ref));
  const double bt = grad_base_tol<T, G>() * scale;
  return compare(
      std::string("grad_weight<") + type_name<G>() + "> (prefill + dW)", gw.rows * gw.cols,
      [&](std::int64_t k) { return gw.get(k / gw.cols, k % gw.cols); },
      [&](std::int64_t k) { return prefill[static_cast<std::size_t>(k)] + dw_ref[static_cast<std::size_t>(k)]; },
      [&](std::int64_t k, double w) {
        return bt + ulp_of<G>(w) + ulp_of<G>(dw_ref[static_cast<std::size_t>(k)]) +
               (rounding.empty() ? 0.0 : rounding[static_cast<std::size_t>(k)]);
      });
}

template <class Env, class T>
void backward_matches_reference() {
  using O = out_t<T>;
  std::uint64_t seed = 2000;
  for (const auto& c : grad_configs) {
    CAPTURE(c.tau);
    CAPTURE(c.cap);
    CAPTURE(c.entropy);
    CAPTURE(c.x_scale);
    problem p = make_problem(29, 16, 53, ++seed, rounder_for<T>(), c.x_scale, 1.0, 0.15);
    p.tau = c.tau;
    p.cap = c.cap;
    const auto g = random_vector(p.n, seed * 3, -1.0, 1.0, rounder_for<O>());
    const auto hg = c.entropy ? random_vector(p.n, seed * 5, -0.7, 0.7, rounder_for<O>()) : std::vector<double>{};
    const auto ref = reference_forward(p);
    // the library receives the lse rounded to its element type: use that in the reference too
    forward_result ref_r = ref;
    for (auto& l : ref_r.lse) l = round_to<O>(static_cast<double>(l));
    const auto grads = reference_backward(p, ref_r, g, hg);
    const auto rounding = reference_operand_rounding_bounds(p, ref_r, g, hg, Env::template gradient_operand_unit<T>,
                                                            Env::template gradient_operand_floor<T>);

    const auto X = make_matrix<T>(p.x, p.n, p.h);
    const auto W = make_matrix<T>(p.w, p.v, p.h);
    const auto Y = make_targets<std::int64_t>(p.y);
    vector_buf<O> lse(to_doubles(ref.lse)), G(g);
    vector_buf<O> HG(c.entropy ? hg : std::vector<double>(static_cast<std::size_t>(p.n), 0.0));
    auto op = Env::template make_op<T>(make_options(c.tau, c.cap, 7));

    auto run = [&]<class G_>() {
      INFO("gradient element " << type_name<G_>());
      const auto pre = prefill_values<G_>(p.v * p.h, seed * 7);
      matrix_buf<G_> gh(p.n, p.h), gw(p.v, p.h);
      gh.fill(garbage<G_>());
      gw.fill_from(pre);
      if (c.entropy)
        op.backward(X.cview(), W.cview(), Y.cview(), lse.cview(), G.cview(), HG.cview(), gh.view(), gw.view());
      else
        op.backward(X.cview(), W.cview(), Y.cview(), lse.cview(), G.cview(), gh.view(), gw.view());
      LCE_CHECK_CMP((compare_grad_hidden<T, G_>(gh, grads.dx, rounding.dx)));
      LCE_CHECK_CMP((compare_grad_weight<T, G_>(gw, pre, grads.dw, rounding.dw)));
      CHECK(gh.padding_intact());
      CHECK(gw.padding_intact());
    };
    run.template operator()<float>();
    if constexpr (!std::is_same_v<T, float>) run.template operator()<T>();
  }
}

template <class Env, class T>
void forward_backward_matches_reference() {
  using O = out_t<T>;
  std::uint64_t seed = 3000;
  for (const auto& c : grad_configs) {
    if (c.entropy) continue;  // forward_backward has no entropy term
    CAPTURE(c.tau);
    CAPTURE(c.cap);
    for (std::int64_t chunk : {std::int64_t{0}, std::int64_t{6}}) {
      CAPTURE(chunk);
      problem p = make_problem(31, 16, 47, ++seed, rounder_for<T>(), c.x_scale, 1.0, 0.15);
      p.tau = c.tau;
      p.cap = c.cap;
      const auto g = random_vector(p.n, seed * 3, -1.0, 1.0, rounder_for<O>());
      const auto ref = reference_forward(p);
      const auto grads = reference_backward(p, ref, g, {});
      const auto rounding = reference_operand_rounding_bounds(
          p, ref, g, {}, Env::template gradient_operand_unit<T>, Env::template gradient_operand_floor<T>);
      const auto X = make_matrix<T>(p.x, p.n, p.h);
      const auto W = make_matrix<T>(p.w, p.v, p.h);
      const auto Y = make_targets<std::int64_t>(p.y);
      vector_buf<O> G(g);
      auto op = Env::template make_op<T>(make_options(c.tau, c.cap, chunk));

      auto run = [&]<class G_>() {
        INFO("gradient element " << type_name<G_>());
        const auto pre = prefill_values<G_>(p.v * p.h, seed * 7);
        vector_buf<O> lp(p.n);
        lp.fill(garbage<O>());
        matrix_buf<G_> gh(p.n, p.h), gw(p.v, p.h);
        gh.fill(garbage<G_>());
        gw.fill_from(pre);
        op.forward_backward(X.cview(), W.cview(), Y.cview(), G.cview(), lp.view(), gh.view(), gw.view());
        const double bt = base_tol<T>();
        LCE_CHECK_CMP(compare(
            "forward_backward logprobs", p.n, [&](std::int64_t i) { return lp.get(i); },
            [&](std::int64_t i) { return static_cast<double>(ref.logp[i]); },
            [&](std::int64_t i, double) { return p.ignored(i) ? 0.0 : bt; }));
        LCE_CHECK_CMP((compare_grad_hidden<T, G_>(gh, grads.dx, rounding.dx)));
        LCE_CHECK_CMP((compare_grad_weight<T, G_>(gw, pre, grads.dw, rounding.dw)));
        CHECK(lp.padding_intact());
        CHECK(gh.padding_intact());
        CHECK(gw.padding_intact());
      };
      run.template operator()<float>();
      if constexpr (!std::is_same_v<T, float>) run.template operator()<T>();
    }
  }
}

template <class Env, class T>
void forward_backward_equals_two_calls() {
  using O = out_t<T>;
  const double eq_tol = std::is_same_v<T, double> ? 1e-12 : 1e-6;
  std::uint64_t seed = 4000;
  for (const auto& c : grad_configs) {
    if (c.entropy) continue;
    CAPTURE(c.tau);
    CAPTURE(c.cap);
    problem p = make_problem(45, 24, 77, ++seed, rounder_for<T>(), c.x_scale, 1.0, 0.15);
    const auto g = random_vector(p.n, seed * 3, -1.0, 1.0, rounder_for<O>());
    const auto X = make_matrix<T>(p.x, p.n, p.h);
    const auto W = make_matrix<T>(p.w, p.v, p.h);
    const auto Y = make_targets<std::int64_t>(p.y);
    vector_buf<O> G(g);
    auto op = Env::template make_op<T>(make_options(c.tau, c.cap, 8));
    // Where dz is rounded to a narrower operand, each call rounds its own
    // (fp32-close) dz: the two results may differ by both rounding bounds.
    // Empty (nothing added) where dz stays in the compute type.
    operand_rounding_bounds rounding;
    if constexpr (Env::template gradient_operand_unit<T> > 0) {
      problem pr = p;
      pr.tau = c.tau;
      pr.cap = c.cap;
      rounding = reference_operand_rounding_bounds(pr, reference_forward(pr), g, {},
                                                   2 * Env::template gradient_operand_unit<T>,
                                                   2 * Env::template gradient_operand_floor<T>);
    }
    auto extra = [&](const std::vector<double>& b, std::int64_t k) {
      return b.empty() ? 0.0 : b[static_cast<std::size_t>(k)];
    };

    auto run = [&]<class G_>() {
      INFO("gradient element " << type_name<G_>());
      const auto pre = prefill_values<G_>(p.v * p.h, seed * 7);
      // two calls
      vector_buf<O> lp1(p.n), lse1(p.n);
      matrix_buf<G_> gh1(p.n, p.h), gw1(p.v, p.h);
      gh1.fill(garbage<G_>());
      gw1.fill_from(pre);
      op.forward(X.cview(), W.cview(), Y.cview(), lp1.view(), lse1.view());
      op.backward(X.cview(), W.cview(), Y.cview(), lse1.cview(), G.cview(), gh1.view(), gw1.view());
      // one sweep
      vector_buf<O> lp2(p.n);
      matrix_buf<G_> gh2(p.n, p.h), gw2(p.v, p.h);
      gh2.fill(garbage<G_>());
      gw2.fill_from(pre);
      op.forward_backward(X.cview(), W.cview(), Y.cview(), G.cview(), lp2.view(), gh2.view(), gw2.view());

      CHECK_MESSAGE(lp1.bytes() == lp2.bytes(), "logprobs of forward_backward differ from forward's");
      std::vector<double> d1(static_cast<std::size_t>(p.n * p.h)), w1(static_cast<std::size_t>(p.v * p.h));
      for (std::int64_t k = 0; k < p.n * p.h; ++k) d1[k] = gh1.get(k / p.h, k % p.h);
      for (std::int64_t k = 0; k < p.v * p.h; ++k) w1[k] = gw1.get(k / p.h, k % p.h) - pre[k];
      const double sx = std::max(1.0, max_abs(d1)), sw = std::max(1.0, max_abs(w1));
      LCE_CHECK_CMP(compare(
          "grad_hidden fused vs two calls", p.n * p.h, [&](std::int64_t k) { return gh2.get(k / p.h, k % p.h); },
          [&](std::int64_t k) { return gh1.get(k / p.h, k % p.h); },
          [&](std::int64_t k, double w) {
            return eq_tol * sx + (is_2byte_v<G_> ? ulp_of<G_>(w) : 0.0) + extra(rounding.dx, k);
          }));
      LCE_CHECK_CMP(compare(
          "grad_weight fused vs two calls", p.v * p.h, [&](std::int64_t k) { return gw2.get(k / p.h, k % p.h); },
          [&](std::int64_t k) { return gw1.get(k / p.h, k % p.h); },
          [&](std::int64_t k, double w) {
            return eq_tol * sw + (is_2byte_v<G_> ? ulp_of<G_>(w) : 0.0) + extra(rounding.dw, k);
          }));
    };
    run.template operator()<float>();
    if constexpr (!std::is_same_v<T, float>) run.template operator()<T>();
  }
}

template <class Env, class T>
void gradients_over_several_tiles() {
  using O = out_t<T>;
  problem p = make_problem(40, 24, 5000, 6100, rounder_for<T>(), 1.5, 1.0, 0.1);
  p.tau = 0.8f;
  p.cap = 6.0f;
  const auto g = random_vector(p.n, 6101, -1.0, 1.0, rounder_for<O>());
  const auto hg = random_vector(p.n, 6102, -0.5, 0.5, rounder_for<O>());
  for (std::int64_t chunk : {std::int64_t{0}, std::int64_t{16}}) {
    CAPTURE(chunk);
    for (int threads : {1, 2}) {
      CAPTURE(threads);
      auto op = Env::template make_op<T>(make_options(p.tau, p.cap, chunk), threads);
      const auto pre_f = random_vector(p.v * p.h, 6103, -1.0, 1.0, rounder_for<float>());
      check_against_reference(exercise<T, float>(op, p, g, hg, pre_f), p, g, hg, pre_f,
                              Env::template gradient_operand_unit<T>, Env::template gradient_operand_floor<T>);
      if constexpr (!std::is_same_v<T, float>) {
        const auto pre_t = random_vector(p.v * p.h, 6104, -1.0, 1.0, rounder_for<T>());
        check_against_reference(exercise<T, T>(op, p, g, hg, pre_t), p, g, hg, pre_t,
                                Env::template gradient_operand_unit<T>, Env::template gradient_operand_floor<T>);
      }
    }
  }
}

}  // namespace lce_test::cases
