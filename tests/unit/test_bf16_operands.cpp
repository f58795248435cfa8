// A GEMM provider with bf16_operands (lce/host/gemm_provider.hpp): a bfloat16
// operator's three GEMMs per chunk take the hidden rows as stored and dz
// rounded once to bf16, in the form of GPU fused losses (and of lce_torch,
// whose provider is MKL's bf16 GEMM). The shared bodies of tests/cases run
// through it against the long-double materialised reference, with the same
// tolerance for dz's rounding (u = 2^-8) as the CUDA suite; a float operator
// on the same provider keeps its fp32 GEMMs. The same bodies then run through
// lce::host_bf16_operands, lce's own provider so made (its AMX kernel on a CPU
// with AMX). Also: detail::widening_bf16_gemm (the fallback for a machine
// without a bf16 GEMM library) against plain loops.
#include "cases/backward_cases.hpp"
#include "cases/edge_cases.hpp"
#include "cases/error_cases.hpp"
#include "cases/forward_cases.hpp"
#include "cases/overwrite_cases.hpp"
#include "cases/target_set_cases.hpp"

#include <lce/host/detail/widening_bf16_gemm.hpp>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

using namespace lce_test;

namespace {

struct gemm_calls {
  struct shape {
    std::int64_t m, n, k;
  };
  std::atomic<std::int64_t> fp32{0}, bf16{0}, availability_asked{0};
  std::atomic<std::int64_t> logits_elements{0};  // of the bf16 GEMMs x w^T
  std::mutex bf16_shapes_mutex;
  std::vector<shape> bf16_shapes;  // each bf16 GEMM's output extent and depth
};

// Row-major C = alpha op(A) op(B) + beta C in plain loops, products and sums in fp32.
template <class E>
void loop_gemm(lce::transpose ta, lce::transpose tb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
               const E* a, std::int64_t lda, const E* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc) {
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      float sum = 0;
      for (std::int64_t p = 0; p < k; ++p) {
        const float x = static_cast<float>(ta == lce::transpose::yes ? a[p * lda + i] : a[i * lda + p]);
        const float y = static_cast<float>(tb == lce::transpose::yes ? b[j * ldb + p] : b[p * ldb + j]);
        sum += x * y;
      }
      c[i * ldc + j] = beta == 0.0f ? alpha * sum : alpha * sum + beta * c[i * ldc + j];
    }
}

// fp32 / fp64 GEMMs from the BLAS; the bf16 GEMM in plain loops, counted.
// It says its bf16 GEMM is unavailable: with bf16_operands lce must not ask
// (and, had it asked, it would have widened instead and never called it).
struct loop_bf16_operand_gemm {
  static constexpr bool bf16_operands = true;
  std::shared_ptr<gemm_calls> calls = std::make_shared<gemm_calls>();

