#pragma once
// The CPU kernels of the lce:: torch ops: each one builds lce views on the
// tensors' storage (no copy for contiguous or row-strided hidden / weight),
// takes the operator for (dtype, options, group, threads) from a per-thread
// cache and makes one lce call.
//
// kernels<T> is instantiated in two translation units (ops_full.cpp for float
// and double, ops_half.cpp for bfloat16 and float16) so that they compile in
// parallel; register.cpp only declares them.

#include "process_group_comm.hpp"
#include "torch_gemm.hpp"

#include <lce/lce.hpp>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace lce_torch {

// The op arguments that become lce::options (and the communicator).
struct config {
  std::int64_t vocab_start = 0;
  std::int64_t ignore_index = -100;
  double temperature = 1.0;
  double softcap = 0.0;
  bool sequence_parallel = false;
  std::int64_t chunk_tokens = 0;
  std::int64_t workspace_limit_bytes = std::int64_t{256} << 20;
  std::optional<std::string> group_name;

  lce::options to_options() const {
    TORCH_CHECK(workspace_limit_bytes > 0, "lce: options.workspace_limit_bytes must be > 0, got ",
                workspace_limit_bytes);
    lce::options o;
    o.vocab_start = vocab_start;
    o.ignore_index = ignore_index;
    o.temperature = static_cast<float>(temperature);
    o.softcap = static_cast<float>(softcap);
    o.sequence_parallel = sequence_parallel;
    o.chunk_tokens = chunk_tokens;
    o.workspace_limit_bytes = static_cast<std::size_t>(workspace_limit_bytes);
    return o;
  }
};

// Whether operators keep their scratch between calls (lce's default) or give
// it back after each call (this package's default: PyTorch users expect memory
// to be returned, and peak-memory measurements to be honest).
bool keep_workspace();
void set_keep_workspace(bool keep);

// lce's element type for a torch dtype.
template <class T> struct lce_type_of;
template <> struct lce_type_of<float> { using type = float; };
template <> struct lce_type_of<double> { using type = double; };
template <> struct lce_type_of<c10::BFloat16> { using type = lce::bfloat16; };
template <> struct lce_type_of<c10::Half> { using type = lce::float16; };

// hidden [..., H] as rows: a view (no copy) when the leading dimensions
// collapse into one row stride and the last dimension is contiguous,
// otherwise a contiguous copy.
struct rows_view {
  at::Tensor tensor;  // keeps a copy alive when one was needed
  std::int64_t rows = 0, cols = 0, ld = 0;
};

inline rows_view as_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() >= 1, "lce_torch: ", name, " must have at least one dimension (..., H), got a scalar");
  const std::int64_t cols = x.size(-1);
  std::int64_t rows = 1;
  for (std::int64_t d = 0; d + 1 < x.dim(); ++d) rows *= x.size(d);
  at::Tensor m;
  if (x.dim() == 2) {
    m = x;
  } else {
    // view() succeeds exactly when the leading dimensions collapse without a copy.
    std::optional<at::Tensor> viewed;
    try {
      viewed = x.view({rows, cols});
    } catch (const c10::Error&) {
    }
    m = viewed ? *viewed : x.contiguous().view({rows, cols});
  }
  if ((cols > 1 && m.stride(1) != 1) || (rows > 1 && m.stride(0) < cols)) m = m.contiguous();
  const std::int64_t ld = rows > 1 ? m.stride(0) : cols;
  return {m, rows, cols, ld};
}

// grad_weight, zeroed for the operator's +=: a fresh [V, H] block on the
// allocator's own pages, like the scratch (see operator_cache).
inline at::Tensor zeroed_weight_gradient(std::int64_t rows, std::int64_t cols, const at::TensorOptions& options) {
  return at::zeros({rows, cols}, options.memory_format(at::MemoryFormat::Contiguous));
}

// A 1-D unit-stride tensor of the same elements (per-token vectors; small).
inline at::Tensor as_vector(const at::Tensor& x) {
  at::Tensor v = x.reshape({-1});
  if (v.numel() > 1 && v.stride(0) != 1) v = v.contiguous();
  return v;
}

