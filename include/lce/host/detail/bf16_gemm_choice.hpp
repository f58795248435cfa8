#pragma once
// Which bf16 x bf16 -> fp32 GEMM lce's default provider (cblas_gemm) runs for a
// bfloat16 weight's logits and dX, chosen once per process:
//
//   amx     lce's own kernel on AMX tiles (amx_bf16_gemm.hpp), on CPUs with AMX:
//           header-only, so every build has it, installed ones included
//   onednn  oneDNN's matmul, in builds that link it (LCE_BF16_GEMM_ONEDNN), on
//           CPUs with AVX512-BF16 or AMX (e.g. AMD Zen 4, Intel Cooper Lake)
//   widen   none: lce widens the weight to fp32 for the BLAS's sgemm
//
// The first that this CPU and build have, in that order. The environment
// variable LCE_BF16_GEMM=amx|onednn|widen, read at the first use, asks for one
// (an unavailable or unknown name falls to the default); a build configured
// with -DLCE_BF16_GEMM=widen (LCE_BF16_GEMM_WIDEN) always widens.

#include <lce/core/config.hpp>
#include <lce/core/dtypes.hpp>
#include <lce/host/detail/amx_bf16_gemm.hpp>
#include <lce/host/gemm_provider.hpp>
#if LCE_HOST_BF16_GEMM_ONEDNN
#include <lce/host/detail/onednn_gemm.hpp>
#endif

#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

LCE_BEGIN_NAMESPACE
namespace detail {

enum class bf16_gemm_kernel { amx, onednn, widen };

// The kernel that runs when `asked` ("amx", "onednn", "widen", or anything else for the default) is asked for.
inline bf16_gemm_kernel resolve_bf16_gemm_kernel(std::string_view asked) {
#if defined(LCE_BF16_GEMM_WIDEN)
  (void)asked;
  return bf16_gemm_kernel::widen;
#else
  const bool amx = amx_bf16_gemm_available();
#if LCE_HOST_BF16_GEMM_ONEDNN
  const bool onednn = onednn_bf16_gemm_available();
#else
  const bool onednn = false;
#endif
  if (asked == "widen") return bf16_gemm_kernel::widen;
  if (asked == "onednn" && onednn) return bf16_gemm_kernel::onednn;
  if (amx) return bf16_gemm_kernel::amx;
  return onednn ? bf16_gemm_kernel::onednn : bf16_gemm_kernel::widen;
#endif
}

inline bf16_gemm_kernel chosen_bf16_gemm_kernel() {
  static const bf16_gemm_kernel chosen = [] {
    const char* asked = std::getenv("LCE_BF16_GEMM");
    return resolve_bf16_gemm_kernel(asked ? asked : "");
  }();
  return chosen;
}

// Whether the chosen kernel runs on the CPU's bf16 instructions (not widened):
// cblas_gemm::bf16_gemm_available() and blas_report::bf16_gemm_native.
inline bool bf16_gemm_runs_natively() { return chosen_bf16_gemm_kernel() != bf16_gemm_kernel::widen; }

// Row-major C[m, n] = alpha op(A) op(B) + beta C on `kernel` (not widen).
inline void run_bf16_gemm(bf16_gemm_kernel kernel, transpose ta, transpose tb, std::int64_t m, std::int64_t n,
                          std::int64_t k, float alpha, const bfloat16* a, std::int64_t lda, const bfloat16* b,
                          std::int64_t ldb, float beta, float* c, std::int64_t ldc) {
#if LCE_HOST_BF16_GEMM_ONEDNN
  if (kernel == bf16_gemm_kernel::onednn) {
    // oneDNN takes each operand as [rows, cols] with a stride per dimension.
    const bool at = ta == transpose::yes, bt = tb == transpose::yes;
    onednn_bf16_gemm(m, n, k, alpha, a, at ? 1 : lda, at ? lda : 1, b, bt ? 1 : ldb, bt ? ldb : 1, beta, c, ldc);
    return;
  }
#endif
  (void)kernel;
  amx_bf16_gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

// For lce::blas_info(): what runs a bfloat16 weight's GEMMs, and why.
inline std::string bf16_gemm_description(bf16_gemm_kernel kernel) {
  switch (kernel) {
    case bf16_gemm_kernel::amx:
      return "lce's AMX kernel (amx_bf16_gemm.hpp, up to " + std::to_string(amx_bf16_gemm_scratch_bytes / 1024) +
             " KiB of scratch per thread)";
#if LCE_HOST_BF16_GEMM_ONEDNN
    case bf16_gemm_kernel::onednn:
      return onednn_bf16_gemm_description();
#endif
    default:
      break;
  }
#if defined(LCE_BF16_GEMM_WIDEN)
  return "widened to fp32 for the BLAS (built with LCE_BF16_GEMM=widen)";
#else
  const char* asked = std::getenv("LCE_BF16_GEMM");
  if (asked && std::string_view(asked) == "widen") return "widened to fp32 for the BLAS (LCE_BF16_GEMM=widen)";
#if LCE_HOST_BF16_GEMM_ONEDNN
  return "widened to fp32 for the BLAS (no AMX, and " + onednn_bf16_gemm_description() +
         " has no bf16 instructions here)";
#else
  return "widened to fp32 for the BLAS (no AMX here; oneDNN, for AVX512-BF16, not linked)";
#endif
#endif
}

}  // namespace detail
LCE_END_NAMESPACE