  template <class A>
  void gemm(lce::transpose ta, lce::transpose tb, std::int64_t m, std::int64_t n, std::int64_t k, A alpha, const A* a,
            std::int64_t lda, const A* b, std::int64_t ldb, A beta, A* c, std::int64_t ldc) const {
    calls->fp32.fetch_add(1);
    lce::detail::gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
  bool bf16_gemm_available() const {
    calls->availability_asked.fetch_add(1);
    return false;
  }
  void bf16_gemm(lce::transpose ta, lce::transpose tb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                 const lce::bfloat16* a, std::int64_t lda, const lce::bfloat16* b, std::int64_t ldb, float beta,
                 float* c, std::int64_t ldc) const {
    calls->bf16.fetch_add(1);
    if (ta == lce::transpose::no && tb == lce::transpose::yes) calls->logits_elements.fetch_add(m * n);
    {
      const std::lock_guard lock(calls->bf16_shapes_mutex);
      calls->bf16_shapes.push_back({m, n, k});
    }
    loop_gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
};

using bf16_operand_host = lce::basic_host<loop_bf16_operand_gemm>;

static_assert(lce::gemm_reads_bf16_operands<loop_bf16_operand_gemm>);
static_assert(!lce::gemm_reads_bf16_operands<lce::cblas_gemm>);
static_assert(lce::backend<bf16_operand_host>);
static_assert(std::is_same_v<lce::gemm_operand_t<bf16_operand_host, lce::bfloat16>, lce::bfloat16>);
static_assert(std::is_same_v<lce::gemm_operand_t<bf16_operand_host, float>, float>);
static_assert(std::is_same_v<lce::gemm_operand_t<bf16_operand_host, lce::float16>, float>);
static_assert(std::is_same_v<lce::gemm_operand_t<lce::host, lce::bfloat16>, float>);

// Every operator an Env makes holds a copy of one provider, so a test can count its calls.
const loop_bf16_operand_gemm& shared_provider() {
  static const loop_bf16_operand_gemm provider;
  return provider;
}
gemm_calls& shared_calls() { return *shared_provider().calls; }

struct bf16_operands_env {
  static constexpr const char* name = "host, bf16 operands";

  template <class T, class Chunk = lce::budget_chunk>
  static lce::ChunkedHiddenToLogprobs<lce::comm::single, T, Chunk, bf16_operand_host> make_op(
      const lce::options& opt, int threads = 0) {
    return lce::ChunkedHiddenToLogprobs<lce::comm::single, T, Chunk, bf16_operand_host>(
        lce::comm::single{}, opt, bf16_operand_host(shared_provider(), threads));
  }

  template <class T>
  static constexpr double gradient_operand_unit = std::is_same_v<T, lce::bfloat16> ? 0x1p-8 : 0.0;
  template <class T>
  static constexpr double gradient_operand_floor = std::is_same_v<T, lce::bfloat16> ? 0x1p-134 : 0.0;
};

// The same provider, saying its bf16 GEMM runs as fast against memory as lce's kernel on AMX
// tiles (gemm_provider.hpp: bf16_gemm_flops_per_memory_byte), where a pass over memory costs
// more logits computed again than the default's.
struct amx_paced_loop_gemm : loop_bf16_operand_gemm {
  double bf16_gemm_flops_per_memory_byte() const { return lce::detail::amx_gemm_flops_per_memory_byte; }
};

struct amx_paced_bf16_operands_env {
  static constexpr const char* name = "host, bf16 operands, paced as AMX";

  template <class T, class Chunk = lce::budget_chunk>
  static lce::ChunkedHiddenToLogprobs<lce::comm::single, T, Chunk, lce::basic_host<amx_paced_loop_gemm>> make_op(
      const lce::options& opt, int threads = 0) {
    return lce::ChunkedHiddenToLogprobs<lce::comm::single, T, Chunk, lce::basic_host<amx_paced_loop_gemm>>(
        lce::comm::single{}, opt, lce::basic_host<amx_paced_loop_gemm>(amx_paced_loop_gemm{shared_provider()}, threads));
  }
};

static_assert(lce::default_gemm_flops_per_memory_byte < lce::detail::amx_gemm_flops_per_memory_byte);

// lce's own provider with bf16_operands (lce::host_bf16_operands): the chosen bf16 kernel
// (lce's AMX kernel on this CPU if it has AMX, oneDNN where linked and AMX is missing, else
// widening), with the same tolerance for dz's rounding.
struct cblas_bf16_operands_env {
  static constexpr const char* name = "lce::host_bf16_operands";

  template <class T, class Chunk = lce::budget_chunk>
  static lce::ChunkedHiddenToLogprobs<lce::comm::single, T, Chunk, lce::host_bf16_operands> make_op(
      const lce::options& opt, int threads = 0) {
    return lce::ChunkedHiddenToLogprobs<lce::comm::single, T, Chunk, lce::host_bf16_operands>(
        lce::comm::single{}, opt, lce::host_bf16_operands(threads));
  }

  template <class T>
  static constexpr double gradient_operand_unit = bf16_operands_env::gradient_operand_unit<T>;
  template <class T>
  static constexpr double gradient_operand_floor = bf16_operands_env::gradient_operand_floor<T>;
};

static_assert(lce::gemm_reads_bf16_operands<lce::cblas_gemm_bf16_operands>);
static_assert(std::is_same_v<lce::gemm_operand_t<lce::host_bf16_operands, lce::bfloat16>, lce::bfloat16>);

// Runs body() and checks which GEMMs it called: bf16 ones only for a bfloat16 operator.
template <class T, class Body>
void expect_gemms(Body&& body) {
  auto& calls = shared_calls();
  const std::int64_t fp32 = calls.fp32.load(), bf16 = calls.bf16.load();
  body();
  if constexpr (std::is_same_v<T, lce::bfloat16>) {
    CHECK(calls.bf16.load() > bf16);
    CHECK(calls.fp32.load() == fp32);  // no GEMM of a bf16 operator widens
  } else {
    CHECK(calls.bf16.load() == bf16);
    CHECK(calls.fp32.load() > fp32);
  }
  CHECK(calls.availability_asked.load() == 0);
}

}  // namespace

#define LCE_BF16_OPERAND_TYPES float, lce::bfloat16

TEST_CASE_TEMPLATE("bf16 operands: forward matches the materialised reference", T, LCE_BF16_OPERAND_TYPES) {
  expect_gemms<T>([] { cases::forward_matches_reference<bf16_operands_env, T>(); });
}

TEST_CASE_TEMPLATE("bf16 operands: ignored tokens give exactly zero log-prob and entropy", T,
                   LCE_BF16_OPERAND_TYPES) {
  cases::forward_ignored_tokens_zero<bf16_operands_env, T>();
}

TEST_CASE_TEMPLATE("bf16 operands: backward matches the reference gradients", T, LCE_BF16_OPERAND_TYPES) {
  expect_gemms<T>([] { cases::backward_matches_reference<bf16_operands_env, T>(); });
}

TEST_CASE_TEMPLATE("bf16 operands: forward_backward matches the reference", T, LCE_BF16_OPERAND_TYPES) {
  expect_gemms<T>([] { cases::forward_backward_matches_reference<bf16_operands_env, T>(); });
}

TEST_CASE_TEMPLATE("bf16 operands: forward_backward equals forward then backward", T, LCE_BF16_OPERAND_TYPES) {
  cases::forward_backward_equals_two_calls<bf16_operands_env, T>();
}

TEST_CASE_TEMPLATE("bf16 operands: gradients over a vocabulary of several GEMM tiles", T, LCE_BF16_OPERAND_TYPES) {
  cases::gradients_over_several_tiles<bf16_operands_env, T>();
}

TEST_CASE_TEMPLATE("bf16 operands: all tokens ignored: zero outputs and gradients", T, LCE_BF16_OPERAND_TYPES) {
  cases::all_tokens_ignored<bf16_operands_env, T>();
}

TEST_CASE_TEMPLATE("bf16 operands: strided buffers: correct, padding untouched", T, LCE_BF16_OPERAND_TYPES) {
  cases::strided_buffers<bf16_operands_env, T>();
}

TEST_CASE_TEMPLATE("bf16 operands: int32 and int64 targets give identical results", T, LCE_BF16_OPERAND_TYPES) {
  cases::int32_and_int64_targets<bf16_operands_env, T>();
}

TEST_CASE_TEMPLATE("bf16 operands: target sets: forward", T, LCE_BF16_OPERAND_TYPES) {
  cases::target_sets_forward<bf16_operands_env, T>();
}

TEST_CASE_TEMPLATE("bf16 operands: target sets: gradients", T, LCE_BF16_OPERAND_TYPES) {
  cases::target_sets_gradients<bf16_operands_env, T>();
}

TEST_CASE_TEMPLATE("bf16 operands: bad target ids raise lce::error; nothing written", T, LCE_BF16_OPERAND_TYPES) {
  cases::fixture<T, bf16_operands_env> f;
  for (cases::entry e : cases::all_entries) f.expect_ok(e);
  const auto all = {cases::entry::forward, cases::entry::forward_entropy, cases::entry::backward,
                    cases::entry::backward_entropy, cases::entry::forward_backward};
  cases::bad_target_subcases(f, all);
}

TEST_CASE("bf16 operands: no weight tile is widened and dz overwrites its logit row: no block but the logits") {
  const auto opt = make_options(1.0f, 0.0f, 64);
  const auto widening = make_op<lce::bfloat16>(opt, 2);
  const auto direct = bf16_operands_env::make_op<lce::bfloat16>(opt, 2);
  const std::int64_t n = 64, h = 256, v = 8192;
  // Both hold a chunk's fp32 logits (one chunk: and two slots of dW tiles, none where the
  // lce's own kernel rounds them into grad_weight itself); the bf16 one has no widened weight
  // tiles, no widened hidden rows and no dz block of its own (dz is rounded over the first
  // half of each logit row), so only the per-row arrays are left.
  const std::size_t logits = static_cast<std::size_t>(n * v) * sizeof(float);
  const bf16_operand_host backend(shared_provider(), 1);
  const std::size_t tiles = 2 * sizeof(float) *
      static_cast<std::size_t>(backend.weight_gradient_tile_elements<float, lce::bfloat16, lce::bfloat16>(h, v, n));
  CHECK(tiles > 0);
  // lce's own provider rounds the tiles into grad_weight on its own kernel (AMX or
  // AVX512-BF16), so it holds none there.
  const std::size_t own_tiles = static_cast<std::size_t>(
      lce::host_bf16_operands(1).weight_gradient_tile_elements<float, lce::bfloat16, lce::bfloat16>(h, v, n));
  CHECK((own_tiles == 0) ==
        (lce::detail::amx_bf16_gemm_available() || lce::detail::avx512_bf16_gemm_available()));
  CHECK(direct.workspace_bytes(n, h, v) < widening.workspace_bytes(n, h, v));
  CHECK(direct.workspace_bytes(n, h, v) >= logits + tiles);
  CHECK(direct.workspace_bytes(n, h, v) < logits + tiles + std::size_t(64 * v * 2) / 4);
}

TEST_CASE("detail::widening_bf16_gemm equals the bf16 GEMM in plain loops") {
  const auto sgemm = [](lce::transpose ta, lce::transpose tb, std::int64_t m, std::int64_t n, std::int64_t k,
                        float alpha, const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta,
                        float* c, std::int64_t ldc) { lce::detail::gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc); };
  const std::int64_t m = 37, n = 53, lda = 700, ldb = 700, ldc = 61;
  for (const std::int64_t k : {std::int64_t{0}, std::int64_t{1}, std::int64_t{255}, std::int64_t{600}}) {
    for (const auto ta : {lce::transpose::no, lce::transpose::yes})
      for (const auto tb : {lce::transpose::no, lce::transpose::yes})
        for (const float beta : {0.0f, 1.0f}) {
          CAPTURE(k);
          CAPTURE(static_cast<int>(ta));
          CAPTURE(static_cast<int>(tb));
          CAPTURE(beta);
          const auto a = random_vector(700 * 700, 7 + k, -1.0, 1.0, rounder_for<lce::bfloat16>());
          const auto b = random_vector(700 * 700, 9 + k, -1.0, 1.0, rounder_for<lce::bfloat16>());
          std::vector<lce::bfloat16> ab(a.size()), bb(b.size());
          for (std::size_t i = 0; i < a.size(); ++i) ab[i] = lce::bfloat16(static_cast<float>(a[i]));
          for (std::size_t i = 0; i < b.size(); ++i) bb[i] = lce::bfloat16(static_cast<float>(b[i]));
          std::vector<float> want(m * ldc, 0.5f), got(m * ldc, 0.5f);
          got[m * ldc - 1] = want[m * ldc - 1] = -7.0f;  // past the last row's n columns: untouched
          loop_gemm(ta, tb, m, n, k, 0.75f, ab.data(), lda, bb.data(), ldb, beta, want.data(), ldc);
          lce::detail::widening_bf16_gemm(sgemm, ta, tb, m, n, k, 0.75f, ab.data(), lda, bb.data(), ldb, beta,
                                          got.data(), ldc);
          double worst = 0;
          for (std::size_t i = 0; i < got.size(); ++i)
            worst = std::max(worst, std::fabs(double(got[i]) - double(want[i])) / (1.0 + std::sqrt(double(k))));
          CHECK(worst < 1e-5);
          CHECK(got[m * ldc - 1] == -7.0f);
        }
  }
}