// Per-token inputs (lse, grad_logprobs, grad_entropy) in the result dtype.
inline at::Tensor per_token(const at::Tensor& x, at::ScalarType result, std::int64_t n, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), "lce_torch: ", name, " must be a CPU tensor, got ", x.device());
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "lce_torch: ", name, " must be floating point, got ",
              x.scalar_type());
  TORCH_CHECK(x.numel() == n, "lce_torch: ", name, " has ", x.numel(), " elements, the targets ", n);
  at::Tensor v = as_vector(x);
  if (v.scalar_type() != result) v = v.to(result);
  return v;
}

template <class E>
lce::matrix_view<E> matrix_of(const rows_view& r) {
  return {reinterpret_cast<E*>(const_cast<void*>(static_cast<const void*>(r.tensor.const_data_ptr()))), r.rows,
          r.cols, r.ld};
}

template <class E>
lce::vector_view<E> vector_of(const at::Tensor& v) {
  return {reinterpret_cast<E*>(const_cast<void*>(v.const_data_ptr())), v.numel()};
}

inline at::ScalarType result_dtype(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// The operator of this thread for (T, options, group, threads).
template <class T>
class operator_cache {
 public:
  using backend_t = lce::basic_host<torch_gemm>;
  using op_t = lce::ChunkedHiddenToLogprobs<process_group_comm, T, lce::budget_chunk, backend_t>;

  static op_t& get(const config& c) {
    process_group_comm comm = c.group_name ? process_group_comm(*c.group_name) : process_group_comm();
    const lce::options o = c.to_options();
    const int threads = at::get_num_threads();
    const void* group = comm.size() > 1 ? comm.identity() : nullptr;
    auto& entries = table();
    for (auto& e : entries)
      if (e.threads == threads && e.group == group && same(e.opt, o)) return *e.op;
    if (entries.size() >= 8) entries.erase(entries.begin());
    // The scratch is given back after each call (keep_workspace), so each call maps it
    // afresh: on the allocator's own pages, not transparent huge ones (lce::scratch_pages).
    entries.push_back({o, group, threads,
                       std::make_unique<op_t>(std::move(comm), o, backend_t{threads, lce::scratch_pages::base})});
    return *entries.back().op;
  }

 private:
  struct entry {
    lce::options opt;
    const void* group;
    int threads;
    std::unique_ptr<op_t> op;
  };
  static bool same(const lce::options& a, const lce::options& b) {
    return a.vocab_start == b.vocab_start && a.ignore_index == b.ignore_index && a.temperature == b.temperature &&
           a.softcap == b.softcap && a.sequence_parallel == b.sequence_parallel && a.chunk_tokens == b.chunk_tokens &&
           a.workspace_limit_bytes == b.workspace_limit_bytes;
  }
  static std::vector<entry>& table() {
    thread_local std::vector<entry> entries;
    return entries;
  }
};

// Gives the scratch back after a call (also when it raised) unless keep_workspace().
template <class Op>
struct workspace_release {
  Op& op;
  ~workspace_release() {
    if (!keep_workspace()) op.release_workspace();
  }
};

template <class TorchT>
struct kernels {
  using T = typename lce_type_of<TorchT>::type;
  using R = std::conditional_t<std::is_same_v<T, double>, double, float>;

  // Each returns the prepared call: every local check and allocation is done
  // (and may raise) before it returns; the call itself makes lce's one
  // exchange with the other ranks and the sweep. All of them use lce's
  // row-term forms (lce::row_outputs / lce::row_gradients).

  // -> (logprobs, lse, entropy, mean_logit) shaped as targets; entropy and
  // mean_logit are [0] when not asked for.
  static std::function<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>()> forward(
      const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets, bool with_entropy,
      bool with_mean_logit, const config& c);

  // -> (grad_hidden shaped as hidden, grad_weight [V_r, H]) in the inputs' dtype,
  // for dL/d(logprobs, entropy, lse, mean_logit); the optional ones count as 0.
  // lse is a real value on ignored tokens too, so grad_lse applies there (the
  // others are 0 there: log-prob, entropy and mean logit are reported 0).
  static std::function<std::tuple<at::Tensor, at::Tensor>()> backward(
      const at::Tensor& grad_logprobs, const std::optional<at::Tensor>& grad_entropy, const at::Tensor& hidden,
      const at::Tensor& weight, const at::Tensor& targets, const at::Tensor& lse,
      const std::optional<at::Tensor>& grad_lse, const std::optional<at::Tensor>& grad_mean_logit,
      const config& c);

  // One sweep: -> (logprobs, grad_hidden, grad_weight, lse, mean_logit) for
  // dL/d(logprobs, lse, mean_logit) known up front (ignored tokens: no
  // gradient, as in lce); mean_logit is [0] unless with_mean_logit.
  static std::function<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>()> forward_backward(
      const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets, const at::Tensor& grad_logprobs,
      const std::optional<at::Tensor>& grad_lse, const std::optional<at::Tensor>& grad_mean_logit,
      bool with_mean_logit, const config& c);

  // Target sets (lce's target_set_outputs / target_set_gradients): ids
  // [..., K] (K ids per token) instead of targets [...]; the log-probs and
  // their gradient are [..., K], the row terms [...].

  // -> (logprobs [..., K], lse [...], entropy [...] or [0], mean_logit [...] or [0]).
  static std::function<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>()> set_forward(
      const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& ids, bool with_entropy,
      bool with_mean_logit, const config& c);

  // -> (grad_hidden, grad_weight) for dL/d(logprobs [..., K], entropy, lse, mean_logit).
  static std::function<std::tuple<at::Tensor, at::Tensor>()> set_backward(
      const at::Tensor& grad_logprobs, const std::optional<at::Tensor>& grad_entropy, const at::Tensor& hidden,
      const at::Tensor& weight, const at::Tensor& ids, const at::Tensor& lse,
      const std::optional<at::Tensor>& grad_lse, const std::optional<at::Tensor>& grad_mean_logit,
      const config& c);
};

// Calls f with the targets as an lce vector view of int32 or int64.
template <class F>
decltype(auto) with_targets(const at::Tensor& t, F&& f) {
  if (t.scalar_type() == at::kInt) return f(vector_of<const std::int32_t>(t));
  return f(vector_of<const std::int64_t>(t));
}

// What a prepared call holds: the operator, the views' tensors, the outputs.
template <class TorchT>
using op_of = typename operator_cache<typename lce_type_of<TorchT>::type>::op_t;

inline bool given(const std::optional<at::Tensor>& t) { return t && t->defined(); }

// An empty lce view (the row term is absent) or the tensor's.
template <class E>
lce::vector_view<E> optional_vector(const at::Tensor& t) {
  return t.defined() ? vector_of<E>(t) : lce::vector_view<E>{};
}

template <class TorchT>
std::function<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>()> kernels<TorchT>::forward(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets, bool with_entropy,
    bool with_mean_logit, const config& c) {
  auto* op = &operator_cache<T>::get(c);
  const rows_view x = as_rows(hidden, "hidden"), w = as_rows(weight, "weight");
  const at::Tensor y = as_vector(targets);
  const auto out = at::TensorOptions().dtype(c10::CppTypeToScalarType<R>::value);
  at::Tensor logp = at::empty(targets.sizes(), out), lse = at::empty(targets.sizes(), out);
  at::Tensor ent = with_entropy ? at::empty(targets.sizes(), out) : at::empty({0}, out);
  at::Tensor mean = with_mean_logit ? at::empty(targets.sizes(), out) : at::empty({0}, out);
  return [=]() -> std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> {
    workspace_release<op_of<TorchT>> release{*op};
    with_targets(y, [&](auto ids) {
      op->forward(matrix_of<const T>(x), matrix_of<const T>(w), ids,
                  lce::row_outputs<R>{vector_of<R>(logp), vector_of<R>(lse),
                                      with_entropy ? vector_of<R>(ent) : lce::vector_view<R>{},
                                      with_mean_logit ? vector_of<R>(mean) : lce::vector_view<R>{}});
    });
    return {logp, lse, ent, mean};
  };
}

template <class TorchT>
std::function<std::tuple<at::Tensor, at::Tensor>()> kernels<TorchT>::backward(
    const at::Tensor& grad_logprobs, const std::optional<at::Tensor>& grad_entropy, const at::Tensor& hidden,
    const at::Tensor& weight, const at::Tensor& targets, const at::Tensor& lse,
    const std::optional<at::Tensor>& grad_lse, const std::optional<at::Tensor>& grad_mean_logit, const config& c) {
  auto* op = &operator_cache<T>::get(c);
  const rows_view x = as_rows(hidden, "hidden"), w = as_rows(weight, "weight");
  at::Tensor y = as_vector(targets);
  const auto rt = c10::CppTypeToScalarType<R>::value;
  const std::int64_t n = y.numel();
  const at::Tensor ls = per_token(lse, rt, n, "lse");
  at::Tensor gl = per_token(grad_logprobs, rt, n, "grad_logprobs");
  at::Tensor ge = given(grad_entropy) ? per_token(*grad_entropy, rt, n, "grad_entropy") : at::Tensor();
  const at::Tensor gq = given(grad_lse) ? per_token(*grad_lse, rt, n, "grad_lse") : at::Tensor();
  at::Tensor gm = given(grad_mean_logit) ? per_token(*grad_mean_logit, rt, n, "grad_mean_logit") : at::Tensor();
  if (gq.defined() && n > 0) {
    // lce gives ignored tokens no gradient at all, but their lse is real: hand
    // lce those rows with a valid target (the same id on every rank, so the
    // targets still agree) and no log-prob, entropy or mean-logit gradient, so
    // that only dL/dlse reaches them.
    const at::Tensor ignored = y == c.ignore_index;
    const std::int64_t stand_in = c.ignore_index == 0 ? 1 : 0;
    const bool representable = c.group_name || stand_in < w.rows;
    if (representable && ignored.any().item<bool>()) {
      y = y.masked_fill(ignored, stand_in);
      gl = gl.masked_fill(ignored, 0);
      if (ge.defined()) ge = ge.masked_fill(ignored, 0);
      if (gm.defined()) gm = gm.masked_fill(ignored, 0);
    }
  }
  at::Tensor dx = at::empty(hidden.sizes(), hidden.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor dw = zeroed_weight_gradient(w.rows, w.cols, weight.options());
  const rows_view gx = as_rows(dx, "grad_hidden"), gw = as_rows(dw, "grad_weight");
  return [=]() -> std::tuple<at::Tensor, at::Tensor> {
    workspace_release<op_of<TorchT>> release{*op};
    with_targets(y, [&](auto ids) {
      op->backward(matrix_of<const T>(x), matrix_of<const T>(w), ids, vector_of<const R>(ls),
                   lce::row_gradients<R>{vector_of<const R>(gl), optional_vector<const R>(ge),
                                         optional_vector<const R>(gq), optional_vector<const R>(gm)},
                   matrix_of<T>(gx), matrix_of<T>(gw));
    });
    return {dx, dw};
  };
}

template <class TorchT>
std::function<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>()>
kernels<TorchT>::forward_backward(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                                  const at::Tensor& grad_logprobs, const std::optional<at::Tensor>& grad_lse,
                                  const std::optional<at::Tensor>& grad_mean_logit, bool with_mean_logit,
                                  const config& c) {
  auto* op = &operator_cache<T>::get(c);
  const rows_view x = as_rows(hidden, "hidden"), w = as_rows(weight, "weight");
  const at::Tensor y = as_vector(targets);
  const auto rt = c10::CppTypeToScalarType<R>::value;
  const std::int64_t n = y.numel();
  const at::Tensor gl = per_token(grad_logprobs, rt, n, "grad_logprobs");
  const at::Tensor gq = given(grad_lse) ? per_token(*grad_lse, rt, n, "grad_lse") : at::Tensor();
  const at::Tensor gm = given(grad_mean_logit) ? per_token(*grad_mean_logit, rt, n, "grad_mean_logit") : at::Tensor();
  const auto out = at::TensorOptions().dtype(rt);
  at::Tensor logp = at::empty(targets.sizes(), out), lse = at::empty(targets.sizes(), out);
  at::Tensor mean = with_mean_logit ? at::empty(targets.sizes(), out) : at::empty({0}, out);
  at::Tensor dx = at::empty(hidden.sizes(), hidden.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor dw = zeroed_weight_gradient(w.rows, w.cols, weight.options());
  const rows_view gx = as_rows(dx, "grad_hidden"), gw = as_rows(dw, "grad_weight");
  return [=]() -> std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> {
    workspace_release<op_of<TorchT>> release{*op};
    with_targets(y, [&](auto ids) {
      op->forward_backward(
          matrix_of<const T>(x), matrix_of<const T>(w), ids,
          lce::row_gradients<R>{vector_of<const R>(gl), {}, optional_vector<const R>(gq), optional_vector<const R>(gm)},
          lce::row_outputs<R>{vector_of<R>(logp), vector_of<R>(lse), {},
                              with_mean_logit ? vector_of<R>(mean) : lce::vector_view<R>{}},
          matrix_of<T>(gx), matrix_of<T>(gw));
    });
    return {logp, dx, dw, lse, mean};
  };
}

// ids [..., K] as a dense [N, K] matrix (lce needs ld = K): a view when the
// tensor is contiguous, otherwise a contiguous copy.
struct sets_view {
  at::Tensor tensor;
  std::int64_t rows = 0, k = 0;
};

inline sets_view as_sets(const at::Tensor& ids) {
  TORCH_CHECK(ids.dim() >= 1, "lce_torch: ids must be [..., K] (K ids per token), got a scalar");
  const std::int64_t k = ids.size(-1);
  std::int64_t rows = 1;
  for (std::int64_t d = 0; d + 1 < ids.dim(); ++d) rows *= ids.size(d);
  return {ids.contiguous().view({rows, k}), rows, k};
}

// A [..., K] input of K values per token (grad_logprobs) as a dense [N, K]
// tensor of the result dtype.
inline at::Tensor per_id(const at::Tensor& x, at::ScalarType result, const sets_view& s, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), "lce_torch: ", name, " must be a CPU tensor, got ", x.device());
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "lce_torch: ", name, " must be floating point, got ",
              x.scalar_type());
  TORCH_CHECK(x.numel() == s.rows * s.k, "lce_torch: ", name, " has ", x.numel(), " elements, the ids [", s.rows,
              ", ", s.k, "]");
  at::Tensor v = x.contiguous().view({s.rows, s.k});
  if (v.scalar_type() != result) v = v.to(result);
  return v;
}

