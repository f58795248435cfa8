// The host backend's GEMM provider (lce/host/gemm_provider.hpp): a provider
// written here (plain loops that count their calls) plugged into
// lce::basic_host gives the default host's results and is the one that runs;
// one with the optional bf16 x bf16 -> fp32 GEMM runs the bfloat16 weights'
// logits and dX GEMMs; the concept rejects what is not a provider.
#include "support/harness.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <vector>

using namespace lce_test;

namespace {

struct call_counts {
  std::atomic<std::int64_t> gemm{0}, bf16_gemm{0}, split_gemm{0};
  std::atomic<std::int64_t> logits_columns{0};  // of `gemm`'s x w^T (A as it is, B transposed): columns of C
};

// C = alpha op(A) op(B) + beta C in plain loops, summed in the operands' type
// (single-threaded, thread-safe: it only reads the counters' address).
template <class A, class E>
void loop_gemm(lce::transpose ta, lce::transpose tb, std::int64_t m, std::int64_t n, std::int64_t k, A alpha,
               const E* a, std::int64_t lda, const E* b, std::int64_t ldb, A beta, A* c, std::int64_t ldc) {
  const auto at = [&](std::int64_t i, std::int64_t p) {
    return static_cast<A>(ta == lce::transpose::yes ? a[p * lda + i] : a[i * lda + p]);
  };
  const auto bt = [&](std::int64_t p, std::int64_t j) {
    return static_cast<A>(tb == lce::transpose::yes ? b[j * ldb + p] : b[p * ldb + j]);
  };
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      A sum = 0;
      for (std::int64_t p = 0; p < k; ++p) sum += at(i, p) * bt(p, j);
      c[i * ldc + j] = beta == A(0) ? alpha * sum : alpha * sum + beta * c[i * ldc + j];
    }
}

struct counting_gemm {
  std::shared_ptr<call_counts> counts = std::make_shared<call_counts>();

  template <class A>
  void gemm(lce::transpose ta, lce::transpose tb, std::int64_t m, std::int64_t n, std::int64_t k, A alpha, const A* a,
            std::int64_t lda, const A* b, std::int64_t ldb, A beta, A* c, std::int64_t ldc) const {
    counts->gemm.fetch_add(1);
    if (ta == lce::transpose::no && tb == lce::transpose::yes) counts->logits_columns.fetch_add(n);
    loop_gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
};

// The same, declared to parallelise itself: lce calls it from one thread.
struct counting_whole_gemm : counting_gemm {
  static constexpr bool parallelises_itself = true;
};

// With the bf16 GEMM: bf16 operands, products and sums in fp32.
struct counting_bf16_gemm : counting_gemm {
  bool available = true;

  bool bf16_gemm_available() const { return available; }
  void bf16_gemm(lce::transpose ta, lce::transpose tb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                 const lce::bfloat16* a, std::int64_t lda, const lce::bfloat16* b, std::int64_t ldb, float beta,
                 float* c, std::int64_t ldc) const {
    counts->bf16_gemm.fetch_add(1);
    loop_gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
};

struct counting_whole_bf16_gemm : counting_bf16_gemm {
  static constexpr bool parallelises_itself = true;
};

// With the split bf16 GEMM too: A in fp32 as hi = bf16(a) plus lo = bf16(a - hi), in loops.
struct counting_split_gemm : counting_bf16_gemm {
  bool split_available = true;

