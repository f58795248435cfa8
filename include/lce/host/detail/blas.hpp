#pragma once
// Row-major GEMM on top of CBLAS, in the three layouts the operator needs.
// Empty products are skipped here so callers need no special cases.

#include <lce/core/config.hpp>
#include <lce/core/error.hpp>

#include <cblas.h>

#include <climits>
#include <cstdint>

LCE_BEGIN_NAMESPACE
namespace detail {

enum class transpose : bool { no = false, yes = true };

inline int blas_int(std::int64_t value, const char* what) {
  expects(value <= INT_MAX, what, " = ", value, " exceeds the BLAS integer range (", INT_MAX, ")");
  return static_cast<int>(value);
}

// C[m, n] = alpha * op(A)[m, k] * op(B)[k, n] + beta * C
template <class A>
void gemm(transpose trans_a, transpose trans_b, std::int64_t m, std::int64_t n, std::int64_t k, A alpha, const A* a,
          std::int64_t lda, const A* b, std::int64_t ldb, A beta, A* c, std::int64_t ldc) {
  if (m == 0 || n == 0) return;
  const auto ta = trans_a == transpose::yes ? CblasTrans : CblasNoTrans;
  const auto tb = trans_b == transpose::yes ? CblasTrans : CblasNoTrans;
  const int im = blas_int(m, "gemm m"), in = blas_int(n, "gemm n"), ik = blas_int(k, "gemm k");
  const int ilda = blas_int(lda, "gemm lda"), ildb = blas_int(ldb, "gemm ldb"), ildc = blas_int(ldc, "gemm ldc");
  if constexpr (sizeof(A) == sizeof(float)) {
    cblas_sgemm(CblasRowMajor, ta, tb, im, in, ik, alpha, a, ilda, b, ildb, beta, c, ildc);
  } else {
    cblas_dgemm(CblasRowMajor, ta, tb, im, in, ik, alpha, a, ilda, b, ildb, beta, c, ildc);
  }
}

}  // namespace detail
LCE_END_NAMESPACE
