// Compile test: every loss of <lce/loss/losses.hpp> instantiated for the GPU
// (Thrust's CUDA system: thrust::cuda::par_nosync.on(stream) and
// thrust::device), from the same source the host tests run with thrust::host.
// Built wherever nvcc is (CI included); nothing here runs on a device: the
// functions are only instantiated, never called.
#include <lce/loss/losses.hpp>

#include <cuda_runtime_api.h>
#include <thrust/execution_policy.h>
#include <thrust/system/cuda/execution_policy.h>

#include <cstdint>

namespace {

template <class Policy, class R, class I, class C, class G>
void instantiate_all(Policy&& exec, const R* logp, const I* targets, const C* cu, const std::int32_t* tokens,
                     I* targets_out, const float* weights, G* grad, G* grad_entropy, double* seq_a, double* seq_b,
                     const double* seq_ref, std::int64_t* seq_tokens, const std::int64_t* pairs, std::int64_t n,
                     std::int64_t s) {
  lce::shift_targets_packed(exec, lce::vector_view<const std::int32_t>{tokens, n}, lce::vector_view<const C>{cu, s + 1},
                            lce::vector_view<I>{targets_out, n}, -100);
  (void)lce::check_cu_seqlens(exec, lce::vector_view<const C>{cu, s + 1}, n);
  const lce::packed_tokens<I, C> batch{{targets, n}, {cu, s + 1}, {weights, n}, -100};
  (void)lce::count_loss_units(exec, batch, n, lce::loss_reduction::sequence_mean);
  // SFT: gradient before the forward, then the loss
  lce::sft_grad_logprobs(exec, batch, 1.0, lce::vector_view<G>{grad, n}, lce::vector_view<std::int64_t>{seq_tokens, s},
                         lce::sft_options{lce::loss_reduction::sequence_mean});
  (void)lce::sft_loss(exec, batch, lce::vector_view<const R>{logp, n}, 1.0,
                      lce::sft_outputs<G>{{grad, n}, {seq_a, s}, {seq_tokens, s}});
  // SFT with label smoothing: the three row gradients, the loss from logp, lse and the mean logit
  lce::sft_options smoothed;
  smoothed.label_smoothing = 0.1;
  lce::sft_gradients(exec, batch, 1.0, lce::sft_row_gradients<G>{{grad, n}, {grad_entropy, n}, {grad_entropy, n}},
                     lce::vector_view<std::int64_t>{seq_tokens, s}, smoothed);
  (void)lce::sft_loss(exec, batch, lce::vector_view<const R>{logp, n}, 1.0, lce::sft_outputs<G>{}, smoothed,
                      lce::sft_smoothing_inputs<const R>{{logp, n}, {logp, n}});
  // policy gradient
  const lce::pg_inputs<R> pg_in{{logp, n}, {logp, n}, {logp, n}, {logp, n}, {logp, n}, {logp, n}};
  (void)lce::policy_gradient_loss(exec, batch, pg_in, 1.0,
                                  lce::pg_outputs<G>{{grad, n}, {grad_entropy, n}, {seq_a, s}, {seq_tokens, s}},
                                  lce::pg_options{});
  // DPO
  lce::sequence_logprobs(exec, batch, lce::vector_view<const R>{logp, n}, lce::vector_view<double>{seq_a, s},
                         lce::vector_view<std::int64_t>{seq_tokens, s}, true);
  const lce::dpo_inputs<R, std::int64_t> dpo_in{{logp, n}, {seq_ref, s}, {pairs, s}};
  (void)lce::dpo_loss(exec, batch, dpo_in, 1.0,
                      lce::dpo_outputs<G>{{grad, n}, {seq_a, s}, {seq_b, s}, {seq_tokens, s}}, lce::dpo_options{});
  // Distillation from a teacher's top-K (here K = 1: the targets as ids, logp as both log-probs)
  const lce::distill_inputs<I, const R> distill_in{{targets, n, 1}, {logp, n, 1}, {logp, n, 1}};
  (void)lce::distill_loss(exec, batch, distill_in, 1.0,
                          lce::distill_outputs<G>{{grad, n, 1}, {seq_a, s}, {seq_tokens, s}},
                          lce::distill_options{lce::loss_reduction::sequence_mean, lce::distill_tail::renormalise});
}

}  // namespace

// Pointers to device memory; never called.
void lce_loss_device_instantiations(cudaStream_t stream, void** p, std::int64_t n, std::int64_t s) {
  auto* f = static_cast<const float*>(p[0]);
  auto* d = static_cast<const double*>(p[1]);
  auto* i32 = static_cast<std::int32_t*>(p[2]);
  auto* i64 = static_cast<std::int64_t*>(p[3]);
  auto* gf = static_cast<float*>(p[4]);
  auto* gd = static_cast<double*>(p[5]);
  auto* sa = static_cast<double*>(p[6]);
  auto* sb = static_cast<double*>(p[7]);
  auto* st = static_cast<std::int64_t*>(p[8]);
  const auto on_stream = thrust::cuda::par_nosync.on(stream);
  instantiate_all(on_stream, f, i64, i32, i32, i64, f, gf, gf, sa, sb, sb, st, i64, n, s);
  instantiate_all(thrust::device, d, i32, i64, i32, i32, f, gd, gd, sa, sb, sb, st, i64, n, s);
}