  bool split_bf16_gemm_available() const { return split_available; }
  template <class B>
  void split_bf16_gemm(lce::transpose ta, lce::transpose tb, std::int64_t m, std::int64_t n, std::int64_t k,
                       float alpha, const float* a, std::int64_t lda, const B* b, std::int64_t ldb, float beta,
                       float* c, std::int64_t ldc) const {
    counts->split_gemm.fetch_add(1);
    const std::int64_t rows = ta == lce::transpose::yes ? k : m, cols = ta == lce::transpose::yes ? m : k;
    std::vector<lce::bfloat16> hi(static_cast<std::size_t>(rows * lda)), lo(hi.size());
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t j = 0; j < cols; ++j) {
        const float x = a[r * lda + j];
        hi[r * lda + j] = lce::bfloat16(x);
        lo[r * lda + j] = lce::bfloat16(x - static_cast<float>(hi[r * lda + j]));
      }
    std::vector<lce::bfloat16> b16(static_cast<std::size_t>((tb == lce::transpose::yes ? n : k) * ldb));
    for (std::size_t i = 0; i < b16.size(); ++i) b16[i] = lce::bfloat16(static_cast<float>(b[i]));
    loop_gemm(ta, tb, m, n, k, alpha, hi.data(), lda, b16.data(), ldb, beta, c, ldc);
    loop_gemm(ta, tb, m, n, k, alpha, lo.data(), lda, b16.data(), ldb, 1.0f, c, ldc);
  }
};

struct not_a_provider {
  void gemm(lce::transpose, lce::transpose, std::int64_t, std::int64_t, std::int64_t, float, const float*,
            std::int64_t, const float*, std::int64_t, float, float*, std::int64_t) const {}
  // no double GEMM
};

struct bf16_without_query : counting_gemm {
  void bf16_gemm(lce::transpose, lce::transpose, std::int64_t, std::int64_t, std::int64_t, float,
                 const lce::bfloat16*, std::int64_t, const lce::bfloat16*, std::int64_t, float, float*,
                 std::int64_t) const {}
};

}  // namespace

static_assert(lce::gemm_provider<lce::cblas_gemm>);
static_assert(lce::gemm_provider<counting_gemm>);
static_assert(!lce::bf16_gemm_provider<counting_gemm>);
static_assert(lce::bf16_gemm_provider<counting_bf16_gemm>);
static_assert(!lce::gemm_provider<not_a_provider>);
static_assert(!lce::gemm_provider<int>);
static_assert(!lce::bf16_gemm_provider<bf16_without_query>);
static_assert(lce::split_bf16_gemm_provider<counting_split_gemm> && !lce::split_bf16_gemm_provider<counting_bf16_gemm>);
static_assert(lce::split_bf16_gemm_provider<lce::cblas_gemm>);
static_assert(!lce::gemm_parallelises_itself<counting_gemm> && lce::gemm_parallelises_itself<counting_whole_gemm>);
static_assert(std::is_same_v<lce::host, lce::basic_host<lce::cblas_gemm>>);
static_assert(lce::backend<lce::basic_host<counting_gemm>>);

namespace {

template <class T, class Gemm>
outputs<T, out_t<T>> run_with(Gemm gemm, const problem& p, const std::vector<double>& g,
                               const std::vector<double>& hg, const std::vector<double>& pre, int threads) {
  auto opt = make_options(1.0f, 0.0f, 0);
  opt.workspace_limit_bytes = std::size_t{1} << 20;  // several chunks
  lce::ChunkedHiddenToLogprobs<lce::comm::single, T, lce::budget_chunk, lce::basic_host<Gemm>> op(
      lce::comm::single{}, opt, lce::basic_host<Gemm>(gemm, threads));
  return exercise<T, out_t<T>>(op, p, g, hg, pre);
}

template <class T>
outputs<T, out_t<T>> run_default(const problem& p, const std::vector<double>& g, const std::vector<double>& hg,
                                 const std::vector<double>& pre) {
  auto opt = make_options(1.0f, 0.0f, 0);
  opt.workspace_limit_bytes = std::size_t{1} << 20;
  auto op = make_op<T>(opt, 2);
  return exercise<T, out_t<T>>(op, p, g, hg, pre);
}

}  // namespace

TEST_CASE_TEMPLATE("a user's GEMM provider runs every GEMM and matches the default host", T, float, double,
                   lce::bfloat16) {
  using O = out_t<T>;
  const problem p = make_problem(150, 96, 1500, 41, rounder_for<T>(), 1.0, 0.2, 0.1);
  const auto g = random_vector(p.n, 42, -1.0, 1.0, rounder_for<O>());
  const auto hg = random_vector(p.n, 43, -0.5, 0.5, rounder_for<O>());
  const auto pre = random_vector(p.v * p.h, 44, -1.0, 1.0, rounder_for<O>());
  const auto reference = run_default<T>(p, g, hg, pre);
  const double tol = std::is_same_v<T, double> ? 1e-12 : 1e-5;

  SUBCASE("per tile, from lce's threads") {
    const counting_gemm gemm;
    const auto o = run_with<T>(gemm, p, g, hg, pre, 3);
    CHECK(gemm.counts->gemm.load() > 0);
    check_close(o, reference, tol);
    check_against_reference(o, p, g, hg, pre);
  }
  SUBCASE("parallelising itself: from the calling thread") {
    const counting_whole_gemm gemm;
    const auto o = run_with<T>(gemm, p, g, hg, pre, 3);
    CHECK(gemm.counts->gemm.load() > 0);
    check_close(o, reference, tol);
  }
}

