// Test plumbing around lce: element-type helpers (built on the independent
// conversions of reference.hpp, never on the library's), padded buffers with a
// byte pattern to detect stray writes, and comparison helpers that report the
// worst element.
#pragma once

#include <lce/lce.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iomanip>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "support/reference.hpp"

namespace lce_test {

static_assert(sizeof(lce::bfloat16) == 2 && std::is_trivially_copyable_v<lce::bfloat16>,
              "tests need lce::bfloat16 to be a trivially copyable 2-byte type");
static_assert(sizeof(lce::float16) == 2 && std::is_trivially_copyable_v<lce::float16>,
              "tests need lce::float16 to be a trivially copyable 2-byte type");

template <class T>
inline constexpr bool is_2byte_v = std::is_same_v<T, lce::bfloat16> || std::is_same_v<T, lce::float16>;

// Element type of logprobs / lse / entropy / grad_logprobs for input type T.
template <class T>
using out_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <class E>
std::string type_name() {
  if constexpr (std::is_same_v<E, float>) return "float";
  else if constexpr (std::is_same_v<E, double>) return "double";
  else if constexpr (std::is_same_v<E, lce::bfloat16>) return "bfloat16";
  else return "float16";
}

template <class E>
E to_elem(double d) {
  if constexpr (std::is_same_v<E, float>) return static_cast<float>(d);
  else if constexpr (std::is_same_v<E, double>) return d;
  else if constexpr (std::is_same_v<E, lce::bfloat16>)
    return std::bit_cast<lce::bfloat16>(float_to_bf16_bits(static_cast<float>(d)));
  else
    return std::bit_cast<lce::float16>(float_to_fp16_bits(static_cast<float>(d)));
}

template <class E>
double from_elem(E e) {
  if constexpr (std::is_same_v<E, float> || std::is_same_v<E, double>) return static_cast<double>(e);
  else if constexpr (std::is_same_v<E, lce::bfloat16>) return bf16_bits_to_float(std::bit_cast<std::uint16_t>(e));
  else return fp16_bits_to_float(std::bit_cast<std::uint16_t>(e));
}

template <class E>
rounder rounder_for() {
  if constexpr (std::is_same_v<E, float>) return round_to_float;
  else if constexpr (std::is_same_v<E, double>) return round_identity;
  else if constexpr (std::is_same_v<E, lce::bfloat16>) return round_to_bf16;
  else return round_to_fp16;
}

template <class E>
double round_to(double d) { return rounder_for<E>()(d); }

// One unit in the last place of E at magnitude |r| (for tolerances on results stored as E).
template <class E>
double ulp_of(double r) {
  int mant_bits, min_exp;  // explicit mantissa bits; exponent of the smallest normal
  if constexpr (std::is_same_v<E, float>) { mant_bits = 23; min_exp = -126; }
  else if constexpr (std::is_same_v<E, double>) { mant_bits = 52; min_exp = -1022; }
  else if constexpr (std::is_same_v<E, lce::bfloat16>) { mant_bits = 7; min_exp = -126; }
  else { mant_bits = 10; min_exp = -14; }
  const double a = std::fabs(r);
  int e = min_exp;
  if (a > 0 && std::isfinite(a)) {
    int e2 = 0;
    (void)std::frexp(a, &e2);
    e = std::max(e2 - 1, min_exp);
  }
  return std::ldexp(1.0, e - mant_bits);
}

// A quiet NaN of E with a payload: "garbage" that a correct overwrite removes.
template <class E>
E garbage() {
  if constexpr (std::is_same_v<E, float>) return std::bit_cast<float>(std::uint32_t{0x7FC00BADu});
  else if constexpr (std::is_same_v<E, double>) return std::bit_cast<double>(std::uint64_t{0x7FF8000000000BADull});
  else if constexpr (std::is_same_v<E, lce::bfloat16>) return std::bit_cast<lce::bfloat16>(std::uint16_t{0x7FC1u});
  else return std::bit_cast<lce::float16>(std::uint16_t{0x7E01u});
}

inline constexpr unsigned char pad_byte = 0xA5;

// Row-major [rows, cols] with leading dimension ld; padding (and one spare
// element at the end) filled with pad_byte so stray writes can be detected.
template <class E>
struct matrix_buf {
  std::int64_t rows = 0, cols = 0, ld = 0;
  std::vector<E> data;

