#pragma once
// Distillation from a teacher's top-K: the forward KL(teacher || student) per
// token, from the teacher's log-probs of its K ids and the student's log-probs
// of the same ids (the operator's target-set forward, targets [N, K]), never
// holding [N, V]. The teacher's mass outside its top-K is not known, only its
// total 1 - sum_k p_k, so the tail is handled one of two ways, both exact KLs:
//
//   distill_tail::bucket       the (K+1)-outcome distributions "each of the K
//                              ids, or any other id": KL = sum_k p_k (log p_k -
//                              log q_k) + r_T (log r_T - log r_S), r = 1 - sum_k
//                              (teacher's and student's tails). It never exceeds
//                              the full-vocabulary KL and equals it when the
//                              student's tail is proportional to the teacher's.
//   distill_tail::renormalise  the teacher's top-K renormalised, p^_k = p_k /
//                              sum p: KL(p^ || q) = sum_k p^_k (log p^_k - log q_k)
//                              over the student's full distribution q.
//
// A tail below distill_mass_resolution (1e-5; 1e-2 for 2-byte log-probs) is the
// rounding of the K log-probs, not a mass: the teacher's counts as none (every id
// of the vocabulary in the set gives the full KL and -p), the student's as at
// least that; a top-K mass above 1 + it raises.
//
// dL/dlog q_k (to op.backward as the target set's grad_logprobs):
//   bucket       c_i (-p_k + r_T q_k / r_S)
//   renormalise  c_i (-p^_k)
// with c_i the token's scale (w_i / normaliser, or per sequence). The
// gradient depends on q, so this is forward, loss, backward (4 GEMMs).
//
//   op.forward(X, W, ids, lce::target_set_outputs<float>{student, lse, {}, {}});
//   auto r = distill_loss(thrust::host, batch, distill_inputs<std::int64_t>{ids, teacher, student},
//                         norm, distill_outputs<float>{grad});
//   op.backward(X, W, ids, lse, lce::target_set_gradients<float>{grad, {}, {}, {}}, dX, dW);
//
// An id equal to the batch's ignore_index is absent (teacher entries there
// are not read); a token whose ids are all absent adds nothing. The K ids of
// a counted token must be distinct (a teacher's top-K are): a repeat raises.

#include <lce/loss/packed.hpp>

LCE_BEGIN_NAMESPACE

enum class distill_tail { bucket, renormalise };

struct distill_options {
  loss_reduction reduction = loss_reduction::token_mean;
  distill_tail tail = distill_tail::bucket;
};

// [N, K] each, dense (ld = K): the ids (the operator's targets), the
// teacher's log-probs of them, the student's (op.forward's target-set log-probs).
template <class I, class R = const float>
struct distill_inputs {
  matrix_view<const I> ids;
  matrix_view<R> teacher_logprobs;
  matrix_view<R> student_logprobs;
};

template <class G = float>
struct distill_outputs {
  matrix_view<G> grad_logprobs{};          // [N, K] dL/dlog q (written), or empty
  vector_view<double> seq_kl{};            // [S] sum of w_i KL_i per sequence (written), or empty
  vector_view<std::int64_t> seq_tokens{};  // [S] counted tokens (written), or empty; required for sequence_mean
};

struct distill_result {
  double loss = 0;           // this rank's share of the global loss
  double kl_sum = 0;         // sum_i w_i KL_i over this rank's counted tokens
  double teacher_mass = 0;   // sum over counted tokens of the teacher's top-K mass sum_k p_k (divide by tokens)
  double student_mass = 0;   // the same for the student: how much of its mass the top-K ids hold
  std::int64_t tokens = 0;   // counted tokens with at least one id
};

namespace loss_detail {

// Below this a top-K's tail, 1 - sum_k p_k, is the rounding of its K
// log-probs (float log-probs near lse ~ 100 carry about 1e-5 of it; 2-byte
// ones about 1e-2), not a mass: a teacher's tail there counts as none (so
// every id of the vocabulary in the set gives the full KL, not the ratio of
// two roundings), a student's counts as at least this, and a top-K mass above
// 1 + this raises.
template <class R>
inline constexpr double distill_mass_resolution = sizeof(R) <= 2 ? 1e-2 : 1e-5;

// One token's KL and its gradient factors, in double.
template <class I, class R>
struct distill_token {
  const I* ids;
  const R* teacher;
  const R* student;
  std::int64_t k;
  std::int64_t ignore_index;
  distill_tail tail;

  struct row {
    double kl = 0, teacher_mass = 0, student_mass = 0;
    double log_teacher_mass = 0;  // renormalise: log sum_k p_k, from the largest log-prob (no underflow)
    double tail_ratio = 0;        // bucket: r_T / r_S
    bool any = false;
  };