template <class E>
lce::matrix_view<E> dense_of(const at::Tensor& m) {
  return {reinterpret_cast<E*>(const_cast<void*>(m.const_data_ptr())), m.size(0), m.size(1), m.size(1)};
}

// Calls f with the ids as an lce matrix view of int32 or int64.
template <class F>
decltype(auto) with_sets(const at::Tensor& t, F&& f) {
  if (t.scalar_type() == at::kInt) return f(dense_of<const std::int32_t>(t));
  return f(dense_of<const std::int64_t>(t));
}

template <class TorchT>
std::function<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>()> kernels<TorchT>::set_forward(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& ids, bool with_entropy,
    bool with_mean_logit, const config& c) {
  auto* op = &operator_cache<T>::get(c);
  const rows_view x = as_rows(hidden, "hidden"), w = as_rows(weight, "weight");
  const sets_view y = as_sets(ids);
  const auto rows_shape = ids.sizes().slice(0, ids.dim() - 1);
  const auto out = at::TensorOptions().dtype(c10::CppTypeToScalarType<R>::value);
  at::Tensor logp = at::empty(ids.sizes(), out), lse = at::empty(rows_shape, out);
  at::Tensor ent = with_entropy ? at::empty(rows_shape, out) : at::empty({0}, out);
  at::Tensor mean = with_mean_logit ? at::empty(rows_shape, out) : at::empty({0}, out);
  return [=]() -> std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> {
    workspace_release<op_of<TorchT>> release{*op};
    with_sets(y.tensor, [&](auto sets) {
      op->forward(matrix_of<const T>(x), matrix_of<const T>(w), sets,
                  lce::target_set_outputs<R>{dense_of<R>(logp.view({y.rows, y.k})), vector_of<R>(lse),
                                             with_entropy ? vector_of<R>(ent) : lce::vector_view<R>{},
                                             with_mean_logit ? vector_of<R>(mean) : lce::vector_view<R>{}});
    });
    return {logp, lse, ent, mean};
  };
}

