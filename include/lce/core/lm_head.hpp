#pragma once
// An LM head with a bias (some models have one): the weight shard [V_r, H]
// and its bias [V_r], passed where the weight goes,
//
//   op.forward(hidden, lce::with_bias{weight, bias}, targets, logprobs, lse);
//
// and, where grad_weight goes, grad_weight with grad_bias [V_r] (float or
// double; accumulated, +=, like grad_weight):
//
//   op.backward(hidden, lce::with_bias{weight, bias}, targets, lse, grad_logprobs, grad_hidden,
//               lce::with_bias{grad_weight, grad_bias});
//
// The bias joins the raw logit before the soft-cap and the temperature:
// s = x . w + b. An empty bias view ({}) is no bias, and an empty grad_bias is
// not written: one instantiation serves heads with and without a bias.

#include <lce/core/config.hpp>
#include <lce/core/views.hpp>

#include <type_traits>

LCE_BEGIN_NAMESPACE

template <class Weight, class Bias>
struct with_bias {
  Weight weight;
  Bias bias;
};
template <class Weight, class Bias>
with_bias(Weight, Bias) -> with_bias<Weight, Bias>;

namespace detail {
template <class W>
struct biased_head : std::false_type {};
template <class W, class B>
struct biased_head<with_bias<W, B>> : std::true_type {
  using weight = W;
  using bias = B;
};
template <class W>
inline constexpr bool is_biased_head = biased_head<std::remove_cvref_t<W>>::value;
}  // namespace detail

// A weight (or weight gradient) view, or one with its bias vector.
template <class W>
concept head_like = matrix_like<W> || (detail::is_biased_head<W> &&
                                       matrix_like<typename detail::biased_head<std::remove_cvref_t<W>>::weight> &&
                                       vector_like<typename detail::biased_head<std::remove_cvref_t<W>>::bias>);

namespace detail {
template <class W>
const auto& head_weight(const W& head) {
  if constexpr (is_biased_head<W>) return head.weight;
  else return head;
}
template <class W>
using head_weight_t = std::remove_cvref_t<decltype(head_weight(std::declval<const W&>()))>;
}  // namespace detail

LCE_END_NAMESPACE
