// Clipped policy gradient (PPO / GRPO / DAPO family).
#include "loss/loss_support.hpp"

#include <lce/comm/threads.hpp>
#include <lce/lce.hpp>

#include <thread>

using namespace lce_loss_test;

namespace {

struct pg_data {
  batch b;
  std::vector<double> adv, adv_seq, old, ref, gen, ent;
};

pg_data make_pg(std::vector<std::int64_t> lengths, unsigned seed) {
  pg_data d;
  d.b = make_batch(lengths, seed);
  std::mt19937_64 rng(seed + 1);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  const auto n = d.b.n();
  for (std::int64_t i = 0; i < n; ++i) {
    d.adv.push_back(u(rng) * 2);
    // log-ratios spread over [-0.5, 0.5], away from the clip edges by at least 0.01
    double lr = 0.5 * u(rng);
    for (double edge : {std::log(0.8), std::log(1.2), std::log(0.85), std::log(1.28)})
      if (std::fabs(lr - edge) < 0.01) lr += 0.03;
    d.old.push_back(d.b.logp[i] - lr);
    d.ref.push_back(d.b.logp[i] + 0.3 * u(rng));
    d.gen.push_back(d.old[i] + 0.4 * u(rng));
    d.ent.push_back(1.5 + u(rng));
  }
  for (std::int64_t s = 0; s < d.b.s(); ++s) d.adv_seq.push_back(u(rng) * 2);
  return d;
}

// Plain per-token loss l_i and dl_i/dlogp (reference; no Thrust).
struct ref_tok {
  double l, dl;
};
ref_tok ref_token(double lp, double a, const double* old, const double* ref, const double* gen, double ent,
                  const lce::pg_options& o) {
  const double oldv = old ? *old : lp;
  const double r = std::exp(lp - oldv);
  const double rc = std::min(std::max(r, 1 - o.eps_low), 1 + o.eps_high);
  double pg, dpg;
  if (-a * r >= -a * rc) {
    pg = -a * r;
    dpg = -a * r;
  } else {
    pg = -a * rc;
    dpg = 0;
  }
  if (o.dual_clip > 0 && a < 0 && -a * o.dual_clip < pg) {
    pg = -a * o.dual_clip;
    dpg = 0;
  }
  if (gen && o.tis_cap > 0) {
    const double t = std::min(std::exp(oldv - *gen), o.tis_cap);
    pg *= t;
    dpg *= t;
  }
  double kl = 0, dkl = 0;
  if (ref) {
    const double d = *ref - lp;
    if (o.kl == lce::kl_estimator::k3) {
      kl = std::exp(d) - d - 1;
      dkl = 1 - std::exp(d);
    } else {
      kl = -d;
      dkl = 1;
    }
  }
  return {pg + o.kl_coef * kl - o.entropy_coef * ent, dpg + o.kl_coef * dkl};
}

struct pg_ref {
  double loss = 0;
  std::vector<double> grad, grad_ent, seq_loss;
};
pg_ref reference_pg(const pg_data& d, const std::vector<double>& logp, const std::vector<double>& ent, double norm,
                    const lce::pg_options& o, bool use_old) {
  const auto& b = d.b;
  pg_ref r;
  r.grad.assign(b.n(), 0);
  r.grad_ent.assign(b.n(), 0);
  r.seq_loss.assign(b.s(), 0);
  for (std::int64_t s = 0; s < b.s(); ++s) {
    std::int64_t ns = 0;
    for (std::int64_t i = b.cu[s]; i < b.cu[s + 1]; ++i) ns += b.w(i) != 0;
    for (std::int64_t i = b.cu[s]; i < b.cu[s + 1]; ++i) {
      if (b.w(i) == 0) continue;
      const double a = o.sequence_advantages ? d.adv_seq[s] : d.adv[i];
      const auto t = ref_token(logp[i], a, use_old ? &d.old[i] : nullptr, o.kl_coef > 0 ? &d.ref[i] : nullptr,
                               o.tis_cap > 0 ? &d.gen[i] : nullptr, ent[i], o);
      r.seq_loss[s] += b.w(i) * t.l;
      const double scale = norm == 0 ? 0
                           : o.reduction == lce::loss_reduction::sequence_mean ? b.w(i) / (norm * double(ns))
                                                                                : b.w(i) / norm;
      r.loss += scale * t.l;
      r.grad[i] = scale * t.dl;
      r.grad_ent[i] = -scale * o.entropy_coef;
    }
  }
  return r;
}

lce::pg_inputs<double> inputs_of(const pg_data& d, const std::vector<double>& logp, const std::vector<double>& ent,
                                 const lce::pg_options& o, bool use_old) {
  lce::pg_inputs<double> in;
  in.logprobs = cv(logp);
  in.advantages = o.sequence_advantages ? cv(d.adv_seq) : cv(d.adv);
  if (use_old) in.old_logprobs = cv(d.old);
  if (o.kl_coef > 0) in.ref_logprobs = cv(d.ref);
  if (o.tis_cap > 0) in.generation_logprobs = cv(d.gen);
  in.entropy = cv(ent);
  return in;
}

std::vector<lce::pg_options> option_sets() {
  std::vector<lce::pg_options> v;
  lce::pg_options ppo;  // PPO token mean, k3 KL, entropy bonus
  ppo.kl_coef = 0.05;
  ppo.entropy_coef = 0.01;
  v.push_back(ppo);
  lce::pg_options grpo;  // GRPO: sequence mean, per-sequence advantages, k3, dual clip
  grpo.reduction = lce::loss_reduction::sequence_mean;
  grpo.sequence_advantages = true;
  grpo.kl_coef = 0.1;
  grpo.dual_clip = 3.0;
  v.push_back(grpo);
  lce::pg_options dapo;  // DAPO: clip-higher, token mean, TIS, k1, no KL coefficient... k1 with coefficient
  dapo.eps_low = 0.15;
  dapo.eps_high = 0.28;
  dapo.tis_cap = 1.1;
  dapo.kl = lce::kl_estimator::k1;
  dapo.kl_coef = 0.02;
  dapo.dual_clip = 1.5;
  v.push_back(dapo);
  return v;
}

}  // namespace

