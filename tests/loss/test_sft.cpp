// Packed sequences (cu_seqlens, shifted targets, counts) and the SFT / NLL loss.
#include "loss/loss_support.hpp"

#include <lce/comm/threads.hpp>
#include <lce/lce.hpp>

#include <thread>

using namespace lce_loss_test;

namespace {

// Plain reference of the SFT loss: token_mean or sequence_mean.
struct sft_ref {
  double loss = 0;
  std::vector<double> grad, seq_nll;
  std::vector<std::int64_t> seq_tokens;
};

sft_ref reference_sft(const batch& b, const std::vector<double>& logp, double norm, bool seq_mean) {
  sft_ref r;
  r.grad.assign(b.n(), 0.0);
  r.seq_nll.assign(b.s(), 0.0);
  r.seq_tokens.assign(b.s(), 0);
  for (std::int64_t s = 0; s < b.s(); ++s)
    for (std::int64_t i = b.cu[s]; i < b.cu[s + 1]; ++i)
      if (b.w(i) != 0) {
        ++r.seq_tokens[s];
        r.seq_nll[s] += -b.w(i) * logp[i];
      }
  for (std::int64_t s = 0; s < b.s(); ++s) {
    if (r.seq_tokens[s] == 0 || norm == 0) continue;
    const double d = seq_mean ? norm * double(r.seq_tokens[s]) : norm;
    r.loss += r.seq_nll[s] / d;
    for (std::int64_t i = b.cu[s]; i < b.cu[s + 1]; ++i) r.grad[i] = -b.w(i) / d;
  }
  return r;
}

double run_sft_loss(const batch& b, const std::vector<double>& logp, double norm, lce::loss_reduction red) {
  std::vector<std::int64_t> counts(b.s());
  return lce::sft_loss(thrust::host, b.view(), cv(logp), norm,
                       lce::sft_outputs<double>{{}, {}, mv(counts)}, lce::sft_options{red})
      .loss;
}

}  // namespace

TEST_CASE("sft: token and sequence mean against a plain reference and finite differences") {
  const auto b = make_batch({5, 1, 0, 7, 3, 0, 4}, 11);
  for (auto red : {lce::loss_reduction::token_mean, lce::loss_reduction::sequence_mean}) {
    const bool seq_mean = red == lce::loss_reduction::sequence_mean;
    CAPTURE(seq_mean);
    const double norm = double(lce::count_loss_units(thrust::host, b.view(), b.n(), red)) + 3.0;  // + other ranks
    const auto ref = reference_sft(b, b.logp, norm, seq_mean);
    std::vector<float> grad(b.n(), 99.0f), grad_before(b.n());
    std::vector<double> seq_nll(b.s(), 99.0);
    std::vector<std::int64_t> seq_tokens(b.s(), 99);
    const auto res = lce::sft_loss(thrust::host, b.view(), cv(b.logp), norm,
                                   lce::sft_outputs<float>{mv(grad), mv(seq_nll), mv(seq_tokens)},
                                   lce::sft_options{red});
    CHECK(close(res.loss, ref.loss, 1e-12));
    for (std::int64_t i = 0; i < b.n(); ++i) CHECK(close(grad[i], ref.grad[i], 1e-6));
    for (std::int64_t s = 0; s < b.s(); ++s) {
      CHECK(close(seq_nll[s], ref.seq_nll[s], 1e-12));
      CHECK(seq_tokens[s] == ref.seq_tokens[s]);
    }
    // grad before the forward (from targets, weights, normaliser alone) is the same
    std::vector<float> early(b.n(), 7.0f);
    std::vector<std::int64_t> counts2(b.s());
    lce::sft_grad_logprobs(thrust::host, b.view(), norm, mv(early), mv(counts2), lce::sft_options{red});
    CHECK(early == grad);
    // central differences of the loss w.r.t. each logp (counted or not)
    const double h = 1e-5;
    for (std::int64_t i = 0; i < b.n(); ++i) {
      auto lp = b.logp;
      lp[i] += h;
      const double up = run_sft_loss(b, lp, norm, red);
      lp[i] -= 2 * h;
      const double down = run_sft_loss(b, lp, norm, red);
      CHECK(std::fabs((up - down) / (2 * h) - ref.grad[i]) < 1e-7);
    }
  }
}

