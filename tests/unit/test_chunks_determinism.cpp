// Chunk sizes, bitwise determinism across thread counts, workspace_bytes.
#include "support/device_shaped_backend.hpp"
#include "support/harness.hpp"

extern "C" void openblas_set_num_threads(int);
extern "C" int openblas_get_num_threads(void);

using namespace lce_test;

namespace {

struct blas_threads_guard {
  int saved = openblas_get_num_threads();
  ~blas_threads_guard() { openblas_set_num_threads(saved); }
};

}  // namespace

TEST_CASE_TEMPLATE("every chunk size gives the reference answer", T, float, double, lce::bfloat16, lce::float16) {
  using O = out_t<T>;
  const std::int64_t n = 10;
  problem p = make_problem(n, 12, 40, 77, rounder_for<T>(), 1.5, 1.0, 0.2);
  p.tau = 0.7f;
  p.cap = 5.0f;
  const auto g = random_vector(n, 78, -1.0, 1.0, rounder_for<O>());
  const auto hg = random_vector(n, 79, -0.5, 0.5, rounder_for<O>());
  const auto pre = random_vector(p.v * p.h, 80, -1.0, 1.0, rounder_for<float>());
  const double eq_tol = std::is_same_v<T, double> ? 1e-12 : 1e-6;

  auto opts = [&](std::int64_t chunk) { return make_options(p.tau, p.cap, chunk); };
  std::vector<outputs<T, float>> runs;
  for (std::int64_t chunk : {std::int64_t{1}, std::int64_t{3}, n - 1, n, 4 * n}) {
    CAPTURE(chunk);
    auto op = make_op<T>(opts(chunk));
    runs.push_back(exercise<T, float>(op, p, g, hg, pre));
    check_against_reference(runs.back(), p, g, hg, pre);
    if (runs.size() > 1) check_close(runs.back(), runs.front(), eq_tol);
  }
  {
    INFO("policy lce::fixed_chunk<3>");
    auto op = make_op<T, lce::fixed_chunk<3>>(opts(0));
    auto o = exercise<T, float>(op, p, g, hg, pre);
    check_against_reference(o, p, g, hg, pre);
    check_close(o, runs.front(), eq_tol);
  }
  {
    INFO("policy lce::fixed_chunk<4> wins: chunk_tokens = 4 agrees, chunk_tokens = 1 is an error");
    auto op = make_op<T, lce::fixed_chunk<4>>(opts(4));
    CHECK(op.chunk_tokens(n, p.h, p.v) == 4);
    auto o = exercise<T, float>(op, p, g, hg, pre);
    check_against_reference(o, p, g, hg, pre);
    check_close(o, runs.front(), eq_tol);
    const auto conflicting = [&] { return make_op<T, lce::fixed_chunk<4>>(opts(1)); };
    CHECK_THROWS_WITH_AS(conflicting(),
                         doctest::Contains("chunk_tokens = 1 conflicts with the compile-time chunk policy fixed_chunk<4>"),
                         lce::error);
  }
  {
    INFO("default (budget) policy, gradients of element T");
    const auto pre_t = random_vector(p.v * p.h, 81, -1.0, 1.0, rounder_for<T>());
    auto op = make_op<T>(opts(0));
    auto o = exercise<T, T>(op, p, g, hg, pre_t);
    check_against_reference(o, p, g, hg, pre_t);
  }
}

namespace {
// A run-time policy (no compile-time `tokens`) that answers 4 rows, whatever it is asked.
struct at_most_four_rows {
  std::int64_t tokens_per_chunk(const lce::chunk_request&) const { return 4; }
};
static_assert(lce::chunk_policy<at_most_four_rows> && !lce::fixed_chunk_policy<at_most_four_rows>);
}  // namespace

