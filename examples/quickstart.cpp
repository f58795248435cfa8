// lce quickstart: per-token log-probs, entropies and the mean-NLL gradients of a
// language-model head, without ever holding the [tokens, vocab] logits in memory.
#include <lce/lce.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

int main() {
  const std::int64_t N = 1024, H = 256, V = 32000;  // tokens, hidden size, vocabulary
  std::mt19937 rng{42};
  std::normal_distribution<float> normal{0.0f, 1.0f};
  std::uniform_int_distribution<std::int64_t> token{0, V - 1};
  std::vector<float> x(N * H), w(V * H);  // hidden states X [N, H], output weight W [V, H]
  std::vector<std::int64_t> y(N);         // target token ids
  for (float& v : x) v = normal(rng);
  for (float& v : w) v = normal(rng) * 3.0f / std::sqrt(float(H));  // logits with std ~3
  for (std::int64_t& t : y) t = token(rng);

  // [quickstart]
  lce::ChunkedHiddenToLogprobs<lce::comm::single, float> op{lce::comm::single{}};

  lce::matrix_view<const float> X{x.data(), N, H}, W{w.data(), V, H};
  lce::vector_view<const std::int64_t> Y{y.data(), N};

  // Forward: log p(y_i | x_i), log-sum-exp and entropy of every token.
  std::vector<float> logp(N), lse(N), ent(N);
  op.forward(X, W, Y, lce::vector_view<float>{logp.data(), N},
             lce::vector_view<float>{lse.data(), N}, lce::vector_view<float>{ent.data(), N});

  // Backward of the mean NLL, L = -(1/N) sum_i logp_i, so dL/dlogp_i = -1/N.
  // grad_hidden is overwritten; grad_weight is accumulated into (+=), so start at zero.
  std::vector<float> g(N, -1.0f / float(N)), dx(N * H), dw(V * H, 0.0f);
  op.backward(X, W, Y, lce::vector_view<const float>{lse.data(), N},
              lce::vector_view<const float>{g.data(), N},
              lce::matrix_view<float>{dx.data(), N, H}, lce::matrix_view<float>{dw.data(), V, H});
  // [quickstart]

  double nll = 0.0, mean_ent = 0.0;
  for (std::int64_t i = 0; i < N; ++i) nll -= logp[i], mean_ent += ent[i];
  std::printf("mean NLL %.4f nats (log V = %.4f), mean entropy %.4f nats\n", nll / N,
              std::log(double(V)), mean_ent / N);
  std::printf("dX[0,0] = %.3e, dW[y_0,0] = %.3e\n", dx[0], dw[y[0] * H]);
  return std::isfinite(nll) && std::isfinite(mean_ent) ? 0 : 1;
}
