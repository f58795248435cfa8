// Storage types, edge cases (N = 0, all ignored, V = 1, +-1e4 logits, strided
// buffers, target index types, ignore_index) and the view types accepted.
#include "cases/edge_cases.hpp"

#include <cmath>
#if defined(__x86_64__)
#include <pmmintrin.h>  // the MXCSR's flush-to-zero and denormals-are-zero modes
#endif

#if LCE_TESTS_HAVE_CCCL && __has_include(<cuda/std/mdspan>)
#include <cuda/std/mdspan>
#define LCE_T_CUDA_MDSPAN 1
#endif
#if __has_include(<mdspan>)
#include <mdspan>
#if defined(__cpp_lib_mdspan)
#define LCE_T_STD_MDSPAN 1
#endif
#endif

using namespace lce_test;

// ---------------------------------------------------------------------------
// bfloat16 / float16 against the independent IEEE conversions
// ---------------------------------------------------------------------------
namespace {
std::vector<float> conversion_inputs(bool half) {
  std::vector<float> f = {0.0f, -0.0f, 1.0f, -1.0f, 1.5f, 0.1f, -3.14159f, 65504.0f, 65519.0f, 65520.0f, 65536.0f,
                          1e-8f, 6e-5f, 5.96e-8f, 2.98e-8f, 1e30f, -1e30f, 3.4e38f, 1e-40f, -1e-45f,
                          std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::max(), std::numeric_limits<float>::denorm_min()};
  rng r(half ? 11 : 12);
  for (int k = 0; k < 20000; ++k) {
    const auto bits = static_cast<std::uint32_t>(r.next());
    const float x = std::bit_cast<float>(bits);
    if (!std::isnan(x)) f.push_back(x);
    f.push_back(static_cast<float>(r.uniform(-70000, 70000)));
    f.push_back(static_cast<float>(r.uniform(-1e-4, 1e-4)));
    // exact ties: halfway between two representable neighbours
    if (half) {
      const auto b = static_cast<std::uint16_t>(r.below(0x7BFF));
      const double tie = (double(fp16_bits_to_float(b)) + double(fp16_bits_to_float(static_cast<std::uint16_t>(b + 1)))) / 2;
      f.push_back(static_cast<float>(tie));  // exact in float
      f.push_back(-static_cast<float>(tie));
    } else {
      const auto b16 = static_cast<std::uint32_t>(r.below(0x7F7F)) << 16;
      f.push_back(std::bit_cast<float>(b16 | 0x8000u));          // tie
      f.push_back(std::bit_cast<float>(b16 | 0x8001u));          // just above the tie
      f.push_back(std::bit_cast<float>(b16 | 0x7FFFu));          // just below
      f.push_back(-std::bit_cast<float>((b16 + 0x10000u) | 0x8000u));  // tie, odd neighbour
    }
  }
  return f;
}
}  // namespace

TEST_CASE("bfloat16: rounds to nearest even and converts back exactly") {
  int bad = 0;
  for (float x : conversion_inputs(false)) {
    const auto got = std::bit_cast<std::uint16_t>(lce::bfloat16{x});
    const auto want = float_to_bf16_bits(x);
    if (got != want && bad++ < 5) FAIL_CHECK("bfloat16{" << x << "} bits " << std::hex << got << ", want " << want);
  }
  CHECK(bad == 0);
  CHECK(std::isnan(static_cast<float>(lce::bfloat16{std::numeric_limits<float>::quiet_NaN()})));
  int bad_back = 0;
  for (std::uint32_t b = 0; b < 0x10000u; ++b) {
    const float got = static_cast<float>(std::bit_cast<lce::bfloat16>(static_cast<std::uint16_t>(b)));
    const float want = bf16_bits_to_float(static_cast<std::uint16_t>(b));
    const bool same = std::isnan(want) ? std::isnan(got) : std::bit_cast<std::uint32_t>(got) == std::bit_cast<std::uint32_t>(want);
    if (!same && bad_back++ < 5) FAIL_CHECK("float(bfloat16 bits " << std::hex << b << ") = " << got << ", want " << want);
  }
  CHECK(bad_back == 0);
}

