#pragma once
// Packed sequences for the losses (lce/loss/*.hpp): cu_seqlens, the per-token
// batch description every loss takes, next-token targets that never cross a
// sequence boundary, and the token / sequence counts that normalise a loss.
//
// Every function takes a Thrust execution policy first (`thrust::host` on the
// CPU; `thrust::cuda::par_nosync.on(stream)` or `thrust::device` under nvcc,
// with every view in device memory): the same source runs on both. The math
// lives in functors marked LCE_HOST_DEVICE. The caller owns all memory: inputs
// and outputs are lce::vector_view.
//
// Checks that read values (cu_seqlens, DPO pairs) run as one Thrust reduction
// (a host synchronisation on a device policy) before anything is written: a
// raised lce::error names the argument and its values and leaves every output
// untouched.
//
// Needs CCCL (Thrust) on the include path; g++ alone compiles it for the host
// with -DTHRUST_DEVICE_SYSTEM=THRUST_DEVICE_SYSTEM_CPP.

#include <lce/core/config.hpp>
#include <lce/core/error.hpp>
#include <lce/core/views.hpp>
#include <lce/detail/arguments.hpp>

#include <thrust/execution_policy.h>
#include <thrust/fill.h>
#include <thrust/for_each.h>
#include <thrust/functional.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/iterator/discard_iterator.h>
#include <thrust/iterator/transform_iterator.h>
#include <thrust/iterator/transform_output_iterator.h>
#include <thrust/reduce.h>
#include <thrust/transform.h>
#include <thrust/transform_reduce.h>
#include <thrust/type_traits/is_execution_policy.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

LCE_BEGIN_NAMESPACE

// How a summed loss becomes a mean.
//   token_mean:    L = (1/normaliser) sum_i w_i l_i; normaliser = the global
//                  number of counted tokens (count_loss_units +
//                  global_token_count), or any constant divisor (e.g.
//                  Dr. GRPO's batch x max length: a plain scaled sum).
//   sequence_mean: L = (1/normaliser) sum_s (1/n_s) sum_{i in s} w_i l_i; n_s =
//                  counted tokens of sequence s (sequences with none add 0),
//                  normaliser = the global number of sequences with n_s > 0.
enum class loss_reduction { token_mean, sequence_mean };

// The per-token description shared by every loss. N (the token count) comes
// from the loss's per-token arrays; the views here are empty or of size N
// (targets, weights) / S + 1 (cu_seqlens).
//
// A token is counted when its target is not ignore_index (no targets: every
// token) and its weight is not 0 (no weights: 1). Its term is multiplied by
// its weight; counts (n_s, the normaliser) count tokens, not weights, so a
// 0/1 mask is the usual weight. A plain [B, T] batch with a mask is
// cu_seqlens = {0, T, 2T, ..., BT} and weights = the mask.
template <class I = std::int64_t, class C = std::int64_t>
struct packed_tokens {
  vector_view<const I> targets{};     // [N] shifted targets, or empty (every token counts)
  vector_view<const C> cu_seqlens{};  // [S + 1]: 0 = cu[0] <= cu[1] <= ... <= cu[S] = N; empty: one sequence [0, N)
  vector_view<const float> weights{}; // [N] per-token weights / mask, or empty (1)
  std::int64_t ignore_index = -100;
};

namespace loss_detail {

using detail::expects;
using detail::fail;

template <class T>
using bare = std::remove_cvref_t<T>;

template <class P>
inline constexpr bool is_policy = thrust::is_execution_policy<bare<P>>::value;

inline constexpr std::int64_t no_index = std::numeric_limits<std::int64_t>::max();

// The sequences of a packed batch, readable on host and device.
template <class C>
struct seqs {
  const C* cu = nullptr;  // S + 1 entries; null: one sequence [0, n)
  std::int64_t count = 1; // S
  std::int64_t n = 0;     // N