  matrix_buf() = default;
  matrix_buf(std::int64_t r, std::int64_t c, std::int64_t ld_ = -1) : rows(r), cols(c), ld(ld_ < 0 ? c : ld_) {
    // room for the view's full extent even when ld < cols (an invalid view used by error tests)
    const std::int64_t extent = rows > 0 ? std::max(rows * ld, (rows - 1) * ld + cols) : 0;
    data.resize(static_cast<std::size_t>(extent + 1));
    std::memset(static_cast<void*>(data.data()), pad_byte, data.size() * sizeof(E));
  }
  E* ptr() { return data.data(); }
  const E* ptr() const { return data.data(); }
  E& at(std::int64_t i, std::int64_t j) { return data[static_cast<std::size_t>(i * ld + j)]; }
  const E& at(std::int64_t i, std::int64_t j) const { return data[static_cast<std::size_t>(i * ld + j)]; }
  double get(std::int64_t i, std::int64_t j) const { return from_elem(at(i, j)); }
  void set(std::int64_t i, std::int64_t j, double d) { at(i, j) = to_elem<E>(d); }
  void fill(E e) {
    for (std::int64_t i = 0; i < rows; ++i)
      for (std::int64_t j = 0; j < cols; ++j) at(i, j) = e;
  }
  void fill_from(const std::vector<double>& dense) {  // dense [rows, cols]
    for (std::int64_t i = 0; i < rows; ++i)
      for (std::int64_t j = 0; j < cols; ++j) set(i, j, dense[static_cast<std::size_t>(i * cols + j)]);
  }
  lce::matrix_view<E> view() { return lce::matrix_view<E>{data.data(), rows, cols, ld}; }
  lce::matrix_view<const E> cview() const { return lce::matrix_view<const E>{data.data(), rows, cols, ld}; }

  bool padding_intact() const {
    const auto* b = reinterpret_cast<const unsigned char*>(data.data());
    auto pad_ok = [&](std::size_t first_elem, std::size_t count) {
      for (std::size_t k = first_elem * sizeof(E); k < (first_elem + count) * sizeof(E); ++k)
        if (b[k] != pad_byte) return false;
      return true;
    };
    for (std::int64_t i = 0; i < rows && ld > cols; ++i)
      if (!pad_ok(static_cast<std::size_t>(i * ld + cols), static_cast<std::size_t>(ld - cols))) return false;
    const std::size_t used = static_cast<std::size_t>(std::max<std::int64_t>(rows * ld, 0));
    return pad_ok(used, data.size() - used);
  }
  std::vector<unsigned char> bytes() const {
    const auto* b = reinterpret_cast<const unsigned char*>(data.data());
    return std::vector<unsigned char>(b, b + data.size() * sizeof(E));
  }
};

template <class E>
struct vector_buf {
  std::int64_t size = 0;
  std::vector<E> data;

