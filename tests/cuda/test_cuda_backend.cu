// lce::cuda_backend against the CPU suite's references and tolerances: the
// typed bodies of tests/cases/*.hpp (the same functions tests/unit/*.cpp run
// on the host) through the device mirror of tests/cuda/device_env.cuh, for
// float, bfloat16 and float16; then what only the device has: the caller's
// workspace, a workspace too small, cuda::std::mdspan over device memory.
//
// Without a CUDA device it says so and exits 77 (ctest: SKIP_RETURN_CODE).
// The nvcc build is kept lean: three element types, each body instantiated
// once per type (double runs on the host suite only: fp64 GEMMs are not
// what this backend is for, and they double the kernels to compile).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "cuda/device_env.cuh"

#include "cases/backward_cases.hpp"
#include "cases/bias_cases.hpp"
#include "cases/edge_cases.hpp"
#include "cases/error_cases.hpp"
#include "cases/forward_cases.hpp"
#include "cases/overwrite_cases.hpp"
#include "cases/target_set_cases.hpp"
#include "cases/vocabulary_order_cases.hpp"

#include <cuda/std/mdspan>

#include <cstdio>

using namespace lce_test;

#define LCE_CUDA_TYPES float, lce::bfloat16, lce::float16

// ---------------------------------------------------------------------------
// The CPU suite's bodies
// ---------------------------------------------------------------------------
TEST_CASE_TEMPLATE("cuda: forward matches the materialised reference", T, LCE_CUDA_TYPES) {
  cases::forward_matches_reference<cuda_env, T>();
}

TEST_CASE_TEMPLATE("cuda: forward: ignored tokens give exactly zero log-prob and entropy", T, LCE_CUDA_TYPES) {
  cases::forward_ignored_tokens_zero<cuda_env, T>();
}

TEST_CASE_TEMPLATE("cuda: backward matches the reference gradients", T, LCE_CUDA_TYPES) {
  cases::backward_matches_reference<cuda_env, T>();
}

TEST_CASE_TEMPLATE("cuda: forward_backward matches the reference", T, LCE_CUDA_TYPES) {
  cases::forward_backward_matches_reference<cuda_env, T>();
}

TEST_CASE_TEMPLATE("cuda: forward_backward equals forward then backward", T, LCE_CUDA_TYPES) {
  cases::forward_backward_equals_two_calls<cuda_env, T>();
}

TEST_CASE_TEMPLATE("cuda: gradients over a vocabulary of several GEMM tiles", T, float, lce::bfloat16) {
  cases::gradients_over_several_tiles<cuda_env, T>();
}

TEST_CASE_TEMPLATE("cuda: all tokens ignored: zero log-probs, entropies and gradients; grad_weight untouched", T,
                   LCE_CUDA_TYPES) {
  cases::all_tokens_ignored<cuda_env, T>();
}

TEST_CASE_TEMPLATE("cuda: strided hidden, weight, grad_hidden, grad_weight: correct, padding untouched", T,
                   LCE_CUDA_TYPES) {
  cases::strided_buffers<cuda_env, T>();
}

TEST_CASE_TEMPLATE("cuda: int32 and int64 targets give identical results", T, LCE_CUDA_TYPES) {
  cases::int32_and_int64_targets<cuda_env, T>();
}

TEST_CASE_TEMPLATE("cuda: a NaN logit makes its tokens' lse, log-prob, entropy and gradients NaN", T,
                   LCE_CUDA_TYPES) {
  cases::nan_logit_poisons_its_row<cuda_env, T>();
}

TEST_CASE_TEMPLATE("cuda: target sets: forward gives each id's log-prob, lse and entropy", T, LCE_CUDA_TYPES) {
  lce_test::cases::target_sets_forward<lce_test::cuda_env, T>();
}

TEST_CASE_TEMPLATE("cuda: target sets: backward and forward_backward match the materialised gradient", T,
                   LCE_CUDA_TYPES) {
  lce_test::cases::target_sets_gradients<lce_test::cuda_env, T>();
}

TEST_CASE_TEMPLATE("cuda: vocabulary order: forward, backward with entropy and forward_backward equal the reference",
                   T, lce::bfloat16, lce::float16) {
  cases::vocabulary_order::matches_reference<cuda_env, T>();
}

TEST_CASE_TEMPLATE("cuda: overwrite_weight_gradients: grad_weight written over (NaN before) on every path", T,
                   LCE_CUDA_TYPES) {
  cases::overwrite::matches_reference<cuda_env, T>();
}

