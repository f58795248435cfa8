#pragma once
// lce's default GEMM provider (see gemm_provider.hpp): the CBLAS lce links
// (OpenBLAS, BLIS, MKL, ...), one single-threaded call per GEMM tile, and with
// LCE_BF16_GEMM=onednn (LCE_HOST_BF16_GEMM_ONEDNN) oneDNN's bf16 x bf16 -> fp32
// matmul for bfloat16 weights on CPUs with bf16 instructions. Its first operator
// call in a process warns once on std::cerr when the BLAS runs kernels below the CPU's class
// (blas_info.hpp; LCE_NO_BLAS_WARNING=1 hides it).

#include <lce/core/config.hpp>
#include <lce/core/dtypes.hpp>
#include <lce/host/blas_info.hpp>
#include <lce/host/detail/blas.hpp>
#include <lce/host/gemm_provider.hpp>
#if LCE_HOST_BF16_GEMM_ONEDNN
#include <lce/host/detail/onednn_gemm.hpp>
#endif

#include <concepts>
#include <cstdint>

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

#if LCE_HOST_BF16_GEMM_ONEDNN
  bool bf16_gemm_available() const { return detail::onednn_bf16_gemm_available(); }

  void bf16_gemm(transpose ta, transpose tb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                 const bfloat16* a, std::int64_t lda, const bfloat16* b, std::int64_t ldb, float beta, float* c,
                 std::int64_t ldc) const {
    // oneDNN takes each operand as [rows, cols] with a stride per dimension.
    const bool at = ta == transpose::yes, bt = tb == transpose::yes;
    detail::onednn_bf16_gemm(m, n, k, alpha, a, at ? 1 : lda, at ? lda : 1, b, bt ? 1 : ldb, bt ? ldb : 1, beta, c,
                             ldc);
  }
#endif
};

static_assert(gemm_provider<cblas_gemm>);
#if LCE_HOST_BF16_GEMM_ONEDNN
static_assert(bf16_gemm_provider<cblas_gemm>);
#endif

LCE_END_NAMESPACE