  vector_buf() = default;
  explicit vector_buf(std::int64_t n) : size(n) {
    data.resize(static_cast<std::size_t>(std::max<std::int64_t>(n, 0) + 1));
    std::memset(static_cast<void*>(data.data()), pad_byte, data.size() * sizeof(E));
  }
  vector_buf(const std::vector<double>& vals) : vector_buf(static_cast<std::int64_t>(vals.size())) {
    for (std::int64_t i = 0; i < size; ++i) set(i, vals[static_cast<std::size_t>(i)]);
  }
  E* ptr() { return data.data(); }
  const E* ptr() const { return data.data(); }
  double get(std::int64_t i) const { return from_elem(data[static_cast<std::size_t>(i)]); }
  void set(std::int64_t i, double d) { data[static_cast<std::size_t>(i)] = to_elem<E>(d); }
  void fill(E e) { std::fill(data.begin(), data.begin() + size, e); }
  lce::vector_view<E> view() { return lce::vector_view<E>{data.data(), size}; }
  lce::vector_view<const E> cview() const { return lce::vector_view<const E>{data.data(), size}; }
  bool padding_intact() const {
    const auto* b = reinterpret_cast<const unsigned char*>(data.data() + size);
    for (std::size_t k = 0; k < sizeof(E); ++k)
      if (b[k] != pad_byte) return false;
    return true;
  }
  std::vector<unsigned char> bytes() const {
    const auto* b = reinterpret_cast<const unsigned char*>(data.data());
    return std::vector<unsigned char>(b, b + data.size() * sizeof(E));
  }
};

template <class I>
vector_buf<I> make_targets(const std::vector<std::int64_t>& y) {
  vector_buf<I> t(static_cast<std::int64_t>(y.size()));
  for (std::size_t i = 0; i < y.size(); ++i) t.data[i] = static_cast<I>(y[i]);
  return t;
}

template <class E>
matrix_buf<E> make_matrix(const std::vector<double>& dense, std::int64_t rows, std::int64_t cols, std::int64_t ld = -1) {
  matrix_buf<E> m(rows, cols, ld);
  m.fill_from(dense);
  return m;
}

// ---------------------------------------------------------------------------
// Comparison with a report of the worst offender (NaN never passes).
// ---------------------------------------------------------------------------
struct comparison {
  bool ok = true;
  std::int64_t count = 0;
  std::int64_t worst = -1;         // index with the largest err / tol
  double worst_ratio = 0, got = 0, want = 0, tol = 0;
  std::int64_t failures = 0;
  std::string what;
  std::string describe() const {
    std::ostringstream os;
    os.precision(17);
    os << what << ": " << failures << " of " << count << " elements out of tolerance";
    if (worst >= 0) os << "; worst at index " << worst << ": got " << got << ", want " << want << ", |diff| " << std::fabs(got - want) << ", tol " << tol;
    return os.str();
  }
};

template <class Got, class Want, class Tol>
comparison compare(const std::string& what, std::int64_t count, Got got, Want want, Tol tol) {
  comparison c;
  c.what = what;
  c.count = count;
  for (std::int64_t k = 0; k < count; ++k) {
    const double g = got(k), w = want(k), t = tol(k, w);
    const double err = std::fabs(g - w);
    const bool good = err <= t;  // false for NaN
    double ratio = err / (t > 0 ? t : 1e-300);
    if (std::isnan(ratio)) ratio = std::numeric_limits<double>::infinity();
    if (!good) {
      c.ok = false;
      ++c.failures;
    }
    if (c.worst < 0 || ratio > c.worst_ratio) {
      c.worst = k;
      c.worst_ratio = ratio;
      c.got = g;
      c.want = w;
      c.tol = t;
    }
  }
  return c;
}

#define LCE_CHECK_CMP(expr)                         \
  do {                                              \
    const ::lce_test::comparison lce_cmp_ = (expr); \
    CHECK_MESSAGE(lce_cmp_.ok, lce_cmp_.describe()); \
  } while (0)

inline double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double e : v) m = std::max(m, std::fabs(e));
  return m;
}
template <class R>
std::vector<double> to_doubles(const std::vector<R>& v) {
  return std::vector<double>(v.begin(), v.end());
}

// Tolerance of values computed by the library for input type T (absolute,
// scaled by `scale`): double arithmetic for double, fp32 otherwise.
template <class T>
double base_tol() {
  return std::is_same_v<T, double> ? 1e-10 : 1e-5;
}

// The temperature / soft-cap / chunk settings the row-term, target-set and
// bias tests sweep: plain, tempered in several chunks, soft-capped in chunks.
struct scaling {
  float tau, cap;
  std::int64_t chunk;
};
inline constexpr scaling scalings[] = {{1.0f, 0.0f, 0}, {0.7f, 0.0f, 5}, {0.8f, 4.0f, 3}};

