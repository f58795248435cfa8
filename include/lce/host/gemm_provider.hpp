#pragma once
// What the host backend needs from a GEMM library, so that a user can plug in
// MKL, BLIS, a JIT or their own kernels: lce::basic_host<Provider>.
//
// A provider is a small copyable object with, for A = float and A = double,
//
//   void gemm(lce::transpose ta, lce::transpose tb, std::int64_t m, std::int64_t n, std::int64_t k,
//             A alpha, const A* a, std::int64_t lda, const A* b, std::int64_t ldb,
//             A beta, A* c, std::int64_t ldc) const;
//
// computing the row-major C[m, n] = alpha op(A)[m, k] op(B)[k, n] + beta C
// (CBLAS's sgemm / dgemm with CblasRowMajor). beta = 0 overwrites C, NaN or
// not. m, n or k may be 0 (then C = beta C, or nothing for an empty C).
//
// Threading. By default lce cuts every GEMM into tiles fixed by the shapes and
// calls the provider once per tile, concurrently from its own threads, on one
// provider object: gemm must be thread-safe and should run on the calling
// thread only (a provider that starts threads of its own inside each call
// oversubscribes the CPU). The results then do not depend on thread counts.
// A provider that parallelises each call itself declares
//
//   static constexpr bool parallelises_itself = true;
//
// and lce calls it from one thread, once per vocabulary tile (a few large
// GEMMs per chunk) instead of once per small tile; whether its results depend
// on its thread count is then up to the provider.
//
// Optional: a bf16 x bf16 -> fp32 GEMM (products of bf16 values are exact in
// fp32; the sums must be accumulated in fp32), used for bfloat16 weights
// instead of widening the weight to fp32, when bf16_gemm_available() says this
// CPU runs it well (the host backend asks once per GEMM):
//
//   bool bf16_gemm_available() const;
//   void bf16_gemm(lce::transpose ta, lce::transpose tb, std::int64_t m, std::int64_t n, std::int64_t k,
//                  float alpha, const lce::bfloat16* a, std::int64_t lda,
//                  const lce::bfloat16* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc) const;
//
// lce calls it with beta = 0 or 1 only. The hidden rows reach it as bf16 only
// when they are bf16 values; dz (the logits' gradient, fp32) is passed as two
// bf16 parts hi + lo (16 significant bits), both multiplied and summed.
//
// Optional, with the bf16 GEMM: a GEMM whose A is fp32, kept to 16 significant bits as
// two bf16 parts hi = bf16(a) and lo = bf16(a - hi) (lo = 0 where hi is not finite), both
// multiplied by B in bf16 (or by B in fp32 holding bf16 values), sums in fp32:
//
//   bool split_bf16_gemm_available() const;
//   void split_bf16_gemm(lce::transpose ta, lce::transpose tb, std::int64_t m, std::int64_t n, std::int64_t k,
//                        float alpha, const float* a, std::int64_t lda,
//                        const lce::bfloat16* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc) const;
//   void split_bf16_gemm(..., const float* a, std::int64_t lda, const float* b, std::int64_t ldb, ...) const;
//
// When available, a bfloat16 weight's dX (dz w, B in bf16) and dW (dz^T x, x the hidden
// rows as floats) run on it, dz as it is, instead of dX on two bf16 GEMMs over dz split in
// a pass of its own and dW as an fp32 GEMM: the hi + lo precision, with no scratch (lce's
// AMX kernel splits A as it packs it).
//
// Optional, with the bf16 GEMM: how fast it runs against memory, as the flops it does in the
// time a pass through memory moves one byte (core/backend.hpp: gemm_flops_per_memory_byte):
//
//   double bf16_gemm_flops_per_memory_byte() const;
//
// The host backend reports it for a bfloat16 operator's GEMMs where bf16_gemm_available();
// without it, default_gemm_flops_per_memory_byte. lce::cblas_gemm says 80 on AMX tiles.
//
// Optional, with the bf16 GEMM: `static constexpr bool bf16_operands = true;`
// Then a bfloat16 operator runs all three GEMMs of a chunk as bf16 x bf16 ->
// fp32: the hidden rows as stored (never widened), and dz rounded once to
// bf16 in its own block before the two gradient GEMMs (unit roundoff 2^-8),
// as GPU fused losses and PyTorch's own bf16 path do. Half the GEMM work of
// the hi + lo form above, no fp32 copy of any weight tile; the price is dz's
// rounding. bf16_gemm must then run on every CPU: lce does not ask
// bf16_gemm_available() for these GEMMs (a provider without bf16
// instructions widens inside bf16_gemm, e.g. detail::widening_bf16_gemm).
//
// Optional, with the bf16 GEMM (and, for the second form, the split one): the same GEMMs
// with a bf16 C that they add into, each element's sum rounded once:
//
//   bool gemm_into_bf16_available() const;
//   void bf16_gemm_into_bf16(lce::transpose ta, lce::transpose tb, std::int64_t m, std::int64_t n,
//                            std::int64_t k, float alpha, const lce::bfloat16* a, std::int64_t lda,
//                            const lce::bfloat16* b, std::int64_t ldb, float beta, lce::bfloat16* c,
//                            std::int64_t ldc) const;
//   void split_bf16_gemm_into_bf16(..., const float* a, std::int64_t lda, const float* b, std::int64_t ldb,
//                                  float beta, lce::bfloat16* c, std::int64_t ldc) const;
//
// c = bf16(alpha op(A) op(B) + beta c), beta 0 (c is not read) or 1: each element's
// products summed in fp32 over all of k, times alpha, added to c widened to fp32 and
// rounded once to nearest even (A split as hi + lo in the second form, B holding bf16
// values). Where gemm_into_bf16_available()
// says it runs well here, lce writes the dW tiles of a bfloat16 grad_weight with it,
// k <= 512 (the tokens of one call's dz block), instead of summing each tile in fp32
// scratch of its workspace and adding that in a pass of its own: the same bits, with
// neither the scratch nor the pass. It must give that result whenever it is called.
//
// Optional: a call_scope type (default-constructible, RAII) that lce holds for
// each operator call and around each GEMM, e.g. to switch a library to one
// thread per call (lce::cblas_gemm does, for OpenBLAS).

