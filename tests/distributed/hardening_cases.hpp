// Distributed hardening bodies, run on every rank of any communicator
// (test_threads.cpp, test_mpi.cpp), like those of distributed_cases.hpp:
//
//   check_options_disagree          ranks with different options or targets -> lce::error on every rank
//   check_what_only_the_exchange_tells  an element type of its own on one rank, a soft-cap of -0 beside 0,
//                                   targets that pass the hash but leave the vocabulary on one rank
//   check_resources_may_differ<T>   ranks with different budgets, chunks and threads: one agreed chunk,
//                                   results against the long-double reference (not a library run)
//   check_failure_on_one_rank       a view rejected, a workspace allocation failing, a GEMM integer range
//                                   exceeded on one rank only -> lce::error on every rank, nothing written
//   check_message_limit             a communicator with a small message limit: chunks shrink to fit
//   check_mid_sweep_failure         a collective failing in chunk k: the error names it; earlier chunks'
//                                   outputs are written, later ones untouched, grad_weight holds exactly
//                                   the earlier chunks' contributions
#pragma once

#include "distributed_cases.hpp"
#include "support/harness.hpp"

#include <climits>
#include <cmath>
#include <memory>
#include <new>
#include <utility>

namespace lce_hard {

using lce_dist::contains;
using lce_dist::error_of;

// ---------------------------------------------------------------------------
// Test communicators and backends.
// ---------------------------------------------------------------------------

// Forwards to Comm; its data collectives refuse messages over `limit` bytes
// (as MPI refuses counts over INT_MAX) and it says so through max_message_bytes().
template <lce::communicator Comm>
class limited {
 public:
  using memory_space = typename Comm::memory_space;
  limited(Comm inner, std::size_t limit) : inner_(std::move(inner)), limit_(limit) {}
  int rank() const { return inner_.rank(); }
  int size() const { return inner_.size(); }
  std::size_t max_message_bytes() const { return limit_; }
  void all_gather_bytes(const void* s, void* r, std::size_t bytes) const {
    check(bytes);
    inner_.all_gather_bytes(s, r, bytes);
  }
  template <class A>
  void all_reduce_sum(A* d, std::int64_t count) const {
    check(static_cast<std::size_t>(count) * sizeof(A));
    inner_.all_reduce_sum(d, count);
  }
  template <class A>
  void reduce_scatter_sum(const A* s, A* r, std::int64_t count) const {
    check(static_cast<std::size_t>(count) * sizeof(A));
    inner_.reduce_scatter_sum(s, r, count);
  }
  bool all_agree(bool f) const { return inner_.all_agree(f); }
  void all_gather_host(const std::int64_t* s, std::int64_t* r, std::int64_t c) const { inner_.all_gather_host(s, r, c); }

 private:
  void check(std::size_t bytes) const {
    if (bytes > limit_) lce::detail::fail("limited: a message of ", bytes, " bytes exceeds the limit of ", limit_);
  }
  Comm inner_;
  std::size_t limit_;
};

// Forwards to Comm; the `fail_at`-th data collective (counting from 0) raises
// lce::error instead, on every rank alike (as a failed collective would).
template <lce::communicator Comm>
class failing_collective {
 public:
  using memory_space = typename Comm::memory_space;
  failing_collective(Comm inner, std::int64_t fail_at)
      : inner_(std::move(inner)), fail_at_(fail_at), issued_(std::make_shared<std::int64_t>(0)) {}
  int rank() const { return inner_.rank(); }
  int size() const { return inner_.size(); }
  void all_gather_bytes(const void* s, void* r, std::size_t bytes) const {
    step();
    inner_.all_gather_bytes(s, r, bytes);
  }
  template <class A>
  void all_reduce_sum(A* d, std::int64_t count) const {
    step();
    inner_.all_reduce_sum(d, count);
  }
  template <class A>
  void reduce_scatter_sum(const A* s, A* r, std::int64_t count) const {
    step();
    inner_.reduce_scatter_sum(s, r, count);
  }
  bool all_agree(bool f) const { return inner_.all_agree(f); }
  void all_gather_host(const std::int64_t* s, std::int64_t* r, std::int64_t c) const { inner_.all_gather_host(s, r, c); }

 private:
  void step() const {
    if ((*issued_)++ == fail_at_) lce::detail::fail("injected: collective ", fail_at_, " failed");
  }
  Comm inner_;
  std::int64_t fail_at_;
  std::shared_ptr<std::int64_t> issued_;
};

// lce::host whose allocations fail while `fail` is set (a rank short of memory).
struct flaky_host : lce::host {
  using lce::host::host;
  bool fail = false;
  void* allocate(std::size_t bytes) {
    if (fail) throw std::bad_alloc();
    return lce::host::allocate(bytes);
  }
};
static_assert(lce::backend<flaky_host>);

// A user's matrix type whose columns are `step` elements apart: only step 1 is
// usable, which lce can only tell at run time.
struct strided_matrix {
  const float* data = nullptr;
  std::int64_t rows = 0, cols = 0, step = 1;
};

}  // namespace lce_hard

