// A vector where the hidden states (a matrix) go: no overload matches, and the
// unsatisfied constraint names the reason.
// expect: matrix_like
// expect: is_rank_1_view
#include "common.hpp"

#ifdef LCE_COMPILE_FAIL_CONTROL
void call() { cf::op.forward(lce::matrix_view<const float>{cf::x, 4, 4}, cf::W, cf::Y, cf::LP, cf::LSE); }
#else
void call() { cf::op.forward(cf::Y, cf::W, cf::Y, cf::LP, cf::LSE); }
#endif
