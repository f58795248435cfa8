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
#include <lce/core/simd.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

LCE_BEGIN_SIMD_PACKS

LCE_BEGIN_NAMESPACE
namespace detail {

// exp for the row passes. The standard exp does not vectorise without
// -ffast-math, which a header-only library cannot impose, so fp32 brings its
// own: range reduction by ln 2, rounding with the 1.5 * 2^23 add-and-subtract
// (which, unlike roundf, vectorises), a degree-6 polynomial and the power of
// two built from exponent bits. Relative error about 2e-7. Arguments below
// -87 give 0; the passes only ever call it on arguments <= 0 (z - max).
//
// F is float or a GNU vector of floats (the host's SIMD packs): the same
// arithmetic, one lane or sixteen.
template <class F>
LCE_HOST_DEVICE LCE_ALWAYS_INLINE F fast_exp_fp32(F x) {
  using Int = std::conditional_t<std::is_same_v<F, float>, std::int32_t, decltype(F{} < F{})>;
  const F lowest = F{} + -87.0f;
  const F highest = F{} + 88.0f;
  const F round_shift = F{} + 12582912.0f;  // 1.5 * 2^23
  constexpr float log2e = 1.44269504088896341f;
  constexpr float ln2_hi = 0.693145751953125f;
  constexpr float ln2_lo = 1.42860682030941723e-6f;

  F clamped = x < lowest ? lowest : x;
  clamped = clamped > highest ? highest : clamped;
  const F shifted = clamped * log2e + round_shift;
  const F n = shifted - round_shift;
  const Int exponent = __builtin_bit_cast(Int, shifted) - __builtin_bit_cast(Int, round_shift);
  const F r = (clamped - n * ln2_hi) - n * ln2_lo;
  F p = F{} + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const F scale = __builtin_bit_cast(F, (exponent + 127) << 23);
  return x < lowest ? F{} : p * scale;
}

LCE_HOST_DEVICE LCE_ALWAYS_INLINE float fast_exp(float x) { return fast_exp_fp32(x); }

// log for the logits kept as ratios to their row's largest (see keep_ratio_row),
// in (0, 1]: x = 2^e m with m in [0.75, 1.5), log m = 2 atanh(s), s = (m - 1) / (m + 1),
// |s| <= 0.2, to s^9 (error about 4e-9), and the exponent turned into a float
// through the same 1.5 * 2^23 bias as fast_exp_fp32 (no int-to-float conversion,
// which GNU vectors spell differently). log 1 is exactly 0; 0 gives -inf and a
// NaN stays a NaN.
template <class F>
LCE_HOST_DEVICE LCE_ALWAYS_INLINE F fast_log_fp32(F x) {
  using Int = std::conditional_t<std::is_same_v<F, float>, std::int32_t, decltype(F{} < F{})>;
  constexpr std::int32_t three_quarters = 0x3f400000;  // the bits of 0.75f
  constexpr std::int32_t round_shift_bits = 0x4b400000;  // the bits of 1.5 * 2^23
  constexpr float ln2_hi = 0.693145751953125f;
  constexpr float ln2_lo = 1.42860682030941723e-6f;

  const Int offset = __builtin_bit_cast(Int, x) - three_quarters;
  const Int exponent = offset >> 23;
  const F mantissa = __builtin_bit_cast(F, (offset & 0x7fffff) + three_quarters);
  const F f = mantissa - 1.0f;
  const F s = f / (f + 2.0f);
  const F s2 = s * s;
  F p = F{} + 1.0f / 9.0f;
  p = p * s2 + 1.0f / 7.0f;
  p = p * s2 + 1.0f / 5.0f;
  p = p * s2 + 1.0f / 3.0f;
  p = p * s2 + 1.0f;
  const F e = __builtin_bit_cast(F, exponent + round_shift_bits) - 12582912.0f;
  const F log_x = e * ln2_hi + ((s + s) * p + e * ln2_lo);
  const F zero{};
  const F at_zero = zero + __builtin_bit_cast(float, 0xff800000u);  // -inf
  const F positive = x > zero ? log_x : at_zero;
  return x == x ? positive : x;
}

LCE_HOST_DEVICE LCE_ALWAYS_INLINE float fast_log(float x) { return fast_log_fp32(x); }

LCE_HOST_DEVICE LCE_ALWAYS_INLINE double fast_exp(double x) { return std::exp(x); }

// A logit of -inf (a bias masking its column: padded vocabulary slots, a
// restricted output set) has p = 0 and must add nothing. Two guards keep it
// from turning into 0 * inf = NaN:
//  - exp_centre: the centre of a block's exps is its max, or 0 when every
//    logit is -inf (the exps are then all 0, and merge() skips the partial);
//  - above_exp_floor: x raised to a finite value wherever exp(x) is 0
//    anyway (fast_exp_fp32 is 0 below -87; std::exp below about -745), so
//    that exp(x) * x and p * (c - x) are exactly what they were for finite
//    x, and 0 for x = -inf.
template <class A>
inline constexpr A exp_floor = std::is_same_v<A, float> ? A(-88) : A(-1000);

template <class A, class P>
LCE_HOST_DEVICE LCE_ALWAYS_INLINE P above_exp_floor(P x) {
  const P floor = P{} + exp_floor<A>;
  return x < floor ? floor : x;
}

// The most negative finite value: a constant device code can use too (nvcc
// does not take numeric_limits' functions there).
template <class A>
inline constexpr A lowest_finite = std::numeric_limits<A>::lowest();

template <class A>
LCE_HOST_DEVICE LCE_ALWAYS_INLINE A exp_centre(A max) {
  return max < lowest_finite<A> ? A(0) : max;  // -inf only: a NaN stays
}

// tanh from the same exp, so soft-capping vectorises as well: (1 - e) / (1 + e),
// e = exp(-2|x|), within about 1e-7 relative for |x| >= 1/4. Below that 1 - e cancels:
// its absolute error of about 1e-7, times the cap that scales it, took a soft-cap of
// 1e6 to logits off by 0.1, and |x| < 3e-8 to tanh 0 (the cap silently off). There
// tanh's odd series to x^11 holds it within 1e-9 relative.
template <class F>
LCE_HOST_DEVICE LCE_ALWAYS_INLINE F fast_tanh_fp32(F x) {
  const F zero{};
  const F magnitude = x < zero ? -x : x;
  const F e = fast_exp_fp32(magnitude * -2.0f);
  const F u = magnitude * magnitude;
  const F series =
      magnitude *
      (1.0f + u * (-1.0f / 3 + u * (2.0f / 15 + u * (-17.0f / 315 + u * (62.0f / 2835 + u * (-1382.0f / 155925))))));
  const F quarter = zero + 0.25f;
  const F t = magnitude < quarter ? series : (1.0f - e) / (1.0f + e);
  return x < zero ? -t : t;
}

LCE_HOST_DEVICE LCE_ALWAYS_INLINE float fast_tanh(float x) { return fast_tanh_fp32(x); }

LCE_HOST_DEVICE LCE_ALWAYS_INLINE double fast_tanh(double x) { return std::tanh(x); }

#if LCE_VECTOR_PACKS && !defined(__CUDA_ARCH__)
LCE_ALWAYS_INLINE pack<float> fast_exp(pack<float> x) { return fast_exp_fp32(x); }
LCE_ALWAYS_INLINE pack<float> fast_tanh(pack<float> x) { return fast_tanh_fp32(x); }
LCE_ALWAYS_INLINE pack<float> fast_log(pack<float> x) { return fast_log_fp32(x); }

// double is the precise path: exp and tanh stay the standard ones, lane by lane.
LCE_ALWAYS_INLINE pack<double> fast_exp(pack<double> x) {
  for (int l = 0; l < pack_lanes<double>; ++l) x[l] = std::exp(x[l]);
  return x;
}
LCE_ALWAYS_INLINE pack<double> fast_tanh(pack<double> x) {
  for (int l = 0; l < pack_lanes<double>; ++l) x[l] = std::tanh(x[l]);
  return x;
}
#endif

// The model's soft-cap, then the sampler's temperature (Gemma-2 caps the raw
// logit; vLLM and HF divide what the model returns by the temperature):
//   z = (cap / tau) tanh(s / cap),  s = x . w.
// Folding 1/tau into the scale keeps it one multiply per logit. The slope
// dz/ds = (1/tau)(1 - tanh^2) is written in terms of z; the 1/tau part rides
// on the gradient GEMMs' alpha, so `soft_cap_slope` returns 1 - tanh^2 only.
template <class A>
struct soft_cap_map {
  A inverse_cap = 0;    // 1 / cap; 0: no soft-cap
  A scale = 0;          // cap / tau
  A inverse_scale = 0;  // tau / cap

