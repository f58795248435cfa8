#pragma once
// Loops over one row of logits, built on core/row_math.hpp and SIMD packs.
//
// Every reduction keeps one pack of independent lane sums and merges the
// lanes in a fixed order at the end; the tail of a row lands in the lanes it
// would occupy in a longer row. So a row's result depends only on the row,
// never on the thread that computed it.

#include <lce/core/config.hpp>
#include <lce/core/row_math.hpp>
#include <lce/core/simd.hpp>
#include <lce/host/detail/convert.hpp>

#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

LCE_BEGIN_SIMD_PACKS

LCE_BEGIN_NAMESPACE
namespace detail {

// Folds map(z[j]) into lanes with combine; the same lambdas serve packs and
// the scalar tail.
template <class A, class Map, class Combine>
LCE_ALWAYS_INLINE A reduce_row(const A* LCE_RESTRICT z, std::int64_t n, A identity, Map&& map, Combine&& combine) {
  constexpr int L = pack_lanes<A>;
  pack<A> accumulator = splat(identity);
  std::int64_t j = 0;
  for (; j + L <= n; j += L) accumulator = combine(accumulator, map(load_pack(z + j)));
  A lanes[L];
  store_pack(lanes, accumulator);
  for (int l = 0; j + l < n; ++l) lanes[l] = combine(lanes[l], map(z[j + l]));
  for (int width = L / 2; width > 0; width /= 2)
    for (int l = 0; l < width; ++l) lanes[l] = combine(lanes[l], lanes[l + width]);
  return lanes[0];
}

// z[j] = map(z[j]).
template <class A, class Map>
LCE_ALWAYS_INLINE void transform_row(A* LCE_RESTRICT z, std::int64_t n, Map&& map) {
  constexpr int L = pack_lanes<A>;
  std::int64_t j = 0;
  for (; j + L <= n; j += L) store_pack(z + j, map(load_pack(z + j)));
  for (; j < n; ++j) z[j] = map(z[j]);
}

inline constexpr auto plus = [](auto a, auto b) { return a + b; };
inline constexpr auto larger = [](auto a, auto b) { return a > b ? a : b; };

template <class A>
A row_max(const A* z, std::int64_t n) {
  return reduce_row(z, n, -std::numeric_limits<A>::infinity(), [](auto v) { return v; }, larger);
}

// Raw logits s -> tempered, soft-capped z (see soft_cap_map).
template <class A>
void soft_cap_row(A* z, std::int64_t n, const soft_cap_map<A>& map) {
  transform_row(z, n, [=](auto v) { return soft_cap(v, map); });
}

// s = sum exp(z - max) and, when the entropy is wanted, t = sum exp(z - max)(z - max).
template <class A, bool WithEntropy>
void sum_exp_row(const A* z, std::int64_t n, A max, A& sum_exp, A& sum_exp_offset) {
  sum_exp = reduce_row(z, n, A(0), [=](auto v) { return fast_exp(v - max); }, plus);
  sum_exp_offset = WithEntropy ? reduce_row(
                                     z, n, A(0),
                                     [=](auto v) {
                                       const auto shifted = v - max;
                                       return fast_exp(shifted) * above_exp_floor<A>(shifted);
                                     },
                                     plus)
                               : A(0);
}

// Overwrites z with exp(z - max) and returns their sum: the fused sweep then
// needs no second exp to form probabilities.
template <class A>
A exp_in_place_row(A* z, std::int64_t n, A max) {
  transform_row(z, n, [=](auto v) { return fast_exp(v - max); });
  return reduce_row(z, n, A(0), [](auto v) { return v; }, plus);
}

// sum p (z - lse) with p = exp(z - lse): this rank's share of E_p[z] - lse.
template <class A>
A mean_centred_logit_row(const A* z, std::int64_t n, A lse) {
  return reduce_row(
      z, n, A(0),
      [=](auto v) {
        const auto centred = v - lse;
        return fast_exp(centred) * above_exp_floor<A>(centred);
      },
      plus);
}

// z -> dL/dz (before the target's +g), chained through the soft-cap when
// WithSoftCap (z is then the capped logit; the 1/tau is the GEMMs' alpha).
// `uniform` is added to every logit's gradient (see fold_row_terms).
template <class A, bool WithEntropy, bool WithSoftCap>
void gradient_row(A* z, std::int64_t n, A lse, A grad_logprob, A grad_entropy, A mean_centred, A uniform,
                  soft_cap_map<A> cap) {
  transform_row(z, n, [=](auto logit) {
    const auto centred = logit - lse;
    const auto p = fast_exp(centred);
    auto d = WithEntropy ? logit_gradient(p, centred, grad_logprob, grad_entropy, mean_centred) : p * -grad_logprob;
    d = d + uniform;
    if constexpr (WithSoftCap) d = d * soft_cap_slope(logit, cap);
    return d;
  });
}

// z = z * factor + uniform: dz from a block holding exp(z - max).
template <class A>
void scale_row(A* z, std::int64_t n, A factor, A uniform) {
  transform_row(z, n, [=](auto v) { return v * factor + uniform; });
}

// A row of logits kept between the vocabulary order's two sweeps in 2 bytes a
// logit: r = bf16(exp(z - c)) with c = exp_centre(max z), returned. Back as
// c + log r (expand_ratio_row): z to 2^-8 (half a bf16 ulp of r) where r is
// normal (z - c above -87), exactly where z is the row's largest (r = 1; the
// one logit whose p may be near 1, so that 1 - p keeps its digits), and -inf
// where r is 0. Every p = exp(z - lse) then carries a relative error of at
// most 2^-8, the rounding its dz gets anyway as a bf16 GEMM operand.
// (Templates, as every pass here, so that a translation unit of device code that sees
// them, where the pack overloads of fast_exp and fast_log are hidden, never compiles them.)
template <class A>
A keep_ratio_row(const A* z, std::int64_t n, bfloat16* ratios) {
  static_assert(std::is_same_v<A, float>, "ratios keep fp32 logits");
  const float centre = exp_centre(row_max(z, n));
  std::int64_t j = 0;
#if LCE_VECTOR_PACKS
  constexpr int lanes = pack_lanes<float>;
  for (; j + lanes <= n; j += lanes) {
    const bf16_bits_pack bits = round_pack_to_bf16(fast_exp(load_pack(z + j) - centre));
    std::memcpy(static_cast<void*>(ratios + j), &bits, sizeof bits);
  }
#endif
  for (; j < n; ++j) ratios[j] = bfloat16(fast_exp(z[j] - centre));
  return centre;
}

// z = centre + log r: the logits of keep_ratio_row.
template <class A>
void expand_ratio_row(const bfloat16* ratios, std::int64_t n, A centre, A* z) {
  static_assert(std::is_same_v<A, float>, "ratios keep fp32 logits");
  std::int64_t j = 0;
#if LCE_VECTOR_PACKS
  constexpr int lanes = pack_lanes<float>;
  for (; j + lanes <= n; j += lanes) store_pack(z + j, fast_log(widen_bf16_pack(ratios + j)) + centre);
#endif
  for (; j < n; ++j) z[j] = fast_log(static_cast<float>(ratios[j])) + centre;
}

// z = r factor + uniform from a row of ratios r = bf16(exp(z - c)) (keep_exp_ratios): the
// rescale of scale_row with the ratios widened as it goes.
template <class A>
void scale_ratio_row(const bfloat16* ratios, std::int64_t n, A factor, A uniform, A* z) {
  std::int64_t j = 0;
#if LCE_VECTOR_PACKS
  if constexpr (std::is_same_v<A, float>) {
    constexpr int lanes = pack_lanes<float>;
    for (; j + lanes <= n; j += lanes) store_pack(z + j, widen_bf16_pack(ratios + j) * factor + uniform);
  }
#endif
  for (; j < n; ++j) z[j] = static_cast<A>(static_cast<float>(ratios[j])) * factor + uniform;
}

template <class A>
void zero_row(A* z, std::int64_t n) {
  for (std::int64_t j = 0; j < n; ++j) z[j] = A(0);
}

}  // namespace detail
LCE_END_NAMESPACE

LCE_END_SIMD_PACKS
