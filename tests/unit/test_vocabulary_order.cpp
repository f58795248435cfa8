// The vocabulary order on the host (the shared bodies and their shapes:
// tests/cases/vocabulary_order_cases.hpp): the materialised reference's
// results for every row term, a soft-cap and temperature, a bias, and
// bitwise the same for any thread count.
#include "cases/vocabulary_order_cases.hpp"
#include "support/device_shaped_backend.hpp"

#include <cstdint>
#include <utility>

using namespace lce_test;
using namespace lce_test::cases::vocabulary_order;

TEST_CASE_TEMPLATE("vocabulary order: forward, backward with entropy and forward_backward equal the reference", T,
                   lce::bfloat16, lce::float16, float, double) {
  matches_reference<host_env, T>(3);
}

TEST_CASE_TEMPLATE("vocabulary order: the same bits on any thread count", T, lce::bfloat16, lce::float16, float,
                   double) {
  using G = narrow_t<T>;
  for (const tiling l : tilings)
  for (const auto& s : scalings) {
    CAPTURE(int(l));
    CAPTURE(s.tau);
    CAPTURE(s.cap);
    const exercise_inputs in = exercise_inputs_for<T>(s);
    auto three = make_op<T>(budget_options<T>(s.tau, s.cap, l), 3);
    auto one = make_op<T>(budget_options<T>(s.tau, s.cap, l), 1);
    const auto tiled = exercise<T, G>(three, in.p, in.g, in.hg, in.pre);
    check_took_vocabulary_order<decltype(three), T>(three, l);
    const auto diff = exercise<T, G>(one, in.p, in.g, in.hg, in.pre).bitwise_diff(tiled);
    CHECK_MESSAGE(diff.empty(), "host{1} vs host{3}: " << diff);
  }
}

TEST_CASE_TEMPLATE("vocabulary order: forward_backward with every row term in and out", T, lce::bfloat16, float,
                   double) {
  using O = out_t<T>;
  using G = narrow_t<T>;
  for (const tiling l : tilings)
  for (const auto& s : scalings) {
    CAPTURE(int(l));
    CAPTURE(s.tau);
    CAPTURE(s.cap);
    problem p = make_problem(tokens, hidden, vocab, 71, rounder_for<T>(), 2.0, 0.5);
    p.tau = s.tau;
    p.cap = s.cap;
    const forward_result ref = reference_forward(p);
    const std::vector<double> g = random_vector(tokens, 72, -1, 1);
    const std::vector<double> hg = random_vector(tokens, 73, -0.5, 0.5);
    const std::vector<double> q = random_vector(tokens, 74, 0.0, 0.3);
    const std::vector<double> m = random_vector(tokens, 75, -0.3, 0.0);

    auto op = make_op<T>(budget_options<T>(s.tau, s.cap, l));
    const auto X = make_matrix<T>(p.x, tokens, hidden);
    const auto W = make_matrix<T>(p.w, vocab, hidden, hidden + 5);
    const auto Y = make_targets<std::int32_t>(p.y);
    const vector_buf<O> Gv(g), HG(hg), Q(q), M(m);
    vector_buf<O> lp(tokens), lse(tokens), ent(tokens), ml(tokens);
    matrix_buf<T> gh(tokens, hidden);
    matrix_buf<G> gw(vocab, hidden);
    gw.fill(G(0));
    op.forward_backward(X.cview(), W.cview(), Y.cview(),
                        lce::row_gradients<O>{Gv.cview(), HG.cview(), Q.cview(), M.cview()},
                        lce::row_outputs<O>{lp.view(), lse.view(), ent.view(), ml.view()}, gh.view(), gw.view());
    check_took_vocabulary_order<decltype(op), T>(op, l);

    check_row_outputs(p, ref, lp, lse, ent, ml, base_tol<T>() * 10);

    const gradients want = reference_with_terms(p, ref, g, hg, q, m);
    const double dx_tol = gradient_tol<T>() + (is_2byte_v<T> ? ulp_of<T>(1.0) : 0.0);
    const double dw_tol = gradient_tol<T>() + ulp_of<G>(1.0);
    LCE_CHECK_CMP(compare_gradient("dX", gh, want.dx, dx_tol));
    LCE_CHECK_CMP(compare_gradient("dW", gw, want.dw, dw_tol));
  }
}