// Tolerance of a gradient element relative to (1 + the largest one).
template <class T>
double gradient_tol() {
  return std::is_same_v<T, double> ? 1e-10 : 2e-5;
}

// Default options with a given temperature/softcap/chunk.
inline lce::options make_options(float tau = 1.0f, float cap = 0.0f, std::int64_t chunk = 0,
                                 std::int64_t ignore_index = -100) {
  lce::options o;
  o.temperature = tau;
  o.softcap = cap;
  o.chunk_tokens = chunk;
  o.ignore_index = ignore_index;
  return o;
}

template <class T, class Chunk = lce::budget_chunk>
using op_t = lce::ChunkedHiddenToLogprobs<lce::comm::single, T, Chunk, lce::host>;

template <class T, class Chunk = lce::budget_chunk>
op_t<T, Chunk> make_op(const lce::options& opt, int threads = 0) {
  return op_t<T, Chunk>(lce::comm::single{}, opt, lce::host{threads});
}

// ---------------------------------------------------------------------------
// One full exercise of an op: forward with entropy, backward with entropy
// (from that forward's lse), forward_backward; all outputs kept.
// ---------------------------------------------------------------------------
template <class T, class G>
struct outputs {
  using O = out_t<T>;
  vector_buf<O> lp, lse, ent, lp_fb;
  matrix_buf<G> gh, gw, gh_fb, gw_fb;
  // "" when bitwise identical to `o`, else which output and element first differ
  std::string bitwise_diff(const outputs& o) const {
    auto first = [](const std::vector<unsigned char>& a, const std::vector<unsigned char>& b, std::size_t elem) {
      for (std::size_t k = 0; k < std::min(a.size(), b.size()); ++k)
        if (a[k] != b[k]) return static_cast<std::int64_t>(k / elem);
      return a.size() == b.size() ? std::int64_t{-1} : static_cast<std::int64_t>(std::min(a.size(), b.size()) / elem);
    };
    std::ostringstream os;
    auto vec = [&](const char* name, const vector_buf<O>& a, const vector_buf<O>& b) {
      const auto k = first(a.bytes(), b.bytes(), sizeof(O));
      if (k >= 0) os << name << "[" << k << "] " << std::setprecision(17) << a.get(k) << " vs " << b.get(k) << "; ";
    };
    auto mat = [&](const char* name, const matrix_buf<G>& a, const matrix_buf<G>& b) {
      const auto k = first(a.bytes(), b.bytes(), sizeof(G));
      if (k >= 0)
        os << name << "[" << k / a.ld << "," << k % a.ld << "] " << std::setprecision(17) << from_elem(a.data[k])
           << " vs " << from_elem(b.data[k]) << "; ";
    };
    vec("logprobs", lp, o.lp);
    vec("lse", lse, o.lse);
    vec("entropy", ent, o.ent);
    vec("forward_backward logprobs", lp_fb, o.lp_fb);
    mat("grad_hidden", gh, o.gh);
    mat("grad_weight", gw, o.gw);
    mat("forward_backward grad_hidden", gh_fb, o.gh_fb);
    mat("forward_backward grad_weight", gw_fb, o.gw_fb);
    return os.str();
  }
  std::vector<unsigned char> all_bytes() const {
    std::vector<unsigned char> b;
    for (const auto& part : {lp.bytes(), lse.bytes(), ent.bytes(), lp_fb.bytes(), gh.bytes(), gw.bytes(),
                             gh_fb.bytes(), gw_fb.bytes()})
      b.insert(b.end(), part.begin(), part.end());
    return b;
  }
};

// Leading dimensions (-1: dense) of the four matrices.
struct layout {
  std::int64_t x_ld = -1, w_ld = -1, gh_ld = -1, gw_ld = -1;
};