  LCE_HOST_DEVICE row operator()(std::int64_t i) const {
    row out;
    double top = -INFINITY;
    for (std::int64_t e = 0; e < k; ++e) {
      if (static_cast<std::int64_t>(ids[i * k + e]) == ignore_index) continue;
      out.any = true;
      const double lt = static_cast<double>(teacher[i * k + e]);
      out.teacher_mass += std::exp(lt);
      out.student_mass += std::exp(static_cast<double>(student[i * k + e]));
      top = lt > top ? lt : top;
    }
    if (!out.any) return out;
    if (tail == distill_tail::renormalise) {
      // exp(lt) underflows at lt < -745 where exp(lt - top) does not (distill_entry
      // rejects a top of -inf here: nothing to renormalise).
      double shifted = 0;
      for (std::int64_t e = 0; e < k; ++e)
        if (static_cast<std::int64_t>(ids[i * k + e]) != ignore_index)
          shifted += std::exp(static_cast<double>(teacher[i * k + e]) - top);
      out.log_teacher_mass = top + std::log(shifted);
    }
    for (std::int64_t e = 0; e < k; ++e) {
      if (static_cast<std::int64_t>(ids[i * k + e]) == ignore_index) continue;
      const double lt = static_cast<double>(teacher[i * k + e]), ls = static_cast<double>(student[i * k + e]);
      if (tail == distill_tail::bucket) {
        const double p = std::exp(lt);
        if (p != 0.0) out.kl += p * (lt - ls);  // 0 log 0 = 0
      } else {
        const double log_p = lt - out.log_teacher_mass;
        const double p = std::exp(log_p);
        if (p != 0.0) out.kl += p * (log_p - ls);
      }
    }
    if (tail == distill_tail::bucket) {
      constexpr double resolution = distill_mass_resolution<R>;
      const double teacher_tail = 1.0 - out.teacher_mass;
      if (teacher_tail > resolution) {
        // A student with (next to) no tail facing a teacher's gives a large finite KL, not inf.
        double student_tail = 1.0 - out.student_mass;
        student_tail = student_tail > resolution ? student_tail : resolution;
        out.kl += teacher_tail * (std::log(teacher_tail) - std::log(student_tail));
        out.tail_ratio = teacher_tail / student_tail;
      }
    }
    return out;
  }
};

template <class I, class R, class C>
struct distill_terms {  // {loss, kl, teacher mass, student mass, tokens}
  distill_token<I, R> token;
  token_scale<C, I> scale;
  token_weight<I> w;
  LCE_HOST_DEVICE sums<5> operator()(std::int64_t i) const {
    sums<5> r;
    const double wi = w(i);
    if (wi == 0.0) return r;
    const auto t = token(i);
    if (!t.any) return r;
    r.v[0] = scale(i) * t.kl;
    r.v[1] = wi * t.kl;
    r.v[2] = t.teacher_mass;
    r.v[3] = t.student_mass;
    r.v[4] = 1;
    return r;
  }
};

template <class I, class R>
struct distill_weighted_kl {
  distill_token<I, R> token;
  token_weight<I> w;
  LCE_HOST_DEVICE double operator()(std::int64_t i) const {
    const double wi = w(i);
    if (wi == 0.0) return 0.0;
    const auto t = token(i);
    return t.any ? wi * t.kl : 0.0;
  }
};

template <class I, class R, class C, class G>
struct distill_gradient {
  distill_token<I, R> token;
  token_scale<C, I> scale;
  G* grad;
  LCE_HOST_DEVICE void operator()(std::int64_t i) const {
    const std::int64_t k = token.k;
    const double c = scale(i);
    const auto t = c == 0.0 ? typename distill_token<I, R>::row{} : token(i);
    for (std::int64_t e = 0; e < k; ++e) {
      double g = 0;
      if (t.any && static_cast<std::int64_t>(token.ids[i * k + e]) != token.ignore_index) {
        const double lt = static_cast<double>(token.teacher[i * k + e]);
        g = token.tail == distill_tail::bucket
                ? -std::exp(lt) + t.tail_ratio * std::exp(static_cast<double>(token.student[i * k + e]))
                : -std::exp(lt - t.log_teacher_mass);
        g *= c;
      }
      grad[i * k + e] = static_cast<G>(g);
    }
  }
};

// What distill_entry found wrong with a counted token (value_report's `at`
// is fault * K + the entry).
enum class distill_fault : std::int64_t {
  teacher_entry,    // NaN, or a probability above 1
  student_entry,    // not finite, or a probability above 1
  repeated_id,      // the entry repeats an earlier id of the token
  teacher_mass,     // the top-K hold more than 1 + distill_mass_resolution
  student_mass,     // the same for the student
  teacher_no_mass,  // renormalise: every teacher log-prob -inf
};

// The teacher's entries of counted tokens: log-probs <= 0 (or -inf), a top-K
// mass <= 1 (and > 0 to renormalise); the student's finite, its top-K mass
// <= 1; the ids distinct. Reports the first offending token.
template <class I, class R>
struct distill_entry {
  distill_token<I, R> token;
  token_weight<I> w;
  LCE_HOST_DEVICE value_report fault(std::int64_t i, distill_fault what, std::int64_t e, double value) const {
    value_report r;
    r.bad = i;
    r.at = static_cast<std::int64_t>(what) * token.k + e;
    r.value = value;
    return r;
  }
  LCE_HOST_DEVICE value_report operator()(std::int64_t i) const {
    if (w(i) == 0.0) return value_report{};
    double teacher_mass = 0, student_mass = 0;
    bool any = false;
    const I* ids = token.ids + i * token.k;
    for (std::int64_t e = 0; e < token.k; ++e) {
      const auto id = static_cast<std::int64_t>(ids[e]);
      if (id == token.ignore_index) continue;
      any = true;
      // A repeated id would count the student's mass on it twice. K^2 / 2
      // compares per token: nothing beside the token's V H GEMM work.
      for (std::int64_t f = 0; f < e; ++f)
        if (static_cast<std::int64_t>(ids[f]) == id)
          return fault(i, distill_fault::repeated_id, e, static_cast<double>(id));
      const double lt = static_cast<double>(token.teacher[i * token.k + e]);
      const double ls = static_cast<double>(token.student[i * token.k + e]);
      if (lt != lt || lt > 1e-6) return fault(i, distill_fault::teacher_entry, e, lt);
      if (!finite(ls) || ls > 1e-6) return fault(i, distill_fault::student_entry, e, ls);
      teacher_mass += std::exp(lt);
      student_mass += std::exp(ls);
    }
    if (!any) return value_report{};
    constexpr double limit = 1.0 + distill_mass_resolution<R>;
    if (teacher_mass > limit) return fault(i, distill_fault::teacher_mass, 0, teacher_mass);
    if (student_mass > limit) return fault(i, distill_fault::student_mass, 0, student_mass);
    if (token.tail == distill_tail::renormalise) {
      bool all_minus_inf = true;
      for (std::int64_t e = 0; e < token.k && all_minus_inf; ++e)
        all_minus_inf = static_cast<std::int64_t>(ids[e]) == token.ignore_index ||
                        static_cast<double>(token.teacher[i * token.k + e]) == -INFINITY;
      if (all_minus_inf) return fault(i, distill_fault::teacher_no_mass, 0, 0.0);
    }
    return value_report{};
  }
};

}  // namespace loss_detail