TEST_CASE_TEMPLATE("cuda: overwrite_weight_gradients: grad_bias too, and a call with no tokens zeroes both", T,
                   LCE_CUDA_TYPES) {
  cases::overwrite::bias_and_empty_calls<cuda_env, T>();
}

// Its compute-type dW GEMM takes beta 0: the first chunk writes a float grad_weight, and a
// forward_backward may keep its logits there.
static_assert(lce::overwrites_compute_weight_gradient<lce::cuda_backend, float, float>);

TEST_CASE("cuda: overwrite_weight_gradients: a forward_backward keeps its logits in grad_weight between its sweeps") {
  cases::overwrite::logits_kept_in_grad_weight<cuda_env, float>();
}

TEST_CASE_TEMPLATE("cuda: with_bias: forward, backward and forward_backward equal the head with the bias as a column",
                   T, LCE_CUDA_TYPES) {
  cases::bias::matches_bias_as_a_column<cuda_env, T>();
}

TEST_CASE_TEMPLATE("cuda: with_bias: a bias of -inf masks its columns: the head without them, entropy included", T,
                   LCE_CUDA_TYPES) {
  cases::bias::masks_columns<cuda_env, T>();
}

TEST_CASE_TEMPLATE("cuda: errors: the fixture itself is valid", T, LCE_CUDA_TYPES) {
  cases::fixture<T, cuda_env> f;
  for (cases::entry e : cases::all_entries) f.expect_ok(e);
}

TEST_CASE_TEMPLATE("cuda: errors: bad target ids raise lce::error naming targets[i]; nothing written", T,
                   LCE_CUDA_TYPES) {
  cases::fixture<T, cuda_env> f;
  const auto all = {cases::entry::forward, cases::entry::forward_entropy, cases::entry::backward,
                    cases::entry::backward_entropy, cases::entry::forward_backward};
  cases::bad_target_subcases(f, all);
}

// ---------------------------------------------------------------------------
// The caller's workspace (cuda_backend_options::workspace)
// ---------------------------------------------------------------------------
TEST_CASE_TEMPLATE("cuda: a caller workspace of workspace_bytes serves every entry point", T, float,
                   lce::bfloat16) {
  using O = out_t<T>;
  // Several chunks; T grads need the fp32 dW accumulator, carved from the
  // same buffer after the sweep's scratch.
  problem p = make_problem(23, 40, 301, 77, rounder_for<T>(), 1.0, 1.0, 0.15);
  p.tau = 0.9f;
  p.cap = 8.0f;
  const auto opt = make_options(p.tau, p.cap, 6);
  const auto g = random_vector(p.n, 78, -1, 1, rounder_for<O>());
  const auto hg = random_vector(p.n, 79, -0.5, 0.5, rounder_for<O>());
  const std::size_t bytes = device_op<T>(opt).workspace_bytes(p.n, p.h, p.v);
  REQUIRE(bytes > 0);
  CAPTURE(bytes);
  device_buffer workspace(bytes);
  device_op<T> op(opt, lce::cuda_backend_options{.workspace = workspace.pointer, .workspace_bytes = bytes});
  REQUIRE(op.device().comm().size() == 1);
  {
    INFO("gradients of element float");
    const auto pre = random_vector(p.v * p.h, 80, -1, 1, rounder_for<float>());
    check_against_reference(exercise<T, float>(op, p, g, hg, pre), p, g, hg, pre,
                            cuda_env::gradient_operand_unit<T>, cuda_env::gradient_operand_floor<T>);
  }
  if constexpr (!std::is_same_v<T, float>) {
    INFO("gradients of element T (fp32 accumulator from the caller's workspace)");
    const auto pre = random_vector(p.v * p.h, 81, -1, 1, rounder_for<T>());
    check_against_reference(exercise<T, T>(op, p, g, hg, pre), p, g, hg, pre, cuda_env::gradient_operand_unit<T>,
                            cuda_env::gradient_operand_floor<T>);
  }
}

