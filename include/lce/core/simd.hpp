#pragma once
// Fixed-width SIMD packs the host row passes are written over.
//
// GNU vector extensions (g++, clang) let the row passes be written once as
// plain arithmetic on packs as wide as one register of the target the user
// compiles for (AVX-512: 64 bytes, AVX: 32, otherwise 16: SSE2, NEON), so
// the passes are vectorised at any optimisation level, with no reliance on
// the auto-vectoriser or -ffast-math. (Packs wider than the registers get
// split poorly, selects even scalarised, hence one register exactly.) Without
// vector extensions a pack is a single element and the same code runs scalar.
// The pack width fixes the order of each row's sums, so results are bitwise
// reproducible for a given build, whatever the thread count.

#include <lce/core/config.hpp>

#include <cmath>
#include <cstring>

LCE_BEGIN_SIMD_PACKS

LCE_BEGIN_NAMESPACE
namespace detail {

#if defined(__GNUC__) || defined(__clang__)
#define LCE_VECTOR_PACKS 1
#if defined(__AVX512F__)
inline constexpr int pack_bytes = 64;
#elif defined(__AVX__)
inline constexpr int pack_bytes = 32;
#else
inline constexpr int pack_bytes = 16;
#endif
template <class A>
struct pack_of {
  typedef A type __attribute__((vector_size(pack_bytes)));
  static constexpr int lanes = pack_bytes / static_cast<int>(sizeof(A));
};
#else
#define LCE_VECTOR_PACKS 0
template <class A>
struct pack_of {
  using type = A;
  static constexpr int lanes = 1;
};
#endif

template <class A>
using pack = typename pack_of<A>::type;
template <class A>
inline constexpr int pack_lanes = pack_of<A>::lanes;

template <class A>
LCE_ALWAYS_INLINE pack<A> load_pack(const A* source) {
  pack<A> value;
  std::memcpy(&value, source, sizeof(value));
  return value;
}

template <class A>
LCE_ALWAYS_INLINE void store_pack(A* target, const pack<A>& value) {
  std::memcpy(target, &value, sizeof(value));
}

template <class A>
LCE_ALWAYS_INLINE pack<A> splat(A value) {
  return pack<A>{} + value;
}

}  // namespace detail
LCE_END_NAMESPACE

LCE_END_SIMD_PACKS