TEST_CASE("float16: rounds to nearest even and converts back exactly") {
  int bad = 0;
  for (float x : conversion_inputs(true)) {
    const auto got = std::bit_cast<std::uint16_t>(lce::float16{x});
    const auto want = float_to_fp16_bits(x);
    if (got != want && bad++ < 5) FAIL_CHECK("float16{" << x << "} bits " << std::hex << got << ", want " << want);
  }
  CHECK(bad == 0);
  CHECK(std::isnan(static_cast<float>(lce::float16{std::numeric_limits<float>::quiet_NaN()})));
  int bad_back = 0;
  for (std::uint32_t b = 0; b < 0x10000u; ++b) {
    const float got = static_cast<float>(std::bit_cast<lce::float16>(static_cast<std::uint16_t>(b)));
    const float want = fp16_bits_to_float(static_cast<std::uint16_t>(b));
    const bool same = std::isnan(want) ? std::isnan(got) : std::bit_cast<std::uint32_t>(got) == std::bit_cast<std::uint32_t>(want);
    if (!same && bad_back++ < 5) FAIL_CHECK("float(float16 bits " << std::hex << b << ") = " << got << ", want " << want);
  }
  CHECK(bad_back == 0);
}

#if defined(__x86_64__)
// nvcc -ftz (and fast math) flush denormal operands to zero. On the host the
// MXCSR's flush-to-zero and denormals-are-zero bits do the same, so every
// subnormal half is checked here as the device would widen it.
TEST_CASE("float16: subnormal halves widen exactly with denormals flushed to zero") {
  const unsigned int saved = _mm_getcsr();
  _MM_SET_FLUSH_ZERO_MODE(_MM_FLUSH_ZERO_ON);
  _MM_SET_DENORMALS_ZERO_MODE(_MM_DENORMALS_ZERO_ON);
  int bad = 0;
  for (std::uint32_t b = 1; b < 0x400u; ++b) {
    for (const std::uint32_t sign : {0u, 0x8000u}) {
      const auto bits = static_cast<std::uint16_t>(b | sign);
      const float got = static_cast<float>(std::bit_cast<lce::float16>(bits));
      const float want = (sign ? -1.0f : 1.0f) * std::ldexp(static_cast<float>(b), -24);
      if (std::bit_cast<std::uint32_t>(got) != std::bit_cast<std::uint32_t>(want) && bad++ < 5)
        FAIL_CHECK("float(float16 bits " << static_cast<unsigned>(bits) << ") = " << got << ", want " << want);
    }
  }
  _mm_setcsr(saved);
  CHECK(bad == 0);
}
#endif