TEST_CASE_TEMPLATE("cuda: a caller workspace too small raises lce::error and writes nothing", T, float,
                   lce::bfloat16) {
  using O = out_t<T>;
  problem p = make_problem(23, 40, 301, 91, rounder_for<T>(), 1.0, 1.0, 0.15);
  const auto opt = make_options(1.0f, 0.0f, 6);
  const std::size_t bytes = device_op<T>(opt).workspace_bytes(p.n, p.h, p.v);
  const auto X = make_matrix<T>(p.x, p.n, p.h);
  const auto W = make_matrix<T>(p.w, p.v, p.h);
  const auto Y = make_targets<std::int64_t>(p.y);
  // A forward holds only the sweep's scratch: workspace_bytes also counts a 2-byte
  // grad_weight's fp32 accumulator, so half of it may still hold a forward.
  std::size_t forward_bytes = 0;
  {
    device_op<T> probe(opt);
    vector_buf<O> lp(p.n), lse(p.n), ent(p.n);
    probe.forward(X.cview(), W.cview(), Y.cview(), lp.view(), lse.view(), ent.view());
    forward_bytes = probe.held_workspace_bytes();
  }
  REQUIRE(forward_bytes > 64);
  REQUIRE(forward_bytes <= bytes);
  device_buffer workspace(bytes);
  for (const std::size_t given : {forward_bytes / 2, std::size_t{64}}) {
    CAPTURE(given);
    device_op<T> op(opt, lce::cuda_backend_options{.workspace = workspace.pointer, .workspace_bytes = given});
    vector_buf<O> lp(p.n), lse(p.n), ent(p.n), G(random_vector(p.n, 92, -1, 1, rounder_for<O>()));
    lp.fill(garbage<O>());
    lse.fill(garbage<O>());
    ent.fill(garbage<O>());
    matrix_buf<T> gh(p.n, p.h), gw(p.v, p.h);
    gh.fill(garbage<T>());
    gw.fill_from(random_vector(p.v * p.h, 93, -1, 1, rounder_for<T>()));
    const auto before = std::vector<std::vector<unsigned char>>{lp.bytes(), lse.bytes(), ent.bytes(), gh.bytes(),
                                                                gw.bytes()};
    auto expect_workspace_error = [&](auto&& call) {
      std::string message;
      try {
        call();
      } catch (const lce::error& e) {
        message = e.what();
      }
      INFO("message: " << message);
      CHECK_MESSAGE(!message.empty(), "no lce::error from a workspace of " << given << " bytes (needs " << bytes
                                                                           << ")");
      CHECK(message.find("workspace") != std::string::npos);
      const auto after = std::vector<std::vector<unsigned char>>{lp.bytes(), lse.bytes(), ent.bytes(), gh.bytes(),
                                                                 gw.bytes()};
      CHECK_MESSAGE(before == after, "an output was written by a call that raised");
    };
    expect_workspace_error([&] { op.forward(X.cview(), W.cview(), Y.cview(), lp.view(), lse.view(), ent.view()); });
    expect_workspace_error(
        [&] { op.forward_backward(X.cview(), W.cview(), Y.cview(), G.cview(), lp.view(), gh.view(), gw.view()); });
  }
}

