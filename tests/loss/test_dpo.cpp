// DPO (with the optional SFT term and length averaging) over packed sequences.
#include "loss/loss_support.hpp"

#include <lce/comm/threads.hpp>
#include <lce/lce.hpp>

#include <thread>

using namespace lce_loss_test;

namespace {

struct dpo_ref {
  double loss = 0, accuracy = 0, margin = 0, chosen = 0, rejected = 0;
  std::vector<double> grad, pi, seq_grad;
  std::vector<std::int64_t> n;
};

// pairs flat (c0, r0, c1, r1, ...)
dpo_ref reference_dpo(const batch& b, const std::vector<double>& logp, const std::vector<double>& ref,
                      const std::vector<std::int64_t>& pairs, double norm, const lce::dpo_options& o) {
  dpo_ref r;
  const auto S = b.s();
  r.pi.assign(S, 0);
  r.n.assign(S, 0);
  r.seq_grad.assign(S, 0);
  r.grad.assign(b.n(), 0);
  std::vector<double> sum(S, 0);
  for (std::int64_t s = 0; s < S; ++s)
    for (std::int64_t i = b.cu[s]; i < b.cu[s + 1]; ++i)
      if (b.w(i) != 0) {
        ++r.n[s];
        sum[s] += b.w(i) * logp[i];
      }
  for (std::int64_t s = 0; s < S; ++s) r.pi[s] = o.length_average ? (r.n[s] ? sum[s] / double(r.n[s]) : 0) : sum[s];
  const std::int64_t P = std::int64_t(pairs.size()) / 2;
  const double inv = norm > 0 ? 1 / norm : 0;
  for (std::int64_t p = 0; p < P; ++p) {
    const auto c = pairs[2 * p], j = pairs[2 * p + 1];
    const double rc = o.beta * (r.pi[c] - ref[c]), rr = o.beta * (r.pi[j] - ref[j]);
    const double m = rc - rr;
    const double nll = r.n[c] ? -sum[c] / double(r.n[c]) : 0;
    r.loss += inv * (std::log1p(std::exp(-m)) + o.sft_coef * nll);
    r.accuracy += (rc > rr) / double(P);
    r.margin += m / double(P);
    r.chosen += rc / double(P);
    r.rejected += rr / double(P);
    const double sg = 1 / (1 + std::exp(m));  // sigmoid(-m)
    r.seq_grad[c] = inv * (-o.beta * sg + o.sft_coef * (r.n[c] ? (o.length_average ? -1.0 : -1.0 / double(r.n[c])) : 0));
    r.seq_grad[j] = inv * o.beta * sg;
  }
  for (std::int64_t s = 0; s < S; ++s)
    for (std::int64_t i = b.cu[s]; i < b.cu[s + 1]; ++i)
      if (b.w(i) != 0) r.grad[i] = r.seq_grad[s] * b.w(i) / (o.length_average ? double(r.n[s]) : 1.0);
  return r;
}

struct run_out {
  lce::dpo_result res;
  std::vector<double> grad, pi, seq_grad;
  std::vector<std::int64_t> n;
};

run_out run_dpo(const batch& b, const std::vector<double>& logp, const std::vector<double>& ref,
                const std::vector<std::int64_t>& pairs, double norm, const lce::dpo_options& o) {
  run_out r;
  r.grad.assign(b.n(), 7);
  r.pi.assign(b.s(), 7);
  r.seq_grad.assign(b.s(), 7);
  r.n.assign(b.s(), 7);
  r.res = lce::dpo_loss(thrust::host, b.view(), lce::dpo_inputs<double>{cv(logp), cv(ref), cv(pairs)}, norm,
                        lce::dpo_outputs<double>{mv(r.grad), mv(r.pi), mv(r.seq_grad), mv(r.n)}, o);
  return r;
}

std::vector<lce::dpo_options> dpo_sets() {
  return {lce::dpo_options{0.1, 0.0, false}, lce::dpo_options{0.5, 0.3, false}, lce::dpo_options{2.0, 1.0, true}};
}

}  // namespace

