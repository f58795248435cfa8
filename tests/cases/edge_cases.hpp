// The bodies of edge-case tests (tests/unit/test_edge_cases.cpp) shared with
// the CUDA suite (tests/cuda/test_cuda_backend.cu): all tokens ignored,
// strided buffers with padding, int32 / int64 targets, a NaN logit. Env: see
// cases/host_env.hpp.
#pragma once

#include "cases/host_env.hpp"

namespace lce_test::cases {

template <class Env, class T>
void all_tokens_ignored() {
  using O = out_t<T>;
  for (std::int64_t ignore : {std::int64_t{-100}, std::int64_t{-1}}) {
    CAPTURE(ignore);
    problem p = make_problem(13, 8, 21, 5, rounder_for<T>(), 1.0, 1.0, 1.0, ignore);
    const auto g = random_vector(p.n, 6, -1, 1, rounder_for<O>());   // non-zero: must still be ignored
    const auto hg = random_vector(p.n, 7, -1, 1, rounder_for<O>());
    auto check = [&]<class G>() {
      INFO("gradient element " << type_name<G>());
      const auto pre = random_vector(p.v * p.h, 8, -1, 1, rounder_for<G>());
      auto op = Env::template make_op<T>(make_options(0.7f, 5.0f, 4, ignore));
      const auto o = exercise<T, G>(op, p, g, hg, pre);
      for (std::int64_t i = 0; i < p.n; ++i) {
        CAPTURE(i);
        CHECK(o.lp.get(i) == 0.0);
        CHECK(o.ent.get(i) == 0.0);
        CHECK(o.lp_fb.get(i) == 0.0);
        CHECK(std::isfinite(o.lse.get(i)));
      }
      bool zero_gh = true, zero_gh_fb = true;
      for (std::int64_t i = 0; i < p.n; ++i)
        for (std::int64_t k = 0; k < p.h; ++k) {
          zero_gh = zero_gh && o.gh.get(i, k) == 0.0;
          zero_gh_fb = zero_gh_fb && o.gh_fb.get(i, k) == 0.0;
        }
      CHECK_MESSAGE(zero_gh, "backward grad_hidden not all zero");
      CHECK_MESSAGE(zero_gh_fb, "forward_backward grad_hidden not all zero");
      const auto untouched = make_matrix<G>(pre, p.v, p.h).bytes();
      CHECK_MESSAGE(o.gw.bytes() == untouched, "backward changed grad_weight");
      CHECK_MESSAGE(o.gw_fb.bytes() == untouched, "forward_backward changed grad_weight");
    };
    check.template operator()<float>();
    if constexpr (!std::is_same_v<T, float>) check.template operator()<T>();
  }
}

template <class Env, class T>
void strided_buffers() {
  using O = out_t<T>;
  problem p = make_problem(19, 10, 33, 31, rounder_for<T>(), 1.0, 1.0, 0.2);
  p.tau = 0.7f;
  p.cap = 5.0f;
  const auto g = random_vector(p.n, 32, -1, 1, rounder_for<O>());
  const auto hg = random_vector(p.n, 33, -0.5, 0.5, rounder_for<O>());
  const layout L{p.h + 5, p.h + 3, p.h + 2, p.h + 7};
  auto op = Env::template make_op<T>(make_options(p.tau, p.cap, 4));  // 19 = 4*4 + 3
  {
    const auto pre = random_vector(p.v * p.h, 34, -1, 1, rounder_for<float>());
    const auto o = exercise<T, float>(op, p, g, hg, pre, L);
    check_against_reference(o, p, g, hg, pre, Env::template gradient_operand_unit<T>,
                            Env::template gradient_operand_floor<T>);
  }
  if constexpr (!std::is_same_v<T, float>) {
    INFO("gradients of element T");
    const auto pre = random_vector(p.v * p.h, 35, -1, 1, rounder_for<T>());
    const auto o = exercise<T, T>(op, p, g, hg, pre, L);
    check_against_reference(o, p, g, hg, pre, Env::template gradient_operand_unit<T>,
                            Env::template gradient_operand_floor<T>);
  }
}

template <class Env, class T>
void int32_and_int64_targets() {
  using O = out_t<T>;
  problem p = make_problem(21, 8, 40, 41, rounder_for<T>(), 1.0, 1.0, 0.2);
  const auto g = random_vector(p.n, 42, -1, 1, rounder_for<O>());
  const auto hg = random_vector(p.n, 43, -0.5, 0.5, rounder_for<O>());
  const auto pre = random_vector(p.v * p.h, 44, -1, 1, rounder_for<float>());
  auto op = Env::template make_op<T>(make_options(1.0f, 0.0f, 5));
  const auto o64 = exercise<T, float, std::int64_t>(op, p, g, hg, pre);
  const auto o32 = exercise<T, float, std::int32_t>(op, p, g, hg, pre);
  check_against_reference(o64, p, g, hg, pre, Env::template gradient_operand_unit<T>,
                          Env::template gradient_operand_floor<T>);
  check_against_reference(o32, p, g, hg, pre, Env::template gradient_operand_unit<T>,
                          Env::template gradient_operand_floor<T>);
  CHECK(o32.all_bytes() == o64.all_bytes());
}

// A NaN in one row of the weight makes that column's logit NaN for every token: every
// counted token's lse, log-prob and entropy must come out NaN (a loss that checks for NaN
// must see it), and its gradient rows too, whichever columns come before or after the NaN
// and however the row's sum is split over threads. The vocabulary is wide enough that
// each thread of a row reduction sees several columns, larger ones after the NaN.
template <class Env, class T>
void nan_logit_poisons_its_row() {
  using O = out_t<T>;
  for (std::int64_t nan_row : {std::int64_t{0}, std::int64_t{1500}}) {
    CAPTURE(nan_row);
    problem p = make_problem(6, 8, 2048, 51, rounder_for<T>(), 1.0, 1.0, 0.0);
    for (std::int64_t k = 0; k < p.h; ++k)
      p.w[static_cast<std::size_t>(nan_row * p.h + k)] = std::numeric_limits<double>::quiet_NaN();
    for (auto& y : p.y)
      if (y == nan_row) y = nan_row + 1;  // the NaN must come from the sum, not the target's logit
    const auto g = random_vector(p.n, 52, -1, 1, rounder_for<O>());
    const auto hg = random_vector(p.n, 53, -0.5, 0.5, rounder_for<O>());
    const auto pre = random_vector(p.v * p.h, 54, -1, 1, rounder_for<float>());
    auto op = Env::template make_op<T>(make_options(1.0f, 0.0f, 4));
    const auto o = exercise<T, float>(op, p, g, hg, pre);
    for (std::int64_t i = 0; i < p.n; ++i) {
      CAPTURE(i);
      CHECK(std::isnan(o.lse.get(i)));
      CHECK(std::isnan(o.lp.get(i)));
      CHECK(std::isnan(o.ent.get(i)));
      CHECK(std::isnan(o.lp_fb.get(i)));
      CHECK(std::isnan(o.gh.get(i, 0)));
      CHECK(std::isnan(o.gh_fb.get(i, 0)));
    }
  }
}

}  // namespace lce_test::cases
