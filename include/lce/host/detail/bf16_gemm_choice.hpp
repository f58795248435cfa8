#pragma once
// Which bf16 x bf16 -> fp32 GEMM lce's default provider (cblas_gemm) runs for a
// bfloat16 weight's logits and dX, chosen once per process:
//
//   amx         lce's own kernel on AMX tiles (own_bf16_gemm.hpp), on CPUs with
//               AMX: header-only, so every build has it, installed ones included
//   avx512bf16  the same kernel on AVX512-BF16 (AMD Zen 4 and later, Intel
//               Cooper Lake): 4x MKL's bf16 GEMM on a Zen 5, near oneDNN's
//   onednn      oneDNN's matmul, in builds that link it (LCE_BF16_GEMM_ONEDNN),
//               on CPUs with AVX512-BF16 or AMX
//   widen       none: lce widens the weight to fp32 for the BLAS's sgemm
//
// The first that this CPU and build have, in that order. The environment
// variable LCE_BF16_GEMM=amx|avx512bf16|onednn|widen, read at the first use, asks for one
// (an unavailable or unknown name falls to the default); a build configured
// with -DLCE_BF16_GEMM=widen (LCE_BF16_GEMM_WIDEN) always widens.

#include <lce/core/backend.hpp>
#include <lce/core/config.hpp>
#include <lce/core/dtypes.hpp>
#include <lce/host/detail/own_bf16_gemm.hpp>
#include <lce/host/gemm_provider.hpp>
#if LCE_HOST_BF16_GEMM_ONEDNN
#include <lce/host/detail/onednn_gemm.hpp>
#endif

#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>

LCE_BEGIN_NAMESPACE
namespace detail {

enum class bf16_gemm_kernel { amx, avx512bf16, onednn, widen };

inline constexpr double amx_gemm_flops_per_memory_byte = 80.0;

// The kernel that runs when `asked` ("amx", "avx512bf16", "onednn", "widen", or anything else for the
// default) is asked for.
inline bf16_gemm_kernel resolve_bf16_gemm_kernel(std::string_view asked) {
#if defined(LCE_BF16_GEMM_WIDEN)
  (void)asked;
  return bf16_gemm_kernel::widen;
#else
  const bool amx = amx_bf16_gemm_available(), avx512bf16 = avx512_bf16_gemm_available();
#if LCE_HOST_BF16_GEMM_ONEDNN
  const bool onednn = onednn_bf16_gemm_available();
#else
  const bool onednn = false;
#endif
  if (asked == "widen") return bf16_gemm_kernel::widen;
  if (asked == "onednn" && onednn) return bf16_gemm_kernel::onednn;
  if (asked == "avx512bf16" && avx512bf16) return bf16_gemm_kernel::avx512bf16;
  if (amx) return bf16_gemm_kernel::amx;
  if (avx512bf16) return bf16_gemm_kernel::avx512bf16;
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

// How fast `kernel` runs against memory (gemm_provider.hpp: bf16_gemm_flops_per_memory_byte).
// On AMX tiles lce's kernel (and oneDNN's) runs 1.2-1.9 TFLOP/s on two cores of a Xeon
// (cpuid model 167) where a pass over an fp32 dW sum, read and written, streams some 24 GB/s
// (through lce_torch, bf16, H 1,024, V 32,000, N 3,072: chunks of 240 rows against 384 took
// 11 ms more per pass over the sum's 131 MB): 80. AVX512-BF16 runs some 400 GFLOP/s on two
// cores of an AMD Zen 4: the default's 16.
inline double bf16_gemm_flops_per_memory_byte(bf16_gemm_kernel kernel) {
  const bool on_amx =
      kernel == bf16_gemm_kernel::amx || (kernel == bf16_gemm_kernel::onednn && amx_bf16_gemm_available());
  return on_amx ? amx_gemm_flops_per_memory_byte : default_gemm_flops_per_memory_byte;
}

// The unit of lce's own kernel when `kernel` is it.
inline std::optional<bf16_unit> own_unit_of(bf16_gemm_kernel kernel) {
  if (kernel == bf16_gemm_kernel::amx) return bf16_unit::amx;
  if (kernel == bf16_gemm_kernel::avx512bf16) return bf16_unit::avx512;
  return std::nullopt;
}

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
  own_bf16_gemm(kernel == bf16_gemm_kernel::amx ? bf16_unit::amx : bf16_unit::avx512, ta, tb, m, n, k, alpha, a, lda,
                b, ldb, beta, c, ldc);
}

// For lce::blas_info(): what runs a bfloat16 weight's GEMMs, and why.
inline std::string bf16_gemm_description(bf16_gemm_kernel kernel) {
  switch (kernel) {
    case bf16_gemm_kernel::amx:
    case bf16_gemm_kernel::avx512bf16:
      return std::string("lce's own kernel on ") + (kernel == bf16_gemm_kernel::amx ? "AMX" : "AVX512-BF16") +
             " (own_bf16_gemm.hpp, up to " + std::to_string(own_bf16_gemm_scratch_bytes / 1024) +
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
  return "widened to fp32 for the BLAS (no AMX or AVX512-BF16, and " + onednn_bf16_gemm_description() +
         " has no bf16 instructions here)";
#else
  return "widened to fp32 for the BLAS (no AMX or AVX512-BF16 here)";
#endif
#endif
}

}  // namespace detail
LCE_END_NAMESPACE
