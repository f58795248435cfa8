// An LM head with a bias (lce::with_bias): s = x . w + b, for any Env
// (cases/host_env.hpp: the host, or tests/cuda's device mirror). The
// reference is the materialised one of a problem with one more hidden column:
// x' = [x, 1] and w' = [w, b] give the same logits, and dW' holds dW and, in
// its last column, db. A backend that rounds dz to a narrower GEMM operand
// (Env::gradient_operand_unit) gets the bound of that rounding on top of the
// tolerance (reference_operand_rounding_bounds).
#pragma once

#include "cases/host_env.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace lce_test::cases::bias {

// forward, backward and forward_backward with_bias equal the head with the bias as a column.
template <class Env, class T>
void matches_bias_as_a_column() {
  using O = out_t<T>;
  const std::int64_t n = 13, h = 16, v = 77;
  for (const auto& s : scalings) {
    CAPTURE(s.tau);
    CAPTURE(s.cap);
    problem p = make_problem(n, h + 1, v, 51, rounder_for<T>(), 1.5, 0.5);
    p.tau = s.tau;
    p.cap = s.cap;
    for (std::int64_t i = 0; i < n; ++i) p.x[static_cast<std::size_t>(i * (h + 1) + h)] = 1.0;
    const forward_result ref = reference_forward(p);
    const std::vector<double> g = random_vector(n, 52, -1, 1);
    const gradients want = reference_backward(p, ref, g, {});
    const operand_rounding_bounds rounding = reference_operand_rounding_bounds(
        p, ref, g, {}, Env::template gradient_operand_unit<T>, Env::template gradient_operand_floor<T>);
    // The element of the reference's [rows, h + 1] layout: x's (and w's) columns, then the bias's.
    const auto at = [&](std::int64_t row, std::int64_t column) { return static_cast<std::size_t>(row * (h + 1) + column); };

    const auto X = make_matrix<T>(p.x, n, h + 1);
    const auto W = make_matrix<T>(p.w, v, h + 1);
    const lce::matrix_view<const T> hidden{X.ptr(), n, h, h + 1}, weight{W.ptr(), v, h, h + 1};
    std::vector<T> bias(static_cast<std::size_t>(v));
    for (std::int64_t j = 0; j < v; ++j) bias[static_cast<std::size_t>(j)] = W.at(j, h);
    const lce::vector_view<const T> b{bias.data(), v};
    const auto Y = make_targets<std::int64_t>(p.y);
    auto op = Env::template make_op<T>(make_options(s.tau, s.cap, s.chunk));

    vector_buf<O> lp(n), lse(n);
    op.forward(hidden, lce::with_bias{weight, b}, Y.cview(), lp.view(), lse.view());
    const double tol = base_tol<T>() * 10;
    LCE_CHECK_CMP(compare(
        "logprobs", n, [&](std::int64_t i) { return lp.get(i); }, [&](std::int64_t i) { return double(ref.logp[i]); },
        [&](std::int64_t, double w) { return tol * (1 + std::fabs(w)); }));

    // The gradients: dX is x's columns of dX', dW w's columns of dW', db its last.
    const auto check_gradients = [&](const char* what, const matrix_buf<O>& gh, const matrix_buf<O>& gw,
                                     const std::vector<O>& gb) {
      CAPTURE(what);
      const double scale_x = 1 + max_abs(want.dx), scale_w = 1 + max_abs(want.dw);
      LCE_CHECK_CMP(compare(
          "dX", n * h, [&](std::int64_t e) { return gh.get(e / h, e % h); },
          [&](std::int64_t e) { return want.dx[at(e / h, e % h)]; },
          [&](std::int64_t e, double) { return gradient_tol<T>() * scale_x + rounding.dx[at(e / h, e % h)]; }));
      LCE_CHECK_CMP(compare(
          "dW", v * h, [&](std::int64_t e) { return gw.get(e / h, e % h); },
          [&](std::int64_t e) { return want.dw[at(e / h, e % h)]; },
          [&](std::int64_t e, double) { return gradient_tol<T>() * scale_w + rounding.dw[at(e / h, e % h)]; }));
      LCE_CHECK_CMP(compare(
          "db", v, [&](std::int64_t j) { return double(gb[static_cast<std::size_t>(j)]) - 0.5; },
          [&](std::int64_t j) { return want.dw[at(j, h)]; },
          [&](std::int64_t j, double) { return gradient_tol<T>() * scale_w + rounding.dw[at(j, h)]; }));
    };
    const vector_buf<O> G(g);
    {
      matrix_buf<O> gh(n, h), gw(v, h);
      gw.fill(O(0));
      std::vector<O> gb(static_cast<std::size_t>(v), O(0.5));  // accumulated onto
      op.backward(hidden, lce::with_bias{weight, b}, Y.cview(), lse.cview(), G.cview(), gh.view(),
                  lce::with_bias{gw.view(), lce::vector_view<O>{gb.data(), v}});
      check_gradients("backward", gh, gw, gb);
    }
    {
      matrix_buf<O> gh(n, h), gw(v, h);
      gw.fill(O(0));
      std::vector<O> gb(static_cast<std::size_t>(v), O(0.5));
      vector_buf<O> lp_fb(n);
      op.forward_backward(hidden, lce::with_bias{weight, b}, Y.cview(), G.cview(), lp_fb.view(), gh.view(),
                          lce::with_bias{gw.view(), lce::vector_view<O>{gb.data(), v}});
      check_gradients("forward_backward", gh, gw, gb);
    }
    // Without the bias the log-probs differ: the bias is not ignored.
    vector_buf<O> lp0(n), lse0(n);
    op.forward(hidden, weight, Y.cview(), lp0.view(), lse0.view());
    bool differs = false;
    for (std::int64_t i = 0; i < n; ++i) differs |= !p.ignored(i) && std::fabs(lp0.get(i) - lp.get(i)) > 1e-3;
    CHECK(differs);
  }
}