// ---------------------------------------------------------------------------
// cuda::std::mdspan over device memory
// ---------------------------------------------------------------------------
TEST_CASE_TEMPLATE("cuda: cuda::std::mdspan device views give the results of matrix_view", T, float,
                   lce::bfloat16) {
  using O = out_t<T>;
  using ext2 = cuda::std::dextents<std::int64_t, 2>;
  using ext1 = cuda::std::dextents<std::int64_t, 1>;
  problem p = make_problem(17, 12, 45, 101, rounder_for<T>(), 1.0, 1.0, 0.2);
  p.tau = 0.8f;
  const auto opt = make_options(p.tau, 0.0f, 5);
  const std::int64_t ldx = p.h + 4;  // padded rows: layout_stride with unit inner stride
  const auto X = make_matrix<T>(p.x, p.n, p.h, ldx);
  const auto W = make_matrix<T>(p.w, p.v, p.h);
  const auto Y = make_targets<std::int32_t>(p.y);
  const auto Gv = vector_buf<O>(random_vector(p.n, 102, -1, 1, rounder_for<O>()));
  const auto pre = random_vector(p.v * p.h, 103, -1, 1, rounder_for<float>());

  // Through lce views and the mirror: the expected bytes.
  device_op<T> op(opt);
  vector_buf<O> lp_ref(p.n), lse_ref(p.n), ent_ref(p.n);
  matrix_buf<float> gh_ref(p.n, p.h), gw_ref(p.v, p.h);
  gw_ref.fill_from(pre);
  op.forward(X.cview(), W.cview(), Y.cview(), lp_ref.view(), lse_ref.view(), ent_ref.view());
  op.backward(X.cview(), W.cview(), Y.cview(), lse_ref.cview(), Gv.cview(), gh_ref.view(), gw_ref.view());

  // The same calls on mdspans the test builds over its own device buffers.
  auto upload = [](const auto* host, std::int64_t elements) {
    const auto bytes = static_cast<std::size_t>(elements) * sizeof(*host);
    device_buffer d(bytes);
    LCE_T_CUDA(cudaMemcpy(d.pointer, host, bytes, cudaMemcpyHostToDevice));
    return d;
  };
  const auto dX = upload(X.ptr(), p.n * ldx);
  const auto dW = upload(W.ptr(), p.v * p.h);
  const auto dY = upload(Y.ptr(), p.n);
  const auto dG = upload(Gv.ptr(), p.n);
  const auto dGW = upload(make_matrix<float>(pre, p.v, p.h).ptr(), p.v * p.h);
  const device_buffer dLP(p.n * sizeof(O)), dLSE(p.n * sizeof(O)), dENT(p.n * sizeof(O)),
      dGH(p.n * p.h * sizeof(float));
  // cudaMemcpy is ordered on the legacy stream only; the op runs on a non-blocking one.
  LCE_T_CUDA(cudaDeviceSynchronize());

  using strided = cuda::std::mdspan<const T, ext2, cuda::std::layout_stride>;
  const strided Xs(dX.template as<const T>(),
                   cuda::std::layout_stride::mapping<ext2>(ext2(p.n, p.h), cuda::std::array<std::int64_t, 2>{ldx, 1}));
  const cuda::std::mdspan<const T, ext2> Wm(dW.template as<const T>(), p.v, p.h);
  const cuda::std::mdspan<const std::int32_t, ext1> Ym(dY.template as<const std::int32_t>(), p.n);
  const cuda::std::mdspan<O, ext1> LP(dLP.template as<O>(), p.n), LSE(dLSE.template as<O>(), p.n), ENT(dENT.template as<O>(), p.n);
  const cuda::std::mdspan<const O, ext1> LSEc(dLSE.template as<const O>(), p.n), Gm(dG.template as<const O>(), p.n);
  const cuda::std::mdspan<float, ext2> GH(dGH.template as<float>(), p.n, p.h), GW(dGW.template as<float>(), p.v, p.h);
  op.device().forward(Xs, Wm, Ym, LP, LSE, ENT);
  op.device().backward(Xs, Wm, Ym, LSEc, Gm, GH, GW);
  LCE_T_CUDA(cudaStreamSynchronize(test_stream()));

  vector_buf<O> lp(p.n), lse(p.n), ent(p.n);
  matrix_buf<float> gh(p.n, p.h), gw(p.v, p.h);
  LCE_T_CUDA(cudaMemcpy(lp.ptr(), dLP.pointer, p.n * sizeof(O), cudaMemcpyDeviceToHost));
  LCE_T_CUDA(cudaMemcpy(lse.ptr(), dLSE.pointer, p.n * sizeof(O), cudaMemcpyDeviceToHost));
  LCE_T_CUDA(cudaMemcpy(ent.ptr(), dENT.pointer, p.n * sizeof(O), cudaMemcpyDeviceToHost));
  LCE_T_CUDA(cudaMemcpy(gh.ptr(), dGH.pointer, p.n * p.h * sizeof(float), cudaMemcpyDeviceToHost));
  LCE_T_CUDA(cudaMemcpy(gw.ptr(), dGW.pointer, p.v * p.h * sizeof(float), cudaMemcpyDeviceToHost));
  CHECK(lp.bytes() == lp_ref.bytes());
  CHECK(lse.bytes() == lse_ref.bytes());
  CHECK(ent.bytes() == ent_ref.bytes());
  CHECK(gh.bytes() == gh_ref.bytes());
  CHECK(gw.bytes() == gw_ref.bytes());
}

// ---------------------------------------------------------------------------
int main(int argc, char** argv) {
  int devices = 0;
  const cudaError_t status = cudaGetDeviceCount(&devices);
  if (status != cudaSuccess || devices == 0) {
    std::printf("lce CUDA tests: no CUDA device (cudaGetDeviceCount: %s): skipped\n",
                status != cudaSuccess ? cudaGetErrorName(status) : "0 devices");
    return 77;
  }
  doctest::Context context(argc, argv);
  return context.run();
}
