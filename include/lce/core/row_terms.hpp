#pragma once
// The per-token vectors of the operator's extended calls, for losses with
// more row terms than log p(y) (label smoothing, z-loss, entropy bonus).
// Each is a view over N elements of float or double, or empty (the default):
// an empty output is not computed, an empty gradient counts as zero.

#include <lce/core/config.hpp>
#include <lce/core/dtypes.hpp>
#include <lce/core/views.hpp>

LCE_BEGIN_NAMESPACE

template <result_type E = float>
struct row_outputs {
  vector_view<E> logprobs;    // log p(y_i); ignored tokens 0
  vector_view<E> lse;         // log sum_v exp(z_iv)
  vector_view<E> entropy;     // -sum_v p_iv log p_iv; ignored tokens 0
  vector_view<E> mean_logit;  // sum_v z_iv / V over the whole vocabulary; ignored tokens 0
};

// dL/d of each of the above.
template <result_type E = float>
struct row_gradients {
  vector_view<const E> logprobs;
  vector_view<const E> entropy;
  vector_view<const E> lse;         // a z-loss lambda lse^2 gives 2 lambda lse
  vector_view<const E> mean_logit;  // label smoothing eps: -eps per counted token (times its weight)
  // The coefficient of lse^2 in the loss (a z-loss, lambda per counted
  // token): adds 2 lse_squared lse to dL/dlse with the lse of the same sweep,
  // so a z-loss is known before the forward and stays on forward_backward.
  vector_view<const E> lse_squared{};
};

// Target sets: targets [N, K], K ids per token (a teacher's top-K, several
// references): the log-prob of each id, and its gradient, as dense [N, K]
// matrices (row-major, ld = K); the per-token vectors as above. An id equal
// to ignore_index gives log-prob 0 and takes no gradient; a token whose K ids
// are all ignored is an ignored token (entropy and mean logit 0, no gradient;
// its lse is still computed).
template <result_type E = float>
struct target_set_outputs {
  matrix_view<E> logprobs;    // [N, K]
  vector_view<E> lse;         // [N]
  vector_view<E> entropy;     // [N]
  vector_view<E> mean_logit;  // [N]
};

template <result_type E = float>
struct target_set_gradients {
  matrix_view<const E> logprobs;  // [N, K] dL/dlog p of each id
  vector_view<const E> entropy;
  vector_view<const E> lse;
  vector_view<const E> mean_logit;
  vector_view<const E> lse_squared{};  // as in row_gradients
};

LCE_END_NAMESPACE