  LCE_HOST_DEVICE std::int64_t begin(std::int64_t s) const { return cu ? static_cast<std::int64_t>(cu[s]) : 0; }
  LCE_HOST_DEVICE std::int64_t end(std::int64_t s) const { return cu ? static_cast<std::int64_t>(cu[s + 1]) : n; }
  // s with cu[s] <= i < cu[s + 1] (the last such s when empty sequences share a start)
  LCE_HOST_DEVICE std::int64_t of(std::int64_t i) const {
    if (!cu) return 0;
    std::int64_t lo = 0, hi = count;
    while (hi - lo > 1) {
      const std::int64_t mid = lo + (hi - lo) / 2;
      if (static_cast<std::int64_t>(cu[mid]) <= i) lo = mid;
      else hi = mid;
    }
    return lo;
  }
};

// Token i's weight: 0 when not counted.
template <class I>
struct token_weight {
  const I* targets = nullptr;
  const float* weights = nullptr;
  std::int64_t ignore_index = -100;
  LCE_HOST_DEVICE double operator()(std::int64_t i) const {
    if (targets && static_cast<std::int64_t>(targets[i]) == ignore_index) return 0.0;
    return weights ? static_cast<double>(weights[i]) : 1.0;
  }
};

LCE_HOST_DEVICE inline double softplus(double x) {  // log(1 + e^x), stable
  return (x > 0 ? x : 0.0) + std::log1p(std::exp(-(x < 0 ? -x : x)));
}
LCE_HOST_DEVICE inline double sigmoid(double x) {
  if (x >= 0) return 1.0 / (1.0 + std::exp(-x));
  const double e = std::exp(x);
  return e / (1.0 + e);
}

// --- argument checks (host) ---------------------------------------------------

// `needed_by`: what makes an input that may otherwise be absent required (an option),
// named where it is absent.
inline void check_size(const char* name, std::int64_t size, std::int64_t want, const char* what, bool optional,
                       const char* needed_by = nullptr) {
  if (size == want || (optional && size == 0)) return;
  if (size == 0 && needed_by) fail(name, ": absent (size 0), but ", needed_by, " needs it: size ", want, " (", what, ")");
  fail(name, ": size ", size, " does not match ", what, " (", want, ")", optional ? " and is not 0 (absent)" : "");
}

inline void check_finite(const char* name, double value) {
  expects(std::isfinite(value), name, " must be finite, got ", value);
}
inline void check_non_negative(const char* name, double value) {
  expects(std::isfinite(value) && value >= 0, name, " must be finite and >= 0, got ", value);
}

// cu_seqlens: one reduction over its S + 1 entries.
struct cu_report {
  std::int64_t bad = no_index;  // first j with cu[j - 1] > cu[j]
  std::int64_t prev = 0, cur = 0;
  std::int64_t first = 0, last = 0;
};
struct cu_report_plus {
  LCE_HOST_DEVICE cu_report operator()(const cu_report& a, const cu_report& b) const {
    cu_report r = a.bad <= b.bad ? a : b;
    r.first = a.first + b.first;
    r.last = a.last + b.last;
    return r;
  }
};
template <class C>
struct cu_entry {
  const C* cu;
  std::int64_t s;
  LCE_HOST_DEVICE cu_report operator()(std::int64_t j) const {
    cu_report r;
    const auto v = static_cast<std::int64_t>(cu[j]);
    if (j > 0 && static_cast<std::int64_t>(cu[j - 1]) > v) {
      r.bad = j;
      r.prev = static_cast<std::int64_t>(cu[j - 1]);
      r.cur = v;
    }
    if (j == 0) r.first = v;
    if (j == s) r.last = v;
    return r;
  }
};

template <class C>
inline constexpr bool index_type = std::is_same_v<C, std::int32_t> || std::is_same_v<C, std::int64_t>;

// Checks cu_seqlens against n tokens; returns the sequences (S).
template <class Policy, class C>
seqs<C> check_cu_seqlens(Policy&& exec, vector_view<const C> cu, std::int64_t n, const char* name) {
  static_assert(index_type<C>, "lce: cu_seqlens must hold std::int32_t or std::int64_t");
  if (cu.size == 0) return seqs<C>{nullptr, 1, n};
  expects(cu.data != nullptr, name, ": null data for ", cu.size, " entries");
  const std::int64_t s = cu.size - 1;
  const auto idx = thrust::make_counting_iterator<std::int64_t>(0);
  const cu_report r =
      thrust::transform_reduce(exec, idx, idx + cu.size, cu_entry<C>{cu.data, s}, cu_report{}, cu_report_plus{});
  expects(r.first == 0, name, "[0] = ", r.first, ": the first offset must be 0");
  expects(r.bad == no_index, name, " must be non-decreasing: ", name, "[", r.bad - 1, "] = ", r.prev, " > ", name,
          "[", r.bad, "] = ", r.cur);
  expects(r.last == n, name, "[", s, "] = ", r.last, ": the last offset must be the number of tokens (", n, ")");
  return seqs<C>{cu.data, s, n};
}

// Finite without <cmath> in device code: inf - inf and NaN - NaN are NaN.
LCE_HOST_DEVICE inline bool finite(double v) { return v - v == 0.0; }

// The first non-finite value of a reduction (index, value) and a count.
struct value_report {
  std::int64_t bad = no_index;  // first token i whose value is not finite
  std::int64_t at = 0;          // the entry read for it (i, or its sequence)
  double value = 0;
  std::int64_t counted = 0;     // counted tokens
};
struct value_report_plus {
  LCE_HOST_DEVICE value_report operator()(const value_report& a, const value_report& b) const {
    value_report r = a.bad <= b.bad ? a : b;
    r.counted = a.counted + b.counted;
    return r;
  }
};

// Weights: every entry finite (a NaN in a mask is a bug upstream, counted or
// not); counts the counted tokens on the way (for the normaliser's check).
template <class I>
struct weight_entry {
  token_weight<I> w;
  LCE_HOST_DEVICE value_report operator()(std::int64_t i) const {
    value_report r;
    if (w.weights && !finite(static_cast<double>(w.weights[i]))) {
      r.bad = i;
      r.at = i;
      r.value = static_cast<double>(w.weights[i]);
      return r;
    }
    r.counted = w(i) != 0.0 ? 1 : 0;
    return r;
  }
};

template <class I, class C>
token_weight<I> weight_of(const packed_tokens<I, C>& batch) {
  return {batch.targets.size ? batch.targets.data : nullptr, batch.weights.size ? batch.weights.data : nullptr,
          batch.ignore_index};
}

// Checks the batch against n tokens (sizes, cu_seqlens, finite weights);
// `counted` (optional) receives this rank's counted tokens.
template <class Policy, class I, class C>
seqs<C> check_batch(Policy&& exec, const packed_tokens<I, C>& batch, std::int64_t n,
                    std::int64_t* counted = nullptr) {
  static_assert(index_type<I>, "lce: targets must hold std::int32_t or std::int64_t");
  check_size("targets", batch.targets.size, n, "the number of tokens", true);
  check_size("weights", batch.weights.size, n, "the number of tokens", true);
  expects(batch.targets.size == 0 || n == 0 || batch.targets.data, "targets: null data for ", n, " tokens");
  expects(batch.weights.size == 0 || n == 0 || batch.weights.data, "weights: null data for ", n, " tokens");
  const auto sq = check_cu_seqlens(exec, batch.cu_seqlens, n, "cu_seqlens");
  if (n > 0 && (counted || batch.weights.size)) {
    const auto idx = thrust::make_counting_iterator<std::int64_t>(0);
    const value_report r = thrust::transform_reduce(exec, idx, idx + n, weight_entry<I>{weight_of(batch)},
                                                    value_report{}, value_report_plus{});
    expects(r.bad == no_index, "weights[", r.bad, "] = ", r.value, " is not finite");
    if (counted) *counted = r.counted;
  } else if (counted) {
    *counted = 0;
  }
  return sq;
}

// A per-token (or, per_sequence, per-sequence) input read by counted tokens:
// its value there must be finite. Tokens that do not count are not read.
template <class R, class C, class I>
struct finite_entry {
  const R* data;
  token_weight<I> w;
  seqs<C> sq;
  bool per_sequence;
  LCE_HOST_DEVICE value_report operator()(std::int64_t i) const {
    value_report r;
    if (w(i) == 0.0) return r;
    const std::int64_t at = per_sequence ? sq.of(i) : i;
    const double v = static_cast<double>(data[at]);
    if (!finite(v)) {
      r.bad = i;
      r.at = at;
      r.value = v;
    }
    return r;
  }
};

template <class Policy, class R, class C, class I>
void check_finite_values(Policy&& exec, const char* name, const R* data, seqs<C> sq, token_weight<I> w,
                         bool per_sequence = false) {
  if (!data || sq.n == 0) return;
  const auto idx = thrust::make_counting_iterator<std::int64_t>(0);
  const value_report r = thrust::transform_reduce(exec, idx, idx + sq.n, finite_entry<R, C, I>{data, w, sq, per_sequence},
                                                  value_report{}, value_report_plus{});
  if (per_sequence)
    expects(r.bad == no_index, name, "[", r.at, "] = ", r.value, " is not finite (sequence ", r.at,
            " has counted tokens, the first at ", r.bad, ")");
  else
    expects(r.bad == no_index, name, "[", r.bad, "] = ", r.value,
            " is not finite (token ", r.bad, " counts: its target is not ignore_index and its weight is not 0)");
}

// normaliser: finite, >= 0, and not 0 while this rank has something to normalise.
// `counted_by`: the function that counts them on one rank.
inline void check_normaliser(double normaliser, std::int64_t units, const char* what,
                             const char* counted_by = "count_loss_units") {
  check_non_negative("normaliser", normaliser);
  expects(normaliser > 0 || units == 0, "normaliser is 0 but this rank has ", units, " ", what,
          ": pass the global count (", counted_by, " summed by global_token_count), which includes them");
}

// No output may overlap an input or another output (lce::error naming both).
using detail::bytes_of;
using detail::check_no_alias;

template <class T>
const T* optional_data(vector_view<T> v) {
  return v.size ? v.data : nullptr;
}

// --- segmented sums -------------------------------------------------------------
// store(s, sum over the tokens i of sequence s of value(i)) for every sequence
// with at least one token (one reduce_by_key; the key travels in the value so
// the result is scattered to its sequence, and empty sequences are skipped:
// fill the outputs first).

template <class Acc>
struct keyed {
  std::int64_t key;
  Acc acc;
};
template <class Acc>
struct keyed_plus {
  LCE_HOST_DEVICE keyed<Acc> operator()(const keyed<Acc>& a, const keyed<Acc>& b) const {
    return {a.key, a.acc + b.acc};
  }
};
template <class C>
struct seq_key {
  seqs<C> sq;
  LCE_HOST_DEVICE std::int64_t operator()(std::int64_t i) const { return sq.of(i); }
};
template <class C, class Value, class Acc>
struct keyed_value {
  seqs<C> sq;
  Value value;
  LCE_HOST_DEVICE keyed<Acc> operator()(std::int64_t i) const { return {sq.of(i), static_cast<Acc>(value(i))}; }
};
template <class Acc, class Store>
struct keyed_store {
  Store store;
  LCE_HOST_DEVICE int operator()(const keyed<Acc>& k) const {
    store(k.key, k.acc);
    return 0;
  }
};

template <class Acc, class Policy, class C, class Value, class Store>
void segmented_sum(Policy&& exec, seqs<C> sq, Value value, Store store) {
  if (sq.n == 0) return;
  const auto idx = thrust::make_counting_iterator<std::int64_t>(0);
  const auto keys = thrust::make_transform_iterator(idx, seq_key<C>{sq});
  const auto values = thrust::make_transform_iterator(idx, keyed_value<C, Value, Acc>{sq, value});
  const auto out =
      thrust::make_transform_output_iterator(thrust::make_discard_iterator(), keyed_store<Acc, Store>{store});
  thrust::reduce_by_key(exec, keys, keys + sq.n, values, thrust::make_discard_iterator(), out,
                        thrust::equal_to<std::int64_t>(), keyed_plus<Acc>());
}

// Stores into a per-sequence array.
template <class T>
struct store_to {
  T* out;
  template <class Acc>
  LCE_HOST_DEVICE void operator()(std::int64_t s, const Acc& v) const {
    out[s] = static_cast<T>(v);
  }
};

template <class I>
struct counted_token {
  token_weight<I> w;
  LCE_HOST_DEVICE std::int64_t operator()(std::int64_t i) const { return w(i) != 0.0 ? 1 : 0; }
};

// seq_tokens[s] = counted tokens of sequence s (every entry written).
template <class Policy, class C, class I>
void sequence_token_counts(Policy&& exec, seqs<C> sq, token_weight<I> w, std::int64_t* seq_tokens) {
  thrust::fill(exec, seq_tokens, seq_tokens + sq.count, std::int64_t{0});
  segmented_sum<std::int64_t>(exec, sq, counted_token<I>{w}, store_to<std::int64_t>{seq_tokens});
}

// Whether a sequence has a counted token (scans from its end, where completions are).
template <class C, class I>
struct sequence_has_tokens {
  seqs<C> sq;
  token_weight<I> w;
  LCE_HOST_DEVICE std::int64_t operator()(std::int64_t s) const {
    for (std::int64_t i = sq.end(s) - 1; i >= sq.begin(s); --i)
      if (w(i) != 0.0) return 1;
    return 0;
  }
};

// Per-token scale of a reduction: w_i / normaliser, or w_i / (n_s normaliser).
template <class C, class I>
struct token_scale {
  seqs<C> sq;
  token_weight<I> w;
  const std::int64_t* seq_tokens;  // sequence_mean only
  double inv_norm;                 // 0 when the normaliser is 0
  LCE_HOST_DEVICE double operator()(std::int64_t i) const {
    const double wi = w(i);
    if (wi == 0.0) return 0.0;
    if (!seq_tokens) return wi * inv_norm;
    const std::int64_t ns = seq_tokens[sq.of(i)];
    return ns > 0 ? wi * inv_norm / static_cast<double>(ns) : 0.0;
  }
};

// K double sums reduced together (transform_reduce's value type).
template <int K>
struct sums {
  double v[K] = {};
  LCE_HOST_DEVICE sums operator+(const sums& o) const {
    sums r;
    for (int k = 0; k < K; ++k) r.v[k] = v[k] + o.v[k];
    return r;
  }
};
template <int K>
struct sums_plus {
  LCE_HOST_DEVICE sums<K> operator()(const sums<K>& a, const sums<K>& b) const { return a + b; }
};

inline double inverse(double normaliser) { return normaliser > 0 ? 1.0 / normaliser : 0.0; }

// --- next-token targets ---------------------------------------------------------
template <class Tok, class C, class I>
struct shifted_target {
  const Tok* tokens;
  seqs<C> sq;
  std::int64_t ignore_index;
  LCE_HOST_DEVICE I operator()(std::int64_t i) const {
    const std::int64_t s = sq.of(i);
    return i + 1 < sq.end(s) ? static_cast<I>(tokens[i + 1]) : static_cast<I>(ignore_index);
  }
};

}  // namespace loss_detail