TEST_CASE("sft: the packed batch equals looping over its sequences one at a time") {
  const auto b = make_batch({4, 1, 0, 6, 2}, 5);
  for (auto red : {lce::loss_reduction::token_mean, lce::loss_reduction::sequence_mean}) {
    const double norm = double(lce::count_loss_units(thrust::host, b.view(), b.n(), red));
    std::vector<double> grad(b.n());
    std::vector<std::int64_t> counts(b.s());
    const double packed = lce::sft_loss(thrust::host, b.view(), cv(b.logp), norm,
                                        lce::sft_outputs<double>{mv(grad), {}, mv(counts)}, lce::sft_options{red})
                              .loss;
    double looped = 0;
    for (std::int64_t s = 0; s < b.s(); ++s) {
      const std::int64_t a = b.cu[s], len = b.cu[s + 1] - b.cu[s];
      lce::packed_tokens<std::int64_t, std::int64_t> one{
          {b.targets.data() + a, len}, {}, {b.weights.data() + a, len}, -100};
      std::vector<double> g(len);
      std::vector<std::int64_t> c(1);
      looped += lce::sft_loss(thrust::host, one, lce::vector_view<const double>{b.logp.data() + a, len}, norm,
                              lce::sft_outputs<double>{mv(g), {}, mv(c)}, lce::sft_options{red})
                    .loss;
      for (std::int64_t k = 0; k < len; ++k) CHECK(g[k] == grad[a + k]);
    }
    CHECK(close(packed, looped, 1e-13));
  }
}

TEST_CASE("shift_targets_packed: next token inside each sequence, ignore_index at every sequence end") {
  const std::vector<std::int32_t> tokens{10, 11, 12, 20, 30, 31};
  const std::vector<std::int32_t> cu{0, 3, 4, 4, 6, 6};  // lengths 3, 1, 0, 2, 0
  std::vector<std::int64_t> targets(tokens.size(), 7);
  lce::shift_targets_packed(cv(tokens), cv(cu), mv(targets), -1);
  CHECK(targets == std::vector<std::int64_t>{11, 12, -1, -1, 31, -1});
  std::vector<std::int32_t> t32(tokens.size());
  lce::shift_targets_packed(thrust::host, cv(tokens), lce::vector_view<const std::int32_t>{}, mv(t32));
  CHECK(t32 == std::vector<std::int32_t>{11, 12, 20, 30, 31, -100});  // no cu_seqlens: one sequence
  std::vector<std::int64_t> none;
  const std::vector<std::int32_t> empty_tokens, cu0{0};
  lce::shift_targets_packed(cv(empty_tokens), cv(cu0), mv(none));
  CHECK(lce::check_cu_seqlens(thrust::host, cv(cu), 6) == 5);
}

TEST_CASE("packed: bad cu_seqlens and sizes raise lce::error naming them; outputs untouched") {
  const std::vector<std::int64_t> tokens{1, 2, 3, 4};
  std::vector<std::int64_t> out(4, 5);
  const auto untouched = out;
  check_error([&] { lce::shift_targets_packed(cv(tokens), cv(std::vector<std::int64_t>{1, 2, 4}), mv(out)); },
              "cu_seqlens[0] = 1: the first offset must be 0");
  check_error([&] { lce::shift_targets_packed(cv(tokens), cv(std::vector<std::int64_t>{0, 3, 2, 4}), mv(out)); },
              "cu_seqlens must be non-decreasing: cu_seqlens[1] = 3 > cu_seqlens[2] = 2");
  check_error([&] { lce::shift_targets_packed(cv(tokens), cv(std::vector<std::int64_t>{0, 2, 5}), mv(out)); },
              "cu_seqlens[2] = 5: the last offset must be the number of tokens (4)");
  std::vector<std::int64_t> out3(3, 5);
  check_error([&] { lce::shift_targets_packed(cv(tokens), cv(std::vector<std::int64_t>{0, 4}), mv(out3)); },
              "targets_out: size 3 does not match token_ids (4)");
  CHECK(out == untouched);

  const auto b = make_batch({3, 2}, 3);
  std::vector<float> grad(b.n(), 4.0f);
  const auto g0 = grad;
  std::vector<std::int64_t> counts(b.s(), 9);
  const auto c0 = counts;
  check_error([&] { lce::sft_grad_logprobs(thrust::host, b.view(), std::nan(""), mv(grad), mv(counts)); },
              "normaliser must be finite and >= 0, got nan");
  check_error([&] { lce::sft_grad_logprobs(thrust::host, b.view(), -1.0, mv(grad), mv(counts)); },
              "normaliser must be finite and >= 0, got -1");
  check_error(
      [&] {
        lce::sft_grad_logprobs(thrust::host, b.view(), 1.0, mv(grad), {},
                               lce::sft_options{lce::loss_reduction::sequence_mean});
      },
      "seq_tokens: sequence_mean needs it");
  auto bad = b.view();
  bad.weights.size = 3;
  check_error([&] { lce::sft_grad_logprobs(thrust::host, bad, 1.0, mv(grad), mv(counts)); },
              "weights: size 3 does not match the number of tokens (5)");
  std::vector<double> lp_short(4);
  check_error(
      [&] {
        lce::sft_loss(thrust::host, b.view(), cv(lp_short), 1.0, lce::sft_outputs<float>{mv(grad), {}, {}});
      },
      "targets: size 5 does not match the number of tokens (4)");
  std::vector<std::int64_t> seq3(3);
  check_error([&] { lce::sft_grad_logprobs(thrust::host, b.view(), 1.0, mv(grad), mv(seq3)); },
              "seq_tokens: size 3 does not match the number of sequences (2)");
  CHECK(grad == g0);
  CHECK(counts == c0);
}