TEST_CASE("policy gradient: loss, dL/dlogp, dL/dentropy against a plain reference and finite differences") {
  const auto d = make_pg({6, 1, 0, 9, 4}, 41);
  const auto& b = d.b;
  int set = 0;
  for (const auto& o : option_sets()) {
    for (bool use_old : {true, false}) {
      CAPTURE(set);
      CAPTURE(use_old);
      const double norm = double(lce::count_loss_units(thrust::host, b.view(), b.n(), o.reduction)) + 2;
      const auto ref = reference_pg(d, b.logp, d.ent, norm, o, use_old);
      std::vector<double> grad(b.n(), 9), gent(b.n(), 9), seq_loss(b.s(), 9);
      std::vector<std::int64_t> counts(b.s());
      const auto res = lce::policy_gradient_loss(thrust::host, b.view(), inputs_of(d, b.logp, d.ent, o, use_old),
                                                 norm, lce::pg_outputs<double>{mv(grad), mv(gent), mv(seq_loss), mv(counts)},
                                                 o);
      CHECK(close(res.loss, ref.loss, 1e-12));
      CHECK(close(res.pg_loss + res.kl_loss + res.entropy_loss, res.loss, 1e-12));
      for (std::int64_t i = 0; i < b.n(); ++i) {
        CHECK(close(grad[i], ref.grad[i], 1e-12));
        CHECK(close(gent[i], ref.grad_ent[i], 1e-12));
      }
      for (std::int64_t s = 0; s < b.s(); ++s) CHECK(close(seq_loss[s], ref.seq_loss[s], 1e-12));
      // central differences w.r.t. logp (old / ref / gen held fixed) and entropy
      auto loss_at = [&](const std::vector<double>& lp, const std::vector<double>& en) {
        std::vector<double> g(b.n()), ge(b.n());
        std::vector<std::int64_t> c(b.s());
        return lce::policy_gradient_loss(thrust::host, b.view(), inputs_of(d, lp, en, o, use_old), norm,
                                         lce::pg_outputs<double>{mv(g), mv(ge), {}, mv(c)}, o)
            .loss;
      };
      const double h = 1e-6;
      for (std::int64_t i = 0; i < b.n(); ++i) {
        auto lp = b.logp;
        if (!use_old) break;  // without old_logprobs the ratio is 1 by definition (old = logp, held fixed)
        lp[i] += h;
        const double up = loss_at(lp, d.ent);
        lp[i] -= 2 * h;
        const double down = loss_at(lp, d.ent);
        CHECK(std::fabs((up - down) / (2 * h) - grad[i]) < 1e-6);
        auto en = d.ent;
        en[i] += h;
        const double eu = loss_at(b.logp, en);
        en[i] -= 2 * h;
        const double ed = loss_at(b.logp, en);
        CHECK(std::fabs((eu - ed) / (2 * h) - gent[i]) < 1e-7);
      }
    }
    ++set;
  }
}