// Checks cu_seqlens for `tokens` tokens (lce::error naming it otherwise) and
// returns the number of sequences S (1 for an empty view: one sequence).
template <class Policy, class C>
  requires loss_detail::is_policy<Policy>
std::int64_t check_cu_seqlens(Policy&& exec, vector_view<C> cu_seqlens, std::int64_t tokens) {
  using V = std::remove_const_t<C>;
  return loss_detail::check_cu_seqlens(exec, vector_view<const V>{cu_seqlens.data, cu_seqlens.size}, tokens,
                                       "cu_seqlens")
      .count;
}

// targets_out[i] = token_ids[i + 1] inside a sequence; the last token of each
// sequence gets ignore_index, so no target crosses a sequence boundary.
template <class Policy, class Tok, class C, class I>
  requires loss_detail::is_policy<Policy>
void shift_targets_packed(Policy&& exec, vector_view<Tok> token_ids, vector_view<C> cu_seqlens,
                          vector_view<I> targets_out, std::int64_t ignore_index = -100) {
  using T0 = std::remove_const_t<Tok>;
  using C0 = std::remove_const_t<C>;
  static_assert(std::is_integral_v<T0>, "lce: token_ids must hold integers");
  static_assert(loss_detail::index_type<I>, "lce: targets_out must hold std::int32_t or std::int64_t");
  const std::int64_t n = token_ids.size;
  loss_detail::check_size("targets_out", targets_out.size, n, "token_ids", false);
  if constexpr (std::is_same_v<I, std::int32_t>)
    detail::expects(ignore_index >= INT32_MIN && ignore_index <= INT32_MAX, "ignore_index ", ignore_index,
                    " does not fit targets_out's std::int32_t");
  const auto sq =
      loss_detail::check_cu_seqlens(exec, vector_view<const C0>{cu_seqlens.data, cu_seqlens.size}, n, "cu_seqlens");
  if (n == 0) return;
  detail::expects(token_ids.data && targets_out.data, "token_ids / targets_out: null data for ", n, " tokens");
  detail::check_no_alias({detail::bytes_of(token_ids, "token_ids"), detail::bytes_of(cu_seqlens, "cu_seqlens")},
                         {detail::bytes_of(targets_out, "targets_out")});
  const auto idx = thrust::make_counting_iterator<std::int64_t>(0);
  thrust::transform(exec, idx, idx + n, targets_out.data,
                    loss_detail::shifted_target<T0, C0, I>{token_ids.data, sq, ignore_index});
}