template <class TorchT>
std::function<std::tuple<at::Tensor, at::Tensor>()> kernels<TorchT>::set_backward(
    const at::Tensor& grad_logprobs, const std::optional<at::Tensor>& grad_entropy, const at::Tensor& hidden,
    const at::Tensor& weight, const at::Tensor& ids, const at::Tensor& lse,
    const std::optional<at::Tensor>& grad_lse, const std::optional<at::Tensor>& grad_mean_logit, const config& c) {
  auto* op = &operator_cache<T>::get(c);
  const rows_view x = as_rows(hidden, "hidden"), w = as_rows(weight, "weight");
  sets_view y = as_sets(ids);
  const auto rt = c10::CppTypeToScalarType<R>::value;
  const std::int64_t n = y.rows;
  const at::Tensor ls = per_token(lse, rt, n, "lse");
  at::Tensor gl = per_id(grad_logprobs, rt, y, "grad_logprobs");
  at::Tensor ge = given(grad_entropy) ? per_token(*grad_entropy, rt, n, "grad_entropy") : at::Tensor();
  const at::Tensor gq = given(grad_lse) ? per_token(*grad_lse, rt, n, "grad_lse") : at::Tensor();
  at::Tensor gm = given(grad_mean_logit) ? per_token(*grad_mean_logit, rt, n, "grad_mean_logit") : at::Tensor();
  if (gq.defined() && n > 0 && y.k > 0) {
    // As in backward above: a token whose K ids are all ignored takes no
    // gradient in lce, but its lse is real. Its first id becomes a valid
    // stand-in (the same on every rank) with no log-prob, entropy or
    // mean-logit gradient, so that only dL/dlse reaches it.
    const at::Tensor ignored = (y.tensor == c.ignore_index).all(1);
    const std::int64_t stand_in = c.ignore_index == 0 ? 1 : 0;
    const bool representable = c.group_name || stand_in < w.rows;
    if (representable && ignored.any().item<bool>()) {
      at::Tensor first = y.tensor.select(1, 0).masked_fill(ignored, stand_in);
      y.tensor = y.tensor.clone();
      y.tensor.select(1, 0).copy_(first);
      gl = gl.masked_fill(ignored.unsqueeze(1), 0);
      if (ge.defined()) ge = ge.masked_fill(ignored, 0);
      if (gm.defined()) gm = gm.masked_fill(ignored, 0);
    }
  }
  at::Tensor dx = at::empty(hidden.sizes(), hidden.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor dw = zeroed_weight_gradient(w.rows, w.cols, weight.options());
  const rows_view gx = as_rows(dx, "grad_hidden"), gw = as_rows(dw, "grad_weight");
  return [=]() -> std::tuple<at::Tensor, at::Tensor> {
    workspace_release<op_of<TorchT>> release{*op};
    with_sets(y.tensor, [&](auto sets) {
      op->backward(matrix_of<const T>(x), matrix_of<const T>(w), sets, vector_of<const R>(ls),
                   lce::target_set_gradients<R>{dense_of<const R>(gl), optional_vector<const R>(ge),
                                                optional_vector<const R>(gq), optional_vector<const R>(gm)},
                   matrix_of<T>(gx), matrix_of<T>(gw));
    });
    return {dx, dw};
  };
}

extern template struct kernels<float>;
extern template struct kernels<double>;
extern template struct kernels<c10::BFloat16>;
extern template struct kernels<c10::Half>;

}  // namespace lce_torch
