#pragma once
// Vectorisable loops over one row of logits, built on core/row_math.hpp.
//
// Every reduction keeps a fixed number of independent lanes (one SIMD
// register's worth) and merges them in a fixed order at the end: that is what
// lets the compiler vectorise a sum without -ffast-math, and it makes the
// result independent of how rows are spread over threads. The tail of a row
// lands in the same lanes it would in a longer row.

#include <lce/core/config.hpp>
#include <lce/core/row_math.hpp>

#include <cstdint>
#include <limits>

LCE_BEGIN_NAMESPACE
namespace detail {

template <class A>
inline constexpr int simd_lanes = 64 / static_cast<int>(sizeof(A));

// Pairwise merge of the lanes, always in the same order.
template <class A, class Combine>
LCE_ALWAYS_INLINE A reduce_lanes(A (&lanes)[simd_lanes<A>], Combine combine) {
  for (int width = simd_lanes<A> / 2; width > 0; width /= 2)
    for (int l = 0; l < width; ++l) lanes[l] = combine(lanes[l], lanes[l + width]);
  return lanes[0];
}

// Applies body(lane, index) to every element: full blocks of lanes first, then the tail.
template <class A, class Body>
LCE_ALWAYS_INLINE void for_each_lane(std::int64_t n, Body&& body) {
  constexpr int L = simd_lanes<A>;
  std::int64_t j = 0;
  for (; j + L <= n; j += L) {
#pragma GCC unroll 16
    for (int l = 0; l < L; ++l) body(l, j + l);
  }
  for (int l = 0; j + l < n; ++l) body(l, j + l);
}

template <class A>
A row_max(const A* LCE_RESTRICT z, std::int64_t n) {
  A lanes[simd_lanes<A>];
  for (auto& lane : lanes) lane = -std::numeric_limits<A>::infinity();
  for_each_lane<A>(n, [&](int l, std::int64_t j) { lanes[l] = z[j] > lanes[l] ? z[j] : lanes[l]; });
  return reduce_lanes(lanes, [](A a, A b) { return a > b ? a : b; });
}

template <class A>
void soft_cap_row(A* LCE_RESTRICT z, std::int64_t n, A cap) {
  for_each_lane<A>(n, [&](int, std::int64_t j) { z[j] = soft_cap(z[j], cap); });
}

// s = sum exp(z - max) and, when the entropy is wanted, t = sum exp(z - max)(z - max).
template <class A, bool WithEntropy>
void sum_exp_row(const A* LCE_RESTRICT z, std::int64_t n, A max, A& sum_exp, A& sum_exp_offset) {
  A sums[simd_lanes<A>] = {};
  A offsets[simd_lanes<A>] = {};
  for_each_lane<A>(n, [&](int l, std::int64_t j) {
    const A shifted = z[j] - max;
    const A e = fast_exp(shifted);
    sums[l] += e;
    if constexpr (WithEntropy) offsets[l] += e * shifted;
  });
  const auto plus = [](A a, A b) { return a + b; };
  sum_exp = reduce_lanes(sums, plus);
  sum_exp_offset = WithEntropy ? reduce_lanes(offsets, plus) : A(0);
}

// Overwrites z with exp(z - max) and returns their sum: the fused sweep then
// needs no second exp to form probabilities.
template <class A>
A exp_in_place_row(A* LCE_RESTRICT z, std::int64_t n, A max) {
  A sums[simd_lanes<A>] = {};
  for_each_lane<A>(n, [&](int l, std::int64_t j) {
    const A e = fast_exp(z[j] - max);
    z[j] = e;
    sums[l] += e;
  });
  return reduce_lanes(sums, [](A a, A b) { return a + b; });
}

// sum p z with p = exp(z - lse): this rank's share of E_p[z].
template <class A>
A expected_logit_row(const A* LCE_RESTRICT z, std::int64_t n, A lse) {
  A sums[simd_lanes<A>] = {};
  for_each_lane<A>(n, [&](int l, std::int64_t j) { sums[l] += fast_exp(z[j] - lse) * z[j]; });
  return reduce_lanes(sums, [](A a, A b) { return a + b; });
}

// z -> dL/dz (before the target's +g), chained through the soft-cap when
// inverse_cap > 0.
template <class A, bool WithEntropy, bool WithSoftCap>
void gradient_row(A* LCE_RESTRICT z, std::int64_t n, A lse, A grad_logprob, A grad_entropy, A expected_logit,
                  A inverse_cap) {
  for_each_lane<A>(n, [&](int, std::int64_t j) {
    const A logit = z[j];
    const A p = fast_exp(logit - lse);
    A d = WithEntropy ? logit_gradient(p, logit, grad_logprob, grad_entropy, expected_logit) : -grad_logprob * p;
    if constexpr (WithSoftCap) d *= soft_cap_slope(logit, inverse_cap);
    z[j] = d;
  });
}

template <class A>
void scale_row(A* LCE_RESTRICT z, std::int64_t n, A factor) {
  for_each_lane<A>(n, [&](int, std::int64_t j) { z[j] *= factor; });
}

template <class A>
void zero_row(A* LCE_RESTRICT z, std::int64_t n) {
  for (std::int64_t j = 0; j < n; ++j) z[j] = A(0);
}

}  // namespace detail
LCE_END_NAMESPACE
