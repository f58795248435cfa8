// Bad values the losses used to accept silently (issue 8, item 8): non-finite
// per-token weights, advantages, log-probs and reference values; a normaliser
// of 0 while this rank has counted tokens (or pairs); outputs that alias inputs
// or each other. Each raises lce::error naming the argument and its value, and
// leaves every output bit-for-bit untouched. Values that no counted token
// reads (an ignored token's advantage) stay accepted.
#include "loss/loss_support.hpp"

#include <limits>

using namespace lce_loss_test;

namespace {

const double nan_v = std::numeric_limits<double>::quiet_NaN();
const double inf_v = std::numeric_limits<double>::infinity();

// A batch of two sequences {3, 2} with every token counted, except token 1 (ignored).
batch counted_batch() {
  batch b = make_batch({3, 2}, 11, false);
  for (std::int64_t i = 0; i < b.n(); ++i) {
    b.targets[i] = i == 1 ? -100 : 7;
    b.weights[i] = 1.0f;
    b.logp[i] = i == 1 ? 0.0 : -0.5 - 0.1 * double(i);
  }
  return b;
}

struct pg_case {
  batch b = counted_batch();
  std::vector<double> adv{0.5, -1.0, 1.5, -0.5, 2.0}, adv_seq{1.0, -1.0};
  std::vector<double> old, ref, gen, ent;
  std::vector<float> grad, gent;
  std::vector<double> seq_loss;
  std::vector<std::int64_t> seq_tokens;
  pg_case() {
    for (double lp : b.logp) {
      old.push_back(lp - 0.05);
      ref.push_back(lp + 0.1);
      gen.push_back(lp - 0.02);
      ent.push_back(2.0);
    }
    grad.assign(b.n(), 4.0f);
    gent.assign(b.n(), 4.0f);
    seq_loss.assign(b.s(), 4.0);
    seq_tokens.assign(b.s(), 4);
  }
  lce::pg_options options() const {
    lce::pg_options o;
    o.kl_coef = 0.1;
    o.tis_cap = 2.0;
    o.entropy_coef = 0.01;
    return o;
  }
  lce::pg_inputs<double> inputs() const {
    return {cv(b.logp), cv(adv), cv(old), cv(ref), cv(gen), cv(ent)};
  }
  lce::pg_result run(const lce::pg_inputs<double>& in, const lce::pg_options& o, double norm = 4.0) {
    return lce::policy_gradient_loss(thrust::host, b.view(), in, norm,
                                     lce::pg_outputs<float>{mv(grad), mv(gent), mv(seq_loss), mv(seq_tokens)}, o);
  }
  bool untouched() const {
    for (std::int64_t i = 0; i < b.n(); ++i)
      if (grad[i] != 4.0f || gent[i] != 4.0f) return false;
    for (std::int64_t s = 0; s < b.s(); ++s)
      if (seq_loss[s] != 4.0 || seq_tokens[s] != 4) return false;
    return true;
  }
};

}  // namespace

TEST_CASE("bad values: a non-finite per-token weight raises lce::error naming it; outputs untouched") {
  for (const double bad : {nan_v, inf_v, -inf_v}) {
    auto b = counted_batch();
    b.weights[3] = float(bad);
    std::vector<float> grad(b.n(), 4.0f);
    std::vector<std::int64_t> counts(b.s(), 4);
    std::vector<double> nll(b.s(), 4.0);
    const auto g0 = grad;
    const auto c0 = counts;
    const auto n0 = nll;
    check_error([&] { (void)lce::count_loss_units(thrust::host, b.view(), b.n()); }, "weights[3] = ");
    check_error([&] { lce::sft_grad_logprobs(thrust::host, b.view(), 4.0, mv(grad), mv(counts)); },
                "weights[3] = ");
    check_error(
        [&] {
          (void)lce::sft_loss(thrust::host, b.view(), cv(b.logp), 4.0,
                              lce::sft_outputs<float>{mv(grad), mv(nll), mv(counts)});
        },
        "weights[3] = ");
    check_error([&] { (void)lce::sft_loss(thrust::host, b.view(), cv(b.logp), 4.0, lce::sft_outputs<float>{}); },
                "is not finite");
    CHECK(grad == g0);
    CHECK(counts == c0);
    CHECK(nll == n0);
    pg_case pg;
    pg.b = b;
    check_error([&] { (void)pg.run(pg.inputs(), pg.options()); }, "weights[3] = ");
    CHECK(pg.untouched());
  }
  // on an ignored token too: the weight decides nothing there, but NaN in a mask is a bug upstream
  auto b = counted_batch();
  b.weights[1] = float(nan_v);
  std::vector<float> grad(b.n(), 4.0f);
  check_error([&] { lce::sft_grad_logprobs(thrust::host, b.view(), 4.0, mv(grad), {}); }, "weights[1] = nan");
}