#include <lce/core/config.hpp>
#include <lce/core/dtypes.hpp>

#include <concepts>
#include <cstdint>

LCE_BEGIN_NAMESPACE

enum class transpose : bool { no = false, yes = true };

template <class P>
concept gemm_provider =
    std::copy_constructible<P> &&
    requires(const P& provider, transpose op, std::int64_t extent, const float* fa, float* fc, float fs,
             const double* da, double* dc, double ds) {
      provider.gemm(op, op, extent, extent, extent, fs, fa, extent, fa, extent, fs, fc, extent);
      provider.gemm(op, op, extent, extent, extent, ds, da, extent, da, extent, ds, dc, extent);
    };

// A provider with the optional bf16 x bf16 -> fp32 GEMM.
template <class P>
concept bf16_gemm_provider =
    gemm_provider<P> &&
    requires(const P& provider, transpose op, std::int64_t extent, const bfloat16* a, float* c, float s) {
      { provider.bf16_gemm_available() } -> std::convertible_to<bool>;
      provider.bf16_gemm(op, op, extent, extent, extent, s, a, extent, a, extent, s, c, extent);
    };

// A provider with the optional split bf16 GEMM (A in fp32 as hi + lo, B bf16 or fp32).
template <class P>
concept split_bf16_gemm_provider =
    bf16_gemm_provider<P> && requires(const P& provider, transpose op, std::int64_t extent, const float* a,
                                      const bfloat16* b16, const float* b32, float* c, float s) {
      { provider.split_bf16_gemm_available() } -> std::convertible_to<bool>;
      provider.split_bf16_gemm(op, op, extent, extent, extent, s, a, extent, b16, extent, s, c, extent);
      provider.split_bf16_gemm(op, op, extent, extent, extent, s, a, extent, b32, extent, s, c, extent);
    };

// A provider with the optional GEMM into a bf16 C (bf16 A and B).
template <class P>
concept bf16_into_bf16_gemm_provider =
    bf16_gemm_provider<P> && requires(const P& provider, transpose op, std::int64_t extent, const bfloat16* a,
                                      bfloat16* c, float s) {
      { provider.gemm_into_bf16_available() } -> std::convertible_to<bool>;
      provider.bf16_gemm_into_bf16(op, op, extent, extent, extent, s, a, extent, a, extent, s, c, extent);
    };

// A provider with the optional split GEMM into a bf16 C (A in fp32 as hi + lo, B fp32 holding bf16 values).
template <class P>
concept split_bf16_into_bf16_gemm_provider =
    split_bf16_gemm_provider<P> && requires(const P& provider, transpose op, std::int64_t extent, const float* a,
                                            bfloat16* c, float s) {
      { provider.gemm_into_bf16_available() } -> std::convertible_to<bool>;
      provider.split_bf16_gemm_into_bf16(op, op, extent, extent, extent, s, a, extent, a, extent, s, c, extent);
    };

// Whether P parallelises each call itself (see above); false unless it says so.
template <class P>
inline constexpr bool gemm_parallelises_itself = [] {
  if constexpr (requires { P::parallelises_itself; }) {
    return static_cast<bool>(P::parallelises_itself);
  } else {
    return false;
  }
}();

// Whether P's bf16 GEMM takes a bfloat16 operator's hidden rows and dz as
// bf16 (see above); false unless it says so.
template <class P>
inline constexpr bool gemm_reads_bf16_operands = [] {
  if constexpr (bf16_gemm_provider<P> && requires { P::bf16_operands; }) {
    return static_cast<bool>(P::bf16_operands);
  } else {
    return false;
  }
}();

LCE_END_NAMESPACE
