// Which bf16 GEMM lce's default provider runs (detail/bf16_gemm_choice.hpp), in a
// process of its own: the choice is made once per process, from the CPU, the build and
// LCE_BF16_GEMM. ctest runs it with LCE_BF16_GEMM unset, "widen", "amx", "avx512bf16",
// "onednn" and an unknown name. Each run checks
//   - the kernel lce::blas_info() reports against the documented rule (widen when asked
//     or built with LCE_BF16_GEMM=widen; else the kernel asked for where this CPU and build
//     have it; else lce's own kernel on AMX where the CPU has AMX, on AVX512-BF16 where it
//     has that, oneDNN where linked, widening);
//   - a bfloat16 operator's forward_backward on that kernel against a float operator on
//     the same values (bf16 values widened: exact), whose GEMMs are the BLAS's sgemm: the
//     log-probs within fp32 sums, the gradients within dz's hi + lo split (2^-16).
#include <lce/lce.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

namespace {

struct outputs {
  std::vector<float> logp, dx, dw;
};

template <class T>
outputs step(const std::vector<float>& x, const std::vector<float>& w, const std::vector<std::int64_t>& y,
             std::int64_t n, std::int64_t h, std::int64_t v) {
  std::vector<T> xt(x.begin(), x.end()), wt(w.begin(), w.end());
  if constexpr (!std::is_same_v<T, float>) {
    for (std::size_t i = 0; i < x.size(); ++i) xt[i] = T(x[i]);
    for (std::size_t i = 0; i < w.size(); ++i) wt[i] = T(w[i]);
  }
  outputs o{std::vector<float>(n), std::vector<float>(n * h), std::vector<float>(v * h, 0.0f)};
  std::vector<float> g(n, -1.0f / float(n));
  lce::options opts;
  opts.workspace_limit_bytes = std::size_t{1} << 20;  // several chunks
  lce::ChunkedHiddenToLogprobs<lce::comm::single, T> op{lce::comm::single{}, opts};
  op.forward_backward(lce::matrix_view<const T>{xt.data(), n, h}, lce::matrix_view<const T>{wt.data(), v, h},
                      lce::vector_view<const std::int64_t>{y.data(), n}, lce::vector_view<const float>{g.data(), n},
                      lce::vector_view<float>{o.logp.data(), n}, lce::matrix_view<float>{o.dx.data(), n, h},
                      lce::matrix_view<float>{o.dw.data(), v, h});
  return o;
}

// max |a - b| / max |b|
double relative(const std::vector<float>& a, const std::vector<float>& b) {
  double err = 0, scale = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    err = std::max(err, std::fabs(double(a[i]) - double(b[i])));
    scale = std::max(scale, std::fabs(double(b[i])));
  }
  return err / scale;
}

}  // namespace

int main() {
  const char* asked_env = std::getenv("LCE_BF16_GEMM");
  const std::string asked = asked_env ? asked_env : "";
  const bool amx = lce::detail::amx_bf16_gemm_available(), avx512bf16 = lce::detail::avx512_bf16_gemm_available();
#if LCE_HOST_BF16_GEMM_ONEDNN
  const bool onednn = lce::detail::onednn_bf16_gemm_available();
#else
  const bool onednn = false;
#endif
#if defined(LCE_BF16_GEMM_WIDEN)
  const bool built_widen = true;
#else
  const bool built_widen = false;
#endif
  std::string expected;
  if (built_widen || asked == "widen") expected = "widen";
  else if (asked == "amx" && amx) expected = "amx";
  else if (asked == "avx512bf16" && avx512bf16) expected = "avx512bf16";
  else if (asked == "onednn" && onednn) expected = "onednn";
  else expected = amx ? "amx" : avx512bf16 ? "avx512bf16" : onednn ? "onednn" : "widen";

  const std::string reported = lce::blas_info().bf16_gemm;
  const std::string marker = expected == "amx"          ? "lce's own kernel on AMX"
                             : expected == "avx512bf16" ? "lce's own kernel on AVX512-BF16"
                             : expected == "onednn"     ? "oneDNN"
                                                        : "widened to fp32";
  const bool named = reported.rfind(marker, 0) == 0;
  const bool available = lce::cblas_gemm{}.bf16_gemm_available() == (expected != "widen");
  std::printf(
      "LCE_BF16_GEMM=\"%s\"; CPU/build: amx %d, avx512bf16 %d, onednn %d, built widen %d; expected %s\nbf16 GEMMs: %s\n",
      asked.c_str(), int(amx), int(avx512bf16), int(onednn), int(built_widen), expected.c_str(), reported.c_str());

  const std::int64_t n = 96, h = 160, v = 3000;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(n * h), w(v * h);
  for (float& e : x) e = static_cast<float>(lce::bfloat16(normal(rng)));
  for (float& e : w) e = static_cast<float>(lce::bfloat16(0.2f * normal(rng)));
  std::vector<std::int64_t> y(n);
  for (std::int64_t i = 0; i < n; ++i) y[i] = (i * 37) % v;
  const outputs wide = step<float>(x, w, y, n, h, v);
  const outputs narrow = step<lce::bfloat16>(x, w, y, n, h, v);
  const double logp_err = relative(narrow.logp, wide.logp), dx_err = relative(narrow.dx, wide.dx),
               dw_err = relative(narrow.dw, wide.dw);
  std::printf("bf16 operator against float on the same values: log-probs %.2e, dX %.2e, dW %.2e\n", logp_err,
              dx_err, dw_err);
  const bool close = logp_err < 1e-5 && dx_err < 1e-4 && dw_err < 1e-4;
  const bool ok = named && available && close;
  std::printf("%s\n", ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}
