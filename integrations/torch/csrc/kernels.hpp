#pragma once
// The kernels of the lce:: torch ops, one set per (dtype, device): each
// builds lce views on the tensors' storage, takes the operator for (dtype,
// options, group, device) from the device's per-thread cache and returns the
// prepared lce call. Declared here for register.cpp; defined in
// kernel_bodies.hpp and instantiated per device and dtype, in parallel
// translation units: ops_full.cpp (float, double), ops_half.cpp (bfloat16,
// float16) on the CPU; cuda_ops.cu (float, bfloat16, float16) on CUDA, where
// lce_torch is built with CUDA (LCE_TORCH_WITH_CUDA).

#include "tensor_views.hpp"

#include <ATen/ATen.h>

#include <functional>
#include <optional>
#include <tuple>

namespace lce_torch {

struct cpu_device;   // cpu_device.hpp
struct cuda_device;  // cuda_device.cuh

template <class TorchT, class Device>
struct kernels {
  using T = typename lce_type_of<TorchT>::type;
  using R = std::conditional_t<std::is_same_v<T, double>, double, float>;

  // Each returns the prepared call: every local check and allocation is done
  // (and may raise) before it returns; the call itself makes lce's one
  // exchange with the other ranks and the sweep. All of them use lce's
  // row-term forms (lce::row_outputs / lce::row_gradients).

  // Every kernel takes the head's optional bias [V_r] (weight's dtype; absent:
  // none), and those with gradients return grad_bias [V_r] in its dtype, or
  // [0] without a bias.

  // -> (logprobs, lse, entropy, mean_logit) shaped as targets; entropy and
  // mean_logit are [0] when not asked for.
  static std::function<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>()> forward(
      const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
      const std::optional<at::Tensor>& bias, bool with_entropy, bool with_mean_logit, const config& c);

  // -> (grad_hidden shaped as hidden, grad_weight [V_r, H], grad_bias) in the
  // inputs' dtype, for dL/d(logprobs, entropy, lse, mean_logit); the optional
  // ones count as 0. lse is a real value on ignored tokens too, so grad_lse
  // applies there (the others are 0 there: log-prob, entropy and mean logit
  // are reported 0).
  static std::function<std::tuple<at::Tensor, at::Tensor, at::Tensor>()> backward(
      const at::Tensor& grad_logprobs, const std::optional<at::Tensor>& grad_entropy, const at::Tensor& hidden,
      const at::Tensor& weight, const at::Tensor& targets, const at::Tensor& lse,
      const std::optional<at::Tensor>& grad_lse, const std::optional<at::Tensor>& grad_mean_logit,
      const std::optional<at::Tensor>& bias, const config& c);

  // One sweep: -> (logprobs, grad_hidden, grad_weight, lse, mean_logit,
  // grad_bias) for dL/d(logprobs, lse, mean_logit) known up front (ignored
  // tokens: no gradient, as in lce); mean_logit is [0] unless with_mean_logit.
  static std::function<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>()>
  forward_backward(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                   const at::Tensor& grad_logprobs, const std::optional<at::Tensor>& grad_lse,
                   const std::optional<at::Tensor>& grad_mean_logit, const std::optional<at::Tensor>& bias,
                   bool with_mean_logit, const config& c);

  // Target sets (lce's target_set_outputs / target_set_gradients): ids
  // [..., K] (K ids per token) instead of targets [...]; the log-probs and
  // their gradient are [..., K], the row terms [...].

  // -> (logprobs [..., K], lse [...], entropy [...] or [0], mean_logit [...] or [0]).
  static std::function<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>()> set_forward(
      const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& ids, const std::optional<at::Tensor>& bias,
      bool with_entropy, bool with_mean_logit, const config& c);

  // -> (grad_hidden, grad_weight, grad_bias) for dL/d(logprobs [..., K], entropy, lse, mean_logit).
  static std::function<std::tuple<at::Tensor, at::Tensor, at::Tensor>()> set_backward(
      const at::Tensor& grad_logprobs, const std::optional<at::Tensor>& grad_entropy, const at::Tensor& hidden,
      const at::Tensor& weight, const at::Tensor& ids, const at::Tensor& lse,
      const std::optional<at::Tensor>& grad_lse, const std::optional<at::Tensor>& grad_mean_logit,
      const std::optional<at::Tensor>& bias, const config& c);
};


extern template struct kernels<float, cpu_device>;
extern template struct kernels<double, cpu_device>;
extern template struct kernels<c10::BFloat16, cpu_device>;
extern template struct kernels<c10::Half, cpu_device>;
#if LCE_TORCH_WITH_CUDA
extern template struct kernels<float, cuda_device>;
extern template struct kernels<c10::BFloat16, cuda_device>;
extern template struct kernels<c10::Half, cuda_device>;
#endif

}  // namespace lce_torch
