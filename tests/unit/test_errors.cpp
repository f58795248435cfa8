// Bad input: every entry point throws lce::error naming the argument and the
// values, and writes nothing (every buffer, inputs and outputs, bitwise
// unchanged; grad_weight included).
#include "cases/error_cases.hpp"

#include <cctype>
#include <cmath>
#include <functional>
#include <initializer_list>
#include <optional>

#if LCE_TESTS_HAVE_CCCL && __has_include(<cuda/std/mdspan>)
#include <cuda/std/mdspan>
#define LCE_T_CUDA_MDSPAN 1
#endif

using namespace lce_test;

static_assert(std::is_base_of_v<std::runtime_error, lce::error>);

using namespace lce_test::cases;

TEST_CASE_TEMPLATE("errors: the fixture itself is valid", T, float, double, lce::bfloat16, lce::float16) {
  fixture<T> f;
  for (entry e : all_entries) f.expect_ok(e);
}

TEST_CASE_TEMPLATE("errors: bad input raises lce::error and writes nothing", T, float, double, lce::bfloat16,
                   lce::float16) {
  fixture<T> f;
  const auto all = {entry::forward, entry::forward_entropy, entry::backward, entry::backward_entropy,
                    entry::forward_backward};

  SUBCASE("hidden cols != weight cols") {
    f.w_cols = 11;
    f.w_ld = 11;
    f.gw_cols = 11;
    f.gw_ld = 11;
    f.expect_error(all, {{"hidden", "weight"}, {"13"}, {"11"}});
  }
  SUBCASE("targets size != N") {
    f.y_size = 22;
    f.expect_error(all, {{"targets"}, {"22"}, {"23"}});
  }
  SUBCASE("logprobs size != N") {
    f.lp_size = 21;
    f.expect_error({entry::forward, entry::forward_entropy, entry::forward_backward}, {{"logprobs"}, {"21"}, {"23"}});
  }
  SUBCASE("lse size != N") {
    f.lse_size = 24;
    f.expect_error({entry::forward, entry::forward_entropy, entry::backward, entry::backward_entropy},
                   {{"lse"}, {"24"}, {"23"}});
  }
  SUBCASE("entropy size != N") {
    f.ent_size = 19;
    f.expect_error({entry::forward_entropy}, {{"entropy"}, {"19"}, {"23"}});
  }
  SUBCASE("grad_logprobs size != N") {
    f.glp_size = 18;
    f.expect_error({entry::backward, entry::backward_entropy, entry::forward_backward},
                   {{"grad_logprobs"}, {"18"}, {"23"}});
  }
  SUBCASE("grad_entropy size != N") {
    f.gent_size = 17;
    f.expect_error({entry::backward_entropy}, {{"grad_entropy"}, {"17"}, {"23"}});
  }
  SUBCASE("grad_hidden rows != N") {
    f.gh_rows = 16;
    f.expect_error({entry::backward, entry::backward_entropy, entry::forward_backward},
                   {{"grad_hidden"}, {"16"}, {"23"}});
  }
  SUBCASE("grad_hidden cols != H") {
    f.gh_cols = 12;
    f.gh_ld = 12;
    f.expect_error({entry::backward, entry::backward_entropy, entry::forward_backward},
                   {{"grad_hidden"}, {"12"}, {"13"}});
  }
  SUBCASE("grad_weight rows != V") {
    f.gw_rows = 6;
    f.expect_error({entry::backward, entry::backward_entropy, entry::forward_backward},
                   {{"grad_weight"}, {"6"}, {"7"}});
  }
  SUBCASE("grad_weight cols != H") {
    f.gw_cols = 14;
    f.gw_ld = 14;
    f.expect_error({entry::backward, entry::backward_entropy, entry::forward_backward},
                   {{"grad_weight"}, {"14"}, {"13"}});
  }
  cases::bad_target_subcases(f, all);
  SUBCASE("hidden ld < cols") {
    f.x_ld = 12;
    f.expect_error(all, {{"hidden"}, {"12"}, {"13"}});
  }
  SUBCASE("weight ld < cols") {
    f.w_ld = 10;
    f.expect_error(all, {{"weight"}, {"10"}, {"13"}});
  }
  SUBCASE("grad_hidden ld < cols") {
    f.gh_ld = 9;
    f.expect_error({entry::backward, entry::backward_entropy, entry::forward_backward},
                   {{"grad_hidden"}, {"9"}, {"13"}});
  }
  SUBCASE("grad_weight ld < cols") {
    f.gw_ld = 8;
    f.expect_error({entry::backward, entry::backward_entropy, entry::forward_backward},
                   {{"grad_weight"}, {"8"}, {"13"}});
  }
  SUBCASE("temperature == 0") {
    f.opt.temperature = 0.0f;
    f.expect_error(all, {{"temperature"}, {"0"}});
  }
  SUBCASE("temperature < 0") {
    f.opt.temperature = -0.5f;
    f.expect_error(all, {{"temperature"}, {"-0.5"}});
  }
  SUBCASE("temperature NaN") {
    f.opt.temperature = std::numeric_limits<float>::quiet_NaN();
    f.expect_error(all, {{"temperature"}, {"nan"}});
  }
  SUBCASE("negative softcap") {
    f.opt.softcap = -2.5f;
    f.expect_error(all, {{"softcap"}, {"-2.5"}});
  }
  // Subnormal: > 0, but the reciprocal that scales the logits overflows (NaN logits).
  SUBCASE("subnormal temperature") {
    f.opt.temperature = std::numeric_limits<float>::denorm_min();
    f.expect_error(all, {{"temperature"}, {"normal float"}, {"got 1e-45"}});
  }
  SUBCASE("subnormal softcap") {
    f.opt.softcap = std::numeric_limits<float>::denorm_min();
    f.expect_error(all, {{"softcap"}, {"normal float"}, {"got 1e-45"}});
  }
  SUBCASE("the largest subnormal temperature, named apart from FLT_MIN") {
    f.opt.temperature = std::nextafter(std::numeric_limits<float>::min(), 0.0f);
    f.expect_error(all, {{"temperature"}, {"got 1.1754942e-38"}});
  }
  SUBCASE("max_logits_share outside [0, 1]") {
    f.opt.max_logits_share = 1.5f;
    f.expect_error(all, {{"max_logits_share"}, {"1.5"}});
  }
  SUBCASE("max_logits_share just over 1, named as passed") {
    f.opt.max_logits_share = std::nextafter(1.0f, 2.0f);
    f.expect_error(all, {{"max_logits_share"}, {"got 1.0000001"}});
  }
  SUBCASE("max_logits_share NaN") {
    f.opt.max_logits_share = std::numeric_limits<float>::quiet_NaN();
    f.expect_error(all, {{"max_logits_share"}, {"nan"}});
  }
  SUBCASE("negative chunk_tokens") {
    f.opt.chunk_tokens = -3;
    f.expect_error(all, {{"chunk_tokens"}, {"-3"}});
  }
  SUBCASE("vocab_start != 0 with one rank") {
    f.opt.vocab_start = 4242;
    f.expect_error(all, {{"vocab_start"}, {"4242"}});
  }
  SUBCASE("negative vocab_start with one rank") {
    f.opt.vocab_start = -5;
    f.expect_error(all, {{"vocab_start"}, {"-5"}});
  }
}

