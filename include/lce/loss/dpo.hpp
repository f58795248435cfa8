#pragma once
// DPO over packed sequences, with an optional SFT (NLL) term on the chosen
// sequences (RPO) and optional length-averaged log-probs (IPO/SimPO style).
//
// Layout: the packed batch holds S sequences (cu_seqlens); a preference pair
// is (chosen, rejected), two sequence indices. `pairs` lists them flat,
// [c_0, r_0, c_1, r_1, ...]; empty means consecutive sequences: (0, 1),
// (2, 3), ... (S must be even). Each sequence belongs to at most one pair (checked)
// (sequences in none get zero gradient). Per sequence s, with w_i the token
// weights (packed.hpp) and n_s its counted tokens:
//   pi_s  = sum_{i in s} w_i logp_i          (length_average: divided by n_s; 0 when n_s = 0)
//   ref_s = ref_seq_logprobs[s], in the same form (sequence_logprobs of the reference model's logp)
// Per pair p = (c, r):
//   m_p   = beta ((pi_c - ref_c) - (pi_r - ref_r))
//   l_p   = -log sigmoid(m_p) + sft_coef nll_c,   nll_c = -(sum_{i in c} w_i logp_i) / n_c
//   L     = (1/normaliser) sum_p l_p,  normaliser = the global number of pairs
//           (lce::global_token_count(comm, local_pairs), or the local count on one rank)
// Outputs dL/dlogp per token (-> op.backward), dL/dpi per sequence, metrics.

#include <lce/loss/packed.hpp>

#include <thrust/memory.h>

LCE_BEGIN_NAMESPACE

struct dpo_options {
  double beta = 0.1;            // > 0, finite
  double sft_coef = 0;          // >= 0: weight of the chosen sequences' NLL (token mean per sequence)
  bool length_average = false;  // pi_s = mean instead of sum of the sequence's log-probs
};

template <class R = float, class P = std::int64_t>
struct dpo_inputs {
  vector_view<const R> logprobs{};             // [N] op.forward's
  vector_view<const double> ref_seq_logprobs{};  // [S] the reference model's pi_s (sequence_logprobs, same length_average)
  vector_view<const P> pairs{};                // [2 x pairs] (chosen, rejected) sequence indices, or empty: (0,1), (2,3), ...
};

template <class G = float>
struct dpo_outputs {
  vector_view<G> grad_logprobs{};          // [N] dL/dlogp (written)
  vector_view<double> seq_logprobs{};      // [S] the policy's pi_s (written)
  vector_view<double> seq_grad{};          // [S] dL/dpi_s (written; 0 for sequences in no pair)
  vector_view<std::int64_t> seq_tokens{};  // [S] n_s (written)
};

// Means over this rank's pairs; rewards are beta (pi - ref).
struct dpo_result {
  double loss = 0;        // this rank's share of the global loss (sum over ranks = the global loss)
  double dpo_loss = 0;    // its -log sigmoid part
  double sft_loss = 0;    // its sft_coef nll part
  std::int64_t pairs = 0;
  double reward_accuracy = 0;  // fraction of pairs with chosen reward > rejected reward
  double mean_margin = 0;      // mean of chosen reward - rejected reward
  double chosen_reward = 0;    // mean chosen reward
  double rejected_reward = 0;  // mean rejected reward
};

