#pragma once
// Element conversions between storage and compute types, row by row.
// Branch-free conversions (core/dtypes.hpp) let these loops vectorise.

#include <lce/core/config.hpp>
#include <lce/core/dtypes.hpp>

#include <cstdint>
#include <cstring>

LCE_BEGIN_NAMESPACE
namespace detail {

template <class From, class To>
void convert_span(const From* LCE_RESTRICT source, To* LCE_RESTRICT target, std::int64_t n) {
  for (std::int64_t j = 0; j < n; ++j) target[j] = convert<To>(source[j]);
}

// target += source, summed in the wider of the two types and rounded once.
template <class From, class To>
void add_span(const From* LCE_RESTRICT source, To* LCE_RESTRICT target, std::int64_t n) {
  using Sum = std::conditional_t<std::same_as<From, double> || std::same_as<To, double>, double, float>;
  for (std::int64_t j = 0; j < n; ++j) target[j] = convert<To>(convert<Sum>(target[j]) + convert<Sum>(source[j]));
}

// to[i] = bf16(from[i]); false when some from[i] is not a bf16 value (low 16 bits set).
inline bool round_to_bf16_exact(const float* from, bfloat16* to, std::int64_t n) {
  std::uint32_t low = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    std::uint32_t bits;
    std::memcpy(&bits, from + i, sizeof bits);
    low |= bits & 0xffffu;
    to[i] = bfloat16::from_bits(static_cast<std::uint16_t>(bits >> 16));
  }
  return low == 0;
}

// hi[i] + lo[i] = from[i] to 16 significant bits: hi = bf16(from), lo = bf16(from - hi)
// (lo = 0 where hi is not finite).
inline void split_to_bf16(const float* from, bfloat16* hi, bfloat16* lo, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) {
    const bfloat16 h(from[i]);
    const float high = static_cast<float>(h), rest = from[i] - high;
    hi[i] = h;
    lo[i] = bfloat16(high - high == 0.0f ? rest : 0.0f);
  }
}

}  // namespace detail
LCE_END_NAMESPACE