// A bias of -inf masks its column (padded vocabulary slots, a restricted set of
// outputs): p = 0 there, and it adds nothing to the lse, the entropy or any
// gradient. The reference is the head without the masked columns, materialised
// in double with the bias as a hidden column (as above). Log-probs, lse, entropy
// and the gradients (of log-probs and entropy, and of forward_backward) must be
// its, and the masked columns' rows of dW and entries of db must stay exactly as
// they were (0, and 0.5 accumulated onto).
template <class Env, class T, class G, class Masked, class AfterBackward>
void masked_columns(std::int64_t n, std::int64_t h, std::int64_t v, const lce::options& opt, Masked masked,
                          std::uint64_t seed, AfterBackward after_backward) {
  using O = out_t<T>;
  std::vector<std::int64_t> kept;
  for (std::int64_t j = 0; j < v; ++j)
    if (!masked(j)) kept.push_back(j);
  const auto k = static_cast<std::int64_t>(kept.size());
  problem p = make_problem(n, h + 1, k, seed, rounder_for<T>(), 1.5, 0.5);
  p.tau = opt.temperature;
  for (std::int64_t i = 0; i < n; ++i) p.x[static_cast<std::size_t>(i * (h + 1) + h)] = 1.0;
  const forward_result ref = reference_forward(p);
  const std::vector<double> g = random_vector(n, seed + 1, -1, 1), hg = random_vector(n, seed + 2, -1, 1);
  const gradients want = reference_backward(p, ref, g, hg), want_fb = reference_backward(p, ref, g, {});
  const double unit = Env::template gradient_operand_unit<T>, floor = Env::template gradient_operand_floor<T>;
  const operand_rounding_bounds rounding = reference_operand_rounding_bounds(p, ref, g, hg, unit, floor),
                                rounding_fb = reference_operand_rounding_bounds(p, ref, g, {}, unit, floor);

  // lce's head: every column; a masked one has a -inf bias and any weights (kept column 0's).
  std::vector<double> x(static_cast<std::size_t>(n * h)), w(static_cast<std::size_t>(v * h));
  std::vector<T> bias(static_cast<std::size_t>(v), to_elem<T>(-std::numeric_limits<double>::infinity()));
  std::vector<std::int64_t> kept_index(static_cast<std::size_t>(v), -1);
  for (std::int64_t c = 0; c < k; ++c) kept_index[static_cast<std::size_t>(kept[static_cast<std::size_t>(c)])] = c;
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t c = 0; c < h; ++c) x[static_cast<std::size_t>(i * h + c)] = p.x[static_cast<std::size_t>(i * (h + 1) + c)];
  for (std::int64_t j = 0; j < v; ++j) {
    const std::int64_t from = std::max<std::int64_t>(kept_index[static_cast<std::size_t>(j)], 0);
    for (std::int64_t c = 0; c < h; ++c)
      w[static_cast<std::size_t>(j * h + c)] = p.w[static_cast<std::size_t>(from * (h + 1) + c)];
    if (kept_index[static_cast<std::size_t>(j)] >= 0)
      bias[static_cast<std::size_t>(j)] = to_elem<T>(p.w[static_cast<std::size_t>(from * (h + 1) + h)]);
  }
  std::vector<std::int64_t> y(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i)
    y[static_cast<std::size_t>(i)] = p.ignored(i) ? p.ignore_index : kept[static_cast<std::size_t>(p.y[static_cast<std::size_t>(i)])];
  const auto X = make_matrix<T>(x, n, h);
  const auto W = make_matrix<T>(w, v, h);
  const auto Y = make_targets<std::int64_t>(y);
  const lce::vector_view<const T> b{bias.data(), v};
  const auto head = lce::with_bias{W.cview(), b};
  auto op = Env::template make_op<T>(opt);

  vector_buf<O> lp(n), lse(n), ent(n);
  op.forward(X.cview(), head, Y.cview(), lp.view(), lse.view(), ent.view());
  const double tol = base_tol<T>() * 10;
  const auto row_check = [&](const char* what, const vector_buf<O>& got, const std::vector<real>& expected) {
    LCE_CHECK_CMP(compare(
        what, n, [&](std::int64_t i) { return got.get(i); }, [&](std::int64_t i) { return double(expected[i]); },
        [&](std::int64_t, double e) { return tol * (1 + std::fabs(e)); }));
  };
  row_check("logprobs", lp, ref.logp);
  row_check("lse", lse, ref.lse);
  row_check("entropy", ent, ref.ent);

  const auto check_gradients = [&](const char* what, const gradients& expected, const operand_rounding_bounds& moved,
                                   const matrix_buf<G>& gh, const matrix_buf<G>& gw, const std::vector<O>& gb) {
    CAPTURE(what);
    const double scale_x = 1 + max_abs(expected.dx), scale_w = 1 + max_abs(expected.dw);
    const double gtol = gradient_tol<T>() + ulp_of<G>(1.0);
    LCE_CHECK_CMP(compare(
        "dX", n * h, [&](std::int64_t e) { return gh.get(e / h, e % h); },
        [&](std::int64_t e) { return expected.dx[static_cast<std::size_t>((e / h) * (h + 1) + e % h)]; },
        [&](std::int64_t e, double) {
          return gtol * scale_x + moved.dx[static_cast<std::size_t>((e / h) * (h + 1) + e % h)];
        }));
    // A masked row of dW, and its db, must be untouched: a want of exactly 0 (and 0.5 - 0.5).
    const auto kept_or_zero = [&](std::int64_t j, std::int64_t c) {
      const std::int64_t from = kept_index[static_cast<std::size_t>(j)];
      return from < 0 ? 0.0 : expected.dw[static_cast<std::size_t>(from * (h + 1) + c)];
    };
    const auto tolerance_of = [&](std::int64_t j, std::int64_t c, double scale) {
      const std::int64_t from = kept_index[static_cast<std::size_t>(j)];
      return from < 0 ? 0.0 : gtol * scale + moved.dw[static_cast<std::size_t>(from * (h + 1) + c)];
    };
    LCE_CHECK_CMP(compare(
        "dW", v * h, [&](std::int64_t e) { return gw.get(e / h, e % h); },
        [&](std::int64_t e) { return kept_or_zero(e / h, e % h); },
        [&](std::int64_t e, double) { return tolerance_of(e / h, e % h, scale_w); }));
    LCE_CHECK_CMP(compare(
        "db", v, [&](std::int64_t j) { return double(gb[static_cast<std::size_t>(j)]) - 0.5; },
        [&](std::int64_t j) { return kept_or_zero(j, h); },
        [&](std::int64_t j, double) { return tolerance_of(j, h, scale_w); }));
  };
  const vector_buf<O> Gv(g), HG(hg);
  {
    matrix_buf<G> gh(n, h), gw(v, h);
    gw.fill(G(0));
    std::vector<O> gb(static_cast<std::size_t>(v), O(0.5));
    op.backward(X.cview(), head, Y.cview(), lse.cview(), Gv.cview(), HG.cview(), gh.view(),
                lce::with_bias{gw.view(), lce::vector_view<O>{gb.data(), v}});
    check_gradients("backward, log-probs and entropy", want, rounding, gh, gw, gb);
    after_backward(op);
  }
  {
    matrix_buf<G> gh(n, h), gw(v, h);
    gw.fill(G(0));
    std::vector<O> gb(static_cast<std::size_t>(v), O(0.5));
    vector_buf<O> lp_fb(n);
    op.forward_backward(X.cview(), head, Y.cview(), Gv.cview(), lp_fb.view(), gh.view(),
                        lce::with_bias{gw.view(), lce::vector_view<O>{gb.data(), v}});
    check_gradients("forward_backward", want_fb, rounding_fb, gh, gw, gb);
    row_check("forward_backward logprobs", lp_fb, ref.logp);
  }
}

// The token order: the last 17 columns (padded vocabulary slots) and every 7th.
template <class Env, class T>
void masks_columns() {
  const auto masked = [](std::int64_t j) { return j >= 60 || j % 7 == 3; };
  for (const auto& s : scalings) {
    if (s.cap != 0.0f) continue;  // the soft-cap maps -inf to -cap: no mask
    CAPTURE(s.tau);
    CAPTURE(s.chunk);
    masked_columns<Env, T, out_t<T>>(13, 16, 77, make_options(s.tau, 0.0f, s.chunk), masked, 61, [](const auto&) {});
  }
}

}  // namespace lce_test::cases::bias
