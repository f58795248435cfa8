// options.overwrite_weight_gradients on the host (the shared bodies:
// tests/cases/overwrite_cases.hpp): grad_weight and grad_bias written over,
// never read, on every path a call takes, against the reference; with the AMX
// kernel's rounded-in dW tiles written over too (beta 0) where the CPU has it.
#include "cases/overwrite_cases.hpp"

using namespace lce_test;

TEST_CASE_TEMPLATE("overwrite_weight_gradients: grad_weight written over (NaN before) on every path, as the reference",
                   T, lce::bfloat16, lce::float16, float, double) {
  cases::overwrite::matches_reference<host_env, T>(3);
}

TEST_CASE_TEMPLATE("overwrite_weight_gradients: grad_bias too, and a call with no tokens zeroes both", T,
                   lce::bfloat16, float, double) {
  cases::overwrite::bias_and_empty_calls<host_env, T>();
}

static_assert(lce::overwrites_compute_weight_gradient<lce::host, float, float> &&
              lce::overwrites_compute_weight_gradient<lce::host, double, double>);

TEST_CASE_TEMPLATE("overwrite_weight_gradients: a forward_backward keeps its logits in grad_weight between its sweeps",
                   T, float, double, lce::bfloat16, lce::float16) {
  cases::overwrite::logits_kept_in_grad_weight<host_env, T>(3);
}

TEST_CASE_TEMPLATE("overwrite_weight_gradients: a forward_backward of several chunks holds its dW sum in part in "
                   "grad_weight", T, lce::bfloat16, lce::float16, double) {
  cases::overwrite::dw_sum_in_grad_weight<host_env, T>();
}
