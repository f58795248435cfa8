#pragma once
// The kernels of kernels.hpp, for any Device: a policy with
//   Device::op<T>(config)  -> the operator of this thread for (T, options, group, device):
//                             a reference, or a std::variant of pointers to operators of
//                             different backends chosen at run time (cpu_device's bfloat16),
//   Device::guard(tensor)  -> an object that makes the tensor's device current while it lives.
// Included only by the translation units that instantiate them (ops_full.cpp,
// ops_half.cpp with cpu_device.hpp; cuda_ops.cu with cuda_device.cuh).

#include "kernels.hpp"
#include "tensor_views.hpp"

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <variant>

namespace lce_torch {

// What a kernel's prepared call holds of Device::op<T>: a pointer to the one operator, or the
// variant of pointers; with_op calls f on the operator itself.
template <class Op>
Op* hold(Op& op) { return &op; }
template <class... Ops>
std::variant<Ops*...> hold(std::variant<Ops*...> op) { return op; }

template <class Op, class F>
void with_op(Op* op, F&& f) { f(*op); }
template <class... Ops, class F>
void with_op(const std::variant<Ops*...>& op, F&& f) { std::visit([&](auto* one) { f(*one); }, op); }

// dL/d(entropy, lse, mean logit) per token, in the result dtype on hidden's
// device; each undefined when not given.
struct row_term_gradients {
  at::Tensor entropy, lse, mean_logit;

  row_term_gradients(const std::optional<at::Tensor>& grad_entropy, const std::optional<at::Tensor>& grad_lse,
                     const std::optional<at::Tensor>& grad_mean_logit, at::ScalarType result, std::int64_t n,
                     const at::Device& device) {
    const auto of = [&](const std::optional<at::Tensor>& g, const char* name) {
      return given(g) ? per_token(*g, result, n, name, device) : at::Tensor();
    };
    entropy = of(grad_entropy, "grad_entropy");
    lse = of(grad_lse, "grad_lse");
    mean_logit = of(grad_mean_logit, "grad_mean_logit");
  }