TEST_CASE("dpo: loss, metrics, dL/dlogp against a plain reference and finite differences") {
  // 8 sequences, including a one-token and an empty one; pairs in a shuffled order
  const auto b = make_batch({5, 3, 1, 4, 0, 6, 2, 3}, 77);
  const std::vector<std::int64_t> pairs{3, 0, 1, 2, 5, 7, 6, 4};
  std::vector<double> ref(b.s());
  for (std::int64_t s = 0; s < b.s(); ++s) ref[s] = -1.0 - 0.7 * double(s % 3);
  int set = 0;
  for (const auto& o : dpo_sets()) {
    CAPTURE(set++);
    const double norm = 4 + 3;  // 3 more pairs on other ranks
    const auto want = reference_dpo(b, b.logp, ref, pairs, norm, o);
    const auto got = run_dpo(b, b.logp, ref, pairs, norm, o);
    CHECK(close(got.res.loss, want.loss, 1e-12));
    CHECK(close(got.res.dpo_loss + got.res.sft_loss, got.res.loss, 1e-12));
    CHECK(got.res.pairs == 4);
    CHECK(close(got.res.reward_accuracy, want.accuracy, 1e-12));
    CHECK(close(got.res.mean_margin, want.margin, 1e-12));
    CHECK(close(got.res.chosen_reward, want.chosen, 1e-12));
    CHECK(close(got.res.rejected_reward, want.rejected, 1e-12));
    for (std::int64_t s = 0; s < b.s(); ++s) {
      CHECK(close(got.pi[s], want.pi[s], 1e-12));
      CHECK(close(got.seq_grad[s], want.seq_grad[s], 1e-12));
      CHECK(got.n[s] == want.n[s]);
    }
    for (std::int64_t i = 0; i < b.n(); ++i) CHECK(close(got.grad[i], want.grad[i], 1e-12));
    const double h = 1e-6;
    for (std::int64_t i = 0; i < b.n(); ++i) {
      auto lp = b.logp;
      lp[i] += h;
      const double up = run_dpo(b, lp, ref, pairs, norm, o).res.loss;
      lp[i] -= 2 * h;
      const double down = run_dpo(b, lp, ref, pairs, norm, o).res.loss;
      CHECK(std::fabs((up - down) / (2 * h) - got.grad[i]) < 1e-8);
    }
  }
}

TEST_CASE("dpo: consecutive pairs, packed equal to one pair at a time, reference from sequence_logprobs") {
  const auto b = make_batch({4, 2, 1, 5, 3, 3}, 13);
  auto ref_logp = b.logp;
  for (auto& v : ref_logp) v *= 1.1;
  for (const auto& o : dpo_sets()) {
    std::vector<double> ref(b.s());
    std::vector<std::int64_t> n(b.s());
    lce::sequence_logprobs(thrust::host, b.view(), cv(ref_logp), mv(ref), mv(n), o.length_average);
    const auto explicit_pairs = run_dpo(b, b.logp, ref, {0, 1, 2, 3, 4, 5}, 3, o);
    std::vector<double> grad(b.n()), pi(b.s()), sg(b.s());
    std::vector<std::int64_t> cnt(b.s());
    const auto consecutive = lce::dpo_loss(thrust::host, b.view(), lce::dpo_inputs<double>{cv(b.logp), cv(ref), {}}, 3,
                                           lce::dpo_outputs<double>{mv(grad), mv(pi), mv(sg), mv(cnt)}, o);
    CHECK(consecutive.loss == explicit_pairs.res.loss);
    CHECK(grad == explicit_pairs.grad);
    double looped = 0;
    for (std::int64_t p = 0; p < 3; ++p) {
      const std::int64_t a = b.cu[2 * p], len = b.cu[2 * p + 2] - a;
      const std::vector<std::int64_t> cu{0, b.cu[2 * p + 1] - a, len};
      lce::packed_tokens<std::int64_t, std::int64_t> one{{b.targets.data() + a, len}, cv(cu), {b.weights.data() + a, len}};
      std::vector<double> g(len), pi2(2), sg2(2);
      std::vector<std::int64_t> n2(2);
      looped += lce::dpo_loss(thrust::host, one,
                              lce::dpo_inputs<double>{{b.logp.data() + a, len}, {ref.data() + 2 * p, 2}, {}}, 3,
                              lce::dpo_outputs<double>{mv(g), mv(pi2), mv(sg2), mv(n2)}, o)
                    .loss;
      for (std::int64_t k = 0; k < len; ++k) CHECK(g[k] == grad[a + k]);
    }
    CHECK(close(looped, consecutive.loss, 1e-13));
  }
}

