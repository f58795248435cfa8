// Independent references for the lce tests.
//
// Nothing in this header includes or calls lce: the logits are materialised in
// long double, the gradients are derived analytically by hand, and a central
// finite-difference helper checks those analytic gradients (and, in the tests,
// the library's). The bfloat16 / float16 conversions are written here from the
// IEEE definitions (round to nearest, ties to even) so that 2-byte inputs can be
// produced and read back without using the library's own conversions.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace lce_test {

using real = long double;

// ---------------------------------------------------------------------------
// Deterministic random numbers (splitmix64; identical on every platform).
// ---------------------------------------------------------------------------
struct rng {
  std::uint64_t state;
  explicit rng(std::uint64_t seed) : state(seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull) {}
  std::uint64_t next() {
    std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // uniform in [lo, hi)
  double uniform(double lo, double hi) { return lo + (hi - lo) * (double(next() >> 11) * 0x1.0p-53); }
  // uniform integer in [0, n)
  std::int64_t below(std::int64_t n) { return static_cast<std::int64_t>(next() % static_cast<std::uint64_t>(n)); }
};

// ---------------------------------------------------------------------------
// bfloat16 / float16 bit conversions (round to nearest, ties to even).
// Written with exact double arithmetic so they are obviously right.
// ---------------------------------------------------------------------------
inline std::uint16_t float_to_bf16_bits(float f) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  if (std::isnan(f)) return static_cast<std::uint16_t>(sign | 0x7FC0u);
  if (std::isinf(f)) return static_cast<std::uint16_t>(sign | 0x7F80u);
  const double a = std::fabs(static_cast<double>(f));
  if (a == 0.0) return sign;
  if (a < 0x1.0p-126) {  // float subnormal: bf16 subnormal quantum is 2^-133
    const double q = std::nearbyint(a * 0x1.0p133);
    return static_cast<std::uint16_t>(sign | static_cast<std::uint16_t>(q));
  }
  int e2 = 0;
  (void)std::frexp(a, &e2);  // a = m * 2^e2, m in [0.5, 1)
  const int e = e2 - 1;      // a in [2^e, 2^(e+1))
  const double q = std::nearbyint(std::ldexp(a, 7 - e));  // in [128, 256]
  const std::uint32_t bits = (static_cast<std::uint32_t>(e + 127) << 7) + static_cast<std::uint32_t>(q - 128.0);
  // a carry into the exponent is handled by the addition; exponent 255 = inf
  return static_cast<std::uint16_t>(sign | static_cast<std::uint16_t>(std::min<std::uint32_t>(bits, 0x7F80u)));
}

inline float bf16_bits_to_float(std::uint16_t b) { return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16); }

inline std::uint16_t float_to_fp16_bits(float f) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  if (std::isnan(f)) return static_cast<std::uint16_t>(sign | 0x7E00u);
  const double a = std::fabs(static_cast<double>(f));
  if (a >= 65520.0) return static_cast<std::uint16_t>(sign | 0x7C00u);  // rounds to inf (incl. inf)
  if (a < 0x1.0p-14) {                                                   // subnormal, quantum 2^-24
    const double q = std::nearbyint(a * 0x1.0p24);                       // q == 1024 is the smallest normal
    return static_cast<std::uint16_t>(sign | static_cast<std::uint16_t>(q));
  }
  int e2 = 0;
  (void)std::frexp(a, &e2);
  const int e = e2 - 1;
  const double q = std::nearbyint(std::ldexp(a, 10 - e));  // in [1024, 2048]
  const std::uint32_t bits = (static_cast<std::uint32_t>(e + 15) << 10) + static_cast<std::uint32_t>(q - 1024.0);
  return static_cast<std::uint16_t>(sign | static_cast<std::uint16_t>(bits));
}

inline float fp16_bits_to_float(std::uint16_t b) {
  const bool neg = (b & 0x8000u) != 0;
  const int exp = (b >> 10) & 0x1F;
  const int man = b & 0x3FF;
  double v;
  if (exp == 0) {
    v = std::ldexp(static_cast<double>(man), -24);
  } else if (exp == 31) {
    v = man == 0 ? std::numeric_limits<double>::infinity() : std::numeric_limits<double>::quiet_NaN();
  } else {
    v = std::ldexp(static_cast<double>(man + 1024), exp - 25);
  }
  return static_cast<float>(neg ? -v : v);
}