namespace {

template <class T>
void check_bias_gradients(tiling l) {
  using O = out_t<T>;
  using G = narrow_t<T>;
  CAPTURE(int(l));
  const std::int64_t h = hidden - 1;  // the bias is the reference's last hidden column
  problem p = make_problem(tokens, hidden, vocab, 81, rounder_for<T>(), 1.5, 0.5);
  p.tau = 0.8f;
  p.cap = 4.0f;
  for (std::int64_t i = 0; i < tokens; ++i) p.x[static_cast<std::size_t>(i * hidden + h)] = 1.0;
  const forward_result ref = reference_forward(p);
  const std::vector<double> g = random_vector(tokens, 82, -1, 1);
  const gradients want = reference_backward(p, ref, g, {});

  const auto X = make_matrix<T>(p.x, tokens, hidden);
  const auto W = make_matrix<T>(p.w, vocab, hidden);
  const lce::matrix_view<const T> x{X.ptr(), tokens, h, hidden}, w{W.ptr(), vocab, h, hidden};
  std::vector<T> bias(static_cast<std::size_t>(vocab));
  for (std::int64_t j = 0; j < vocab; ++j) bias[static_cast<std::size_t>(j)] = W.at(j, h);
  const lce::vector_view<const T> b{bias.data(), vocab};
  const auto Y = make_targets<std::int64_t>(p.y);
  auto op = make_op<T>(budget_options<T>(p.tau, p.cap, l));
  const vector_buf<O> Gv(g);

  const auto check = [&](const char* what, const matrix_buf<G>& gh, const matrix_buf<G>& gw,
                         const std::vector<O>& gb) {
    CAPTURE(what);
    const double scale_x = 1 + max_abs(want.dx), scale_w = 1 + max_abs(want.dw);
    const double tol = gradient_tol<T>() + ulp_of<G>(1.0);
    LCE_CHECK_CMP(compare(
        "dX", tokens * h, [&](std::int64_t e) { return gh.get(e / h, e % h); },
        [&](std::int64_t e) { return want.dx[static_cast<std::size_t>((e / h) * hidden + e % h)]; },
        [&](std::int64_t, double) { return tol * scale_x; }));
    LCE_CHECK_CMP(compare(
        "dW", vocab * h, [&](std::int64_t e) { return gw.get(e / h, e % h); },
        [&](std::int64_t e) { return want.dw[static_cast<std::size_t>((e / h) * hidden + e % h)]; },
        [&](std::int64_t, double) { return tol * scale_w; }));
    LCE_CHECK_CMP(compare(
        "db", vocab, [&](std::int64_t j) { return double(gb[static_cast<std::size_t>(j)]) - 0.5; },
        [&](std::int64_t j) { return want.dw[static_cast<std::size_t>(j * hidden + h)]; },
        [&](std::int64_t, double) { return gradient_tol<T>() * scale_w; }));
  };
  vector_buf<O> lp(tokens), lse(tokens);
  op.forward(x, lce::with_bias{w, b}, Y.cview(), lp.view(), lse.view());
  {
    matrix_buf<G> gh(tokens, h), gw(vocab, h);
    gw.fill(G(0));
    std::vector<O> gb(static_cast<std::size_t>(vocab), O(0.5));  // accumulated onto
    op.backward(x, lce::with_bias{w, b}, Y.cview(), lse.cview(), Gv.cview(), gh.view(),
                lce::with_bias{gw.view(), lce::vector_view<O>{gb.data(), vocab}});
    check("backward", gh, gw, gb);
    check_took_vocabulary_order<decltype(op), T>(op, l, h);
  }
  {
    matrix_buf<G> gh(tokens, h), gw(vocab, h);
    gw.fill(G(0));
    std::vector<O> gb(static_cast<std::size_t>(vocab), O(0.5));
    vector_buf<O> lp_fb(tokens);
    op.forward_backward(x, lce::with_bias{w, b}, Y.cview(), Gv.cview(), lp_fb.view(), gh.view(),
                        lce::with_bias{gw.view(), lce::vector_view<O>{gb.data(), vocab}});
    check("forward_backward", gh, gw, gb);
  }
}

}  // namespace

