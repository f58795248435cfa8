#pragma once
// Clipped policy gradient (PPO / GRPO / DAPO family) over packed sequences.
//
// Per counted token i (weight w_i, packed.hpp), with logp from op.forward:
//   r     = exp(logp - old_logp)                       (old_logprobs empty: old = logp, so r = 1, dr/dlogp = 1)
//   pg    = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))
//   dual clip (dual_clip = c > 1, A < 0 only):  pg = min(pg, -A c)
//   tis   = min(exp(old_logp - generation_logprobs), tis_cap)   (tis_cap > 0: truncated importance
//           sampling for the inference engine's log-probs; a constant factor on pg)
//   kl    = logp - ref (k1)  or  exp(ref - logp) - (ref - logp) - 1 (k3)
//   l_i   = tis pg + kl_coef kl - entropy_coef entropy_i
// and L = the token_mean or sequence_mean reduction of w_i l_i (packed.hpp;
// normaliser = global counted tokens (DAPO, token level) or global sequences
// with counted tokens (GRPO, sequence level), or any constant divisor).
// Outputs dL/dlogp (-> op.backward) and dL/dentropy (op.backward's grad_entropy).

#include <lce/loss/packed.hpp>

LCE_BEGIN_NAMESPACE

enum class kl_estimator { k1, k3 };

struct pg_options {
  loss_reduction reduction = loss_reduction::token_mean;
  double eps_low = 0.2;         // ratio floor 1 - eps_low; in [0, 1)
  double eps_high = 0.2;        // ratio ceiling 1 + eps_high; >= 0 (DAPO's clip-higher: eps_high > eps_low)
  double dual_clip = 0;         // 0: off; else c > 1 bounds the loss of a negative advantage by -A c
  double kl_coef = 0;           // >= 0; > 0 needs ref_logprobs
  kl_estimator kl = kl_estimator::k3;
  double tis_cap = 0;           // 0: off; else > 0, needs generation_logprobs
  double entropy_coef = 0;      // >= 0; > 0 needs entropy and grad_entropy
  bool sequence_advantages = false;  // advantages has one entry per sequence [S] (broadcast), else [N]
};

template <class R = float>
struct pg_inputs {
  vector_view<const R> logprobs{};             // [N] op.forward's
  vector_view<const R> advantages{};           // [N], or [S] with sequence_advantages
  vector_view<const R> old_logprobs{};         // [N] behaviour policy's, or empty (on-policy: ratio 1)
  vector_view<const R> ref_logprobs{};         // [N] reference policy's (kl_coef > 0), or empty
  vector_view<const R> generation_logprobs{};  // [N] the inference engine's (tis_cap > 0), or empty
  vector_view<const R> entropy{};              // [N] op.forward's (entropy_coef > 0; else optional, for the metric)
};

template <class G = float>
struct pg_outputs {
  vector_view<G> grad_logprobs{};          // [N] dL/dlogp (written)
  vector_view<G> grad_entropy{};           // [N] dL/dentropy (written), or empty; required when entropy_coef > 0
  vector_view<double> seq_loss{};          // [S] sum_{i in s} w_i l_i (written), or empty
  vector_view<std::int64_t> seq_tokens{};  // [S] counted tokens (written), or empty; required for sequence_mean
};

// Means are over this rank's counted tokens (unweighted); `tokens` is their
// count, so ranks combine them as count-weighted means.
struct pg_result {
  double loss = 0;            // this rank's share of the global loss
  double pg_loss = 0, kl_loss = 0, entropy_loss = 0;  // its three parts (sum = loss)
  std::int64_t tokens = 0;
  double clip_frac_low = 0;   // A < 0 and r < 1 - eps_low
  double clip_frac_high = 0;  // A > 0 and r > 1 + eps_high
  double dual_clip_frac = 0;  // the dual clip's bound was taken
  double approx_kl = 0;       // mean of old_logp - logp (0 without old_logprobs)
  double ref_kl = 0;          // mean of the chosen KL estimator (with ref_logprobs)
  double mean_entropy = 0;    // with entropy
  double mean_ratio = 0;
};