TEST_CASE("dpo: no pairs, empty chosen sequences and all-ignored tokens give finite results") {
  auto b = make_batch({3, 0, 0, 2}, 3);  // pairs (0,1), (2,3): an empty rejected and an empty chosen
  std::vector<double> ref(b.s(), -1.0);
  for (const auto& o : dpo_sets()) {
    const auto r = run_dpo(b, b.logp, ref, {0, 1, 2, 3}, 2, o);
    CHECK(std::isfinite(r.res.loss));
    for (double g : r.grad) CHECK(std::isfinite(g));
    const auto want = reference_dpo(b, b.logp, ref, {0, 1, 2, 3}, 2, o);
    CHECK(close(r.res.loss, want.loss, 1e-12));
  }
  // every token ignored: pi = 0 everywhere, finite loss log 2 per pair, zero gradient
  auto ignored = b;
  for (auto& t : ignored.targets) t = -100;
  const auto ri = run_dpo(ignored, ignored.logp, std::vector<double>(b.s(), 0.0), {0, 1, 2, 3}, 2, lce::dpo_options{0.1, 1.0, true});
  CHECK(ri.res.loss == doctest::Approx(std::log(2.0)));
  for (double g : ri.grad) CHECK(g == 0.0);
  // zero sequences, zero pairs: loss 0
  const std::vector<std::int64_t> cu_empty{0};
  const lce::packed_tokens<std::int64_t, std::int64_t> empty{{}, cv(cu_empty), {}};
  std::vector<double> none_lp;
  const auto r0 = lce::dpo_loss(thrust::host, empty, lce::dpo_inputs<double>{cv(none_lp), {}, {}}, 0.0,
                                lce::dpo_outputs<double>{{}, {}, {}, {}});
  CHECK(r0.loss == 0.0);
  CHECK(r0.pairs == 0);
  CHECK(r0.reward_accuracy == 0.0);
}

TEST_CASE("dpo: bad beta, coefficients, pairs and sizes raise lce::error naming them; outputs untouched") {
  const auto b = make_batch({2, 3, 1, 2}, 8);
  std::vector<double> ref(b.s(), -1), grad(b.n(), 3), pi(b.s(), 3), sg(b.s(), 3);
  std::vector<std::int64_t> n(b.s(), 3);
  const auto g0 = grad, p0 = pi;
  const auto n0 = n;
  auto run = [&](const std::vector<std::int64_t>& pairs, lce::dpo_options o, std::int64_t ref_size = 4) {
    lce::dpo_loss(thrust::host, b.view(), lce::dpo_inputs<double>{cv(b.logp), {ref.data(), ref_size}, cv(pairs)}, 2.0,
                  lce::dpo_outputs<double>{mv(grad), mv(pi), mv(sg), mv(n)}, o);
  };
  check_error([&] { run({0, 1}, lce::dpo_options{std::nan(""), 0, false}); }, "dpo_options.beta must be finite and > 0, got nan");
  check_error([&] { run({0, 1}, lce::dpo_options{0.0, 0, false}); }, "dpo_options.beta must be finite and > 0, got 0");
  check_error([&] { run({0, 1}, lce::dpo_options{0.1, -1, false}); }, "dpo_options.sft_coef must be finite and >= 0, got -1");
  check_error([&] { run({0, 1, 2, 4}, {}); }, "pairs[1] = (2, 4): chosen and rejected must be different sequences in [0, 4)");
  check_error([&] { run({0, 1, 3, 3}, {}); }, "pairs[1] = (3, 3)");
  check_error([&] { run({0, -1}, {}); }, "pairs[0] = (0, -1)");
  check_error([&] { run({0, 1, 2}, {}); }, "pairs: size 3 is odd");
  check_error([&] { run({0, 1, 2, 1}, {}); }, "sequence 1 is also in pairs[");
  check_error([&] { run({0, 1, 2, 3, 0, 3}, {}); }, "is also in pairs[");
  check_error([&] { run({0, 1}, {}, 3); }, "ref_seq_logprobs: size 3 does not match the number of sequences (4)");
  CHECK(grad == g0);
  CHECK(pi == p0);
  CHECK(sg == p0);
  CHECK(n == n0);
  const auto odd = make_batch({2, 3, 1}, 8);
  std::vector<double> r3(3, -1), g3(odd.n()), pi3(3), sg3(3);
  std::vector<std::int64_t> n3(3);
  check_error(
      [&] {
        lce::dpo_loss(thrust::host, odd.view(), lce::dpo_inputs<double>{cv(odd.logp), cv(r3), {}}, 1.0,
                      lce::dpo_outputs<double>{mv(g3), mv(pi3), mv(sg3), mv(n3)});
      },
      "needs an even number of sequences, got 3");
}