TEST_CASE_TEMPLATE("vocabulary order: an LM head with a bias (each tile's columns of db)", T, lce::bfloat16, float,
                   double) {
  for (const tiling l : tilings) check_bias_gradients<T>(l);
}

// Where all of a call's tokens go over each tile, the tile takes at most a
// 32nd of the shard (the engine's vocabulary_share), never fewer columns than
// the host's min_efficient_vocabulary_tile: at N = 520, 1,024 columns of a
// 32,000-row shard, where 16 MiB of logits would hold 8,064, 1,248 of a
// 40,000-row one and 2,048 of 65,536. What a forward_backward allocates is
// that block, the [N, H] sum of dX and a little scratch (H = 8).
TEST_CASE("vocabulary order: a tile of every token holds a 32nd of the shard, down to 1,024 columns") {
  static_assert(lce::min_efficient_vocabulary_tile<lce::host>() == 1024);
  static_assert(lce::min_efficient_vocabulary_tile<lce_test::device_shaped_backend<>>() == INT64_MAX);
  using B = lce::bfloat16;
  constexpr std::int64_t n = 520, h = 8;
  const auto block = [](std::int64_t tile) { return static_cast<std::size_t>(n * tile) * sizeof(float); };
  constexpr std::pair<std::int64_t, std::int64_t> shard_and_tile[] = {{32000, 1024}, {40000, 1248}, {65536, 2048}};
  for (const auto& [vocab, tile] : shard_and_tile) {
    CAPTURE(vocab);
    const problem p = make_problem(n, h, vocab, 97, rounder_for<B>(), 1.0, 0.3, 0.1);
    const auto X = make_matrix<B>(p.x, n, h);
    const auto W = make_matrix<B>(p.w, vocab, h);
    const auto Y = make_targets<std::int64_t>(p.y);
    vector_buf<float> G(random_vector(n, 98, -1.0, 1.0, rounder_for<float>())), lp(n);
    matrix_buf<B> gh(n, h), gw(vocab, h);
    auto op = make_op<B>(lce::options{}, 2);
    REQUIRE(op.chunk_tokens(n, h, vocab) < n);  // the token order would take chunks and the [V, H] accumulator
    op.forward_backward(X.cview(), W.cview(), Y.cview(), G.cview(), lp.view(), gh.view(), gw.view());
    const std::size_t held = op.held_workspace_bytes();
    CHECK(held >= block(tile));
    CHECK(held < block(tile) + (std::size_t{1} << 20));
  }
}

// A chunk the user fixed is kept: the token order, and for a 2-byte
// grad_weight its [V, H] accumulator. Under the budget alone, a float
// grad_weight takes the vocabulary order too (its tiles' dW GEMMs add into
// it), as does a forward of any type.
TEST_CASE("vocabulary order: not for a fixed chunk") {
  using B = lce::bfloat16;
  const std::size_t one_tile = static_cast<std::size_t>(least_all_rows_tile<lce::host>() * tokens) * sizeof(float);
  lce::options fixed = budget_options<B>();
  fixed.chunk_tokens = 8;
  auto bf16 = make_op<B>(fixed);
  CHECK(bf16.workspace_bytes(tokens, hidden, vocab) >= accumulator_bytes<B>());
  auto budget = make_op<B>(budget_options<B>());
  CHECK(budget.workspace_bytes(tokens, hidden, vocab) < accumulator_bytes<B>());
  lce::options fixed_f32 = budget_options<float>();
  fixed_f32.chunk_tokens = 24;
  auto f32_fixed = make_op<float>(fixed_f32);
  CHECK(f32_fixed.workspace_bytes(tokens, hidden, vocab) >= static_cast<std::size_t>(24 * vocab) * sizeof(float));
  auto f32 = make_op<float>(budget_options<float>());
  CHECK(f32.workspace_bytes(tokens, hidden, vocab) < one_tile + (std::size_t{64} << 10));
}