// The vocabulary order (test_vocabulary_order.cpp) with bf16 operands: dz is
// rounded to bf16 over the first half of each tile's own fp32 logit rows and
// the gradient GEMMs read it tile by tile; every result against the
// reference (within dz's rounding), bitwise the same for 1 and 3 threads.
// With a 0.5 MiB budget the tokens go through each tile in slices (about 30
// and 18 rows), each tile's dW summed in a [4,096, H] fp32 accumulator.
TEST_CASE("bf16 operands: the vocabulary order (all tokens at once, the vocabulary a tile at a time)") {
  using T = lce::bfloat16;
  const std::int64_t n = 48, h = 64, v = 12001;  // tiles of >= 4,096 rows, a ragged last one
  const std::size_t tile_accumulator = std::size_t{4096} * h * sizeof(float);
  for (const bool slices : {false, true}) {
    CAPTURE(slices);
    lce::options budget = make_options(0.8f, 4.0f);
    budget.workspace_limit_bytes = slices ? std::size_t{512} << 10 : std::size_t{1280} << 10;
    problem p = make_problem(n, h, v, 91, rounder_for<T>(), 1.0, 0.3, 0.1);
    p.tau = budget.temperature;
    p.cap = budget.softcap;
    const auto g = random_vector(n, 92, -1.0, 1.0, rounder_for<float>());
    const auto hg = random_vector(n, 93, -0.5, 0.5, rounder_for<float>());
    const auto pre = random_vector(v * h, 94, -1.0, 1.0, rounder_for<T>());

    auto op = bf16_operands_env::make_op<T>(budget, 3);
    REQUIRE(op.chunk_tokens(n, h, v) < n);
    std::optional<outputs<T, T>> result;
    expect_gemms<T>([&] { result.emplace(exercise<T, T>(op, p, g, hg, pre)); });
    const auto& tiled = *result;
    check_against_reference(tiled, p, g, hg, pre, bf16_operands_env::gradient_operand_unit<T>,
                            bf16_operands_env::gradient_operand_floor<T>);
    const std::size_t accumulator = static_cast<std::size_t>(v * h) * sizeof(float);
    const std::size_t one_chunk = static_cast<std::size_t>(n * v) * sizeof(float);
    CHECK(op.held_workspace_bytes() < accumulator);  // neither the accumulator
    CHECK(op.held_workspace_bytes() < one_chunk);    // nor every token over the whole vocabulary
    CHECK(op.workspace_bytes(n, h, v) == op.held_workspace_bytes());
    // A tile's accumulator and a slice's block within the budget, or every token over a tile.
    if (slices) CHECK(op.held_workspace_bytes() <= budget.workspace_limit_bytes + tile_accumulator);
    if (slices) CHECK(op.held_workspace_bytes() >= tile_accumulator);
    // Every token over a tile of the host's 1,024 columns (min_efficient_vocabulary_tile; a 32nd of v is less).
    if (!slices) CHECK(op.held_workspace_bytes() >= std::size_t{1024} * n * sizeof(float));

    auto one_thread = bf16_operands_env::make_op<T>(budget, 1);
    const auto diff = exercise<T, T>(one_thread, p, g, hg, pre).bitwise_diff(tiled);
    CHECK_MESSAGE(diff.empty(), "host{1} vs host{3}: " << diff);
  }
}