template <class T, class G, class I = std::int64_t, class Op>
outputs<T, G> exercise(Op& op, const problem& p, const std::vector<double>& g, const std::vector<double>& hg,
                       const std::vector<double>& prefill, layout L = {}) {
  using O = out_t<T>;
  const auto X = make_matrix<T>(p.x, p.n, p.h, L.x_ld);
  const auto W = make_matrix<T>(p.w, p.v, p.h, L.w_ld);
  const auto Y = make_targets<I>(p.y);
  const vector_buf<O> Gv(g), HG(hg);
  const auto inputs_before = std::vector<std::vector<unsigned char>>{X.bytes(), W.bytes(), Y.bytes(), Gv.bytes(), HG.bytes()};
  outputs<T, G> o{vector_buf<O>(p.n),
                  vector_buf<O>(p.n),
                  vector_buf<O>(p.n),
                  vector_buf<O>(p.n),
                  matrix_buf<G>(p.n, p.h, L.gh_ld),
                  matrix_buf<G>(p.v, p.h, L.gw_ld),
                  matrix_buf<G>(p.n, p.h, L.gh_ld),
                  matrix_buf<G>(p.v, p.h, L.gw_ld)};
  o.lp.fill(garbage<O>());
  o.lse.fill(garbage<O>());
  o.ent.fill(garbage<O>());
  o.lp_fb.fill(garbage<O>());
  o.gh.fill(garbage<G>());
  o.gh_fb.fill(garbage<G>());
  o.gw.fill_from(prefill);
  o.gw_fb.fill_from(prefill);
  op.forward(X.cview(), W.cview(), Y.cview(), o.lp.view(), o.lse.view(), o.ent.view());
  op.backward(X.cview(), W.cview(), Y.cview(), o.lse.cview(), Gv.cview(), HG.cview(), o.gh.view(), o.gw.view());
  op.forward_backward(X.cview(), W.cview(), Y.cview(), Gv.cview(), o.lp_fb.view(), o.gh_fb.view(), o.gw_fb.view());
  const auto inputs_after = std::vector<std::vector<unsigned char>>{X.bytes(), W.bytes(), Y.bytes(), Gv.bytes(), HG.bytes()};
  CHECK_MESSAGE(inputs_before == inputs_after, "an input buffer (or its padding) was modified");
  CHECK(o.lp.padding_intact());
  CHECK(o.lse.padding_intact());
  CHECK(o.ent.padding_intact());
  CHECK(o.lp_fb.padding_intact());
  CHECK_MESSAGE(o.gh.padding_intact(), "grad_hidden padding written");
  CHECK_MESSAGE(o.gw.padding_intact(), "grad_weight padding written");
  CHECK_MESSAGE(o.gh_fb.padding_intact(), "forward_backward grad_hidden padding written");
  CHECK_MESSAGE(o.gw_fb.padding_intact(), "forward_backward grad_weight padding written");
  return o;
}