// ---------------------------------------------------------------------------
// N = 0
// ---------------------------------------------------------------------------
TEST_CASE_TEMPLATE("N = 0: every entry point is a no-op", T, float, double, lce::bfloat16, lce::float16) {
  using O = out_t<T>;
  const std::int64_t h = 8, v = 11;
  const auto wv = random_vector(v * h, 1, -1, 1);
  const auto W = make_matrix<T>(wv, v, h);
  std::vector<T> xstore(4);
  std::vector<std::int64_t> ystore(4, 0);
  std::vector<O> ostore(8, O(7));
  matrix_buf<float> gw(v, h);
  gw.fill_from(random_vector(v * h, 2, -1, 1));
  matrix_buf<T> gw_t(v, h);
  gw_t.fill_from(random_vector(v * h, 3, -1, 1, rounder_for<T>()));
  std::vector<float> ghstore(4, 9.0f);
  const auto gw_before = gw.bytes(), gw_t_before = gw_t.bytes();
  const auto ostore_before = ostore;
  auto op = make_op<T>(make_options(1.0f, 0.0f, 0));

  // distinct addresses for every view (zero-size views never alias anyway)
  auto run = [&](T* xp, std::int64_t* yp, O* op_, float* ghp) {
    auto at = [&](int k) { return op_ ? op_ + k : op_; };
    const lce::matrix_view<const T> X{xp, 0, h};
    const lce::vector_view<const std::int64_t> Y{yp, 0};
    const lce::vector_view<O> lp{at(0), 0}, lse{at(1), 0}, ent{at(2), 0};
    const lce::vector_view<const O> lse_in{at(3), 0}, glp{at(4), 0}, gent{at(5), 0};
    const lce::matrix_view<float> GH{ghp, 0, h};
    const lce::matrix_view<T> GHt{reinterpret_cast<T*>(ghp), 0, h};
    CHECK_NOTHROW(op.forward(X, W.cview(), Y, lp, lse));
    CHECK_NOTHROW(op.forward(X, W.cview(), Y, lp, lse, ent));
    CHECK_NOTHROW(op.backward(X, W.cview(), Y, lse_in, glp, GH, gw.view()));
    CHECK_NOTHROW(op.backward(X, W.cview(), Y, lse_in, glp, gent, GHt, gw_t.view()));
    CHECK_NOTHROW(op.forward_backward(X, W.cview(), Y, glp, lp, GH, gw.view()));
    CHECK(gw.bytes() == gw_before);
    CHECK(gw_t.bytes() == gw_t_before);
  };
  SUBCASE("non-null data pointers") {
    run(xstore.data(), ystore.data(), ostore.data(), ghstore.data());
    CHECK(ostore == ostore_before);
    CHECK(ghstore == std::vector<float>(4, 9.0f));
  }
  SUBCASE("null data pointers (as an empty tensor may have)") {
    run(nullptr, nullptr, nullptr, nullptr);
  }
}

// ---------------------------------------------------------------------------
// all tokens ignored
// ---------------------------------------------------------------------------
TEST_CASE_TEMPLATE("all tokens ignored: zero log-probs, entropies and gradients; grad_weight untouched", T, float,
                   double, lce::bfloat16, lce::float16) {
  cases::all_tokens_ignored<host_env, T>();
}

// ---------------------------------------------------------------------------
// V = 1
// ---------------------------------------------------------------------------
TEST_CASE_TEMPLATE("V = 1: log-prob 0, entropy 0, no gradient", T, float, double, lce::bfloat16, lce::float16) {
  using O = out_t<T>;
  problem p = make_problem(9, 6, 1, 21, rounder_for<T>(), 2.0, 2.0, 0.2);
  const auto g = random_vector(p.n, 22, -1, 1, rounder_for<O>());
  const auto hg = random_vector(p.n, 23, -1, 1, rounder_for<O>());
  const auto pre = random_vector(p.v * p.h, 24, -1, 1, rounder_for<float>());
  auto op = make_op<T>(make_options(1.0f, 0.0f, 4));
  const auto o = exercise<T, float>(op, p, g, hg, pre);
  const double tol = std::is_same_v<T, double> ? 1e-12 : 1e-6;
  const auto ref = reference_forward(p);
  for (std::int64_t i = 0; i < p.n; ++i) {
    CAPTURE(i);
    CHECK(std::fabs(o.lp.get(i)) <= tol);
    CHECK(std::fabs(o.lp_fb.get(i)) <= tol);
    CHECK(std::fabs(o.ent.get(i)) <= tol);
    CHECK(std::fabs(o.lse.get(i) - static_cast<double>(ref.lse[i])) <= base_tol<T>() * std::max(1.0, std::fabs(static_cast<double>(ref.lse[i]))));
  }
  check_against_reference(o, p, g, hg, pre);
}

