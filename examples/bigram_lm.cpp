// lce example: a bigram language model trained through lce's losses.
//
// The source is a Zipf-Markov chain over V tokens: every token a has one of K
// classes c(a), and the next token is drawn from a Zipf(s) law over the
// vocabulary whose ranks are permuted per class:
//     P(b | a) = p_{rank_c(a)(b)},   p_r = r^-s / sum_{q=1..V} q^-s.
// Every row of the transition matrix is a permutation of the same Zipf law, so
// the source's true conditional entropy is exactly the Zipf entropy
//     H(next | prev) = -sum_r p_r log p_r,
// whatever the stationary distribution of the chain. The model
//     hidden_i = E[token_i] (an embedding row, [H]),  logits = W hidden_i ([V, H] LM head)
// can represent the source exactly when H >= K (E[a] = the class's one-hot,
// W[b, c] = log P(b | c)), so its loss can reach H(next | prev).
//
// Phase 1 (SFT): every step draws a fresh packed batch from the chain (sequences
// of --seq-len tokens, next-token targets from lce::shift_targets_packed), takes
// dL/dlogp from lce::sft_grad_logprobs, runs op.forward_backward (3 GEMMs per
// chunk, the [N, V] logits never exist), and steps SGD. A second model, started
// from the same weights, trains on the same batches through a materialised
// reference written here in plain double loops (the full [N, V] logits, softmax
// and gradients); the two losses must agree step by step within --match-tol.
//
// Phase 2 (GRPO): from the SFT model, groups of completions are sampled for
// random prompts; the reward is the fraction of generated tokens in the lower
// half of the vocabulary (id < V / 2); advantages are group-normalised per
// sequence; lce::policy_gradient_loss (sequence-mean, clipped ratio against the
// sampler's log-probs) gives dL/dlogp for op.backward. The mean reward must rise.
//
// Prints a table of both phases and writes an SVG of the curves (--svg).
//
//   lce_bigram_lm [--vocab V] [--hidden H] [--classes K] [--zipf s] [--tokens N] [--seq-len L]
//                 [--steps S] [--lr-head a] [--lr-embed b] [--grpo-steps G] [--prompts P]
//                 [--group g] [--gen-len l] [--grpo-lr a] [--seed x] [--svg file]
//                 [--max-gap nats] [--match-tol t] [--min-reward-rise r] [--print-every k]
//                 [--reference-steps R]   (the reference trains alongside for the first R steps; default all)
// Exits 1 when the loss does not approach the entropy (mean of the last tenth of
// the steps more than --max-gap above it), when lce and the reference disagree
// (|loss difference| > match_tol (1 + loss) at any step, or the final weights
// differ by more than 100 match_tol), or when the reward does not rise by
// --min-reward-rise (mean of the last two GRPO steps against the first two).
#include <lce/lce.hpp>
#include <lce/loss/losses.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>
#include <vector>

namespace {

using i64 = std::int64_t;

struct settings {
  i64 vocab = 32768, hidden = 64, classes = 16;
  double zipf = 1.2;
  i64 tokens = 4096, seq_len = 64, steps = 120;
  double lr_head = 2.0, lr_embed = 0.5;
  double lr_final = 1.0;  // the SFT learning rates fall linearly to this fraction of themselves by the last step
  i64 grpo_steps = 10, prompts = 32, group = 8, gen_len = 8;
  double grpo_lr = 2.0;
  unsigned seed = 1;
  std::string svg = "bigram_lm.svg";
  double max_gap = 0.1, match_tol = 1e-4, min_reward_rise = 0.05;
  i64 print_every = 10;
  i64 reference_steps = -1;  // -1: every step
};

// --- the source ----------------------------------------------------------------
struct zipf_markov {
  i64 V, K;
  std::vector<double> p, cdf;    // Zipf law by rank 0..V-1 (rank r has weight (r+1)^-s)
  std::vector<std::int32_t> cls;  // [V] class of each token
  std::vector<std::int32_t> token_at, rank_of;  // [K * V] rank -> token, token -> rank, per class
  double entropy = 0;             // H(next | prev) = the Zipf entropy, in nats