// All outputs of an exercise against the reference (base tolerance of T,
// plus an ulp of G for results stored as G; plus, for a backend that rounds
// dz to a narrower operand type before the gradient GEMMs, the bound of
// reference_operand_rounding_bounds for that type's unit roundoff and floor).
template <class T, class G>
void check_against_reference(const outputs<T, G>& o, const problem& p, const std::vector<double>& g,
                             const std::vector<double>& hg, const std::vector<double>& prefill,
                             double operand_unit = 0.0, double operand_floor = 0.0) {
  const auto ref = reference_forward(p);
  const auto gr = reference_backward(p, ref, g, hg);
  const auto gr_fb = reference_backward(p, ref, g, {});
  const auto rb = reference_operand_rounding_bounds(p, ref, g, hg, operand_unit, operand_floor);
  const auto rb_fb = reference_operand_rounding_bounds(p, ref, g, {}, operand_unit, operand_floor);
  const double bt = base_tol<T>();
  const double gbt = (std::is_same_v<T, double> && std::is_same_v<G, double>) ? 1e-10 : 1e-5;
  auto cmp_vec = [&](const char* what, const auto& buf, const std::vector<real>& want, bool zero_ignored) {
    return compare(
        what, p.n, [&](std::int64_t i) { return buf.get(i); },
        [&](std::int64_t i) { return static_cast<double>(want[i]); },
        [&](std::int64_t i, double w) { return (zero_ignored && p.ignored(i)) ? 0.0 : bt * std::max(1.0, std::fabs(w)); });
  };
  LCE_CHECK_CMP(cmp_vec("logprobs", o.lp, ref.logp, true));
  LCE_CHECK_CMP(cmp_vec("lse", o.lse, ref.lse, false));
  LCE_CHECK_CMP(cmp_vec("entropy", o.ent, ref.ent, true));
  LCE_CHECK_CMP(cmp_vec("forward_backward logprobs", o.lp_fb, ref.logp, true));
  auto cmp_mat = [&](const char* what, const matrix_buf<G>& m, const std::vector<double>& want,
                     const std::vector<double>* pre, const std::vector<double>& rounding) {
    const double s = gbt * std::max(1.0, max_abs(want));
    return compare(
        what, m.rows * m.cols, [&](std::int64_t k) { return m.get(k / m.cols, k % m.cols); },
        [&](std::int64_t k) { return want[k] + (pre ? (*pre)[k] : 0.0); },
        [&](std::int64_t k, double w) { return s + ulp_of<G>(w) + ulp_of<G>(want[k]) + rounding[k]; });
  };
  LCE_CHECK_CMP(cmp_mat("backward grad_hidden", o.gh, gr.dx, nullptr, rb.dx));
  LCE_CHECK_CMP(cmp_mat("backward grad_weight", o.gw, gr.dw, &prefill, rb.dw));
  LCE_CHECK_CMP(cmp_mat("forward_backward grad_hidden", o.gh_fb, gr_fb.dx, nullptr, rb_fb.dx));
  LCE_CHECK_CMP(cmp_mat("forward_backward grad_weight", o.gw_fb, gr_fb.dw, &prefill, rb_fb.dw));
}

// Element-wise closeness of two exercises (e.g. different chunk sizes).
template <class T, class G>
void check_close(const outputs<T, G>& a, const outputs<T, G>& b, double tol) {
  auto cmp_vec = [&](const char* what, const auto& x, const auto& y) {
    return compare(
        what, x.size, [&](std::int64_t i) { return x.get(i); }, [&](std::int64_t i) { return y.get(i); },
        [&](std::int64_t, double w) { return tol * std::max(1.0, std::fabs(w)); });
  };
  auto cmp_mat = [&](const char* what, const matrix_buf<G>& x, const matrix_buf<G>& y) {
    double s = 1.0;
    for (std::int64_t k = 0; k < y.rows * y.cols; ++k) s = std::max(s, std::fabs(y.get(k / y.cols, k % y.cols)));
    return compare(
        what, x.rows * x.cols, [&](std::int64_t k) { return x.get(k / x.cols, k % x.cols); },
        [&](std::int64_t k) { return y.get(k / y.cols, k % y.cols); },
        [&](std::int64_t, double w) { return tol * s + (is_2byte_v<G> ? ulp_of<G>(w) : 0.0); });
  };
  LCE_CHECK_CMP(cmp_vec("logprobs", a.lp, b.lp));
  LCE_CHECK_CMP(cmp_vec("lse", a.lse, b.lse));
  LCE_CHECK_CMP(cmp_vec("entropy", a.ent, b.ent));
  LCE_CHECK_CMP(cmp_vec("forward_backward logprobs", a.lp_fb, b.lp_fb));
  LCE_CHECK_CMP(cmp_mat("grad_hidden", a.gh, b.gh));
  LCE_CHECK_CMP(cmp_mat("grad_weight", a.gw, b.gw));
  LCE_CHECK_CMP(cmp_mat("forward_backward grad_hidden", a.gh_fb, b.gh_fb));
  LCE_CHECK_CMP(cmp_mat("forward_backward grad_weight", a.gw_fb, b.gw_fb));
}