// ---------------------------------------------------------------------------
// logits of +-1e4 (exact in every storage type: integer inputs)
// ---------------------------------------------------------------------------
TEST_CASE_TEMPLATE("logits of +-1e4 give finite, correct results", T, float, double, lce::bfloat16, lce::float16) {
  using O = out_t<T>;
  problem p;
  p.n = 6;
  p.h = 2;
  p.v = 6;
  p.x = {100, 1, -100, 1, 100, -1, 0, 0, -100, -1, 100, 0};
  p.w = {100, 0, 100, 1, -100, 0, 0, 3, 99, 5, -100, -1};
  p.y = {0, 2, 2, 4, 5, 3};
  struct cfg {
    float tau, cap;
  };
  for (const cfg c : {cfg{1.0f, 0.0f}, cfg{0.5f, 0.0f}, cfg{1.0f, 30.0f}}) {
    CAPTURE(c.tau);
    CAPTURE(c.cap);
    p.tau = c.tau;
    p.cap = c.cap;
    const auto ref = reference_forward(p);
    const auto X = make_matrix<T>(p.x, p.n, p.h);
    const auto W = make_matrix<T>(p.w, p.v, p.h);
    const auto Y = make_targets<std::int64_t>(p.y);
    auto op = make_op<T>(make_options(c.tau, c.cap, 4));
    vector_buf<O> lp(p.n), lse(p.n), ent(p.n);
    op.forward(X.cview(), W.cview(), Y.cview(), lp.view(), lse.view(), ent.view());
    // fp32 results near 1e4 carry about one fp32 ulp of the logits' magnitude
    auto tol = [&](double mag) {
      return std::is_same_v<T, double> ? 1e-9 * std::max(1.0, mag) : 1e-4 + 2 * ulp_of<float>(mag);
    };
    for (std::int64_t i = 0; i < p.n; ++i) {
      CAPTURE(i);
      double zmax = 0;
      for (std::int64_t j = 0; j < p.v; ++j) zmax = std::max(zmax, std::fabs(static_cast<double>(ref.z[i * p.v + j])));
      CHECK(std::isfinite(lp.get(i)));
      CHECK(std::isfinite(lse.get(i)));
      CHECK(std::isfinite(ent.get(i)));
      INFO("logp got " << lp.get(i) << " want " << static_cast<double>(ref.logp[i]) << "; lse got " << lse.get(i)
                        << " want " << static_cast<double>(ref.lse[i]) << "; entropy got " << ent.get(i) << " want "
                        << static_cast<double>(ref.ent[i]));
      CHECK(std::fabs(lp.get(i) - static_cast<double>(ref.logp[i])) <= tol(zmax));
      CHECK(std::fabs(lse.get(i) - static_cast<double>(ref.lse[i])) <= tol(zmax));
      CHECK(std::fabs(ent.get(i) - static_cast<double>(ref.ent[i])) <= tol(zmax));
    }
    // backward, given the exact lse: the gradients of the true distribution.
    // In fp32 a logit near 1e4 / tau is only known to half an ulp (~5e-4 at
    // 1e4), which shifts each p by that much relatively; propagated through
    // |w| (or |x|) and 1/tau this bounds the fp32 error: one ulp of the
    // largest logit, times max(|x|, |w|) / tau.
    const auto g = std::vector<double>{-1.0, 0.5, -0.25, 1.0, -1.0, 0.75};
    const auto hg = std::vector<double>{0.3, -0.2, 0.1, 0.5, -0.4, 0.2};
    const auto gr = reference_backward(p, ref, g, hg);
    vector_buf<double> lse_in(to_doubles(ref.lse));
    vector_buf<O> G(g), HG(hg);
    matrix_buf<float> gh(p.n, p.h), gw(p.v, p.h);
    gw.fill(0.0f);
    op.backward(X.cview(), W.cview(), Y.cview(), lse_in.cview(), G.cview(), HG.cview(), gh.view(), gw.view());
    const double sx = std::max(1.0, max_abs(gr.dx)), sw = std::max(1.0, max_abs(gr.dw));
    double zmax_all = 0, inputs_max = 0;
    for (const auto& z : ref.z) zmax_all = std::max(zmax_all, std::fabs(static_cast<double>(z)));
    for (const double e : p.x) inputs_max = std::max(inputs_max, std::fabs(e));
    for (const double e : p.w) inputs_max = std::max(inputs_max, std::fabs(e));
    const double logit_ulp =
        std::is_same_v<T, double> ? 0.0 : ulp_of<float>(zmax_all) * inputs_max / static_cast<double>(c.tau);
    const double gt = std::is_same_v<T, double> ? 1e-6 : 1e-4;  // float grads: fp32 output
    LCE_CHECK_CMP(compare(
        "grad_hidden", p.n * p.h, [&](std::int64_t k) { return gh.get(k / p.h, k % p.h); },
        [&](std::int64_t k) { return gr.dx[k]; }, [&](std::int64_t, double) { return gt * sx + logit_ulp; }));
    LCE_CHECK_CMP(compare(
        "grad_weight", p.v * p.h, [&](std::int64_t k) { return gw.get(k / p.h, k % p.h); },
        [&](std::int64_t k) { return gr.dw[k]; }, [&](std::int64_t, double) { return gt * sw + logit_ulp; }));
    // fused sweep (its lse is internal): finite and correct to fp32 resolution of 1e4
    const auto gr_fb = reference_backward(p, ref, g, {});
    vector_buf<O> lp_fb(p.n);
    matrix_buf<float> gh_fb(p.n, p.h), gw_fb(p.v, p.h);
    gw_fb.fill(0.0f);
    op.forward_backward(X.cview(), W.cview(), Y.cview(), G.cview(), lp_fb.view(), gh_fb.view(), gw_fb.view());
    const double ft = std::is_same_v<T, double> ? 1e-6 : 4e-3;
    LCE_CHECK_CMP(compare(
        "forward_backward grad_hidden", p.n * p.h, [&](std::int64_t k) { return gh_fb.get(k / p.h, k % p.h); },
        [&](std::int64_t k) { return gr_fb.dx[k]; }, [&](std::int64_t, double) { return ft * sx; }));
    LCE_CHECK_CMP(compare(
        "forward_backward grad_weight", p.v * p.h, [&](std::int64_t k) { return gw_fb.get(k / p.h, k % p.h); },
        [&](std::int64_t k) { return gr_fb.dw[k]; }, [&](std::int64_t, double) { return ft * sw; }));
  }
}