TEST_CASE("bad values: policy gradient rejects non-finite advantages and log-probs of counted tokens") {
  struct bad_input {
    const char* name;
    std::vector<double> pg_case::*field;
    std::int64_t at;
  };
  for (const double bad : {nan_v, inf_v}) {
    for (const auto& c : {bad_input{"advantages", &pg_case::adv, 2}, bad_input{"old_logprobs", &pg_case::old, 4},
                          bad_input{"ref_logprobs", &pg_case::ref, 0},
                          bad_input{"generation_logprobs", &pg_case::gen, 3},
                          bad_input{"entropy", &pg_case::ent, 2}}) {
      CAPTURE(c.name);
      pg_case pg;
      (pg.*c.field)[c.at] = bad;
      check_error([&] { (void)pg.run(pg.inputs(), pg.options()); },
                  std::string(c.name) + "[" + std::to_string(c.at) + "] = " + (bad != bad ? "nan" : "inf"));
      CHECK(pg.untouched());
    }
    pg_case pg;
    pg.b.logp[2] = bad;
    check_error([&] { (void)pg.run(pg.inputs(), pg.options()); }, "logprobs[2] = ");
    CHECK(pg.untouched());
  }
  // per-sequence advantages: the bad entry is named by its sequence
  pg_case pg;
  pg.adv_seq[1] = nan_v;
  auto o = pg.options();
  o.sequence_advantages = true;
  auto in = pg.inputs();
  in.advantages = cv(pg.adv_seq);
  check_error([&] { (void)pg.run(in, o); }, "advantages[1] = nan");
  CHECK(pg.untouched());
}

TEST_CASE("bad values: values no counted token reads stay accepted (ignored tokens, unused inputs)") {
  pg_case pg;
  pg.adv[1] = nan_v;  // token 1 is ignore_index
  pg.old[1] = nan_v;
  pg.ref[1] = inf_v;
  pg.b.logp[1] = nan_v;
  auto r = pg.run(pg.inputs(), pg.options());
  CHECK(std::isfinite(r.loss));
  for (float g : pg.grad) CHECK(std::isfinite(g));
  CHECK(pg.grad[1] == 0.0f);
  // a weight-0 token's values do not matter either
  pg_case z;
  z.b.weights[4] = 0.0f;
  z.adv[4] = nan_v;
  r = z.run(z.inputs(), z.options());
  CHECK(std::isfinite(r.loss));
  CHECK(z.grad[4] == 0.0f);
}

TEST_CASE("bad values: a normaliser of 0 with counted tokens (or pairs) here raises lce::error") {
  const auto b = counted_batch();
  std::vector<float> grad(b.n(), 4.0f);
  const auto g0 = grad;
  check_error([&] { lce::sft_grad_logprobs(thrust::host, b.view(), 0.0, mv(grad), {}); },
              "normaliser is 0 but this rank has 4 counted tokens");
  check_error([&] { (void)lce::sft_loss(thrust::host, b.view(), cv(b.logp), 0.0, lce::sft_outputs<float>{mv(grad)}); },
              "normaliser is 0 but this rank has 4 counted tokens");
  CHECK(grad == g0);
  pg_case pg;
  check_error([&] { (void)pg.run(pg.inputs(), pg.options(), 0.0); }, "normaliser is 0 but this rank has 4 counted tokens");
  CHECK(pg.untouched());

  std::vector<double> ref(b.s(), -1.0), g(b.n(), 4.0), pi(b.s(), 4.0), sg(b.s(), 4.0);
  std::vector<std::int64_t> n(b.s(), 4);
  check_error(
      [&] {
        (void)lce::dpo_loss(thrust::host, b.view(), lce::dpo_inputs<double>{cv(b.logp), cv(ref), {}}, 0.0,
                            lce::dpo_outputs<double>{mv(g), mv(pi), mv(sg), mv(n)});
      },
      "normaliser is 0 but this rank has 1 pair(s): pass the global count (count_pairs summed by global_token_count)");
  CHECK(g == std::vector<double>(b.n(), 4.0));
  CHECK(pi == std::vector<double>(b.s(), 4.0));
}

