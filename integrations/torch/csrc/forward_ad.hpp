#pragma once
// The ops' refusal of forward-mode AD, shared by the LM-head ops (register.cpp)
// and the losses (losses.cpp), so that calling torch.ops.lce directly refuses a
// tangent as the Python wrappers do.

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/forward_grad.h>
#include <torch/csrc/autograd/variable.h>

#include <initializer_list>
#include <optional>

namespace lce_torch {

// Tensors carrying a forward-mode tangent (torch.autograd.forward_ad's dual tensors, at
// any level): the ops have no forward-mode rule, and PyTorch would hand their results
// back without a tangent (a Jacobian of zeros), so a call given one raises instead.
// (torch.func.jvp and jacfwd unwrap their tensors before the kernel, which cannot see
// their tangents: the Python wrappers refuse those.)
inline bool has_tangent(const at::TensorBase& t) {
  const torch::autograd::AutogradMeta* meta = torch::autograd::impl::get_autograd_meta(t);
  if (meta != nullptr && meta->fw_grad_ != nullptr && !meta->fw_grad_->empty()) return true;
  // A view takes its base's tangent lazily, when it is first read: its own may be empty yet.
  return t.is_view() && has_tangent(t._base());
}

inline void refuse_forward_ad(std::initializer_list<std::optional<at::Tensor>> tensors) {
  for (const std::optional<at::Tensor>& t : tensors)
    TORCH_CHECK_NOT_IMPLEMENTED(!t || !t->defined() || !has_tangent(*t),
                                "lce_torch: the lce ops have no forward-mode AD (torch.autograd.forward_ad, "
                                "torch.func.jvp); use reverse mode (backward(), torch.autograd.grad)");
}

}  // namespace lce_torch