// ---------------------------------------------------------------------------
// strided buffers, N not a multiple of the chunk
// ---------------------------------------------------------------------------
// A soft-cap far above the logits maps each close to itself: tanh(s / cap) near 0, where
// fp32's (1 - e) / (1 + e) cancels (cap 1e6 left logits 0.1 off; cap 1e8 made them all 0).
TEST_CASE_TEMPLATE("a soft-cap far above the logits keeps them, to the type's precision", T, float, double,
                   lce::bfloat16, lce::float16) {
  const std::int64_t n = 9;
  problem p = make_problem(n, 6, 37, 211, rounder_for<T>(), 1.5, 1.0, 0.2);
  const auto g = random_vector(n, 212, -1.0, 1.0, rounder_for<out_t<T>>());
  const auto hg = random_vector(n, 213, -0.5, 0.5, rounder_for<out_t<T>>());
  const auto pre = random_vector(p.v * p.h, 214, -1.0, 1.0, rounder_for<float>());
  for (const float cap : {3.0f, 0.3f, 1e4f, 1e6f, 1e8f, 1e20f, 8.5e37f}) {
    CAPTURE(cap);
    p.cap = cap;
    p.tau = 0.8f;
    auto op = make_op<T>(make_options(p.tau, p.cap, 4));
    check_against_reference(exercise<T, float>(op, p, g, hg, pre), p, g, hg, pre);
  }
}

