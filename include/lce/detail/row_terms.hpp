#pragma once
// The per-token vectors of one call, as the engine takes them: the outputs
// (log-probs, lse, entropy, mean logit) and the loss's gradients with respect
// to them. A call has some of them (`has_*`); the others are empty views that
// nothing reads or writes. Each may have its own element type (float or
// double), as the public overloads allow.

#include <lce/core/config.hpp>
#include <lce/core/views.hpp>

#include <cstdint>

LCE_BEGIN_NAMESPACE
namespace detail {

template <class Logprobs, class Lse, class Entropy, class MeanLogit>
struct row_output_views {
  vector_view<Logprobs> logprobs;
  vector_view<Lse> lse;
  vector_view<Entropy> entropy;
  vector_view<MeanLogit> mean_logit;
  bool has_logprobs = false, has_lse = false, has_entropy = false, has_mean_logit = false;

  std::int64_t mask() const { return has_logprobs | has_lse << 1 | has_entropy << 2 | has_mean_logit << 3; }
};

template <class Logprobs, class Entropy, class Lse, class MeanLogit>
struct row_gradient_views {
  vector_view<const Logprobs> logprobs;  // dL/dlogprobs
  vector_view<const Entropy> entropy;    // dL/dentropy
  vector_view<const Lse> lse;            // dL/dlse
  vector_view<const MeanLogit> mean_logit;  // dL/d(mean logit)
  vector_view<const Lse> lse_squared;    // the coefficient of lse^2 (a z-loss)
  bool has_logprobs = false, has_entropy = false, has_lse = false, has_mean_logit = false, has_lse_squared = false;

  std::int64_t mask() const {
    return has_logprobs | has_entropy << 1 | has_lse << 2 | has_mean_logit << 3 | has_lse_squared << 4;
  }
};

}  // namespace detail
LCE_END_NAMESPACE
