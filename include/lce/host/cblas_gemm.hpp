#pragma once
// lce's default GEMM provider (see gemm_provider.hpp): the CBLAS lce links
// (OpenBLAS, BLIS, MKL, ...), one single-threaded call per GEMM tile, and for a
// bfloat16 weight's GEMMs a bf16 x bf16 -> fp32 GEMM where the CPU has bf16
// instructions: lce's own kernel on AMX or AVX512-BF16, else oneDNN's matmul in builds
// that link it (detail/bf16_gemm_choice.hpp). dz keeps 16 significant bits as hi + lo: on
// lce's kernel dX and dW split it as they pack it (split_bf16_gemm); on
// oneDNN dX takes it split in a pass of its own and dW stays sgemm. Its first operator
// call in a process warns once on std::cerr when the BLAS runs kernels below the CPU's class
// (blas_info.hpp; LCE_NO_BLAS_WARNING=1 hides it).

#include <lce/core/config.hpp>
#include <lce/core/dtypes.hpp>
#include <lce/host/blas_info.hpp>
#include <lce/host/detail/bf16_gemm_choice.hpp>
#include <lce/host/detail/blas.hpp>
#include <lce/host/detail/widening_bf16_gemm.hpp>
#include <lce/host/gemm_provider.hpp>

#include <concepts>
#include <cstdint>
#include <optional>

LCE_BEGIN_NAMESPACE

struct cblas_gemm {
  // One BLAS thread per call while lce runs (detail::single_threaded_blas), and the
  // process's one slow-kernel warning at the first call (not per GEMM).
  struct call_scope : detail::single_threaded_blas {
    call_scope() { detail::warn_once_if_blas_kernels_slow(); }
  };

  template <class A>
    requires std::same_as<A, float> || std::same_as<A, double>
  void gemm(transpose ta, transpose tb, std::int64_t m, std::int64_t n, std::int64_t k, A alpha, const A* a,
            std::int64_t lda, const A* b, std::int64_t ldb, A beta, A* c, std::int64_t ldc) const {
    detail::gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }

  bool bf16_gemm_available() const { return detail::bf16_gemm_runs_natively(); }

  void bf16_gemm(transpose ta, transpose tb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                 const bfloat16* a, std::int64_t lda, const bfloat16* b, std::int64_t ldb, float beta, float* c,
                 std::int64_t ldc) const {
    detail::run_bf16_gemm(detail::chosen_bf16_gemm_kernel(), ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }

  double bf16_gemm_flops_per_memory_byte() const {
    return detail::bf16_gemm_flops_per_memory_byte(detail::chosen_bf16_gemm_kernel());
  }

  // A in fp32 as hi + lo (gemm_provider.hpp): lce's own kernel, which splits A as it packs it.

  bool split_bf16_gemm_available() const { return own_unit().has_value(); }

  template <class B>
    requires std::same_as<B, bfloat16> || std::same_as<B, float>
  void split_bf16_gemm(transpose ta, transpose tb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                       const float* a, std::int64_t lda, const B* b, std::int64_t ldb, float beta, float* c,
                       std::int64_t ldc) const {
    detail::own_split_bf16_gemm(*own_unit(), ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }

  // The GEMMs above into a bf16 C (gemm_provider.hpp): lce's own kernel rounds each 32 x 32
  // block into C as its sum is done.
  bool gemm_into_bf16_available() const { return split_bf16_gemm_available(); }

  void bf16_gemm_into_bf16(transpose ta, transpose tb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                           const bfloat16* a, std::int64_t lda, const bfloat16* b, std::int64_t ldb, float beta,
                           bfloat16* c, std::int64_t ldc) const {
    detail::bf16_gemm_into_bf16_of(*this, own_unit(), ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }

  void split_bf16_gemm_into_bf16(transpose ta, transpose tb, std::int64_t m, std::int64_t n, std::int64_t k,
                                 float alpha, const float* a, std::int64_t lda, const float* b, std::int64_t ldb,
                                 float beta, bfloat16* c, std::int64_t ldc) const {
    if (gemm_into_bf16_available())
      return detail::own_bf16_gemm_into_bf16(*own_unit(), ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    detail::round_sum_into_bf16(
        m, n, beta, c, ldc, [&](float* sum) { split_bf16_gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, 0.0f, sum, n); });
  }

 protected:
  // The unit lce's own kernel runs on, where it is the chosen bf16 GEMM.
  static std::optional<detail::bf16_unit> own_unit() { return detail::own_unit_of(detail::chosen_bf16_gemm_kernel()); }
};

// cblas_gemm with bf16_operands (gemm_provider.hpp): a bfloat16 operator runs all three
// GEMMs of a chunk as bf16 x bf16 -> fp32, the hidden rows as stored and dz rounded once to
// bf16, as GPU fused losses and lce_torch do: 1.5e-3 relative (rms) in dX and dW instead of
// hi + lo's 2.3e-6, for about 2.6x the speed of hi + lo on AMX (README, "bf16 GEMMs").
// Where this CPU has no bf16 kernel it widens inside bf16_gemm (same results up to the order
// of the sums). lce::host_bf16_operands is the backend.
struct cblas_gemm_bf16_operands : cblas_gemm {
  static constexpr bool bf16_operands = true;

  void bf16_gemm(transpose ta, transpose tb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                 const bfloat16* a, std::int64_t lda, const bfloat16* b, std::int64_t ldb, float beta, float* c,
                 std::int64_t ldc) const {
    const detail::bf16_gemm_kernel kernel = detail::chosen_bf16_gemm_kernel();
    if (kernel != detail::bf16_gemm_kernel::widen)
      return detail::run_bf16_gemm(kernel, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    detail::widening_bf16_gemm(
        [](auto... args) { detail::gemm(args...); }, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }

  void bf16_gemm_into_bf16(transpose ta, transpose tb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                           const bfloat16* a, std::int64_t lda, const bfloat16* b, std::int64_t ldb, float beta,
                           bfloat16* c, std::int64_t ldc) const {
    detail::bf16_gemm_into_bf16_of(*this, own_unit(), ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
};

static_assert(gemm_provider<cblas_gemm>);
static_assert(bf16_gemm_provider<cblas_gemm>);
static_assert(split_bf16_gemm_provider<cblas_gemm>);
static_assert(bf16_into_bf16_gemm_provider<cblas_gemm> && split_bf16_into_bf16_gemm_provider<cblas_gemm>);
static_assert(gemm_reads_bf16_operands<cblas_gemm_bf16_operands>);

LCE_END_NAMESPACE
