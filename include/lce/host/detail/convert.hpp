#pragma once
// Element conversions between storage and compute types, row by row.
// float -> bf16 (the rounding of dz and of a 2-byte grad_weight's sums) runs
// a SIMD pack at a time (core/simd.hpp): the compilers keep the scalar
// rounding's NaN test as a branch, which stops their vectoriser. Same bits
// as the scalar bfloat16(float).

#include <lce/core/config.hpp>
#include <lce/core/dtypes.hpp>
#include <lce/core/simd.hpp>

#include <cstdint>
#include <cstring>

LCE_BEGIN_SIMD_PACKS

LCE_BEGIN_NAMESPACE
namespace detail {

#if LCE_VECTOR_PACKS
// The bf16 bits of a pack of floats: round to nearest even, a NaN kept and made quiet.
using bf16_bits_pack = std::uint16_t __attribute__((vector_size(pack_bytes / 2)));

LCE_ALWAYS_INLINE bf16_bits_pack round_pack_to_bf16(const pack<float>& value) {
  using bits_pack = pack<std::uint32_t>;
  bits_pack bits;
  std::memcpy(&bits, &value, sizeof bits);
  const bits_pack rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const bits_pack quiet_nan = (bits >> 16) | 0x40u;
  const auto is_nan = (bits & 0x7fffffffu) > 0x7f800000u;  // lanes of all ones where NaN
  const bits_pack chosen = (quiet_nan & is_nan) | (rounded & ~is_nan);
  return __builtin_convertvector(chosen, bf16_bits_pack);
}

LCE_ALWAYS_INLINE pack<float> widen_bf16_pack(const bfloat16* source) {
  using narrow = bf16_bits_pack;
  narrow raw;
  std::memcpy(&raw, source, sizeof raw);
  const pack<std::uint32_t> bits = __builtin_convertvector(raw, pack<std::uint32_t>) << 16;
  pack<float> value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}
#endif

inline void convert_span(const float* LCE_RESTRICT source, bfloat16* LCE_RESTRICT target, std::int64_t n) {
  std::int64_t j = 0;
#if LCE_VECTOR_PACKS
  constexpr int lanes = pack_lanes<float>;
  for (; j + lanes <= n; j += lanes) {
    const bf16_bits_pack bits = round_pack_to_bf16(load_pack(source + j));
    std::memcpy(target + j, &bits, sizeof bits);
  }
#endif
  for (; j < n; ++j) target[j] = bfloat16(source[j]);
}

// convert_span to bf16 where `target` may also start where `source` starts
// (a row rounded over its own first half): each pack is read before it is
// written, and the writes (2 bytes per element) trail the reads (4 bytes).
inline void round_row_to_bf16(const float* source, bfloat16* target, std::int64_t n) {
  std::int64_t j = 0;
#if LCE_VECTOR_PACKS
  constexpr int lanes = pack_lanes<float>;
  for (; j + lanes <= n; j += lanes) {
    const bf16_bits_pack bits = round_pack_to_bf16(load_pack(source + j));
    std::memcpy(static_cast<void*>(target + j), &bits, sizeof bits);
  }
#endif
  for (; j < n; ++j) {
    float value;
    std::memcpy(&value, source + j, sizeof value);
    const bfloat16 rounded(value);
    std::memcpy(static_cast<void*>(target + j), &rounded, sizeof rounded);
  }
}

// target += source, summed in fp32 and rounded once.
inline void add_span(const float* LCE_RESTRICT source, bfloat16* LCE_RESTRICT target, std::int64_t n) {
  std::int64_t j = 0;
#if LCE_VECTOR_PACKS
  constexpr int lanes = pack_lanes<float>;
  for (; j + lanes <= n; j += lanes) {
    const bf16_bits_pack bits = round_pack_to_bf16(widen_bf16_pack(target + j) + load_pack(source + j));
    std::memcpy(target + j, &bits, sizeof bits);
  }
#endif
  for (; j < n; ++j) target[j] = bfloat16(static_cast<float>(target[j]) + source[j]);
}

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
inline void split_to_bf16(const float* LCE_RESTRICT from, bfloat16* LCE_RESTRICT hi, bfloat16* LCE_RESTRICT lo,
                          std::int64_t n) {
  std::int64_t i = 0;
#if LCE_VECTOR_PACKS
  constexpr int lanes = pack_lanes<float>;
  using bits_pack = pack<std::uint32_t>;
  for (; i + lanes <= n; i += lanes) {
    const pack<float> value = load_pack(from + i);
    const bf16_bits_pack high_bits = round_pack_to_bf16(value);
    std::memcpy(hi + i, &high_bits, sizeof high_bits);
    const pack<float> high = widen_bf16_pack(hi + i);
    const pack<float> rest = value - high;
    const auto finite = (high - high) == 0.0f;  // all ones where high is finite
    bits_pack rest_bits, keep;
    std::memcpy(&rest_bits, &rest, sizeof rest_bits);
    std::memcpy(&keep, &finite, sizeof keep);
    rest_bits &= keep;
    pack<float> kept;
    std::memcpy(&kept, &rest_bits, sizeof kept);
    const bf16_bits_pack low_bits = round_pack_to_bf16(kept);
    std::memcpy(lo + i, &low_bits, sizeof low_bits);
  }
#endif
  for (; i < n; ++i) {
    const bfloat16 h(from[i]);
    const float high = static_cast<float>(h), rest = from[i] - high;
    hi[i] = h;
    lo[i] = bfloat16(high - high == 0.0f ? rest : 0.0f);
  }
}

}  // namespace detail
LCE_END_NAMESPACE

LCE_END_SIMD_PACKS