TEST_CASE("policy gradient: metrics, clip fractions and the on-policy case") {
  // four tokens, one sequence: ratios 1.5 (A > 0: high clip), 0.5 (A < 0: low clip), 1 (A > 0), 2 (A < 0: dual clip)
  const std::vector<double> lp{std::log(1.5), std::log(0.5), 0.0, std::log(2.0)}, old{0, 0, 0, 0};
  const std::vector<double> adv{1.0, -1.0, 2.0, -4.0}, ent{1, 2, 3, 4};
  lce::pg_options o;
  o.dual_clip = 1.5;
  lce::pg_inputs<double> in{cv(lp), cv(adv), cv(old), {}, {}, cv(ent)};
  std::vector<float> grad(4);
  const lce::packed_tokens<std::int64_t, std::int64_t> all{};
  const auto r = lce::policy_gradient_loss(thrust::host, all, in, 4.0, lce::pg_outputs<float>{mv(grad)}, o);
  CHECK(r.tokens == 4);
  CHECK(r.clip_frac_high == doctest::Approx(0.25));
  CHECK(r.clip_frac_low == doctest::Approx(0.25));
  CHECK(r.dual_clip_frac == doctest::Approx(0.25));
  CHECK(r.mean_ratio == doctest::Approx((1.5 + 0.5 + 1 + 2) / 4));
  CHECK(r.mean_entropy == doctest::Approx(2.5));
  CHECK(r.approx_kl == doctest::Approx(-(std::log(1.5) + std::log(0.5) + std::log(2.0)) / 4));
  // per token: max(-1.5, -1.2) = -1.2; max(0.5, 0.8) = 0.8; -2; min(max(8, 4.8), 4 * 1.5) = 6
  CHECK(r.loss == doctest::Approx((-1.2 + 0.8 - 2.0 + 6.0) / 4));
  CHECK(grad == std::vector<float>{0.0f, 0.0f, -2.0f / 4, 0.0f});
}

TEST_CASE("policy gradient: packed equals looping over sequences; zero tokens give 0 and no NaN") {
  const auto d = make_pg({3, 0, 5, 1, 4}, 7);
  const auto& b = d.b;
  lce::pg_options o = option_sets()[0];
  const double norm = double(lce::count_loss_units(thrust::host, b.view(), b.n()));
  std::vector<double> grad(b.n()), gent(b.n());
  const double packed = lce::policy_gradient_loss(thrust::host, b.view(), inputs_of(d, b.logp, d.ent, o, true), norm,
                                                  lce::pg_outputs<double>{mv(grad), mv(gent)}, o)
                            .loss;
  double looped = 0;
  for (std::int64_t s = 0; s < b.s(); ++s) {
    const std::int64_t a = b.cu[s], len = b.cu[s + 1] - a;
    lce::packed_tokens<std::int64_t, std::int64_t> one{{b.targets.data() + a, len}, {}, {b.weights.data() + a, len}};
    auto sub = [&](const std::vector<double>& v) { return lce::vector_view<const double>{v.data() + a, len}; };
    lce::pg_inputs<double> in{sub(b.logp), sub(d.adv), sub(d.old), sub(d.ref), {}, sub(d.ent)};
    std::vector<double> g(len), ge(len);
    looped += lce::policy_gradient_loss(thrust::host, one, in, norm, lce::pg_outputs<double>{mv(g), mv(ge)}, o).loss;
    for (std::int64_t k = 0; k < len; ++k) {
      CHECK(g[k] == grad[a + k]);
      CHECK(ge[k] == gent[a + k]);
    }
  }
  CHECK(close(packed, looped, 1e-13));

  auto none = d;
  for (auto& t : none.b.targets) t = -100;
  for (std::int64_t i = 0; i < none.b.n(); i += 2) none.b.logp[i] = std::nan("");  // ignored tokens' values are not read
  for (auto red : {lce::loss_reduction::token_mean, lce::loss_reduction::sequence_mean}) {
    lce::pg_options oz = o;
    oz.reduction = red;
    std::vector<float> g(b.n(), 5), ge(b.n(), 5);
    std::vector<std::int64_t> c(b.s());
    const auto r = lce::policy_gradient_loss(thrust::host, none.b.view(), inputs_of(none, none.b.logp, d.ent, oz, true),
                                             0.0, lce::pg_outputs<float>{mv(g), mv(ge), {}, mv(c)}, oz);
    CHECK(r.loss == 0.0);
    CHECK(r.tokens == 0);
    CHECK(r.mean_ratio == 0.0);
    for (std::int64_t i = 0; i < b.n(); ++i) CHECK((g[i] == 0.0f && ge[i] == 0.0f));
  }
}