inline double round_to_bf16(double d) { return bf16_bits_to_float(float_to_bf16_bits(static_cast<float>(d))); }
inline double round_to_fp16(double d) { return fp16_bits_to_float(float_to_fp16_bits(static_cast<float>(d))); }
inline double round_to_float(double d) { return static_cast<double>(static_cast<float>(d)); }

// ---------------------------------------------------------------------------
// The problem and the materialised reference.
// ---------------------------------------------------------------------------
struct problem {
  std::int64_t n = 0, h = 0, v = 0;
  std::vector<double> x;          // [n, h] dense, values exactly representable in the storage type
  std::vector<double> w;          // [v, h] dense
  std::vector<std::int64_t> y;    // [n]
  float tau = 1.0f;               // as the library receives it (options::temperature is float)
  float cap = 0.0f;               // options::softcap
  std::int64_t ignore_index = -100;

  bool ignored(std::int64_t i) const { return y[static_cast<std::size_t>(i)] == ignore_index; }
};

struct forward_result {
  std::int64_t n = 0, v = 0;
  std::vector<real> z;      // [n, v] final logits: softcap, then temperature
  std::vector<real> dzds;   // [n, v] d z / d (x . w): (1/tau) * (1 - tanh^2)
  std::vector<real> lse;    // [n]
  std::vector<real> logp;   // [n] 0 for ignored tokens
  std::vector<real> ent;    // [n] 0 for ignored tokens
};

// Logit of one (row, vocab) pair and its derivative with respect to x . w.
inline real reference_logit(const double* xr, const double* wr, std::int64_t h, float tau, float cap, real* dzds) {
  real s = 0;
  for (std::int64_t k = 0; k < h; ++k) s += static_cast<real>(xr[k]) * static_cast<real>(wr[k]);
  // The model's soft-cap on the raw logit, then the sampler's temperature.
  const real t = static_cast<real>(tau);
  if (cap > 0.0f) {
    const real c = static_cast<real>(cap);
    const real th = std::tanh(s / c);
    if (dzds) *dzds = (1 - th * th) / t;
    return c * th / t;
  }
  if (dzds) *dzds = 1 / t;
  return s / t;
}

// Statistics of one row of final logits z[0..v).
struct row_stats {
  real lse, logp, ent;
};
inline row_stats reference_row_stats(const real* z, std::int64_t v, std::int64_t target, bool ignored) {
  real m = -std::numeric_limits<real>::infinity();
  for (std::int64_t j = 0; j < v; ++j) m = std::max(m, z[j]);
  real s = 0;
  for (std::int64_t j = 0; j < v; ++j) s += std::exp(z[j] - m);
  const real lse = m + std::log(s);
  if (ignored) return {lse, 0, 0};
  real ent = 0;  // sum p (lse - z)
  for (std::int64_t j = 0; j < v; ++j) {
    const real p = std::exp(z[j] - lse);
    ent += p * (lse - z[j]);
  }
  return {lse, z[target] - lse, ent};
}

inline void check_targets(const problem& p) {
  for (std::int64_t i = 0; i < p.n; ++i) {
    const auto t = p.y[static_cast<std::size_t>(i)];
    if (t != p.ignore_index && (t < 0 || t >= p.v))
      throw std::logic_error("reference: target out of range at " + std::to_string(i));
  }
}

inline forward_result reference_forward(const problem& p) {
  check_targets(p);
  forward_result r;
  r.n = p.n;
  r.v = p.v;
  r.z.assign(static_cast<std::size_t>(p.n * p.v), 0);
  r.dzds.assign(static_cast<std::size_t>(p.n * p.v), 0);
  r.lse.assign(static_cast<std::size_t>(p.n), 0);
  r.logp.assign(static_cast<std::size_t>(p.n), 0);
  r.ent.assign(static_cast<std::size_t>(p.n), 0);
  for (std::int64_t i = 0; i < p.n; ++i) {
    for (std::int64_t j = 0; j < p.v; ++j)
      r.z[i * p.v + j] = reference_logit(&p.x[i * p.h], &p.w[j * p.h], p.h, p.tau, p.cap, &r.dzds[i * p.v + j]);
    const auto st = reference_row_stats(&r.z[i * p.v], p.v, p.y[i], p.ignored(i));
    r.lse[i] = st.lse;
    r.logp[i] = st.logp;
    r.ent[i] = st.ent;
  }
  return r;
}

