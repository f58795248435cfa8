// The lce:: torch operators: schemas (TORCH_LIBRARY) and their CPU and CUDA kernels.
// Fake (meta) kernels and autograd are registered in Python
// (lce_torch/_ops.py: torch.library.register_fake / register_autograd).
//
//   lce::logprobs                  hidden, weight, targets, bias? -> logprobs, lse, entropy, mean_logit
//   lce::logprobs_backward         grad_logprobs, grad_entropy?, hidden, weight, targets, lse,
//                                  grad_lse?, grad_mean_logit?, bias? -> grad_hidden, grad_weight, grad_bias
//   lce::logprobs_forward_backward hidden, weight, targets, grad_logprobs, grad_lse?, grad_mean_logit?, bias?
//                                  -> logprobs, grad_hidden, grad_weight, lse, mean_logit, grad_bias (one sweep)
//
//   lce::target_set_logprobs      hidden, weight, ids [..., K], bias? -> logprobs [..., K], lse, entropy, mean_logit
//   lce::target_set_logprobs_backward
//                                  grad_logprobs [..., K], grad_entropy?, hidden, weight, ids, lse,
//                                  grad_lse?, grad_mean_logit?, bias? -> grad_hidden, grad_weight, grad_bias
//   (target sets: K ids per token, e.g. a teacher's top-K; lce's target_set_outputs / _gradients)
//
// (lce's row-term forms: entropy and mean_logit are [0] unless with_entropy /
// with_mean_logit; a missing gradient counts as 0. bias: the LM head's [V_local],
// weight's dtype, lce::with_bias; grad_bias is [0] without it.)
//
// Every op takes the same keyword options: vocab_start, ignore_index,
// temperature, softcap, sequence_parallel, chunk_tokens, workspace_limit_bytes,
// max_logits_share, group_name (a torch.distributed group's name; None: one rank) and
// caller_settings (text the ranks of a group must share beyond lce's own call,
// compared in the exchange of verdicts: what the caller makes of the results,
// e.g. linear_cross_entropy's reduction; ignored without a group).

#include "kernels.hpp"
#include "forward_ad.hpp"
#include "op_tags.hpp"
#include "process_group_comm.hpp"
#include "verdicts.hpp"
#include "torch_gemm.hpp"

#include <lce/host/blas_info.hpp>

#include <torch/library.h>

#include <atomic>
#include <exception>
#include <type_traits>
#include <vector>

#ifndef LCE_TORCH_WITH_CUDA
#define LCE_TORCH_WITH_CUDA 0
#endif