namespace loss_detail {

template <class P>
struct pair_list {
  const P* pairs;  // null: consecutive sequences
  LCE_HOST_DEVICE std::int64_t chosen(std::int64_t p) const {
    return pairs ? static_cast<std::int64_t>(pairs[2 * p]) : 2 * p;
  }
  LCE_HOST_DEVICE std::int64_t rejected(std::int64_t p) const {
    return pairs ? static_cast<std::int64_t>(pairs[2 * p + 1]) : 2 * p + 1;
  }
};

struct pair_report {
  std::int64_t bad = no_index;  // first pair with an index outside [0, S) or chosen == rejected
  std::int64_t chosen = 0, rejected = 0;
};
struct pair_report_min {
  LCE_HOST_DEVICE pair_report operator()(const pair_report& a, const pair_report& b) const {
    return a.bad <= b.bad ? a : b;
  }
};
template <class P>
struct pair_entry {
  pair_list<P> list;
  std::int64_t s;
  LCE_HOST_DEVICE pair_report operator()(std::int64_t p) const {
    pair_report r;
    const std::int64_t c = list.chosen(p), j = list.rejected(p);
    if (c < 0 || c >= s || j < 0 || j >= s || c == j) {
      r.bad = p;
      r.chosen = c;
      r.rejected = j;
    }
    return r;
  }
};

// Each sequence in at most one pair: every pair marks its two sequences with
// its index, then every pair checks that both marks are its own (with a
// sequence in two pairs, the pair whose mark was overwritten fails).
template <class P>
struct pair_mark {
  pair_list<P> list;
  std::int64_t* mark;
  LCE_HOST_DEVICE void operator()(std::int64_t p) const {
    mark[list.chosen(p)] = p;
    mark[list.rejected(p)] = p;
  }
};
struct pair_clash {
  std::int64_t bad = no_index, chosen = 0, rejected = 0, sequence = 0, other = 0;
};
struct pair_clash_min {
  LCE_HOST_DEVICE pair_clash operator()(const pair_clash& a, const pair_clash& b) const {
    return a.bad <= b.bad ? a : b;
  }
};
template <class P>
struct pair_unmarked {
  pair_list<P> list;
  const std::int64_t* mark;
  LCE_HOST_DEVICE pair_clash operator()(std::int64_t p) const {
    pair_clash r;
    const std::int64_t c = list.chosen(p), j = list.rejected(p);
    if (mark[c] != p || mark[j] != p) {
      r.bad = p;
      r.chosen = c;
      r.rejected = j;
      r.sequence = mark[c] != p ? c : j;
      r.other = mark[r.sequence];
    }
    return r;
  }
};

template <class Policy>
struct temporary_marks {  // thrust::get_temporary_buffer, returned on every path
  Policy& exec;
  decltype(thrust::get_temporary_buffer<std::int64_t>(exec, 0)) buffer;
  temporary_marks(Policy& e, std::int64_t n) : exec(e), buffer(thrust::get_temporary_buffer<std::int64_t>(e, n)) {}
  ~temporary_marks() { thrust::return_temporary_buffer(exec, buffer.first, buffer.second); }
  temporary_marks(const temporary_marks&) = delete;
  temporary_marks& operator=(const temporary_marks&) = delete;
  std::int64_t* get() const { return thrust::raw_pointer_cast(buffer.first); }
};

template <class R, class I>
struct weighted_logp {
  const R* logp;
  token_weight<I> w;
  LCE_HOST_DEVICE double operator()(std::int64_t i) const {
    const double wi = w(i);
    return wi == 0.0 ? 0.0 : wi * static_cast<double>(logp[i]);
  }
};

struct average_at {
  double* seq;
  const std::int64_t* counts;
  LCE_HOST_DEVICE void operator()(std::int64_t s) const {
    seq[s] = counts[s] > 0 ? seq[s] / static_cast<double>(counts[s]) : 0.0;
  }
};

// Pair p's terms, shared by the gradient and the reduction.
template <class P>
struct dpo_math {
  pair_list<P> list;
  const double* pi;
  const double* ref;
  const std::int64_t* counts;
  double beta, sft_coef, inv_norm;
  bool length_average;