TEST_CASE("a run-time policy's answer is the most rows: the tokens go in the fewest chunks, as even as rows allow") {
  const problem p = make_problem(9, 12, 40, 91, round_to_float, 1.5, 1.0, 0.2);
  const auto g = random_vector(p.n, 92, -1.0, 1.0, round_to_float);
  const auto hg = random_vector(p.n, 93, -0.5, 0.5, round_to_float);
  const auto pre = random_vector(p.v * p.h, 94, -1.0, 1.0, round_to_float);
  auto op = make_op<float, at_most_four_rows>(make_options(1.0f, 0.0f, 0));
  // n tokens -> rows per chunk, ceil(n / ceil(n / 4)): 5 -> 3 (3 + 2, not 4 + 1), 9 -> 3 (3 x 3, not
  // 4 + 4 + 1), 13 -> 4 (four chunks either way: 4 + 4 + 4 + 1).
  const std::pair<std::int64_t, std::int64_t> evened[] = {{3, 3}, {4, 4}, {5, 3}, {8, 4}, {9, 3}, {13, 4}, {17, 4}};
  for (const auto& [n, rows] : evened) {
    CAPTURE(n);
    CHECK(op.chunk_tokens(n, p.h, p.v) == rows);
  }
  // 9 tokens in three chunks of 3 give the reference answer.
  check_against_reference(exercise<float, float>(op, p, g, hg, pre), p, g, hg, pre);
  // An explicit options.chunk_tokens is taken as it is: 9 tokens as 4 + 4 + 1.
  auto explicit_op = make_op<float, at_most_four_rows>(make_options(1.0f, 0.0f, 4));
  CHECK(explicit_op.chunk_tokens(9, p.h, p.v) == 4);
  check_against_reference(exercise<float, float>(explicit_op, p, g, hg, pre), p, g, hg, pre);
}

TEST_CASE("budget_chunk stops at the backend's enough_chunk_rows: the host's 512, none for a GPU-shaped backend") {
  // H 64, V 1,000: a row of the plan is a few KiB, so the default 256 MiB budget holds tens of thousands.
  const std::int64_t h = 64, v = 1000;
  static_assert(lce::enough_chunk_rows<lce::host>() == 512);
  static_assert(lce::enough_chunk_rows<lce_test::device_shaped_backend<>>() == INT64_MAX);
  auto host_op = make_op<float>(make_options(1.0f, 0.0f, 0));
  const lce::ChunkedHiddenToLogprobs<lce::comm::single, lce::bfloat16, lce::budget_chunk,
                                     lce_test::device_shaped_backend<>>
      device_op(lce::comm::single{}, make_options(1.0f, 0.0f, 0), lce_test::device_shaped_backend<>{});
  CHECK(device_op.chunk_tokens(16384, h, v) == 16384);
  CHECK(host_op.chunk_tokens(16384, h, v) == 512);
  CHECK(host_op.chunk_tokens(512, h, v) == 512);
  CHECK(host_op.chunk_tokens(300, h, v) == 300);
  CHECK(host_op.chunk_tokens(1100, h, v) == 192);  // an eighth, at least 192 rows: 192 x 5 + 140
  // Under a budget smaller than 512 rows, the budget decides as before.
  lce::options tight = make_options(1.0f, 0.0f, 0);
  tight.workspace_limit_bytes = std::size_t{1} << 20;
  const std::int64_t budget_rows = make_op<float>(tight).chunk_tokens(16384, h, v);
  CHECK(budget_rows < 512);
  CHECK(budget_rows > 32);
  // The workspace follows: 512 rows' logit block, not the budget's.
  CHECK(host_op.workspace_bytes(16384, h, v) < std::size_t{512 + 64} * v * sizeof(float) + (std::size_t{2} << 20));
  // An explicit chunk_tokens is taken as it is, above the host's 512 too.
  CHECK(make_op<float>(make_options(1.0f, 0.0f, 2048)).chunk_tokens(16384, h, v) == 2048);
}

TEST_CASE("evened_chunk_rows keeps the chunk count of most_rows and gives an evened size back") {
  // What lets ranks exchange evened sizes and agree (core/chunking.hpp).
  for (std::int64_t tokens = 1; tokens < 1200; ++tokens)
    for (std::int64_t most = 1; most < 600; most += 7)
      for (const std::int64_t least : {std::int64_t{1}, std::int64_t{64}, std::int64_t{192}}) {
        const auto rows = lce::evened_chunk_rows(tokens, most, least);
        const auto chunks = [&](std::int64_t r) { return (tokens + r - 1) / r; };
        if (rows < 1 || rows > most || chunks(rows) != chunks(most) ||
            lce::evened_chunk_rows(tokens, rows, least) != rows) {
          CAPTURE(tokens);
          CAPTURE(most);
          CAPTURE(least);
          CAPTURE(rows);
          FAIL("evened_chunk_rows");
        }
        if (least <= most && chunks(most) > 1 && rows < least) {
          CAPTURE(tokens);
          CAPTURE(most);
          CAPTURE(least);
          FAIL("evened under least_rows");
        }
      }
}