TEST_CASE("bad values: inputs given for a metric alone: a reference far off (kl_coef 0) leaves the loss finite; an "
          "lse (no smoothing, no z-loss) is checked") {
  // k3's exp(ref - logp) overflows at token 0; with kl_coef 0 only the ref_kl metric may show it.
  batch b = counted_batch();
  std::vector<std::int64_t> cu{0, 2}, targets{1, 1};
  lce::packed_tokens<std::int64_t, std::int64_t> two{cv(targets), cv(cu), {}, -100};
  const std::vector<float> lp{-750.0f, -1.0f}, adv{1.0f, 1.0f}, ref{0.0f, -1.0f};
  std::vector<float> g(2, 4.0f);
  const auto r = lce::policy_gradient_loss(thrust::host, two, lce::pg_inputs<float>{cv(lp), cv(adv), {}, cv(ref)}, 2.0,
                                           lce::pg_outputs<float>{mv(g)}, lce::pg_options{});
  CHECK(r.loss == -1.0);  // -A r per token, r = 1 without old_logprobs, over 2 tokens
  CHECK(g == std::vector<float>{-0.5f, -0.5f});
  CHECK(std::isinf(r.ref_kl));

  // sft_loss reads a given lse for lse_square_sum, so it checks it.
  std::vector<double> lse(b.n(), 2.0);
  lse[2] = inf_v;
  std::vector<float> grad(b.n(), 4.0f);
  check_error(
      [&] {
        (void)lce::sft_loss(thrust::host, b.view(), cv(b.logp), 4.0, lce::sft_outputs<float>{mv(grad)},
                            lce::sft_options{}, lce::sft_smoothing_inputs<const double>{cv(lse), {}});
      },
      "lse[2] = inf is not finite");
  CHECK(grad == std::vector<float>(b.n(), 4.0f));
  lse[1] = nan_v;  // token 1 is ignore_index: not read
  lse[2] = 2.0;
  const auto sft = lce::sft_loss(thrust::host, b.view(), cv(b.logp), 4.0, lce::sft_outputs<float>{mv(grad)},
                                 lce::sft_options{}, lce::sft_smoothing_inputs<const double>{cv(lse), {}});
  CHECK(sft.lse_square_sum == 16.0);  // 4 counted tokens of weight 1, lse 2
}

TEST_CASE("bad values: DPO rejects non-finite reference sequence log-probs and policy log-probs of a pair") {
  const auto b = counted_batch();
  std::vector<double> g(b.n(), 4.0), pi(b.s(), 4.0), sg(b.s(), 4.0);
  std::vector<std::int64_t> n(b.s(), 4);
  auto run = [&](const std::vector<double>& logp, const std::vector<double>& ref) {
    (void)lce::dpo_loss(thrust::host, b.view(), lce::dpo_inputs<double>{cv(logp), cv(ref), {}}, 1.0,
                        lce::dpo_outputs<double>{mv(g), mv(pi), mv(sg), mv(n)});
  };
  check_error([&] { run(b.logp, {-1.0, nan_v}); }, "ref_seq_logprobs[1] = nan");
  check_error([&] { run(b.logp, {-inf_v, -1.0}); }, "ref_seq_logprobs[0] = -inf");
  auto lp = b.logp;
  lp[3] = nan_v;
  check_error([&] { run(lp, {-1.0, -1.0}); }, "logprobs[3] = nan");
  CHECK(g == std::vector<double>(b.n(), 4.0));
  CHECK(pi == std::vector<double>(b.s(), 4.0));
  CHECK(sg == std::vector<double>(b.s(), 4.0));
  CHECK(n == std::vector<std::int64_t>(b.s(), 4));
  // a sequence in no pair may carry anything: pairs (0, 1) of three sequences
  const auto b3 = make_batch({2, 2, 1}, 5);
  std::vector<double> g3(b3.n()), pi3(3), sg3(3), ref3{-1.0, -2.0, nan_v};
  std::vector<std::int64_t> n3(3);
  const std::vector<std::int64_t> pairs{0, 1};
  const auto r = lce::dpo_loss(thrust::host, b3.view(), lce::dpo_inputs<double>{cv(b3.logp), cv(ref3), cv(pairs)}, 1.0,
                               lce::dpo_outputs<double>{mv(g3), mv(pi3), mv(sg3), mv(n3)});
  CHECK(std::isfinite(r.loss));
}

