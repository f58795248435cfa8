// SFT with label smoothing (PyTorch's label_smoothing): sft_gradients before
// the forward, the operator's row-term forward_backward, sft_loss from logp,
// lse and the mean logit, against a loss materialised in double from the
// logits and against finite differences of it.
#include "loss_support.hpp"

#include <lce/lce.hpp>

using namespace lce_loss_test;

namespace {

// sum over counted tokens of c_i [(1 - eps)(-log p_y) + eps mean_v(-log p_v)], z = x . w in double.
double materialised_smoothed_loss(const std::vector<double>& x, const std::vector<double>& w, std::int64_t n,
                                  std::int64_t h, std::int64_t v, const batch& b, double norm, double eps,
                                  bool sequence_mean, double z_loss = 0) {
  double loss = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const double wi = b.w(i);
    if (wi == 0.0) continue;
    std::int64_t ns = 0;
    if (sequence_mean) {
      const auto s = b.seq_of(i);
      for (std::int64_t k = b.cu[s]; k < b.cu[s + 1]; ++k) ns += b.w(k) != 0.0;
    }
    const double c = sequence_mean ? wi / (norm * double(ns)) : wi / norm;
    std::vector<double> z(v);
    double m = -1e300;
    for (std::int64_t j = 0; j < v; ++j) {
      z[j] = 0;
      for (std::int64_t k = 0; k < h; ++k) z[j] += x[i * h + k] * w[j * h + k];
      m = std::max(m, z[j]);
    }
    double s = 0;
    for (double e : z) s += std::exp(e - m);
    const double lse = m + std::log(s);
    double mean_neg_logp = 0;
    for (double e : z) mean_neg_logp += (lse - e) / double(v);
    loss += c * ((1 - eps) * (lse - z[b.targets[i]]) + eps * mean_neg_logp + z_loss * lse * lse);
  }
  return loss;
}

}  // namespace

TEST_CASE("sft with label smoothing: one sweep, loss equals the materialised definition, dX equals finite differences") {
  const std::int64_t H = 5, V = 13;
  const auto b0 = make_batch({4, 1, 0, 5}, 57, true);
  const std::int64_t N = b0.n();
  auto b = b0;
  for (auto& t : b.targets)
    if (t != -100) t %= V;
  std::mt19937_64 rng(9);
  std::normal_distribution<double> g(0.0, 0.8);
  std::vector<double> x(N * H), w(V * H);
  for (auto& e : x) e = g(rng);
  for (auto& e : w) e = g(rng);
  lce::ChunkedHiddenToLogprobs<lce::comm::single, double> op{lce::comm::single{}, lce::options{.chunk_tokens = 3}};
  const lce::matrix_view<const double> W{w.data(), V, H};

  for (const auto reduction : {lce::loss_reduction::token_mean, lce::loss_reduction::sequence_mean}) {
    for (const auto& [eps, z_loss] : {std::pair{0.0, 0.0}, {0.1, 0.0}, {0.4, 0.0}, {0.0, 0.05}, {0.1, 0.02}}) {
      CAPTURE(eps);
      CAPTURE(z_loss);
      CAPTURE(int(reduction));
      lce::sft_options opts;
      opts.reduction = reduction;
      opts.label_smoothing = eps;
      opts.z_loss = z_loss;
      const double norm = double(lce::count_loss_units(thrust::host, b.view(), N, reduction));
      std::vector<double> g_lp(N), g_lse(N), g_mean(N), g_square(N);
      std::vector<std::int64_t> seq_tokens(b.s());
      lce::sft_gradients(thrust::host, b.view(), norm,
                         lce::sft_row_gradients<double>{mv(g_lp), mv(g_lse), mv(g_mean), mv(g_square)}, mv(seq_tokens),
                         opts);
      std::vector<double> lp(N), lse(N), mean(N), dx(N * H), dw(V * H, 0.0);
      op.forward_backward(lce::matrix_view<const double>{x.data(), N, H}, W, cv(b.targets),
                          lce::row_gradients<double>{cv(g_lp), {}, cv(g_lse), cv(g_mean), cv(g_square)},
                          lce::row_outputs<double>{mv(lp), mv(lse), {}, mv(mean)},
                          lce::matrix_view<double>{dx.data(), N, H}, lce::matrix_view<double>{dw.data(), V, H});
      const auto loss_from = [&](const std::vector<double>& l, const std::vector<double>& ls,
                                 const std::vector<double>& ml) {
        return lce::sft_loss(thrust::host, b.view(), cv(l), norm, lce::sft_outputs<double>{{}, {}, mv(seq_tokens)},
                             opts, lce::sft_smoothing_inputs<const double>{cv(ls), cv(ml)})
            .loss;
      };
      const double loss = loss_from(lp, lse, mean);
      const double want = materialised_smoothed_loss(x, w, N, H, V, b, norm, eps,
                                                     reduction == lce::loss_reduction::sequence_mean, z_loss);
      CHECK(std::fabs(loss - want) < 1e-12 * (1 + std::fabs(want)));

      const auto loss_at = [&](const std::vector<double>& xs) {
        std::vector<double> l(N), ls(N), ml(N);
        op.forward(lce::matrix_view<const double>{xs.data(), N, H}, W, cv(b.targets),
                   lce::row_outputs<double>{mv(l), mv(ls), {}, mv(ml)});
        return loss_from(l, ls, ml);
      };
      const double step = 1e-6;
      for (std::int64_t k = 0; k < N * H; ++k) {
        auto xs = x;
        xs[k] += step;
        const double up = loss_at(xs);
        xs[k] -= 2 * step;
        const double down = loss_at(xs);
        CHECK(std::fabs((up - down) / (2 * step) - dx[k]) < 1e-8);
      }
    }
  }
}