TEST_CASE("budget_chunk: a call longer than 512 tokens holds at most an eighth of its logits, down to 192 rows") {
  const std::int64_t h = 256, v = 32000;
  static_assert(lce::min_efficient_chunk_rows<lce::host>() == 192);
  static_assert(lce::min_efficient_chunk_rows<lce_test::device_shaped_backend<>>() == INT64_MAX);
  const auto host_op = make_op<float>(make_options(1.0f, 0.0f, 0));
  // N, then the chunk: N / 8 from N = 1,536 on (evened, in multiples of 8 rows), 192 rows
  // below that (1,024 tokens in 192 x 5 + 64: evening would take 171 rows, under 192).
  const std::int64_t expected[][2] = {{512, 512},   {513, 192},   {1024, 192},  {1536, 192},
                                      {2048, 256},  {4096, 512},  {4097, 456},  {65536, 512}};
  for (const auto& [n, chunk] : expected) {
    CAPTURE(n);
    CHECK(host_op.chunk_tokens(n, h, v) == chunk);
    // What the call holds against the [N, V] fp32 logits it does not materialise.
    const double logits = static_cast<double>(n) * v * sizeof(float);
    const double held = static_cast<double>(host_op.workspace_bytes(n, h, v));
    if (n >= 1536) CHECK(held <= logits / 7.5);
    if (n >= 1024) CHECK(held <= logits / 5.2);
  }
  // A GPU-shaped backend has no share: the budget alone decides.
  const lce::ChunkedHiddenToLogprobs<lce::comm::single, lce::bfloat16, lce::budget_chunk,
                                     lce_test::device_shaped_backend<>>
      device_op(lce::comm::single{}, make_options(1.0f, 0.0f, 0), lce_test::device_shaped_backend<>{});
  CHECK(device_op.chunk_tokens(1024, h, v) == 1024);
  // An explicit chunk_tokens, or a budget under the share, is taken as before.
  CHECK(make_op<float>(make_options(1.0f, 0.0f, 1024)).chunk_tokens(4096, h, v) == 1024);
  lce::options tight = make_options(1.0f, 0.0f, 0);
  tight.workspace_limit_bytes = std::size_t{4} << 20;
  CHECK(make_op<float>(tight).chunk_tokens(1024, h, v) <= 32);
}

TEST_CASE_TEMPLATE("outputs are bitwise identical across runs and thread counts", T, float, double, lce::bfloat16,
                   lce::float16) {
  using O = out_t<T>;
  blas_threads_guard guard;
  // V = 3000 spans several GEMM tiles and row-pass grains; chunks of 200+
  // rows split dX over several row tiles.
  problem p = make_problem(640, 48, 3000, 4242, rounder_for<T>(), 1.0, 1.0, 0.1);
  p.tau = 0.9f;
  const auto g = random_vector(p.n, 1, -1.0, 1.0, rounder_for<O>());
  const auto hg = random_vector(p.n, 2, -0.5, 0.5, rounder_for<O>());
  const auto pre_f = random_vector(p.v * p.h, 3, -1.0, 1.0, rounder_for<float>());
  const auto pre_t = random_vector(p.v * p.h, 4, -1.0, 1.0, rounder_for<T>());

  for (std::int64_t chunk : {std::int64_t{0}, std::int64_t{256}, std::int64_t{211}}) {
    CAPTURE(chunk);
    const auto opt = make_options(p.tau, 0.0f, chunk);
    openblas_set_num_threads(1);
    auto base_op = make_op<T>(opt, 1);
    const auto base_f = exercise<T, float>(base_op, p, g, hg, pre_f);
    const auto base_t = exercise<T, T>(base_op, p, g, hg, pre_t);
    {
      const auto d1 = exercise<T, float>(base_op, p, g, hg, pre_f).bitwise_diff(base_f);
      const auto d2 = exercise<T, T>(base_op, p, g, hg, pre_t).bitwise_diff(base_t);
      CHECK_MESSAGE(d1.empty(), "same op, second run, float grads: " << d1);
      CHECK_MESSAGE(d2.empty(), "same op, second run, T grads: " << d2);
    }
    for (int blas : {1, 2}) {
      for (int threads : {1, 2, 0, 3}) {
        openblas_set_num_threads(blas);
        auto op = make_op<T>(opt, threads);
        const auto d1 = exercise<T, float>(op, p, g, hg, pre_f).bitwise_diff(base_f);
        const auto d2 = exercise<T, T>(op, p, g, hg, pre_t).bitwise_diff(base_t);
        CHECK_MESSAGE(d1.empty(), "openblas threads " << blas << ", host{" << threads << "} vs openblas 1, host{1}, float grads: " << d1);
        CHECK_MESSAGE(d2.empty(), "openblas threads " << blas << ", host{" << threads << "} vs openblas 1, host{1}, T grads: " << d2);
      }
    }
  }
}