TEST_CASE("bad values: the SFT loss rejects a non-finite log-prob of a counted token") {
  auto b = counted_batch();
  b.logp[4] = -inf_v;
  std::vector<float> grad(b.n(), 4.0f);
  check_error(
      [&] { (void)lce::sft_loss(thrust::host, b.view(), cv(b.logp), 4.0, lce::sft_outputs<float>{mv(grad)}); },
      "logprobs[4] = -inf");
  CHECK(grad == std::vector<float>(b.n(), 4.0f));
}

TEST_CASE("bad values: outputs that alias inputs or each other raise lce::error naming both") {
  auto b = counted_batch();
  // policy gradient: grad_logprobs written over logprobs would feed the metrics garbage
  std::vector<float> lp(b.logp.begin(), b.logp.end()), adv{0.5f, -1.0f, 1.5f, -0.5f, 2.0f}, ent(b.n(), 2.0f);
  std::vector<float> gent(b.n(), 4.0f);
  const auto lp0 = lp;
  check_error(
      [&] {
        (void)lce::policy_gradient_loss(thrust::host, b.view(), lce::pg_inputs<float>{cv(lp), cv(adv), {}, {}, {}, cv(ent)},
                                        4.0, lce::pg_outputs<float>{mv(lp), mv(gent)});
      },
      "grad_logprobs overlaps the input logprobs");
  check_error(
      [&] {
        (void)lce::policy_gradient_loss(thrust::host, b.view(), lce::pg_inputs<float>{cv(lp), cv(adv), {}, {}, {}, cv(ent)},
                                        4.0, lce::pg_outputs<float>{mv(gent), mv(gent)});
      },
      "grad_entropy overlaps the output grad_logprobs");
  CHECK(lp == lp0);
  CHECK(gent == std::vector<float>(b.n(), 4.0f));
  // SFT: the per-sequence NLL is read from logprobs after grad_logprobs is written
  check_error(
      [&] {
        (void)lce::sft_loss(thrust::host, b.view(), cv(lp), 4.0, lce::sft_outputs<float>{mv(lp)});
      },
      "grad_logprobs overlaps the input logprobs");
  std::vector<float> w = b.weights;
  b.weights = w;
  auto view = b.view();
  view.weights = cv(w);
  check_error([&] { lce::sft_grad_logprobs(thrust::host, view, 4.0, mv(w), {}); },
              "grad_logprobs overlaps the input weights");
  CHECK(w == b.weights);
  // DPO: seq_logprobs over ref_seq_logprobs
  std::vector<double> ref(b.s(), -1.0), g(b.n(), 4.0), sg(b.s(), 4.0);
  std::vector<std::int64_t> n(b.s(), 4);
  check_error(
      [&] {
        (void)lce::dpo_loss(thrust::host, b.view(), lce::dpo_inputs<double>{cv(b.logp), cv(ref), {}}, 1.0,
                            lce::dpo_outputs<double>{mv(g), mv(ref), mv(sg), mv(n)});
      },
      "seq_logprobs overlaps the input ref_seq_logprobs");
  CHECK(ref == std::vector<double>(b.s(), -1.0));
  CHECK(g == std::vector<double>(b.n(), 4.0));
  // shift_targets_packed in place
  std::vector<std::int64_t> tok{1, 2, 3, 4, 5};
  const std::vector<std::int64_t> cu{0, 3, 5};
  check_error([&] { lce::shift_targets_packed(cv(tok), cv(cu), mv(tok)); }, "targets_out overlaps the input token_ids");
  CHECK(tok == std::vector<std::int64_t>{1, 2, 3, 4, 5});
}