TEST_CASE("policy gradient: bad options and sizes raise lce::error naming them; outputs untouched") {
  const auto d = make_pg({3, 2}, 5);
  const auto& b = d.b;
  std::vector<float> grad(b.n(), 4), gent(b.n(), 4);
  const auto g0 = grad;
  auto run = [&](lce::pg_options o, lce::pg_inputs<double> in) {
    lce::policy_gradient_loss(thrust::host, b.view(), in, 1.0, lce::pg_outputs<float>{mv(grad), mv(gent)}, o);
  };
  const auto in = inputs_of(d, b.logp, d.ent, lce::pg_options{}, true);
  lce::pg_options o;
  o.eps_low = std::nan("");
  check_error([&] { run(o, in); }, "pg_options.eps_low must be in [0, 1), got nan");
  o = {};
  o.eps_high = -0.1;
  check_error([&] { run(o, in); }, "pg_options.eps_high must be finite and >= 0, got -0.1");
  o = {};
  o.dual_clip = 0.5;
  check_error([&] { run(o, in); }, "pg_options.dual_clip must be 0 (off) or a finite c > 1, got 0.5");
  o = {};
  o.kl_coef = -1;
  check_error([&] { run(o, in); }, "pg_options.kl_coef must be finite and >= 0, got -1");
  o = {};
  o.entropy_coef = -0.01;
  check_error([&] { run(o, in); }, "pg_options.entropy_coef must be finite and >= 0");
  o = {};
  o.kl_coef = 0.1;
  check_error([&] { run(o, in); }, "ref_logprobs: absent (size 0), but kl_coef > 0 needs it: size 5 (logprobs)");
  o = {};
  o.tis_cap = 2;
  check_error([&] { run(o, in); }, "generation_logprobs: absent (size 0), but tis_cap > 0 needs it: size 5 (logprobs)");
  o = {};
  o.sequence_advantages = true;
  check_error([&] { run(o, in); }, "advantages: size 5 does not match the number of sequences (sequence_advantages) (2)");
  o = {};
  o.reduction = lce::loss_reduction::sequence_mean;
  check_error([&] { run(o, in); }, "seq_tokens: absent (size 0), but sequence_mean needs it: size 2");
  auto bad = in;
  bad.old_logprobs.size = 4;
  check_error([&] { run({}, bad); }, "old_logprobs: size 4 does not match logprobs (5)");
  CHECK(grad == g0);
  CHECK(gent == g0);
}

TEST_CASE("policy gradient: ranks' losses (lce::comm::threads, global normaliser) sum to the one-rank loss") {
  const auto d = make_pg({4, 3, 1, 0, 5, 2}, 17);
  const auto& b = d.b;
  for (const auto& o : option_sets()) {
    const double norm1 = double(lce::count_loss_units(thrust::host, b.view(), b.n(), o.reduction));
    std::vector<double> g1(b.n()), ge1(b.n());
    std::vector<std::int64_t> c1(b.s());
    const double one = lce::policy_gradient_loss(thrust::host, b.view(), inputs_of(d, b.logp, d.ent, o, true), norm1,
                                                 lce::pg_outputs<double>{mv(g1), mv(ge1), {}, mv(c1)}, o)
                           .loss;
    const int P = 3;
    lce::comm::thread_group group(P);
    std::vector<double> losses(P), grad(b.n()), gent(b.n());
    std::vector<std::thread> ranks;
    for (int r = 0; r < P; ++r)
      ranks.emplace_back([&, r] {
        lce::comm::threads comm{group, r};
        const std::int64_t s0 = b.s() * r / P, s1 = b.s() * (r + 1) / P, a = b.cu[s0], len = b.cu[s1] - a;
        std::vector<std::int64_t> cu;
        for (std::int64_t s = s0; s <= s1; ++s) cu.push_back(b.cu[s] - a);
        lce::packed_tokens<std::int64_t, std::int64_t> mine{
            {b.targets.data() + a, len}, cv(cu), {b.weights.data() + a, len}};
        auto sub = [&](const std::vector<double>& v) { return lce::vector_view<const double>{v.data() + a, len}; };
        lce::pg_inputs<double> in{sub(b.logp),
                                  o.sequence_advantages ? lce::vector_view<const double>{d.adv_seq.data() + s0, s1 - s0}
                                                        : sub(d.adv),
                                  sub(d.old), o.kl_coef > 0 ? sub(d.ref) : lce::vector_view<const double>{},
                                  o.tis_cap > 0 ? sub(d.gen) : lce::vector_view<const double>{}, sub(d.ent)};
        const double norm =
            double(lce::global_token_count(comm, lce::count_loss_units(thrust::host, mine, len, o.reduction)));
        std::vector<std::int64_t> c(s1 - s0);
        losses[r] = lce::policy_gradient_loss(thrust::host, mine, in, norm,
                                              lce::pg_outputs<double>{{grad.data() + a, len}, {gent.data() + a, len}, {}, mv(c)}, o)
                        .loss;
      });
    for (auto& t : ranks) t.join();
    CHECK(close(losses[0] + losses[1] + losses[2], one, 1e-13));
    for (std::int64_t i = 0; i < b.n(); ++i) CHECK(close(grad[i], g1[i], 1e-15));
  }
}