// The distillation loss over a packed batch (its targets/weights say which
// tokens count; their cu_seqlens the sequences), with dL/dlog q for op.backward.
template <class Policy, class I, class C, class R, class G>
  requires loss_detail::is_policy<Policy>
distill_result distill_loss(Policy&& exec, const packed_tokens<I, C>& batch, const distill_inputs<I, R>& in,
                            double normaliser, const distill_outputs<G>& out, const distill_options& options = {}) {
  using namespace loss_detail;
  using R0 = std::remove_const_t<R>;
  const std::int64_t n = in.ids.rows, k = in.ids.cols;
  std::int64_t counted = 0;
  const auto sq = check_batch(exec, batch, n, &counted);
  expects(k > 0 || n == 0, "ids: [", n, ", ", k, "]: distillation needs K >= 1 teacher ids per token");
  const auto check_matrix = [&](const char* name, std::int64_t rows, std::int64_t cols, std::int64_t ld,
                                const void* data, bool optional) {
    if (optional && rows == 0 && cols == 0) return;
    expects(rows == n && cols == k, name, ": [", rows, ", ", cols, "] does not match ids' [", n, ", ", k, "]");
    expects(rows <= 1 || ld == cols, name, ": [", rows, ", ", cols, "] must be dense rows (ld ", ld, ")");
    expects(n * k == 0 || data, name, ": null data for [", rows, ", ", cols, "]");
  };
  check_matrix("ids", in.ids.rows, in.ids.cols, in.ids.ld, in.ids.data, false);
  check_matrix("teacher_logprobs", in.teacher_logprobs.rows, in.teacher_logprobs.cols, in.teacher_logprobs.ld,
               in.teacher_logprobs.data, false);
  check_matrix("student_logprobs", in.student_logprobs.rows, in.student_logprobs.cols, in.student_logprobs.ld,
               in.student_logprobs.data, false);
  check_matrix("grad_logprobs", out.grad_logprobs.rows, out.grad_logprobs.cols, out.grad_logprobs.ld,
               out.grad_logprobs.data, true);
  check_size("seq_kl", out.seq_kl.size, sq.count, "the number of sequences", true);
  check_size("seq_tokens", out.seq_tokens.size, sq.count, "the number of sequences", true);
  expects(options.reduction != loss_reduction::sequence_mean || out.seq_tokens.size == sq.count,
          "seq_tokens: sequence_mean needs it ([", sq.count, "] per-sequence counts), got size ", out.seq_tokens.size);
  expects(options.tail == distill_tail::bucket || options.tail == distill_tail::renormalise,
          "options.tail = ", static_cast<int>(options.tail), " is not a distill_tail");
  check_normaliser(normaliser, counted, "counted tokens");
  check_no_alias({bytes_of(in.ids, "ids"), bytes_of(in.teacher_logprobs, "teacher_logprobs"),
                  bytes_of(in.student_logprobs, "student_logprobs"), bytes_of(batch.targets, "targets"),
                  bytes_of(batch.cu_seqlens, "cu_seqlens"), bytes_of(batch.weights, "weights")},
                 {bytes_of(out.grad_logprobs, "grad_logprobs"), bytes_of(out.seq_kl, "seq_kl"),
                  bytes_of(out.seq_tokens, "seq_tokens")});

  const auto w = weight_of(batch);
  const distill_token<I, R0> token{in.ids.data, in.teacher_logprobs.data, in.student_logprobs.data, k,
                                   batch.ignore_index, options.tail};
  const auto idx = thrust::make_counting_iterator<std::int64_t>(0);
  if (n > 0) {
    const value_report r = thrust::transform_reduce(exec, idx, idx + n, distill_entry<I, R0>{token, w},
                                                    value_report{}, value_report_plus{});
    if (r.bad != no_index) {
      const auto what = static_cast<distill_fault>(r.at / k);
      const std::int64_t e = r.at % k;
      const double resolution = distill_mass_resolution<R0>;
      switch (what) {
        case distill_fault::teacher_entry:
          detail::fail("teacher_logprobs[", r.bad, ", ", e, "] = ", r.value,
                       " is not a log-probability (NaN or > 0) and token ", r.bad, " counts");
        case distill_fault::student_entry:
          detail::fail("student_logprobs[", r.bad, ", ", e, "] = ", r.value,
                       " is not a finite log-probability and token ", r.bad, " counts");
        case distill_fault::repeated_id:
          detail::fail("ids[", r.bad, ", ", e, "] = ", static_cast<std::int64_t>(r.value),
                       " repeats an earlier id of token ", r.bad, ": a token's K ids must be distinct (a teacher's ",
                       "top-K are; ignore_index ", batch.ignore_index, " may repeat)");
        case distill_fault::teacher_mass:
          detail::fail("teacher_logprobs: the top-K of token ", r.bad, " hold probability ", r.value, " > 1 + ",
                       resolution, " (log-probs of a normalised distribution over the whole vocabulary expected)");
        case distill_fault::student_mass:
          detail::fail("student_logprobs: the top-K of token ", r.bad, " hold probability ", r.value, " > 1 + ",
                       resolution, " (the student's log-probs of the K ids, from the operator's target-set ",
                       "forward, expected)");
        case distill_fault::teacher_no_mass:
          detail::fail("teacher_logprobs: every log-prob of token ", r.bad,
                       " is -inf: distill_tail::renormalise has no top-K mass to renormalise (bucket takes it)");
      }
    }
  }
  const std::int64_t* counts = nullptr;
  if (out.seq_tokens.size) {
    sequence_token_counts(exec, sq, w, out.seq_tokens.data);
    if (options.reduction == loss_reduction::sequence_mean) counts = out.seq_tokens.data;
  }
  const token_scale<C, I> scale{sq, w, counts, inverse(normaliser)};
  distill_result result;
  if (n > 0) {
    const sums<5> s = thrust::transform_reduce(exec, idx, idx + n, distill_terms<I, R0, C>{token, scale, w}, sums<5>{},
                                               sums_plus<5>{});
    result.loss = s.v[0];
    result.kl_sum = s.v[1];
    result.teacher_mass = s.v[2];
    result.student_mass = s.v[3];
    result.tokens = static_cast<std::int64_t>(s.v[4]);
  }
  if (out.grad_logprobs.rows && n > 0)
    thrust::for_each(exec, idx, idx + n, distill_gradient<I, R0, C, G>{token, scale, out.grad_logprobs.data});
  if (out.seq_kl.size) {
    thrust::fill(exec, out.seq_kl.data, out.seq_kl.data + sq.count, 0.0);
    segmented_sum<double>(exec, sq, distill_weighted_kl<I, R0>{token, w}, store_to<double>{out.seq_kl.data});
  }
  return result;
}

LCE_END_NAMESPACE