// A forward_backward over a bf16 grad_weight whose rows hold a logit
// column of every token in fp32 (N <= H / 2) keeps its logits there between
// its two sweeps over the vocabulary, dz rounded over the first half of each
// kept row (overwrite_cases.hpp: against the reference, every scaling).
// Each logit is then computed once, where the vocabulary order without
// the overwrite computes them twice: the logits GEMMs' outputs sum to N x V,
// not 2 N x V. At N = H / 2 exactly, the first tile is half the vocabulary
// order's (1,024 columns here) and computed twice, and the block holds no
// more than half a tile. At N = H, where a row holds half a logit column of
// every token in fp32, the logits are kept as bf16 ratios to their row's
// largest (a whole column a row, in tiles of 768 columns): every tile's but the
// first two (the second's row centres would take rows of the first's), computed again.
// At N = 2 H and 4 H the tiles whose ratios the rows before them hold are kept,
// the others computed again; past 4 H every logit is computed twice.
TEST_CASE("bf16 operands: a forward_backward keeps its logits in a bf16 grad_weight between its sweeps") {
  using T = lce::bfloat16;
  expect_gemms<T>([] { cases::overwrite::logits_kept_in_grad_weight<bf16_operands_env, T>(3); });
  cases::overwrite::logits_kept_in_grad_weight<cblas_bf16_operands_env, T>(3);

  const std::int64_t n = 48, v = 12001, tile = 1024;  // the host's min_efficient_vocabulary_tile
  const std::int64_t ratio_tile = 768;                 // the ratios' tiles (kept_ratios_tile_columns)
  const auto logits_computed = [&](std::int64_t h, bool overwrite, std::size_t* held = nullptr) {
    const problem p = make_problem(n, h, v, 95, rounder_for<T>(), 1.0, 0.3, 0.1);
    const vector_buf<float> G(random_vector(n, 96, -1.0, 1.0, rounder_for<float>()));
    const auto X = make_matrix<T>(p.x, n, h);
    const auto W = make_matrix<T>(p.w, v, h);
    const auto Y = make_targets<std::int64_t>(p.y);
    auto opt = make_options(1.0f, 0.0f);
    opt.overwrite_weight_gradients = overwrite;
    auto op = bf16_operands_env::make_op<T>(opt, 2);
    vector_buf<float> lp(n);
    matrix_buf<T> gh(n, h), gw(v, h);
    gw.fill(overwrite ? lce::bfloat16(std::numeric_limits<float>::quiet_NaN()) : lce::bfloat16(0.0f));
    const std::int64_t before = shared_calls().logits_elements.load();
    op.forward_backward(X.cview(), W.cview(), Y.cview(), G.cview(), lp.view(), gh.view(), gw.view());
    std::int64_t nan = 0;
    for (std::int64_t j = 0; j < v * h; ++j) nan += std::isnan(gw.get(j / h, j % h));
    CHECK(nan == 0);
    if (held) *held = op.held_workspace_bytes();
    return shared_calls().logits_elements.load() - before;
  };
  for (const std::int64_t h : {128, 96, 48, 24, 12, 8}) {
    CAPTURE(h);
    std::size_t held = 0;
    const std::int64_t kept = logits_computed(h, true, &held);
    CAPTURE(held);
    CAPTURE(kept);
    if (h > 2 * n) {
      CHECK(kept == n * v);
    } else if (h == 2 * n) {
      CHECK((kept > n * v && kept <= n * (v + tile / 2)));
      CHECK(held < static_cast<std::size_t>(n * tile) * sizeof(float));
    } else if (h == n) {
      CHECK((kept > n * v && kept <= n * (v + 2 * ratio_tile)));
    } else if (h * 4 >= n) {
      CHECK((kept > n * v + 2 * ratio_tile && kept < 2 * n * v));  // some tiles kept, the others computed again
    } else {
      CHECK(kept == 2 * n * v);  // past N = 4 H: the vocabulary order, every logit twice
    }
    CHECK(logits_computed(h, false) == 2 * n * v);
  }
}

// A long forward_backward (N far past the hidden size: no logits kept) that
// writes its bf16 grad_weight over takes the token order's three GEMMs, its
// fp32 dW sum half in grad_weight's storage (overwrite_cases.hpp checks that
// against the reference), over the vocabulary order's four, where the rest of
// the sum and its chunks hold at most a tenth of the call's fp32 logits and
// the budget (detail/engine.hpp: accumulator_in_grad_weight_plan): each logit
// computed once, N x V, where without the overwrite the vocabulary order
// computes them twice. Under a budget of 12 MiB here (N 3,072, H 8, V 9,000:
// the vocabulary order's 4,096-column tile in slices holds less than the token
// order's chunks and whole sum). The outputs are the vocabulary order's.
TEST_CASE("bf16 operands: a long forward_backward takes three GEMMs, its dW sum in part in grad_weight") {
  using T = lce::bfloat16;
  constexpr std::int64_t n = 3072, h = 8, v = 9000;
  constexpr std::size_t budget = std::size_t{12} << 20;
  const problem p = make_problem(n, h, v, 85, rounder_for<T>(), 1.0, 0.3, 0.1);
  const vector_buf<float> G(random_vector(n, 86, -1.0, 1.0, rounder_for<float>()));
  const auto X = make_matrix<T>(p.x, n, h);
  const auto W = make_matrix<T>(p.w, v, h);
  const auto Y = make_targets<std::int64_t>(p.y);
  struct result {
    std::int64_t logits;
    std::size_t held;
    vector_buf<float> lp;
    matrix_buf<T> gh, gw;
  };
  const auto run = [&](bool overwrite) {
    auto opt = make_options(1.0f, 0.0f);
    opt.overwrite_weight_gradients = overwrite;
    opt.workspace_limit_bytes = budget;
    auto op = bf16_operands_env::make_op<T>(opt, 2);
    result r{0, 0, vector_buf<float>(n), matrix_buf<T>(n, h), matrix_buf<T>(v, h)};
    r.gw.fill(overwrite ? lce::bfloat16(std::numeric_limits<float>::quiet_NaN()) : lce::bfloat16(0.0f));
    const std::int64_t before = shared_calls().logits_elements.load();
    op.forward_backward(X.cview(), W.cview(), Y.cview(), G.cview(), r.lp.view(), r.gh.view(), r.gw.view());
    r.logits = shared_calls().logits_elements.load() - before;
    r.held = op.held_workspace_bytes();
    CHECK(op.workspace_bytes(n, h, v) >= r.held);
    return r;
  };
  const result split = run(true), vocabulary_order = run(false);
  CHECK(split.logits == n * v);
  CHECK(vocabulary_order.logits == 2 * n * v);
  CAPTURE(split.held);
  CHECK(split.held <= std::min(budget, static_cast<std::size_t>(n * v) * sizeof(float) / 10));
  CHECK(split.held >= static_cast<std::size_t>(v / 2 * h) * sizeof(float));
  // The same sums in another order: within the outputs' rounding (dW and dX in bf16).
  double worst_lp = 0, worst_gh = 0, worst_gw = 0, largest_gw = 0;
  std::int64_t nan = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    worst_lp = std::max(worst_lp, std::fabs(split.lp.get(i) - vocabulary_order.lp.get(i)));
    for (std::int64_t k = 0; k < h; ++k)
      worst_gh = std::max(worst_gh, std::fabs(split.gh.get(i, k) - vocabulary_order.gh.get(i, k)) /
                                        std::max(1e-3, std::fabs(vocabulary_order.gh.get(i, k))));
  }
  for (std::int64_t j = 0; j < v; ++j)
    for (std::int64_t k = 0; k < h; ++k) {
      nan += std::isnan(split.gw.get(j, k));
      largest_gw = std::max(largest_gw, std::fabs(vocabulary_order.gw.get(j, k)));
      worst_gw = std::max(worst_gw, std::fabs(split.gw.get(j, k) - vocabulary_order.gw.get(j, k)));
    }
  CHECK(nan == 0);
  CHECK(worst_lp < 1e-4);
  CHECK(worst_gh < 3 * 0x1p-8);
  CHECK(worst_gw <= 3 * 0x1p-8 * largest_gw);
}