// The row terms beyond log-probs (lce::row_outputs / lce::row_gradients), materialised.
// dX, dW of L = sum_i g_i logp_i + hg_i ent_i + q_i lse_i + m_i mean_i,
// materialised: the g and hg parts from reference_backward, the others here
// (dlse/dz = p, dmean/dz = 1/V; ignored rows contribute nothing).
inline gradients reference_with_terms(const problem& p, const forward_result& r, const std::vector<double>& g,
                                      const std::vector<double>& hg, const std::vector<double>& q,
                                      const std::vector<double>& m) {
  gradients out = reference_backward(p, r, g, hg);
  for (std::int64_t i = 0; i < p.n; ++i) {
    if (p.ignored(i)) continue;
    for (std::int64_t j = 0; j < p.v; ++j) {
      const real prob = std::exp(r.z[i * p.v + j] - r.lse[i]);
      const real dz = (q.empty() ? 0 : static_cast<real>(q[i]) * prob) +
                      (m.empty() ? 0 : static_cast<real>(m[i]) / static_cast<real>(p.v));
      const real ds = dz * r.dzds[i * p.v + j];
      for (std::int64_t k = 0; k < p.h; ++k) {
        out.dx[i * p.h + k] += static_cast<double>(ds * static_cast<real>(p.w[j * p.h + k]));
        out.dw[j * p.h + k] += static_cast<double>(ds * static_cast<real>(p.x[i * p.h + k]));
      }
    }
  }
  return out;
}

inline std::vector<double> reference_mean_logit(const problem& p, const forward_result& r) {
  std::vector<double> mean(static_cast<std::size_t>(p.n), 0.0);
  for (std::int64_t i = 0; i < p.n; ++i) {
    if (p.ignored(i)) continue;
    real sum = 0;
    for (std::int64_t j = 0; j < p.v; ++j) sum += r.z[i * p.v + j];
    mean[static_cast<std::size_t>(i)] = static_cast<double>(sum / static_cast<real>(p.v));
  }
  return mean;
}

// Log-probs, lse, entropy and mean logit of a call against the reference,
// each within tol (1 + |want|).
template <class O>
void check_row_outputs(const problem& p, const forward_result& ref, const vector_buf<O>& lp,
                       const vector_buf<O>& lse, const vector_buf<O>& ent, const vector_buf<O>& ml, double tol) {
  const auto rel = [&](std::int64_t, double w) { return tol * (1 + std::fabs(w)); };
  LCE_CHECK_CMP(compare(
      "logprobs", p.n, [&](std::int64_t i) { return lp.get(i); },
      [&](std::int64_t i) { return static_cast<double>(ref.logp[i]); }, rel));
  LCE_CHECK_CMP(compare(
      "lse", p.n, [&](std::int64_t i) { return lse.get(i); },
      [&](std::int64_t i) { return static_cast<double>(ref.lse[i]); }, rel));
  LCE_CHECK_CMP(compare(
      "entropy", p.n, [&](std::int64_t i) { return ent.get(i); },
      [&](std::int64_t i) { return static_cast<double>(ref.ent[i]); }, rel));
  const std::vector<double> mean = reference_mean_logit(p, ref);
  LCE_CHECK_CMP(compare(
      "mean_logit", p.n, [&](std::int64_t i) { return ml.get(i); }, [&](std::int64_t i) { return mean[i]; }, rel));
}

// |got - want| <= tol (1 + |want|) over a gradient, relative to its largest element.
template <class G>
comparison compare_gradient(const std::string& what, const matrix_buf<G>& got, const std::vector<double>& want,
                            double tol) {
  const double scale = 1 + max_abs(want);
  return compare(
      what, got.rows * got.cols, [&](std::int64_t k) { return got.get(k / got.cols, k % got.cols); },
      [&](std::int64_t k) { return want[static_cast<std::size_t>(k)]; },
      [&](std::int64_t, double) { return tol * scale; });
}


}  // namespace lce_test