// The same with thrust::host (host memory).
template <class Tok, class C, class I>
void shift_targets_packed(vector_view<Tok> token_ids, vector_view<C> cu_seqlens, vector_view<I> targets_out,
                          std::int64_t ignore_index = -100) {
  shift_targets_packed(thrust::host, token_ids, cu_seqlens, targets_out, ignore_index);
}

// This rank's share of a reduction's normaliser: counted tokens (token_mean)
// or sequences with at least one counted token (sequence_mean). Sum it over
// the data/context-parallel group with lce::global_token_count(comm, local)
// (<lce/loss/token_count.hpp>) and pass the total as `normaliser`: every
// micro-batch's loss is then its exact share of the global mean.
template <class Policy, class I, class C>
  requires loss_detail::is_policy<Policy>
std::int64_t count_loss_units(Policy&& exec, const packed_tokens<I, C>& batch, std::int64_t tokens,
                              loss_reduction reduction = loss_reduction::token_mean) {
  std::int64_t counted = 0;
  const auto sq = loss_detail::check_batch(exec, batch, tokens, &counted);
  if (reduction == loss_reduction::token_mean) return counted;
  const auto w = loss_detail::weight_of(batch);
  const auto idx = thrust::make_counting_iterator<std::int64_t>(0);
  return thrust::transform_reduce(exec, idx, idx + sq.count, loss_detail::sequence_has_tokens<C, I>{sq, w},
                                  std::int64_t{0}, thrust::plus<std::int64_t>());
}

LCE_END_NAMESPACE