TEST_CASE_TEMPLATE("strided hidden, weight, grad_hidden, grad_weight: correct, padding untouched", T, float, double,
                   lce::bfloat16, lce::float16) {
  cases::strided_buffers<host_env, T>();
}

// ---------------------------------------------------------------------------
// target index types and ignore_index
// ---------------------------------------------------------------------------
TEST_CASE_TEMPLATE("int32 and int64 targets give identical results", T, float, double, lce::bfloat16, lce::float16) {
  cases::int32_and_int64_targets<host_env, T>();
}

TEST_CASE_TEMPLATE("a NaN logit makes its tokens' lse, log-prob, entropy and gradients NaN", T, float, double,
                   lce::bfloat16, lce::float16) {
  cases::nan_logit_poisons_its_row<host_env, T>();
}

TEST_CASE("ignore_index: a custom value is honoured, including one inside [0, V)") {
  for (std::int64_t ignore : {std::int64_t{-1}, std::int64_t{-100}, std::int64_t{5}}) {
    CAPTURE(ignore);
    problem p = make_problem(25, 8, 12, 51, round_to_float, 1.0, 1.0, 0.3, ignore);
    const auto g = random_vector(p.n, 52, -1, 1, round_to_float);
    const auto hg = random_vector(p.n, 53, -0.5, 0.5, round_to_float);
    const auto pre = random_vector(p.v * p.h, 54, -1, 1, round_to_float);
    auto op = make_op<float>(make_options(1.0f, 0.0f, 6, ignore));
    const auto o = exercise<float, float>(op, p, g, hg, pre);
    check_against_reference(o, p, g, hg, pre);
  }
}

// ---------------------------------------------------------------------------
// non-const views and mdspan views
// ---------------------------------------------------------------------------
TEST_CASE_TEMPLATE("non-const views are accepted as inputs", T, float, double, lce::bfloat16, lce::float16) {
  using O = out_t<T>;
  problem p = make_problem(11, 8, 17, 61, rounder_for<T>(), 1.0, 1.0, 0.2);
  const auto g = random_vector(p.n, 62, -1, 1, rounder_for<O>());
  const auto hg = random_vector(p.n, 63, -0.5, 0.5, rounder_for<O>());
  const auto pre = random_vector(p.v * p.h, 64, -1, 1, rounder_for<float>());
  auto op = make_op<T>(make_options(1.0f, 0.0f, 4));
  const auto ref = exercise<T, float>(op, p, g, hg, pre);

  auto X = make_matrix<T>(p.x, p.n, p.h);
  auto W = make_matrix<T>(p.w, p.v, p.h);
  auto Y = make_targets<std::int64_t>(p.y);
  vector_buf<O> Gv(g), HG(hg);
  outputs<T, float> o{vector_buf<O>(p.n), vector_buf<O>(p.n), vector_buf<O>(p.n), vector_buf<O>(p.n),
                      matrix_buf<float>(p.n, p.h), matrix_buf<float>(p.v, p.h), matrix_buf<float>(p.n, p.h),
                      matrix_buf<float>(p.v, p.h)};
  o.gh.fill(garbage<float>());
  o.gh_fb.fill(garbage<float>());
  o.gw.fill_from(pre);
  o.gw_fb.fill_from(pre);
  o.lp.fill(garbage<O>());
  o.lse.fill(garbage<O>());
  o.ent.fill(garbage<O>());
  o.lp_fb.fill(garbage<O>());
  op.forward(X.view(), W.view(), Y.view(), o.lp.view(), o.lse.view(), o.ent.view());
  op.backward(X.view(), W.view(), Y.view(), o.lse.view(), Gv.view(), HG.view(), o.gh.view(), o.gw.view());
  op.forward_backward(X.view(), W.view(), Y.view(), Gv.view(), o.lp_fb.view(), o.gh_fb.view(), o.gw_fb.view());
  CHECK(o.all_bytes() == ref.all_bytes());
}