// The pace the host reports for a T operator's GEMMs: its provider's for bf16 where they run on
// its bf16 GEMM, the default otherwise (float and float16 are widened for the fp32 GEMM).
TEST_CASE("gemm_flops_per_memory_byte: the provider's bf16 figure, 80 on AMX tiles, else the default") {
  const auto kernel = lce::detail::chosen_bf16_gemm_kernel();
  const bool on_amx = kernel == lce::detail::bf16_gemm_kernel::amx ||
                      (kernel == lce::detail::bf16_gemm_kernel::onednn && lce::detail::amx_bf16_gemm_available());
  CAPTURE(lce::detail::bf16_gemm_description(kernel));
  const lce::host_bf16_operands lce_own(1);
  CHECK(lce::gemm_flops_per_memory_byte<lce::bfloat16>(lce_own) == (on_amx ? 80.0 : 16.0));
  CHECK(lce::gemm_flops_per_memory_byte<float>(lce_own) == lce::default_gemm_flops_per_memory_byte);
  const bf16_operand_host loops(shared_provider(), 1);  // a provider without a figure of its own
  CHECK(lce::gemm_flops_per_memory_byte<lce::bfloat16>(loops) == lce::default_gemm_flops_per_memory_byte);
  const lce::basic_host<amx_paced_loop_gemm> paced(amx_paced_loop_gemm{shared_provider()}, 1);
  CHECK(lce::gemm_flops_per_memory_byte<lce::bfloat16>(paced) == lce::detail::amx_gemm_flops_per_memory_byte);
  CHECK(lce::gemm_flops_per_memory_byte<lce::float16>(paced) == lce::default_gemm_flops_per_memory_byte);
  CHECK(lce::gemm_flops_per_memory_byte<float>(paced) == lce::default_gemm_flops_per_memory_byte);
}

