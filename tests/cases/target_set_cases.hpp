// The bodies of the target-set tests (tests/unit/test_target_sets.cpp),
// shared with the CUDA suite (tests/cuda/test_cuda_backend.cu): targets
// [N, K], K log-probs per token and their gradients, against the
// materialised long-double reference. Env: see cases/host_env.hpp.
#pragma once

#include "cases/host_env.hpp"

namespace lce_test::cases {

// K ids per token: random ids with a repeat, some ignored, and every third
// row's ids all ignored (an ignored token).
inline std::vector<std::int64_t> make_sets(const problem& p, std::int64_t k, std::uint64_t seed) {
  rng r(seed);
  std::vector<std::int64_t> ids(static_cast<std::size_t>(p.n * k));
  for (std::int64_t i = 0; i < p.n; ++i) {
    for (std::int64_t e = 0; e < k; ++e) {
      std::int64_t id = r.below(p.v);
      if (e == k - 1 && k > 2) id = ids[static_cast<std::size_t>(i * k)];  // a repeated id
      if (r.uniform(0, 1) < 0.2) id = p.ignore_index;
      ids[static_cast<std::size_t>(i * k + e)] = id;
    }
    if (i % 3 == 2)
      for (std::int64_t e = 0; e < k; ++e) ids[static_cast<std::size_t>(i * k + e)] = p.ignore_index;
  }
  return ids;
}

inline bool all_ignored(const std::vector<std::int64_t>& ids, std::int64_t k, std::int64_t i, std::int64_t ignore) {
  for (std::int64_t e = 0; e < k; ++e)
    if (ids[static_cast<std::size_t>(i * k + e)] != ignore) return false;
  return true;
}

// dX, dW of L = sum_ik g_ik logp_ik + hg_i entropy_i, materialised:
// dL/dz_ij = sum_k g_ik (1[j = id_ik] - p_ij) + hg_i p_ij (E_p[z] - z_ij);
// and, for a backend that rounds dz to a narrower GEMM operand (unit, floor > 0),
// how far that may move each element (as reference_operand_rounding_bounds).
struct set_gradients {
  std::vector<double> dx, dw;              // [n, h], [v, h]
  std::vector<double> dx_moved, dw_moved;  // rounding bounds
};

inline set_gradients reference_set_backward(const problem& p, const forward_result& r,
                                            const std::vector<std::int64_t>& ids, std::int64_t k,
                                            const std::vector<double>& g, const std::vector<double>& hg,
                                            double unit = 0, double floor = 0) {
  std::vector<real> dx(static_cast<std::size_t>(p.n * p.h), 0), dw(static_cast<std::size_t>(p.v * p.h), 0);
  set_gradients out;
  out.dx_moved.assign(dx.size(), 0.0);
  out.dw_moved.assign(dw.size(), 0.0);
  std::vector<real> dz(static_cast<std::size_t>(p.v));
  for (std::int64_t i = 0; i < p.n; ++i) {
    if (all_ignored(ids, k, i, p.ignore_index)) continue;
    const real* z = &r.z[i * p.v];
    real ez = 0;
    for (std::int64_t j = 0; j < p.v; ++j) ez += std::exp(z[j] - r.lse[i]) * z[j];
    real g_sum = 0;
    for (std::int64_t e = 0; e < k; ++e)
      if (ids[static_cast<std::size_t>(i * k + e)] != p.ignore_index) g_sum += g[static_cast<std::size_t>(i * k + e)];
    const real h_i = hg.empty() ? 0 : static_cast<real>(hg[static_cast<std::size_t>(i)]);
    for (std::int64_t j = 0; j < p.v; ++j) {
      const real pr = std::exp(z[j] - r.lse[i]);
      dz[j] = -g_sum * pr + h_i * pr * (ez - z[j]);
    }
    for (std::int64_t e = 0; e < k; ++e) {
      const auto id = ids[static_cast<std::size_t>(i * k + e)];
      if (id != p.ignore_index) dz[id] += g[static_cast<std::size_t>(i * k + e)];
    }
    for (std::int64_t j = 0; j < p.v; ++j) {
      const real ds = dz[j] * r.dzds[i * p.v + j];
      const double moved = 1.01 * (unit * std::fabs(static_cast<double>(ds)) + floor / static_cast<double>(p.tau));
      for (std::int64_t c = 0; c < p.h; ++c) {
        dx[i * p.h + c] += ds * static_cast<real>(p.w[j * p.h + c]);
        dw[j * p.h + c] += ds * static_cast<real>(p.x[i * p.h + c]);
        out.dx_moved[static_cast<std::size_t>(i * p.h + c)] += moved * std::fabs(p.w[j * p.h + c]);
        out.dw_moved[static_cast<std::size_t>(j * p.h + c)] += moved * std::fabs(p.x[i * p.h + c]);
      }
    }
  }
  out.dx.assign(dx.begin(), dx.end());
  out.dw.assign(dw.begin(), dw.end());
  return out;
}

// |got - want| <= tol (1 + max |want|) + moved, element by element.
template <class G>
comparison compare_set_gradient(const std::string& what, const matrix_buf<G>& got, const std::vector<double>& want,
                                double tol, const std::vector<double>& moved) {
  const double scale = 1 + max_abs(want);
  return compare(
      what, got.rows * got.cols, [&](std::int64_t e) { return got.get(e / got.cols, e % got.cols); },
      [&](std::int64_t e) { return want[static_cast<std::size_t>(e)]; },
      [&](std::int64_t e, double) { return tol * scale + moved[static_cast<std::size_t>(e)]; });
}


template <class I>
matrix_buf<I> make_id_matrix(const std::vector<std::int64_t>& ids, std::int64_t n, std::int64_t k) {
  matrix_buf<I> m(n, k);
  for (std::int64_t e = 0; e < n * k; ++e)
    m.data[static_cast<std::size_t>(e)] = static_cast<I>(ids[static_cast<std::size_t>(e)]);
  return m;
}

template <class Env, class T>
void target_sets_forward() {
  using O = out_t<T>;
  const std::int64_t n = 14, h = 20, v = 83;
  for (const std::int64_t k : {1, 4, 7}) {
    for (const auto& s : scalings) {
      CAPTURE(k);
      CAPTURE(s.tau);
      CAPTURE(s.cap);
      problem p = make_problem(n, h, v, 61, rounder_for<T>(), 1.5, 0.5);
      p.tau = s.tau;
      p.cap = s.cap;
      const auto ids = make_sets(p, k, 62 + static_cast<std::uint64_t>(k));
      const forward_result ref = reference_forward(p);
      auto op = Env::template make_op<T>(make_options(s.tau, s.cap, s.chunk));
      const auto X = make_matrix<T>(p.x, n, h);
      const auto W = make_matrix<T>(p.w, v, h);
      const auto Y = make_id_matrix<std::int32_t>(ids, n, k);
      matrix_buf<O> lp(n, k);
      vector_buf<O> lse(n), ent(n);
      op.forward(X.cview(), W.cview(), Y.cview(), lce::target_set_outputs<O>{lp.view(), lse.view(), ent.view(), {}});
      const double tol = base_tol<T>() * 10;
      LCE_CHECK_CMP(compare(
          "logprobs", n * k, [&](std::int64_t e) { return lp.get(e / k, e % k); },
          [&](std::int64_t e) {
            const auto id = ids[static_cast<std::size_t>(e)];
            return id == p.ignore_index ? 0.0 : static_cast<double>(ref.z[(e / k) * v + id] - ref.lse[e / k]);
          },
          [&](std::int64_t, double w) { return tol * (1 + std::fabs(w)); }));
      LCE_CHECK_CMP(compare(
          "lse", n, [&](std::int64_t i) { return lse.get(i); },
          [&](std::int64_t i) { return static_cast<double>(ref.lse[i]); },
          [&](std::int64_t, double w) { return tol * (1 + std::fabs(w)); }));
      LCE_CHECK_CMP(compare(
          "entropy", n, [&](std::int64_t i) { return ent.get(i); },
          [&](std::int64_t i) {
            if (all_ignored(ids, k, i, p.ignore_index)) return 0.0;
            real e = 0;
            for (std::int64_t j = 0; j < v; ++j) {
              const real pr = std::exp(ref.z[i * v + j] - ref.lse[i]);
              e += pr * (ref.lse[i] - ref.z[i * v + j]);
            }
            return static_cast<double>(e);
          },
          [&](std::int64_t, double w) { return tol * (1 + std::fabs(w)); }));
      CHECK(lp.padding_intact());
    }
  }
}

template <class Env, class T>
void target_sets_gradients() {
  using O = out_t<T>;
  const std::int64_t n = 12, h = 18, v = 71;
  const double unit = Env::template gradient_operand_unit<T>, floor = Env::template gradient_operand_floor<T>;
  for (const std::int64_t k : {1, 5}) {
    for (const auto& s : scalings) {
      for (const bool with_entropy : {false, true}) {
        CAPTURE(k);
        CAPTURE(s.tau);
        CAPTURE(s.cap);
        CAPTURE(with_entropy);
        problem p = make_problem(n, h, v, 71, rounder_for<T>(), 1.5, 0.5);
        p.tau = s.tau;
        p.cap = s.cap;
        const auto ids = make_sets(p, k, 72);
        const forward_result ref = reference_forward(p);
        std::vector<double> g = random_vector(n * k, 73, -1, 1);
        if (k > 1) {  // a row whose gradients sum to zero still moves its ids' logits
          g[0] = 0.5;
          g[1] = -0.5;
          for (std::int64_t e = 2; e < k; ++e) g[static_cast<std::size_t>(e)] = 0;
        }
        const std::vector<double> hg = with_entropy ? random_vector(n, 74, -0.5, 0.5) : std::vector<double>{};
        const set_gradients want = reference_set_backward(p, ref, ids, k, g, hg, unit, floor);

        auto op = Env::template make_op<T>(make_options(s.tau, s.cap, s.chunk));
        const auto X = make_matrix<T>(p.x, n, h, h + 2);
        const auto W = make_matrix<T>(p.w, v, h);
        const auto Y = make_id_matrix<std::int64_t>(ids, n, k);
        matrix_buf<O> lp(n, k);
        vector_buf<O> lse(n);
        op.forward(X.cview(), W.cview(), Y.cview(), lce::target_set_outputs<O>{lp.view(), lse.view(), {}, {}});
        const auto G = make_matrix<O>(g, n, k);
        const vector_buf<O> HG(hg);
        matrix_buf<O> gh(n, h), gw(v, h);
        gw.fill(O(0));
        op.backward(X.cview(), W.cview(), Y.cview(), lse.cview(),
                    lce::target_set_gradients<O>{G.cview(), HG.cview(), {}, {}}, gh.view(), gw.view());
        const double tol = gradient_tol<T>();
        LCE_CHECK_CMP(compare_set_gradient("dX", gh, want.dx, tol, want.dx_moved));
        LCE_CHECK_CMP(compare_set_gradient("dW", gw, want.dw, tol, want.dw_moved));
        CHECK(gh.padding_intact());

        matrix_buf<O> lp_fb(n, k);
        matrix_buf<O> gh_fb(n, h), gw_fb(v, h);
        gw_fb.fill(O(0));
        op.forward_backward(X.cview(), W.cview(), Y.cview(),
                            lce::target_set_gradients<O>{G.cview(), HG.cview(), {}, {}},
                            lce::target_set_outputs<O>{lp_fb.view(), {}, {}, {}}, gh_fb.view(), gw_fb.view());
        LCE_CHECK_CMP(compare_set_gradient("dX fused", gh_fb, want.dx, tol, want.dx_moved));
        LCE_CHECK_CMP(compare_set_gradient("dW fused", gw_fb, want.dw, tol, want.dw_moved));
        LCE_CHECK_CMP(compare(
            "logprobs fused", n * k, [&](std::int64_t e) { return lp_fb.get(e / k, e % k); },
            [&](std::int64_t e) { return lp.get(e / k, e % k); },
            [&](std::int64_t, double w) { return 1e-6 * (1 + std::fabs(w)); }));

        // The set's +g terms must matter: without them the gradient is far off.
        const std::vector<double> zero_g(g.size(), 0.0);
        const set_gradients without = reference_set_backward(p, ref, ids, k, zero_g, hg);
        CHECK_FALSE(compare_set_gradient("dW without the set", gw, without.dw, tol, want.dw_moved).ok);
      }
    }
  }
}

}  // namespace lce_test::cases