#ifdef LCE_T_CUDA_MDSPAN
namespace {
template <class Op, class... A>
concept forward_callable = requires(Op& op, A... a) { op.forward(a...); };
}

TEST_CASE_TEMPLATE("cuda::std::mdspan views give the same results as matrix_view", T, float, double, lce::bfloat16,
                   lce::float16) {
  using O = out_t<T>;
  using ext2 = cuda::std::dextents<std::int64_t, 2>;
  using ext1 = cuda::std::dextents<std::int64_t, 1>;
  problem p = make_problem(14, 8, 23, 71, rounder_for<T>(), 1.0, 1.0, 0.2);
  p.tau = 0.8f;
  const auto g = random_vector(p.n, 72, -1, 1, rounder_for<O>());
  const auto hg = random_vector(p.n, 73, -0.5, 0.5, rounder_for<O>());
  auto run = [&]<class G>() {
    INFO("gradient element " << type_name<G>());
    const auto pre = random_vector(p.v * p.h, 74, -1, 1, rounder_for<G>());
    auto op = make_op<T>(make_options(p.tau, 0.0f, 4));
    const auto ref = exercise<T, G>(op, p, g, hg, pre);

    const auto X = make_matrix<T>(p.x, p.n, p.h);
    const auto W = make_matrix<T>(p.w, p.v, p.h);
    const auto Y = make_targets<std::int64_t>(p.y);
    const vector_buf<O> Gv(g), HG(hg);
    outputs<T, G> o{vector_buf<O>(p.n),      vector_buf<O>(p.n),      vector_buf<O>(p.n),
                    vector_buf<O>(p.n),      matrix_buf<G>(p.n, p.h), matrix_buf<G>(p.v, p.h),
                    matrix_buf<G>(p.n, p.h), matrix_buf<G>(p.v, p.h)};
    o.lp.fill(garbage<O>());
    o.lse.fill(garbage<O>());
    o.ent.fill(garbage<O>());
    o.lp_fb.fill(garbage<O>());
    o.gh.fill(garbage<G>());
    o.gh_fb.fill(garbage<G>());
    o.gw.fill_from(pre);
    o.gw_fb.fill_from(pre);
    const cuda::std::mdspan<const T, ext2> Xm(X.ptr(), p.n, p.h), Wm(W.ptr(), p.v, p.h);
    const cuda::std::mdspan<const std::int64_t, ext1> Ym(Y.ptr(), p.n);
    const cuda::std::mdspan<const O, ext1> Gm(Gv.ptr(), p.n), HGm(HG.ptr(), p.n), LSEc(o.lse.ptr(), p.n);
    const cuda::std::mdspan<O, ext1> LP(o.lp.ptr(), p.n), LSE(o.lse.ptr(), p.n), ENT(o.ent.ptr(), p.n),
        LPfb(o.lp_fb.ptr(), p.n);
    const cuda::std::mdspan<G, ext2> GH(o.gh.ptr(), p.n, p.h), GW(o.gw.ptr(), p.v, p.h), GHfb(o.gh_fb.ptr(), p.n, p.h),
        GWfb(o.gw_fb.ptr(), p.v, p.h);
    op.forward(Xm, Wm, Ym, LP, LSE, ENT);
    op.backward(Xm, Wm, Ym, LSEc, Gm, HGm, GH, GW);
    op.forward_backward(Xm, Wm, Ym, Gm, LPfb, GHfb, GWfb);
    CHECK(o.all_bytes() == ref.all_bytes());

    // mixed: mdspan inputs, matrix_view outputs, non-const mdspan inputs
    vector_buf<O> lp2(p.n), lse2(p.n);
    const cuda::std::mdspan<T, ext2> Xmut(const_cast<T*>(X.ptr()), p.n, p.h), Wmut(const_cast<T*>(W.ptr()), p.v, p.h);
    op.forward(Xmut, Wmut, Y.cview(), lp2.view(), lse2.view());
    CHECK(lp2.bytes() == ref.lp.bytes());
    CHECK(lse2.bytes() == ref.lse.bytes());
  };
  run.template operator()<float>();
  if constexpr (!std::is_same_v<T, float>) run.template operator()<T>();
}