// Reference forward for a single row (for problems too large to materialise).
inline row_stats reference_forward_row(const problem& p, std::int64_t i) {
  std::vector<real> z(static_cast<std::size_t>(p.v));
  for (std::int64_t j = 0; j < p.v; ++j) z[j] = reference_logit(&p.x[i * p.h], &p.w[j * p.h], p.h, p.tau, p.cap, nullptr);
  return reference_row_stats(z.data(), p.v, p.y[i], p.ignored(i));
}

struct gradients {
  std::vector<double> dx;  // [n, h]
  std::vector<double> dw;  // [v, h]
};

// Analytic gradients of L = sum_i g_i logp_i + hg_i ent_i (hg may be empty: no entropy term).
//   dL/dz[i,v] = g_i (1[v==y_i] - p) + hg_i p (E_p[z] - z)
//   dL/ds[i,v] = dL/dz * (1/tau) * (1 - tanh^2)
//   dX = dS W,  dW = dS^T X
inline gradients reference_backward(const problem& p, const forward_result& r, const std::vector<double>& g,
                                    const std::vector<double>& hg) {
  std::vector<real> dx(static_cast<std::size_t>(p.n * p.h), 0), dw(static_cast<std::size_t>(p.v * p.h), 0);
  std::vector<real> ds(static_cast<std::size_t>(p.v));
  for (std::int64_t i = 0; i < p.n; ++i) {
    if (p.ignored(i)) continue;
    const real* z = &r.z[i * p.v];
    real ez = 0;
    for (std::int64_t j = 0; j < p.v; ++j) ez += std::exp(z[j] - r.lse[i]) * z[j];
    const real gi = g[i];
    const real hi = hg.empty() ? 0 : static_cast<real>(hg[i]);
    for (std::int64_t j = 0; j < p.v; ++j) {
      const real pr = std::exp(z[j] - r.lse[i]);
      real dz = gi * ((j == p.y[i] ? 1 : 0) - pr) + hi * pr * (ez - z[j]);
      ds[j] = dz * r.dzds[i * p.v + j];
    }
    for (std::int64_t j = 0; j < p.v; ++j)
      for (std::int64_t k = 0; k < p.h; ++k) {
        dx[i * p.h + k] += ds[j] * static_cast<real>(p.w[j * p.h + k]);
        dw[j * p.h + k] += ds[j] * static_cast<real>(p.x[i * p.h + k]);
      }
  }
  gradients out;
  out.dx.assign(dx.begin(), dx.end());
  out.dw.assign(dw.begin(), dw.end());
  return out;
}

// How much rounding the gradient GEMMs' operand to a narrower type may move
// dX and dW, element by element (for a backend that, like lce::cuda_backend
// with 2-byte inputs, stores dz in T before the two gradient GEMMs).
//
// The backend's operand is o[i,v] = tau * dS[i,v] (dz times the soft-cap's
// slope; the GEMMs' alpha is 1/tau). Round-to-nearest into T stores
// o (1 + d) + e with |d| <= unit (2^-8 bf16, 2^-11 fp16: half an ulp,
// relative) and |e| <= floor (half the subnormal spacing, where the relative
// bound stops holding: 2^-25 fp16, 2^-134 bf16). Through the exact products
// and fp32 sums of the GEMMs that moves
//   dX[i,k] by at most  sum_v (unit |dS[i,v]| + floor / tau) |W[v,k]|
//   dW[v,k] by at most  sum_i (unit |dS[i,v]| + floor / tau) |X[i,k]|
// (the rest of the error, the fp32 arithmetic, stays in the base tolerance;
// the backend rounds its own fp32 dz, within ~1e-6 relative of dS, which
// the factor 1.01 below covers). A product of a T operand with T rows is
// exact in fp32, so this is the whole difference from the host's path.
struct operand_rounding_bounds {
  std::vector<double> dx;  // [n, h]
  std::vector<double> dw;  // [v, h]
};

