// The README's loss snippets (<lce/loss/losses.hpp>): packed batches, SFT, the
// clipped policy gradient (GRPO), DPO and top-K distillation on top of the operator. Each region
// between two `// [loss:NAME]` markers is the README's block of that name
// (checked by tests/readme_losses.cmake); this program builds and runs them on
// a small random model and checks the results against plain loops, so the
// README's snippets cannot rot.
#include <lce/lce.hpp>
#include <lce/loss/losses.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

namespace {

int failures = 0;
void check(bool ok, const char* what, double got, double want) {
  std::printf("%-44s %12.6f  (plain loops: %12.6f)  %s\n", what, got, want, ok ? "ok" : "MISMATCH");
  failures += !ok;
}
bool near(double a, double b) { return std::fabs(a - b) <= 1e-5 * (1.0 + std::fabs(b)); }

}  // namespace

int main() {
  const std::int64_t H = 32, V = 1000;
  std::mt19937 rng{7};
  std::normal_distribution<float> normal{0.0f, 1.0f};
  std::uniform_int_distribution<std::int64_t> token{0, V - 1};
  std::vector<std::int64_t> tokens(16);  // four sequences packed: lengths 5, 4, 3, 4
  for (auto& t : tokens) t = token(rng);
  std::vector<float> x(16 * H), w(V * H), w_ref(V * H), mask(16, 1.0f);
  for (float& v : x) v = normal(rng);
  for (float& v : w) v = normal(rng) / std::sqrt(float(H));
  for (std::int64_t j = 0; j < V * H; ++j) w_ref[j] = w[j] + 0.05f * normal(rng);  // a reference model
  mask[2] = 0.0f;                                                                  // e.g. a prompt token
  lce::comm::single comm;
  lce::ChunkedHiddenToLogprobs<lce::comm::single, float> op{comm};

  // [loss:packed]
  // Four sequences packed into N = 16 tokens. Targets are the next token inside
  // each sequence; the last token of each gets ignore_index (-100).
  const std::int64_t N = 16, S = 4;
  std::vector<std::int64_t> cu{0, 5, 9, 12, 16}, targets(N);
  lce::shift_targets_packed(thrust::host, lce::vector_view<const std::int64_t>{tokens.data(), N},
                            lce::vector_view<const std::int64_t>{cu.data(), S + 1},
                            lce::vector_view<std::int64_t>{targets.data(), N});
  // The batch every loss takes: targets, cu_seqlens, an optional per-token mask / weights.
  const lce::packed_tokens<> batch{{targets.data(), N}, {cu.data(), S + 1}, {mask.data(), N}};
  // The normaliser: counted tokens summed over the data/context-parallel group.
  const double norm = double(lce::global_token_count(comm, lce::count_loss_units(thrust::host, batch, N)));

  lce::matrix_view<const float> X{x.data(), N, H}, W{w.data(), V, H};
  lce::vector_view<const std::int64_t> Y{targets.data(), N};
  // [loss:packed]

  // [loss:sft]
  // SFT: dL/dlogp_i = -w_i / norm does not depend on logp, so it is computed
  // first and the whole step is one fused forward_backward sweep (3 GEMMs per chunk).
  std::vector<float> grad(N), logp(N), dX(N * H), dW(V * H, 0.0f);
  lce::sft_grad_logprobs(thrust::host, batch, norm, lce::vector_view<float>{grad.data(), N}, {});
  op.forward_backward(X, W, Y, lce::vector_view<const float>{grad.data(), N}, lce::vector_view<float>{logp.data(), N},
                      lce::matrix_view<float>{dX.data(), N, H}, lce::matrix_view<float>{dW.data(), V, H});
  const lce::sft_result sft =
      lce::sft_loss(thrust::host, batch, lce::vector_view<const float>{logp.data(), N}, norm, lce::sft_outputs<float>{});
  // sft.loss: the mean NLL (this rank's share); sft.tokens, sft.nll_sum for metrics
  // [loss:sft]
  {
    double nll = 0;
    for (std::int64_t i = 0; i < N; ++i)
      if (targets[i] != -100) nll -= mask[i] * logp[i];
    check(near(sft.loss, nll / norm) && sft.tokens == std::int64_t(norm), "SFT loss", sft.loss, nll / norm);
  }

  // The reference model's per-token log-probs (for the KL term and DPO).
  std::vector<float> ref_logp(N), ref_lse(N);
  op.forward(X, lce::matrix_view<const float>{w_ref.data(), V, H}, Y, lce::vector_view<float>{ref_logp.data(), N},
             lce::vector_view<float>{ref_lse.data(), N});
  std::vector<float> old_logp = ref_logp;  // the sampler's log-probs (here: an older policy)

  // [loss:pg]
  // GRPO: one advantage per sequence (its group-normalised reward), the clipped
  // ratio against the sampler's log-probs, a k3 KL penalty to the reference.
  const std::vector<float> advantages{1.0f, -1.0f, 0.5f, -0.5f};  // [S]
  lce::pg_options opt;
  opt.reduction = lce::loss_reduction::sequence_mean;  // each sequence's token mean, averaged over sequences
  opt.sequence_advantages = true;
  opt.eps_low = 0.2;
  opt.eps_high = 0.28;  // DAPO's clip-higher
  opt.kl_coef = 0.01;
  const double n_seq = double(lce::global_token_count(comm, lce::count_loss_units(thrust::host, batch, N, opt.reduction)));

  std::vector<float> lse(N), entropy(N), pg_grad(N);
  std::vector<std::int64_t> seq_tokens(S);
  op.forward(X, W, Y, lce::vector_view<float>{logp.data(), N}, lce::vector_view<float>{lse.data(), N},
             lce::vector_view<float>{entropy.data(), N});
  const lce::pg_result pg = lce::policy_gradient_loss(
      thrust::host, batch,
      lce::pg_inputs<float>{{logp.data(), N}, {advantages.data(), S}, {old_logp.data(), N}, {ref_logp.data(), N}, {},
                            {entropy.data(), N}},
      n_seq, lce::pg_outputs<float>{{pg_grad.data(), N}, {}, {}, {seq_tokens.data(), S}}, opt);
  std::fill(dW.begin(), dW.end(), 0.0f);
  op.backward(X, W, Y, lce::vector_view<const float>{lse.data(), N}, lce::vector_view<const float>{pg_grad.data(), N},
              lce::matrix_view<float>{dX.data(), N, H}, lce::matrix_view<float>{dW.data(), V, H});
  // pg.loss, pg.clip_frac_low / high, pg.ref_kl, pg.mean_entropy, pg.mean_ratio: metrics
  // [loss:pg]
  {
    double want = 0;  // plain loops: sequence means of the clipped loss plus the k3 KL
    for (std::int64_t s = 0; s < S; ++s) {
      double sum = 0, n = 0;
      for (std::int64_t i = cu[s]; i < cu[s + 1]; ++i) {
        if (targets[i] == -100 || mask[i] == 0.0f) continue;
        const double a = advantages[s], r = std::exp(double(logp[i]) - old_logp[i]);
        const double rc = std::min(std::max(r, 0.8), 1.28), d = double(ref_logp[i]) - logp[i];
        sum += std::max(-a * r, -a * rc) + 0.01 * (std::exp(d) - d - 1.0);
        n += 1;
      }
      if (n > 0) want += sum / n / n_seq;
    }
    check(near(pg.loss, want), "GRPO loss", pg.loss, want);
  }

  // [loss:dpo]
  // DPO: sequences (0, 1) and (2, 3) are (chosen, rejected) pairs (empty `pairs`:
  // consecutive). The reference model's per-sequence log-probs come first.
  std::vector<double> ref_seq(S), seq_logp(S), seq_grad(S);
  std::vector<float> dpo_grad(N);
  lce::sequence_logprobs(thrust::host, batch, lce::vector_view<const float>{ref_logp.data(), N},
                         lce::vector_view<double>{ref_seq.data(), S}, lce::vector_view<std::int64_t>{seq_tokens.data(), S});
  const double n_pairs = double(lce::global_token_count(comm, S / 2));
  lce::dpo_options dpo_opt;
  dpo_opt.beta = 0.1;
  const lce::dpo_result dpo = lce::dpo_loss(
      thrust::host, batch, lce::dpo_inputs<float>{{logp.data(), N}, {ref_seq.data(), S}, {}}, n_pairs,
      lce::dpo_outputs<float>{{dpo_grad.data(), N}, {seq_logp.data(), S}, {seq_grad.data(), S}, {seq_tokens.data(), S}},
      dpo_opt);
  std::fill(dW.begin(), dW.end(), 0.0f);
  op.backward(X, W, Y, lce::vector_view<const float>{lse.data(), N}, lce::vector_view<const float>{dpo_grad.data(), N},
              lce::matrix_view<float>{dX.data(), N, H}, lce::matrix_view<float>{dW.data(), V, H});
  // dpo.loss, dpo.reward_accuracy, dpo.mean_margin, dpo.chosen_reward, dpo.rejected_reward
  // [loss:dpo]
  {
    std::vector<double> pi(S, 0.0), rf(S, 0.0);
    for (std::int64_t s = 0; s < S; ++s)
      for (std::int64_t i = cu[s]; i < cu[s + 1]; ++i)
        if (targets[i] != -100) pi[s] += mask[i] * logp[i], rf[s] += mask[i] * ref_logp[i];
    double want = 0;
    for (std::int64_t p = 0; p < S / 2; ++p) {
      const double m = 0.1 * ((pi[2 * p] - rf[2 * p]) - (pi[2 * p + 1] - rf[2 * p + 1]));
      want += std::log1p(std::exp(-m)) / n_pairs;
    }
    check(near(dpo.loss, want), "DPO loss", dpo.loss, want);
  }
  // A teacher's top-K as its inference server would store them (here the
  // reference model's logits by plain loops): ids and log-probs, [N, K].
  const std::int64_t K = 8;
  std::vector<std::int64_t> teacher_ids(N * K);
  std::vector<float> teacher_logp(N * K);
  std::vector<double> student_full(N * V);  // for the plain-loop check only
  for (std::int64_t i = 0; i < N; ++i) {
    std::vector<double> t(V);
    for (std::int64_t j = 0; j < V; ++j) {
      double zt = 0, zs = 0;
      for (std::int64_t c = 0; c < H; ++c) zt += double(x[i * H + c]) * w_ref[j * H + c], zs += double(x[i * H + c]) * w[j * H + c];
      t[j] = zt;
      student_full[i * V + j] = zs;
    }
    const auto log_softmax = [](double* z, std::int64_t n) {
      const double m = *std::max_element(z, z + n);
      double sum = 0;
      for (std::int64_t j = 0; j < n; ++j) sum += std::exp(z[j] - m);
      for (std::int64_t j = 0; j < n; ++j) z[j] -= m + std::log(sum);
    };
    log_softmax(t.data(), V);
    log_softmax(&student_full[i * V], V);
    std::vector<std::int64_t> order(V);
    for (std::int64_t j = 0; j < V; ++j) order[j] = j;
    std::partial_sort(order.begin(), order.begin() + K, order.end(), [&](auto a, auto b) { return t[a] > t[b]; });
    for (std::int64_t e = 0; e < K; ++e) teacher_ids[i * K + e] = order[e], teacher_logp[i * K + e] = float(t[order[e]]);
  }

  // [loss:distill]
  // Distillation from the teacher's top-K: the student's log-probs of the same
  // K ids come from the operator's target-set form (targets [N, K]), the loss is
  // KL(teacher || student) with the teacher's remaining mass as one more outcome.
  std::vector<float> student_logp(N * K), kd_grad(N * K);
  const lce::matrix_view<const std::int64_t> ids{teacher_ids.data(), N, K};
  op.forward(X, W, ids, lce::target_set_outputs<float>{{student_logp.data(), N, K}, {lse.data(), N}, {}, {}});
  const lce::distill_result kd = lce::distill_loss(
      thrust::host, batch,
      lce::distill_inputs<std::int64_t>{ids, {teacher_logp.data(), N, K}, {student_logp.data(), N, K}}, norm,
      lce::distill_outputs<float>{{kd_grad.data(), N, K}});
  std::fill(dW.begin(), dW.end(), 0.0f);
  op.backward(X, W, ids, lce::vector_view<const float>{lse.data(), N},
              lce::target_set_gradients<float>{{kd_grad.data(), N, K}, {}, {}, {}},
              lce::matrix_view<float>{dX.data(), N, H}, lce::matrix_view<float>{dW.data(), V, H});
  // kd.loss; kd.teacher_mass / kd.tokens: how much of the teacher the top-K cover
  // [loss:distill]
  {
    double want = 0;  // plain loops over the student's full log-softmax
    for (std::int64_t i = 0; i < N; ++i) {
      if (targets[i] == -100 || mask[i] == 0.0f) continue;
      double kl = 0, p_mass = 0, q_mass = 0;
      for (std::int64_t e = 0; e < K; ++e) {
        const double lp = teacher_logp[i * K + e], lq = student_full[i * V + teacher_ids[i * K + e]];
        kl += std::exp(lp) * (lp - lq);
        p_mass += std::exp(lp);
        q_mass += std::exp(lq);
      }
      kl += (1 - p_mass) * (std::log(1 - p_mass) - std::log(1 - q_mass));
      want += mask[i] * kl / norm;
    }
    check(near(kd.loss, want), "distillation loss (top-8 teacher)", kd.loss, want);
  }
  double dw_norm = 0;
  for (float g : dW) dw_norm += double(g) * g;
  check(std::isfinite(dw_norm) && dw_norm > 0, "|dW|^2 of the distillation step (finite, > 0)", dw_norm, dw_norm);
  std::printf(failures ? "FAILED\n" : "all losses match their plain-loop references\n");
  return failures ? 1 : 0;
}