TEST_CASE("dpo: ranks' losses (lce::comm::threads, global pair count) sum to the one-rank loss") {
  const auto b = make_batch({3, 2, 4, 1, 2, 5, 3, 3, 1, 2}, 99);  // 5 consecutive pairs
  std::vector<double> ref(b.s());
  for (std::int64_t s = 0; s < b.s(); ++s) ref[s] = -2.0 + 0.1 * double(s);
  for (const auto& o : dpo_sets()) {
    std::vector<double> g1(b.n()), pi1(b.s()), sg1(b.s());
    std::vector<std::int64_t> n1(b.s());
    const double one = lce::dpo_loss(thrust::host, b.view(), lce::dpo_inputs<double>{cv(b.logp), cv(ref), {}}, 5.0,
                                     lce::dpo_outputs<double>{mv(g1), mv(pi1), mv(sg1), mv(n1)}, o)
                           .loss;
    for (int P : {2, 3}) {
      lce::comm::thread_group group(P);
      std::vector<double> losses(P), grad(b.n());
      std::vector<std::thread> ranks;
      for (int r = 0; r < P; ++r)
        ranks.emplace_back([&, r] {
          lce::comm::threads comm{group, r};
          const std::int64_t p0 = 5 * r / P, p1 = 5 * (r + 1) / P, s0 = 2 * p0, s1 = 2 * p1;
          const std::int64_t a = b.cu[s0], len = b.cu[s1] - a;
          std::vector<std::int64_t> cu;
          for (std::int64_t s = s0; s <= s1; ++s) cu.push_back(b.cu[s] - a);
          lce::packed_tokens<std::int64_t, std::int64_t> mine{{b.targets.data() + a, len}, cv(cu), {b.weights.data() + a, len}};
          const lce::dpo_inputs<double> in{{b.logp.data() + a, len}, {ref.data() + s0, s1 - s0}, {}};
          const double norm = double(lce::global_token_count(comm, lce::count_pairs(in, s1 - s0)));
          std::vector<double> pi(s1 - s0), sg(s1 - s0);
          std::vector<std::int64_t> n(s1 - s0);
          losses[r] = lce::dpo_loss(thrust::host, mine, in, norm,
                                    lce::dpo_outputs<double>{{grad.data() + a, len}, mv(pi), mv(sg), mv(n)}, o)
                          .loss;
        });
      for (auto& t : ranks) t.join();
      double sum = 0;
      for (double l : losses) sum += l;
      CHECK(close(sum, one, 1e-13));
      for (std::int64_t i = 0; i < b.n(); ++i) CHECK(close(grad[i], g1[i], 1e-15));
    }
  }
}