// Aliasing needs pointers into the buffers that expect_error rebuilds, so it
// has its own driver: build once, alias, call each entry point on fresh copies.
namespace {
template <class T>
void expect_alias_error(fixture<T>& f, entry e, const std::function<void(fixture<T>&)>& alias, const needles& must) {
  INFO("entry point: " << std::string(entry_name(e)));
  f.lp_ptr = nullptr;
  f.lse_ptr = nullptr;
  f.gh_ptr = nullptr;
  f.gw_ptr = nullptr;
  f.build();
  alias(f);
  const auto before = f.snapshot();
  std::optional<std::string> msg;
  try {
    f.invoke(e);
  } catch (const lce::error& err) {
    msg = err.what();
  } catch (const std::exception& err) {
    FAIL_CHECK("threw something other than lce::error: " << err.what());
    return;
  }
  if (!msg) {
    FAIL_CHECK("no lce::error thrown for an aliased output");
    return;
  }
  INFO("message: " << *msg);
  const std::string m = lower(*msg);
  for (const auto& alternatives : must) {
    bool found = false;
    for (const auto& s : alternatives) found = found || m.find(lower(s)) != std::string::npos;
    CHECK_MESSAGE(found, "message lacks '" << alternatives.front() << "'");
  }
  const auto after = f.snapshot();
  for (std::size_t k = 0; k < before.size(); ++k)
    CHECK_MESSAGE(before[k] == after[k], "buffer '" << std::string(fixture<T>::buffer_name(k)) << "' was modified");
}
}  // namespace