  struct terms {
    double dpo, nll, reward_c, reward_r, d_c, d_r;  // d_*: dL/dpi (with inv_norm)
  };
  LCE_HOST_DEVICE terms operator()(std::int64_t p) const {
    const std::int64_t c = list.chosen(p), r = list.rejected(p);
    terms t;
    t.reward_c = beta * (pi[c] - ref[c]);
    t.reward_r = beta * (pi[r] - ref[r]);
    const double m = t.reward_c - t.reward_r;
    t.dpo = softplus(-m);
    const double s = sigmoid(-m);
    const double nc = static_cast<double>(counts[c]);
    // nll_c = -(sum w logp) / n_c = -pi_c (length_average) or -pi_c / n_c
    double dnll = 0.0;
    if (counts[c] > 0) dnll = length_average ? -1.0 : -1.0 / nc;
    t.nll = dnll * pi[c];
    t.d_c = inv_norm * (-beta * s + sft_coef * dnll);
    t.d_r = inv_norm * beta * s;
    return t;
  }
};

template <class P>
struct dpo_scatter {
  dpo_math<P> math;
  double* seq_grad;
  LCE_HOST_DEVICE void operator()(std::int64_t p) const {
    const auto t = math(p);
    seq_grad[math.list.chosen(p)] = t.d_c;
    seq_grad[math.list.rejected(p)] = t.d_r;
  }
};

// {loss, dpo, sft, accuracy, margin, chosen reward, rejected reward}
template <class P>
struct dpo_terms {
  dpo_math<P> math;
  LCE_HOST_DEVICE sums<7> operator()(std::int64_t p) const {
    const auto t = math(p);
    sums<7> s;
    s.v[1] = math.inv_norm * t.dpo;
    s.v[2] = math.inv_norm * math.sft_coef * t.nll;
    s.v[0] = s.v[1] + s.v[2];
    s.v[3] = t.reward_c > t.reward_r ? 1.0 : 0.0;
    s.v[4] = t.reward_c - t.reward_r;
    s.v[5] = t.reward_c;
    s.v[6] = t.reward_r;
    return s;
  }
};

template <class G, class C, class I>
struct dpo_token_grad {
  seqs<C> sq;
  token_weight<I> w;
  const double* seq_grad;
  const std::int64_t* counts;
  bool length_average;
  LCE_HOST_DEVICE G operator()(std::int64_t i) const {
    const double wi = w(i);
    if (wi == 0.0) return G(0);
    const std::int64_t s = sq.of(i);
    double g = seq_grad[s] * wi;
    if (length_average) g /= static_cast<double>(counts[s]);  // n_s > 0: token i counts
    return static_cast<G>(g);
  }
};

// The reference value of each paired sequence must be finite.
struct ref_report {
  std::int64_t bad = no_index;  // first pair with a non-finite reference value
  std::int64_t sequence = 0;
  double value = 0;
};
struct ref_report_min {
  LCE_HOST_DEVICE ref_report operator()(const ref_report& a, const ref_report& b) const {
    return a.bad <= b.bad ? a : b;
  }
};
template <class P>
struct ref_entry {
  pair_list<P> list;
  const double* ref;
  LCE_HOST_DEVICE ref_report operator()(std::int64_t p) const {
    ref_report r;
    const std::int64_t c = list.chosen(p), j = list.rejected(p);
    const std::int64_t s = !finite(ref[c]) ? c : (!finite(ref[j]) ? j : -1);
    if (s >= 0) {
      r.bad = p;
      r.sequence = s;
      r.value = ref[s];
    }
    return r;
  }
};

template <class Policy, class R, class I, class C>
void sequence_sums(Policy&& exec, seqs<C> sq, token_weight<I> w, const R* logp, bool length_average,
                   double* seq_logprobs, std::int64_t* seq_tokens) {
  sequence_token_counts(exec, sq, w, seq_tokens);
  thrust::fill(exec, seq_logprobs, seq_logprobs + sq.count, 0.0);
  segmented_sum<double>(exec, sq, weighted_logp<R, I>{logp, w}, store_to<double>{seq_logprobs});
  if (length_average) {
    const auto idx = thrust::make_counting_iterator<std::int64_t>(0);
    thrust::for_each(exec, idx, idx + sq.count, average_at{seq_logprobs, seq_tokens});
  }
}

}  // namespace loss_detail