TEST_CASE("policy gradient end to end: hidden -> op.forward (entropy) -> loss -> op.backward matches finite differences") {
  const std::int64_t H = 5, V = 9;
  auto d = make_pg({4, 1, 0, 3}, 55);
  auto& b = d.b;
  for (auto& t : b.targets)
    if (t != -100) t %= V;
  const std::int64_t N = b.n();
  std::mt19937_64 rng(8);
  std::normal_distribution<double> g(0.0, 0.6);
  std::vector<double> x(N * H), w(V * H);
  for (auto& e : x) e = g(rng);
  for (auto& e : w) e = g(rng);
  lce::ChunkedHiddenToLogprobs<lce::comm::single, double> op{lce::comm::single{}};
  const lce::matrix_view<const double> W{w.data(), V, H};
  std::vector<double> lp0(N), lse0(N);
  op.forward(lce::matrix_view<const double>{x.data(), N, H}, W, cv(b.targets), mv(lp0), mv(lse0));
  for (std::int64_t i = 0; i < N; ++i) d.old[i] = lp0[i] + 0.3 * g(rng);  // ratios away from 1
  for (std::int64_t i = 0; i < N; ++i) d.ref[i] = lp0[i] + 0.2 * g(rng);
  lce::pg_options o;
  o.reduction = lce::loss_reduction::sequence_mean;
  o.kl_coef = 0.1;
  o.entropy_coef = 0.05;
  o.eps_low = 0.5;  // wide: the clip edges stay away from the sampled ratios
  o.eps_high = 0.9;
  const double norm = double(lce::count_loss_units(thrust::host, b.view(), N, o.reduction));
  auto run = [&](const std::vector<double>& xs, std::vector<double>* glp, std::vector<double>* gent,
                 std::vector<double>* lse_out) {
    std::vector<double> lp(N), lse(N), ent(N), gl(N), ge(N);
    std::vector<std::int64_t> c(b.s());
    op.forward(lce::matrix_view<const double>{xs.data(), N, H}, W, cv(b.targets), mv(lp), mv(lse), mv(ent));
    const double loss = lce::policy_gradient_loss(thrust::host, b.view(), inputs_of(d, lp, ent, o, true), norm,
                                                  lce::pg_outputs<double>{mv(gl), mv(ge), {}, mv(c)}, o)
                            .loss;
    if (glp) *glp = gl;
    if (gent) *gent = ge;
    if (lse_out) *lse_out = lse;
    return loss;
  };
  std::vector<double> gl, ge, lse, dx(N * H), dw(V * H, 0.0);
  run(x, &gl, &ge, &lse);
  op.backward(lce::matrix_view<const double>{x.data(), N, H}, W, cv(b.targets), cv(lse), cv(gl), cv(ge),
              lce::matrix_view<double>{dx.data(), N, H}, lce::matrix_view<double>{dw.data(), V, H});
  const double h = 1e-6;
  for (std::int64_t k = 0; k < N * H; ++k) {
    auto xs = x;
    xs[k] += h;
    const double up = run(xs, nullptr, nullptr, nullptr);
    xs[k] -= 2 * h;
    const double down = run(xs, nullptr, nullptr, nullptr);
    CHECK(std::fabs((up - down) / (2 * h) - dx[k]) < 1e-7);
  }
}