namespace lce_torch {

namespace {
std::atomic<bool> keep_workspace_flag{false};
}
bool keep_workspace() { return keep_workspace_flag.load(std::memory_order_relaxed); }
void set_keep_workspace(bool keep) { keep_workspace_flag.store(keep, std::memory_order_relaxed); }

namespace {

#define LCE_TORCH_OPTIONS                                                                                        \
  "int vocab_start=0, int ignore_index=-100, float temperature=1.0, float softcap=0.0, "                        \
  "bool sequence_parallel=False, int chunk_tokens=0, int workspace_limit_bytes=268435456, "                     \
  "float max_logits_share=0.1, str? group_name=None, str caller_settings=''"

config make_config(std::int64_t vocab_start, std::int64_t ignore_index, double temperature, double softcap,
                   bool sequence_parallel, std::int64_t chunk_tokens, std::int64_t workspace_limit_bytes,
                   double max_logits_share, const std::optional<std::string>& group_name,
                   std::string caller_settings) {
  config c;
  c.vocab_start = vocab_start;
  c.ignore_index = ignore_index;
  c.temperature = temperature;
  c.softcap = softcap;
  c.sequence_parallel = sequence_parallel;
  c.chunk_tokens = chunk_tokens;
  c.workspace_limit_bytes = workspace_limit_bytes;
  c.max_logits_share = max_logits_share;
  c.group_name = group_name;
  c.caller_settings = std::move(caller_settings);
  return c;
}

enum class targets_kind { one_per_token, sets_of_k };

// targets [...] (ids [..., K]) pair with hidden's rows [..., H] token for token, so their
// leading shape is hidden's, not only their count: PyTorch raises on a [B, T] hidden
// against [T, B] targets, and so does lce_torch. Under sequence parallel hidden holds this
// rank's rows and the targets every rank's: lce checks their counts.
void check_token_shape(const at::Tensor& hidden, const at::Tensor& targets, targets_kind kind,
                       bool sequence_parallel) {
  if (sequence_parallel || hidden.dim() < 1) return;
  const auto tokens = hidden.sizes().slice(0, hidden.dim() - 1);
  if (kind == targets_kind::one_per_token) {
    TORCH_CHECK(targets.sizes() == tokens, "lce_torch: targets must have hidden's leading shape ", tokens,
                " (hidden ", hidden.sizes(), "), got ", targets.sizes());
  } else {
    TORCH_CHECK(targets.dim() >= 1 && targets.sizes().slice(0, targets.dim() - 1) == tokens,
                "lce_torch: ids must be [..., K] with hidden's leading shape ", tokens, " (hidden ",
                hidden.sizes(), "), got ", targets.sizes());
  }
}

template <class Device>
void check_inputs(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets, const config& c,
                  targets_kind kind = targets_kind::one_per_token) {
  const char* const targets_name = kind == targets_kind::one_per_token ? "targets" : "ids";
  if constexpr (std::is_same_v<Device, cpu_device>) {
    TORCH_CHECK(hidden.device().is_cpu() && weight.device().is_cpu() && targets.device().is_cpu(),
                "lce_torch: hidden, weight and targets must all be CPU tensors, got ", hidden.device(), ", ",
                weight.device(), ", ", targets.device());
  } else {
    TORCH_CHECK(hidden.device().is_cuda() && weight.device() == hidden.device() && targets.device() == hidden.device(),
                "lce_torch: hidden, weight and targets must all be on one CUDA device, got ", hidden.device(), ", ",
                weight.device(), ", ", targets.device());
    TORCH_CHECK_TYPE(hidden.scalar_type() != at::kDouble,
                     "lce_torch: float64 runs on the CPU only (gradcheck); CUDA takes float32, bfloat16 and float16");
  }
  TORCH_CHECK(hidden.dim() >= 1, "lce_torch: hidden must be [..., H], got a scalar");
  TORCH_CHECK(weight.dim() == 2, "lce_torch: weight must be [V_local, H], got ", weight.dim(), " dimensions ",
              weight.sizes());
  TORCH_CHECK_TYPE(hidden.scalar_type() == weight.scalar_type(), "lce_torch: hidden (", hidden.scalar_type(),
                   ") and weight (", weight.scalar_type(), ") must have the same dtype");
  const auto t = hidden.scalar_type();
  TORCH_CHECK_TYPE(t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf,
                   "lce_torch: hidden and weight must be float32, float64, bfloat16 or float16, got ", t);
  TORCH_CHECK_TYPE(targets.scalar_type() == at::kInt || targets.scalar_type() == at::kLong,
                   "lce_torch: ", targets_name, " must be int32 or int64, got ", targets.scalar_type());
  check_token_shape(hidden, targets, kind, c.sequence_parallel);
}

// Calls f.template operator()<TorchT>() for the dtype of hidden.
// (float64 on the CPU only: check_inputs has turned it away from CUDA.)
template <class Device, class F>
decltype(auto) dispatch(at::ScalarType t, F&& f) {
  using Wide = std::conditional_t<std::is_same_v<Device, cpu_device>, double, float>;
  switch (t) {
    case at::kFloat: return f.template operator()<float>();
    case at::kDouble: return f.template operator()<Wide>();
    case at::kBFloat16: return f.template operator()<c10::BFloat16>();
    default: return f.template operator()<c10::Half>();
  }
}

std::int64_t dtype_code(const at::Tensor& t) { return static_cast<std::int64_t>(t.scalar_type()); }

// Every local check and allocation of a call runs in `prepare` (which returns
// the prepared lce call). With a group, the ranks then exchange their verdicts,
// dtypes and device types before any of them enters lce's own exchange, so a
// rank whose arguments fail here (a dtype, a shape torch rejects, bad options,
// a group without a backend for its tensors) makes every rank raise instead of
// leaving the others waiting in a collective: it gets its own error, the
// others "lce_torch: rank r rejected its arguments"; ranks whose caller_settings
// differ raise saying so. A rank on the CPU beside
// ranks on CUDA would run other kernels with other collectives: refused too.
template <class Prepare>
auto agreed(exchange_kind kind, const config& c, const at::Tensor& hidden, Prepare&& prepare) {
  using plan_t = decltype(prepare());
  plan_t plan;
  std::exception_ptr failure;
  try {
    plan = prepare();
  } catch (...) {
    failure = std::current_exception();
  }
  if (c.group_name) {
    const process_group comm(*c.group_name, hidden.device());
    if (comm.size() > 1) {
      const auto all = exchange_verdicts(comm, !failure, kind, c.caller_settings, dtype_code(hidden),
                                         static_cast<std::int64_t>(hidden.device().type()));
      if (failure) std::rethrow_exception(failure);
      const verdict& first = all.front();
      for (int r = 1; r < comm.size(); ++r) {
        const verdict& theirs = all[static_cast<std::size_t>(r)];
        TORCH_CHECK_TYPE(theirs.first == first.first,
                         "lce_torch: hidden and weight dtypes differ across ranks: rank 0 has ",
                         static_cast<at::ScalarType>(first.first), ", rank ", r, " has ",
                         static_cast<at::ScalarType>(theirs.first), ": every rank must pass the same dtype");
        TORCH_CHECK(theirs.second == first.second, "lce_torch: the tensors' devices differ across ranks: rank 0 has ",
                    static_cast<c10::DeviceType>(first.second), ", rank ", r, " has ",
                    static_cast<c10::DeviceType>(theirs.second),
                    ": every rank must pass tensors of one device type");
      }
    }
  }
  if (failure) std::rethrow_exception(failure);
  return plan();
}

template <class Device>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> logprobs_on(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
    const std::optional<at::Tensor>& bias, bool with_entropy,
    bool with_mean_logit, std::int64_t vocab_start, std::int64_t ignore_index, double temperature, double softcap, bool sequence_parallel,
    std::int64_t chunk_tokens, std::int64_t workspace_limit_bytes, double max_logits_share,
    std::optional<std::string> group_name, std::string caller_settings) {
  const config c = make_config(vocab_start, ignore_index, temperature, softcap, sequence_parallel, chunk_tokens,
                               workspace_limit_bytes, max_logits_share, group_name, std::move(caller_settings));
  return agreed(exchange_kind::logprobs, c, hidden, [&] {
    refuse_forward_ad({hidden, weight, bias});
    check_inputs<Device>(hidden, weight, targets, c);
    return dispatch<Device>(hidden.scalar_type(), [&]<class TorchT>() {
      return kernels<TorchT, Device>::forward(hidden, weight, targets, bias, with_entropy, with_mean_logit, c);
    });
  });
}

template <class Device>
std::tuple<at::Tensor, at::Tensor, at::Tensor> logprobs_backward_on(
    const at::Tensor& grad_logprobs, const std::optional<at::Tensor>& grad_entropy, const at::Tensor& hidden,
    const at::Tensor& weight, const at::Tensor& targets, const at::Tensor& lse,
    const std::optional<at::Tensor>& grad_lse, const std::optional<at::Tensor>& grad_mean_logit,
    const std::optional<at::Tensor>& bias, std::int64_t vocab_start, std::int64_t ignore_index, double temperature, double softcap, bool sequence_parallel,
    std::int64_t chunk_tokens, std::int64_t workspace_limit_bytes, double max_logits_share,
    std::optional<std::string> group_name, std::string caller_settings) {
  const config c = make_config(vocab_start, ignore_index, temperature, softcap, sequence_parallel, chunk_tokens,
                               workspace_limit_bytes, max_logits_share, group_name, std::move(caller_settings));
  return agreed(exchange_kind::logprobs_backward, c, hidden, [&] {
    refuse_forward_ad({grad_logprobs, grad_entropy, hidden, weight, lse, grad_lse, grad_mean_logit, bias});
    check_inputs<Device>(hidden, weight, targets, c);
    return dispatch<Device>(hidden.scalar_type(), [&]<class TorchT>() {
      return kernels<TorchT, Device>::backward(grad_logprobs, grad_entropy, hidden, weight, targets, lse, grad_lse,
                                               grad_mean_logit, bias, c);
    });
  });
}

template <class Device>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> logprobs_forward_backward_on(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets, const at::Tensor& grad_logprobs,
    const std::optional<at::Tensor>& grad_lse, const std::optional<at::Tensor>& grad_mean_logit,
    const std::optional<at::Tensor>& bias, bool with_mean_logit, std::int64_t vocab_start, std::int64_t ignore_index, double temperature, double softcap, bool sequence_parallel,
    std::int64_t chunk_tokens, std::int64_t workspace_limit_bytes, double max_logits_share,
    std::optional<std::string> group_name, std::string caller_settings) {
  const config c = make_config(vocab_start, ignore_index, temperature, softcap, sequence_parallel, chunk_tokens,
                               workspace_limit_bytes, max_logits_share, group_name, std::move(caller_settings));
  return agreed(exchange_kind::logprobs_forward_backward, c, hidden, [&] {
    refuse_forward_ad({hidden, weight, grad_logprobs, grad_lse, grad_mean_logit, bias});
    check_inputs<Device>(hidden, weight, targets, c);
    return dispatch<Device>(hidden.scalar_type(), [&]<class TorchT>() {
      return kernels<TorchT, Device>::forward_backward(hidden, weight, targets, grad_logprobs, grad_lse,
                                                       grad_mean_logit, bias, with_mean_logit, c);
    });
  });
}

template <class Device>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> target_set_logprobs_on(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& ids, const std::optional<at::Tensor>& bias,
    bool with_entropy,
    bool with_mean_logit, std::int64_t vocab_start, std::int64_t ignore_index, double temperature, double softcap,
    bool sequence_parallel, std::int64_t chunk_tokens, std::int64_t workspace_limit_bytes, double max_logits_share,
    std::optional<std::string> group_name, std::string caller_settings) {
  const config c = make_config(vocab_start, ignore_index, temperature, softcap, sequence_parallel, chunk_tokens,
                               workspace_limit_bytes, max_logits_share, group_name, std::move(caller_settings));
  return agreed(exchange_kind::target_set_logprobs, c, hidden, [&] {
    refuse_forward_ad({hidden, weight, bias});
    check_inputs<Device>(hidden, weight, ids, c, targets_kind::sets_of_k);
    return dispatch<Device>(hidden.scalar_type(), [&]<class TorchT>() {
      return kernels<TorchT, Device>::set_forward(hidden, weight, ids, bias, with_entropy, with_mean_logit, c);
    });
  });
}

template <class Device>
std::tuple<at::Tensor, at::Tensor, at::Tensor> target_set_logprobs_backward_on(
    const at::Tensor& grad_logprobs, const std::optional<at::Tensor>& grad_entropy, const at::Tensor& hidden,
    const at::Tensor& weight, const at::Tensor& ids, const at::Tensor& lse,
    const std::optional<at::Tensor>& grad_lse, const std::optional<at::Tensor>& grad_mean_logit,
    const std::optional<at::Tensor>& bias, std::int64_t vocab_start, std::int64_t ignore_index, double temperature, double softcap, bool sequence_parallel,
    std::int64_t chunk_tokens, std::int64_t workspace_limit_bytes, double max_logits_share,
    std::optional<std::string> group_name, std::string caller_settings) {
  const config c = make_config(vocab_start, ignore_index, temperature, softcap, sequence_parallel, chunk_tokens,
                               workspace_limit_bytes, max_logits_share, group_name, std::move(caller_settings));
  return agreed(exchange_kind::target_set_logprobs_backward, c, hidden, [&] {
    refuse_forward_ad({grad_logprobs, grad_entropy, hidden, weight, lse, grad_lse, grad_mean_logit, bias});
    check_inputs<Device>(hidden, weight, ids, c, targets_kind::sets_of_k);
    return dispatch<Device>(hidden.scalar_type(), [&]<class TorchT>() {
      return kernels<TorchT, Device>::set_backward(grad_logprobs, grad_entropy, hidden, weight, ids, lse, grad_lse,
                                                   grad_mean_logit, bias, c);
    });
  });
}

// lce's report, with what runs this package's GEMMs (torch_gemm.hpp). Slow OpenBLAS
// kernels are no warning here when MKL runs the fp32/fp64 GEMMs instead.
std::string blas_info_line() {
  lce::blas_report report = lce::blas_info();
  report.bf16_gemm = torch_gemm::bf16_description();
  const std::string full = torch_gemm::full_precision_description();
  if (full.empty()) return report.line();
  report.slow = false;
  return report.line() + "; fp32/fp64 GEMMs: " + full;
}

}  // namespace

// Registers the five ops' kernels of one device.
template <class Device>
void impl_ops(torch::Library& m) {
  m.impl("logprobs", &logprobs_on<Device>);
  m.impl("logprobs_backward", &logprobs_backward_on<Device>);
  m.impl("logprobs_forward_backward", &logprobs_forward_backward_on<Device>);
  m.impl("target_set_logprobs", &target_set_logprobs_on<Device>);
  m.impl("target_set_logprobs_backward", &target_set_logprobs_backward_on<Device>);
}

}  // namespace lce_torch