// pi_s for every sequence (sum, or mean with length_average, of w_i logp_i)
// and n_s: the reference model's ref_seq_logprobs come from this on its logp.
template <class Policy, class I, class C, class R>
  requires loss_detail::is_policy<Policy>
void sequence_logprobs(Policy&& exec, const packed_tokens<I, C>& batch, vector_view<R> logprobs,
                       vector_view<double> seq_logprobs, vector_view<std::int64_t> seq_tokens,
                       bool length_average = false) {
  using namespace loss_detail;
  const std::int64_t n = logprobs.size;
  const auto sq = check_batch(exec, batch, n);
  expects(n == 0 || logprobs.data, "logprobs: null data for ", n, " tokens");
  check_size("seq_logprobs", seq_logprobs.size, sq.count, "the number of sequences", false);
  check_size("seq_tokens", seq_tokens.size, sq.count, "the number of sequences", false);
  check_no_alias({bytes_of(logprobs, "logprobs"), bytes_of(batch.targets, "targets"),
                  bytes_of(batch.cu_seqlens, "cu_seqlens"), bytes_of(batch.weights, "weights")},
                 {bytes_of(seq_logprobs, "seq_logprobs"), bytes_of(seq_tokens, "seq_tokens")});
  sequence_sums(exec, sq, weight_of(batch), static_cast<const std::remove_const_t<R>*>(logprobs.data), length_average,
                seq_logprobs.data, seq_tokens.data);
}

// This rank's number of pairs (for the normaliser): pairs.size / 2, or S / 2.
template <class R, class P>
std::int64_t count_pairs(const dpo_inputs<R, P>& in, std::int64_t sequences) {
  return in.pairs.size ? in.pairs.size / 2 : sequences / 2;
}

template <class Policy, class I, class C, class R, class P, class G>
  requires loss_detail::is_policy<Policy>