  zipf_markov(i64 v, i64 k, double s, std::mt19937_64& rng) : V(v), K(k), p(v), cdf(v), cls(v), token_at(k * v), rank_of(k * v) {
    double z = 0;
    for (i64 r = 0; r < V; ++r) z += p[r] = std::pow(double(r + 1), -s);
    double acc = 0;
    for (i64 r = 0; r < V; ++r) {
      p[r] /= z;
      acc += p[r];
      cdf[r] = acc;
      entropy -= p[r] * std::log(p[r]);
    }
    cdf[V - 1] = 1.0;
    std::uniform_int_distribution<std::int32_t> pick(0, std::int32_t(K - 1));
    for (auto& c : cls) c = pick(rng);
    for (i64 c = 0; c < K; ++c) {
      std::int32_t* perm = token_at.data() + c * V;
      for (i64 r = 0; r < V; ++r) perm[r] = std::int32_t(r);
      std::shuffle(perm, perm + V, rng);
      for (i64 r = 0; r < V; ++r) rank_of[c * V + perm[r]] = std::int32_t(r);
    }
  }
  i64 next(i64 prev, std::mt19937_64& rng) const {
    const double u = std::uniform_real_distribution<double>(0.0, 1.0)(rng);
    const i64 r = std::lower_bound(cdf.begin(), cdf.end(), u) - cdf.begin();
    return token_at[cls[prev] * V + std::min(r, V - 1)];
  }
  double logp(i64 prev, i64 next) const { return std::log(p[rank_of[cls[prev] * V + next]]); }
};

// --- the model and its SGD step ---------------------------------------------------
struct model {
  i64 V, H;
  std::vector<float> E, W;  // embedding [V, H], LM head [V, H]
};

// W -= lr_head dW (dW of the mean loss). Each embedding row steps on the mean
// gradient of its own occurrences in the batch (sparse-embedding SGD: a row seen
// once moves as far as a row seen a thousand times): E[a] -= lr_embed * mean over
// {i : token_i = a, counted} of dL_i/dhidden_i, with dL_i/dhidden_i = dX_i * norm.
void sgd_step(model& m, const std::vector<std::int64_t>& tokens, const std::vector<std::int64_t>& targets,
              const std::vector<float>& dX, const std::vector<float>& dW, double norm, double lr_head,
              double lr_embed, std::vector<double>& row_grad, std::vector<std::int32_t>& row_count) {
  const i64 H = m.H, N = i64(tokens.size());
  for (i64 j = 0; j < m.V * H; ++j) m.W[j] -= float(lr_head * dW[j]);
  for (i64 i = 0; i < N; ++i) {
    if (targets[i] == -100) continue;
    const i64 a = tokens[i];
    if (row_count[a]++ == 0) std::fill_n(row_grad.begin() + a * H, H, 0.0);
    for (i64 h = 0; h < H; ++h) row_grad[a * H + h] += double(dX[i * H + h]) * norm;
  }
  for (i64 i = 0; i < N; ++i) {
    if (targets[i] == -100) continue;
    const i64 a = tokens[i];
    if (row_count[a] == 0) continue;  // done
    const double step = lr_embed / row_count[a];
    for (i64 h = 0; h < H; ++h) m.E[a * H + h] -= float(step * row_grad[a * H + h]);
    row_count[a] = 0;
  }
}

// --- the materialised reference (plain double loops, no lce) ----------------------
// Loss and gradients of the mean NLL over the counted tokens, holding the full
// [N, V] logits (then probabilities) in double.
struct reference {
  std::vector<double> logits, wt;  // [N, V]; W transposed [H, V]
  double step(const model& m, const std::vector<std::int64_t>& tokens, const std::vector<std::int64_t>& targets,
              std::vector<float>& dX, std::vector<float>& dW) {
    const i64 V = m.V, H = m.H, N = i64(tokens.size());
    logits.assign(std::size_t(N * V), 0.0);
    wt.resize(std::size_t(H * V));
    for (i64 v = 0; v < V; ++v)
      for (i64 h = 0; h < H; ++h) wt[h * V + v] = m.W[v * H + h];
    i64 count = 0;
    for (i64 i = 0; i < N; ++i) count += targets[i] != -100;
    const double inv = count ? 1.0 / double(count) : 0.0;
    std::vector<double> dw_t(std::size_t(H * V), 0.0);
    double loss = 0;
    for (i64 i = 0; i < N; ++i) {
      double* z = logits.data() + i * V;
      const float* x = m.E.data() + tokens[i] * H;
      for (i64 h = 0; h < H; ++h) {  // z = W x, as H axpys over the vocabulary
        const double xh = x[h];
        const double* w = wt.data() + h * V;
        for (i64 v = 0; v < V; ++v) z[v] += xh * w[v];
      }
      float* dx = dX.data() + i * H;
      std::fill_n(dx, H, 0.0f);
      if (targets[i] == -100) continue;
      double mx = z[0];
      for (i64 v = 1; v < V; ++v) mx = std::max(mx, z[v]);
      double sum = 0;
      for (i64 v = 0; v < V; ++v) sum += std::exp(z[v] - mx);
      const double lse = mx + std::log(sum);
      const i64 y = targets[i];
      loss -= (z[y] - lse) * inv;
      for (i64 v = 0; v < V; ++v) z[v] = std::exp(z[v] - lse) * inv;  // dL/dz = (softmax - onehot) / count
      z[y] -= inv;
      for (i64 h = 0; h < H; ++h) {
        const double* w = wt.data() + h * V;
        double acc[8] = {};
        i64 v = 0;
        for (; v + 8 <= V; v += 8)
          for (int k = 0; k < 8; ++k) acc[k] += z[v + k] * w[v + k];
        for (; v < V; ++v) acc[0] += z[v] * w[v];
        double s = 0;
        for (double a : acc) s += a;
        dx[h] = float(s);
        double* g = dw_t.data() + h * V;
        const double xh = x[h];
        for (i64 u = 0; u < V; ++u) g[u] += xh * z[u];
      }
    }
    for (i64 v = 0; v < V; ++v)
      for (i64 h = 0; h < H; ++h) dW[v * H + h] = float(dw_t[h * V + v]);
    return loss;
  }
};

// A fresh packed batch from the chain: B sequences of L tokens, the chain running on.
struct packed_batch {
  std::vector<std::int64_t> tokens, cu, targets;
  double oracle = 0;  // the batch's mean NLL under the true source
};

packed_batch draw_batch(const zipf_markov& src, i64 n_seq, i64 len, i64& state, std::mt19937_64& rng) {
  packed_batch b;
  b.cu.push_back(0);
  for (i64 s = 0; s < n_seq; ++s) {
    for (i64 t = 0; t < len; ++t) {
      state = src.next(state, rng);
      b.tokens.push_back(state);
    }
    b.cu.push_back(b.cu.back() + len);
  }
  b.targets.resize(b.tokens.size());
  lce::shift_targets_packed(thrust::host, lce::vector_view<const std::int64_t>{b.tokens.data(), i64(b.tokens.size())},
                            lce::vector_view<const std::int64_t>{b.cu.data(), i64(b.cu.size())},
                            lce::vector_view<std::int64_t>{b.targets.data(), i64(b.targets.size())});
  i64 count = 0;
  for (std::size_t i = 0; i < b.tokens.size(); ++i)
    if (b.targets[i] != -100) b.oracle -= src.logp(b.tokens[i], b.targets[i]), ++count;
  b.oracle /= double(count);
  return b;
}

template <class T>
lce::vector_view<const T> cview(const std::vector<T>& v) {
  return {v.data(), i64(v.size())};
}
template <class T>
lce::vector_view<T> view(std::vector<T>& v) {
  return {v.data(), i64(v.size())};
}

// Gathers hidden = E[tokens].
void gather(const model& m, const std::vector<std::int64_t>& tokens, std::vector<float>& X) {
  X.resize(tokens.size() * std::size_t(m.H));
  for (std::size_t i = 0; i < tokens.size(); ++i)
    std::copy_n(m.E.begin() + tokens[i] * m.H, m.H, X.begin() + i * m.H);
}

// --- the SVG, by hand --------------------------------------------------------------
struct series {
  std::string name, color, dash;
  std::vector<double> x, y;
};

std::string fmt(double v, int prec = 3) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", prec, v);
  return buf;
}

