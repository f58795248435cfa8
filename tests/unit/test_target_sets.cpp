// Target sets: targets [N, K] (a teacher's top-K), K log-probs per token and
// their gradients. The typed bodies (cases/target_set_cases.hpp) also run on
// the CUDA backend (tests/cuda/test_cuda_backend.cu).
#include "cases/target_set_cases.hpp"

using namespace lce_test;
using namespace lce_test::cases;

TEST_CASE_TEMPLATE("target sets: forward gives each id's log-prob, lse and entropy", T, float, double, lce::bfloat16,
                   lce::float16) {
  target_sets_forward<host_env, T>();
}

TEST_CASE_TEMPLATE("target sets: backward and forward_backward match the materialised gradient", T, float, double,
                   lce::bfloat16) {
  target_sets_gradients<host_env, T>();
}

TEST_CASE("target sets of one id equal the single-target calls") {
  const std::int64_t n = 17, h = 16, v = 64;
  problem p = make_problem(n, h, v, 81, rounder_for<float>(), 1.5, 0.5);
  auto op = make_op<float>(make_options(0.9f, 5.0f, 4));
  const auto X = make_matrix<float>(p.x, n, h);
  const auto W = make_matrix<float>(p.w, v, h);
  const auto Y1 = make_targets<std::int64_t>(p.y);
  const auto YK = make_id_matrix<std::int64_t>(p.y, n, 1);
  vector_buf<float> lp(n), lse(n), ent(n), g(random_vector(n, 82, -1, 1));
  matrix_buf<float> lpk(n, 1);
  vector_buf<float> lsek(n), entk(n);
  op.forward(X.cview(), W.cview(), Y1.cview(), lp.view(), lse.view(), ent.view());
  op.forward(X.cview(), W.cview(), YK.cview(), lce::target_set_outputs<float>{lpk.view(), lsek.view(), entk.view(), {}});
  for (std::int64_t i = 0; i < n; ++i) {
    CHECK(lpk.get(i, 0) == doctest::Approx(lp.get(i)).epsilon(1e-6));
    CHECK(lsek.get(i) == lse.get(i));
    CHECK(entk.get(i) == ent.get(i));
  }
  matrix_buf<float> gh(n, h), gw(v, h), ghk(n, h), gwk(v, h);
  gw.fill(0.0f);
  gwk.fill(0.0f);
  op.backward(X.cview(), W.cview(), Y1.cview(), lse.cview(), g.cview(), gh.view(), gw.view());
  const lce::matrix_view<const float> gk{g.ptr(), n, 1, 1};
  op.backward(X.cview(), W.cview(), YK.cview(), lse.cview(), lce::target_set_gradients<float>{gk, {}, {}, {}},
              ghk.view(), gwk.view());
  for (std::int64_t e = 0; e < n * h; ++e)
    CHECK(ghk.get(e / h, e % h) == doctest::Approx(gh.get(e / h, e % h)).epsilon(1e-5));
  for (std::int64_t e = 0; e < v * h; ++e)
    CHECK(gwk.get(e / h, e % h) == doctest::Approx(gw.get(e / h, e % h)).epsilon(1e-5));
}

TEST_CASE("target sets: bad shapes and ids raise lce::error naming them, outputs untouched") {
  const std::int64_t n = 6, h = 8, v = 20, k = 3;
  problem p = make_problem(n, h, v, 91, rounder_for<float>());
  auto ids = make_sets(p, k, 92);
  auto op = make_op<float>(make_options());
  const auto X = make_matrix<float>(p.x, n, h);
  const auto W = make_matrix<float>(p.w, v, h);
  matrix_buf<float> lp(n, k);
  vector_buf<float> lse(n);
  const auto before = lp.bytes();
  const auto raises = [&](const auto& targets, const lce::target_set_outputs<float>& out, const char* needle) {
    CAPTURE(needle);
    try {
      op.forward(X.cview(), W.cview(), targets, out);
      FAIL("no lce::error");
    } catch (const lce::error& e) {
      CAPTURE(e.what());
      CHECK(std::string(e.what()).find(needle) != std::string::npos);
    }
    CHECK(lp.bytes() == before);
  };
  const auto Y = make_id_matrix<std::int64_t>(ids, n, k);
  matrix_buf<std::int64_t> strided(n, k, k + 1);  // a leading dimension past K
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t e = 0; e < k; ++e) strided.at(i, e) = ids[static_cast<std::size_t>(i * k + e)];
  raises(strided.cview(), {lp.view(), lse.view(), {}, {}}, "must be dense rows");
  matrix_buf<float> wrong(n, k + 1);
  raises(Y.cview(), {wrong.view(), lse.view(), {}, {}}, "logprobs: [6, 4] does not match the targets' [6, 3]");
  ids[7] = v;
  const auto Ybad = make_id_matrix<std::int64_t>(ids, n, k);
  raises(Ybad.cview(), {lp.view(), lse.view(), {}, {}}, "targets[2, 1] = 20 is outside the vocabulary [0, 20)");
  const matrix_buf<std::int64_t> empty(n, 0);
  raises(empty.cview(), {lp.view(), lse.view(), {}, {}}, "needs K >= 1 ids per token");
  const auto Yshort = make_id_matrix<std::int64_t>(ids, n - 1, k);
  raises(Yshort.cview(), {lp.view(), lse.view(), {}, {}}, "logprobs: [6, 3] does not match the targets' [5, 3]");
  vector_buf<float> short_lse(n - 1);
  raises(Y.cview(), {lp.view(), short_lse.view(), {}, {}}, "lse");
}
