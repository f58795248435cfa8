// Consumer smoke test: the smallest real use of lce through its installed /
// added CMake target. Exit status 0 iff every log-prob is finite, <= 0 and
// matches a direct log_softmax.
#include <lce/lce.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

int main() {
  constexpr std::int64_t N = 4, H = 3, V = 5;
  std::vector<float> x(N * H), w(V * H);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = 0.25f * float(int(i * 7 % 11) - 5);
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = 0.125f * float(int(i * 5 % 13) - 6);
  std::vector<std::int64_t> y = {0, 4, 2, 1};
  std::vector<float> logp(N, 1.0f), lse(N, 0.0f);

  lce::ChunkedHiddenToLogprobs<lce::comm::single, float> op{lce::comm::single{}};
  op.forward(lce::matrix_view<const float>{x.data(), N, H},
             lce::matrix_view<const float>{w.data(), V, H},
             lce::vector_view<const std::int64_t>{y.data(), N},
             lce::vector_view<float>{logp.data(), N},
             lce::vector_view<float>{lse.data(), N});

  int bad = 0;
  for (std::int64_t i = 0; i < N; ++i) {
    double z[V], m = -INFINITY, s = 0.0;
    for (std::int64_t v = 0; v < V; ++v) {
      z[v] = 0.0;
      for (std::int64_t k = 0; k < H; ++k) z[v] += double(x[i * H + k]) * double(w[v * H + k]);
      m = z[v] > m ? z[v] : m;
    }
    for (std::int64_t v = 0; v < V; ++v) s += std::exp(z[v] - m);
    const double ref = z[y[i]] - (m + std::log(s));
    const bool ok = std::isfinite(logp[i]) && logp[i] <= 0.0f && std::fabs(logp[i] - ref) <= 1e-4;
    std::printf("token %lld: logprob %.6f (reference %.6f)%s\n", static_cast<long long>(i),
                double(logp[i]), ref, ok ? "" : "  <-- WRONG");
    bad += !ok;
  }
  std::printf("%s\n", bad ? "lce_consumer: FAILED" : "lce_consumer: OK");
  return bad ? 1 : 0;
}
