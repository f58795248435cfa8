// The one-time warning of lce's default GEMM provider (cblas_gemm.hpp) when the BLAS
// runs kernels below the CPU's class. Its own process: the warning is once per process.
// ctest runs it with OPENBLAS_CORETYPE=Prescott (must warn, once, on an AVX2/AVX-512 CPU
// with a DYNAMIC_ARCH OpenBLAS), the same with LCE_NO_BLAS_WARNING=1 (must not), and with
// the environment the suite runs in (warns exactly when blas_info() says slow).
//
//   lce_blas_warning [expect-slow]
#include <lce/lce.hpp>
#include <lce/host/blas_info.hpp>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace {

int count(const std::string& text, const std::string& what) {
  int n = 0;
  for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + what.size())) ++n;
  return n;
}

void one_forward() {
  const std::int64_t n = 8, h = 16, v = 40;
  std::vector<float> x(n * h, 0.25f), w(v * h, 0.5f), logp(n), lse(n);
  std::vector<std::int64_t> y(n, 3);
  lce::ChunkedHiddenToLogprobs<lce::comm::single, float> op{lce::comm::single{}};
  op.forward(lce::matrix_view<const float>{x.data(), n, h}, lce::matrix_view<const float>{w.data(), v, h},
             lce::vector_view<const std::int64_t>{y.data(), n}, lce::vector_view<float>{logp.data(), n},
             lce::vector_view<float>{lse.data(), n});
}

}  // namespace

int main(int argc, char** argv) {
  const bool expect_slow = argc > 1 && std::strcmp(argv[1], "expect-slow") == 0;
  std::ostringstream captured;
  std::streambuf* const stderr_buffer = std::cerr.rdbuf(captured.rdbuf());
  one_forward();
  one_forward();
  std::cerr.rdbuf(stderr_buffer);

  const lce::blas_report r = lce::blas_info();
  const char* no_warning = std::getenv("LCE_NO_BLAS_WARNING");  // ctest sets "" or "1"
  const bool silenced = no_warning && std::strcmp(no_warning, "1") == 0;
  const bool should_warn = r.slow && !silenced;
  const int warnings = count(captured.str(), "lce: warning: ");
  std::printf("%s\nslow %d, silenced %d, warnings printed %d\n", r.line().c_str(), int(r.slow),
              int(silenced), warnings);
  if (!captured.str().empty()) std::printf("captured stderr: %s", captured.str().c_str());
  bool ok = warnings == (should_warn ? 1 : 0);
  if (should_warn) ok = ok && captured.str() == r.warning() + "\n";
  if (expect_slow && r.cpu.simd_tier() >= 2 && r.coretype_settable && !r.slow) {
    std::printf("FAIL: OPENBLAS_CORETYPE=%s on this CPU should be reported slow\n", r.coretype_env.c_str());
    ok = false;
  }
  std::printf("%s\n", ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}