  LCE_HOST_DEVICE static soft_cap_map make(A cap, A temperature) {
    if (!(cap > A(0))) return {};
    return {A(1) / cap, cap / temperature, temperature / cap};
  }
  LCE_HOST_DEVICE bool enabled() const { return inverse_cap > A(0); }
};

// P is a scalar or a SIMD pack of A.
template <class P, class A>
LCE_HOST_DEVICE LCE_ALWAYS_INLINE P soft_cap(P raw_logit, const soft_cap_map<A>& map) {
  return fast_tanh(raw_logit * map.inverse_cap) * map.scale;
}

template <class P, class A>
LCE_HOST_DEVICE LCE_ALWAYS_INLINE P soft_cap_slope(P capped, const soft_cap_map<A>& map) {
  const P ratio = capped * map.inverse_scale;  // tanh(s / cap)
  return A(1) - ratio * ratio;
}

// The column of a row's target in a shard of `columns` vocabulary rows that
// starts at global id `vocab_start`, or -1 (ignored, or held by another shard).
template <class I>
LCE_HOST_DEVICE inline std::int64_t local_target(I target, std::int64_t vocab_start, std::int64_t ignore_index,
                                                 std::int64_t columns) {
  const auto id = static_cast<std::int64_t>(target);
  const std::int64_t local = id - vocab_start;
  return id != ignore_index && local >= 0 && local < columns ? local : -1;
}

// The single target a row of a target set stands in with when not all its
// ids are ignored: an id outside every shard that is not ignore_index, so the
// row counts but no single-target term lands anywhere.
LCE_HOST_DEVICE constexpr std::int64_t held_by_no_shard(std::int64_t ignore_index) {
  return ignore_index == -1 ? -2 : -1;
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
  A sum_logit = 0;        // sum z (the mean logit's numerator; kept only when asked for)
};

template <class A>
LCE_HOST_DEVICE inline row_partial<A> merge(const row_partial<A>& a, const row_partial<A>& b) {
  const A target_logit = a.target_logit + b.target_logit, sum_logit = a.sum_logit + b.sum_logit;
  if (b.sum_exp == A(0)) return {a.max, a.sum_exp, a.sum_exp_offset, target_logit, sum_logit};
  if (a.sum_exp == A(0)) return {b.max, b.sum_exp, b.sum_exp_offset, target_logit, sum_logit};
  const A max = a.max > b.max ? a.max : b.max;
  const A shift_a = a.max - max;  // <= 0
  const A shift_b = b.max - max;
  const A scale_a = std::exp(shift_a);
  const A scale_b = std::exp(shift_b);
  // Re-centre t on the new maximum: sum e^(z-M)(z-M) = scale * (t + (m - M) s).
  return {max, a.sum_exp * scale_a + b.sum_exp * scale_b,
          scale_a * (a.sum_exp_offset + shift_a * a.sum_exp) + scale_b * (b.sum_exp_offset + shift_b * b.sum_exp),
          target_logit, sum_logit};
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
// one-hot is ever built. Logits enter centred on the row's lse
// (`centred` = z - lse, `mean_centred` = E_p[z] - lse = -entropy): both are
// of order one, whereas E_p[z] - z computed from logits near 1e4 would
// cancel away most of fp32's digits.
template <class P, class A>
LCE_HOST_DEVICE LCE_ALWAYS_INLINE P logit_gradient(P p, P centred, A grad_logprob, A grad_entropy, A mean_centred) {
  return p * ((mean_centred - above_exp_floor<A>(centred)) * grad_entropy - grad_logprob);
}

// The row terms of a loss beyond log p(y) and the entropy, folded into the
// two numbers the per-logit gradient needs: dlse/dz = p, so dL/dlse joins the
// -g of every logit (the target keeps its +g); d(mean logit)/dz = 1/V, the
// same for every logit.
template <class A>
struct extra_row_terms {
  A grad_logprob_of_p;  // g - dL/dlse: what multiplies -p
  A uniform;            // dL/d(mean logit) / V: added to every logit's gradient
};

template <class A>
LCE_HOST_DEVICE inline extra_row_terms<A> fold_row_terms(A grad_logprob, A grad_lse, A grad_mean_logit,
                                                         A inverse_vocab) {
  return {grad_logprob - grad_lse, grad_mean_logit * inverse_vocab};
}

// dL/dlse of a row: the given one plus a z-loss's 2 c lse (c the coefficient
// of lse^2; either pointer may be null).
template <class A>
LCE_HOST_DEVICE inline A lse_gradient(const A* grad_lse, const A* lse_squared, const A* lse, std::int64_t r) {
  return (grad_lse ? grad_lse[r] : A(0)) + (lse_squared ? A(2) * lse_squared[r] * lse[r] : A(0));
}

}  // namespace detail
LCE_END_NAMESPACE

LCE_END_SIMD_PACKS
