#pragma once
// Storage types of the hidden states and weights, and the arithmetic type
// each one is computed in.
//
// bfloat16 and float16 are plain 2-byte structs, bit-compatible with CUDA's
// __nv_bfloat16 / __half and torch's bf16 / fp16, so a caller can hand lce a
// pointer to either. Conversions are branch-free so that block conversions
// vectorise; they round to nearest even and keep NaN and infinities.

#include <lce/core/config.hpp>

#include <concepts>
#include <cstdint>
#include <type_traits>

LCE_BEGIN_NAMESPACE

namespace detail {

LCE_HOST_DEVICE constexpr std::uint32_t bits_of(float value) { return __builtin_bit_cast(std::uint32_t, value); }
LCE_HOST_DEVICE constexpr float float_of(std::uint32_t bits) { return __builtin_bit_cast(float, bits); }

LCE_HOST_DEVICE constexpr std::uint16_t float_to_bfloat16_bits(float value) {
  const std::uint32_t bits = bits_of(value);
  const std::uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const std::uint32_t quiet_nan = (bits >> 16) | 0x40u;
  const bool is_nan = (bits & 0x7fffffffu) > 0x7f800000u;
  return static_cast<std::uint16_t>(is_nan ? quiet_nan : rounded);
}

LCE_HOST_DEVICE constexpr float bfloat16_bits_to_float(std::uint16_t bits) {
  return float_of(static_cast<std::uint32_t>(bits) << 16);
}

LCE_HOST_DEVICE constexpr float float16_bits_to_float(std::uint16_t bits) {
  const std::uint32_t sign = (static_cast<std::uint32_t>(bits) & 0x8000u) << 16;
  const std::uint32_t magnitude = static_cast<std::uint32_t>(bits) & 0x7fffu;
  // Normal halves: shifting the exponent-and-mantissa into place and scaling
  // by 2^112 moves the exponent bias from 15 to 127. Subnormal halves are
  // magnitude x 2^-24, exact in a float: their shifted pattern would be a float
  // denormal, which flush-to-zero arithmetic (nvcc -ftz, fast math) reads as 0.
  const std::uint32_t normal = bits_of(float_of(magnitude << 13) * 0x1p112f);
  const std::uint32_t subnormal = bits_of(static_cast<float>(magnitude) * 0x1p-24f);
  std::uint32_t widened = magnitude < 0x400u ? subnormal : normal;
  widened = magnitude >= 0x7c00u ? (widened | 0x7f800000u) : widened;
  return float_of(widened | sign);
}

LCE_HOST_DEVICE constexpr std::uint16_t float_to_float16_bits(float value) {
  const std::uint32_t bits = bits_of(value);
  const std::uint32_t sign = (bits >> 16) & 0x8000u;
  const std::uint32_t magnitude = bits & 0x7fffffffu;

  // Below 2^-14 the result is subnormal: adding 0.5f aligns the mantissa so the
  // hardware's own round-to-nearest-even does the rounding.
  const std::uint32_t subnormal = bits_of(float_of(magnitude) + 0.5f) - 0x3f000000u;
  // Normal range: rebias the exponent and round to nearest even by hand.
  const std::uint32_t mantissa_is_odd = (magnitude >> 13) & 1u;
  const std::uint32_t normal = (magnitude + 0xc8000fffu + mantissa_is_odd) >> 13;

  std::uint32_t result = magnitude < 0x38800000u ? subnormal : normal;
  result = magnitude >= 0x477ff000u ? 0x7c00u : result;  // rounds past 65504: infinity
  result = magnitude > 0x7f800000u ? 0x7e00u : result;   // NaN stays NaN
  return static_cast<std::uint16_t>(result | sign);
}

}  // namespace detail

struct bfloat16 {
  std::uint16_t bits;

  bfloat16() = default;
  LCE_HOST_DEVICE constexpr bfloat16(float value) : bits(detail::float_to_bfloat16_bits(value)) {}
  LCE_HOST_DEVICE constexpr explicit operator float() const { return detail::bfloat16_bits_to_float(bits); }
  LCE_HOST_DEVICE static constexpr bfloat16 from_bits(std::uint16_t raw) {
    bfloat16 result;
    result.bits = raw;
    return result;
  }
};

struct float16 {
  std::uint16_t bits;

  float16() = default;
  LCE_HOST_DEVICE constexpr float16(float value) : bits(detail::float_to_float16_bits(value)) {}
  LCE_HOST_DEVICE constexpr explicit operator float() const { return detail::float16_bits_to_float(bits); }
  LCE_HOST_DEVICE static constexpr float16 from_bits(std::uint16_t raw) {
    float16 result;
    result.bits = raw;
    return result;
  }
};

static_assert(sizeof(bfloat16) == 2 && std::is_trivially_copyable_v<bfloat16>);
static_assert(sizeof(float16) == 2 && std::is_trivially_copyable_v<float16>);

// The element types hidden states and weights may be stored in.
template <class T>
concept storage_type = std::same_as<T, float> || std::same_as<T, double> || std::same_as<T, bfloat16> ||
                       std::same_as<T, float16>;

template <class T>
concept half_precision = std::same_as<T, bfloat16> || std::same_as<T, float16>;

// The type logits, statistics and gradients are computed in: double stays
// double, everything else is computed in fp32.
template <storage_type T>
using compute_t = std::conditional_t<std::same_as<T, double>, double, float>;

// Result element types: log-probs, lse and entropy are float or double.
template <class T>
concept result_type = std::same_as<T, float> || std::same_as<T, double>;

// Target ids.
template <class T>
concept target_id_type = std::same_as<T, std::int32_t> || std::same_as<T, std::int64_t>;

namespace detail {

template <class To, class From>
LCE_HOST_DEVICE constexpr To convert(From value) {
  if constexpr (std::same_as<To, From>) {
    return value;
  } else if constexpr (half_precision<From>) {
    return static_cast<To>(static_cast<float>(value));
  } else if constexpr (half_precision<To>) {
    return To(static_cast<float>(value));
  } else {
    return static_cast<To>(value);
  }
}

}  // namespace detail

LCE_END_NAMESPACE
