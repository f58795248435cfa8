#pragma once
// The materialised-logits LM-head step on the CPU, for the benchmarks and the
// planner's measured check: what a plain linear + (vocabulary-parallel)
// cross-entropy does, in fp32, over any lce communicator (single, mpi).
//
// Rank r of P holds the weight shard [V_r, H] starting at vocab_start, and the
// hidden rows [rows, H] (all N, or N / P under sequence parallelism). One step:
//   sequence parallel: all-gather the hidden rows into [N, H]
//   logits [N, V_r] = X W_r^T                                  (one sgemm)
//   per row: max, sum of exp, target logit (3 x N); with P > 1 all-gather
//     them (3 P N) and merge: lse, logp
//   in place: dz = g (onehot - softmax)
//   dX = dz W_r (sequence parallel: into [N, H], reduce-scattered to the
//     rank's rows; otherwise all-reduced in place), dW_r += dz^T X
// Every buffer is a std::vector (operator new), so a counting allocator sees
// it: exactly what lce::plan_step counts for plan_scheme::materialised with
// 4-byte elements (logits S x V_r x 4, per-token 3 (1 + P) x S x 4 beside the
// caller's logp / lse / grad, and 2 S x H x 4 under sequence parallelism).

#include <lce/core/row_math.hpp>

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <thread>
#include <vector>

namespace lce_bench {

// Runs body(begin, end) over [0, n) split into `threads` contiguous parts.
template <class Body>
void parallel_rows(std::int64_t n, int threads, Body&& body) {
  threads = static_cast<int>(std::clamp<std::int64_t>(threads, 1, std::max<std::int64_t>(n, 1)));
  if (threads == 1) return body(std::int64_t{0}, n);
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back([&, t] { body(n * t / threads, n * (t + 1) / threads); });
  body(std::int64_t{0}, n / threads);
  for (auto& th : pool) th.join();
}

struct materialised_args {
  std::int64_t n = 0, h = 0, v_local = 0, vocab_start = 0;
  bool sequence_parallel = false;
  int threads = 1;
  const float* x = nullptr;        // [rows, H]
  const float* w = nullptr;        // [V_r, H]
  const std::int64_t* y = nullptr; // [N]
  const float* g = nullptr;        // [N] dL/dlogp
  float* logp = nullptr;           // [N]
  float* lse = nullptr;            // [N]
  float* dx = nullptr;             // [rows, H] (=)
  float* dw = nullptr;             // [V_r, H] (+=)
};

template <class Comm>
void materialised_step(const Comm& comm, const materialised_args& a) {
  const std::int64_t p = comm.size(), n = a.n, h = a.h, vl = a.v_local;
  const bool sp = a.sequence_parallel && p > 1;
  const std::int64_t rows = sp ? n / p : n;
  const auto sz = [](std::int64_t v) { return static_cast<std::size_t>(v); };

  std::vector<float> x_full;
  const float* x = a.x;
  if (sp) {
    x_full.assign(sz(n * h), 0.0f);
    comm.all_gather_bytes(a.x, x_full.data(), sz(rows * h) * sizeof(float));
    x = x_full.data();
  }
  std::vector<float> logits(sz(n * vl));
  if (n > 0 && vl > 0)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(n), int(vl), int(h), 1.0f, x, int(h), a.w, int(h), 0.0f,
                logits.data(), int(vl));

  // per row: max, sum of exp, target logit (0 when another rank owns the target)
  std::vector<float> stats(sz(3 * n));
  float *mx = stats.data(), *se = mx + n, *zt = se + n;
  parallel_rows(n, a.threads, [&](std::int64_t i0, std::int64_t i1) {
    for (std::int64_t i = i0; i < i1; ++i) {
      const float* z = logits.data() + i * vl;
      float m = -INFINITY;
      for (std::int64_t v = 0; v < vl; ++v) m = std::max(m, z[v]);
      float s = 0;
      for (std::int64_t v = 0; v < vl; ++v) s += lce::detail::fast_exp(z[v] - m);
      const std::int64_t t = a.y[i] - a.vocab_start;
      mx[i] = m, se[i] = s, zt[i] = t >= 0 && t < vl ? z[t] : 0.0f;
    }
  });
  if (p > 1) {
    std::vector<float> gathered(sz(3 * n * p));
    comm.all_gather_bytes(stats.data(), gathered.data(), sz(3 * n) * sizeof(float));
    for (std::int64_t i = 0; i < n; ++i) {
      float m = -INFINITY, s = 0, t = 0;
      for (std::int64_t r = 0; r < p; ++r) m = std::max(m, gathered[sz(r * 3 * n + i)]);
      for (std::int64_t r = 0; r < p; ++r) {
        const float* part = gathered.data() + r * 3 * n;
        s += part[n + i] * std::exp(part[i] - m), t += part[2 * n + i];
      }
      mx[i] = m, se[i] = s, zt[i] = t;
    }
  }
  for (std::int64_t i = 0; i < n; ++i) {
    a.lse[i] = mx[i] + std::log(se[i]);
    a.logp[i] = zt[i] - a.lse[i];
  }

  // dz = g (onehot - softmax), in place of the logits
  parallel_rows(n, a.threads, [&](std::int64_t i0, std::int64_t i1) {
    for (std::int64_t i = i0; i < i1; ++i) {
      float* z = logits.data() + i * vl;
      const float l = a.lse[i], gi = a.g[i];
      for (std::int64_t v = 0; v < vl; ++v) z[v] = -gi * lce::detail::fast_exp(z[v] - l);
      const std::int64_t t = a.y[i] - a.vocab_start;
      if (t >= 0 && t < vl) z[t] += gi;
    }
  });

  std::vector<float> dx_full;
  float* dx = a.dx;
  if (sp) dx_full.assign(sz(n * h), 0.0f), dx = dx_full.data();
  if (n > 0 && h > 0 && vl > 0) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(n), int(h), int(vl), 1.0f, logits.data(), int(vl), a.w,
                int(h), 0.0f, dx, int(h));
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(vl), int(h), int(n), 1.0f, logits.data(), int(vl), x,
                int(h), 1.0f, a.dw, int(h));
  } else {
    std::fill(dx, dx + n * h, 0.0f);
  }
  if (sp) comm.reduce_scatter_sum(dx_full.data(), a.dx, rows * h);
  else if (p > 1) comm.all_reduce_sum(a.dx, n * h);
}

}  // namespace lce_bench
