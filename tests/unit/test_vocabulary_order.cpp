// The vocabulary order (detail/engine.hpp: vocabulary_tiles_plan). A call on
// one rank with a grad_weight narrower than the compute type, whose budget
// chunk holds fewer rows than it has tokens, would hold the [V, H] dW
// accumulator on top of its chunks. Where all its tokens at once, the
// vocabulary a tile at a time, hold less (an [N, H] sum of dX instead), the
// call sweeps that way: every result must still be the materialised
// reference's, for every row term, a soft-cap and temperature, a bias, and
// bitwise the same for any thread count. Under a budget too small for
// every token over one tile, the tokens go in slices too, and each tile's
// dW is summed over them in a [tile, H] accumulator: the same results.
#include "support/harness.hpp"

using namespace lce_test;

namespace {

// Shapes where N x H is far below V x H and the budget holds a few
// vocabulary tiles of every token but not the whole vocabulary.
// (Tiles are at least 4,096 vocabulary rows: vocabulary_tile_min_columns.)
constexpr std::int64_t tokens = 48, hidden = 64, vocab = 12001;  // 12001: a ragged last tile
constexpr std::int64_t min_tile = 4096;

// all_rows: 1.25 MiB for 4-byte logits (2-byte T), twice that for double's:
// every token over a tile. token_slices: 0.5 MiB (resp. 1 MiB): some 30
// tokens over a tile, so slices of about 30 and 18 rows.
enum class tiling { all_rows, token_slices };
constexpr tiling tilings[] = {tiling::all_rows, tiling::token_slices};

template <class T>
constexpr std::size_t budget_bytes(tiling l = tiling::all_rows) {
  return (l == tiling::all_rows ? std::size_t{1280} << 10 : std::size_t{512} << 10) * sizeof(lce::compute_t<T>) / 4;
}

template <class T>
constexpr std::size_t tile_of_all_rows_bytes() {
  return static_cast<std::size_t>(min_tile * tokens) * sizeof(lce::compute_t<T>);
}

template <class T>
lce::options budget_options(float tau = 1.0f, float cap = 0.0f, tiling l = tiling::all_rows) {
  lce::options o = make_options(tau, cap);
  o.workspace_limit_bytes = budget_bytes<T>(l);
  return o;
}

template <class T>
using narrow_t = std::conditional_t<std::is_same_v<T, double>, float, T>;

template <class T>
std::size_t accumulator_bytes() {
  return static_cast<std::size_t>(vocab * hidden) * sizeof(lce::compute_t<T>);
}

// The call took the vocabulary order: it holds less than the accumulator
// alone, and less than one chunk of every token over the whole vocabulary.
// With all rows at once, its block holds every token over a tile; with
// token slices, a tile's [tile, H] accumulator and, within the budget
// (below every token over a tile), a slice's block.
template <class Op, class T>
void check_took_vocabulary_order(const Op& op, tiling l = tiling::all_rows, std::int64_t h = hidden) {
  const std::size_t one_chunk_logits = static_cast<std::size_t>(tokens * vocab) * sizeof(lce::compute_t<T>);
  const std::size_t tile_accumulator = static_cast<std::size_t>(min_tile * h) * sizeof(lce::compute_t<T>);
  const std::size_t tile_of_all_rows = tile_of_all_rows_bytes<T>();
  REQUIRE(op.chunk_tokens(tokens, h, vocab) < tokens);  // the token order would need several chunks
  const std::size_t held = op.held_workspace_bytes();
  CHECK(held < accumulator_bytes<T>());
  CHECK(held < one_chunk_logits);
  CHECK(op.workspace_bytes(tokens, h, vocab) == held);
  if (l == tiling::token_slices) {
    static_assert(budget_bytes<T>(tiling::token_slices) < tile_of_all_rows_bytes<T>());
    CHECK(held >= tile_accumulator);
    CHECK(held <= budget_bytes<T>(l) + tile_accumulator);
  } else {
    CHECK(held >= tile_of_all_rows);
  }
}

}  // namespace

TEST_CASE_TEMPLATE("vocabulary order: forward, backward with entropy and forward_backward equal the reference", T,
                   lce::bfloat16, lce::float16, double) {
  using G = narrow_t<T>;
  using O = out_t<T>;
  for (const tiling l : tilings)
  for (const auto& s : scalings) {
    CAPTURE(int(l));
    CAPTURE(s.tau);
    CAPTURE(s.cap);
    problem p = make_problem(tokens, hidden, vocab, 61, rounder_for<T>(), 1.0, 0.3, 0.1);
    p.tau = s.tau;
    p.cap = s.cap;
    const auto g = random_vector(p.n, 62, -1.0, 1.0, rounder_for<O>());
    const auto hg = random_vector(p.n, 63, -0.5, 0.5, rounder_for<O>());
    const auto pre = random_vector(p.v * p.h, 64, -1.0, 1.0, rounder_for<G>());

    auto op = make_op<T>(budget_options<T>(s.tau, s.cap, l), 3);
    const auto tiled = exercise<T, G>(op, p, g, hg, pre);
    check_against_reference(tiled, p, g, hg, pre);
    check_took_vocabulary_order<decltype(op), T>(op, l);

    auto one_thread = make_op<T>(budget_options<T>(s.tau, s.cap, l), 1);
    const auto diff = exercise<T, G>(one_thread, p, g, hg, pre).bitwise_diff(tiled);
    CHECK_MESSAGE(diff.empty(), "host{1} vs host{3}: " << diff);
  }
}

TEST_CASE_TEMPLATE("vocabulary order: forward_backward with every row term in and out", T, lce::bfloat16, double) {
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

TEST_CASE_TEMPLATE("vocabulary order: an LM head with a bias (each tile's columns of db)", T, lce::bfloat16, double) {
  for (const tiling l : tilings) check_bias_gradients<T>(l);
}

// A float grad_weight has no accumulator to save (dW sums into it chunk by
// chunk), and a chunk the user fixed is kept: both stay in the token order.
TEST_CASE("vocabulary order: not for a grad_weight of the compute type, nor a fixed chunk") {
  using B = lce::bfloat16;
  auto f32 = make_op<float>(budget_options<float>());
  CHECK(f32.workspace_bytes(tokens, hidden, vocab) <= budget_bytes<float>());
  lce::options fixed = budget_options<B>();
  fixed.chunk_tokens = 8;
  auto bf16 = make_op<B>(fixed);
  CHECK(bf16.workspace_bytes(tokens, hidden, vocab) >= accumulator_bytes<B>());
  auto budget = make_op<B>(budget_options<B>());
  CHECK(budget.workspace_bytes(tokens, hidden, vocab) < accumulator_bytes<B>());
}