void panel(std::string& out, double x0, double y0, double w, double h, const std::string& title,
           const std::string& xlabel, const std::string& ylabel, const std::vector<series>& lines) {
  double xmin = 1e300, xmax = -1e300, ymin = 1e300, ymax = -1e300;
  for (const auto& s : lines)
    for (std::size_t k = 0; k < s.x.size(); ++k) {
      xmin = std::min(xmin, s.x[k]), xmax = std::max(xmax, s.x[k]);
      ymin = std::min(ymin, s.y[k]), ymax = std::max(ymax, s.y[k]);
    }
  if (xmax <= xmin) xmax = xmin + 1;
  const double pad = 0.05 * std::max(ymax - ymin, 1e-9);
  ymin -= pad, ymax += pad;
  const double L = x0 + 60, R = x0 + w - 10, T = y0 + 30, B = y0 + h - 45;
  auto px = [&](double x) { return L + (x - xmin) / (xmax - xmin) * (R - L); };
  auto py = [&](double y) { return B - (y - ymin) / (ymax - ymin) * (B - T); };
  out += "<text x='" + fmt((L + R) / 2, 1) + "' y='" + fmt(y0 + 18, 1) +
         "' text-anchor='middle' font-size='15' font-weight='bold'>" + title + "</text>\n";
  out += "<rect x='" + fmt(L, 1) + "' y='" + fmt(T, 1) + "' width='" + fmt(R - L, 1) + "' height='" + fmt(B - T, 1) +
         "' fill='none' stroke='#444'/>\n";
  for (int k = 0; k <= 5; ++k) {
    const double yv = ymin + (ymax - ymin) * k / 5, xv = xmin + (xmax - xmin) * k / 5;
    out += "<line x1='" + fmt(L, 1) + "' x2='" + fmt(R, 1) + "' y1='" + fmt(py(yv), 1) + "' y2='" + fmt(py(yv), 1) +
           "' stroke='#ddd'/>\n";
    out += "<text x='" + fmt(L - 5, 1) + "' y='" + fmt(py(yv) + 4, 1) + "' text-anchor='end' font-size='11'>" +
           fmt(yv, 2) + "</text>\n";
    out += "<text x='" + fmt(px(xv), 1) + "' y='" + fmt(B + 15, 1) + "' text-anchor='middle' font-size='11'>" +
           fmt(xv, 0) + "</text>\n";
  }
  out += "<text x='" + fmt((L + R) / 2, 1) + "' y='" + fmt(B + 32, 1) + "' text-anchor='middle' font-size='12'>" +
         xlabel + "</text>\n";
  out += "<text transform='translate(" + fmt(x0 + 14, 1) + "," + fmt((T + B) / 2, 1) +
         ") rotate(-90)' text-anchor='middle' font-size='12'>" + ylabel + "</text>\n";
  double ly = T + 14;
  for (const auto& s : lines) {
    out += "<polyline fill='none' stroke='" + s.color + "' stroke-width='1.8'" +
           (s.dash.empty() ? "" : " stroke-dasharray='" + s.dash + "'") + " points='";
    for (std::size_t k = 0; k < s.x.size(); ++k) out += fmt(px(s.x[k]), 1) + "," + fmt(py(s.y[k]), 1) + " ";
    out += "'/>\n";
    out += "<line x1='" + fmt(R - 190, 1) + "' x2='" + fmt(R - 165, 1) + "' y1='" + fmt(ly - 4, 1) + "' y2='" +
           fmt(ly - 4, 1) + "' stroke='" + s.color + "' stroke-width='2'" +
           (s.dash.empty() ? "" : " stroke-dasharray='" + s.dash + "'") + "/>\n";
    out += "<text x='" + fmt(R - 160, 1) + "' y='" + fmt(ly, 1) + "' font-size='11'>" + s.name + "</text>\n";
    ly += 16;
  }
}