// A bfloat16 problem (inputs from `seed` on), with the default host's results on it.
struct bf16_case {
  problem p;
  std::vector<double> g, hg, pre;
  outputs<lce::bfloat16, out_t<lce::bfloat16>> reference;

  explicit bf16_case(std::uint64_t seed)
      : p(make_problem(150, 96, 1500, seed, rounder_for<lce::bfloat16>(), 1.0, 0.2, 0.1)),
        g(random_vector(p.n, seed + 1, -1.0, 1.0, rounder_for<float>())),
        hg(random_vector(p.n, seed + 2, -0.5, 0.5, rounder_for<float>())),
        pre(random_vector(p.v * p.h, seed + 3, -1.0, 1.0, rounder_for<float>())),
        reference(run_default<lce::bfloat16>(p, g, hg, pre)) {}
};

TEST_CASE_TEMPLATE("a provider's bf16 GEMM runs a bfloat16 weight's logits and dX, and matches", Gemm,
                   counting_bf16_gemm, counting_whole_bf16_gemm) {
  using T = lce::bfloat16;
  const bf16_case c(51);
  const auto& [p, g, hg, pre, reference] = c;

  const Gemm gemm;
  const auto o = run_with<T>(gemm, p, g, hg, pre, 2);
  // logits (forward, backward, forward_backward) and dX (backward, forward_backward): bf16;
  // dW stays an fp32 GEMM (its operands are the fp32 dz and hidden rows).
  CHECK(gemm.counts->bf16_gemm.load() >= 5);
  CHECK(gemm.counts->gemm.load() > 0);
  check_close(o, reference, 1e-5);
  check_against_reference(o, p, g, hg, pre);

  SUBCASE("not available on this CPU: the weight is widened for the fp32 GEMM") {
    Gemm unavailable;
    unavailable.available = false;
    const auto widened = run_with<T>(unavailable, p, g, hg, pre, 2);
    CHECK(unavailable.counts->bf16_gemm.load() == 0);
    CHECK(unavailable.counts->gemm.load() > gemm.counts->gemm.load());
    check_close(widened, reference, 1e-5);
  }
}

TEST_CASE("a provider's split bf16 GEMM runs a bfloat16 weight's dX and dW on dz as it is, and matches") {
  using T = lce::bfloat16;
  const bf16_case c(61);
  const auto& [p, g, hg, pre, reference] = c;

  const counting_split_gemm gemm;
  const auto o = run_with<T>(gemm, p, g, hg, pre, 2);
  // logits on the bf16 GEMM; dX and dW on the split one; no fp32 GEMM and no widened weight.
  CHECK(gemm.counts->split_gemm.load() >= 6);
  CHECK(gemm.counts->bf16_gemm.load() >= 3);
  CHECK(gemm.counts->gemm.load() == 0);
  check_close(o, reference, 1e-5);
  check_against_reference(o, p, g, hg, pre);

  SUBCASE("split GEMM not available: dX on the bf16 GEMM over dz split in its own pass, dW an fp32 GEMM") {
    counting_split_gemm unavailable;
    unavailable.split_available = false;
    const auto staged = run_with<T>(unavailable, p, g, hg, pre, 2);
    CHECK(unavailable.counts->split_gemm.load() == 0);
    CHECK(unavailable.counts->bf16_gemm.load() > 0);
    CHECK(unavailable.counts->gemm.load() > 0);
    check_close(staged, reference, 1e-5);
  }
}