TEST_CASE("sft: zero counted tokens and empty batches give loss 0, zero gradient, no NaN") {
  auto b = make_batch({3, 0, 2}, 9);
  for (auto& t : b.targets) t = -100;
  for (auto red : {lce::loss_reduction::token_mean, lce::loss_reduction::sequence_mean}) {
    CHECK(lce::count_loss_units(thrust::host, b.view(), b.n(), red) == 0);
    std::vector<float> grad(b.n(), 3.0f);
    std::vector<std::int64_t> counts(b.s(), 3);
    const auto r = lce::sft_loss(thrust::host, b.view(), cv(b.logp), 0.0,
                                 lce::sft_outputs<float>{mv(grad), {}, mv(counts)}, lce::sft_options{red});
    CHECK(r.loss == 0.0);
    CHECK(r.tokens == 0);
    for (float g : grad) CHECK(g == 0.0f);
    for (auto c : counts) CHECK(c == 0);
  }
  const lce::packed_tokens<std::int64_t, std::int64_t> empty{};
  std::vector<double> none;
  CHECK(lce::sft_loss(thrust::host, empty, cv(none), 0.0, lce::sft_outputs<float>{}).loss == 0.0);
  const std::vector<std::int64_t> cu_zero{0, 0, 0};
  const lce::packed_tokens<std::int64_t, std::int64_t> two_empty{{}, cv(cu_zero), {}};
  std::vector<std::int64_t> counts(2, 5);
  std::vector<double> nll(2, 5.0);
  CHECK(lce::sft_loss(thrust::host, two_empty, cv(none), 0.0, lce::sft_outputs<float>{{}, mv(nll), mv(counts)})
            .loss == 0.0);
  CHECK(counts == std::vector<std::int64_t>{0, 0});
  CHECK(nll == std::vector<double>{0.0, 0.0});
}