// Where the whole dW sum does not fit a tenth of the call's fp32 logits and the budget, the
// token order holds the part of it that grad_weight's storage and the rest of the limit do,
// and a second sweep makes the dW of the shard's last rows, every token at once, their
// logits computed again (detail/engine.hpp: tail_sweep_plan): fewer logits than the
// vocabulary order's 2 N V. Under a budget of 5.3 MiB here (N 2,304, H 16, V 7,000; chunks of
// 192 tokens, 3,499 sum rows in grad_weight, some 2,000 in scratch). Every row term's
// gradient (log-probs, entropy, lse, mean logit; the entropy's row term is kept from the
// first sweep for the second), a temperature and a soft-cap, grad_weight NaN before: against
// the materialised reference in long double; the same bits on 1 and 2 threads; through the
// counting provider and lce's own (lce::host_bf16_operands). A provider whose GEMMs outrun
// memory as AMX tiles do takes the vocabulary order instead (tail_sweep_cost: the chunks'
// passes over the sum cost more than its logits computed again), with the same values.
TEST_CASE("bf16 operands: a long forward_backward sums most of dW in the token order and sweeps its tail again") {
  using T = lce::bfloat16;
  constexpr std::int64_t n = 2304, h = 16, v = 7000;
  constexpr std::size_t budget = std::size_t{5427} << 10;  // 5.3 MiB
  problem p = make_problem(n, h, v, 87, rounder_for<T>(), 1.0, 0.3, 0.1);
  p.tau = 0.8f;
  p.cap = 4.0f;
  const forward_result ref = reference_forward(p);
  const std::vector<double> g = random_vector(n, 88, -1, 1, rounder_for<float>());
  const std::vector<double> hg = random_vector(n, 89, -0.5, 0.5, rounder_for<float>());
  const std::vector<double> q = random_vector(n, 90, 0.0, 0.3, rounder_for<float>());
  const std::vector<double> m = random_vector(n, 91, -0.3, 0.0, rounder_for<float>());
  const gradients want = reference_with_terms(p, ref, g, hg, q, m);
  const auto X = make_matrix<T>(p.x, n, h);
  const auto W = make_matrix<T>(p.w, v, h);
  const auto Y = make_targets<std::int64_t>(p.y);
  const vector_buf<float> G(g), HG(hg), Q(q), M(m);
  struct result {
    vector_buf<float> lp, lse, ent, ml;
    matrix_buf<T> gh, gw;
    std::size_t held = 0;
  };
  const auto run = [&](auto env, int threads) {
    auto opt = make_options(p.tau, p.cap);
    opt.overwrite_weight_gradients = true;
    opt.workspace_limit_bytes = budget;
    auto op = decltype(env)::template make_op<T>(opt, threads);
    result r{vector_buf<float>(n), vector_buf<float>(n), vector_buf<float>(n), vector_buf<float>(n),
             matrix_buf<T>(n, h), matrix_buf<T>(v, h)};
    r.gw.fill(lce::bfloat16(std::numeric_limits<float>::quiet_NaN()));
    op.forward_backward(X.cview(), W.cview(), Y.cview(),
                        lce::row_gradients<float>{G.cview(), HG.cview(), Q.cview(), M.cview()},
                        lce::row_outputs<float>{r.lp.view(), r.lse.view(), r.ent.view(), r.ml.view()}, r.gh.view(),
                        r.gw.view());
    r.held = op.held_workspace_bytes();
    CHECK(op.workspace_bytes(n, h, v) >= r.held);
    return r;
  };
  const auto check = [&](const result& r) {
    CAPTURE(r.held);
    check_row_outputs(p, ref, r.lp, r.lse, r.ent, r.ml, base_tol<T>() * 10);
    // dz rounded once to bf16 for the GEMMs (2^-8), dX and dW rounded to bf16 (2^-9).
    LCE_CHECK_CMP(compare_gradient("dX", r.gh, want.dx, 3 * 0x1p-8));
    LCE_CHECK_CMP(compare_gradient("dW", r.gw, want.dw, 3 * 0x1p-8));
    std::int64_t nan = 0;
    for (std::int64_t j = 0; j < v; ++j)
      for (std::int64_t k = 0; k < h; ++k) nan += std::isnan(r.gw.get(j, k));
    CHECK(nan == 0);
  };
  const std::int64_t before = shared_calls().logits_elements.load();
  const result counted = run(bf16_operands_env{}, 2);
  const std::int64_t logits = shared_calls().logits_elements.load() - before;
  CAPTURE(logits);
  // The chunks' N V, then N of every tail column: more than 512 columns, fewer than half.
  CHECK(logits > n * v + n * 512);
  CHECK(logits < n * v + n * (v / 2));
  check(counted);
  const result one_thread = run(bf16_operands_env{}, 1);
  // Within the limit with one thread's dW tiles (a provider that does not round into bf16 has a
  // tile per thread, on top, as the vocabulary order's: the plan never depends on the threads).
  CAPTURE(one_thread.held);
  CHECK(one_thread.held <= std::min(budget, static_cast<std::size_t>(n * v) * sizeof(float) / 10));
  CHECK(one_thread.gw.bytes() == counted.gw.bytes());
  CHECK(one_thread.gh.bytes() == counted.gh.bytes());
  CHECK(one_thread.lp.bytes() == counted.lp.bytes());
  check(run(cblas_bf16_operands_env{}, 2));

  {
    const std::int64_t paced_before = shared_calls().logits_elements.load();
    const result paced = run(amx_paced_bf16_operands_env{}, 2);
    const std::int64_t paced_logits = shared_calls().logits_elements.load() - paced_before;
    CAPTURE(paced_logits);
    // The vocabulary order: every logit twice, but those of the tile its block still holds.
    CHECK(paced_logits > n * v + n * (v / 2));
    CHECK(paced_logits <= 2 * n * v);
    check(paced);
  }

  // With a bias: the reference is the same call with one more hidden column, 1 for every
  // token, whose weight column is the bias (the bias joins the raw logit); its dW column is db.
  problem with_ones = p;
  with_ones.h = h + 1;
  with_ones.x.assign(static_cast<std::size_t>(n * (h + 1)), 1.0);
  with_ones.w.assign(static_cast<std::size_t>(v * (h + 1)), 0.0);
  const std::vector<double> b = random_vector(v, 92, -0.5, 0.5, rounder_for<T>());
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t k = 0; k < h; ++k)
      with_ones.x[static_cast<std::size_t>(i * (h + 1) + k)] = p.x[static_cast<std::size_t>(i * h + k)];
  for (std::int64_t j = 0; j < v; ++j) {
    for (std::int64_t k = 0; k < h; ++k)
      with_ones.w[static_cast<std::size_t>(j * (h + 1) + k)] = p.w[static_cast<std::size_t>(j * h + k)];
    with_ones.w[static_cast<std::size_t>(j * (h + 1) + h)] = b[static_cast<std::size_t>(j)];
  }
  const forward_result ref_b = reference_forward(with_ones);
  const gradients want_b = reference_with_terms(with_ones, ref_b, g, hg, q, m);
  const auto columns = [&](const std::vector<double>& wide, std::int64_t rows, std::int64_t first, std::int64_t count) {
    std::vector<double> out;
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t k = first; k < first + count; ++k) out.push_back(wide[static_cast<std::size_t>(r * (h + 1) + k)]);
    return out;
  };
  std::vector<T> bias(static_cast<std::size_t>(v));
  for (std::int64_t j = 0; j < v; ++j) bias[static_cast<std::size_t>(j)] = to_elem<T>(b[static_cast<std::size_t>(j)]);
  auto opt = make_options(p.tau, p.cap);
  opt.overwrite_weight_gradients = true;
  opt.workspace_limit_bytes = budget;
  auto op = bf16_operands_env::make_op<T>(opt, 2);
  vector_buf<float> lp(n), lse(n), ent(n), ml(n);
  matrix_buf<T> gh(n, h), gw(v, h);
  matrix_buf<float> gb(v, 1);
  gw.fill(lce::bfloat16(std::numeric_limits<float>::quiet_NaN()));
  gb.fill(std::numeric_limits<float>::quiet_NaN());
  const std::int64_t before_bias = shared_calls().logits_elements.load();
  op.forward_backward(X.cview(), lce::with_bias{W.cview(), lce::vector_view<const T>{bias.data(), v}}, Y.cview(),
                      lce::row_gradients<float>{G.cview(), HG.cview(), Q.cview(), M.cview()},
                      lce::row_outputs<float>{lp.view(), lse.view(), ent.view(), ml.view()}, gh.view(),
                      lce::with_bias{gw.view(), lce::vector_view<float>{gb.ptr(), v}});
  const std::int64_t logits_b = shared_calls().logits_elements.load() - before_bias;
  CAPTURE(logits_b);
  CHECK(logits_b > n * v + n * 512);
  check_row_outputs(with_ones, ref_b, lp, lse, ent, ml, base_tol<T>() * 10);
  LCE_CHECK_CMP(compare_gradient("dX with a bias", gh, columns(want_b.dx, n, 0, h), 3 * 0x1p-8));
  LCE_CHECK_CMP(compare_gradient("dW with a bias", gw, columns(want_b.dw, v, 0, h), 3 * 0x1p-8));
  LCE_CHECK_CMP(compare_gradient("db", gb, columns(want_b.dw, v, h, 1), 3 * 0x1p-8));
}