dpo_result dpo_loss(Policy&& exec, const packed_tokens<I, C>& batch, const dpo_inputs<R, P>& in, double normaliser,
                    const dpo_outputs<G>& out, const dpo_options& opt = {}) {
  using namespace loss_detail;
  static_assert(index_type<P>, "lce: pairs must hold std::int32_t or std::int64_t");
  expects(std::isfinite(opt.beta) && opt.beta > 0, "dpo_options.beta must be finite and > 0, got ", opt.beta);
  check_non_negative("dpo_options.sft_coef", opt.sft_coef);
  check_non_negative("normaliser", normaliser);
  const std::int64_t n = in.logprobs.size;
  const auto sq = check_batch(exec, batch, n);
  expects(n == 0 || in.logprobs.data, "logprobs: null data for ", n, " tokens");
  expects(in.ref_seq_logprobs.size == 0 || in.ref_seq_logprobs.data, "ref_seq_logprobs: null data for ",
          in.ref_seq_logprobs.size, " sequences");
  expects(in.pairs.size == 0 || in.pairs.data, "pairs: null data for ", in.pairs.size, " entries");
  check_size("ref_seq_logprobs", in.ref_seq_logprobs.size, sq.count, "the number of sequences", false);
  check_size("grad_logprobs", out.grad_logprobs.size, n, "logprobs", false);
  check_size("seq_logprobs", out.seq_logprobs.size, sq.count, "the number of sequences", false);
  check_size("seq_grad", out.seq_grad.size, sq.count, "the number of sequences", false);
  check_size("seq_tokens", out.seq_tokens.size, sq.count, "the number of sequences", false);
  expects(in.pairs.size % 2 == 0, "pairs: size ", in.pairs.size, " is odd: it lists (chosen, rejected) index pairs");
  expects(in.pairs.size > 0 || sq.count % 2 == 0, "pairs: empty (consecutive sequences (0, 1), (2, 3), ...) needs an "
          "even number of sequences, got ", sq.count);
  const std::int64_t np = count_pairs(in, sq.count);
  check_normaliser(normaliser, np, "pair(s)", "count_pairs");
  check_no_alias({bytes_of(in.logprobs, "logprobs"), bytes_of(in.ref_seq_logprobs, "ref_seq_logprobs"),
                  bytes_of(in.pairs, "pairs"), bytes_of(batch.targets, "targets"),
                  bytes_of(batch.cu_seqlens, "cu_seqlens"), bytes_of(batch.weights, "weights")},
                 {bytes_of(out.grad_logprobs, "grad_logprobs"), bytes_of(out.seq_logprobs, "seq_logprobs"),
                  bytes_of(out.seq_grad, "seq_grad"), bytes_of(out.seq_tokens, "seq_tokens")});
  const pair_list<P> list{in.pairs.size ? in.pairs.data : nullptr};
  const auto idx = thrust::make_counting_iterator<std::int64_t>(0);
  if (np > 0) {
    const pair_report rep = thrust::transform_reduce(exec, idx, idx + np, pair_entry<P>{list, sq.count},
                                                     pair_report{}, pair_report_min{});
    expects(rep.bad == no_index, "pairs[", rep.bad, "] = (", rep.chosen, ", ", rep.rejected,
            "): chosen and rejected must be different sequences in [0, ", sq.count, ")");
    pair_clash clash;
    {
      temporary_marks<std::remove_reference_t<Policy>> marks(exec, sq.count);
      thrust::for_each(exec, idx, idx + np, pair_mark<P>{list, marks.get()});
      clash = thrust::transform_reduce(exec, idx, idx + np, pair_unmarked<P>{list, marks.get()}, pair_clash{},
                                       pair_clash_min{});
    }
    expects(clash.bad == no_index, "pairs[", clash.bad, "] = (", clash.chosen, ", ", clash.rejected,
            "): sequence ", clash.sequence, " is also in pairs[",
            clash.other, "]: each sequence may be in at most one pair");
    const ref_report ref = thrust::transform_reduce(exec, idx, idx + np, ref_entry<P>{list, in.ref_seq_logprobs.data},
                                                    ref_report{}, ref_report_min{});
    expects(ref.bad == no_index, "ref_seq_logprobs[", ref.sequence, "] = ", ref.value, " is not finite (sequence ",
            ref.sequence, " is in pairs[", ref.bad, "])");
  }
  check_finite_values(exec, "logprobs", in.logprobs.data, sq, weight_of(batch));
  // every check done: now write
  const auto w = weight_of(batch);
  sequence_sums(exec, sq, w, in.logprobs.data, opt.length_average, out.seq_logprobs.data, out.seq_tokens.data);
  thrust::fill(exec, out.seq_grad.data, out.seq_grad.data + sq.count, 0.0);
  const dpo_math<P> math{list, out.seq_logprobs.data, in.ref_seq_logprobs.data, out.seq_tokens.data, opt.beta,
                         opt.sft_coef, inverse(normaliser), opt.length_average};
  dpo_result res;
  res.pairs = np;
  if (np > 0) {
    thrust::for_each(exec, idx, idx + np, dpo_scatter<P>{math, out.seq_grad.data});
    const sums<7> s = thrust::transform_reduce(exec, idx, idx + np, dpo_terms<P>{math}, sums<7>{}, sums_plus<7>{});
    res.loss = s.v[0];
    res.dpo_loss = s.v[1];
    res.sft_loss = s.v[2];
    const double inv = 1.0 / static_cast<double>(np);
    res.reward_accuracy = s.v[3] * inv;
    res.mean_margin = s.v[4] * inv;
    res.chosen_reward = s.v[5] * inv;
    res.rejected_reward = s.v[6] * inv;
  }
  if (n > 0)
    thrust::transform(exec, idx, idx + n, out.grad_logprobs.data,
                      dpo_token_grad<G, C, I>{sq, w, out.seq_grad.data, out.seq_tokens.data, opt.length_average});
  return res;
}

LCE_END_NAMESPACE
