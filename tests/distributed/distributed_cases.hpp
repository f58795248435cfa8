// The distributed test bodies, written once and run on any communicator:
// lce::comm::threads (test_threads.cpp) and lce::comm::mpi (test_mpi.cpp).
//
// Every function here runs on EVERY rank of the group it is given, issues the
// same library calls in the same order on every rank, and never returns early
// on one rank only (that would leave the others waiting in a collective).
//
// The reference is independent of the distribution: each rank also runs the
// same operation with lce::comm::single on the full weight (and, under
// sequence parallelism, the full hidden) and compares its own slice of the
// results with the matching slice of the single-rank results.
//
// Tolerances (|got - want| <= tol * (1 + |want|), + 1 rounding unit of a
// 2-byte output type):
//   T = double, double results          tol = 1e-12
//   T = float                           tol = 1e-5
//   T = bfloat16 / float16              tol = 1e-5, plus one unit in the last
//     place of T for gradients stored as T. Both sides see bit-identical 2-byte
//     inputs and widen them the same way, and all arithmetic is fp32 on both
//     sides, so the fp32 results differ only by summation order, exactly as for
//     float; a gradient stored in T is the rounding of two fp32 values that
//     differ by that much, and two such roundings can land one unit of T apart.
// The distributed and single-rank runs differ only in summation order: the
// vocabulary's statistics are merged from per-rank partials, dX is a sum over
// ranks of per-shard products, and sequence parallel chunks mix rows from
// every rank, so dW sums the same tokens in another grouping. Measured worst
// |error| / tolerance (LCE_DIST_MARGINS=1 prints them): double <= 0.0015,
// float <= 0.09, 2-byte fp32 results <= 0.03; 2-byte gradients reach 0.99
// where the two roundings land one unit of T apart.
//
// Bodies:
//   check_all_configurations<T>       forward / backward / forward_backward vs one rank,
//                                     and the collectives each call issues (counting<Comm>)
//   check_bad_input_everywhere        bad input on one rank -> lce::error on every rank
//   check_shard_change                a shard that grows is re-checked on every rank
//   check_context_parallel<T>         tokens split over ranks; global_token_count
//   check_budget_chunk_uneven_shards  (agreement) default chunk policy, uneven shards
//   check_ranks_disagree              (agreement) ranks with different N or H
#pragma once

#include "support/error_of.hpp"

#include <lce/comm/threads.hpp>
#include <lce/lce.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <limits>
#include <mutex>
#include <numeric>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

namespace lce_dist {

// ===========================================================================
// A communicator that forwards every collective to another and counts it.
// ===========================================================================

struct collective_counts {
  std::int64_t all_gather_bytes = 0;    // calls
  std::int64_t all_reduce_sum = 0;
  std::int64_t reduce_scatter_sum = 0;
  std::int64_t all_agree = 0;
  std::int64_t all_gather_host = 0;
  std::int64_t gathered_bytes = 0;      // bytes this rank contributed to all_gather_bytes
  std::int64_t reduced_bytes = 0;       // bytes of the buffers summed by all_reduce_sum
  std::int64_t scattered_bytes = 0;     // bytes this rank received from reduce_scatter_sum
  std::int64_t host_values = 0;         // int64 values this rank contributed to all_gather_host

  bool operator==(const collective_counts&) const = default;

  collective_counts operator-(const collective_counts& o) const {
    return {all_gather_bytes - o.all_gather_bytes, all_reduce_sum - o.all_reduce_sum,
            reduce_scatter_sum - o.reduce_scatter_sum, all_agree - o.all_agree,
            all_gather_host - o.all_gather_host,   gathered_bytes - o.gathered_bytes,
            reduced_bytes - o.reduced_bytes,       scattered_bytes - o.scattered_bytes,
            host_values - o.host_values};
  }

  // Payload bytes: what this rank handed to the data collectives.
  std::int64_t payload_bytes() const { return gathered_bytes + reduced_bytes + scattered_bytes; }

  std::string str() const {
    std::ostringstream os;
    os << "{all_gather_bytes " << all_gather_bytes << " (" << gathered_bytes << " B), all_reduce_sum "
       << all_reduce_sum << " (" << reduced_bytes << " B), reduce_scatter_sum " << reduce_scatter_sum << " ("
       << scattered_bytes << " B), all_agree " << all_agree << ", all_gather_host " << all_gather_host << " ("
       << host_values << " values)}";
    return os.str();
  }
};

template <lce::communicator Comm>
class counting {
 public:
  using memory_space = typename Comm::memory_space;

  counting(Comm inner, collective_counts* counts) : inner_(std::move(inner)), counts_(counts) {}

  int rank() const { return inner_.rank(); }
  int size() const { return inner_.size(); }

  void all_gather_bytes(const void* send, void* receive, std::size_t bytes) const {
    ++counts_->all_gather_bytes;
    counts_->gathered_bytes += static_cast<std::int64_t>(bytes);
    inner_.all_gather_bytes(send, receive, bytes);
  }
  template <class A>
  void all_reduce_sum(A* data, std::int64_t count) const {
    ++counts_->all_reduce_sum;
    counts_->reduced_bytes += count * static_cast<std::int64_t>(sizeof(A));
    inner_.all_reduce_sum(data, count);
  }
  template <class A>
  void reduce_scatter_sum(const A* send, A* receive, std::int64_t count) const {
    ++counts_->reduce_scatter_sum;
    counts_->scattered_bytes += count * static_cast<std::int64_t>(sizeof(A));
    inner_.reduce_scatter_sum(send, receive, count);
  }
  bool all_agree(bool flag) const {
    ++counts_->all_agree;
    return inner_.all_agree(flag);
  }
  void all_gather_host(const std::int64_t* send, std::int64_t* receive, std::int64_t count) const {
    ++counts_->all_gather_host;
    counts_->host_values += count;
    inner_.all_gather_host(send, receive, count);
  }

  const Comm& inner() const { return inner_; }
  collective_counts& counts() const { return *counts_; }

