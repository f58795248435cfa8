// lce::plan_step / lce::longest_sequence (<lce/plan.hpp>): the parts add up, lce's
// figure is the operator's own workspace_bytes, the longest sequence is the
// largest that fits, bad requests raise lce::error. (The measured check, planned
// against the peak of real steps, is lce_plan_measured: bench/bench_memory.cpp.)
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <lce/lce.hpp>
#include <lce/plan.hpp>

#include <cstdint>

namespace {

lce::plan_request request(std::int64_t h, std::int64_t v, int p, bool sp, std::size_t b) {
  lce::plan_request r;
  r.hidden = h, r.vocab = v, r.tensor_parallel = p, r.sequence_parallel = sp, r.element_bytes = b;
  return r;
}

}  // namespace

TEST_CASE("plan: lce's workspace is the operator's workspace_bytes, one rank") {
  for (std::size_t b : {std::size_t{4}, std::size_t{2}}) {
    CAPTURE(b);
    lce::plan_request r = request(256, 5000, 1, false, b);
    r.workspace_limit_bytes = std::size_t{3} << 20;
    lce::options opt;
    opt.workspace_limit_bytes = r.workspace_limit_bytes;
    for (std::int64_t n : {1, 100, 4096, 100000}) {
      CAPTURE(n);
      const lce::step_memory m = lce::plan_step(r, lce::plan_scheme::lce, n);
      std::size_t expected = 0;
      if (b == 4) {
        lce::ChunkedHiddenToLogprobs<lce::comm::single, float> op{lce::comm::single{}, opt};
        expected = op.workspace_bytes(n, 256, 5000);
        CHECK(m.chunk == std::min<std::int64_t>(op.chunk_tokens(n, 256, 5000), n));
      } else {
        // One host thread, as the plan: a call of one chunk holds one 4 MiB dW tile per thread.
        lce::ChunkedHiddenToLogprobs<lce::comm::single, lce::bfloat16> op{lce::comm::single{}, opt, lce::host{1}};
        expected = op.workspace_bytes(n, 256, 5000);
        // The fp32 dW accumulator of a 2-byte grad_weight, for a call of several chunks only:
        // 1 and 100 tokens go in one chunk (for 100, one chunk holds less than the 3 MiB
        // budget's chunks plus the accumulator), 4096 and more in several.
        if (n >= 4096) CHECK(expected >= std::size_t{5000} * 256 * 4);
        else CHECK(expected < std::size_t{5000} * 256 * 4);
      }
      CHECK(m.workspace == expected);
      CHECK(m.logits == 0);
      CHECK(m.collectives == 0);
      const std::size_t s = static_cast<std::size_t>(n);
      CHECK(m.hidden == s * 256 * b);
      CHECK(m.grad_hidden == m.hidden);
      CHECK(m.targets == s * 8);
      CHECK(m.weight == std::size_t{5000} * 256 * b);
      CHECK(m.grad_weight == m.weight);
      CHECK(m.per_token == s * 3 * 4);
      CHECK(m.total() == m.hidden + m.targets + m.weight + m.grad_hidden + m.grad_weight + m.per_token + m.workspace);
    }
  }
}

TEST_CASE("plan: tensor and sequence parallel shares") {
  const std::int64_t h = 128, v = 1001, n = 4096;  // V / 4 is not whole: the largest shard is 251
  const lce::plan_request tp = request(h, v, 4, false, 4), sp = request(h, v, 4, true, 4);
  const lce::step_memory mat = lce::plan_step(tp, lce::plan_scheme::materialised, n);
  CHECK(mat.weight == std::size_t{251} * h * 4);
  CHECK(mat.logits == std::size_t{n} * 251 * 4);
  CHECK(mat.hidden == std::size_t{n} * h * 4);
  CHECK(mat.collectives == 0);
  CHECK(mat.per_token == std::size_t{n} * 4 * (3 + 3 + 3 * 4));
  const lce::step_memory mat_sp = lce::plan_step(sp, lce::plan_scheme::materialised, n);
  CHECK(mat_sp.hidden == std::size_t{n / 4} * h * 4);
  CHECK(mat_sp.collectives == 2 * std::size_t{n} * h * 4);  // gathered hidden, dX before the reduce-scatter
  const lce::step_memory origin = lce::plan_step(sp, lce::plan_scheme::origin, n);
  CHECK(origin.collectives == std::size_t{n} * h * 4 + std::size_t{n} * h * 4);  // gathered + fp32 gradient
  CHECK(origin.logits == std::size_t{1024} * 251 * 16);
  lce::plan_request sp_small = sp;
  sp_small.workspace_limit_bytes = std::size_t{1} << 20;
  const lce::step_memory l = lce::plan_step(sp_small, lce::plan_scheme::lce, n);
  CHECK(l.hidden == std::size_t{n / 4} * h * 4);
  CHECK(l.collectives == 0);
  CHECK(l.workspace > 0);
  CHECK(l.total() < mat_sp.total());
  // one rank: sequence parallel changes nothing
  CHECK(lce::plan_step(request(h, v, 1, true, 2), lce::plan_scheme::materialised, n).total() ==
        lce::plan_step(request(h, v, 1, false, 2), lce::plan_scheme::materialised, n).total());
  // a 2-byte dtype keeps the GEMM's 2-byte logits beside the fp32 ones
  CHECK(lce::plan_step(request(h, v, 4, false, 2), lce::plan_scheme::materialised, n).logits == std::size_t{n} * 251 * 6);
}