TEST_CASE("sft with label smoothing: bad eps and the entry points that cannot smooth raise lce::error") {
  const auto b = make_batch({3, 2}, 5, false);
  const std::int64_t N = b.n();
  std::vector<double> g_lp(N, 7.0), g_lse(N, 7.0), g_mean(N, 7.0), lp(N, -1.0);
  lce::sft_options opts;
  for (const double bad : {-0.1, 1.5, std::nan("")}) {
    opts.label_smoothing = bad;
    CHECK_THROWS_WITH_AS(lce::sft_gradients(thrust::host, b.view(), 1.0,
                                            lce::sft_row_gradients<double>{mv(g_lp), mv(g_lse), mv(g_mean)}, {}, opts),
                         doctest::Contains("options.label_smoothing"), lce::error);
  }
  opts.label_smoothing = 0.1;
  CHECK_THROWS_WITH_AS(lce::sft_grad_logprobs(thrust::host, b.view(), 1.0, mv(g_lp), {}, opts),
                       doctest::Contains("use sft_gradients"), lce::error);
  CHECK_THROWS_WITH_AS(lce::sft_gradients(thrust::host, b.view(), 1.0, lce::sft_row_gradients<double>{mv(g_lp), {}, {}},
                                          {}, opts),
                       doctest::Contains("needs grad_lse and grad_mean_logit"), lce::error);
  CHECK_THROWS_WITH_AS(lce::sft_loss(thrust::host, b.view(), cv(lp), 1.0, lce::sft_outputs<double>{}, opts),
                       doctest::Contains("need lse"), lce::error);
  // z-loss: a bad lambda, or no lse_squared to write it into
  opts.label_smoothing = 0.0;
  for (const double bad : {-0.1, std::nan(""), double(INFINITY)}) {
    opts.z_loss = bad;
    CHECK_THROWS_WITH_AS(lce::sft_gradients(thrust::host, b.view(), 1.0,
                                            lce::sft_row_gradients<double>{mv(g_lp), {}, {}, mv(g_mean)}, {}, opts),
                         doctest::Contains("options.z_loss must be finite and >= 0"), lce::error);
  }
  opts.z_loss = 0.01;
  CHECK_THROWS_WITH_AS(lce::sft_gradients(thrust::host, b.view(), 1.0, lce::sft_row_gradients<double>{mv(g_lp), {}, {}},
                                          {}, opts),
                       doctest::Contains("needs lse_squared"), lce::error);
  CHECK_THROWS_WITH_AS(lce::sft_grad_logprobs(thrust::host, b.view(), 1.0, mv(g_lp), {}, opts),
                       doctest::Contains("use sft_gradients"), lce::error);
  CHECK_THROWS_WITH_AS(lce::sft_loss(thrust::host, b.view(), cv(lp), 1.0, lce::sft_outputs<double>{}, opts),
                       doctest::Contains("need lse"), lce::error);
  for (double e : g_mean) CHECK(e == 7.0);
  for (double e : g_lp) CHECK(e == 7.0);
  for (double e : g_lse) CHECK(e == 7.0);
}