TEST_CASE("sft: the ranks' losses (lce::comm::threads, global normaliser) sum to the one-rank loss") {
  const auto b = make_batch({4, 3, 1, 0, 5, 2, 6}, 21);
  for (auto red : {lce::loss_reduction::token_mean, lce::loss_reduction::sequence_mean}) {
    const double norm1 = double(lce::count_loss_units(thrust::host, b.view(), b.n(), red));
    std::vector<double> grad1(b.n());
    std::vector<std::int64_t> c1(b.s());
    const double one = lce::sft_loss(thrust::host, b.view(), cv(b.logp), norm1,
                                     lce::sft_outputs<double>{mv(grad1), {}, mv(c1)}, lce::sft_options{red})
                           .loss;
    for (int P : {2, 3}) {
      CAPTURE(P);
      // rank r takes sequences [s0, s1): a data-parallel split of whole sequences
      lce::comm::thread_group group(P);
      std::vector<double> losses(P);
      std::vector<double> grad(b.n(), 0.0);
      std::vector<std::thread> ranks;
      for (int r = 0; r < P; ++r)
        ranks.emplace_back([&, r] {
          lce::comm::threads comm{group, r};
          const std::int64_t s0 = b.s() * r / P, s1 = b.s() * (r + 1) / P;
          const std::int64_t a = b.cu[s0], len = b.cu[s1] - a;
          std::vector<std::int64_t> cu;
          for (std::int64_t s = s0; s <= s1; ++s) cu.push_back(b.cu[s] - a);
          lce::packed_tokens<std::int64_t, std::int64_t> mine{
              {b.targets.data() + a, len}, cv(cu), {b.weights.data() + a, len}, -100};
          const double norm =
              double(lce::global_token_count(comm, lce::count_loss_units(thrust::host, mine, len, red)));
          std::vector<std::int64_t> counts(s1 - s0);
          losses[r] = lce::sft_loss(thrust::host, mine, lce::vector_view<const double>{b.logp.data() + a, len}, norm,
                                    lce::sft_outputs<double>{{grad.data() + a, len}, {}, mv(counts)},
                                    lce::sft_options{red})
                          .loss;
        });
      for (auto& t : ranks) t.join();
      double sum = 0;
      for (double l : losses) sum += l;
      CHECK(close(sum, one, 1e-13));
      for (std::int64_t i = 0; i < b.n(); ++i) CHECK(close(grad[i], grad1[i], 1e-15));
    }
  }
}

TEST_CASE("sft end to end: hidden -> op.forward -> SFT loss -> op.backward matches finite differences") {
  const std::int64_t H = 6, V = 11;
  const auto b = make_batch({4, 1, 0, 3}, 31, true);
  const std::int64_t N = b.n();
  std::mt19937_64 rng(3);
  std::normal_distribution<double> g(0.0, 0.7);
  std::vector<double> x(N * H), w(V * H);
  for (auto& e : x) e = g(rng);
  for (auto& e : w) e = g(rng);
  auto batch = b;
  for (auto& t : batch.targets)
    if (t != -100) t %= V;
  lce::ChunkedHiddenToLogprobs<lce::comm::single, double> op{lce::comm::single{}};
  const double norm = double(lce::count_loss_units(thrust::host, batch.view(), N));
  auto loss_of = [&](const std::vector<double>& xs) {
    std::vector<double> lp(N), lse(N);
    op.forward(lce::matrix_view<const double>{xs.data(), N, H}, lce::matrix_view<const double>{w.data(), V, H},
               cv(batch.targets), mv(lp), mv(lse));
    return lce::sft_loss(thrust::host, batch.view(), cv(lp), norm, lce::sft_outputs<double>{}).loss;
  };
  // forward, loss with its gradient, backward
  std::vector<double> lp(N), lse(N), glp(N), dx(N * H), dw(V * H, 0.0);
  op.forward(lce::matrix_view<const double>{x.data(), N, H}, lce::matrix_view<const double>{w.data(), V, H},
             cv(batch.targets), mv(lp), mv(lse));
  lce::sft_loss(thrust::host, batch.view(), cv(lp), norm, lce::sft_outputs<double>{mv(glp), {}, {}});
  op.backward(lce::matrix_view<const double>{x.data(), N, H}, lce::matrix_view<const double>{w.data(), V, H},
              cv(batch.targets), cv(lse), cv(glp), lce::matrix_view<double>{dx.data(), N, H},
              lce::matrix_view<double>{dw.data(), V, H});
  // the fused sweep with the gradient computed before the forward gives the same
  std::vector<double> early(N), lp_fb(N), dx_fb(N * H), dw_fb(V * H, 0.0);
  lce::sft_grad_logprobs(thrust::host, batch.view(), norm, mv(early), {});
  op.forward_backward(lce::matrix_view<const double>{x.data(), N, H}, lce::matrix_view<const double>{w.data(), V, H},
                      cv(batch.targets), cv(early), mv(lp_fb), lce::matrix_view<double>{dx_fb.data(), N, H},
                      lce::matrix_view<double>{dw_fb.data(), V, H});
  for (std::int64_t k = 0; k < N * H; ++k) CHECK(close(dx_fb[k], dx[k], 1e-12));
  const double h = 1e-6;
  for (std::int64_t k = 0; k < N * H; ++k) {
    auto xs = x;
    xs[k] += h;
    const double up = loss_of(xs);
    xs[k] -= 2 * h;
    const double down = loss_of(xs);
    CHECK(std::fabs((up - down) / (2 * h) - dx[k]) < 1e-8);
  }
}