TEST_CASE("cuda::std::mdspan layout_stride with unit inner stride and padded rows is accepted") {
  using ext2 = cuda::std::dextents<std::int64_t, 2>;
  using ext1 = cuda::std::dextents<std::int64_t, 1>;
  problem p = make_problem(9, 6, 13, 81, round_to_float, 1.0, 1.0, 0.2);
  const std::int64_t ldx = p.h + 3;
  const auto X = make_matrix<float>(p.x, p.n, p.h, ldx);
  const auto W = make_matrix<float>(p.w, p.v, p.h);
  const auto Y = make_targets<std::int64_t>(p.y);
  auto op = make_op<float>(make_options(1.0f, 0.0f, 4));
  vector_buf<float> lp_ref(p.n), lse_ref(p.n), lp(p.n), lse(p.n);
  op.forward(X.cview(), W.cview(), Y.cview(), lp_ref.view(), lse_ref.view());
  using strided = cuda::std::mdspan<const float, ext2, cuda::std::layout_stride>;
  const strided Xs(X.ptr(), cuda::std::layout_stride::mapping<ext2>(ext2(p.n, p.h), cuda::std::array<std::int64_t, 2>{ldx, 1}));
  const cuda::std::mdspan<const float, ext2> Wm(W.ptr(), p.v, p.h);
  const cuda::std::mdspan<const std::int64_t, ext1> Ym(Y.ptr(), p.n);
  const cuda::std::mdspan<float, ext1> LP(lp.ptr(), p.n), LSE(lse.ptr(), p.n);
  if constexpr (forward_callable<decltype(op), strided, decltype(Wm), decltype(Ym), decltype(LP), decltype(LSE)>) {
    op.forward(Xs, Wm, Ym, LP, LSE);
    CHECK(lp.bytes() == lp_ref.bytes());
    CHECK(lse.bytes() == lse_ref.bytes());
  } else {
    FAIL_CHECK("a layout_stride mdspan with unit inner stride is not accepted (API.md: any rank-2 mdspan with unit "
               "inner stride)");
  }
}
#endif

#ifdef LCE_T_STD_MDSPAN
TEST_CASE("std::mdspan views give the same results as matrix_view") {
  using ext2 = std::dextents<std::int64_t, 2>;
  using ext1 = std::dextents<std::int64_t, 1>;
  problem p = make_problem(10, 8, 15, 91, round_to_float, 1.0, 1.0, 0.2);
  const auto X = make_matrix<float>(p.x, p.n, p.h);
  const auto W = make_matrix<float>(p.w, p.v, p.h);
  const auto Y = make_targets<std::int64_t>(p.y);
  auto op = make_op<float>(make_options(1.0f, 0.0f, 4));
  vector_buf<float> lp_ref(p.n), lse_ref(p.n), lp(p.n), lse(p.n);
  op.forward(X.cview(), W.cview(), Y.cview(), lp_ref.view(), lse_ref.view());
  op.forward(std::mdspan<const float, ext2>(X.ptr(), p.n, p.h), std::mdspan<const float, ext2>(W.ptr(), p.v, p.h),
             std::mdspan<const std::int64_t, ext1>(Y.ptr(), p.n), std::mdspan<float, ext1>(lp.ptr(), p.n),
             std::mdspan<float, ext1>(lse.ptr(), p.n));
  CHECK(lp.bytes() == lp_ref.bytes());
  CHECK(lse.bytes() == lse_ref.bytes());
}
#endif