template <>
struct lce::view_traits<lce_hard::strided_matrix> {
  using element_type = const float;
  static constexpr int rank = 2;
  static const float* data(const lce_hard::strided_matrix& m) { return m.data; }
  static std::int64_t extent(const lce_hard::strided_matrix& m, int i) { return i == 0 ? m.rows : m.cols; }
  static std::int64_t stride(const lce_hard::strided_matrix& m, int i) { return i == 0 ? m.cols * m.step : m.step; }
};

namespace lce_hard {

// This rank's shard [v0, v0 + vr) of a vocabulary split unevenly over the ranks.
inline std::pair<std::int64_t, std::int64_t> shard_of(std::int64_t vocab, int ranks, int rank, int variant) {
  const auto split = lce_dist::vocab_split(vocab, ranks, variant);
  std::int64_t start = 0;
  for (int r = 0; r < rank; ++r) start += split[static_cast<std::size_t>(r)];
  return {start, split[static_cast<std::size_t>(rank)]};
}

inline std::vector<float> to_floats(const std::vector<double>& v) { return {v.begin(), v.end()}; }

template <class E>
bool all_equal(const std::vector<E>& v, E value) {
  return std::all_of(v.begin(), v.end(), [&](E e) { return e == value; });
}

// Every rank raises the same error when one rank's option or targets differ.
template <class Comm>
void check_options_disagree(const Comm& comm) {
  const int ranks = comm.size(), rank = comm.rank();
  if (ranks == 1) return;
  const std::int64_t n = 12, h = 8;
  const auto [v0, vr] = shard_of(60, ranks, rank, 0);
  const auto p = lce_test::make_problem(n, h, 60, 77, lce_test::round_to_float, 1.0, 1.0, 0.1);
  const auto x = to_floats(p.x);
  const auto w = to_floats(std::vector<double>(p.w.begin() + v0 * h, p.w.begin() + (v0 + vr) * h));
  const int odd = ranks - 1;  // the rank that differs

  const auto expect_everywhere = [&](const char* what, lce::options o, std::vector<std::int64_t> y,
                                     const std::string& expected) {
    o.vocab_start = v0;
    const bool sp = o.sequence_parallel;
    const std::int64_t rows = sp ? n / ranks : n;
    lce::ChunkedHiddenToLogprobs<Comm, float> op(comm, o, lce::host{1});
    constexpr float untouched = 4321.0f;
    std::vector<float> lp(n, untouched), lse(n, untouched);
    const std::string message = error_of([&] {
      op.forward(lce::matrix_view<const float>{x.data(), rows, h}, lce::matrix_view<const float>{w.data(), vr, h},
                 lce::vector_view<const std::int64_t>{y.data(), n}, lce::vector_view<float>{lp.data(), n},
                 lce::vector_view<float>{lse.data(), n});
    });
    CHECK_MESSAGE(contains(message, expected), "rank " << rank << "/" << ranks << ", " << what << ": expected \""
                                                       << expected << "\", got \"" << message << "\"");
    CHECK_MESSAGE((all_equal(lp, untouched) && all_equal(lse, untouched)),
                  "rank " << rank << ", " << what << ": outputs were written");
  };

  lce::options base;
  base.chunk_tokens = 5;
  base.temperature = 0.9f;
  {
    lce::options o = base;
    if (rank == odd) o.temperature = 0.7f;
    expect_everywhere("temperature", o, p.y, "options.temperature differs across ranks: rank 0 has 0.9, rank " +
                                                 std::to_string(odd) + " has 0.7");
  }
  {
    // One ulp apart: the message must still tell the two values apart.
    lce::options o = base;
    if (rank == odd) o.temperature = std::nextafter(0.9f, 1.0f);
    expect_everywhere("temperature one ulp apart", o, p.y, "options.temperature differs across ranks: rank 0 has 0.9, rank " +
                                                               std::to_string(odd) + " has 0.90000004");
  }
  {
    lce::options o = base;
    if (rank == odd) o.softcap = 30.0f;
    expect_everywhere("softcap", o, p.y, "options.softcap differs across ranks: rank 0 has 0, rank " +
                                             std::to_string(odd) + " has 30");
  }
  {
    lce::options o = base;
    if (rank == odd) o.ignore_index = -1;
    expect_everywhere("ignore_index", o, p.y, "options.ignore_index differs across ranks: rank 0 has -100, rank " +
                                                  std::to_string(odd) + " has -1");
  }
  if (n % ranks == 0) {
    // The odd rank alone passes N/P rows as a sequence-parallel shard would;
    // its N = ranks x rows checks pass locally, so only the exchange tells.
    lce::options o = base;
    if (rank == odd) o.sequence_parallel = true;
    std::vector<std::int64_t> y = p.y;
    const std::string message_part = "options.sequence_parallel differs across ranks";
    lce::ChunkedHiddenToLogprobs<Comm, float> op(comm, [&] { o.vocab_start = v0; return o; }(), lce::host{1});
    std::vector<float> lp(n, 1.0f), lse(n, 1.0f);
    const std::int64_t rows = rank == odd ? n / ranks : n;
    const std::string message = error_of([&] {
      op.forward(lce::matrix_view<const float>{x.data(), rows, h}, lce::matrix_view<const float>{w.data(), vr, h},
                 lce::vector_view<const std::int64_t>{y.data(), n}, lce::vector_view<float>{lp.data(), n},
                 lce::vector_view<float>{lse.data(), n});
    });
    CHECK_MESSAGE(contains(message, message_part), "rank " << rank << ": sequence_parallel: got \"" << message << "\"");
  }
  {
    std::vector<std::int64_t> y = p.y;
    if (rank == odd) y[n - 1] = (y[n - 1] == 0 ? 1 : 0);
    expect_everywhere("targets", base, y, "targets: the hash of the target ids differs across ranks");
  }
  {  // The odd rank asks for the entropy as well: another call.
    lce::options o = base;
    o.vocab_start = v0;
    lce::ChunkedHiddenToLogprobs<Comm, float> op(comm, o, lce::host{1});
    std::vector<float> lp(n, 1.0f), lse(n, 1.0f), ent(n, 1.0f);
    const auto X = lce::matrix_view<const float>{x.data(), n, h};
    const auto W = lce::matrix_view<const float>{w.data(), vr, h};
    const auto Y = lce::vector_view<const std::int64_t>{p.y.data(), n};
    const std::string message = error_of([&] {
      if (rank == odd)
        op.forward(X, W, Y, lce::vector_view<float>{lp.data(), n}, lce::vector_view<float>{lse.data(), n},
                   lce::vector_view<float>{ent.data(), n});
      else
        op.forward(X, W, Y, lce::vector_view<float>{lp.data(), n}, lce::vector_view<float>{lse.data(), n});
    });
    const bool names_both_calls = contains(message, "the call differs across ranks") &&
                                  contains(message, "forward(logprobs, lse)") &&
                                  contains(message, "forward(logprobs, lse, entropy)");
    CHECK_MESSAGE(names_both_calls,
                  "rank " << rank << ": entropy on one rank only: got \"" << message << "\"");
  }
  {  // A bias on the odd rank only (forward), then a grad_bias on it only
     // (backward): a head with and without a bias is the caller's mistake.
    lce::options o = base;
    o.vocab_start = v0;
    lce::ChunkedHiddenToLogprobs<Comm, float> op(comm, o, lce::host{1});
    const auto X = lce::matrix_view<const float>{x.data(), n, h};
    const auto W = lce::matrix_view<const float>{w.data(), vr, h};
    const auto Y = lce::vector_view<const std::int64_t>{p.y.data(), n};
    const std::vector<float> bias(static_cast<std::size_t>(vr), 0.5f);
    const lce::vector_view<const float> B = rank == odd ? lce::vector_view<const float>{bias.data(), vr}
                                                        : lce::vector_view<const float>{};
    constexpr float untouched = 4321.0f;
    std::vector<float> lp(n, untouched), lse(n, untouched);
    const std::string message = error_of([&] {
      op.forward(X, lce::with_bias{W, B}, Y, lce::vector_view<float>{lp.data(), n},
                 lce::vector_view<float>{lse.data(), n});
    });
    const bool names_both_calls = contains(message, "the call differs across ranks") &&
                                  contains(message, "forward(logprobs, lse)") &&
                                  contains(message, "forward(logprobs, lse, bias)");
    CHECK_MESSAGE(names_both_calls, "rank " << rank << ": a bias on one rank only: got \"" << message << "\"");
    CHECK_MESSAGE((all_equal(lp, untouched) && all_equal(lse, untouched)),
                  "rank " << rank << ", a bias on one rank only: outputs were written");

    op.forward(X, W, Y, lce::vector_view<float>{lp.data(), n}, lce::vector_view<float>{lse.data(), n});
    const std::vector<float> g(static_cast<std::size_t>(n), 0.5f);
    std::vector<float> gh(static_cast<std::size_t>(n * h), untouched), gw(static_cast<std::size_t>(vr * h), 0.0f),
        gb(static_cast<std::size_t>(vr), untouched);
    const lce::vector_view<float> GB = rank == odd ? lce::vector_view<float>{gb.data(), vr} : lce::vector_view<float>{};
    const std::string backward_message = error_of([&] {
      op.backward(X, W, Y, lce::vector_view<const float>{lse.data(), n}, lce::vector_view<const float>{g.data(), n},
                  lce::matrix_view<float>{gh.data(), n, h}, lce::with_bias{lce::matrix_view<float>{gw.data(), vr, h}, GB});
    });
    const bool names_both_backwards = contains(backward_message, "the call differs across ranks") &&
                                      contains(backward_message, "backward(lse, grad_logprobs)") &&
                                      contains(backward_message, "backward(lse, grad_logprobs, grad_bias)");
    CHECK_MESSAGE(names_both_backwards,
                  "rank " << rank << ": a grad_bias on one rank only: got \"" << backward_message << "\"");
    CHECK_MESSAGE((all_equal(gh, untouched) && all_equal(gw, 0.0f) && all_equal(gb, untouched)),
                  "rank " << rank << ", a grad_bias on one rank only: gradients were written");
  }
}

// What a rank's own checks cannot tell and the exchange must: the element type (one rank
// instantiated on double beside float ones would gather rows of another size), a soft-cap of
// -0 beside 0 (both "none": no disagreement), and targets crafted to pass the hash whose ids
// leave the vocabulary on one rank only (that rank's range check would raise alone and leave
// the others waiting in the sweep's collectives).
template <class Comm>
void check_what_only_the_exchange_tells(const Comm& comm) {
  const int ranks = comm.size(), rank = comm.rank();
  if (ranks == 1) return;
  const std::int64_t n = 12, h = 8, vocab = 60;
  const auto [v0, vr] = shard_of(vocab, ranks, rank, 0);
  const auto p = lce_test::make_problem(n, h, vocab, 78, lce_test::round_to_float, 1.0, 1.0, 0.1);
  const int odd = ranks - 1;
  lce::options o;
  o.vocab_start = v0;
  const auto x = to_floats(p.x);
  const auto w = to_floats(std::vector<double>(p.w.begin() + v0 * h, p.w.begin() + (v0 + vr) * h));
  const auto Y = lce::vector_view<const std::int64_t>{p.y.data(), n};
  constexpr float untouched = 4321.0f;
  {
    std::vector<float> lp(n, untouched), lse(n, untouched);
    std::vector<double> lp_double(n, untouched), lse_double(n, untouched);
    const std::string message = error_of([&] {
      if (rank == odd) {
        lce::ChunkedHiddenToLogprobs<Comm, double> op(comm, o, lce::host{1});
        const std::vector<double> wd(w.begin(), w.end());
        op.forward(lce::matrix_view<const double>{p.x.data(), n, h}, lce::matrix_view<const double>{wd.data(), vr, h},
                   Y, lce::vector_view<double>{lp_double.data(), n}, lce::vector_view<double>{lse_double.data(), n});
      } else {
        lce::ChunkedHiddenToLogprobs<Comm, float> op(comm, o, lce::host{1});
        op.forward(lce::matrix_view<const float>{x.data(), n, h}, lce::matrix_view<const float>{w.data(), vr, h}, Y,
                   lce::vector_view<float>{lp.data(), n}, lce::vector_view<float>{lse.data(), n});
      }
    });
    const std::string expected = "the element type differs across ranks: rank 0 has float (computing in float), rank " +
                                 std::to_string(odd) + " has double (computing in double)";
    CHECK_MESSAGE(contains(message, expected), "rank " << rank << ": float beside double: got \"" << message << "\"");
    CHECK_MESSAGE((all_equal(lp, untouched) && all_equal(lse, untouched) && all_equal(lp_double, 4321.0) &&
                   all_equal(lse_double, 4321.0)),
                  "rank " << rank << ", float beside double: outputs were written");
  }
  {
    lce::options negative_zero = o;
    if (rank == odd) negative_zero.softcap = -0.0f;
    std::vector<float> lp(n), lse(n), want(n), want_lse(n);
    lce::ChunkedHiddenToLogprobs<Comm, float> op(comm, negative_zero, lce::host{1}), plain(comm, o, lce::host{1});
    const auto X = lce::matrix_view<const float>{x.data(), n, h};
    const auto W = lce::matrix_view<const float>{w.data(), vr, h};
    const std::string message = error_of([&] {
      op.forward(X, W, Y, lce::vector_view<float>{lp.data(), n}, lce::vector_view<float>{lse.data(), n});
    });
    CHECK_MESSAGE(message.empty(), "rank " << rank << ": a soft-cap of -0 beside 0: got \"" << message << "\"");
    plain.forward(X, W, Y, lce::vector_view<float>{want.data(), n}, lce::vector_view<float>{want_lse.data(), n});
    CHECK((lp == want && lse == want_lse));
  }
  {
    // The odd rank's last two ids differ from the others' and leave the hash as it is: the
    // hash mixes each id into its state as f((state ^ id) K), a bijection of the state, so
    // with a first id of its own, a second of X = mix(s, a) ^ mix(s, b) ^ y lands on the same state.
    std::vector<std::int64_t> y = p.y;
    if (rank == odd) {
      const auto mix = [](std::uint64_t state, std::int64_t id) {
        state ^= static_cast<std::uint64_t>(id);
        state *= 0xBF58476D1CE4E5B9ull;
        return state ^ state >> 31;
      };
      std::uint64_t state = 0x9E3779B97F4A7C15ull ^ static_cast<std::uint64_t>(n);
      for (std::int64_t i = 0; i < n - 2; ++i) state = mix(state, y[i]);
      const std::int64_t own = (y[n - 2] + 1) % vocab;
      y[n - 1] = static_cast<std::int64_t>(mix(state, own) ^ mix(state, y[n - 2])) ^ y[n - 1];
      y[n - 2] = own;
      const auto theirs = lce::detail::scan_targets_on_host(Y, -100);
      const auto mine = lce::detail::scan_targets_on_host(lce::vector_view<const std::int64_t>{y.data(), n}, -100);
      REQUIRE(mine.hash == theirs.hash);  // the construction above still collides
      REQUIRE((y[n - 1] < 0 || y[n - 1] >= vocab));
    }
    lce::ChunkedHiddenToLogprobs<Comm, float> op(comm, o, lce::host{1});
    std::vector<float> lp(n, untouched), lse(n, untouched);
    const std::string message = error_of([&] {
      op.forward(lce::matrix_view<const float>{x.data(), n, h}, lce::matrix_view<const float>{w.data(), vr, h},
                 lce::vector_view<const std::int64_t>{y.data(), n}, lce::vector_view<float>{lp.data(), n},
                 lce::vector_view<float>{lse.data(), n});
    });
    const std::string expected = rank == odd ? "targets[" + std::to_string(n - 1) + "] = " : "another rank's ids reach ";
    CHECK_MESSAGE((contains(message, expected) && contains(message, "outside the vocabulary [0, 60)")),
                  "rank " << rank << ": colliding targets out of range on one rank: got \"" << message << "\"");
    CHECK_MESSAGE((all_equal(lp, untouched) && all_equal(lse, untouched)),
                  "rank " << rank << ", colliding targets: outputs were written");
  }
}

// Ranks that differ in workspace budget, chunk_tokens and host threads (with a
// bf16 weight the budget chunk depends on the threads) run with the smallest
// chunk; results match the long-double materialised reference.
template <class T, class Comm>
void check_resources_may_differ(const Comm& comm) {
  const int ranks = comm.size(), rank = comm.rank();
  const std::int64_t n = 48, h = 16, v = 3000;
  const auto [v0, vr] = shard_of(v, ranks, rank, 1);
  lce_test::problem p = lce_test::make_problem(n, h, v, 4040, lce_test::rounder_for<T>(), 1.5, 1.0, 0.1);
  p.tau = 0.8f;
  p.cap = 6.0f;
  const auto g = lce_test::random_vector(n, 4041, -1.0, 1.0, lce_test::round_to_float);
  const auto ref = lce_test::reference_forward(p);
  const auto grads = lce_test::reference_backward(p, ref, g, {});

  const auto x = lce_dist::converted<T>(p.x);
  const auto w = lce_dist::converted<T>(p.w, static_cast<std::size_t>(v0 * h), static_cast<std::size_t>(vr * h));
  const auto gf = to_floats(g);

  for (int variant = 0; variant < 4; ++variant) {
    CAPTURE(variant);
    lce::options o;
    o.vocab_start = v0;
    o.temperature = p.tau;
    o.softcap = p.cap;
    int threads = 1;
    if (variant == 0) o.chunk_tokens = 7 + 5 * rank;                           // explicit, different per rank
    if (variant == 1) o.workspace_limit_bytes = (std::size_t{1} << 20) << rank;  // budgets of 1, 2, 4 MiB
    if (variant == 2) {                                                        // threads differ: bf16 scratch
      o.workspace_limit_bytes = std::size_t{3} << 20;
      threads = 1 + rank % 2;
    }
    // Rank 0 asks for chunks of 13 rows (48 = 13 + 13 + 13 + 9), the others for
    // the budget's (all 48 rows, evened to nothing smaller): the others must take
    // 13 as agreed, not even it again to 12 (4 x 12) and run other chunks.
    if (variant == 3 && rank == 0) o.chunk_tokens = 13;
    lce::ChunkedHiddenToLogprobs<Comm, T> op(comm, o, lce::host{threads});
    std::vector<float> lp(n), dx(static_cast<std::size_t>(n * h)), dw(static_cast<std::size_t>(vr * h), 0.0f);
    const std::string message = error_of([&] {
      op.forward_backward(lce::matrix_view<const T>{x.data(), n, h}, lce::matrix_view<const T>{w.data(), vr, h},
                          lce::vector_view<const std::int64_t>{p.y.data(), n},
                          lce::vector_view<const float>{gf.data(), n}, lce::vector_view<float>{lp.data(), n},
                          lce::matrix_view<float>{dx.data(), n, h}, lce::matrix_view<float>{dw.data(), vr, h});
    });
    REQUIRE_MESSAGE(message.empty(), "rank " << rank << ": " << message);
    const double tol = 2e-5;
    double worst_lp = 0, worst_dx = 0, worst_dw = 0;
    const double sx = std::max(1.0, lce_test::max_abs(grads.dx)), sw = std::max(1.0, lce_test::max_abs(grads.dw));
    for (std::int64_t i = 0; i < n; ++i) {
      const double want = static_cast<double>(ref.logp[static_cast<std::size_t>(i)]);
      worst_lp = std::max(worst_lp, std::fabs(lp[static_cast<std::size_t>(i)] - want) / (1 + std::fabs(want)));
    }
    for (std::size_t k = 0; k < dx.size(); ++k) worst_dx = std::max(worst_dx, std::fabs(dx[k] - grads.dx[k]) / sx);
    for (std::size_t k = 0; k < dw.size(); ++k)
      worst_dw = std::max(worst_dw, std::fabs(dw[k] - grads.dw[static_cast<std::size_t>(v0 * h) + k]) / sw);
    CHECK_MESSAGE(worst_lp <= tol, "rank " << rank << ": logprobs vs long-double reference, worst " << worst_lp);
    CHECK_MESSAGE(worst_dx <= tol, "rank " << rank << ": grad_hidden vs long-double reference, worst " << worst_dx);
    CHECK_MESSAGE(worst_dw <= tol, "rank " << rank << ": grad_weight vs long-double reference, worst " << worst_dw);
  }
}

// A failure that only one rank can see, before the exchange: every rank raises,
// the others naming that rank, and nothing is written anywhere.
template <class Comm>
void check_failure_on_one_rank(const Comm& comm) {
  const int ranks = comm.size(), rank = comm.rank();
  const int odd = ranks - 1;
  const std::int64_t n = 6, h = 8;
  const auto [v0, vr] = shard_of(40, ranks, rank, 0);
  const auto p = lce_test::make_problem(n, h, 40, 99, lce_test::round_to_float, 1.0, 1.0, 0.0);
  const auto x = to_floats(p.x);
  const auto w = to_floats(std::vector<double>(p.w.begin() + v0 * h, p.w.begin() + (v0 + vr) * h));
  std::vector<float> x_wide(static_cast<std::size_t>(n * h * 2));
  for (std::size_t k = 0; k < x.size(); ++k) x_wide[2 * k] = x[k];
  const std::vector<float> g(n, -1.0f);
  lce::options o;
  o.vocab_start = v0;
  const auto others = [&](const std::string& own) {
    return rank == odd ? own : "rank " + std::to_string(odd) + " rejected its arguments";
  };
  constexpr float untouched = 777.0f;

  // 1. hidden with a column stride of 2, a view lce can only reject at run time.
  {
    lce::ChunkedHiddenToLogprobs<Comm, float> op(comm, o, lce::host{1});
    std::vector<float> lp(n, untouched), lse(n, untouched);
    const lce_hard::strided_matrix hidden{rank == odd ? x_wide.data() : x.data(), n, h, rank == odd ? 2 : 1};
    const std::string message = error_of([&] {
      op.forward(hidden, lce::matrix_view<const float>{w.data(), vr, h},
                 lce::vector_view<const std::int64_t>{p.y.data(), n}, lce::vector_view<float>{lp.data(), n},
                 lce::vector_view<float>{lse.data(), n});
    });
    const std::string expected = others("hidden: the inner (column) stride must be 1, got 2");
    CHECK_MESSAGE(contains(message, expected), "rank " << rank << ", strided view: expected \"" << expected
                                                       << "\", got \"" << message << "\"");
    CHECK((all_equal(lp, untouched) && all_equal(lse, untouched)));
  }
  // 2. The workspace cannot be allocated on one rank.
  {
    flaky_host backend{1};
    backend.fail = rank == odd;
    lce::ChunkedHiddenToLogprobs<Comm, float, lce::budget_chunk, flaky_host> op(comm, o, std::move(backend));
    std::vector<float> lp(n, untouched), dx(static_cast<std::size_t>(n * h), untouched),
        dw(static_cast<std::size_t>(vr * h), untouched);
    const std::string message = error_of([&] {
      op.forward_backward(lce::matrix_view<const float>{x.data(), n, h}, lce::matrix_view<const float>{w.data(), vr, h},
                          lce::vector_view<const std::int64_t>{p.y.data(), n},
                          lce::vector_view<const float>{g.data(), n}, lce::vector_view<float>{lp.data(), n},
                          lce::matrix_view<float>{dx.data(), n, h}, lce::matrix_view<float>{dw.data(), vr, h});
    });
    const std::string expected = others("workspace: could not allocate");
    CHECK_MESSAGE(contains(message, expected), "rank " << rank << ", allocation: expected \"" << expected
                                                       << "\", got \"" << message << "\"");
    CHECK((all_equal(lp, untouched) && all_equal(dx, untouched) && all_equal(dw, untouched)));
  }
  // 3. A leading dimension beyond the BLAS's int on one rank (one token, so
  //    the huge stride spans no memory).
  {
    lce::ChunkedHiddenToLogprobs<Comm, float> op(comm, o, lce::host{1});
    std::vector<float> lp(1, untouched), lse(1, untouched);
    const std::int64_t ld = rank == odd ? std::int64_t{INT_MAX} + 1 : h;
    const std::string message = error_of([&] {
      op.forward(lce::matrix_view<const float>{x.data(), 1, h, ld}, lce::matrix_view<const float>{w.data(), vr, h},
                 lce::vector_view<const std::int64_t>{p.y.data(), 1}, lce::vector_view<float>{lp.data(), 1},
                 lce::vector_view<float>{lse.data(), 1});
    });
    const std::string expected = others("hidden: shape 1 x 8 with ld 2147483648 exceeds the GEMMs' integer range");
    CHECK_MESSAGE(contains(message, expected), "rank " << rank << ", ld beyond int: expected \"" << expected
                                                       << "\", got \"" << message << "\"");
    CHECK((all_equal(lp, untouched) && all_equal(lse, untouched)));
  }
  // 4. After all that the ranks are still in step: a good call works.
  {
    lce::ChunkedHiddenToLogprobs<Comm, float> op(comm, o, lce::host{1});
    std::vector<float> lp(n), lse(n);
    const std::string message = error_of([&] {
      op.forward(lce::matrix_view<const float>{x.data(), n, h}, lce::matrix_view<const float>{w.data(), vr, h},
                 lce::vector_view<const std::int64_t>{p.y.data(), n}, lce::vector_view<float>{lp.data(), n},
                 lce::vector_view<float>{lse.data(), n});
    });
    CHECK_MESSAGE(message.empty(), "rank " << rank << ": a good call after the failures: " << message);
  }
}

// A communicator whose messages are limited: the chunk shrinks so that every
// per-chunk message fits, and the results stay those of an unlimited run.
template <class Comm>
void check_message_limit(const Comm& comm) {
  const int ranks = comm.size(), rank = comm.rank();
  if (ranks == 1) return;
  const std::int64_t n = 40, h = 16;
  const auto [v0, vr] = shard_of(300, ranks, rank, 0);
  const auto p = lce_test::make_problem(n, h, 300, 55, lce_test::round_to_float, 1.0, 1.0, 0.1);
  const auto x = to_floats(p.x);
  const auto w = to_floats(std::vector<double>(p.w.begin() + v0 * h, p.w.begin() + (v0 + vr) * h));
  const std::vector<float> g(n, -0.5f);
  lce::options o;
  o.vocab_start = v0;
  o.chunk_tokens = 40;  // asks for one chunk; 40 rows x 16 x 4 bytes of dX would exceed 512
  const auto run = [&](auto& op, std::vector<float>& lp, std::vector<float>& dx, std::vector<float>& dw) {
    return error_of([&] {
      op.forward_backward(lce::matrix_view<const float>{x.data(), n, h}, lce::matrix_view<const float>{w.data(), vr, h},
                          lce::vector_view<const std::int64_t>{p.y.data(), n},
                          lce::vector_view<const float>{g.data(), n}, lce::vector_view<float>{lp.data(), n},
                          lce::matrix_view<float>{dx.data(), n, h}, lce::matrix_view<float>{dw.data(), vr, h});
    });
  };
  std::vector<float> lp(n), dx(static_cast<std::size_t>(n * h)), dw(static_cast<std::size_t>(vr * h), 0.0f);
  std::vector<float> lp1(n), dx1(static_cast<std::size_t>(n * h)), dw1(static_cast<std::size_t>(vr * h), 0.0f);
  lce::ChunkedHiddenToLogprobs<limited<Comm>, float> small(limited<Comm>(comm, 512), o, lce::host{1});
  const std::string message = run(small, lp, dx, dw);
  CHECK_MESSAGE(message.empty(), "rank " << rank << ": limited messages: " << message);
  CHECK(small.chunk_tokens(n, h, vr) == 512 / (16 * 4));
  lce::ChunkedHiddenToLogprobs<Comm, float> plain(comm, o, lce::host{1});
  CHECK(run(plain, lp1, dx1, dw1).empty());
  double worst = 0;
  for (std::int64_t i = 0; i < n; ++i) worst = std::max(worst, double(std::fabs(lp[i] - lp1[i])));
  CHECK_MESSAGE(worst <= 1e-6, "rank " << rank << ": logprobs of the limited run differ by " << worst);
}

// A collective that fails in the middle of a sweep (the same one on every
// rank, as a broken communicator would): the error names the chunk, earlier
// chunks' outputs are written (and equal a run over those tokens alone),
// later ones untouched, and grad_weight holds exactly the earlier chunks'
// contributions.
template <class Comm>
void check_mid_sweep_failure(const Comm& comm) {
  const int ranks = comm.size(), rank = comm.rank();
  if (ranks == 1) return;
  const std::int64_t n = 20, h = 8, chunk = 6, failing_chunk = 2;
  const auto [v0, vr] = shard_of(90, ranks, rank, 0);
  const auto p = lce_test::make_problem(n, h, 90, 66, lce_test::round_to_float, 1.0, 1.0, 0.0);
  const auto x = to_floats(p.x);
  const auto w = to_floats(std::vector<double>(p.w.begin() + v0 * h, p.w.begin() + (v0 + vr) * h));
  const std::vector<float> g(n, -0.25f);
  const auto initial_dw = to_floats(lce_test::random_vector(vr * h, 67 + rank, -1.0, 1.0));
  lce::options o;
  o.vocab_start = v0;
  o.chunk_tokens = chunk;
  constexpr float untouched = 555.0f;

  // forward_backward issues 2 data collectives per chunk (partials, dX): the
  // first of chunk 2 fails.
  lce::ChunkedHiddenToLogprobs<failing_collective<Comm>, float> broken(
      failing_collective<Comm>(comm, 2 * failing_chunk), o, lce::host{1});
  std::vector<float> lp(n, untouched), dx(static_cast<std::size_t>(n * h), untouched), dw = initial_dw;
  const std::string message = error_of([&] {
    broken.forward_backward(lce::matrix_view<const float>{x.data(), n, h}, lce::matrix_view<const float>{w.data(), vr, h},
                            lce::vector_view<const std::int64_t>{p.y.data(), n},
                            lce::vector_view<const float>{g.data(), n}, lce::vector_view<float>{lp.data(), n},
                            lce::matrix_view<float>{dx.data(), n, h}, lce::matrix_view<float>{dw.data(), vr, h});
  });
  CHECK_MESSAGE(contains(message, "injected: collective 4 failed (in chunk 2 of 4, hidden rows [12, 18) of this rank"),
                "rank " << rank << ": got \"" << message << "\"");
  CHECK(contains(message, "restore it before a retry"));

  // The same call over the first two chunks' tokens alone.
  const std::int64_t done = failing_chunk * chunk;
  lce::ChunkedHiddenToLogprobs<Comm, float> good(comm, o, lce::host{1});
  std::vector<float> lp_done(done), dx_done(static_cast<std::size_t>(done * h)), dw_done = initial_dw;
  good.forward_backward(lce::matrix_view<const float>{x.data(), done, h}, lce::matrix_view<const float>{w.data(), vr, h},
                        lce::vector_view<const std::int64_t>{p.y.data(), done},
                        lce::vector_view<const float>{g.data(), done}, lce::vector_view<float>{lp_done.data(), done},
                        lce::matrix_view<float>{dx_done.data(), done, h}, lce::matrix_view<float>{dw_done.data(), vr, h});
  CHECK(std::equal(lp_done.begin(), lp_done.end(), lp.begin()));
  CHECK(std::equal(dx_done.begin(), dx_done.end(), dx.begin()));
  CHECK(std::all_of(lp.begin() + done, lp.end(), [](float e) { return e == untouched; }));
  CHECK(std::all_of(dx.begin() + done * h, dx.end(), [](float e) { return e == untouched; }));
  CHECK_MESSAGE(dw == dw_done, "rank " << rank << ": grad_weight is not the initial value plus chunks 0-1");
}

}  // namespace lce_hard
