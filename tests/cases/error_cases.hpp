// The error fixture of tests/unit/test_errors.cpp (every buffer snapshotted,
// one entry point called, the lce::error's message searched, every buffer
// compared bitwise), shared with the CUDA suite: there the Env's device
// mirror copies every device buffer back, error or not, so "writes nothing"
// still means the device buffers. Env: see cases/host_env.hpp.
#pragma once

#include "cases/host_env.hpp"

#include <cctype>
#include <functional>
#include <initializer_list>
#include <optional>

namespace lce_test::cases {

enum class entry { forward, forward_entropy, backward, backward_entropy, forward_backward };
inline constexpr entry all_entries[] = {entry::forward, entry::forward_entropy, entry::backward, entry::backward_entropy,
                                 entry::forward_backward};
inline const char* entry_name(entry e) {
  switch (e) {
    case entry::forward: return "forward";
    case entry::forward_entropy: return "forward(entropy)";
    case entry::backward: return "backward";
    case entry::backward_entropy: return "backward(entropy)";
    default: return "forward_backward";
  }
}

inline std::string lower(std::string s) {
  for (auto& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return s;
}

// Each inner list: at least one of its strings must occur in the message.
using needles = std::vector<std::vector<std::string>>;

template <class T, class Env = host_env>
struct fixture {
  using O = out_t<T>;
  std::int64_t n = 23, h = 13, v = 7;
  std::int64_t x_rows = n, x_cols = h, x_ld = h;
  std::int64_t w_rows = v, w_cols = h, w_ld = h;
  std::int64_t y_size = n, lp_size = n, lse_size = n, ent_size = n, glp_size = n, gent_size = n;
  std::int64_t gh_rows = n, gh_cols = h, gh_ld = h;
  std::int64_t gw_rows = v, gw_cols = h, gw_ld = h;
  std::vector<std::int64_t> y;
  lce::options opt = make_options(1.0f, 0.0f, 4);  // several chunks: a late bad target must still write nothing

  // aliasing overrides
  O* lp_ptr = nullptr;
  O* lse_ptr = nullptr;
  T* gh_ptr = nullptr;
  T* gw_ptr = nullptr;

  matrix_buf<T> X, W, GH, GW;
  vector_buf<std::int64_t> Y;
  vector_buf<O> LP, LSE, ENT, GLP, GENT;

  fixture() {
    rng r(99);
    y.resize(static_cast<std::size_t>(n));
    for (auto& t : y) t = r.below(v);
    y[4] = opt.ignore_index;
  }

  void build() {
    rng r(7);
    X = matrix_buf<T>(x_rows, x_cols, x_ld);
    W = matrix_buf<T>(w_rows, w_cols, w_ld);
    for (std::int64_t i = 0; i < x_rows; ++i)
      for (std::int64_t j = 0; j < x_cols; ++j) X.set(i, j, r.uniform(-1, 1));
    for (std::int64_t i = 0; i < w_rows; ++i)
      for (std::int64_t j = 0; j < w_cols; ++j) W.set(i, j, r.uniform(-1, 1));
    Y = vector_buf<std::int64_t>(y_size);
    for (std::int64_t i = 0; i < y_size; ++i) Y.data[i] = y[static_cast<std::size_t>(i % n)];
    auto pattern = [&](vector_buf<O>& b, std::int64_t size, double base) {
      b = vector_buf<O>(size);
      for (std::int64_t i = 0; i < size; ++i) b.set(i, base + 0.25 * static_cast<double>(i));
    };
    pattern(LP, lp_size, 1000.0);
    pattern(LSE, lse_size, 3.0);  // plausible lse values: also a valid input to backward
    pattern(ENT, ent_size, 2000.0);
    pattern(GLP, glp_size, -1.0);
    pattern(GENT, gent_size, 0.5);
    GH = matrix_buf<T>(gh_rows, gh_cols, gh_ld);
    GH.fill(to_elem<T>(-777.0));
    GW = matrix_buf<T>(gw_rows, gw_cols, gw_ld);
    for (std::int64_t i = 0; i < gw_rows; ++i)
      for (std::int64_t j = 0; j < gw_cols; ++j) GW.set(i, j, 0.5 + 0.125 * static_cast<double>((i * 7 + j) % 13));
  }

  std::vector<std::vector<unsigned char>> snapshot() const {
    return {X.bytes(), W.bytes(), Y.bytes(), LP.bytes(), LSE.bytes(), ENT.bytes(), GLP.bytes(), GENT.bytes(),
            GH.bytes(), GW.bytes()};
  }
  static const char* buffer_name(std::size_t k) {
    static const char* names[] = {"hidden", "weight", "targets", "logprobs", "lse", "entropy", "grad_logprobs",
                                  "grad_entropy", "grad_hidden", "grad_weight"};
    return names[k];
  }

  void invoke(entry e) {
    auto op = Env::template make_op<T>(opt, 0);  // may itself throw on bad options
    const lce::matrix_view<const T> x{X.ptr(), x_rows, x_cols, x_ld};
    const lce::matrix_view<const T> w{W.ptr(), w_rows, w_cols, w_ld};
    const lce::vector_view<const std::int64_t> t{Y.ptr(), y_size};
    const lce::vector_view<O> lp{lp_ptr ? lp_ptr : LP.ptr(), lp_size};
    const lce::vector_view<O> lse{lse_ptr ? lse_ptr : LSE.ptr(), lse_size};
    const lce::vector_view<const O> lse_in{LSE.ptr(), lse_size};
    const lce::vector_view<O> ent{ENT.ptr(), ent_size};
    const lce::vector_view<const O> glp{GLP.ptr(), glp_size};
    const lce::vector_view<const O> gent{GENT.ptr(), gent_size};
    const lce::matrix_view<T> gh{gh_ptr ? gh_ptr : GH.ptr(), gh_rows, gh_cols, gh_ld};
    const lce::matrix_view<T> gw{gw_ptr ? gw_ptr : GW.ptr(), gw_rows, gw_cols, gw_ld};
    switch (e) {
      case entry::forward: op.forward(x, w, t, lp, lse); break;
      case entry::forward_entropy: op.forward(x, w, t, lp, lse, ent); break;
      case entry::backward: op.backward(x, w, t, lse_in, glp, gh, gw); break;
      case entry::backward_entropy: op.backward(x, w, t, lse_in, glp, gent, gh, gw); break;
      case entry::forward_backward: op.forward_backward(x, w, t, glp, lp, gh, gw); break;
    }
  }

  // Rebuild the buffers, call, and check the error and that nothing was written.
  void expect_error(std::initializer_list<entry> entries, const needles& must) {
    for (entry e : entries) {
      INFO("entry point: " << std::string(entry_name(e)));
      build();
      const auto before = snapshot();
      std::optional<std::string> msg;
      try {
        invoke(e);
      } catch (const lce::error& err) {
        msg = err.what();
      } catch (const std::exception& err) {
        FAIL_CHECK("threw something other than lce::error: " << err.what());
        continue;
      }
      if (!msg) {
        FAIL_CHECK("no lce::error thrown");
        continue;
      }
      INFO("message: " << *msg);
      const std::string m = lower(*msg);
      for (const auto& alternatives : must) {
        bool found = false;
        std::string shown;
        for (const auto& s : alternatives) {
          found = found || m.find(lower(s)) != std::string::npos;
          shown += (shown.empty() ? "" : " or ") + ("'" + s + "'");
        }
        CHECK_MESSAGE(found, "message lacks " << shown);
      }
      const auto after = snapshot();
      for (std::size_t k = 0; k < before.size(); ++k)
        CHECK_MESSAGE(before[k] == after[k], "buffer '" << std::string(buffer_name(k)) << "' was modified");
    }
  }

  void expect_ok(entry e) {
    build();
    INFO("entry point: " << std::string(entry_name(e)));
    CHECK_NOTHROW(invoke(e));
  }
};

// Target ids out of range, on every entry point: lce::error naming
// targets[i] and the id, nothing written (the check runs before the sweep,
// also for an id in a late chunk).
template <class F>
void bad_target_subcases(F& f, std::initializer_list<entry> entries) {
  SUBCASE("target >= V, in a late chunk") {
    f.y[17] = 9001;
    f.expect_error(entries, {{"targets"}, {"9001"}, {"17"}});
  }
  SUBCASE("target == V, the last token") {
    f.y[22] = 7;
    f.expect_error(entries, {{"targets"}, {"7"}, {"22"}});
  }
  SUBCASE("negative target that is not ignore_index") {
    f.y[19] = -7;
    f.expect_error(entries, {{"targets"}, {"-7"}, {"19"}});
  }
  SUBCASE("the default ignore_index -100 is a bad target when ignore_index is -1") {
    f.opt.ignore_index = -1;
    f.y[3] = -1;  // ignored
    f.y[4] = 2;   // was the old ignore_index
    f.y[20] = -100;
    f.expect_error(entries, {{"targets"}, {"-100"}, {"20"}});
  }
}

}  // namespace lce_test::cases
