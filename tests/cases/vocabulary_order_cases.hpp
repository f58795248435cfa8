// The vocabulary order (detail/engine.hpp: vocabulary_tiles_plan), shared
// by the CPU suite (tests/unit/test_vocabulary_order.cpp) and the CUDA one.
// A call on one rank with a grad_weight narrower than the compute type,
// whose budget chunk holds fewer rows than it has tokens, would hold the
// [V, H] dW accumulator on top of its chunks. Where all its tokens at once,
// the vocabulary a tile at a time, hold less (an [N, H] sum of dX instead),
// the call sweeps that way: every result must still be the materialised
// reference's. Under a budget too small for every token over one tile, the
// tokens go in slices too, and each tile's dW is summed over them in a
// [tile, H] accumulator: the same results. A forward, and a grad_weight of
// the compute type (float), take the vocabulary order with all their rows
// at once where it holds less than their chunk (direct_plan_for), in
// slices where the budget starves the token order's chunks (this one).
#pragma once

#include "cases/host_env.hpp"


namespace lce_test::cases::vocabulary_order {

// Shapes where N x H is far below V x H and the budget holds a few
// vocabulary tiles of every token but not the whole vocabulary.
// (Tiles of token slices are 4,096 vocabulary rows: vocabulary_tile_min_columns.
// Tiles of all rows may be narrower: at most a 32nd of the vocabulary, down to the
// backend's min_efficient_vocabulary_tile, 1,024 on the host; no share on CUDA.)
constexpr std::int64_t tokens = 48, hidden = 64, vocab = 12001;  // 12001: a ragged last tile
constexpr std::int64_t min_tile = 4096;

template <class Backend>
constexpr std::int64_t least_all_rows_tile() {
  return std::min<std::int64_t>(min_tile, std::max<std::int64_t>(lce::min_efficient_vocabulary_tile<Backend>(),
                                                                 (vocab + 31) / 32));
}

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
  // A grad_weight of the compute type (float) is its own accumulator.
  const std::size_t tile_accumulator =
      std::is_same_v<narrow_t<T>, lce::compute_t<T>> ? 0 : static_cast<std::size_t>(min_tile * h) * sizeof(lce::compute_t<T>);
  REQUIRE(op.chunk_tokens(tokens, h, vocab) < tokens);  // the token order would need several chunks
  const std::size_t held = op.held_workspace_bytes();
  CHECK(held < accumulator_bytes<T>());
  CHECK(held < one_chunk_logits);
  // The largest over every kind of call: a forward's chunk of the budget may hold more
  // than the vocabulary order's narrow tiles, so a forward_backward alone can hold less.
  CHECK(op.workspace_bytes(tokens, h, vocab) >= held);
  if (l == tiling::token_slices) {
    static_assert(budget_bytes<T>(tiling::token_slices) < tile_of_all_rows_bytes<T>());
    CHECK(held >= tile_accumulator);
    CHECK(held <= budget_bytes<T>(l) + tile_accumulator);
  } else {
    constexpr std::int64_t least_tile = least_all_rows_tile<typename Op::backend_type>();
    CHECK(held >= static_cast<std::size_t>(least_tile * tokens) * sizeof(lce::compute_t<T>));
  }
}

// A call alone (a forward of any T; a backward or forward_backward with a
// float grad_weight, which has no dW scratch) under the all-rows budget
// holds one tile of every token and a little more, not a chunk of the
// budget over the whole vocabulary (the token order: about the budget).
// Only where the backend's tiles are narrower than 4,096 columns (the host):
// without a share, a tile of every token is itself most of this budget.
template <class Env, class T>
void check_call_alone_holds_a_tile() {
  using Backend = typename decltype(Env::template make_op<T>(lce::options{}))::backend_type;
  constexpr std::int64_t tile = least_all_rows_tile<Backend>();
  if constexpr (tile < min_tile) {
    using O = out_t<T>;
    const std::size_t bound = 2 * static_cast<std::size_t>(tile * tokens) * sizeof(lce::compute_t<T>);
    static_assert(2 * tile * tokens * sizeof(lce::compute_t<T>) < budget_bytes<T>() / 2);
    const problem p = make_problem(tokens, hidden, vocab, 65, rounder_for<T>(), 1.0, 0.3, 0.1);
    const auto X = make_matrix<T>(p.x, tokens, hidden);
    const auto W = make_matrix<T>(p.w, vocab, hidden);
    const auto Y = make_targets<std::int64_t>(p.y);
    const vector_buf<O> Gv(random_vector(tokens, 66, -1.0, 1.0, rounder_for<O>()));
    vector_buf<O> lp(tokens), lse(tokens);
    {
      auto op = Env::template make_op<T>(budget_options<T>());
      op.forward(X.cview(), W.cview(), Y.cview(), lp.view(), lse.view());
      CAPTURE(op.held_workspace_bytes());
      CHECK(op.held_workspace_bytes() <= bound);
    }
    if constexpr (std::is_same_v<T, float>) {
      matrix_buf<T> gh(tokens, hidden), gw(vocab, hidden);
      gw.fill(T(0));
      auto backward = Env::template make_op<T>(budget_options<T>());
      backward.backward(X.cview(), W.cview(), Y.cview(), lse.cview(), Gv.cview(), gh.view(), gw.view());
      CAPTURE(backward.held_workspace_bytes());
      CHECK(backward.held_workspace_bytes() <= bound);
      auto fused = Env::template make_op<T>(budget_options<T>());
      fused.forward_backward(X.cview(), W.cview(), Y.cview(), Gv.cview(), lp.view(), gh.view(), gw.view());
      CAPTURE(fused.held_workspace_bytes());
      CHECK(fused.held_workspace_bytes() <= bound);
    }
  }
}

// The inputs of an exercise (forward, backward with entropy, forward_backward)
// at these shapes under one scaling: dL/dlogp, dL/dentropy, grad_weight's prefill.
struct exercise_inputs {
  problem p;
  std::vector<double> g, hg, pre;
};

template <class T>
exercise_inputs exercise_inputs_for(const scaling& s, std::int64_t h = hidden) {
  exercise_inputs in{make_problem(tokens, h, vocab, 61, rounder_for<T>(), 1.0, 0.3, 0.1), {}, {}, {}};
  in.p.tau = s.tau;
  in.p.cap = s.cap;
  in.g = random_vector(in.p.n, 62, -1.0, 1.0, rounder_for<out_t<T>>());
  in.hg = random_vector(in.p.n, 63, -0.5, 0.5, rounder_for<out_t<T>>());
  in.pre = random_vector(in.p.v * in.p.h, 64, -1.0, 1.0, rounder_for<narrow_t<T>>());
  return in;
}

// forward, backward with entropy and forward_backward, for every tiling and
// scaling, against the reference; returns nothing, checks everything.
template <class Env, class T>
void matches_reference(int threads = 0) {
  for (const tiling l : tilings)
  for (const auto& s : scalings) {
    CAPTURE(int(l));
    CAPTURE(s.tau);
    CAPTURE(s.cap);
    const exercise_inputs in = exercise_inputs_for<T>(s);
    auto op = Env::template make_op<T>(budget_options<T>(s.tau, s.cap, l), threads);
    check_against_reference(exercise<T, narrow_t<T>>(op, in.p, in.g, in.hg, in.pre), in.p, in.g, in.hg, in.pre,
                            Env::template gradient_operand_unit<T>, Env::template gradient_operand_floor<T>);
    check_took_vocabulary_order<decltype(op), T>(op, l);
  }
  check_call_alone_holds_a_tile<Env, T>();
}

}  // namespace lce_test::cases::vocabulary_order