TEST_CASE_TEMPLATE("errors: an output aliasing an input", T, float, double, lce::bfloat16, lce::float16) {
  fixture<T> f;
  using O = out_t<T>;
  if constexpr (std::is_same_v<O, T>) {
    SUBCASE("logprobs points at hidden") {
      for (entry e : {entry::forward, entry::forward_entropy, entry::forward_backward})
        expect_alias_error<T>(f, e, [](fixture<T>& g) { g.lp_ptr = g.X.ptr(); }, {{"logprobs"}});
    }
    SUBCASE("logprobs points into the middle of hidden") {
      for (entry e : {entry::forward, entry::forward_entropy, entry::forward_backward})
        expect_alias_error<T>(f, e, [](fixture<T>& g) { g.lp_ptr = g.X.ptr() + 5; }, {{"logprobs"}});
    }
    SUBCASE("lse points into weight") {
      for (entry e : {entry::forward, entry::forward_entropy})
        expect_alias_error<T>(f, e, [](fixture<T>& g) { g.lse_ptr = g.W.ptr() + 3; }, {{"lse"}});
    }
  }
  SUBCASE("grad_hidden aliases hidden") {
    for (entry e : {entry::backward, entry::backward_entropy, entry::forward_backward})
      expect_alias_error<T>(f, e, [](fixture<T>& g) { g.gh_ptr = g.X.ptr(); }, {{"grad_hidden"}});
  }
  SUBCASE("grad_weight aliases weight") {
    for (entry e : {entry::backward, entry::backward_entropy, entry::forward_backward})
      expect_alias_error<T>(f, e, [](fixture<T>& g) { g.gw_ptr = g.W.ptr(); }, {{"grad_weight"}});
  }
}

#ifdef LCE_T_CUDA_MDSPAN
namespace {
template <class Op, class... A>
concept forward_callable = requires(Op& op, A... a) { op.forward(a...); };
template <class Op, class... A>
concept backward_callable = requires(Op& op, A... a) { op.backward(a...); };
}  // namespace

