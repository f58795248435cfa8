// options.overwrite_weight_gradients, shared by the CPU suite
// (tests/unit/test_overwrite.cpp) and the CUDA one: a call writes its own
// dL/dweight (and dL/dbias) over grad_weight (and grad_bias), neither reading
// nor keeping what they held. They start as NaN here, so a path that read
// them would show it. Every path a call can take writes each row once: one
// chunk (the backend's dW tiles straight into grad_weight), several chunks
// (the accumulator, rounded or copied in at the end), the vocabulary order
// with all rows or in token slices, and a call with no tokens (zeros). The
// results are the materialised reference's, as if grad_weight had been zero.
#pragma once

#include "cases/vocabulary_order_cases.hpp"

#include <limits>
#include <string>
#include <vector>

namespace lce_test::cases::overwrite {

using vocabulary_order::narrow_t;
using vocabulary_order::tiling;

struct path {
  const char* name;
  std::int64_t chunk_tokens;  // 0: the budget alone
  std::size_t budget;         // 0: the default
};

template <class T>
std::vector<path> paths() {
  return {{"one chunk", vocabulary_order::tokens, 0},
          {"chunks of 7 tokens", 7, 0},
          {"vocabulary order, all rows", 0, vocabulary_order::budget_bytes<T>(tiling::all_rows)},
          {"vocabulary order, token slices", 0, vocabulary_order::budget_bytes<T>(tiling::token_slices)}};
}

template <class Env, class T>
void matches_reference(int threads = 0) {
  using G = narrow_t<T>;
  const auto in = vocabulary_order::exercise_inputs_for<T>(scalings[0]);
  const std::vector<double> nan(in.pre.size(), std::numeric_limits<double>::quiet_NaN()), zero(in.pre.size(), 0.0);
  for (const path& route : paths<T>()) {
    const std::string name = route.name;
    CAPTURE(name);
    lce::options opt = make_options(1.0f, 0.0f, route.chunk_tokens);
    if (route.budget) opt.workspace_limit_bytes = route.budget;
    opt.overwrite_weight_gradients = true;
    auto op = Env::template make_op<T>(opt, threads);
    check_against_reference(exercise<T, G>(op, in.p, in.g, in.hg, nan), in.p, in.g, in.hg, zero,
                            Env::template gradient_operand_unit<T>, Env::template gradient_operand_floor<T>);
  }
}

// A forward_backward whose grad_weight rows hold a logit column of every
// token (N x sizeof(compute) <= H x sizeof(grad_weight): N <= H in fp32, N <=
// H / 2 for a 2-byte grad_weight) keeps the logits of its first sweep over
// the vocabulary tiles in grad_weight, which it writes over anyway, until
// its second (detail/engine.hpp: kept_logits_plan): the default budget,
// every scaling (the soft-cap goes onto the kept logits in place),
// grad_weight NaN before, at the limit (each tile as wide as the one
// before) and below it (the tiles start narrow and grow). Where the rows
// hold half a column (2-byte inputs at N = 2 H x sizeof(grad_weight) /
// sizeof(compute)), some tiles' logits are kept and the others' computed
// again in the logit block, in turn. The operator then holds one tile of
// every token, not all their logits. With grad_weight's rows padded,
// nothing is kept there and the padding is left alone: a grad_weight of the
// compute type then takes the token order's chunk of all the logits, as a
// float call does at N = 2 H (its three GEMMs there beat three and a half).
// A 2-byte grad_weight on the host keeps logits as bf16 ratios at N = H and,
// those of some tiles, at N = 2 H and 4 H.
template <class Env, class T>
void logits_kept_in_grad_weight(int threads = 0) {
  using G = narrow_t<T>;
  using vocabulary_order::tokens, vocabulary_order::vocab;
  const std::size_t all_logits = static_cast<std::size_t>(tokens * vocab) * sizeof(lce::compute_t<T>);
  // Half a column per row; at the limit; and with twice the room per row: tiles of 512, 1,024, 2,048
  // and then 4,096 columns.
  const std::int64_t at_limit = tokens * static_cast<std::int64_t>(sizeof(lce::compute_t<T>) / sizeof(G));
  constexpr bool inputs_of_compute_type = std::is_same_v<T, lce::compute_t<T>>;
  // A 2-byte grad_weight on a backend that keeps ratios (the host) keeps some of them up to N = 4 H
  // (N = 2 H and 4 H here; elsewhere the vocabulary order, against the same reference).
  std::vector<std::int64_t> widths{at_limit / 2, at_limit, 2 * at_limit};
  if constexpr (sizeof(G) == 2) {
    widths.push_back(at_limit / 4);
    widths.push_back(at_limit / 8);
  }
  for (const std::int64_t h : widths)
    for (const auto& s : scalings)
      for (const bool padded : {false, true}) {
        CAPTURE(h);
        CAPTURE(s.tau);
        CAPTURE(s.cap);
        CAPTURE(padded);
        const auto in = vocabulary_order::exercise_inputs_for<T>(s, h);
        const std::vector<double> nan(in.pre.size(), std::numeric_limits<double>::quiet_NaN()),
            zero(in.pre.size(), 0.0);
        lce::options opt = make_options(s.tau, s.cap);
        opt.overwrite_weight_gradients = true;
        auto op = Env::template make_op<T>(opt, threads);
        layout padding;
        if (padded) padding.gw_ld = h + 5;
        check_against_reference(exercise<T, G>(op, in.p, in.g, in.hg, nan, padding), in.p, in.g, in.hg, zero,
                                Env::template gradient_operand_unit<T>, Env::template gradient_operand_floor<T>);
        CAPTURE(op.held_workspace_bytes());
        if (!padded && (h >= at_limit || !inputs_of_compute_type)) CHECK(op.held_workspace_bytes() < all_logits / 2);
        else if (std::is_same_v<G, lce::compute_t<T>>) CHECK(op.held_workspace_bytes() >= all_logits);
      }
}

// A forward_backward of several chunks in the token order that writes a
// narrower grad_weight over holds its [V, H] dW sum in the compute type half
// in grad_weight's own storage (all of it but a row's worth), half in scratch,
// and rounds it into grad_weight at the end, in place (detail/engine.hpp:
// accumulator_in_grad_weight_or): it holds that much less than the same call
// without the overwrite. Chunks of 7 tokens, every scaling, grad_weight NaN
// before, against the reference; the same bits on 1 and 3 threads. With
// padded grad_weight rows (the storage is not free) it holds the whole sum,
// against the same reference.
template <class Env, class T>
void dw_sum_in_grad_weight() {
  using G = narrow_t<T>;
  using C = lce::compute_t<T>;
  static_assert(sizeof(G) < sizeof(C));
  using vocabulary_order::tokens, vocabulary_order::vocab, vocabulary_order::hidden;
  const std::vector<double> nan(static_cast<std::size_t>(vocab * hidden), std::numeric_limits<double>::quiet_NaN()),
      zero(static_cast<std::size_t>(vocab * hidden), 0.0);
  // The sum's rows grad_weight holds: its bytes in rows of the compute type, but one.
  const std::size_t in_grad_weight =
      static_cast<std::size_t>(vocab * static_cast<std::int64_t>(sizeof(G)) / static_cast<std::int64_t>(sizeof(C)) - 1) *
      static_cast<std::size_t>(hidden) * sizeof(C);
  for (const auto& s : scalings)
    for (const bool padded : {false, true}) {
      CAPTURE(s.tau);
      CAPTURE(s.cap);
      CAPTURE(padded);
      const auto in = vocabulary_order::exercise_inputs_for<T>(s);
      lce::options opt = make_options(s.tau, s.cap, 7);
      const auto held_by = [&](bool overwrite) {
        opt.overwrite_weight_gradients = overwrite;
        auto op = Env::template make_op<T>(opt, 3);
        const auto X = make_matrix<T>(in.p.x, tokens, hidden);
        const auto W = make_matrix<T>(in.p.w, vocab, hidden);
        const auto Y = make_targets<std::int64_t>(in.p.y);
        const vector_buf<out_t<T>> Gv(in.g);
        vector_buf<out_t<T>> lp(tokens);
        matrix_buf<G> gh(tokens, hidden), gw(vocab, hidden, padded ? hidden + 3 : -1);
        op.forward_backward(X.cview(), W.cview(), Y.cview(), Gv.cview(), lp.view(), gh.view(), gw.view());
        return op.held_workspace_bytes();
      };
      const std::size_t whole_sum = held_by(false), split_sum = held_by(true);
      CAPTURE(whole_sum);
      CAPTURE(split_sum);
      if (padded) CHECK(split_sum == whole_sum);
      else CHECK(whole_sum - split_sum + lce::detail::workspace_alignment >= in_grad_weight);
      opt.overwrite_weight_gradients = true;
      layout padding;
      if (padded) padding.gw_ld = hidden + 3;
      auto op = Env::template make_op<T>(opt, 3);
      const auto out = exercise<T, G>(op, in.p, in.g, in.hg, nan, padding);
      check_against_reference(out, in.p, in.g, in.hg, zero, Env::template gradient_operand_unit<T>,
                              Env::template gradient_operand_floor<T>);
      auto one_thread = Env::template make_op<T>(opt, 1);
      const auto diff = exercise<T, G>(one_thread, in.p, in.g, in.hg, nan, padding).bitwise_diff(out);
      CHECK_MESSAGE(diff.empty(), "1 vs 3 threads: " << diff);
    }
}

// grad_bias too, and a call with no tokens: both gradients become zero.
template <class Env, class T>
void bias_and_empty_calls() {
  using O = out_t<T>;
  const std::int64_t n = 13, h = 16, v = 77;
  const problem p = make_problem(n, h, v, 71, rounder_for<T>(), 1.5, 0.5);
  const auto X = make_matrix<T>(p.x, n, h);
  const auto W = make_matrix<T>(p.w, v, h);
  const auto Y = make_targets<std::int64_t>(p.y);
  const vector_buf<O> Gv(random_vector(n, 72, -1.0, 1.0, rounder_for<O>()));
  std::vector<T> bias(static_cast<std::size_t>(v));
  for (std::int64_t j = 0; j < v; ++j) bias[static_cast<std::size_t>(j)] = to_elem<T>(0.01 * static_cast<double>(j % 7));
  const lce::vector_view<const T> b{bias.data(), v};
  const double nan = std::numeric_limits<double>::quiet_NaN();

  // The gradients that accumulate onto zeros, and those that overwrite NaN: the same values.
  struct result {
    matrix_buf<O> gh, gw;
    std::vector<O> gb;
  };
  const auto run = [&](bool overwrite, double start) {
    lce::options opt = make_options(1.0f, 0.0f);
    opt.overwrite_weight_gradients = overwrite;
    auto op = Env::template make_op<T>(opt);
    result r{matrix_buf<O>(n, h), matrix_buf<O>(v, h), std::vector<O>(static_cast<std::size_t>(v), to_elem<O>(start))};
    r.gw.fill(to_elem<O>(start));
    vector_buf<O> lp(n);
    op.forward_backward(X.cview(), lce::with_bias{W.cview(), b}, Y.cview(), Gv.cview(), lp.view(), r.gh.view(),
                        lce::with_bias{r.gw.view(), lce::vector_view<O>{r.gb.data(), v}});
    return r;
  };
  const result added = run(false, 0.0), written = run(true, nan);
  std::int64_t differing = 0;
  for (std::int64_t j = 0; j < v; ++j) {
    differing += !(from_elem(added.gb[static_cast<std::size_t>(j)]) == from_elem(written.gb[static_cast<std::size_t>(j)]));
    for (std::int64_t c = 0; c < h; ++c) differing += !(added.gw.get(j, c) == written.gw.get(j, c));
  }
  CHECK(differing == 0);

  // No tokens: grad_weight and grad_bias zero, nothing else written.
  lce::options opt = make_options(1.0f, 0.0f);
  opt.overwrite_weight_gradients = true;
  auto op = Env::template make_op<T>(opt);
  matrix_buf<O> gh(0, h), gw(v, h);
  gw.fill(to_elem<O>(nan));
  std::vector<O> gb(static_cast<std::size_t>(v), to_elem<O>(nan));
  const auto X0 = make_matrix<T>({}, 0, h);
  const auto Y0 = make_targets<std::int64_t>({});
  const vector_buf<O> G0(std::vector<double>{});
  vector_buf<O> lp0(0);
  op.forward_backward(X0.cview(), lce::with_bias{W.cview(), b}, Y0.cview(), G0.cview(), lp0.view(), gh.view(),
                      lce::with_bias{gw.view(), lce::vector_view<O>{gb.data(), v}});
  std::int64_t nonzero = 0;
  for (std::int64_t j = 0; j < v; ++j) {
    nonzero += from_elem(gb[static_cast<std::size_t>(j)]) != 0.0;
    for (std::int64_t c = 0; c < h; ++c) nonzero += gw.get(j, c) != 0.0;
  }
  CHECK(nonzero == 0);
  CHECK(gw.padding_intact());
}

}  // namespace lce_test::cases::overwrite