namespace loss_detail {

template <class R>
struct pg_token {
  double l = 0, dl = 0;  // l_i without weight, dl_i/dlogp
  double pg = 0, kl = 0, ent = 0;
  double kl_term = 0;  // kl_coef kl: 0 without the penalty, even where the metric kl is inf
  bool low = false, high = false, dual = false;
  double ratio = 1, old_minus = 0;
};

template <class R, class C>
struct pg_math {
  const R* logp;
  const R* adv;
  const R* old;
  const R* ref;
  const R* gen;
  const R* ent;
  seqs<C> sq;
  bool seq_adv;
  double eps_low, eps_high, dual_clip, kl_coef, tis_cap, entropy_coef;
  bool k3;

  LCE_HOST_DEVICE pg_token<R> operator()(std::int64_t i) const {
    pg_token<R> t;
    const double lp = static_cast<double>(logp[i]);
    const double a = static_cast<double>(adv[seq_adv ? sq.of(i) : i]);
    const double o = old ? static_cast<double>(old[i]) : lp;
    t.old_minus = o - lp;
    const double r = std::exp(lp - o);
    t.ratio = r;
    const double lo = 1.0 - eps_low, hi = 1.0 + eps_high;
    const double rc = r < lo ? lo : (r > hi ? hi : r);
    const double pg1 = -a * r, pg2 = -a * rc;
    double pg = pg1 >= pg2 ? pg1 : pg2;
    double dpg = pg1 >= pg2 ? -a * r : 0.0;
    t.low = a < 0 && r < lo;
    t.high = a > 0 && r > hi;
    if (dual_clip > 0 && a < 0 && -a * dual_clip < pg) {
      pg = -a * dual_clip;
      dpg = 0.0;
      t.dual = true;
    }
    if (gen) {
      double tis = std::exp(o - static_cast<double>(gen[i]));
      tis = tis < tis_cap ? tis : tis_cap;
      pg *= tis;
      dpg *= tis;
    }
    t.pg = pg;
    double dkl = 0.0;
    if (ref) {
      const double d = static_cast<double>(ref[i]) - lp;
      if (k3) {
        const double e = std::exp(d);
        t.kl = e - d - 1.0;
        dkl = 1.0 - e;
      } else {
        t.kl = -d;
        dkl = 1.0;
      }
    }
    t.ent = ent ? static_cast<double>(ent[i]) : 0.0;
    // ref_logprobs may come for the metric alone (kl_coef 0), where k3's exp(ref - logp) may
    // overflow: 0 inf would make the loss NaN.
    if (kl_coef > 0) {
      t.kl_term = kl_coef * t.kl;
      dkl *= kl_coef;
    } else {
      dkl = 0.0;
    }
    t.l = pg + t.kl_term - entropy_coef * t.ent;
    t.dl = dpg + dkl;
    return t;
  }
};

template <class G, class R, class C, class I>
struct pg_grad {
  pg_math<R, C> math;
  token_scale<C, I> scale;
  LCE_HOST_DEVICE G operator()(std::int64_t i) const {
    const double sc = scale(i);
    return sc == 0.0 ? G(0) : static_cast<G>(sc * math(i).dl);
  }
};

template <class G, class C, class I>
struct pg_grad_entropy {
  token_scale<C, I> scale;
  double entropy_coef;
  LCE_HOST_DEVICE G operator()(std::int64_t i) const {
    const double sc = scale(i);
    return sc == 0.0 ? G(0) : static_cast<G>(-sc * entropy_coef);
  }
};

// {loss, pg, kl, ent-loss, tokens, low, high, dual, old-logp, ref kl, entropy, ratio}
template <class R, class C, class I>
struct pg_terms {
  pg_math<R, C> math;
  token_scale<C, I> scale;
  LCE_HOST_DEVICE sums<12> operator()(std::int64_t i) const {
    sums<12> s;
    if (scale.w(i) == 0.0) return s;
    const double sc = scale(i);
    const pg_token<R> t = math(i);
    s.v[0] = sc * t.l;
    s.v[1] = sc * t.pg;
    s.v[2] = sc * t.kl_term;
    s.v[3] = -sc * math.entropy_coef * t.ent;
    s.v[4] = 1;
    s.v[5] = t.low;
    s.v[6] = t.high;
    s.v[7] = t.dual;
    s.v[8] = t.old_minus;
    s.v[9] = t.kl;
    s.v[10] = t.ent;
    s.v[11] = t.ratio;
    return s;
  }
};

template <class R, class C, class I>
struct pg_weighted_loss {
  pg_math<R, C> math;
  token_weight<I> w;
  LCE_HOST_DEVICE double operator()(std::int64_t i) const {
    const double wi = w(i);
    return wi == 0.0 ? 0.0 : wi * math(i).l;
  }
};

}  // namespace loss_detail