TEST_CASE("basic_host: the provider object is the one held and called; threads as lce::host") {
  const counting_gemm gemm;
  lce::basic_host<counting_gemm> backend(gemm, 2);
  CHECK(backend.threads() == 2);
  CHECK(backend.gemm().counts == gemm.counts);
  const std::vector<float> a{1, 2, 3, 4}, b{5, 6, 7, 8};
  std::vector<float> c(4, -1.0f);
  backend.logits(lce::matrix_view<const float>{a.data(), 2, 2, 2}, lce::matrix_view<const float>{b.data(), 2, 2, 2},
                 1.0f, lce::matrix_view<float>{c.data(), 2, 2, 2}, nullptr);
  CHECK(gemm.counts->gemm.load() == 1);
  CHECK(c == std::vector<float>{17, 23, 39, 53});  // a b^T
  CHECK(lce::basic_host<counting_gemm>(gemm).threads() == lce::host{}.threads());
}

// A forward_backward that keeps its logits in grad_weight between its two
// sweeps over the vocabulary (overwrite_weight_gradients, grad_weight rows
// that hold a logit column of every token: tokens <= hidden in fp32, <=
// hidden / 2 for a 2-byte or a float grad_weight of a double operator)
// computes each logit once, as the token order does (one chunk without the
// overwrite), where the vocabulary order computes them twice: its GEMMs'
// columns sum to V, not 2 V (a 2-byte or float grad_weight without the
// overwrite takes the vocabulary order: 2 V).
TEST_CASE_TEMPLATE("a forward_backward keeping its logits in grad_weight computes each tile's logits once", T, float,
                   double, lce::bfloat16) {
  using C = lce::compute_t<T>;
  using G = std::conditional_t<std::is_same_v<T, double>, float, T>;
  // A third more room per grad_weight row than the limit: the tiles grow from a narrow first one, the last ragged.
  const std::int64_t n = 48, v = 5000;
  const std::int64_t h = n * static_cast<std::int64_t>(sizeof(C) / sizeof(G)) * 4 / 3;
  const problem p = make_problem(n, h, v, 81, rounder_for<T>(), 1.0, 0.3, 0.1);
  const auto g = random_vector(n, 82, -1.0, 1.0, rounder_for<C>());
  const auto X = make_matrix<T>(p.x, n, h);
  const auto W = make_matrix<T>(p.w, v, h);
  const auto Y = make_targets<std::int64_t>(p.y);
  const vector_buf<C> Gv(g);
  const double unit = std::is_same_v<G, C> ? 0.0 : std::is_same_v<G, float> ? 0x1p-24 : 0x1p-8;
  const auto run = [&](bool overwrite) {
    const counting_whole_gemm gemm;
    auto opt = make_options(1.0f, 0.0f, 0);
    opt.overwrite_weight_gradients = overwrite;
    lce::ChunkedHiddenToLogprobs<lce::comm::single, T, lce::budget_chunk, lce::basic_host<counting_whole_gemm>> op(
        lce::comm::single{}, opt, lce::basic_host<counting_whole_gemm>(gemm, 2));
    vector_buf<C> lp(n);
    matrix_buf<G> gh(n, h), gw(v, h);
    gw.fill(overwrite ? G(std::numeric_limits<float>::quiet_NaN()) : G(0.0f));
    op.forward_backward(X.cview(), W.cview(), Y.cview(), Gv.cview(), lp.view(), gh.view(), gw.view());
    const auto ref = reference_forward(p);
    const auto want = reference_backward(p, ref, g, {});
    std::int64_t off = 0;  // NaN counts as off
    for (std::int64_t j = 0; j < v * h; ++j)
      off += !(std::fabs(gw.get(j / h, j % h) - want.dw[j]) <= 1e-5 + unit * std::fabs(want.dw[j]));
    for (std::int64_t j = 0; j < n * h; ++j)
      off += !(std::fabs(gh.get(j / h, j % h) - want.dx[j]) <= 1e-5 + unit * std::fabs(want.dx[j]));
    CHECK(off == 0);
    return gemm.counts->logits_columns.load();
  };
  CHECK(run(true) == v);
  CHECK(run(false) == (std::is_same_v<G, C> ? v : 2 * v));
}
