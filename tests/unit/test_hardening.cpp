// Hardening: argument checks that hold for every shape (one row included),
// integer ranges named as the caller's argument, one call at a time per
// operator, scratch that can be inspected and given back, size arithmetic
// that cannot wrap, the compile-time chunk policy, and allocation failures
// reported as lce::error. Every error case checks the exception type, that
// the message names the argument and the values, and that every buffer
// (outputs and grad_weight included) is bitwise unchanged.
#include "support/harness.hpp"

#include <atomic>
#include <cctype>
#include <chrono>
#include <climits>
#include <cstdint>
#include <initializer_list>
#include <new>
#include <optional>
#include <string>
#include <thread>
#include <vector>

using namespace lce_test;

namespace {

std::string lowercase(std::string s) {
  for (auto& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return s;
}

bool mentions(const std::string& message, const std::string& part) {
  return lowercase(message).find(lowercase(part)) != std::string::npos;
}

void check_mentions(const std::string& message, std::initializer_list<std::string> parts) {
  INFO("message: " << message);
  for (const auto& part : parts) CHECK_MESSAGE(mentions(message, part), "message lacks '" << part << "'");
}

// The lce::error a call raises (FAIL_CHECK and nullopt if none, or another type).
template <class Call>
std::optional<std::string> error_of(Call&& call) {
  try {
    call();
  } catch (const lce::error& e) {
    return std::string(e.what());
  } catch (const std::exception& e) {
    FAIL_CHECK("threw something other than lce::error: " << e.what());
    return std::nullopt;
  }
  FAIL_CHECK("no lce::error thrown");
  return std::nullopt;
}

enum class entry { forward, forward_entropy, backward, backward_entropy, forward_backward };
constexpr entry every_entry[] = {entry::forward, entry::forward_entropy, entry::backward, entry::backward_entropy,
                                 entry::forward_backward};
constexpr entry gradient_entries[] = {entry::backward, entry::backward_entropy, entry::forward_backward};

const char* entry_name(entry e) {
  switch (e) {
    case entry::forward: return "forward";
    case entry::forward_entropy: return "forward(entropy)";
    case entry::backward: return "backward";
    case entry::backward_entropy: return "backward(entropy)";
    default: return "forward_backward";
  }
}

// All buffers of one call, with room to spare so that views may be given any
// leading dimension; outputs start as sentinels, grad_weight as a pattern.
template <class T>
struct call_buffers {
  using O = out_t<T>;
  std::int64_t n, h, v;
  std::vector<T> x, w, gh, gw;
  std::vector<std::int64_t> y;
  std::vector<O> lp, lse, ent, glp, gent;

  call_buffers(std::int64_t n_, std::int64_t h_, std::int64_t v_) : n(n_), h(h_), v(v_) {
    rng r(1234);
    const std::int64_t slack = 8;
    x.resize(static_cast<std::size_t>(n * h + slack));
    w.resize(static_cast<std::size_t>(v * h + slack));
    for (auto& e : x) e = to_elem<T>(round_to<T>(r.uniform(-1, 1)));
    for (auto& e : w) e = to_elem<T>(round_to<T>(r.uniform(-1, 1)));
    y.resize(static_cast<std::size_t>(n));
    for (auto& t : y) t = r.below(v);
    lp.assign(static_cast<std::size_t>(n), garbage<O>());
    ent.assign(static_cast<std::size_t>(n), garbage<O>());
    lse.assign(static_cast<std::size_t>(n), O(3.5));  // plausible: also backward's input
    glp.assign(static_cast<std::size_t>(n), O(-1));
    gent.assign(static_cast<std::size_t>(n), O(0.25));
    gh.assign(static_cast<std::size_t>(n * h + slack), garbage<T>());
    gw.resize(static_cast<std::size_t>(v * h + slack));
    for (std::size_t k = 0; k < gw.size(); ++k) gw[k] = to_elem<T>(0.5 + 0.125 * static_cast<double>(k % 13));
  }

  // Dense views; a test replaces the one it breaks.
  lce::matrix_view<const T> X() const { return {x.data(), n, h, h}; }
  lce::matrix_view<const T> W() const { return {w.data(), v, h, h}; }
  lce::matrix_view<T> GH() { return {gh.data(), n, h, h}; }
  lce::matrix_view<T> GW() { return {gw.data(), v, h, h}; }

  template <class E>
  static std::vector<unsigned char> bytes_of(const std::vector<E>& b) {
    const auto* p = reinterpret_cast<const unsigned char*>(b.data());
    return std::vector<unsigned char>(p, p + b.size() * sizeof(E));
  }
  std::vector<std::vector<unsigned char>> snapshot() const {
    return {bytes_of(x), bytes_of(w), bytes_of(y), bytes_of(lp), bytes_of(lse), bytes_of(ent), bytes_of(glp),
            bytes_of(gent), bytes_of(gh), bytes_of(gw)};
  }
  static const char* buffer_name(std::size_t k) {
    static const char* names[] = {"hidden", "weight", "targets", "logprobs", "lse", "entropy", "grad_logprobs",
                                  "grad_entropy", "grad_hidden", "grad_weight"};
    return names[k];
  }

  template <class Op>
  void invoke(Op& op, entry e, lce::matrix_view<const T> xv, lce::matrix_view<const T> wv, lce::matrix_view<T> ghv,
              lce::matrix_view<T> gwv) {
    const lce::vector_view<const std::int64_t> t{y.data(), n};
    const lce::vector_view<O> lpv{lp.data(), n}, lsev{lse.data(), n}, entv{ent.data(), n};
    const lce::vector_view<const O> lse_in{lse.data(), n}, glpv{glp.data(), n}, gentv{gent.data(), n};
    switch (e) {
      case entry::forward: op.forward(xv, wv, t, lpv, lsev); break;
      case entry::forward_entropy: op.forward(xv, wv, t, lpv, lsev, entv); break;
      case entry::backward: op.backward(xv, wv, t, lse_in, glpv, ghv, gwv); break;
      case entry::backward_entropy: op.backward(xv, wv, t, lse_in, glpv, gentv, ghv, gwv); break;
      case entry::forward_backward: op.forward_backward(xv, wv, t, glpv, lpv, ghv, gwv); break;
    }
  }
};

// Calls `e` with the given views on a fresh operator; expects lce::error
// mentioning every part, and every buffer bitwise unchanged.
template <class T>
void expect_call_error(call_buffers<T>& b, entry e, lce::matrix_view<const T> xv, lce::matrix_view<const T> wv,
                       lce::matrix_view<T> ghv, lce::matrix_view<T> gwv, std::initializer_list<std::string> parts,
                       std::initializer_list<std::string> absent = {}) {
  INFO("entry point: " << std::string(entry_name(e)));
  auto op = make_op<T>(make_options(1.0f, 0.0f, 4), 1);
  const auto before = b.snapshot();
  const auto message = error_of([&] { b.invoke(op, e, xv, wv, ghv, gwv); });
  if (message) {
    check_mentions(*message, parts);
    for (const auto& part : absent) CHECK_MESSAGE(!mentions(*message, part), "message mentions '" << part << "'");
  }
  const auto after = b.snapshot();
  for (std::size_t k = 0; k < before.size(); ++k)
    CHECK_MESSAGE(before[k] == after[k],
                  "buffer '" << std::string(call_buffers<T>::buffer_name(k)) << "' was modified");
}

}  // namespace

// ---------------------------------------------------------------------------
// 1. The leading dimension is checked whatever the row count.
// ---------------------------------------------------------------------------

TEST_CASE_TEMPLATE("hardening: ld < cols is an error for a one-row view too; ld > cols works", T, float,
                   lce::bfloat16) {
  const std::int64_t h = 16;

  SUBCASE("hidden: 1 row, ld = cols - 1") {
    call_buffers<T> b(1, h, 7);
    for (entry e : every_entry)
      expect_call_error(b, e, {b.x.data(), 1, h, h - 1}, b.W(), b.GH(), b.GW(),
                        {"hidden", "ld = 15", "cols = 16"});
  }
  SUBCASE("weight: 1 row (a one-word vocabulary shard), ld = cols - 1") {
    call_buffers<T> b(5, h, 1);
    for (entry e : every_entry)
      expect_call_error(b, e, b.X(), {b.w.data(), 1, h, h - 1}, b.GH(), b.GW(), {"weight", "ld = 15", "cols = 16"});
  }
  SUBCASE("grad_hidden: 1 row, ld = cols - 1") {
    call_buffers<T> b(1, h, 7);
    for (entry e : gradient_entries)
      expect_call_error(b, e, b.X(), b.W(), {b.gh.data(), 1, h, h - 1}, b.GW(),
                        {"grad_hidden", "ld = 15", "cols = 16"});
  }
  SUBCASE("grad_weight: 1 row, ld = cols - 1") {
    call_buffers<T> b(3, h, 1);
    for (entry e : gradient_entries)
      expect_call_error(b, e, b.X(), b.W(), b.GH(), {b.gw.data(), 1, h, h - 1},
                        {"grad_weight", "ld = 15", "cols = 16"});
  }
  SUBCASE("a default-built view given data, 1 row and cols, but left with ld = 0") {
    call_buffers<T> b(1, h, 1);
    lce::matrix_view<const T> hidden;  // ld defaults to the cols of the time: 0
    hidden.data = b.x.data();
    hidden.rows = 1;
    hidden.cols = h;
    REQUIRE(hidden.ld == 0);
    for (entry e : every_entry) expect_call_error(b, e, hidden, b.W(), b.GH(), b.GW(), {"hidden", "ld = 0", "16"});

    lce::matrix_view<const T> weight;
    weight.data = b.w.data();
    weight.rows = 1;
    weight.cols = h;
    for (entry e : every_entry) expect_call_error(b, e, b.X(), weight, b.GH(), b.GW(), {"weight", "ld = 0", "16"});

    lce::matrix_view<T> grad_hidden;
    grad_hidden.data = b.gh.data();
    grad_hidden.rows = 1;
    grad_hidden.cols = h;
    for (entry e : gradient_entries)
      expect_call_error(b, e, b.X(), b.W(), grad_hidden, b.GW(), {"grad_hidden", "ld = 0", "16"});

    lce::matrix_view<T> grad_weight;
    grad_weight.data = b.gw.data();
    grad_weight.rows = 1;
    grad_weight.cols = h;
    for (entry e : gradient_entries)
      expect_call_error(b, e, b.X(), b.W(), b.GH(), grad_weight, {"grad_weight", "ld = 0", "16"});
  }

  // A valid one-row view with ld > cols gives the results of ld == cols.
  const auto check_same = [&](std::int64_t n, std::int64_t v, layout strided) {
    const problem p = make_problem(n, h, v, 77 + static_cast<std::uint64_t>(n), rounder_for<T>(), 1.0, 1.0, 0.0);
    const auto g = random_vector(n, 5, -1.0, 1.0, round_to_float);
    const auto hg = random_vector(n, 6, -0.5, 0.5, round_to_float);
    const auto prefill = random_vector(v * h, 8, -1.0, 1.0, rounder_for<T>());
    auto op_dense = make_op<T>(lce::options{}, 1);
    auto op_strided = make_op<T>(lce::options{}, 1);
    const auto dense = exercise<T, T>(op_dense, p, g, hg, prefill);
    const auto with_ld = exercise<T, T>(op_strided, p, g, hg, prefill, strided);
    CHECK_MESSAGE(dense.bitwise_diff(with_ld).empty(), dense.bitwise_diff(with_ld));
  };
  SUBCASE("valid: hidden of 1 row with ld = cols + 5") { check_same(1, 9, layout{h + 5, -1, -1, -1}); }
  SUBCASE("valid: weight of 1 row with ld = cols + 3") { check_same(4, 1, layout{-1, h + 3, -1, -1}); }
}

// ---------------------------------------------------------------------------
// 2. The BLAS integer range, named as the caller's argument.
// ---------------------------------------------------------------------------

TEST_CASE("hardening: an ld beyond the BLAS int range names the argument, not the GEMM") {
  const std::int64_t h = 16, too_far = std::int64_t{INT_MAX} + 1;  // 2147483648
  SUBCASE("hidden: 1 row, ld = INT_MAX + 1 (only H elements are spanned)") {
    call_buffers<float> b(1, h, 5);
    for (entry e : every_entry)
      expect_call_error(b, e, {b.x.data(), 1, h, too_far}, b.W(), b.GH(), b.GW(),
                        {"hidden", "2147483648", "exceeds the GEMMs' integer range"}, {"gemm lda"});
  }
  SUBCASE("grad_weight: 1 row, ld = INT_MAX + 1") {
    call_buffers<float> b(3, h, 1);
    for (entry e : gradient_entries)
      expect_call_error(b, e, b.X(), b.W(), b.GH(), {b.gw.data(), 1, h, too_far},
                        {"grad_weight", "2147483648", "exceeds the GEMMs' integer range"}, {"gemm ldc", "gemm ld"});
  }
  SUBCASE("grad_hidden: 1 row, ld = INT_MAX + 1") {
    call_buffers<float> b(1, h, 5);
    for (entry e : gradient_entries)
      expect_call_error(b, e, b.X(), b.W(), {b.gh.data(), 1, h, too_far}, b.GW(),
                        {"grad_hidden", "2147483648", "exceeds the GEMMs' integer range"}, {"gemm ld"});
  }
}

// ---------------------------------------------------------------------------
// 3. One call at a time per operator.
// ---------------------------------------------------------------------------

TEST_CASE("hardening: a second thread calling a busy operator gets lce::error; the running call is unharmed") {
  using clock = std::chrono::steady_clock;
  const std::int64_t h = 256, v = 8000;
  const problem small = make_problem(2, h, 5, 3, round_to_float, 1.0, 1.0, 0.0);
  const auto small_x = make_matrix<float>(small.x, 2, h);
  const auto small_w = make_matrix<float>(small.w, 5, h);
  const auto small_y = make_targets<std::int64_t>(small.y);

  bool caught = false;
  // Retried once with more tokens if the long call ended before the second thread ever tried.
  for (const std::int64_t n : {std::int64_t{512}, std::int64_t{4096}}) {
    INFO("long call over N = " << n);
    rng r(42);
    matrix_buf<float> X(n, h), W(v, h);
    for (std::int64_t i = 0; i < n; ++i)
      for (std::int64_t k = 0; k < h; ++k) X.set(i, k, round_to_float(r.uniform(-1, 1)));
    for (std::int64_t j = 0; j < v; ++j)
      for (std::int64_t k = 0; k < h; ++k) W.set(j, k, round_to_float(r.uniform(-0.5, 0.5)));
    vector_buf<std::int64_t> Y(n);
    for (std::int64_t i = 0; i < n; ++i) Y.data[static_cast<std::size_t>(i)] = r.below(v);
    const vector_buf<float> G(std::vector<double>(static_cast<std::size_t>(n), -1.0));
    vector_buf<float> lp(n);
    matrix_buf<float> gh(n, h), gw(v, h);
    lp.fill(garbage<float>());
    gh.fill(garbage<float>());
    gw.fill(0.25f);

    auto op = make_op<float>(lce::options{}, 1);
    std::atomic<int> a_state{0};  // 0: not started, 1: about to call, 2: done
    std::string a_error;
    int a_attempts = 0;
    std::thread a([&] {
      a_state.store(1);
      for (;;) {
        ++a_attempts;
        try {
          op.forward_backward(X.cview(), W.cview(), Y.cview(), G.cview(), lp.view(), gh.view(), gw.view());
        } catch (const lce::error& e) {
          // The second thread's tiny call may hold the operator for a moment: try again.
          if (mentions(e.what(), "already running") && a_attempts < 100000) continue;
          a_error = e.what();
        } catch (const std::exception& e) {
          a_error = std::string("not an lce::error: ") + e.what();
        }
        break;
      }
      a_state.store(2);
    });

    while (a_state.load() == 0) std::this_thread::yield();
    std::optional<std::string> b_error;
    bool b_outputs_untouched = true;
    const auto deadline = clock::now() + std::chrono::seconds(20);
    while (!b_error && a_state.load() != 2 && clock::now() < deadline) {
      vector_buf<float> blp(2), blse(2);
      blp.fill(garbage<float>());
      blse.fill(7.0f);
      const auto before_lp = blp.bytes(), before_lse = blse.bytes();
      try {
        op.forward(small_x.cview(), small_w.cview(), small_y.cview(), blp.view(), blse.view());
      } catch (const lce::error& e) {
        b_error = std::string(e.what());
        b_outputs_untouched = blp.bytes() == before_lp && blse.bytes() == before_lse;
      }
    }
    a.join();
    REQUIRE_MESSAGE(a_error.empty(), "the long call failed: " << a_error);
    if (!b_error) {
      MESSAGE("the long call (N = " << n << ") ended before the second thread got in; retrying");
      continue;
    }
    caught = true;
    check_mentions(*b_error, {"forward", "already running a call on another thread"});
    CHECK_MESSAGE(b_outputs_untouched, "the refused call wrote its outputs");

    // The long call's results are those of the same call on a fresh operator.
    vector_buf<float> lp2(n);
    matrix_buf<float> gh2(n, h), gw2(v, h);
    lp2.fill(garbage<float>());
    gh2.fill(garbage<float>());
    gw2.fill(0.25f);
    auto fresh = make_op<float>(lce::options{}, 1);
    fresh.forward_backward(X.cview(), W.cview(), Y.cview(), G.cview(), lp2.view(), gh2.view(), gw2.view());
    CHECK_MESSAGE(lp.bytes() == lp2.bytes(), "logprobs of the contended call differ from a fresh operator's");
    CHECK_MESSAGE(gh.bytes() == gh2.bytes(), "grad_hidden of the contended call differs from a fresh operator's");
    CHECK_MESSAGE(gw.bytes() == gw2.bytes(), "grad_weight of the contended call differs from a fresh operator's");

    // Idle again: the operator serves the next call as usual.
    vector_buf<float> s_lp(2), s_lse(2), f_lp(2), f_lse(2);
    s_lp.fill(garbage<float>());
    s_lse.fill(garbage<float>());
    f_lp.fill(garbage<float>());
    f_lse.fill(garbage<float>());
    CHECK_NOTHROW(op.forward(small_x.cview(), small_w.cview(), small_y.cview(), s_lp.view(), s_lse.view()));
    fresh.forward(small_x.cview(), small_w.cview(), small_y.cview(), f_lp.view(), f_lse.view());
    CHECK(s_lp.bytes() == f_lp.bytes());
    CHECK(s_lse.bytes() == f_lse.bytes());
    break;
  }
  CHECK_MESSAGE(caught, "the second thread never saw the operator busy, even with the longer call");
}

// ---------------------------------------------------------------------------
// 4. Scratch held between calls, and given back.
// ---------------------------------------------------------------------------

TEST_CASE("hardening: bf16 with a bf16 grad_weight holds its fp32 accumulator until release_workspace") {
  using T = lce::bfloat16;
  const std::int64_t n = 24, h = 32, v = 300;
  const problem p = make_problem(n, h, v, 11, round_to_bf16, 1.0, 1.0, 0.1);
  const auto X = make_matrix<T>(p.x, n, h);
  const auto W = make_matrix<T>(p.w, v, h);
  const auto Y = make_targets<std::int64_t>(p.y);
  const vector_buf<float> G(random_vector(n, 2, -1.0, 1.0, round_to_float));
  auto op = make_op<T>(make_options(1.0f, 0.0f, 8), 1);
  CHECK(op.held_workspace_bytes() == 0);

  vector_buf<float> lp(n), lse(n);
  lp.fill(garbage<float>());
  lse.fill(garbage<float>());
  op.forward(X.cview(), W.cview(), Y.cview(), lp.view(), lse.view());

  const auto run_backward = [&] {
    matrix_buf<T> gh(n, h), gw(v, h);
    gh.fill(garbage<T>());
    gw.fill(to_elem<T>(0.5));
    op.backward(X.cview(), W.cview(), Y.cview(), lse.cview(), G.cview(), gh.view(), gw.view());
    return std::make_pair(gh.bytes(), gw.bytes());
  };
  const auto first = run_backward();
  const std::size_t accumulator = static_cast<std::size_t>(v * h) * sizeof(float);
  const std::size_t held = op.held_workspace_bytes();
  const std::size_t bound = op.workspace_bytes(n, h, v);
  CHECK(held >= accumulator);
  CHECK(held <= bound);

  op.release_workspace();
  CHECK(op.held_workspace_bytes() == 0);
  op.release_workspace();  // twice is harmless
  CHECK(op.held_workspace_bytes() == 0);

  const auto second = run_backward();
  CHECK_MESSAGE(first.first == second.first, "grad_hidden differs after release_workspace");
  CHECK_MESSAGE(first.second == second.second, "grad_weight differs after release_workspace");
  CHECK(op.held_workspace_bytes() == held);

  vector_buf<float> lp2(n), lse2(n);
  lp2.fill(garbage<float>());
  lse2.fill(garbage<float>());
  op.release_workspace();
  op.forward(X.cview(), W.cview(), Y.cview(), lp2.view(), lse2.view());
  CHECK(lp.bytes() == lp2.bytes());
  CHECK(lse.bytes() == lse2.bytes());
  CHECK(op.held_workspace_bytes() <= bound - accumulator);  // a forward reserves no accumulator
}

TEST_CASE("hardening: float with a float grad_weight holds no V x H accumulator") {
  const std::int64_t n = 64, h = 64, v = 1024;
  const problem p = make_problem(n, h, v, 12, round_to_float);
  const auto X = make_matrix<float>(p.x, n, h);
  const auto W = make_matrix<float>(p.w, v, h);
  const auto Y = make_targets<std::int64_t>(p.y);
  const vector_buf<float> G(random_vector(n, 3, -1.0, 1.0, round_to_float));
  auto op = make_op<float>(make_options(1.0f, 0.0f, 8), 1);
  vector_buf<float> lp(n);
  matrix_buf<float> gh(n, h), gw(v, h);
  lp.fill(garbage<float>());
  gh.fill(garbage<float>());
  gw.fill(0.0f);
  op.forward_backward(X.cview(), W.cview(), Y.cview(), G.cview(), lp.view(), gh.view(), gw.view());
  const std::size_t held = op.held_workspace_bytes();
  const std::size_t accumulator = static_cast<std::size_t>(v * h) * sizeof(float);
  CHECK(held > 0);
  CHECK(held <= op.workspace_bytes(n, h, v));
  CHECK(held < accumulator);
  op.release_workspace();
  CHECK(op.held_workspace_bytes() == 0);
}

// A forward_backward that writes a grad_weight of the compute type over keeps its logits there
// (one rank): its plan may hold more than the one a call without that takes (the vocabulary
// order for 2-byte inputs, or a starved float call's), and workspace_bytes still bounds it.
template <class T>
void kept_logits_within_workspace_bytes(std::int64_t n, std::int64_t h, std::int64_t v, std::size_t limit) {
  CAPTURE(sizeof(T));
  CAPTURE(n);
  CAPTURE(h);
  CAPTURE(v);
  CAPTURE(limit);
  const auto p = make_problem(n, h, v, 91, round_to<T>, 1.0, 1.0, 0.1);
  const auto X = make_matrix<T>(p.x, n, h);
  const auto W = make_matrix<T>(p.w, v, h);
  const auto Y = make_targets<std::int64_t>(p.y);
  using C = lce::compute_t<T>;
  const vector_buf<C> G(random_vector(n, 3, -1.0, 1.0, round_to_float));
  lce::options options;
  options.overwrite_weight_gradients = true;
  options.workspace_limit_bytes = limit;
  auto op = make_op<T>(options, 1);
  vector_buf<C> lp(n);
  matrix_buf<C> gh(n, h), gw(v, h);
  op.forward_backward(X.cview(), W.cview(), Y.cview(), G.cview(), lp.view(), gh.view(), gw.view());
  CAPTURE(op.held_workspace_bytes());
  CHECK(op.held_workspace_bytes() <= op.workspace_bytes(n, h, v));
}

TEST_CASE("hardening: workspace_bytes bounds a forward_backward that keeps its logits in a float grad_weight") {
  kept_logits_within_workspace_bytes<lce::bfloat16>(32, 64, 10000, std::size_t{256} << 20);
  kept_logits_within_workspace_bytes<lce::bfloat16>(64, 128, 10000, std::size_t{256} << 20);
  kept_logits_within_workspace_bytes<lce::float16>(65, 64, 4097, 5985650);
  kept_logits_within_workspace_bytes<float>(128, 128, 10000, 3200000);
  kept_logits_within_workspace_bytes<double>(64, 128, 10000, 1600000);
}

// ---------------------------------------------------------------------------
// 5. Size arithmetic: no wrap, no UB, negative sizes named.
// ---------------------------------------------------------------------------

TEST_CASE("hardening: workspace sizes that overflow size_t raise lce::error") {
  auto bf = make_op<lce::bfloat16>(make_options(1.0f, 0.0f, 1), 1);
  auto fp = make_op<float>(lce::options{}, 1);
  const std::int64_t big = std::int64_t{1} << 32;

  // Two chunks need the fp32 accumulator, 2^32 x 2^32 x 4 bytes alone.
  if (const auto m = error_of([&] { (void)bf.workspace_bytes(2, big, big); })) check_mentions(*m, {"size_t"});
  // float has no accumulator; a chunk row of 2^62 hidden columns does not fit either.
  if (const auto m = error_of([&] { (void)fp.workspace_bytes(1, std::int64_t{1} << 62, 1024); }))
    check_mentions(*m, {"size_t"});

  // vocab_local = INT64_MAX: the padded logit row alone overflows size_t, so
  // both raise lce::error (checked here) rather than return.
  if (const auto m = error_of([&] { (void)fp.workspace_bytes(1, 16, INT64_MAX); })) check_mentions(*m, {"size_t"});
  if (const auto m = error_of([&] { (void)fp.chunk_tokens(1, 16, INT64_MAX); })) check_mentions(*m, {"size_t"});

  // n_tokens = INT64_MAX with the budget: the chunk is the budget's, so both return.
  CHECK(fp.chunk_tokens(INT64_MAX, 16, 16) >= 1);
  CHECK(fp.workspace_bytes(INT64_MAX, 16, 16) > 0);
  // ... and with options.chunk_tokens = INT64_MAX the chunk is every token: raises.
  lce::options every;
  every.chunk_tokens = INT64_MAX;
  auto greedy = make_op<float>(every, 1);
  if (const auto m = error_of([&] { (void)greedy.workspace_bytes(INT64_MAX, 16, 16); }))
    check_mentions(*m, {"size_t"});
}

// A 2-byte T also sizes the block its weight is widened into (host's
// vocabulary tile rows x hidden): that arithmetic must not overflow int64
// either (UBSan: no signed overflow). All of these raise lce::error naming
// size_t; none returns.
TEST_CASE("hardening: bf16 sizes near INT64_MAX raise lce::error without signed overflow") {
  auto bf = make_op<lce::bfloat16>(lce::options{}, 1);
  if (const auto m = error_of([&] { (void)bf.workspace_bytes(1, 16, INT64_MAX); })) check_mentions(*m, {"size_t"});
  if (const auto m = error_of([&] { (void)bf.chunk_tokens(1, 16, INT64_MAX); })) check_mentions(*m, {"size_t"});
  if (const auto m = error_of([&] { (void)bf.workspace_bytes(1, std::int64_t{1} << 62, 1024); }))
    check_mentions(*m, {"size_t"});
  if (const auto m = error_of([&] { (void)bf.chunk_tokens(1, std::int64_t{1} << 62, 1024); }))
    check_mentions(*m, {"size_t"});
}

TEST_CASE("hardening: negative sizes to workspace_bytes and chunk_tokens name the size") {
  auto op = make_op<lce::bfloat16>(lce::options{}, 1);
  if (const auto m = error_of([&] { (void)op.workspace_bytes(-3, 16, 16); }))
    check_mentions(*m, {"workspace_bytes", "negative", "n_tokens -3"});
  if (const auto m = error_of([&] { (void)op.workspace_bytes(4, -5, 16); }))
    check_mentions(*m, {"workspace_bytes", "negative", "hidden -5"});
  if (const auto m = error_of([&] { (void)op.workspace_bytes(4, 16, -7); }))
    check_mentions(*m, {"workspace_bytes", "negative", "vocab_local -7"});
  if (const auto m = error_of([&] { (void)op.chunk_tokens(-3, 16, 16); }))
    check_mentions(*m, {"chunk_tokens", "negative", "n_tokens -3"});
  if (const auto m = error_of([&] { (void)op.chunk_tokens(4, -5, 16); }))
    check_mentions(*m, {"chunk_tokens", "negative", "hidden -5"});
  if (const auto m = error_of([&] { (void)op.chunk_tokens(4, 16, -7); }))
    check_mentions(*m, {"chunk_tokens", "negative", "vocab_local -7"});
}

// ---------------------------------------------------------------------------
// 6. fixed_chunk<K> against options.chunk_tokens.
// ---------------------------------------------------------------------------

TEST_CASE("hardening: fixed_chunk<8> refuses another options.chunk_tokens and wins over the budget") {
  using fixed_op = lce::ChunkedHiddenToLogprobs<lce::comm::single, float, lce::fixed_chunk<8>>;
  lce::options opt;
  opt.chunk_tokens = 5;
  if (const auto m = error_of([&] { fixed_op op(lce::comm::single{}, opt); }))
    check_mentions(*m, {"chunk_tokens = 5", "fixed_chunk<8>"});

  for (const std::int64_t chunk : {std::int64_t{0}, std::int64_t{8}}) {
    INFO("options.chunk_tokens = " << chunk);
    opt.chunk_tokens = chunk;
    opt.workspace_limit_bytes = std::size_t{1} << 40;  // a budget that alone would pick every token
    std::optional<fixed_op> op;
    REQUIRE_NOTHROW(op.emplace(lce::comm::single{}, opt));
    CHECK(op->chunk_tokens(100, 16, 50) == 8);
  }
}

// ---------------------------------------------------------------------------
// 7. Allocation failures.
// ---------------------------------------------------------------------------

namespace {
// A host whose allocations above `limit` bytes fail.
struct failing_host : lce::host {
  std::size_t limit = 0;
  failing_host() : lce::host(1) {}
  explicit failing_host(std::size_t bytes) : lce::host(1), limit(bytes) {}
  void* allocate(std::size_t bytes) {
    if (bytes > limit) throw std::bad_alloc();
    return lce::host::allocate(bytes);
  }
};
}  // namespace

TEST_CASE("hardening: a workspace that cannot be allocated is an lce::error, and nothing is written") {
  using failing_op = lce::ChunkedHiddenToLogprobs<lce::comm::single, float, lce::budget_chunk, failing_host>;
  static_assert(lce::backend<failing_host>);
  const std::int64_t n = 6, h = 16, v = 40;
  call_buffers<float> b(n, h, v);
  failing_op op(lce::comm::single{}, make_options(), failing_host{});
  for (entry e : every_entry) {
    INFO("entry point: " << std::string(entry_name(e)));
    const auto before = b.snapshot();
    if (const auto m = error_of([&] { b.invoke(op, e, b.X(), b.W(), b.GH(), b.GW()); }))
      check_mentions(*m, {"workspace: could not allocate", "bytes"});
    const auto after = b.snapshot();
    for (std::size_t k = 0; k < before.size(); ++k)
      CHECK_MESSAGE(before[k] == after[k],
                    "buffer '" << std::string(call_buffers<float>::buffer_name(k)) << "' was modified");
    CHECK(op.held_workspace_bytes() == 0);
  }
}

TEST_CASE("hardening: a bf16 grad_weight whose fp32 accumulator cannot be allocated is an lce::error") {
  using T = lce::bfloat16;
  using limited_op = lce::ChunkedHiddenToLogprobs<lce::comm::single, T, lce::budget_chunk, failing_host>;
  const std::int64_t n = 4, h = 64, v = 2048;  // accumulator 512 KiB; a 2-row chunk's scratch far less
  const std::size_t accumulator = static_cast<std::size_t>(v * h) * sizeof(float);
  call_buffers<T> b(n, h, v);
  limited_op op(lce::comm::single{}, make_options(1.0f, 0.0f, 2), failing_host{accumulator - 1});
  REQUIRE(op.workspace_bytes(n, h, v) - accumulator < accumulator - 1);
  for (entry e : gradient_entries) {
    INFO("entry point: " << std::string(entry_name(e)));
    const auto before = b.snapshot();
    if (const auto m = error_of([&] { b.invoke(op, e, b.X(), b.W(), b.GH(), b.GW()); }))
      check_mentions(*m, {"grad_weight", "accumulator", "could not allocate", std::to_string(accumulator)});
    const auto after = b.snapshot();
    for (std::size_t k = 0; k < before.size(); ++k)
      CHECK_MESSAGE(before[k] == after[k],
                    "buffer '" << std::string(call_buffers<T>::buffer_name(k)) << "' was modified");
  }
  // The operator is not left busy: a float grad_weight (no accumulator) goes through.
  vector_buf<float> lp(n);
  matrix_buf<float> gh(n, h), gw(v, h);
  gw.fill(0.0f);
  const lce::vector_view<const float> g{b.glp.data(), n};
  CHECK_NOTHROW(op.forward_backward(b.X(), b.W(), lce::vector_view<const std::int64_t>{b.y.data(), n}, g, lp.view(),
                                    gh.view(), gw.view()));
}