 private:
  Comm inner_;
  collective_counts* counts_;
};

static_assert(lce::communicator<counting<lce::comm::single>>);

// The calls of the operator, for the collective counts.
enum class call_kind { forward, backward, backward_with_entropy, forward_backward };

inline const char* name_of(call_kind kind) {
  switch (kind) {
    case call_kind::forward: return "forward";
    case call_kind::backward: return "backward";
    case call_kind::backward_with_entropy: return "backward with grad_entropy";
    case call_kind::forward_backward: return "forward_backward";
  }
  return "?";
}

struct call_shape {
  int ranks = 1;
  std::int64_t n_tokens = 0;      // all N tokens (the size of targets)
  std::int64_t hidden = 0;
  std::int64_t chunk_tokens = 0;  // options.chunk_tokens (> 0)
  bool sequence_parallel = false;
  std::size_t compute_bytes = 4;  // sizeof(lce::compute_t<T>)
  std::size_t storage_bytes = 4;  // sizeof(T)
};

// The collectives one call issues on one rank (the contract of the brief):
//   validation: 1 all_gather_host of a 6-value record per rank (ok, targets
//     status, N, H, vocab_start, V_local); when the shard layout is not known
//     yet (first call, or any rank's shard changed): + 1 all_agree on the targets;
//   per chunk: forward 1 all_gather_bytes of the rows' (max, sum, target logit,
//     entropy sum, logit sum) tuples; backward 1 dX reduction, plus 1 all_reduce_sum of
//     E_p[z] with grad_entropy; forward_backward 1 all_gather_bytes + 1 dX reduction;
//   sequence parallel: + 1 all_gather_bytes of the chunk's hidden rows per chunk,
//     and the dX reduction is a reduce_scatter_sum instead of an all_reduce_sum;
//   one rank: nothing at all.
// Chunks: ceil(N_local / local_chunk), N_local = N (N / P under sequence
// parallel), local_chunk = chunk_tokens (chunk_tokens / P under sequence parallel).
inline collective_counts expected_collectives(call_kind kind, const call_shape& s, bool shards_unknown) {
  collective_counts e;
  if (s.ranks == 1) return e;
  const std::int64_t p = s.ranks;
  const bool sp = s.sequence_parallel;
  (void)shards_unknown;  // one exchange per call, whether or not the shards changed
  e.all_agree = 0;
  e.all_gather_host = 1;
  e.host_values = 15;  // the call record (agreement.hpp)
  const std::int64_t local_tokens = sp ? s.n_tokens / p : s.n_tokens;
  const std::int64_t local_chunk = std::clamp<std::int64_t>(sp ? s.chunk_tokens / p : s.chunk_tokens, 1,
                                                            std::max<std::int64_t>(local_tokens, 1));
  const auto a = static_cast<std::int64_t>(s.compute_bytes);
  const auto t = static_cast<std::int64_t>(s.storage_bytes);
  for (std::int64_t first = 0; first < local_tokens; first += local_chunk) {
    const std::int64_t segment = std::min(local_chunk, local_tokens - first);  // this rank's rows
    const std::int64_t rows = sp ? segment * p : segment;                       // rows of the logit block
    if (sp) {
      ++e.all_gather_bytes;
      e.gathered_bytes += segment * s.hidden * t;
    }
    if (kind == call_kind::forward || kind == call_kind::forward_backward) {
      ++e.all_gather_bytes;
      e.gathered_bytes += rows * 5 * a;  // one (m, s, z_y, sz, sum z) tuple per row
    }
    if (kind == call_kind::backward_with_entropy) {
      ++e.all_reduce_sum;
      e.reduced_bytes += rows * a;
    }
    if (kind != call_kind::forward) {
      if (sp) {
        ++e.reduce_scatter_sum;
        e.scattered_bytes += segment * s.hidden * a;
      } else {
        ++e.all_reduce_sum;
        e.reduced_bytes += rows * s.hidden * a;
      }
    }
  }
  return e;
}

// ===========================================================================
// Element types, data, comparisons.
// ===========================================================================

template <class T>
const char* type_name() {
  if constexpr (std::is_same_v<T, float>) return "float";
  else if constexpr (std::is_same_v<T, double>) return "double";
  else if constexpr (std::is_same_v<T, lce::bfloat16>) return "bfloat16";
  else if constexpr (std::is_same_v<T, lce::float16>) return "float16";
  else if constexpr (std::is_same_v<T, std::int32_t>) return "int32";
  else return "int64";
}

// Result (log-prob, lse, entropy, grad inputs) and gradient output types per T.
// bfloat16 writes both gradients as bfloat16 (the staged, converted dX and
// the fp32 dW accumulator); float16 writes dX in float and dW as float16.
template <class T>
struct io_types {
  using result = float;
  using grad_hidden = float;
  using grad_weight = float;
};
template <>
struct io_types<double> {
  using result = double;
  using grad_hidden = double;
  using grad_weight = double;
};
template <>
struct io_types<lce::bfloat16> {
  using result = float;
  using grad_hidden = lce::bfloat16;
  using grad_weight = lce::bfloat16;
};
template <>
struct io_types<lce::float16> {
  using result = float;
  using grad_hidden = float;
  using grad_weight = lce::float16;
};

template <class E>
double to_double(E value) {
  if constexpr (std::is_floating_point_v<E>) return static_cast<double>(value);
  else return static_cast<double>(static_cast<float>(value));
}

template <class E>
E from_double(double value) {
  if constexpr (std::is_floating_point_v<E>) return static_cast<E>(value);
  else return E(static_cast<float>(value));
}

template <class E>
E not_a_number() {
  return from_double<E>(std::numeric_limits<double>::quiet_NaN());
}

template <class T>
constexpr double relative_tolerance() {
  return std::is_same_v<T, double> ? 1e-12 : 1e-5;
}

// One unit in the last place of a 2-byte type at this magnitude; 0 for float and double.
template <class E>
double rounding_unit(double magnitude) {
  int mantissa_bits = 0, min_exponent = 0;
  if constexpr (std::is_same_v<E, lce::bfloat16>) {
    mantissa_bits = 7;
    min_exponent = -126;
  } else if constexpr (std::is_same_v<E, lce::float16>) {
    mantissa_bits = 10;
    min_exponent = -14;
  } else {
    return 0.0;
  }
  int exponent = min_exponent + 1;
  if (magnitude > 0 && std::isfinite(magnitude)) (void)std::frexp(magnitude, &exponent);
  return std::ldexp(1.0, std::max(exponent - 1, min_exponent) - mantissa_bits);
}

// Compares got[i] with want[want_first + i] for i < count; reports the worst element.
struct comparison {
  bool ok = true;
  std::int64_t failures = 0, worst = -1;
  double worst_ratio = -1, got = 0, want = 0, tol = 0;
  std::string describe(const std::string& what, std::int64_t count) const {
    std::ostringstream os;
    os.precision(17);
    os << what << ": " << failures << " of " << count << " elements out of tolerance";
    if (worst >= 0)
      os << "; worst at " << worst << ": got " << got << ", want " << want << ", |diff| " << std::fabs(got - want)
         << ", tol " << tol;
    return os.str();
  }
};

template <class Tolerance, class E, class F>
comparison compare(const std::vector<E>& got, const std::vector<F>& want, std::int64_t want_first,
                   std::int64_t count, double rel, bool two_byte_rounding = false) {
  comparison c;
  for (std::int64_t i = 0; i < count; ++i) {
    const double g = to_double(got[static_cast<std::size_t>(i)]);
    const double w = to_double(want[static_cast<std::size_t>(want_first + i)]);
    double tol = rel * (1.0 + std::fabs(w));
    if (two_byte_rounding) tol += rounding_unit<Tolerance>(std::max(std::fabs(g), std::fabs(w)));
    const double err = std::fabs(g - w);
    const bool good = err <= tol;  // false for NaN
    double ratio = err / tol;
    if (std::isnan(ratio)) ratio = std::numeric_limits<double>::infinity();
    if (!good) {
      c.ok = false;
      ++c.failures;
    }
    if (ratio > c.worst_ratio) {
      c.worst = i;
      c.worst_ratio = ratio;
      c.got = g;
      c.want = w;
      c.tol = tol;
    }
  }
  return c;
}

// LCE_DIST_MARGINS=1 in the environment: print every comparison's worst
// |error| / tolerance (to see how much room a tolerance leaves).
inline void report_margin(const std::string& where, const char* what, const comparison& c) {
  static const bool enabled = std::getenv("LCE_DIST_MARGINS") != nullptr;
  if (!enabled) return;
  static std::mutex mutex;
  std::lock_guard lock(mutex);
  std::fprintf(stderr, "margin %.3g  %s: %s\n", c.worst_ratio, what, where.c_str());
}

// Deterministic data, the same on every rank: splitmix64 of (seed, index).
inline std::uint64_t mix(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
inline double uniform(std::uint64_t seed, std::uint64_t index) {  // [-1, 1)
  return static_cast<double>(mix(seed * 0x100000001B3ull + index) >> 11) * 0x1.0p-52 - 1.0;
}

// ===========================================================================
// Configurations.
// ===========================================================================

// Uneven splits of a vocabulary over P ranks, each with a single-row shard
// when P > 1; `variant` moves the single row around.
inline std::vector<std::int64_t> vocab_split(std::int64_t vocab, int ranks, int variant) {
  if (ranks == 1) return {vocab};
  if (vocab == 1000) {
    const std::vector<std::vector<std::int64_t>> splits[5] = {
        {},
        {},
        {{999, 1}, {1, 999}, {400, 600}},
        {{1, 600, 399}, {500, 499, 1}, {333, 1, 666}},
        {{250, 1, 500, 249}, {1, 1, 1, 997}, {300, 299, 400, 1}}};
    if (ranks <= 4) return splits[ranks][static_cast<std::size_t>(variant % 3)];
  }
  // Any other P: one single-row shard, the rest uneven.
  std::vector<std::int64_t> rows(static_cast<std::size_t>(ranks));
  const int single = variant % ranks;
  const std::int64_t rest = vocab - 1;
  std::int64_t assigned = 0, weight_total = 0;
  for (int r = 0; r < ranks; ++r)
    if (r != single) weight_total += r + 2;
  for (int r = 0; r < ranks; ++r) {
    if (r == single) {
      rows[static_cast<std::size_t>(r)] = 1;
      continue;
    }
    rows[static_cast<std::size_t>(r)] = std::max<std::int64_t>(1, rest * (r + 2) / weight_total);
    assigned += rows[static_cast<std::size_t>(r)];
  }
  const int last = single == ranks - 1 ? ranks - 2 : ranks - 1;
  rows[static_cast<std::size_t>(last)] += rest - assigned;
  return rows;
}

struct case_config {
  std::string name;
  std::int64_t n_tokens = 0;
  std::int64_t hidden = 0;
  std::vector<std::int64_t> shard_rows;  // V_r per rank, in rank order
  std::int64_t chunk_tokens = 0;         // 0: the default chunk policy (budget_chunk)
  std::size_t workspace_limit_bytes = 0;  // 0: lce's default
  bool sequence_parallel = false;
  float temperature = 0.8f;
  float softcap = 0.0f;
  bool overwrite_weight_gradients = false;  // grad_weight starts as NaN on the ranks, zero in the reference
  std::uint64_t seed = 1;

  std::int64_t vocab() const { return std::accumulate(shard_rows.begin(), shard_rows.end(), std::int64_t{0}); }
  std::int64_t vocab_start(int rank) const {
    return std::accumulate(shard_rows.begin(), shard_rows.begin() + rank, std::int64_t{0});
  }
  std::string describe(int rank, int ranks, const char* type) const {
    std::ostringstream os;
    os << name << " [T=" << type << ", rank " << rank << "/" << ranks << ", N=" << n_tokens << ", H=" << hidden
       << ", V split";
    for (auto v : shard_rows) os << " " << v;
    os << ", chunk_tokens " << chunk_tokens;
    if (workspace_limit_bytes > 0) os << ", workspace_limit_bytes " << workspace_limit_bytes;
    os << (sequence_parallel ? ", sequence parallel" : "")
       << ", temperature " << temperature << ", softcap " << softcap << "]";
    return os.str();
  }
};

// The configurations for a group of P ranks: {plain, sequence parallel} x {softcap 0, 7}.
// Plain: N = 37 tokens in chunks of 8 (the last one short). Sequence parallel:
// N = 11 P (11 rows per rank) with chunk_tokens = 4 P + 1 (not a multiple of P),
// i.e. local chunks of 4, 4, 3.
inline std::vector<case_config> configurations(int ranks) {
  std::vector<case_config> all;
  int variant = 0;
  for (bool sp : {false, true}) {
    for (float cap : {0.0f, 7.0f}) {
      case_config c;
      c.name = std::string(sp ? "sequence parallel" : "vocabulary parallel") + (cap > 0 ? ", softcap 7" : "");
      c.hidden = 24;
      c.shard_rows = vocab_split(1000, ranks, variant);
      c.sequence_parallel = sp;
      c.n_tokens = sp ? 11 * ranks : 37;
      c.chunk_tokens = sp ? 4 * ranks + 1 : 8;
      c.temperature = 0.8f;
      c.softcap = cap;
      c.seed = 1000 + static_cast<std::uint64_t>(variant);
      all.push_back(c);
      ++variant;
    }
  }
  // Gradients written over (options.overwrite_weight_gradients), both layouts: the ranks'
  // grad_weight starts as NaN, the single-rank reference's at zero.
  for (const case_config& base : std::vector<case_config>(all.begin(), all.end())) {
    if (base.softcap > 0) continue;
    case_config c = base;
    c.name += ", gradients written over";
    c.overwrite_weight_gradients = true;
    c.seed += 100;
    all.push_back(c);
  }
  return all;
}

// The full problem, identical on every rank.
template <class T>
struct problem {
  std::int64_t n = 0, h = 0, v = 0;
  std::vector<T> x;                 // [n, h]
  std::vector<T> w;                 // [v, h]
  std::vector<std::int64_t> y;      // [n], global ids or ignore_index
  std::vector<double> g, e;         // dL/dlogprobs, dL/dentropy
  std::vector<double> weight_grad;  // initial grad_weight [v, h] (gradients accumulate into it)
};

template <class T>
problem<T> make_problem(const case_config& c, std::int64_t ignore_index = -100) {
  problem<T> p;
  p.n = c.n_tokens;
  p.h = c.hidden;
  p.v = c.vocab();
  const auto n = static_cast<std::size_t>(p.n), h = static_cast<std::size_t>(p.h), v = static_cast<std::size_t>(p.v);
  p.x.resize(n * h);
  p.w.resize(v * h);
  p.weight_grad.resize(v * h);
  // Logits of a few units (|z| up to about 8 after the temperature), so that
  // softcap 7 bends them and the softmax is far from uniform.
  for (std::size_t k = 0; k < n * h; ++k) p.x[k] = from_double<T>(uniform(c.seed, k));
  for (std::size_t k = 0; k < v * h; ++k) p.w[k] = from_double<T>(uniform(c.seed + 1, k));
  for (std::size_t k = 0; k < v * h; ++k) p.weight_grad[k] = 0.25 * uniform(c.seed + 2, k);
  p.y.resize(n);
  for (std::size_t i = 0; i < n; ++i) p.y[i] = static_cast<std::int64_t>(mix(c.seed * 31 + i) % v);
  // Targets in every shard, at both ends of it (a single-row shard's one id included).
  for (std::size_t r = 0; r < c.shard_rows.size() && 2 * r + 1 < n; ++r) {
    p.y[2 * r] = c.vocab_start(static_cast<int>(r));
    p.y[2 * r + 1] = c.vocab_start(static_cast<int>(r)) + c.shard_rows[r] - 1;
  }
  // Some ignored tokens.
  for (std::size_t i = 3; i < n; i += 7) p.y[i] = ignore_index;
  p.g.resize(n);
  p.e.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    p.g[i] = uniform(c.seed + 3, i);
    p.e[i] = 0.5 * uniform(c.seed + 4, i);
  }
  if (n > 5) p.g[5] = 0.0;  // a token with no log-prob gradient (but an entropy one)
  return p;
}

template <class E>
std::vector<E> converted(const std::vector<double>& values, std::size_t first = 0, std::size_t count = SIZE_MAX) {
  count = std::min(count, values.size() - first);
  std::vector<E> out(count);
  for (std::size_t k = 0; k < count; ++k) out[k] = from_double<E>(values[first + k]);
  return out;
}

template <class E>
std::vector<E> rows_of(const std::vector<E>& matrix, std::int64_t cols, std::int64_t first, std::int64_t count) {
  return std::vector<E>(matrix.begin() + first * cols, matrix.begin() + (first + count) * cols);
}

// Everything one exercise of an op produces.
template <class T>
struct results {
  using R = typename io_types<T>::result;
  using GX = typename io_types<T>::grad_hidden;
  using GW = typename io_types<T>::grad_weight;
  std::vector<R> logprobs, lse, entropy;      // forward with entropy
  std::vector<R> logprobs_plain, lse_plain;   // forward without entropy
  std::vector<GX> dx;                         // backward without grad_entropy
  std::vector<GW> dw;
  std::vector<GX> dx_entropy;                 // backward with grad_entropy
  std::vector<GW> dw_entropy;
  std::vector<R> logprobs_fused;              // forward_backward
  std::vector<GX> dx_fused;
  std::vector<GW> dw_fused;
};

// Runs forward (with and without entropy), backward (without and with
// grad_entropy) and forward_backward, in that order, on `op`. Outputs start as
// NaN (they must be overwritten) except grad_weight, which starts at the
// problem's initial gradient (it is accumulated into). `after(kind, first)` runs
// after each call.
template <class T, class I, class Op, class After>
results<T> exercise(Op& op, std::int64_t h, const std::vector<T>& hidden, std::int64_t hidden_rows,
                    const std::vector<T>& weight, std::int64_t weight_rows, const std::vector<I>& targets,
                    const std::vector<double>& g, const std::vector<double>& e,
                    const std::vector<double>& weight_grad_initial, After&& after) {
  using Res = results<T>;
  using R = typename Res::R;
  using GX = typename Res::GX;
  using GW = typename Res::GW;
  const auto n = static_cast<std::int64_t>(targets.size());
  const auto sn = static_cast<std::size_t>(n);
  const auto x_elems = static_cast<std::size_t>(hidden_rows * h);
  Res out;
  out.logprobs.assign(sn, not_a_number<R>());
  out.lse.assign(sn, not_a_number<R>());
  out.entropy.assign(sn, not_a_number<R>());
  out.logprobs_plain.assign(sn, not_a_number<R>());
  out.lse_plain.assign(sn, not_a_number<R>());
  out.logprobs_fused.assign(sn, not_a_number<R>());
  out.dx.assign(x_elems, not_a_number<GX>());
  out.dx_entropy.assign(x_elems, not_a_number<GX>());
  out.dx_fused.assign(x_elems, not_a_number<GX>());
  out.dw = converted<GW>(weight_grad_initial);
  out.dw_entropy = out.dw;
  out.dw_fused = out.dw;
  const std::vector<R> grad_logprobs = converted<R>(g), grad_entropy = converted<R>(e);

  const lce::matrix_view<const T> X{hidden.data(), hidden_rows, h};
  const lce::matrix_view<const T> W{weight.data(), weight_rows, h};
  const lce::vector_view<const I> Y{targets.data(), n};
  const auto vec = [n](std::vector<R>& v) { return lce::vector_view<R>{v.data(), n}; };
  const auto cvec = [n](const std::vector<R>& v) { return lce::vector_view<const R>{v.data(), n}; };
  const auto dx_view = [&](std::vector<GX>& m) { return lce::matrix_view<GX>{m.data(), hidden_rows, h}; };
  const auto dw_view = [&](std::vector<GW>& m) { return lce::matrix_view<GW>{m.data(), weight_rows, h}; };

  op.forward(X, W, Y, vec(out.logprobs), vec(out.lse), vec(out.entropy));
  after(call_kind::forward, true);
  op.forward(X, W, Y, vec(out.logprobs_plain), vec(out.lse_plain));
  after(call_kind::forward, false);
  op.backward(X, W, Y, cvec(out.lse), cvec(grad_logprobs), dx_view(out.dx), dw_view(out.dw));
  after(call_kind::backward, false);
  op.backward(X, W, Y, cvec(out.lse), cvec(grad_logprobs), cvec(grad_entropy), dx_view(out.dx_entropy),
              dw_view(out.dw_entropy));
  after(call_kind::backward_with_entropy, false);
  op.forward_backward(X, W, Y, cvec(grad_logprobs), vec(out.logprobs_fused), dx_view(out.dx_fused),
                      dw_view(out.dw_fused));
  after(call_kind::forward_backward, false);
  return out;
}

// ===========================================================================
// The main body: the distributed op against a single-rank run, with the
// collectives it issues counted.
// ===========================================================================

template <class T, class I, class Comm>
void check_against_single_rank(const Comm& comm, const case_config& cfg) {
  using GX = typename io_types<T>::grad_hidden;
  using GW = typename io_types<T>::grad_weight;
  using A = lce::compute_t<T>;
  const int ranks = comm.size(), rank = comm.rank();
  const std::string where = cfg.describe(rank, ranks, type_name<T>()) + " targets " + type_name<I>();
  // Every rank sees the same configuration, so these leave on every rank alike.
  if (static_cast<int>(cfg.shard_rows.size()) != ranks || (cfg.sequence_parallel && cfg.n_tokens % ranks != 0)) {
    FAIL_CHECK("configuration does not fit " << ranks << " ranks: " << where);
    return;
  }

  const problem<T> p = make_problem<T>(cfg);
  std::vector<I> targets(p.y.begin(), p.y.end());
  const std::int64_t h = p.h, n = p.n;
  const std::int64_t v0 = cfg.vocab_start(rank), vr = cfg.shard_rows[static_cast<std::size_t>(rank)];
  const std::int64_t local_rows = cfg.sequence_parallel ? n / ranks : n;
  const std::int64_t row0 = cfg.sequence_parallel ? rank * local_rows : 0;

  // The single-rank reference: the full weight, all hidden rows.
  lce::options reference_options;
  reference_options.temperature = cfg.temperature;
  reference_options.softcap = cfg.softcap;
  reference_options.chunk_tokens = cfg.chunk_tokens;
  if (cfg.workspace_limit_bytes > 0) reference_options.workspace_limit_bytes = cfg.workspace_limit_bytes;
  lce::ChunkedHiddenToLogprobs<lce::comm::single, T, lce::budget_chunk, lce::host> reference(
      lce::comm::single{}, reference_options, lce::host{1});
  const std::vector<double> zeros(p.weight_grad.size(), 0.0);
  const results<T> want = exercise<T, I>(reference, h, p.x, n, p.w, p.v, targets, p.g, p.e,
                                         cfg.overwrite_weight_gradients ? zeros : p.weight_grad, [](call_kind, bool) {});

  // This rank's shard (and rows), copied so that reading past them is caught by sanitizers.
  const std::vector<T> weight = rows_of(p.w, h, v0, vr);
  const std::vector<T> hidden = rows_of(p.x, h, row0, local_rows);
  const std::vector<double> weight_grad =
      cfg.overwrite_weight_gradients
          ? std::vector<double>(static_cast<std::size_t>(vr * h), std::numeric_limits<double>::quiet_NaN())
          : rows_of(p.weight_grad, h, v0, vr);

  lce::options options = reference_options;
  options.vocab_start = v0;
  options.sequence_parallel = cfg.sequence_parallel;
  options.overwrite_weight_gradients = cfg.overwrite_weight_gradients;
  collective_counts counts;
  lce::ChunkedHiddenToLogprobs<counting<Comm>, T, lce::budget_chunk, lce::host> op(counting<Comm>(comm, &counts),
                                                                                      options, lce::host{1});

  call_shape shape;
  shape.ranks = ranks;
  shape.n_tokens = n;
  shape.hidden = h;
  shape.chunk_tokens = cfg.chunk_tokens;
  shape.sequence_parallel = cfg.sequence_parallel;
  shape.compute_bytes = sizeof(A);
  shape.storage_bytes = sizeof(T);
  collective_counts before = counts;
  const results<T> got = exercise<T, I>(op, h, hidden, local_rows, weight, vr, targets, p.g, p.e, weight_grad,
                                        [&](call_kind kind, bool first) {
                                          // With the default chunk policy the chunk is the library's
                                          // choice; only the sameness across ranks is checked (below).
                                          if (cfg.chunk_tokens == 0) return;
                                          const collective_counts issued = counts - before;
                                          const collective_counts expected =
                                              expected_collectives(kind, shape, first);
                                          CHECK_MESSAGE(issued == expected, where << ": " << name_of(kind)
                                                                                  << (first ? " (first call)" : "")
                                                                                  << " issued " << issued.str()
                                                                                  << ", expected "
                                                                                  << expected.str());
                                          before = counts;
                                        });

  // Every rank issued the same collectives (a test-side exchange, not counted).
  {
    const std::int64_t mine[9] = {counts.all_gather_bytes, counts.all_reduce_sum,  counts.reduce_scatter_sum,
                                  counts.all_agree,        counts.all_gather_host, counts.gathered_bytes,
                                  counts.reduced_bytes,    counts.scattered_bytes, counts.host_values};
    std::vector<std::int64_t> all(static_cast<std::size_t>(9 * ranks));
    comm.all_gather_host(mine, all.data(), 9);
    for (int r = 0; r < ranks; ++r) {
      const std::int64_t* theirs = all.data() + 9 * r;
      const bool same = std::equal(mine, mine + 9, theirs);
      CHECK_MESSAGE(same, where << ": rank " << r << " issued other collectives than this rank " << counts.str());
    }
  }

  const double rel = relative_tolerance<T>();
  constexpr bool dx_rounds = !std::is_floating_point_v<GX>;
  constexpr bool dw_rounds = !std::is_floating_point_v<GW>;
  const auto check = [&](const char* what, const comparison& c, std::int64_t count) {
    report_margin(where, what, c);
    CHECK_MESSAGE(c.ok, where << ": " << c.describe(what, count));
  };
  // Every rank has the per-token results of all N tokens.
  check("logprobs", compare<T>(got.logprobs, want.logprobs, 0, n, rel), n);
  check("lse", compare<T>(got.lse, want.lse, 0, n, rel), n);
  check("entropy", compare<T>(got.entropy, want.entropy, 0, n, rel), n);
  check("logprobs (forward without entropy)", compare<T>(got.logprobs_plain, want.logprobs_plain, 0, n, rel), n);
  check("lse (forward without entropy)", compare<T>(got.lse_plain, want.lse_plain, 0, n, rel), n);
  check("logprobs (forward_backward)", compare<T>(got.logprobs_fused, want.logprobs_fused, 0, n, rel), n);
  // dX: this rank's rows of the full gradient (all rows without sequence parallelism).
  const std::int64_t x_elems = local_rows * h, x_first = row0 * h;
  check("grad_hidden (backward)", compare<GX>(got.dx, want.dx, x_first, x_elems, rel, dx_rounds), x_elems);
  check("grad_hidden (backward with grad_entropy)",
        compare<GX>(got.dx_entropy, want.dx_entropy, x_first, x_elems, rel, dx_rounds), x_elems);
  check("grad_hidden (forward_backward)", compare<GX>(got.dx_fused, want.dx_fused, x_first, x_elems, rel, dx_rounds),
        x_elems);
  // dW_r: this rank's rows of the full weight gradient.
  const std::int64_t w_elems = vr * h, w_first = v0 * h;
  check("grad_weight (backward)", compare<GW>(got.dw, want.dw, w_first, w_elems, rel, dw_rounds), w_elems);
  check("grad_weight (backward with grad_entropy)",
        compare<GW>(got.dw_entropy, want.dw_entropy, w_first, w_elems, rel, dw_rounds), w_elems);
  check("grad_weight (forward_backward)", compare<GW>(got.dw_fused, want.dw_fused, w_first, w_elems, rel, dw_rounds),
        w_elems);
}

// All configurations for this group size, for one element type.
template <class T, class Comm>
void check_all_configurations(const Comm& comm) {
  for (const case_config& cfg : configurations(comm.size())) {
    if (cfg.softcap > 0) check_against_single_rank<T, std::int32_t>(comm, cfg);
    else check_against_single_rank<T, std::int64_t>(comm, cfg);
  }
}

// ===========================================================================
// Bad input on one rank: every rank raises lce::error, nobody hangs, nothing
// is written, and the ranks stay in step for the next call.
// ===========================================================================

using lce_test::error_of;

inline bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

template <class E>
bool all_equal(const std::vector<E>& v, double value) {
  return std::all_of(v.begin(), v.end(), [value](E e) { return to_double(e) == value; });
}

template <class Comm>
void check_bad_input_everywhere(const Comm& comm) {
  using T = float;
  const int ranks = comm.size(), rank = comm.rank();
  case_config cfg;
  cfg.name = "bad input";
  cfg.n_tokens = 13;
  cfg.hidden = 8;
  cfg.shard_rows = vocab_split(1000, ranks, 0);
  cfg.chunk_tokens = 4;
  cfg.seed = 77;
  const problem<T> p = make_problem<T>(cfg);
  const std::int64_t n = p.n, h = p.h, v = p.v;
  const std::int64_t v0 = cfg.vocab_start(rank), vr = cfg.shard_rows[static_cast<std::size_t>(rank)];
  const std::vector<T> weight = rows_of(p.w, h, v0, vr);
  const std::string where = "rank " + std::to_string(rank) + "/" + std::to_string(ranks) + ": ";
  const auto rejected_by = [](int r) { return "rank " + std::to_string(r) + " rejected its arguments"; };

  const auto X = lce::matrix_view<const T>{p.x.data(), n, h};
  const auto W = lce::matrix_view<const T>{weight.data(), vr, h};
  constexpr float untouched = 12345.0f;
  std::vector<float> lp(n, untouched), lse(n, untouched), ent(n, untouched), g(n, -1.0f);
  std::vector<float> dx(static_cast<std::size_t>(n * h), untouched), dw(static_cast<std::size_t>(vr * h), untouched);
  const auto LP = lce::vector_view<float>{lp.data(), n};
  const auto LSE = lce::vector_view<float>{lse.data(), n};
  const auto ENT = lce::vector_view<float>{ent.data(), n};
  const auto G = lce::vector_view<const float>{g.data(), n};
  const auto DX = lce::matrix_view<float>{dx.data(), n, h};
  const auto DW = lce::matrix_view<float>{dw.data(), vr, h};
  const auto nothing_written = [&] {
    return all_equal(lp, untouched) && all_equal(lse, untouched) && all_equal(ent, untouched) &&
           all_equal(dx, untouched) && all_equal(dw, untouched);
  };

  lce::options options;
  options.vocab_start = v0;
  options.chunk_tokens = cfg.chunk_tokens;
  lce::ChunkedHiddenToLogprobs<Comm, T, lce::budget_chunk, lce::host> op(comm, options, lce::host{1});

  // 1. A target outside [0, V) (on every rank: all pass the same targets), on the op's first call.
  {
    std::vector<std::int64_t> y = p.y;
    y[5] = v;
    const std::string message =
        error_of([&] { op.forward(X, W, lce::vector_view<const std::int64_t>{y.data(), n}, LP, LSE, ENT); });
    const std::string expected =
        "targets[5] = " + std::to_string(v) + " is outside the vocabulary [0, " + std::to_string(v) + ")";
    CHECK_MESSAGE(contains(message, expected), where << "first call, target out of range: expected an lce::error "
                                                     << "containing \"" << expected << "\", got \"" << message << "\"");
    CHECK_MESSAGE(nothing_written(), where << "outputs were written before the error");
  }
  // 2. The same op, a later call (shards known): a negative target.
  {
    std::vector<std::int64_t> y = p.y;
    y[2] = -7;
    const std::string message = error_of([&] {
      op.forward_backward(X, W, lce::vector_view<const std::int64_t>{y.data(), n}, G, LP, DX, DW);
    });
    const std::string expected = "targets[2] = -7 is outside the vocabulary";
    CHECK_MESSAGE(contains(message, expected), where << "later call, target -7: expected \"" << expected
                                                     << "\", got \"" << message << "\"");
    CHECK_MESSAGE(nothing_written(), where << "outputs were written before the error");
  }
  // 2b. Valid targets, but rank 0's differ from the others': the hashes disagree.
  if (ranks > 1) {
    std::vector<std::int64_t> y = p.y;
    if (rank == 0) y[3] = (y[3] + 1) % v;
    const std::string message = error_of([&] {
      op.forward_backward(X, W, lce::vector_view<const std::int64_t>{y.data(), n}, G, LP, DX, DW);
    });
    const std::string expected = "targets: the hash of the target ids differs across ranks";
    CHECK_MESSAGE(contains(message, expected), where << "other targets on rank 0: expected \"" << expected
                                                     << "\", got \"" << message << "\"");
    CHECK_MESSAGE(nothing_written(), where << "outputs were written before the error");
  }
  // 3. A shape mismatch on one rank: grad_hidden with one row too few.
  {
    const int bad = ranks > 1 ? 1 : 0;
    const std::int64_t rows = rank == bad ? n - 1 : n;
    const std::vector<std::int64_t>& y = p.y;
    const std::string message = error_of([&] {
      op.backward(X, W, lce::vector_view<const std::int64_t>{y.data(), n}, lce::vector_view<const float>{lse.data(), n},
                  G, lce::matrix_view<float>{dx.data(), rows, h}, DW);
    });
    const std::string expected = rank == bad ? "grad_hidden: shape " + std::to_string(n - 1) : rejected_by(bad);
    CHECK_MESSAGE(contains(message, expected), where << "grad_hidden of the wrong shape on rank " << bad
                                                     << ": expected \"" << expected << "\", got \"" << message
                                                     << "\"");
    CHECK_MESSAGE(nothing_written(), where << "outputs were written before the error");
  }
  // 4. After all that, a good call on the same op: the ranks are still in step.
  {
    const auto Y = lce::vector_view<const std::int64_t>{p.y.data(), n};
    std::fill(dw.begin(), dw.end(), 0.0f);
    const std::string message = error_of([&] { op.forward_backward(X, W, Y, G, LP, DX, DW); });
    CHECK_MESSAGE(message.empty(), where << "a good call after the errors failed: " << message);
    lce::options reference_options = options;
    reference_options.vocab_start = 0;
    lce::ChunkedHiddenToLogprobs<lce::comm::single, T, lce::budget_chunk, lce::host> reference(
        lce::comm::single{}, reference_options, lce::host{1});
    std::vector<float> want(n), want_dx(static_cast<std::size_t>(n * h)), want_dw(static_cast<std::size_t>(v * h), 0.0f);
    reference.forward_backward(X, lce::matrix_view<const T>{p.w.data(), v, h}, Y, G,
                               lce::vector_view<float>{want.data(), n},
                               lce::matrix_view<float>{want_dx.data(), n, h},
                               lce::matrix_view<float>{want_dw.data(), v, h});
    const auto c = compare<T>(lp, want, 0, n, relative_tolerance<T>());
    CHECK_MESSAGE(c.ok, where << "after the errors: " << c.describe("logprobs", n));
    const auto cx = compare<T>(dx, want_dx, 0, n * h, relative_tolerance<T>());
    CHECK_MESSAGE(cx.ok, where << "after the errors: " << cx.describe("grad_hidden", n * h));
    const auto cw = compare<T>(dw, want_dw, v0 * h, vr * h, relative_tolerance<T>());
    CHECK_MESSAGE(cw.ok, where << "after the errors: " << cw.describe("grad_weight", vr * h));
  }

  // 5. Shards that do not tile [0, V): each rank's own shard is fine, so only
  // the exchange can tell. Every rank raises the same error.
  const auto tiling_case = [&](const char* what, int bad_rank, std::int64_t shift, std::int64_t bad_rows,
                               const std::string& expected) {
    lce::options o = options;
    std::int64_t rows = vr;
    if (rank == bad_rank) {
      o.vocab_start += shift;
      rows = bad_rows;
    }
    lce::ChunkedHiddenToLogprobs<Comm, T, lce::budget_chunk, lce::host> tiled(comm, o, lce::host{1});
    const std::vector<T> w = rows_of(p.w, h, std::min(o.vocab_start, v - rows), rows);
    std::vector<float> out(n, untouched), out_lse(n, untouched);
    const std::string message = error_of([&] {
      tiled.forward(X, lce::matrix_view<const T>{w.data(), rows, h},
                    lce::vector_view<const std::int64_t>{p.y.data(), n}, lce::vector_view<float>{out.data(), n},
                    lce::vector_view<float>{out_lse.data(), n});
    });
    CHECK_MESSAGE(contains(message, expected),
                  where << what << ": expected \"" << expected << "\", got \"" << message << "\"");
    CHECK_MESSAGE((all_equal(out, untouched) && all_equal(out_lse, untouched)),
                  where << what << ": outputs were written before the error");
  };
  if (ranks == 1) {
    tiling_case("vocab_start 1 on a single rank", 0, 1, vr, "on a single rank");
  } else {
    const std::int64_t start1 = cfg.vocab_start(1);
    tiling_case("a gap before rank 1's shard", 1, 1, cfg.shard_rows[1] - (cfg.shard_rows[1] > 1 ? 1 : 0),
                "vocab_start = " + std::to_string(start1 + 1) + " on rank 1");
    tiling_case("rank 0 not starting at 0", 0, 1, vr, "vocab_start = 1 on rank 0");
    const int last = ranks - 1;
    const std::int64_t start_last = cfg.vocab_start(last);
    if (start_last > 0)
      tiling_case("the last shard overlapping the one before", last, -1, cfg.shard_rows[static_cast<std::size_t>(last)],
                  "vocab_start = " + std::to_string(start_last - 1) + " on rank " + std::to_string(last) +
                      " (" + std::to_string(cfg.shard_rows[static_cast<std::size_t>(last)]) +
                      " rows), but the shards must tile the vocabulary in rank order: expected " +
                      std::to_string(start_last));
  }

  // 6. An empty shard on the last rank.
  {
    lce::ChunkedHiddenToLogprobs<Comm, T, lce::budget_chunk, lce::host> fresh(comm, options, lce::host{1});
    const std::int64_t rows = rank == ranks - 1 ? 0 : vr;
    std::vector<float> out(n, untouched), out_lse(n, untouched);
    const std::string message = error_of([&] {
      fresh.forward(X, lce::matrix_view<const T>{weight.data(), rows, h},
                    lce::vector_view<const std::int64_t>{p.y.data(), n}, lce::vector_view<float>{out.data(), n},
                    lce::vector_view<float>{out_lse.data(), n});
    });
    const std::string expected =
        rank == ranks - 1 ? "weight: this rank's vocabulary shard is empty" : rejected_by(ranks - 1);
    CHECK_MESSAGE(contains(message, expected), where << "empty shard on rank " << ranks - 1 << ": expected \""
                                                     << expected << "\", got \"" << message << "\"");
  }

  // 7. Sequence parallel: one rank holds one hidden row too many.
  if (ranks > 1) {
    lce::options o = options;
    o.sequence_parallel = true;
    lce::ChunkedHiddenToLogprobs<Comm, T, lce::budget_chunk, lce::host> sp(comm, o, lce::host{1});
    const std::int64_t total = 3 * ranks, local = rank == 0 ? 4 : 3;
    std::vector<std::int64_t> y(p.y.begin(), p.y.begin() + total);
    std::vector<float> out(total, untouched), out_lse(total, untouched);
    const std::string message = error_of([&] {
      sp.forward(lce::matrix_view<const T>{p.x.data(), local, h}, W,
                 lce::vector_view<const std::int64_t>{y.data(), total}, lce::vector_view<float>{out.data(), total},
                 lce::vector_view<float>{out_lse.data(), total});
    });
    const std::string expected = rank == 0 ? "targets: size " + std::to_string(total) + " is not ranks (" +
                                                 std::to_string(ranks) + ") x the 4 rows of hidden"
                                           : rejected_by(0);
    CHECK_MESSAGE(contains(message, expected), where << "sequence parallel, 4 hidden rows on rank 0: expected \""
                                                     << expected << "\", got \"" << message << "\"");
  }
}

// When the last rank's shard grows by one row on a later call, every rank
// re-checks the tiling (within the call's one exchange), the new id becomes a valid target, and results match a
// single-rank run over the grown vocabulary.
template <class Comm>
void check_shard_change(const Comm& comm) {
  using T = double;
  const int ranks = comm.size(), rank = comm.rank();
  case_config cfg;
  cfg.name = "shard change";
  cfg.n_tokens = 9;
  cfg.hidden = 6;
  cfg.shard_rows = vocab_split(1000, ranks, 1);
  cfg.shard_rows.back() += 1;  // the grown vocabulary, 1001 ids
  cfg.chunk_tokens = 4;
  cfg.seed = 91;
  problem<T> p = make_problem<T>(cfg);
  const std::int64_t n = p.n, h = p.h, v = p.v;  // v = 1001
  p.y[4] = v - 1;                                 // the new id
  const std::int64_t v0 = cfg.vocab_start(rank), vr = cfg.shard_rows[static_cast<std::size_t>(rank)];
  const std::int64_t vr_before = rank == ranks - 1 ? vr - 1 : vr;
  const std::vector<T> weight = rows_of(p.w, h, v0, vr);
  const std::string where = "rank " + std::to_string(rank) + "/" + std::to_string(ranks) + ", shard change: ";

  lce::options options;
  options.vocab_start = v0;
  options.chunk_tokens = cfg.chunk_tokens;
  collective_counts counts;
  lce::ChunkedHiddenToLogprobs<counting<Comm>, T, lce::budget_chunk, lce::host> op(counting<Comm>(comm, &counts),
                                                                                      options, lce::host{1});
  std::vector<double> lp(n), lse(n);
  const auto X = lce::matrix_view<const T>{p.x.data(), n, h};
  const auto LP = lce::vector_view<double>{lp.data(), n};
  const auto LSE = lce::vector_view<double>{lse.data(), n};
  call_shape shape{ranks, n, h, cfg.chunk_tokens, false, sizeof(double), sizeof(double)};

  // 1000 ids: id 1000 is not a target yet.
  std::vector<std::int64_t> y_before = p.y;
  for (auto& t : y_before)
    if (t >= v - 1) t = 7;
  op.forward(X, lce::matrix_view<const T>{weight.data(), vr_before, h},
             lce::vector_view<const std::int64_t>{y_before.data(), n}, LP, LSE);
  collective_counts mark = counts;
  CHECK_MESSAGE(counts == expected_collectives(call_kind::forward, shape, true),
                where << "first call issued " << counts.str());
  op.forward(X, lce::matrix_view<const T>{weight.data(), vr_before, h},
             lce::vector_view<const std::int64_t>{y_before.data(), n}, LP, LSE);
  CHECK_MESSAGE(counts - mark == expected_collectives(call_kind::forward, shape, false),
                where << "second call issued " << (counts - mark).str());
  mark = counts;

  // The last shard grows: a full re-check on every rank.
  const std::string message = error_of([&] {
    op.forward(X, lce::matrix_view<const T>{weight.data(), vr, h}, lce::vector_view<const std::int64_t>{p.y.data(), n},
               LP, LSE);
  });
  CHECK_MESSAGE(message.empty(), where << "the grown vocabulary was rejected: " << message);
  CHECK_MESSAGE(counts - mark == expected_collectives(call_kind::forward, shape, true),
                where << "call after the shard change issued " << (counts - mark).str());

  lce::options reference_options;
  reference_options.chunk_tokens = cfg.chunk_tokens;
  lce::ChunkedHiddenToLogprobs<lce::comm::single, T, lce::budget_chunk, lce::host> reference(
      lce::comm::single{}, reference_options, lce::host{1});
  std::vector<double> want(n), want_lse(n);
  reference.forward(X, lce::matrix_view<const T>{p.w.data(), v, h}, lce::vector_view<const std::int64_t>{p.y.data(), n},
                    lce::vector_view<double>{want.data(), n}, lce::vector_view<double>{want_lse.data(), n});
  if (message.empty()) {
    const auto c = compare<double>(lp, want, 0, n, relative_tolerance<double>());
    CHECK_MESSAGE(c.ok, where << c.describe("logprobs over the grown vocabulary", n));
  }
}

// ===========================================================================
// Context parallel: tokens split across ranks, each rank runs the op with
// comm::single on its tokens and the full weight; the mean NLL divides by
// the global count of non-ignored tokens.
// ===========================================================================

template <class T, class Comm>
void check_context_parallel(const Comm& comm) {
  using R = typename io_types<T>::result;
  const int ranks = comm.size(), rank = comm.rank();
  case_config cfg;
  cfg.name = "context parallel";
  cfg.n_tokens = 50;
  cfg.hidden = 16;
  cfg.shard_rows = {1000};
  cfg.seed = 4242;
  const problem<T> p = make_problem<T>(cfg);
  const std::int64_t n = p.n, h = p.h, v = p.v;
  // Uneven token split: rank r gets [first, first + count).
  const std::int64_t first = n * rank / ranks + (rank > 0 ? 1 : 0);
  const std::int64_t end = rank == ranks - 1 ? n : n * (rank + 1) / ranks + 1;
  const std::int64_t count = end - first;
  const std::string where = std::string("context parallel [T=") + type_name<T>() + ", rank " + std::to_string(rank) +
                            "/" + std::to_string(ranks) + ", tokens " + std::to_string(first) + ".." +
                            std::to_string(end) + "]: ";

  const std::vector<std::int64_t> y(p.y.begin() + first, p.y.begin() + end);
  std::int64_t total = 0;
  for (std::int64_t t : p.y) total += t != -100;
  const std::int64_t local = lce::count_tokens(lce::vector_view<const std::int64_t>{y.data(), count});
  std::int64_t local_direct = 0;
  for (std::int64_t t : y) local_direct += t != -100;
  CHECK_MESSAGE(local == local_direct, where << "count_tokens " << local << ", counted " << local_direct);
  const std::int64_t global = lce::global_token_count(comm, lce::vector_view<const std::int64_t>{y.data(), count});
  CHECK_MESSAGE(global == total, where << "global_token_count " << global << ", want " << total);
  CHECK_MESSAGE(lce::global_token_count(comm, local) == total, where << "global_token_count(comm, local count)");
  // With ignore_index = 0, every token whose target is not 0 counts (-100 included).
  std::int64_t zeros = 0;
  for (std::int64_t t : p.y) zeros += t != 0;
  CHECK(lce::global_token_count(comm, lce::vector_view<const std::int64_t>{y.data(), count}, 0) == zeros);

  // Mean NLL over the whole group: dL/dlogp_i = -1 / global count.
  const double scale = -1.0 / static_cast<double>(global);
  std::vector<R> g(static_cast<std::size_t>(n), static_cast<R>(scale));
  lce::options options;
  options.chunk_tokens = 6;  // chunk boundaries differ between the split and the whole
  lce::ChunkedHiddenToLogprobs<lce::comm::single, T, lce::budget_chunk, lce::host> op(lce::comm::single{}, options,
                                                                                      lce::host{1});
  const auto W = lce::matrix_view<const T>{p.w.data(), v, h};

  // Whole sequence, one rank.
  std::vector<R> want_lp(n), want_lse(n), want_ent(n), want_fused(n), want_dx(static_cast<std::size_t>(n * h)),
      want_dw(static_cast<std::size_t>(v * h), R(0));
  const auto Y_all = lce::vector_view<const std::int64_t>{p.y.data(), n};
  op.forward(lce::matrix_view<const T>{p.x.data(), n, h}, W, Y_all, lce::vector_view<R>{want_lp.data(), n},
             lce::vector_view<R>{want_lse.data(), n}, lce::vector_view<R>{want_ent.data(), n});
  op.forward_backward(lce::matrix_view<const T>{p.x.data(), n, h}, W, Y_all, lce::vector_view<const R>{g.data(), n},
                      lce::vector_view<R>{want_fused.data(), n}, lce::matrix_view<R>{want_dx.data(), n, h},
                      lce::matrix_view<R>{want_dw.data(), v, h});

  // This rank's tokens.
  const std::vector<T> x = rows_of(p.x, h, first, count);
  std::vector<R> lp(count), lse(count), ent(count), fused(count), dx(static_cast<std::size_t>(count * h)),
      dw(static_cast<std::size_t>(v * h), R(0));
  const auto X = lce::matrix_view<const T>{x.data(), count, h};
  const auto Y = lce::vector_view<const std::int64_t>{y.data(), count};
  op.forward(X, W, Y, lce::vector_view<R>{lp.data(), count}, lce::vector_view<R>{lse.data(), count},
             lce::vector_view<R>{ent.data(), count});
  op.forward_backward(X, W, Y, lce::vector_view<const R>{g.data(), count}, lce::vector_view<R>{fused.data(), count},
                      lce::matrix_view<R>{dx.data(), count, h}, lce::matrix_view<R>{dw.data(), v, h});

  const double rel = relative_tolerance<T>();
  const auto check = [&](const char* what, const comparison& c, std::int64_t elems) {
    report_margin(where, what, c);
    CHECK_MESSAGE(c.ok, where << c.describe(what, elems));
  };
  check("logprobs", compare<T>(lp, want_lp, first, count, rel), count);
  check("lse", compare<T>(lse, want_lse, first, count, rel), count);
  check("entropy", compare<T>(ent, want_ent, first, count, rel), count);
  check("logprobs (forward_backward)", compare<T>(fused, want_fused, first, count, rel), count);
  check("grad_hidden", compare<T>(dx, want_dx, first * h, count * h, rel), count * h);

  // The loss and dW summed over the group equal the whole-sequence ones.
  std::vector<double> sums(static_cast<std::size_t>(v * h) + 1);
  for (std::size_t k = 0; k < dw.size(); ++k) sums[k] = static_cast<double>(dw[k]);
  double local_loss = 0.0;
  for (std::int64_t i = 0; i < count; ++i) local_loss += scale * static_cast<double>(fused[static_cast<std::size_t>(i)]);
  sums.back() = local_loss;
  comm.all_reduce_sum(sums.data(), static_cast<std::int64_t>(sums.size()));
  double want_loss = 0.0;
  for (std::int64_t i = 0; i < n; ++i) want_loss += scale * static_cast<double>(want_fused[static_cast<std::size_t>(i)]);
  const std::vector<double> loss{sums.back()}, loss_want{want_loss};
  check("mean NLL over the group", compare<double>(loss, loss_want, 0, 1, rel), 1);
  sums.pop_back();
  check("grad_weight summed over the group", compare<T>(sums, want_dw, 0, v * h, rel), v * h);
}

// ===========================================================================
// Agreement across ranks. These two bodies are run as their own tests
// (ctest entries *_agreement*), because a library that gets them wrong makes
// the ranks hang or abort (MPI_ERR_TRUNCATE) rather than fail an assertion.
// ===========================================================================

// The default chunk policy sizes the chunk from the workspace budget and the
// shard; with uneven shards every rank must still sweep the same chunks.
// (Correct input: the API allows uneven shards and chunk_tokens = 0.)
inline std::vector<case_config> budget_configurations(int ranks) {
  std::vector<case_config> all;
  int variant = 0;
  for (bool sp : {false, true}) {
    case_config c;
    c.name = std::string(sp ? "sequence parallel" : "vocabulary parallel") + ", default chunk policy, small budget";
    c.hidden = 32;
    c.shard_rows = vocab_split(1000, ranks, variant);
    c.sequence_parallel = sp;
    c.n_tokens = 600;                          // divisible by 1, 2, 3, 4
    c.chunk_tokens = 0;                        // lce::budget_chunk decides
    c.workspace_limit_bytes = std::size_t{256} << 10;  // a few dozen to a few hundred rows, by shard
    c.softcap = sp ? 7.0f : 0.0f;
    c.seed = 2000 + static_cast<std::uint64_t>(variant);
    all.push_back(c);
    ++variant;
  }
  return all;
}

template <class T, class Comm>
void check_budget_chunk_uneven_shards(const Comm& comm) {
  for (const case_config& cfg : budget_configurations(comm.size()))
    check_against_single_rank<T, std::int64_t>(comm, cfg);
}

// Ranks whose arguments are each fine on their own but disagree with each
// other (another number of tokens, another hidden size) are bad input too:
// every rank must raise lce::error rather than enter collectives of
// different sizes.
template <class Comm>
void check_ranks_disagree(const Comm& comm) {
  using T = float;
  const int ranks = comm.size(), rank = comm.rank();
  if (ranks == 1) return;
  case_config cfg;
  cfg.name = "disagreeing ranks";
  cfg.n_tokens = 40;
  cfg.hidden = 8;
  cfg.shard_rows = vocab_split(1000, ranks, 2);
  cfg.chunk_tokens = 4;
  cfg.seed = 5;
  const problem<T> p = make_problem<T>(cfg);
  const std::int64_t v0 = cfg.vocab_start(rank), vr = cfg.shard_rows[static_cast<std::size_t>(rank)];
  const std::string where = "rank " + std::to_string(rank) + "/" + std::to_string(ranks) + ": ";
  lce::options options;
  options.vocab_start = v0;
  options.chunk_tokens = cfg.chunk_tokens;

  const auto attempt = [&](const char* what, std::int64_t n, std::int64_t h) {
    lce::ChunkedHiddenToLogprobs<Comm, T, lce::budget_chunk, lce::host> op(comm, options, lce::host{1});
    std::vector<T> x(static_cast<std::size_t>(n * h), 0.5f), w(static_cast<std::size_t>(vr * h), 0.25f);
    std::vector<std::int64_t> y(p.y.begin(), p.y.begin() + n);
    std::vector<float> lp(n), lse(n);
    const std::string message = error_of([&] {
      op.forward(lce::matrix_view<const T>{x.data(), n, h}, lce::matrix_view<const T>{w.data(), vr, h},
                 lce::vector_view<const std::int64_t>{y.data(), n}, lce::vector_view<float>{lp.data(), n},
                 lce::vector_view<float>{lse.data(), n});
    });
    CHECK_MESSAGE((!message.empty() && !contains(message, "NOT AN lce::error")),
                  where << what << ": expected lce::error on every rank, got \"" << message << "\"");
  };
  attempt("rank 0 has 4 tokens more than the others (40 vs 36; 10 vs 9 chunks)", rank == 0 ? 40 : 36, 8);
  attempt("the last rank has hidden size 16, the others 8", 12, rank == ranks - 1 ? 16 : 8);
}

// ===========================================================================
// Running P ranks as threads of this process.
// ===========================================================================

// Runs body(lce::comm::threads) on `ranks` threads. A rank that has not
// finished after `limit` is reported and the process exits: a hang becomes a
// failure with a message instead of a stuck test.
template <class Body>
void run_on_threads(int ranks, Body&& body, std::chrono::seconds limit = std::chrono::seconds(300)) {
  lce::comm::thread_group group(ranks);
  std::mutex mutex;
  std::condition_variable finished;
  int done = 0;
  std::vector<std::string> escaped(static_cast<std::size_t>(ranks));
  std::vector<char> rank_done(static_cast<std::size_t>(ranks), 0);
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      try {
        body(lce::comm::threads{group, r});
      } catch (const std::exception& e) {
        escaped[static_cast<std::size_t>(r)] = e.what();
      } catch (...) {
        escaped[static_cast<std::size_t>(r)] = "a non-std exception";
      }
      std::lock_guard lock(mutex);
      ++done;
      rank_done[static_cast<std::size_t>(r)] = 1;
      finished.notify_all();
    });
  }
  {
    std::unique_lock lock(mutex);
    if (!finished.wait_for(lock, limit, [&] { return done == ranks; })) {
      std::fprintf(stderr, "\nFATAL: ranks still running after %lld s (a hang in a collective?):",
                   static_cast<long long>(limit.count()));
      for (int r = 0; r < ranks; ++r)
        if (!rank_done[static_cast<std::size_t>(r)]) std::fprintf(stderr, " %d", r);
      std::fprintf(stderr, " of %d\n", ranks);
      std::fflush(stderr);
      std::_Exit(3);
    }
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < ranks; ++r)
    CHECK_MESSAGE(escaped[static_cast<std::size_t>(r)].empty(),
                  "rank " << r << "/" << ranks << " threw: " << escaped[static_cast<std::size_t>(r)]);
}

}  // namespace lce_dist
