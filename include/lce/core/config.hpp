#pragma once
// Build-wide switches shared by every lce header.

#define LCE_VERSION_MAJOR 0
#define LCE_VERSION_MINOR 1
#define LCE_VERSION_PATCH 0

// Row math is compiled for the host and, under nvcc, for the device too.
#if defined(__CUDACC__)
#define LCE_HOST_DEVICE __host__ __device__
#else
#define LCE_HOST_DEVICE
#endif

#if defined(__GNUC__) || defined(__clang__)
#define LCE_RESTRICT __restrict__
#define LCE_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define LCE_RESTRICT
#define LCE_ALWAYS_INLINE inline
#endif

// SIMD packs (core/simd.hpp) are only ever passed between always-inlined
// functions, so g++'s note that their by-value ABI differs without AVX-512
// does not concern them; headers that pass packs open and close this region.
#if defined(__GNUC__) && !defined(__clang__)
#define LCE_BEGIN_SIMD_PACKS _Pragma("GCC diagnostic push") _Pragma("GCC diagnostic ignored \"-Wpsabi\"")
#define LCE_END_SIMD_PACKS _Pragma("GCC diagnostic pop")
#else
#define LCE_BEGIN_SIMD_PACKS
#define LCE_END_SIMD_PACKS
#endif

// The host backend's bf16 GEMMs through oneDNN (CMake: LCE_BF16_GEMM), in C++
// translation units only: oneDNN's headers stop nvcc 13's front end (an
// internal error), so CUDA translation units keep the widening path for a
// host-side bf16 weight (same results up to fp32 rounding of the products).
#if defined(LCE_BF16_GEMM_ONEDNN) && !defined(__CUDACC__)
#define LCE_HOST_BF16_GEMM_ONEDNN 1
#else
#define LCE_HOST_BF16_GEMM_ONEDNN 0
#endif

// A versioned inline namespace (as CUB does) keeps two shared libraries built
// against different lce versions from silently sharing one instantiation.
#define LCE_ABI_NAMESPACE v0_1
#define LCE_BEGIN_NAMESPACE \
  namespace lce {           \
  inline namespace LCE_ABI_NAMESPACE {
#define LCE_END_NAMESPACE \
  }                       \
  }