int usage(const char* argv0) {
  std::fprintf(stderr,
               "usage: %s [--vocab V] [--hidden H] [--classes K] [--zipf s] [--tokens N] [--seq-len L] [--steps S]\n"
               "          [--lr-head a] [--lr-embed b] [--lr-final f] [--grpo-steps G] [--prompts P] [--group g] [--gen-len l]\n"
               "          [--grpo-lr a] [--seed x] [--svg file] [--max-gap nats] [--match-tol t]\n"
               "          [--min-reward-rise r] [--print-every k] [--reference-steps R]\n",
               argv0);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  settings cfg;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") return usage(argv[0]), 0;
    if (i + 1 >= argc) return usage(argv[0]);
    const char* v = argv[++i];
    if (a == "--vocab") cfg.vocab = std::atoll(v);
    else if (a == "--hidden") cfg.hidden = std::atoll(v);
    else if (a == "--classes") cfg.classes = std::atoll(v);
    else if (a == "--zipf") cfg.zipf = std::atof(v);
    else if (a == "--tokens") cfg.tokens = std::atoll(v);
    else if (a == "--seq-len") cfg.seq_len = std::atoll(v);
    else if (a == "--steps") cfg.steps = std::atoll(v);
    else if (a == "--lr-head") cfg.lr_head = std::atof(v);
    else if (a == "--lr-embed") cfg.lr_embed = std::atof(v);
    else if (a == "--lr-final") cfg.lr_final = std::atof(v);
    else if (a == "--grpo-steps") cfg.grpo_steps = std::atoll(v);
    else if (a == "--prompts") cfg.prompts = std::atoll(v);
    else if (a == "--group") cfg.group = std::atoll(v);
    else if (a == "--gen-len") cfg.gen_len = std::atoll(v);
    else if (a == "--grpo-lr") cfg.grpo_lr = std::atof(v);
    else if (a == "--seed") cfg.seed = unsigned(std::atoll(v));
    else if (a == "--svg") cfg.svg = v;
    else if (a == "--max-gap") cfg.max_gap = std::atof(v);
    else if (a == "--match-tol") cfg.match_tol = std::atof(v);
    else if (a == "--min-reward-rise") cfg.min_reward_rise = std::atof(v);
    else if (a == "--print-every") cfg.print_every = std::atoll(v);
    else if (a == "--reference-steps") cfg.reference_steps = std::atoll(v);
    else return usage(argv[0]);
  }
  if (cfg.vocab < 2 || cfg.hidden < 1 || cfg.classes < 1 || cfg.classes > cfg.vocab || cfg.zipf <= 0 ||
      cfg.seq_len < 2 || cfg.tokens < cfg.seq_len || cfg.steps < 10 || cfg.grpo_steps < 4 || cfg.prompts < 1 ||
      cfg.group < 2 || cfg.gen_len < 1 || cfg.print_every < 1)
    return usage(argv[0]);

  const i64 V = cfg.vocab, H = cfg.hidden, L = cfg.seq_len, n_seq = cfg.tokens / cfg.seq_len, N = n_seq * L;
  std::mt19937_64 rng(cfg.seed);
  const zipf_markov src(V, cfg.classes, cfg.zipf, rng);

  model lce_model{V, H, std::vector<float>(std::size_t(V * H)), std::vector<float>(std::size_t(V * H))};
  {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (auto& e : lce_model.E) e = normal(rng);
    for (auto& w : lce_model.W) w = 0.01f * normal(rng);
  }
  model ref_model = lce_model;

  std::printf("bigram LM through lce: V = %lld, H = %lld, K = %lld classes, Zipf s = %.2f, %lld tokens per step "
              "(%lld sequences of %lld), %lld SGD steps (lr head %.3g, embedding rows %.3g)\n",
              (long long)V, (long long)H, (long long)cfg.classes, cfg.zipf, (long long)N, (long long)n_seq,
              (long long)L, (long long)cfg.steps, cfg.lr_head, cfg.lr_embed);
  if (cfg.lr_final != 1.0) std::printf("learning rates fall linearly to %.3g of themselves by the last SFT step\n", cfg.lr_final);
  std::printf("true conditional entropy H(next | prev) = %.4f nats (the Zipf(%.2f) entropy over %lld ranks; "
              "log V = %.4f)\n",
              src.entropy, cfg.zipf, (long long)V, std::log(double(V)));
  std::printf("reference: plain double loops holding the full [%lld, %lld] logits (%.1f MiB); lce holds at most "
              "one chunk\n\n",
              (long long)N, (long long)V, double(N) * double(V) * 8.0 / 1048576.0);

  lce::ChunkedHiddenToLogprobs<lce::comm::single, float> op{lce::comm::single{}};
  reference ref;
  i64 state = 0;
  std::vector<float> X, X_ref, dX(static_cast<std::size_t>(N * H)), dW(static_cast<std::size_t>(V * H)), dX_ref(static_cast<std::size_t>(N * H)),
      dW_ref(static_cast<std::size_t>(V * H)), grad(static_cast<std::size_t>(N)), logp(static_cast<std::size_t>(N));
  std::vector<double> row_grad(static_cast<std::size_t>(V * H));
  std::vector<std::int32_t> row_count(static_cast<std::size_t>(V), 0);
  std::vector<double> steps_x, loss_lce, loss_ref, oracle;
  double worst_match = 0, t_lce = 0, t_ref = 0, max_w = 0;
  std::vector<double> ref_x;
  const i64 ref_steps = cfg.reference_steps < 0 ? cfg.steps : std::min(cfg.reference_steps, cfg.steps);

  std::printf("%6s %12s %12s %10s %12s %12s\n", "step", "lce loss", "reference", "|diff|", "oracle NLL",
              "lce - H");
  for (i64 step = 0; step < cfg.steps; ++step) {
    const packed_batch b = draw_batch(src, n_seq, L, state, rng);
    const lce::packed_tokens<> batch{cview(b.targets), cview(b.cu), {}};
    const double norm = double(lce::count_loss_units(thrust::host, batch, N));

    // lce: dL/dlogp before the forward, then one fused sweep.
    auto t0 = std::chrono::steady_clock::now();
    gather(lce_model, b.tokens, X);
    lce::sft_grad_logprobs(thrust::host, batch, norm, view(grad), {});
    std::fill(dW.begin(), dW.end(), 0.0f);
    op.forward_backward(lce::matrix_view<const float>{X.data(), N, H},
                        lce::matrix_view<const float>{lce_model.W.data(), V, H}, cview(b.targets), cview(grad),
                        view(logp), lce::matrix_view<float>{dX.data(), N, H}, lce::matrix_view<float>{dW.data(), V, H});
    const double l_lce = lce::sft_loss(thrust::host, batch, cview(logp), norm, lce::sft_outputs<float>{}).loss;
    // Constant-rate SGD stalls above the entropy on a long Zipf tail: --lr-final < 1 anneals it.
    const double anneal = cfg.steps > 1 ? 1.0 - (1.0 - cfg.lr_final) * double(step) / double(cfg.steps - 1) : 1.0;
    sgd_step(lce_model, b.tokens, b.targets, dX, dW, norm, cfg.lr_head * anneal, cfg.lr_embed * anneal, row_grad,
             row_count);
    auto t1 = std::chrono::steady_clock::now();

    // the materialised reference, on its own copy of the model
    const bool with_ref = step < ref_steps;
    double l_ref = std::nan("");
    if (with_ref) {
      l_ref = ref.step(ref_model, b.tokens, b.targets, dX_ref, dW_ref);
      sgd_step(ref_model, b.tokens, b.targets, dX_ref, dW_ref, norm, cfg.lr_head * anneal, cfg.lr_embed * anneal,
               row_grad, row_count);
      if (step == ref_steps - 1) {
        for (std::size_t j = 0; j < lce_model.W.size(); ++j)
          max_w = std::max({max_w, double(std::fabs(lce_model.W[j] - ref_model.W[j])),
                            double(std::fabs(lce_model.E[j] - ref_model.E[j]))});
        std::vector<double>().swap(ref.logits);
      }
    }
    auto t2 = std::chrono::steady_clock::now();
    t_lce += std::chrono::duration<double>(t1 - t0).count();
    t_ref += std::chrono::duration<double>(t2 - t1).count();

    const double diff = with_ref ? std::fabs(l_lce - l_ref) : 0.0;
    if (with_ref) {
      worst_match = std::max(worst_match, diff / (1.0 + std::fabs(l_ref)));
      ref_x.push_back(double(step));
      loss_ref.push_back(l_ref);
    }
    steps_x.push_back(double(step));
    loss_lce.push_back(l_lce);
    oracle.push_back(b.oracle);
    if (step % cfg.print_every == 0 || step == cfg.steps - 1)
      with_ref ? std::printf("%6lld %12.5f %12.5f %10.2e %12.5f %12.5f\n", (long long)step, l_lce, l_ref, diff,
                             b.oracle, l_lce - src.entropy)
               : std::printf("%6lld %12.5f %12s %10s %12.5f %12.5f\n", (long long)step, l_lce, "-", "-", b.oracle,
                             l_lce - src.entropy);
  }
  const i64 tail = std::max<i64>(1, cfg.steps / 10);
  double tail_loss = 0, tail_oracle = 0;
  for (i64 k = cfg.steps - tail; k < cfg.steps; ++k) tail_loss += loss_lce[k] / tail, tail_oracle += oracle[k] / tail;
  const double gap = tail_loss - src.entropy;
  std::printf("\nSFT: mean loss of the last %lld steps %.4f nats, true entropy %.4f, gap %.4f nats (%.2f%% of H; "
              "oracle NLL of the same batches %.4f)\n",
              (long long)tail, tail_loss, src.entropy, gap, 100.0 * gap / src.entropy, tail_oracle);
  std::printf("lce vs reference: worst |loss diff| / (1 + loss) %.2e over %lld steps; weights max |diff| after "
              "them %.2e; time lce %.2f s (%lld steps), reference %.2f s (%lld steps)\n",
              worst_match, (long long)ref_steps, max_w, t_lce, (long long)cfg.steps, t_ref, (long long)ref_steps);

  // --- GRPO -------------------------------------------------------------------------
  const i64 G = cfg.group, P = cfg.prompts, T = cfg.gen_len + 1, S = P * G, NG = S * T;
  std::printf("\nGRPO: %lld prompts x %lld completions of %lld tokens; reward = fraction of generated tokens with "
              "id < V/2; sequence-mean clipped policy gradient, 2 updates per batch (lr %.3g)\n",
              (long long)P, (long long)G, (long long)cfg.gen_len, cfg.grpo_lr);
  std::printf("%6s %12s %12s %12s %12s %14s\n", "step", "mean reward", "pg loss", "mean ratio", "clip frac",
              "max |dlogp|");
  std::vector<double> grpo_x, grpo_reward;
  std::vector<std::int64_t> gtok(static_cast<std::size_t>(NG)), gtgt(static_cast<std::size_t>(NG)), gcu(static_cast<std::size_t>(S + 1));
  std::vector<float> old_lp(static_cast<std::size_t>(NG)), adv(static_cast<std::size_t>(S)), glp(static_cast<std::size_t>(NG)), glse(static_cast<std::size_t>(NG)),
      gent(static_cast<std::size_t>(NG)), ggrad(static_cast<std::size_t>(NG)), gdX(static_cast<std::size_t>(NG * H));
  std::vector<double> z(static_cast<std::size_t>(V)), reward(static_cast<std::size_t>(S)), wt(static_cast<std::size_t>(H * V));
  std::vector<std::int64_t> seq_tokens(static_cast<std::size_t>(S));
  for (i64 s = 0; s <= S; ++s) gcu[s] = s * T;
  for (i64 step = 0; step < cfg.grpo_steps; ++step) {
    // sample with the current model (full softmax of one row at a time: generation, not training)
    for (i64 v = 0; v < V; ++v)
      for (i64 h = 0; h < H; ++h) wt[h * V + v] = lce_model.W[v * H + h];
    for (i64 p = 0; p < P; ++p) {
      state = src.next(state, rng);
      for (i64 g = 0; g < G; ++g) {
        const i64 s = p * G + g;
        i64 prev = state, hits = 0;
        gtok[s * T] = prev;
        for (i64 t = 1; t < T; ++t) {
          std::fill(z.begin(), z.end(), 0.0);
          const float* x = lce_model.E.data() + prev * H;
          for (i64 h = 0; h < H; ++h)
            for (i64 v = 0; v < V; ++v) z[v] += double(x[h]) * wt[h * V + v];
          const double mx = *std::max_element(z.begin(), z.end());
          double sum = 0;
          for (double zv : z) sum += std::exp(zv - mx);
          const double lse = mx + std::log(sum);
          double u = std::uniform_real_distribution<double>(0.0, 1.0)(rng), acc = 0;
          i64 next = V - 1;
          for (i64 v = 0; v < V; ++v)
            if ((acc += std::exp(z[v] - lse)) > u) {
              next = v;
              break;
            }
          old_lp[s * T + t - 1] = float(z[next] - lse);
          gtok[s * T + t] = next;
          hits += next < V / 2;
          prev = next;
        }
        old_lp[s * T + T - 1] = 0.0f;
        reward[s] = double(hits) / double(T - 1);
      }
      double mean = 0, var = 0;
      for (i64 g = 0; g < G; ++g) mean += reward[p * G + g] / double(G);
      for (i64 g = 0; g < G; ++g) var += (reward[p * G + g] - mean) * (reward[p * G + g] - mean) / double(G - 1);
      for (i64 g = 0; g < G; ++g) adv[p * G + g] = float((reward[p * G + g] - mean) / (std::sqrt(var) + 1e-6));
    }
    double mean_reward = 0;
    for (double r : reward) mean_reward += r / double(S);
    lce::shift_targets_packed(thrust::host, cview(gtok), cview(gcu), view(gtgt));
    const lce::packed_tokens<> batch{cview(gtgt), cview(gcu), {}};
    lce::pg_options opt;
    opt.reduction = lce::loss_reduction::sequence_mean;
    opt.sequence_advantages = true;
    opt.eps_low = opt.eps_high = 0.2;
    const double norm = double(lce::count_loss_units(thrust::host, batch, NG, opt.reduction));
    lce::pg_result first{};
    double max_dlogp = 0;
    for (int epoch = 0; epoch < 2; ++epoch) {
      gather(lce_model, gtok, X);
      const lce::matrix_view<const float> Xv{X.data(), NG, H}, Wv{lce_model.W.data(), V, H};
      op.forward(Xv, Wv, cview(gtgt), view(glp), view(glse), view(gent));
      const lce::pg_result r = lce::policy_gradient_loss(
          thrust::host, batch, lce::pg_inputs<float>{cview(glp), cview(adv), cview(old_lp), {}, {}, cview(gent)}, norm,
          lce::pg_outputs<float>{view(ggrad), {}, {}, view(seq_tokens)}, opt);
      if (epoch == 0) {
        first = r;
        for (i64 i = 0; i < NG; ++i)
          if (gtgt[i] != -100) max_dlogp = std::max(max_dlogp, double(std::fabs(glp[i] - old_lp[i])));
      }
      std::fill(dW.begin(), dW.end(), 0.0f);
      op.backward(Xv, Wv, cview(gtgt), cview(glse), cview(ggrad), lce::matrix_view<float>{gdX.data(), NG, H},
                  lce::matrix_view<float>{dW.data(), V, H});
      // GRPO's loss is normalised over sequences: embedding rows step on their mean gradient as in SFT
      sgd_step(lce_model, gtok, gtgt, gdX, dW, norm, cfg.grpo_lr, cfg.lr_embed, row_grad, row_count);
    }
    grpo_x.push_back(double(step));
    grpo_reward.push_back(mean_reward);
    std::printf("%6lld %12.4f %12.5f %12.6f %12.4f %14.2e\n", (long long)step, mean_reward, first.loss,
                first.mean_ratio, first.clip_frac_low + first.clip_frac_high, max_dlogp);
  }
  const i64 gs = cfg.grpo_steps;
  const double reward_first = (grpo_reward[0] + grpo_reward[1]) / 2,
               reward_last = (grpo_reward[gs - 1] + grpo_reward[gs - 2]) / 2;
  std::printf("\nGRPO: mean reward %.4f (first two steps) -> %.4f (last two)\n", reward_first, reward_last);

  // --- SVG ---------------------------------------------------------------------------
  if (!cfg.svg.empty()) {
    std::string svg = "<svg xmlns='http://www.w3.org/2000/svg' width='1000' height='420' font-family='sans-serif'>\n"
                      "<rect width='100%' height='100%' fill='white'/>\n";
    series a{"lce (forward_backward)", "#1f77b4", "", steps_x, loss_lce};
    series r{"materialised reference", "#ff7f0e", "6,4", ref_x, loss_ref};
    series o{"oracle NLL of the batch", "#999999", "2,3", steps_x, oracle};
    series h{"true entropy " + fmt(src.entropy, 3), "#2ca02c", "8,3", {0.0, double(cfg.steps - 1)},
             {src.entropy, src.entropy}};
    panel(svg, 0, 0, 600, 420, "SFT loss (nats), V = " + std::to_string(V), "SGD step", "loss", {a, r, o, h});
    series g{"mean reward", "#d62728", "", grpo_x, grpo_reward};
    panel(svg, 600, 0, 400, 420, "GRPO reward", "GRPO step", "reward", {g});
    svg += "</svg>\n";
    std::ofstream(cfg.svg) << svg;
    std::printf("wrote %s\n", cfg.svg.c_str());
  }

  bool ok = true;
  if (!(gap <= cfg.max_gap)) {
    std::printf("FAIL: the loss does not approach the entropy: gap %.4f > %.4f nats\n", gap, cfg.max_gap);
    ok = false;
  }
  if (!(worst_match <= cfg.match_tol) || !(max_w <= 100 * cfg.match_tol)) {
    std::printf("FAIL: lce and the materialised reference disagree: %.2e (tolerance %.2e), weights %.2e "
                "(tolerance %.2e)\n",
                worst_match, cfg.match_tol, max_w, 100 * cfg.match_tol);
    ok = false;
  }
  if (!(reward_last >= reward_first + cfg.min_reward_rise)) {
    std::printf("FAIL: the GRPO reward did not rise by %.3f: %.4f -> %.4f\n", cfg.min_reward_rise, reward_first,
                reward_last);
    ok = false;
  }
  std::printf(ok ? "PASS\n" : "FAILED\n");
  return ok ? 0 : 1;
}
