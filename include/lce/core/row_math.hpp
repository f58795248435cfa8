#pragma once
// The arithmetic of one logit row, shared by every backend.
//
// A backend computes a block of logits with a GEMM and then calls these
// functions element by element (host loops, CUDA threads). Keeping them in
// one place means the CPU tests cover the math the GPU runs.
//
// Notation (DESIGN.md section 1): z the (tempered, soft-capped) logit,
// m the row maximum, s = sum exp(z - m), t = sum exp(z - m) (z - m).
// Then lse = m + log s, entropy = log s - t / s, E_p[z] = lse - entropy.

#include <lce/core/config.hpp>
#include <lce/core/dtypes.hpp>

#include <cmath>
#include <cstdint>
#include <limits>

LCE_BEGIN_NAMESPACE
namespace detail {

// exp for the row passes. The standard exp does not vectorise without
// -ffast-math, which a header-only library cannot impose, so fp32 brings its
// own: range reduction by ln 2, rounding with the 1.5 * 2^23 add-and-subtract
// (which, unlike roundf, vectorises), a degree-6 polynomial and the power of
// two built from exponent bits. Relative error about 2e-7. Arguments below
// -87 give 0; the passes only ever call it on arguments <= 0 (z - max).
LCE_HOST_DEVICE LCE_ALWAYS_INLINE float fast_exp(float x) {
  constexpr float lowest = -87.0f;
  constexpr float highest = 88.0f;
  constexpr float log2e = 1.44269504088896341f;
  constexpr float ln2_hi = 0.693145751953125f;
  constexpr float ln2_lo = 1.42860682030941723e-6f;
  constexpr float round_shift = 12582912.0f;  // 1.5 * 2^23

  const float clamped = x < lowest ? lowest : (x > highest ? highest : x);
  const float shifted = clamped * log2e + round_shift;
  const float n = shifted - round_shift;
  const std::int32_t exponent =
      static_cast<std::int32_t>(bits_of(shifted)) - static_cast<std::int32_t>(bits_of(round_shift));
  const float r = (clamped - n * ln2_hi) - n * ln2_lo;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const float scale = float_of(static_cast<std::uint32_t>(exponent + 127) << 23);
  return x < lowest ? 0.0f : p * scale;
}

LCE_HOST_DEVICE LCE_ALWAYS_INLINE double fast_exp(double x) { return std::exp(x); }

// tanh from the same exp, so soft-capping vectorises as well. Absolute error
// about 1e-7, which is the rounding of the fp32 logit it is applied to.
LCE_HOST_DEVICE LCE_ALWAYS_INLINE float fast_tanh(float x) {
  const float magnitude = x < 0.0f ? -x : x;
  const float e = fast_exp(-2.0f * magnitude);
  const float t = (1.0f - e) / (1.0f + e);
  return x < 0.0f ? -t : t;
}

LCE_HOST_DEVICE LCE_ALWAYS_INLINE double fast_tanh(double x) { return std::tanh(x); }

template <class A>
LCE_HOST_DEVICE LCE_ALWAYS_INLINE A soft_cap(A z, A cap) {
  return cap * fast_tanh(z / cap);
}

// d(cap * tanh(u / cap)) / du, written in terms of the capped value.
template <class A>
LCE_HOST_DEVICE LCE_ALWAYS_INLINE A soft_cap_slope(A capped, A inverse_cap) {
  const A ratio = capped * inverse_cap;
  return A(1) - ratio * ratio;
}

// The statistics of a row over part of the vocabulary (one block, one rank).
// Partials merge associatively, which is what lets the vocabulary be split
// across blocks and ranks. `target_logit` is 0 where the part does not hold
// the target, so merging adds it.
template <class A>
struct row_partial {
  A max = -std::numeric_limits<A>::infinity();
  A sum_exp = 0;          // s = sum exp(z - max)
  A sum_exp_offset = 0;   // t = sum exp(z - max) (z - max)
  A target_logit = 0;
};

template <class A>
LCE_HOST_DEVICE inline row_partial<A> merge(const row_partial<A>& a, const row_partial<A>& b) {
  if (b.sum_exp == A(0)) return {a.max, a.sum_exp, a.sum_exp_offset, a.target_logit + b.target_logit};
  if (a.sum_exp == A(0)) return {b.max, b.sum_exp, b.sum_exp_offset, a.target_logit + b.target_logit};
  const A max = a.max > b.max ? a.max : b.max;
  const A shift_a = a.max - max;  // <= 0
  const A shift_b = b.max - max;
  const A scale_a = std::exp(shift_a);
  const A scale_b = std::exp(shift_b);
  // Re-centre t on the new maximum: sum e^(z-M)(z-M) = scale * (t + (m - M) s).
  return {max, a.sum_exp * scale_a + b.sum_exp * scale_b,
          scale_a * (a.sum_exp_offset + shift_a * a.sum_exp) + scale_b * (b.sum_exp_offset + shift_b * b.sum_exp),
          a.target_logit + b.target_logit};
}

template <class A>
struct row_result {
  A logprob;
  A lse;
  A entropy;
};

// `ignored` rows keep their lse (harmless, and backward can still recompute)
// but report log-prob 0 and entropy 0.
template <class A>
LCE_HOST_DEVICE inline row_result<A> finalize(const row_partial<A>& row, bool ignored) {
  const A log_sum = std::log(row.sum_exp);
  const A lse = row.max + log_sum;
  if (ignored) return {A(0), lse, A(0)};
  return {row.target_logit - lse, lse, log_sum - row.sum_exp_offset / row.sum_exp};
}

// d(loss)/dz for one logit, from dz = g (1[v = y] - p) + h p (E_p[z] - z);
// the g at the target column is added once per row by the caller, so no
// one-hot is ever built.
template <class A>
LCE_HOST_DEVICE LCE_ALWAYS_INLINE A logit_gradient(A p, A z, A grad_logprob, A grad_entropy, A expected_logit) {
  return p * (grad_entropy * (expected_logit - z) - grad_logprob);
}

}  // namespace detail
LCE_END_NAMESPACE
