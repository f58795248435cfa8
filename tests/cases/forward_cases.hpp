// The bodies of the forward tests (tests/unit/test_forward.cpp), shared with
// the CUDA suite (tests/cuda/test_cuda_backend.cu): log-probs, lse and
// entropy against the materialised long double reference. Env: see
// cases/host_env.hpp.
#pragma once

#include "cases/host_env.hpp"

namespace lce_test::cases {

struct forward_config {
  float tau;
  float cap;
  std::int64_t chunk;
  double x_scale;
};

inline constexpr forward_config forward_configs[] = {
    {1.0f, 0.0f, 0, 1.0},  //
    {0.7f, 0.0f, 0, 1.0},  //
    {1.0f, 5.0f, 0, 1.0},  //
    {0.7f, 5.0f, 0, 1.0},  //
    {1.3f, 2.0f, 5, 1.0},  // strongly saturating softcap, several chunks
    {1.0f, 0.0f, 7, 3.0},  // wider logits (about +-20), several chunks
    {0.7f, 30.0f, 4, 3.0}, // gemma-style softcap
};

// The same computation done "naively" in storage type T: logits rounded to T,
// then log-softmax (in long double, so that only the rounding of the logits
// counts). For 2-byte T the library must be no worse than this.
struct storage_errors {
  double logp = 0, lse = 0, ent = 0;
};
template <class T>
storage_errors materialised_in_storage_type(const problem& p, const forward_result& ref) {
  storage_errors e;
  std::vector<real> z(static_cast<std::size_t>(p.v));
  for (std::int64_t i = 0; i < p.n; ++i) {
    for (std::int64_t j = 0; j < p.v; ++j) z[j] = round_to<T>(static_cast<double>(ref.z[i * p.v + j]));
    const auto st = reference_row_stats(z.data(), p.v, p.y[i], p.ignored(i));
    e.logp = std::max(e.logp, static_cast<double>(std::fabs(st.logp - ref.logp[i])));
    e.lse = std::max(e.lse, static_cast<double>(std::fabs(st.lse - ref.lse[i])));
    e.ent = std::max(e.ent, static_cast<double>(std::fabs(st.ent - ref.ent[i])));
  }
  return e;
}

template <class O>
double max_err(const vector_buf<O>& got, const std::vector<real>& want) {
  double m = 0;
  for (std::int64_t i = 0; i < got.size; ++i) {
    const double d = std::fabs(got.get(i) - static_cast<double>(want[i]));
    m = std::isnan(d) ? std::numeric_limits<double>::infinity() : std::max(m, d);
  }
  return m;
}

template <class T>
void check_forward_outputs(const problem& p, const forward_result& ref, const vector_buf<out_t<T>>& lp,
                           const vector_buf<out_t<T>>& lse, const vector_buf<out_t<T>>* ent) {
  const double bt = base_tol<T>();
  LCE_CHECK_CMP(compare(
      "logprobs", p.n, [&](std::int64_t i) { return lp.get(i); },
      [&](std::int64_t i) { return static_cast<double>(ref.logp[i]); },
      [&](std::int64_t i, double) { return p.ignored(i) ? 0.0 : bt; }));
  LCE_CHECK_CMP(compare(
      "lse", p.n, [&](std::int64_t i) { return lse.get(i); },
      [&](std::int64_t i) { return static_cast<double>(ref.lse[i]); },
      [&](std::int64_t, double w) { return bt * std::max(1.0, std::fabs(w)); }));
  CHECK(lp.padding_intact());
  CHECK(lse.padding_intact());
  if (ent) {
    LCE_CHECK_CMP(compare(
        "entropy", p.n, [&](std::int64_t i) { return ent->get(i); },
        [&](std::int64_t i) { return static_cast<double>(ref.ent[i]); },
        [&](std::int64_t i, double) { return p.ignored(i) ? 0.0 : bt * std::max(1.0, std::fabs(static_cast<double>(ref.lse[i]))); }));
    CHECK(ent->padding_intact());
  }
  if constexpr (is_2byte_v<T>) {
    // No worse than materialising the logits in T (plus a small slack).
    const auto se = materialised_in_storage_type<T>(p, ref);
    const double slack = 1e-5;
    INFO("storage-type materialised errors: logp " << se.logp << ", lse " << se.lse << ", ent " << se.ent);
    CHECK(max_err(lp, ref.logp) <= se.logp + slack);
    CHECK(max_err(lse, ref.lse) <= se.lse + slack);
    if (ent) CHECK(max_err(*ent, ref.ent) <= se.ent + slack);
  }
}

template <class Env, class T>
void forward_matches_reference() {
  using O = out_t<T>;
  std::uint64_t seed = 100;
  for (const auto& c : forward_configs) {
    CAPTURE(c.tau);
    CAPTURE(c.cap);
    CAPTURE(c.chunk);
    CAPTURE(c.x_scale);
    problem p = make_problem(37, 24, 101, ++seed, rounder_for<T>(), c.x_scale, 1.0, 0.15);
    p.tau = c.tau;
    p.cap = c.cap;
    const auto ref = reference_forward(p);
    const auto X = make_matrix<T>(p.x, p.n, p.h);
    const auto W = make_matrix<T>(p.w, p.v, p.h);
    const auto Y = make_targets<std::int64_t>(p.y);
    auto op = Env::template make_op<T>(make_options(c.tau, c.cap, c.chunk));

    {
      INFO("forward without entropy");
      vector_buf<O> lp(p.n), lse(p.n);
      lp.fill(garbage<O>());
      lse.fill(garbage<O>());
      op.forward(X.cview(), W.cview(), Y.cview(), lp.view(), lse.view());
      check_forward_outputs<T>(p, ref, lp, lse, nullptr);
    }
    {
      INFO("forward with entropy");
      vector_buf<O> lp(p.n), lse(p.n), ent(p.n);
      lp.fill(garbage<O>());
      lse.fill(garbage<O>());
      ent.fill(garbage<O>());
      op.forward(X.cview(), W.cview(), Y.cview(), lp.view(), lse.view(), ent.view());
      check_forward_outputs<T>(p, ref, lp, lse, &ent);
    }
  }
}

template <class Env, class T>
void forward_ignored_tokens_zero() {
  using O = out_t<T>;
  problem p = make_problem(40, 8, 30, 7, rounder_for<T>(), 1.0, 1.0, 0.5);
  std::int64_t ignored = 0;
  for (std::int64_t i = 0; i < p.n; ++i) ignored += p.ignored(i);
  REQUIRE(ignored > 5);
  const auto ref = reference_forward(p);
  const auto X = make_matrix<T>(p.x, p.n, p.h);
  const auto W = make_matrix<T>(p.w, p.v, p.h);
  const auto Y = make_targets<std::int64_t>(p.y);
  auto op = Env::template make_op<T>(make_options(1.0f, 0.0f, 3));
  vector_buf<O> lp(p.n), lse(p.n), ent(p.n);
  lp.fill(garbage<O>());
  lse.fill(garbage<O>());
  ent.fill(garbage<O>());
  op.forward(X.cview(), W.cview(), Y.cview(), lp.view(), lse.view(), ent.view());
  for (std::int64_t i = 0; i < p.n; ++i) {
    if (!p.ignored(i)) continue;
    CAPTURE(i);
    CHECK(lp.get(i) == 0.0);
    CHECK(ent.get(i) == 0.0);
  }
  check_forward_outputs<T>(p, ref, lp, lse, &ent);
}

}  // namespace lce_test::cases