  // Rows that take dL/dlse alone (ignored tokens handed a stand-in target).
  void lse_only(const at::Tensor& rows) {
    if (entropy.defined()) entropy = entropy.masked_fill(rows, 0);
    if (mean_logit.defined()) mean_logit = mean_logit.masked_fill(rows, 0);
  }
};

// ids == ignore_index. An int32 tensor compared with an int64 scalar would wrap the scalar to
// int32 (2^32 + 5 matching id 5); an ignore_index outside int32 ids' range matches none, as in lce.
inline at::Tensor equals_ignore_index(const at::Tensor& ids, std::int64_t ignore_index) {
  if (ids.scalar_type() == at::kInt && (ignore_index < std::numeric_limits<std::int32_t>::min() ||
                                        ignore_index > std::numeric_limits<std::int32_t>::max()))
    return at::zeros(ids.sizes(), ids.options().dtype(at::kBool));
  return ids == ignore_index;
}

// lce gives ignored tokens no gradient at all, but their lse is real: the backward hands
// lce those rows (bool `ignored`) with a valid target, the same id on every rank so that the
// targets still agree, and no other row term. That id, where some row is ignored: 1 where
// ignore_index is 0, else 0. On one rank a vocabulary of one id, which ignore_index 0
// takes, has none to lend, and a dL/dlse there would be lost: that raises. (A group's
// vocabulary of one id: lce itself rejects the stand-in, on every rank.)
inline std::optional<std::int64_t> lse_stand_in(const at::Tensor& ignored, const at::Tensor& grad_lse,
                                                const config& c, std::int64_t vocab_local) {
  if (!ignored.any().item<bool>()) return std::nullopt;
  const std::int64_t stand_in = c.ignore_index == 0 ? 1 : 0;
  if (!c.group_name && stand_in >= vocab_local) {
    TORCH_CHECK(!(grad_lse.ne(0) & ignored).any().item<bool>(), "lce_torch: grad_lse reaches tokens whose target is ",
                "ignore_index (", c.ignore_index, "), and a vocabulary of ", vocab_local,
                " id has no other id to carry it: pass another ignore_index (e.g. -100)");
    return std::nullopt;
  }
  return stand_in;
}

template <class TorchT, class Device>
std::function<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>()> kernels<TorchT, Device>::forward(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
    const std::optional<at::Tensor>& bias, bool with_entropy, bool with_mean_logit, const config& c) {
  [[maybe_unused]] const auto on_device = Device::guard(hidden);
  const auto op = hold(Device::template op<T>(c));
  const rows_view x = as_rows(hidden, "hidden"), w = as_rows(weight, "weight");
  const at::Tensor b = bias_vector(bias, weight);
  const at::Tensor y = as_vector(targets);
  const auto out = at::TensorOptions().dtype(c10::CppTypeToScalarType<R>::value).device(hidden.device());
  at::Tensor logp = at::empty(targets.sizes(), out), lse = at::empty(targets.sizes(), out);
  at::Tensor ent = with_entropy ? at::empty(targets.sizes(), out) : at::empty({0}, out);
  at::Tensor mean = with_mean_logit ? at::empty(targets.sizes(), out) : at::empty({0}, out);
  return [=]() -> std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> {
    [[maybe_unused]] const auto on_device = Device::guard(x.tensor);
    with_op(op, [&](auto& o) {
      workspace_release<std::remove_reference_t<decltype(o)>> release{o};
      with_targets(y, [&](auto ids) {
        o.forward(matrix_of<const T>(x), head_of<const T>(matrix_of<const T>(w), b), ids,
                  lce::row_outputs<R>{vector_of<R>(logp), vector_of<R>(lse),
                                      with_entropy ? vector_of<R>(ent) : lce::vector_view<R>{},
                                      with_mean_logit ? vector_of<R>(mean) : lce::vector_view<R>{}});
      });
    });
    return {logp, lse, ent, mean};
  };
}

template <class TorchT, class Device>
std::function<std::tuple<at::Tensor, at::Tensor, at::Tensor>()> kernels<TorchT, Device>::backward(
    const at::Tensor& grad_logprobs, const std::optional<at::Tensor>& grad_entropy, const at::Tensor& hidden,
    const at::Tensor& weight, const at::Tensor& targets, const at::Tensor& lse,
    const std::optional<at::Tensor>& grad_lse, const std::optional<at::Tensor>& grad_mean_logit,
    const std::optional<at::Tensor>& bias, const config& c) {
  [[maybe_unused]] const auto on_device = Device::guard(hidden);
  const auto op = hold(Device::template op<T>(c));
  const at::Device device = hidden.device();
  const rows_view x = as_rows(hidden, "hidden"), w = as_rows(weight, "weight");
  const at::Tensor b = bias_vector(bias, weight);
  at::Tensor y = as_vector(targets);
  const auto rt = c10::CppTypeToScalarType<R>::value;
  const std::int64_t n = y.numel();
  const at::Tensor ls = per_token(lse, rt, n, "lse", device);
  at::Tensor gl = per_token(grad_logprobs, rt, n, "grad_logprobs", device);
  row_term_gradients terms(grad_entropy, grad_lse, grad_mean_logit, rt, n, device);
  if (terms.lse.defined() && n > 0) {
    const at::Tensor ignored = equals_ignore_index(y, c.ignore_index);
    if (const auto stand_in = lse_stand_in(ignored, terms.lse, c, w.rows)) {
      y = y.masked_fill(ignored, *stand_in);
      gl = gl.masked_fill(ignored, 0);
      terms.lse_only(ignored);
    }
  }
  at::Tensor dx = at::empty(hidden.sizes(), hidden.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor dw = weight_gradient(w.rows, w.cols, weight.options());
  const at::Tensor db = bias_gradient<R>(b);
  const rows_view gx = as_rows(dx, "grad_hidden"), gw = as_rows(dw, "grad_weight");
  return [=]() -> std::tuple<at::Tensor, at::Tensor, at::Tensor> {
    [[maybe_unused]] const auto on_device = Device::guard(x.tensor);
    with_op(op, [&](auto& o) {
      workspace_release<std::remove_reference_t<decltype(o)>> release{o};
      with_targets(y, [&](auto ids) {
        o.backward(matrix_of<const T>(x), head_of<const T>(matrix_of<const T>(w), b), ids, vector_of<const R>(ls),
                   lce::row_gradients<R>{vector_of<const R>(gl), optional_vector<const R>(terms.entropy),
                                         optional_vector<const R>(terms.lse),
                                         optional_vector<const R>(terms.mean_logit)},
                   matrix_of<T>(gx), head_of<R>(matrix_of<T>(gw), db));
      });
    });
    return {dx, dw, bias_gradient_result(db, b, weight)};
  };
}

template <class TorchT, class Device>
std::function<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>()>
kernels<TorchT, Device>::forward_backward(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                                          const at::Tensor& grad_logprobs, const std::optional<at::Tensor>& grad_lse,
                                          const std::optional<at::Tensor>& grad_mean_logit,
                                          const std::optional<at::Tensor>& bias, bool with_mean_logit,
                                          const config& c) {
  [[maybe_unused]] const auto on_device = Device::guard(hidden);
  const auto op = hold(Device::template op<T>(c));
  const at::Device device = hidden.device();
  const rows_view x = as_rows(hidden, "hidden"), w = as_rows(weight, "weight");
  const at::Tensor b = bias_vector(bias, weight);
  const at::Tensor y = as_vector(targets);
  const auto rt = c10::CppTypeToScalarType<R>::value;
  const std::int64_t n = y.numel();
  const at::Tensor gl = per_token(grad_logprobs, rt, n, "grad_logprobs", device);
  const row_term_gradients terms(std::nullopt, grad_lse, grad_mean_logit, rt, n, device);
  const auto out = at::TensorOptions().dtype(rt).device(device);
  at::Tensor logp = at::empty(targets.sizes(), out), lse = at::empty(targets.sizes(), out);
  at::Tensor mean = with_mean_logit ? at::empty(targets.sizes(), out) : at::empty({0}, out);
  at::Tensor dx = at::empty(hidden.sizes(), hidden.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor dw = weight_gradient(w.rows, w.cols, weight.options());
  const at::Tensor db = bias_gradient<R>(b);
  const rows_view gx = as_rows(dx, "grad_hidden"), gw = as_rows(dw, "grad_weight");
  return [=]() -> std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> {
    [[maybe_unused]] const auto on_device = Device::guard(x.tensor);
    with_op(op, [&](auto& o) {
      workspace_release<std::remove_reference_t<decltype(o)>> release{o};
      with_targets(y, [&](auto ids) {
        o.forward_backward(
            matrix_of<const T>(x), head_of<const T>(matrix_of<const T>(w), b), ids,
            lce::row_gradients<R>{vector_of<const R>(gl), {}, optional_vector<const R>(terms.lse),
                                  optional_vector<const R>(terms.mean_logit)},
            lce::row_outputs<R>{vector_of<R>(logp), vector_of<R>(lse), {},
                                with_mean_logit ? vector_of<R>(mean) : lce::vector_view<R>{}},
            matrix_of<T>(gx), head_of<R>(matrix_of<T>(gw), db));
      });
    });
    return {logp, dx, dw, lse, mean, bias_gradient_result(db, b, weight)};
  };
}


template <class TorchT, class Device>
std::function<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>()> kernels<TorchT, Device>::set_forward(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& ids, const std::optional<at::Tensor>& bias,
    bool with_entropy, bool with_mean_logit, const config& c) {
  [[maybe_unused]] const auto on_device = Device::guard(hidden);
  const auto op = hold(Device::template op<T>(c));
  const rows_view x = as_rows(hidden, "hidden"), w = as_rows(weight, "weight");
  const at::Tensor b = bias_vector(bias, weight);
  const sets_view y = as_sets(ids);
  const auto rows_shape = ids.sizes().slice(0, ids.dim() - 1);
  const auto out = at::TensorOptions().dtype(c10::CppTypeToScalarType<R>::value).device(hidden.device());
  at::Tensor logp = at::empty(ids.sizes(), out), lse = at::empty(rows_shape, out);
  at::Tensor ent = with_entropy ? at::empty(rows_shape, out) : at::empty({0}, out);
  at::Tensor mean = with_mean_logit ? at::empty(rows_shape, out) : at::empty({0}, out);
  return [=]() -> std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> {
    [[maybe_unused]] const auto on_device = Device::guard(x.tensor);
    with_op(op, [&](auto& o) {
      workspace_release<std::remove_reference_t<decltype(o)>> release{o};
      with_sets(y.tensor, [&](auto sets) {
        o.forward(matrix_of<const T>(x), head_of<const T>(matrix_of<const T>(w), b), sets,
                  lce::target_set_outputs<R>{dense_of<R>(logp.view({y.rows, y.k})), vector_of<R>(lse),
                                             with_entropy ? vector_of<R>(ent) : lce::vector_view<R>{},
                                             with_mean_logit ? vector_of<R>(mean) : lce::vector_view<R>{}});
      });
    });
    return {logp, lse, ent, mean};
  };
}

template <class TorchT, class Device>
std::function<std::tuple<at::Tensor, at::Tensor, at::Tensor>()> kernels<TorchT, Device>::set_backward(
    const at::Tensor& grad_logprobs, const std::optional<at::Tensor>& grad_entropy, const at::Tensor& hidden,
    const at::Tensor& weight, const at::Tensor& ids, const at::Tensor& lse,
    const std::optional<at::Tensor>& grad_lse, const std::optional<at::Tensor>& grad_mean_logit,
    const std::optional<at::Tensor>& bias, const config& c) {
  [[maybe_unused]] const auto on_device = Device::guard(hidden);
  const auto op = hold(Device::template op<T>(c));
  const at::Device device = hidden.device();
  const rows_view x = as_rows(hidden, "hidden"), w = as_rows(weight, "weight");
  const at::Tensor b = bias_vector(bias, weight);
  sets_view y = as_sets(ids);
  const auto rt = c10::CppTypeToScalarType<R>::value;
  const std::int64_t n = y.rows;
  const at::Tensor ls = per_token(lse, rt, n, "lse", device);
  at::Tensor gl = per_id(grad_logprobs, rt, y, "grad_logprobs", device);
  row_term_gradients terms(grad_entropy, grad_lse, grad_mean_logit, rt, n, device);
  if (terms.lse.defined() && n > 0 && y.k > 0) {
    // As in backward above, for a token whose K ids are all ignored: its first id is the stand-in.
    const at::Tensor ignored = equals_ignore_index(y.tensor, c.ignore_index).all(1);
    if (const auto stand_in = lse_stand_in(ignored, terms.lse, c, w.rows)) {
      at::Tensor first = y.tensor.select(1, 0).masked_fill(ignored, *stand_in);
      y.tensor = y.tensor.clone();
      y.tensor.select(1, 0).copy_(first);
      gl = gl.masked_fill(ignored.unsqueeze(1), 0);
      terms.lse_only(ignored);
    }
  }
  at::Tensor dx = at::empty(hidden.sizes(), hidden.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor dw = weight_gradient(w.rows, w.cols, weight.options());
  const at::Tensor db = bias_gradient<R>(b);
  const rows_view gx = as_rows(dx, "grad_hidden"), gw = as_rows(dw, "grad_weight");
  return [=]() -> std::tuple<at::Tensor, at::Tensor, at::Tensor> {
    [[maybe_unused]] const auto on_device = Device::guard(x.tensor);
    with_op(op, [&](auto& o) {
      workspace_release<std::remove_reference_t<decltype(o)>> release{o};
      with_sets(y.tensor, [&](auto sets) {
        o.backward(matrix_of<const T>(x), head_of<const T>(matrix_of<const T>(w), b), sets, vector_of<const R>(ls),
                   lce::target_set_gradients<R>{dense_of<const R>(gl), optional_vector<const R>(terms.entropy),
                                                optional_vector<const R>(terms.lse),
                                                optional_vector<const R>(terms.mean_logit)},
                   matrix_of<T>(gx), head_of<R>(matrix_of<T>(gw), db));
      });
    });
    return {dx, dw, bias_gradient_result(db, b, weight)};
  };
}


}  // namespace lce_torch