TEST_CASE("plan: the longest sequence is the largest that fits") {
  for (const auto& preset : lce::model_presets)
    for (int p : {1, 2, 8})
      for (auto scheme : {lce::plan_scheme::materialised, lce::plan_scheme::origin, lce::plan_scheme::lce}) {
        CAPTURE(preset.name);
        CAPTURE(p);
        CAPTURE(static_cast<int>(scheme));
        lce::plan_request r = request(preset.hidden, preset.vocab, p, true, 2);
        r.budget_bytes = std::size_t{6} << 30;
        const std::int64_t longest = lce::longest_sequence(r, scheme);
        const std::int64_t step = p > 1 ? p : 1;
        REQUIRE(longest > 0);
        CHECK(longest % step == 0);
        CHECK(lce::plan_step(r, scheme, longest).total() <= r.budget_bytes);
        if (longest < lce::plan_max_tokens) CHECK(lce::plan_step(r, scheme, longest + step).total() > r.budget_bytes);
      }
  // at 80 GiB, lce allows the longest sequences, materialised logits the shortest
  for (const auto& preset : lce::model_presets) {
    const lce::plan_request r = request(preset.hidden, preset.vocab, 8, true, 2);
    const auto mat = lce::longest_sequence(r, lce::plan_scheme::materialised);
    const auto origin = lce::longest_sequence(r, lce::plan_scheme::origin);
    const auto mine = lce::longest_sequence(r, lce::plan_scheme::lce);
    CHECK(mat < origin);
    CHECK(origin < mine);
  }
  // a budget below the weight alone fits nothing
  lce::plan_request tiny = request(4096, 128256, 1, false, 2);
  tiny.budget_bytes = 1 << 20;
  CHECK(lce::longest_sequence(tiny, lce::plan_scheme::lce) == 0);
}

TEST_CASE("plan: bad requests raise lce::error") {
  CHECK_THROWS_AS(lce::plan_step(request(0, 10, 1, false, 4), lce::plan_scheme::lce, 8), lce::error);
  CHECK_THROWS_AS(lce::plan_step(request(8, 10, 1, false, 3), lce::plan_scheme::lce, 8), lce::error);
  CHECK_THROWS_AS(lce::plan_step(request(8, 10, 0, false, 4), lce::plan_scheme::lce, 8), lce::error);
  CHECK_THROWS_AS(lce::plan_step(request(8, 10, 4, true, 4), lce::plan_scheme::lce, 6), lce::error);  // 6 % 4
  CHECK_THROWS_AS(lce::plan_step(request(8, 10, 1, false, 4), lce::plan_scheme::lce, -1), lce::error);
  CHECK_NOTHROW(lce::plan_step(request(8, 10, 4, false, 4), lce::plan_scheme::lce, 6));
}

TEST_CASE("plan: a vocabulary near INT64_MAX shards without overflow") {
  const std::int64_t v = INT64_MAX - 7;
  const auto m = lce::plan_step(request(1, v, 16, false, 2), lce::plan_scheme::materialised, 8);
  const std::size_t shard = static_cast<std::size_t>(v / 16 + 1);  // ceil: v is not a multiple of 16
  CHECK(m.weight == shard * 2);
  CHECK(m.total() >= m.weight);
  CHECK(lce::longest_sequence(request(1, v, 16, false, 2), lce::plan_scheme::materialised) == 0);
}
