// forward(): log-probs, lse and entropy against the materialised reference.
// The bodies are in cases/forward_cases.hpp (the CUDA suite runs them too).
#include "cases/forward_cases.hpp"

using namespace lce_test;
using lce_test::cases::check_forward_outputs;

TEST_CASE_TEMPLATE("forward matches the materialised reference", T, float, double, lce::bfloat16, lce::float16) {
  cases::forward_matches_reference<host_env, T>();
}

TEST_CASE_TEMPLATE("forward: ignored tokens give exactly zero log-prob and entropy", T, float, double,
                   lce::bfloat16, lce::float16) {
  cases::forward_ignored_tokens_zero<host_env, T>();
}

TEST_CASE("forward: the float operator needs no template arguments beyond Comm and T") {
  problem p = make_problem(5, 4, 9, 3, round_to_float);
  const auto ref = reference_forward(p);
  const auto X = make_matrix<float>(p.x, p.n, p.h);
  const auto W = make_matrix<float>(p.w, p.v, p.h);
  const auto Y = make_targets<std::int64_t>(p.y);
  lce::ChunkedHiddenToLogprobs<lce::comm::single, float> op(lce::comm::single{}, lce::options{});
  vector_buf<float> lp(p.n), lse(p.n);
  op.forward(X.cview(), W.cview(), Y.cview(), lp.view(), lse.view());
  check_forward_outputs<float>(p, ref, lp, lse, nullptr);
}