// options.max_logits_share sets what a call may hold to compute each logit once. Here
// (N 1,024, H 16, V 8,000: the budget's plan is the vocabulary order, its tiles of 1,024
// columns holding less than chunks of 192 tokens; the fp32 logits are 32.8 MB, a chunk 6.1,
// the dW sum's rest 256 KB) a share of 1 holds the sum and its chunks (the token order: N V
// logits, three GEMMs), the default's tenth or 0 neither (the vocabulary order: most logits
// twice).
TEST_CASE("bf16 operands: max_logits_share trades memory for the logits computed again") {
  using T = lce::bfloat16;
  constexpr std::int64_t n = 1024, h = 16, v = 8000;
  constexpr std::size_t budget = std::size_t{64} << 20;
  problem p = make_problem(n, h, v, 93, rounder_for<T>(), 1.0, 0.3, 0.1);
  const forward_result ref = reference_forward(p);
  const std::vector<double> g = random_vector(n, 94, -1, 1, rounder_for<float>());
  const std::vector<double> zero(static_cast<std::size_t>(n), 0.0);
  const gradients want = reference_with_terms(p, ref, g, zero, zero, zero);
  const auto X = make_matrix<T>(p.x, n, h);
  const auto W = make_matrix<T>(p.w, v, h);
  const auto Y = make_targets<std::int64_t>(p.y);
  const vector_buf<float> G(g);
  const std::size_t logits_bytes = static_cast<std::size_t>(n * v) * sizeof(float);
  for (const float share : {1.0f, 0.1f, 0.0f}) {
    CAPTURE(share);
    auto opt = make_options();
    opt.overwrite_weight_gradients = true;
    opt.workspace_limit_bytes = budget;
    opt.max_logits_share = share;
    auto op = bf16_operands_env::make_op<T>(opt, 1);
    vector_buf<float> lp(n), lse(n);
    matrix_buf<T> gh(n, h), gw(v, h);
    gw.fill(lce::bfloat16(std::numeric_limits<float>::quiet_NaN()));
    const std::int64_t before = shared_calls().logits_elements.load();
    op.forward_backward(X.cview(), W.cview(), Y.cview(), lce::row_gradients<float>{G.cview(), {}, {}, {}},
                        lce::row_outputs<float>{lp.view(), lse.view(), {}, {}}, gh.view(), gw.view());
    const std::int64_t logits = shared_calls().logits_elements.load() - before;
    const std::size_t held = op.held_workspace_bytes();
    CAPTURE(logits);
    CAPTURE(held);
    CHECK(held <= op.workspace_bytes(n, h, v));
    if (share == 1.0f) {
      CHECK(logits == n * v);
      CHECK(held > static_cast<std::size_t>(v * h) * sizeof(T));  // the sum's rest, beyond grad_weight
      CHECK(held <= logits_bytes);
    } else {
      CHECK(logits > n * v + n * (v / 2));
    }
    const auto rel = [&](std::int64_t, double w) { return base_tol<T>() * 10 * (1 + std::fabs(w)); };
    LCE_CHECK_CMP(compare(
        "logprobs", n, [&](std::int64_t i) { return lp.get(i); },
        [&](std::int64_t i) { return static_cast<double>(ref.logp[i]); }, rel));
    LCE_CHECK_CMP(compare(
        "lse", n, [&](std::int64_t i) { return lse.get(i); },
        [&](std::int64_t i) { return static_cast<double>(ref.lse[i]); }, rel));
    LCE_CHECK_CMP(compare_gradient("dX", gh, want.dx, 3 * 0x1p-8));
    LCE_CHECK_CMP(compare_gradient("dW", gw, want.dw, 3 * 0x1p-8));
  }
}

// The worst of each token's dX and of its target's dW row against the reference in double,
// relative to that row's largest element, for targets whose p is near 1 (n = 48, V = 12,001,
// hidden h), from a forward_backward over grad_weight on make(options).
// With `rivals`, each token's target instead has two rivals, its logit 0.3 below the
// largest and the other 0.7 below (rows 5,400 + 3 i, + 1 = the target, + 2: in the 8th
// 768-column tile, one whose ratios are kept at N = H and 2 H): p of 0.27-0.5 that are
// not the row's largest.
template <class T, class MakeOp>
std::pair<double, double> near_one_target_errors(std::int64_t h, MakeOp&& make, bool rivals = false) {
  const std::int64_t n = 48, v = 12001;
  problem p = make_problem(n, h, v, 97, rounder_for<T>(), 1.0, 0.05, 0.0);
  const double peak = std::log(static_cast<double>(v)) + 4.0;
  const auto aim = [&](std::int64_t i, std::size_t row, double logit) {
    double norm2 = 0;
    for (std::int64_t k = 0; k < h; ++k) norm2 += p.x[static_cast<std::size_t>(i * h + k)] * p.x[static_cast<std::size_t>(i * h + k)];
    for (std::int64_t k = 0; k < h; ++k)
      p.w[row * static_cast<std::size_t>(h) + static_cast<std::size_t>(k)] =
          rounder_for<T>()(logit / norm2 * p.x[static_cast<std::size_t>(i * h + k)]);
  };
  for (std::int64_t i = 0; i < n; ++i) {
    if (rivals) {
      const auto first = static_cast<std::size_t>(5400 + 3 * i);
      p.y[static_cast<std::size_t>(i)] = static_cast<std::int64_t>(first + 1);
      aim(i, first, peak);
      aim(i, first + 1, peak - 0.3);
      aim(i, first + 2, peak - 0.7);
    } else {
      aim(i, static_cast<std::size_t>(p.y[static_cast<std::size_t>(i)]), peak);
    }
  }
  const std::vector<double> g = random_vector(n, 98, 0.5, 1.0);
  const std::vector<double> zeros(static_cast<std::size_t>(n), 0.0);
  const forward_result ref = reference_forward(p);
  const gradients want = reference_with_terms(p, ref, g, zeros, zeros, zeros);
  const auto X = make_matrix<T>(p.x, n, h);
  const auto W = make_matrix<T>(p.w, v, h);
  const auto Y = make_targets<std::int64_t>(p.y);
  const vector_buf<float> G(g);
  auto opt = make_options(1.0f, 0.0f);
  opt.overwrite_weight_gradients = true;
  auto op = make(opt);
  vector_buf<float> lp(n);
  matrix_buf<T> gh(n, h), gw(v, h);
  op.forward_backward(X.cview(), W.cview(), Y.cview(), G.cview(), lp.view(), gh.view(), gw.view());
  const auto off_by = [](const auto& got, std::int64_t row, std::int64_t cols, const std::vector<double>& want_all) {
    double largest = 0, worst = 0;
    for (std::int64_t k = 0; k < cols; ++k) {
      const double w = want_all[static_cast<std::size_t>(row * cols + k)];
      largest = std::max(largest, std::fabs(w));
      worst = std::max(worst, std::fabs(static_cast<double>(got.get(row, k)) - w));
    }
    return worst / largest;
  };
  double dx_worst = 0, dw_worst = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    dx_worst = std::max(dx_worst, off_by(gh, i, h, want.dx));
    dw_worst = std::max(dw_worst, off_by(gw, p.y[static_cast<std::size_t>(i)], h, want.dw));
  }
  return {dx_worst, dw_worst};
}

// Kept as bf16 ratios (N = H here, and some tiles' at N = 2 H), each logit comes back to 2^-8, the row's
// largest exactly. A target whose p is near 1 (its logit log V + 4 above
// the rest, give or take: 1 - p from about 0.5 down to 1e-3) has
// dz = g (p - 1): were its p off by 2^-8 of itself, its token's dX (mostly
// (p - 1) times its target's weight row) would be off by 10% or more.
// Each token's dX is checked against the reference in double to 2% of its own
// largest element, and dW's target rows likewise; the other lce paths (the
// fp32 logits kept at N = H / 2) meet the same bound. (With the rivals of the
// test below, dz's own rounding to bf16 leaves dX 47% off at N = H / 2, the
// ratios 46-52% at N = H and 2 H: they add nothing that shows.)
TEST_CASE("bf16 operands: logits kept as bf16 ratios: a target of p near 1 keeps the digits of 1 - p") {
  for (const std::int64_t h : {24, 48, 96}) {
    CAPTURE(h);
    const auto [dx_worst, dw_worst] = near_one_target_errors<lce::bfloat16>(
        h, [](const lce::options& opt) { return bf16_operands_env::make_op<lce::bfloat16>(opt, 2); });
    CAPTURE(dx_worst);
    CAPTURE(dw_worst);
    CHECK(dx_worst < 0.02);
    CHECK(dw_worst < 0.02);
  }
}