// The clipped policy-gradient loss: value, metrics, dL/dlogp and dL/dentropy.
template <class Policy, class I, class C, class R, class G>
  requires loss_detail::is_policy<Policy>
pg_result policy_gradient_loss(Policy&& exec, const packed_tokens<I, C>& batch, const pg_inputs<R>& in,
                               double normaliser, const pg_outputs<G>& out, const pg_options& opt = {}) {
  using namespace loss_detail;
  const std::int64_t n = in.logprobs.size;
  // options
  expects(std::isfinite(opt.eps_low) && opt.eps_low >= 0 && opt.eps_low < 1,
          "pg_options.eps_low must be in [0, 1), got ", opt.eps_low);
  check_non_negative("pg_options.eps_high", opt.eps_high);
  expects(opt.dual_clip == 0 || (std::isfinite(opt.dual_clip) && opt.dual_clip > 1),
          "pg_options.dual_clip must be 0 (off) or a finite c > 1, got ", opt.dual_clip);
  check_non_negative("pg_options.kl_coef", opt.kl_coef);
  check_non_negative("pg_options.tis_cap", opt.tis_cap);
  check_non_negative("pg_options.entropy_coef", opt.entropy_coef);
  // sizes
  std::int64_t counted = 0;
  const auto sq = check_batch(exec, batch, n, &counted);
  check_normaliser(normaliser, counted, "counted tokens");
  expects(n == 0 || in.logprobs.data, "logprobs: null data for ", n, " tokens");
  check_size("advantages", in.advantages.size, opt.sequence_advantages ? sq.count : n,
             opt.sequence_advantages ? "the number of sequences (sequence_advantages)" : "logprobs", false);
  expects(in.advantages.size == 0 || in.advantages.data, "advantages: null data for ", in.advantages.size, " entries");
  check_size("old_logprobs", in.old_logprobs.size, n, "logprobs", true);
  check_size("ref_logprobs", in.ref_logprobs.size, n, "logprobs", opt.kl_coef == 0, "kl_coef > 0");
  check_size("generation_logprobs", in.generation_logprobs.size, n, "logprobs", opt.tis_cap == 0, "tis_cap > 0");
  check_size("entropy", in.entropy.size, n, "logprobs", opt.entropy_coef == 0, "entropy_coef > 0");
  check_size("grad_logprobs", out.grad_logprobs.size, n, "logprobs", false);
  check_size("grad_entropy", out.grad_entropy.size, n, "logprobs", opt.entropy_coef == 0, "entropy_coef > 0");
  check_size("seq_loss", out.seq_loss.size, sq.count, "the number of sequences", true);
  check_size("seq_tokens", out.seq_tokens.size, sq.count, "the number of sequences",
             opt.reduction != loss_reduction::sequence_mean, "sequence_mean");

  check_no_alias({bytes_of(in.logprobs, "logprobs"), bytes_of(in.advantages, "advantages"),
                  bytes_of(in.old_logprobs, "old_logprobs"), bytes_of(in.ref_logprobs, "ref_logprobs"),
                  bytes_of(in.generation_logprobs, "generation_logprobs"), bytes_of(in.entropy, "entropy"),
                  bytes_of(batch.targets, "targets"), bytes_of(batch.cu_seqlens, "cu_seqlens"),
                  bytes_of(batch.weights, "weights")},
                 {bytes_of(out.grad_logprobs, "grad_logprobs"), bytes_of(out.grad_entropy, "grad_entropy"),
                  bytes_of(out.seq_loss, "seq_loss"), bytes_of(out.seq_tokens, "seq_tokens")});

  const auto w = weight_of(batch);
  // values read by counted tokens: finite (a NaN advantage or log-prob would
  // turn the whole gradient to NaN without a word)
  check_finite_values(exec, "logprobs", in.logprobs.data, sq, w);
  check_finite_values(exec, "advantages", in.advantages.data, sq, w, opt.sequence_advantages);
  check_finite_values(exec, "old_logprobs", optional_data(in.old_logprobs), sq, w);
  check_finite_values(exec, "ref_logprobs", optional_data(in.ref_logprobs), sq, w);
  if (opt.tis_cap > 0) check_finite_values(exec, "generation_logprobs", optional_data(in.generation_logprobs), sq, w);
  check_finite_values(exec, "entropy", optional_data(in.entropy), sq, w);

  const std::int64_t* counts = nullptr;
  if (out.seq_tokens.size) {
    sequence_token_counts(exec, sq, w, out.seq_tokens.data);
    if (opt.reduction == loss_reduction::sequence_mean) counts = out.seq_tokens.data;
  }
  const pg_math<R, C> math{in.logprobs.data,
                           in.advantages.data,
                           optional_data(in.old_logprobs),
                           opt.kl_coef > 0 || in.ref_logprobs.size ? optional_data(in.ref_logprobs) : nullptr,
                           opt.tis_cap > 0 ? optional_data(in.generation_logprobs) : nullptr,
                           optional_data(in.entropy),
                           sq,
                           opt.sequence_advantages,
                           opt.eps_low,
                           opt.eps_high,
                           opt.dual_clip,
                           opt.kl_coef,
                           opt.tis_cap,
                           opt.entropy_coef,
                           opt.kl == kl_estimator::k3};
  const token_scale<C, I> scale{sq, w, counts, inverse(normaliser)};
  pg_result res;
  if (n > 0) {
    const auto idx = thrust::make_counting_iterator<std::int64_t>(0);
    thrust::transform(exec, idx, idx + n, out.grad_logprobs.data, pg_grad<G, R, C, I>{math, scale});
    if (out.grad_entropy.size)
      thrust::transform(exec, idx, idx + n, out.grad_entropy.data, pg_grad_entropy<G, C, I>{scale, opt.entropy_coef});
    const sums<12> s =
        thrust::transform_reduce(exec, idx, idx + n, pg_terms<R, C, I>{math, scale}, sums<12>{}, sums_plus<12>{});
    res.loss = s.v[0];
    res.pg_loss = s.v[1];
    res.kl_loss = s.v[2];
    res.entropy_loss = s.v[3];
    res.tokens = static_cast<std::int64_t>(s.v[4]);
    if (res.tokens > 0) {
      const double inv = 1.0 / s.v[4];
      res.clip_frac_low = s.v[5] * inv;
      res.clip_frac_high = s.v[6] * inv;
      res.dual_clip_frac = s.v[7] * inv;
      res.approx_kl = s.v[8] * inv;
      res.ref_kl = s.v[9] * inv;
      res.mean_entropy = s.v[10] * inv;
      res.mean_ratio = s.v[11] * inv;
    }
  }
  if (out.seq_loss.size) {
    thrust::fill(exec, out.seq_loss.data, out.seq_loss.data + sq.count, 0.0);
    segmented_sum<double>(exec, sq, pg_weighted_loss<R, C, I>{math, w}, store_to<double>{out.seq_loss.data});
  }
  return res;
}

LCE_END_NAMESPACE