TORCH_LIBRARY(lce, m) {
  m.def("logprobs(Tensor hidden, Tensor weight, Tensor targets, Tensor? bias=None, *, bool with_entropy=False, "
        "bool with_mean_logit=False, " LCE_TORCH_OPTIONS
        ") -> (Tensor logprobs, Tensor lse, Tensor entropy, Tensor mean_logit)",
        lce_torch::op_tags());
  m.def("logprobs_backward(Tensor grad_logprobs, Tensor? grad_entropy, Tensor hidden, Tensor weight, "
        "Tensor targets, Tensor lse, Tensor? grad_lse=None, Tensor? grad_mean_logit=None, Tensor? bias=None, *, "
        LCE_TORCH_OPTIONS ") -> (Tensor grad_hidden, Tensor grad_weight, Tensor grad_bias)",
        lce_torch::op_tags());
  m.def("logprobs_forward_backward(Tensor hidden, Tensor weight, Tensor targets, Tensor grad_logprobs, "
        "Tensor? grad_lse=None, Tensor? grad_mean_logit=None, Tensor? bias=None, *, bool with_mean_logit=False, "
        LCE_TORCH_OPTIONS
        ") -> (Tensor logprobs, Tensor grad_hidden, Tensor grad_weight, Tensor lse, Tensor mean_logit, "
        "Tensor grad_bias)",
        lce_torch::op_tags());
  m.def("target_set_logprobs(Tensor hidden, Tensor weight, Tensor ids, Tensor? bias=None, *, "
        "bool with_entropy=False, bool with_mean_logit=False, " LCE_TORCH_OPTIONS
        ") -> (Tensor logprobs, Tensor lse, Tensor entropy, Tensor mean_logit)",
        lce_torch::op_tags());
  m.def("target_set_logprobs_backward(Tensor grad_logprobs, Tensor? grad_entropy, Tensor hidden, Tensor weight, "
        "Tensor ids, Tensor lse, Tensor? grad_lse=None, Tensor? grad_mean_logit=None, Tensor? bias=None, *, "
        LCE_TORCH_OPTIONS ") -> (Tensor grad_hidden, Tensor grad_weight, Tensor grad_bias)",
        lce_torch::op_tags());
  m.def("blas_info() -> str", &lce_torch::blas_info_line);
  m.def("set_keep_workspace(bool keep) -> ()", &lce_torch::set_keep_workspace);
  m.def("set_bf16_gemm(str kernel) -> str", &lce_torch::set_bf16_gemm);
  m.def("built_with_cuda() -> bool", [] { return static_cast<bool>(LCE_TORCH_WITH_CUDA); });
}

TORCH_LIBRARY_IMPL(lce, CPU, m) { lce_torch::impl_ops<lce_torch::cpu_device>(m); }

// CUDA tensors: lce::cuda_backend on the current stream (cuda_device.cuh),
// where lce_torch was built with the CUDA toolkit; elsewhere this package's
// reason rather than the dispatcher's "could not run".
#if LCE_TORCH_WITH_CUDA
TORCH_LIBRARY_IMPL(lce, CUDA, m) { lce_torch::impl_ops<lce_torch::cuda_device>(m); }
#else
namespace {
void built_without_cuda(const c10::OperatorHandle& op, torch::jit::Stack*) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, "lce_torch: ", op.schema().name(),
                              " on CUDA tensors: this lce_torch was built without the CUDA toolkit (no nvcc or "
                              "CUDA_HOME at install, or LCE_TORCH_CUDA=0); reinstall where the toolkit is, or move "
                              "hidden, weight and targets to the CPU");
}
}  // namespace
TORCH_LIBRARY_IMPL(lce, CUDA, m) {
  for (const char* name : {"logprobs", "logprobs_backward", "logprobs_forward_backward", "target_set_logprobs",
                           "target_set_logprobs_backward"})
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&built_without_cuda>());
}
#endif