TEST_CASE("errors: non-unit inner stride (cuda::std::mdspan layout_stride / layout_left)") {
  using ext2 = cuda::std::dextents<std::int64_t, 2>;
  using ext1 = cuda::std::dextents<std::int64_t, 1>;
  const std::int64_t n = 6, h = 5, v = 9;
  problem p = make_problem(n, h, v, 5, round_to_float);
  // hidden stored with every other element: strides {2h, 2}
  std::vector<float> xs(static_cast<std::size_t>(2 * n * h), 0.0f);
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t k = 0; k < h; ++k) xs[i * 2 * h + 2 * k] = static_cast<float>(p.x[i * h + k]);
  const auto W = make_matrix<float>(p.w, v, h);
  const auto Y = make_targets<std::int64_t>(p.y);
  vector_buf<float> lp(n), lse(n), G(std::vector<double>(n, -1.0));
  for (std::int64_t i = 0; i < n; ++i) {
    lp.set(i, 100.0 + i);
    lse.set(i, 3.0);
  }
  const auto lp_before = lp.bytes(), lse_before = lse.bytes();

  using strided = cuda::std::mdspan<const float, ext2, cuda::std::layout_stride>;
  const strided Xs(xs.data(), cuda::std::layout_stride::mapping<ext2>(ext2(n, h), cuda::std::array<std::int64_t, 2>{2 * h, 2}));
  const cuda::std::mdspan<const float, ext2> Wm(W.ptr(), v, h);
  const cuda::std::mdspan<const std::int64_t, ext1> Ym(Y.ptr(), n);
  const cuda::std::mdspan<float, ext1> LPm(lp.ptr(), n), LSEm(lse.ptr(), n);
  auto op = make_op<float>(lce::options{});

  SUBCASE("hidden with layout_stride, inner stride 2") {
    if constexpr (forward_callable<decltype(op), strided, decltype(Wm), decltype(Ym), decltype(LPm), decltype(LSEm)>) {
      try {
        op.forward(Xs, Wm, Ym, LPm, LSEm);
        FAIL_CHECK("no lce::error for a non-unit inner stride");
      } catch (const lce::error& e) {
        const std::string what = e.what();
        INFO("message: " << what);
        CHECK(lower(e.what()).find("hidden") != std::string::npos);
        CHECK(lower(e.what()).find("2") != std::string::npos);
      }
      CHECK(lp.bytes() == lp_before);
      CHECK(lse.bytes() == lse_before);
    } else {
      MESSAGE("layout_stride hidden rejected at compile time (acceptable)");
    }
  }
  SUBCASE("weight with layout_left") {
    std::vector<float> wl(static_cast<std::size_t>(v * h));
    for (std::int64_t j = 0; j < v; ++j)
      for (std::int64_t k = 0; k < h; ++k) wl[k * v + j] = static_cast<float>(p.w[j * h + k]);
    using left = cuda::std::mdspan<const float, ext2, cuda::std::layout_left>;
    const left Wl(wl.data(), v, h);
    const cuda::std::mdspan<const float, ext2> Xm(xs.data(), n, h);
    if constexpr (forward_callable<decltype(op), decltype(Xm), left, decltype(Ym), decltype(LPm), decltype(LSEm)>) {
      try {
        op.forward(Xm, Wl, Ym, LPm, LSEm);
        FAIL_CHECK("no lce::error for a layout_left weight");
      } catch (const lce::error& e) {
        const std::string what = e.what();
        INFO("message: " << what);
        CHECK(lower(e.what()).find("weight") != std::string::npos);
      }
      CHECK(lp.bytes() == lp_before);
      CHECK(lse.bytes() == lse_before);
    } else {
      MESSAGE("layout_left weight rejected at compile time (acceptable)");
    }
  }
  SUBCASE("grad_hidden with layout_stride, inner stride 2") {
    std::vector<float> ghs(static_cast<std::size_t>(2 * n * h), -5.0f), gw(static_cast<std::size_t>(v * h), 0.5f);
    const auto ghs_before = ghs, gw_before = gw;
    using mstrided = cuda::std::mdspan<float, ext2, cuda::std::layout_stride>;
    const mstrided GHs(ghs.data(), cuda::std::layout_stride::mapping<ext2>(ext2(n, h), cuda::std::array<std::int64_t, 2>{2 * h, 2}));
    const cuda::std::mdspan<float, ext2> GWm(gw.data(), v, h);
    const auto X = make_matrix<float>(p.x, n, h);
    const cuda::std::mdspan<const float, ext2> Xm(X.ptr(), n, h);
    const cuda::std::mdspan<const float, ext1> LSEc(lse.ptr(), n), Gm(G.ptr(), n);
    if constexpr (backward_callable<decltype(op), decltype(Xm), decltype(Wm), decltype(Ym), decltype(LSEc),
                                    decltype(Gm), mstrided, decltype(GWm)>) {
      try {
        op.backward(Xm, Wm, Ym, LSEc, Gm, GHs, GWm);
        FAIL_CHECK("no lce::error for a non-unit inner stride grad_hidden");
      } catch (const lce::error& e) {
        const std::string what = e.what();
        INFO("message: " << what);
        CHECK(lower(e.what()).find("grad_hidden") != std::string::npos);
      }
      CHECK(ghs == ghs_before);
      CHECK(gw == gw_before);
    } else {
      MESSAGE("layout_stride grad_hidden rejected at compile time (acceptable)");
    }
  }
}
#endif