inline operand_rounding_bounds reference_operand_rounding_bounds(const problem& p, const forward_result& r,
                                                                 const std::vector<double>& g,
                                                                 const std::vector<double>& hg, double unit,
                                                                 double floor) {
  operand_rounding_bounds out;
  out.dx.assign(static_cast<std::size_t>(p.n * p.h), 0.0);
  out.dw.assign(static_cast<std::size_t>(p.v * p.h), 0.0);
  if (unit == 0 && floor == 0) return out;
  std::vector<double> moved(static_cast<std::size_t>(p.v));
  for (std::int64_t i = 0; i < p.n; ++i) {
    if (p.ignored(i)) continue;  // the backend writes exact zeros there
    const real* z = &r.z[i * p.v];
    real ez = 0;
    for (std::int64_t j = 0; j < p.v; ++j) ez += std::exp(z[j] - r.lse[i]) * z[j];
    const real gi = g[i];
    const real hi = hg.empty() ? 0 : static_cast<real>(hg[i]);
    for (std::int64_t j = 0; j < p.v; ++j) {
      const real pr = std::exp(z[j] - r.lse[i]);
      const real dz = gi * ((j == p.y[i] ? 1 : 0) - pr) + hi * pr * (ez - z[j]);
      const double ds = std::fabs(static_cast<double>(dz * r.dzds[i * p.v + j]));
      moved[static_cast<std::size_t>(j)] = 1.01 * (unit * ds + floor / static_cast<double>(p.tau));
    }
    for (std::int64_t j = 0; j < p.v; ++j)
      for (std::int64_t k = 0; k < p.h; ++k) {
        out.dx[i * p.h + k] += moved[j] * std::fabs(p.w[j * p.h + k]);
        out.dw[j * p.h + k] += moved[j] * std::fabs(p.x[i * p.h + k]);
      }
  }
  return out;
}

// L = sum_i g_i logp_i + hg_i ent_i on the reference forward.
inline real reference_objective(const problem& p, const std::vector<double>& g, const std::vector<double>& hg) {
  const auto r = reference_forward(p);
  real l = 0;
  for (std::int64_t i = 0; i < p.n; ++i) {
    l += static_cast<real>(g[i]) * r.logp[i];
    if (!hg.empty()) l += static_cast<real>(hg[i]) * r.ent[i];
  }
  return l;
}

// Central finite differences of reference_objective with respect to every entry
// of x and w (perturbations in double, objective in long double).
inline gradients finite_difference_gradients(problem p, const std::vector<double>& g, const std::vector<double>& hg,
                                             double eps = 1e-5) {
  gradients out;
  out.dx.resize(p.x.size());
  out.dw.resize(p.w.size());
  auto diff = [&](std::vector<double>& vals, std::vector<double>& grad) {
    for (std::size_t k = 0; k < vals.size(); ++k) {
      const double saved = vals[k];
      vals[k] = saved + eps;
      const real lp = reference_objective(p, g, hg);
      vals[k] = saved - eps;
      const real lm = reference_objective(p, g, hg);
      vals[k] = saved;
      grad[k] = static_cast<double>((lp - lm) / (2 * static_cast<real>(eps)));
    }
  };
  diff(p.x, out.dx);
  diff(p.w, out.dw);
  return out;
}

// ---------------------------------------------------------------------------
// Generators. `round` maps a double to the nearest value of the storage type,
// so that the reference is computed from exactly what the library receives.
// ---------------------------------------------------------------------------
using rounder = double (*)(double);
inline double round_identity(double d) { return d; }

inline problem make_problem(std::int64_t n, std::int64_t h, std::int64_t v, std::uint64_t seed, rounder round,
                            double x_scale = 1.0, double w_scale = 1.0, double ignore_fraction = 0.15,
                            std::int64_t ignore_index = -100) {
  problem p;
  p.n = n;
  p.h = h;
  p.v = v;
  p.ignore_index = ignore_index;
  rng r(seed);
  p.x.resize(static_cast<std::size_t>(n * h));
  p.w.resize(static_cast<std::size_t>(v * h));
  for (auto& e : p.x) e = round(r.uniform(-x_scale, x_scale));
  for (auto& e : p.w) e = round(r.uniform(-w_scale, w_scale));
  p.y.resize(static_cast<std::size_t>(n));
  for (auto& t : p.y) t = (r.uniform(0, 1) < ignore_fraction) ? ignore_index : r.below(v);
  return p;
}

inline std::vector<double> random_vector(std::int64_t n, std::uint64_t seed, double lo, double hi,
                                         rounder round = round_identity) {
  rng r(seed);
  std::vector<double> out(static_cast<std::size_t>(n));
  for (auto& e : out) e = round(r.uniform(lo, hi));
  return out;
}

}  // namespace lce_test
