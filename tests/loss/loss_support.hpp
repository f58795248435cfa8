// Shared plumbing of the loss tests: a random packed batch and plain helpers.
// References are written in each test as plain double loops (no Thrust).
#pragma once

#include <lce/loss/losses.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace lce_loss_test {

struct batch {
  std::vector<std::int64_t> lengths;     // per sequence (0 allowed)
  std::vector<std::int64_t> cu;          // S + 1
  std::vector<std::int64_t> targets;     // N, some ignore_index
  std::vector<float> weights;            // N, 0/1 mask plus a few fractional weights
  std::vector<double> logp;              // N, negative
  std::int64_t n() const { return static_cast<std::int64_t>(targets.size()); }
  std::int64_t s() const { return static_cast<std::int64_t>(lengths.size()); }
  std::int64_t seq_of(std::int64_t i) const {
    for (std::int64_t s = 0; s < this->s(); ++s)
      if (i >= cu[s] && i < cu[s + 1]) return s;
    return -1;
  }
  // weight of token i as the losses define it (0 when not counted)
  double w(std::int64_t i) const { return targets[i] == -100 ? 0.0 : double(weights[i]); }
  lce::packed_tokens<std::int64_t, std::int64_t> view() const {
    return {{targets.data(), n()}, {cu.data(), s() + 1}, {weights.data(), n()}, -100};
  }
};

inline batch make_batch(std::vector<std::int64_t> lengths, unsigned seed, bool fractional = true) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  batch b;
  b.lengths = lengths;
  b.cu.push_back(0);
  for (auto l : lengths) b.cu.push_back(b.cu.back() + l);
  const auto n = b.cu.back();
  for (std::int64_t i = 0; i < n; ++i) {
    const bool ignored = u(rng) < 0.2;
    b.targets.push_back(ignored ? -100 : std::int64_t(u(rng) * 50));
    double wt = u(rng) < 0.15 ? 0.0 : 1.0;
    if (fractional && u(rng) < 0.2) wt = 0.25 + u(rng);
    b.weights.push_back(float(wt));
    b.logp.push_back(ignored ? 0.0 : -0.05 - 3.0 * u(rng));
  }
  return b;
}

template <class T>
lce::vector_view<const T> cv(const std::vector<T>& v) {
  return {v.data(), static_cast<std::int64_t>(v.size())};
}
template <class T>
lce::vector_view<T> mv(std::vector<T>& v) {
  return {v.data(), static_cast<std::int64_t>(v.size())};
}

inline bool close(double a, double b, double tol) { return std::fabs(a - b) <= tol * std::max(1.0, std::fabs(b)); }

// Checks fn throws lce::error whose message contains `needle`.
template <class F>
void check_error(F&& fn, const std::string& needle) {
  bool thrown = false;
  try {
    fn();
  } catch (const lce::error& e) {
    thrown = true;
    const std::string what = e.what();
    CHECK_MESSAGE(what.find(needle) != std::string::npos, "message: ", what, " lacks: ", needle);
  }
  CHECK_MESSAGE(thrown, "no lce::error (expected one naming ", needle, ")");
}

}  // namespace lce_loss_test