// The ratios' 2^-8 is the rounding of a bf16 dz operand, no more. With fp32 GEMM
// operands dz keeps more: fp16 inputs (widened), or bf16 ones on lce::host (dz split
// into two bf16 parts), so no logits are kept as ratios there (fp32 logits where the
// rows hold them, N <= H / 2; else computed again). Targets with rivals make dX a
// difference of terms 45 times its size (the three rows are all along the token's
// hidden row), so p's error shows: with ratios taken there too, dX was off by 19-22%
// (fp16) and 21-25% (bf16) at N = H and 2 H; without, by 4.8e-4 and 3.5e-3 to 3.8e-3,
// as at N = H / 2, within 4 units of the outputs' own rounding.
TEST_CASE_TEMPLATE("fp32 GEMM operands: no logits kept as ratios, dz as exact as its GEMMs take it", T, lce::float16,
                   lce::bfloat16) {
  const double bound = 4 * (std::is_same_v<T, lce::float16> ? 0x1p-11 : 0x1p-8);
  for (const std::int64_t h : {24, 48, 96}) {
    CAPTURE(h);
    for (const bool rivals : {false, true}) {
      CAPTURE(rivals);
      const auto [dx_worst, dw_worst] =
          near_one_target_errors<T>(h, [](const lce::options& opt) { return lce_test::make_op<T>(opt, 2); }, rivals);
      CAPTURE(dx_worst);
      CAPTURE(dw_worst);
      CHECK(dx_worst < bound);
      CHECK(dw_worst < bound);
    }
  }
}

TEST_CASE("bf16 operands: dX goes to the bf16 GEMM in tiles of at least 512 x 512, and sums as one GEMM") {
  // AMX-style bf16 GEMMs slow down in small output tiles (host.hpp, output_tiling): a
  // [600, 1,100] dX takes 2 tiles of 600 x 560, where fp32's 256 x 256 floor makes 8.
  const std::int64_t rows = 600, cols = 1100, depth = 24;
  const auto dz_values = random_vector(rows * depth, 7, -1, 1, rounder_for<lce::bfloat16>());
  const auto w_values = random_vector(depth * cols, 8, -1, 1, rounder_for<lce::bfloat16>());
  std::vector<lce::bfloat16> dz(dz_values.begin(), dz_values.end()), w(w_values.begin(), w_values.end());
  std::vector<float> dx(static_cast<std::size_t>(rows * cols), 0.0f), want(dx.size());
  const loop_bf16_operand_gemm provider;  // its own call log
  bf16_operand_host host(provider, 1);
  host.grad_hidden(lce::matrix_view<const lce::bfloat16>{dz.data(), rows, depth},
                   lce::matrix_view<const lce::bfloat16>{w.data(), depth, cols}, 1.0f,
                   lce::matrix_view<float>{dx.data(), rows, cols}, nullptr);
  const auto& shapes = provider.calls->bf16_shapes;
  REQUIRE(!shapes.empty());
  for (const auto& c : shapes) {
    CAPTURE(c.m);
    CAPTURE(c.n);
    CHECK(c.m >= 512);
    CHECK(c.n >= 512);
    CHECK(c.k == depth);
  }
  CHECK(shapes.size() == 2);
  loop_gemm(lce::transpose::no, lce::transpose::no, rows, cols, depth, 1.0f, dz.data(), depth, w.data(), cols, 0.0f,
            want.data(), cols);
  CHECK(dx == want);  // the same sums in the same order, tile by tile
}

// A logits GEMM that output_tiling leaves whole (a 768-column tile of the
// logits kept as ratios, at N 768: tiles of at least 512 x 512) goes to the
// provider in two halves of the tokens, so that two threads share it; from the
// shapes alone, so one thread makes the same two calls (the same bits).
TEST_CASE("bf16 operands: a logits GEMM of one tile is cut over the tokens in two") {
  const std::int64_t tokens = 768, vocab_tile = 768, depth = 24;
  const auto x_values = random_vector(tokens * depth, 9, -1, 1, rounder_for<lce::bfloat16>());
  const auto w_values = random_vector(vocab_tile * depth, 10, -1, 1, rounder_for<lce::bfloat16>());
  std::vector<lce::bfloat16> x(x_values.begin(), x_values.end()), w(w_values.begin(), w_values.end());
  std::vector<float> out(static_cast<std::size_t>(tokens * vocab_tile), -1.0f), want(out.size());
  for (const int threads : {1, 2}) {
    CAPTURE(threads);
    const loop_bf16_operand_gemm provider;
    bf16_operand_host host(provider, threads);
    host.logits(lce::matrix_view<const lce::bfloat16>{x.data(), tokens, depth},
                lce::matrix_view<const lce::bfloat16>{w.data(), vocab_tile, depth}, 0.5f,
                lce::matrix_view<float>{out.data(), tokens, vocab_tile}, nullptr);
    const auto& shapes = provider.calls->bf16_shapes;
    REQUIRE(shapes.size() == 2);
    for (const auto& c : shapes) {
      CHECK(c.m == tokens / 2);
      CHECK(c.n == vocab_tile);
      CHECK(c.k == depth);
    }
    loop_gemm(lce::transpose::no, lce::transpose::yes, tokens, vocab_tile, depth, 0.5f, x.data(), depth, w.data(),
              depth, 0.0f, want.data(), vocab_tile);
    CHECK(out == want);
  }
}

TEST_CASE_TEMPLATE("lce::host_bf16_operands: forward, backward and forward_backward match the reference", T,
                   LCE_BF16_OPERAND_TYPES) {
  MESSAGE("bf16 GEMMs: " << lce::blas_info().bf16_gemm);
  cases::forward_matches_reference<cblas_bf16_operands_env, T>();
  cases::backward_matches_reference<cblas_bf16_operands_env, T>();
  cases::forward_backward_matches_reference<cblas_bf16_operands_env, T>();
  cases::forward_backward_equals_two_calls<cblas_bf16_operands_env, T>();
}

TEST_CASE_TEMPLATE("lce::host_bf16_operands: several GEMM tiles, strided buffers, target sets", T,
                   LCE_BF16_OPERAND_TYPES) {
  cases::gradients_over_several_tiles<cblas_bf16_operands_env, T>();
  cases::strided_buffers<cblas_bf16_operands_env, T>();
  cases::target_sets_gradients<cblas_bf16_operands_env, T>();
}
