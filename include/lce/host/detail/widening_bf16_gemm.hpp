#pragma once
// A bf16 x bf16 -> fp32 GEMM through an fp32 GEMM, for a provider whose
// bf16 library is missing on this machine (gemm_provider.hpp: a provider
// with bf16_operands must run bf16_gemm everywhere). Widening bf16 to fp32
// is exact, so the result is the bf16 GEMM's up to the order of the sums.
// The operands are widened one block of the depth at a time into scratch of
// this thread's, so the scratch stays (m + n) x depth_block floats.

#include <lce/core/config.hpp>
#include <lce/core/dtypes.hpp>
#include <lce/host/detail/convert.hpp>
#include <lce/host/gemm_provider.hpp>

#include <algorithm>
#include <cstdint>
#include <vector>

LCE_BEGIN_NAMESPACE
namespace detail {

// sgemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc): row-major fp32 C = alpha op(A) op(B) + beta C.
template <class Fp32Gemm>
void widening_bf16_gemm(const Fp32Gemm& sgemm, transpose ta, transpose tb, std::int64_t m, std::int64_t n,
                        std::int64_t k, float alpha, const bfloat16* a, std::int64_t lda, const bfloat16* b,
                        std::int64_t ldb, float beta, float* c, std::int64_t ldc) {
  if (m <= 0 || n <= 0) return;
  constexpr std::int64_t depth_block = 256;
  if (k <= 0) {  // C = beta C, through the fp32 GEMM's own rule for beta = 0
    const float none = 0.0f;
    sgemm(transpose::no, transpose::no, m, n, std::int64_t{0}, alpha, &none, std::int64_t{1}, &none, n, beta, c, ldc);
    return;
  }
  thread_local std::vector<float> scratch;
  const std::int64_t depth = std::min(k, depth_block);
  scratch.resize(static_cast<std::size_t>((m + n) * depth));
  float* const wide_a = scratch.data();          // op(A) block [m, depth]
  float* const wide_b = scratch.data() + m * depth;  // op(B) block [depth, n]
  for (std::int64_t p0 = 0; p0 < k; p0 += depth) {
    const std::int64_t d = std::min(depth, k - p0);
    for (std::int64_t i = 0; i < m; ++i)
      for (std::int64_t p = 0; p < d; ++p)
        wide_a[i * d + p] = static_cast<float>(ta == transpose::yes ? a[(p0 + p) * lda + i] : a[i * lda + p0 + p]);
    for (std::int64_t p = 0; p < d; ++p)
      for (std::int64_t j = 0; j < n; ++j)
        wide_b[p * n + j] = static_cast<float>(tb == transpose::yes ? b[j * ldb + p0 + p] : b[(p0 + p) * ldb + j]);
    sgemm(transpose::no, transpose::no, m, n, d, alpha, static_cast<const float*>(wide_a), d,
          static_cast<const float*>(wide_b), n, p0 == 0 ? beta : 1.0f, c, ldc);
  }
}

// bf16 C[m, n] = bf16(sum + beta C), beta 0 (C not read) or 1, the fp32 sum written by
// `fill_sum(float* sum)` into a dense [m, n] buffer of its own: a GEMM into a bf16 C
// (gemm_provider.hpp) for a GEMM without one. Each element rounded once, as add_span.
template <class FillSum>
void round_sum_into_bf16(std::int64_t m, std::int64_t n, float beta, bfloat16* c, std::int64_t ldc,
                         FillSum&& fill_sum) {
  if (m <= 0 || n <= 0) return;
  std::vector<float> sum(static_cast<std::size_t>(m * n));
  fill_sum(sum.data());
  for (std::int64_t i = 0; i < m; ++i) {
    if (beta == 0.0f)
      convert_span(static_cast<const float*>(sum.data() + i * n), c + i * ldc, n);
    else
      add_span(static_cast<const float*>(sum.data() + i * n), c + i * ldc, n);
  }
}

}  // namespace detail
LCE_END_NAMESPACE