TEST_CASE_TEMPLATE("workspace_bytes grows with chunk x vocab, not with tokens", T, float, double, lce::bfloat16,
                   lce::float16) {
  const std::int64_t h = 512, v = 32000;
  SUBCASE("fixed chunk through options.chunk_tokens") {
    auto op64 = make_op<T>(make_options(1.0f, 0.0f, 64));
    auto op128 = make_op<T>(make_options(1.0f, 0.0f, 128));
    const auto a = op64.workspace_bytes(4096, h, v);
    CHECK(a > 0);
    CHECK(op64.workspace_bytes(65536, h, v) == a);
    CHECK(op64.workspace_bytes(1 << 20, h, v) == a);
    CHECK(op64.workspace_bytes(4096, h, 2 * v) > a);
    CHECK(op128.workspace_bytes(4096, h, v) > a);
  }
  SUBCASE("fixed chunk through lce::fixed_chunk<K>") {
    auto op64 = make_op<T, lce::fixed_chunk<64>>(lce::options{});
    auto op256 = make_op<T, lce::fixed_chunk<256>>(lce::options{});
    const auto a = op64.workspace_bytes(4096, h, v);
    CHECK(a > 0);
    CHECK(op64.workspace_bytes(65536, h, v) == a);
    CHECK(op64.workspace_bytes(4096, h, 2 * v) > a);
    CHECK(op256.workspace_bytes(4096, h, v) > a);
  }
  SUBCASE("budget policy stays within workspace_limit_bytes, independent of N") {
    // The limit bounds the scratch of a chunk. A grad_weight whose element is
    // not the compute type (bf16/fp16 for a 2-byte T, float for T = double)
    // also needs a [V_local, H] accumulator in the compute type, which no chunk
    // size can shrink; workspace_bytes reports it on top. Where the
    // vocabulary order holds less (an [N, H] sum of dX instead of it), the
    // call takes that: then the bytes depend on N, but never exceed these.
    auto accumulator = [](std::int64_t hh, std::int64_t vv) -> std::size_t {
      return std::is_same_v<T, float> ? 0 : static_cast<std::size_t>(hh * vv) * sizeof(lce::compute_t<T>);
    };
    for (std::size_t limit : {std::size_t{16} << 20, std::size_t{64} << 20, std::size_t{256} << 20}) {
      CAPTURE(limit);
      lce::options o;
      o.workspace_limit_bytes = limit;
      auto op = make_op<T>(o, 2);  // two threads: the widening floor below assumes two
      const auto a = op.workspace_bytes(65536, h, v);
      CHECK(a > 0);
      CHECK(a <= limit + accumulator(h, v));
      // Evened chunks (core/chunking.hpp) lose under one row per chunk: 65,536
      // tokens are 32 chunks or more here, so N = 2^20 holds a within a 32nd.
      CHECK(65536 / op.chunk_tokens(65536, h, v) >= 32);
      if (std::is_same_v<T, float>) {
        CHECK(op.workspace_bytes(1 << 20, h, v) <= a + a / 32);
        CHECK(op.workspace_bytes(1 << 20, h, v) >= a - a / 32);
      }
      CHECK(op.workspace_bytes(1 << 20, h, v) <= limit + accumulator(h, v));
      // A 2-byte weight is widened to fp32 one tile (>= 512 vocabulary rows) per
      // thread at a time: at H = 4096 that floor alone is 8 MiB a thread.
      const std::size_t widening_floor = is_2byte_v<T> ? std::size_t{2} * 512 * 4096 * sizeof(float) : 0;
      if (limit >= 2 * widening_floor)
        CHECK(op.workspace_bytes(65536, 4096, 128256) <= limit + accumulator(4096, 128256));
      CHECK(op.workspace_bytes(8192, 16, 32768) <= limit + accumulator(16, 32768));
    }
  }
}
