#pragma once
// What every kernel of the lce:: torch ops does with tensors, on any device:
// the op options as lce::options, lce views on the tensors' storage (no copy
// for contiguous or row-strided hidden / weight), per-token inputs checked
// and converted, and the scratch given back after a call. The devices'
// operators are in cpu_device.hpp and cuda_device.cuh; the kernels that use
// both in kernel_bodies.hpp.

#include <lce/chunked_hidden_to_logprobs.hpp>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
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
  double max_logits_share = 0.1;
  std::optional<std::string> group_name;
  std::string caller_settings;  // compared across the group's ranks (register.cpp's agreed)

  lce::options to_options() const {
    TORCH_CHECK(workspace_limit_bytes > 0, "lce: options.workspace_limit_bytes must be > 0, got ",
                workspace_limit_bytes);
    lce::options o;
    o.vocab_start = vocab_start;
    o.ignore_index = ignore_index;
    o.temperature = as_float(temperature, "temperature");
    o.softcap = as_float(softcap, "softcap");
    o.sequence_parallel = sequence_parallel;
    o.chunk_tokens = chunk_tokens;
    o.workspace_limit_bytes = static_cast<std::size_t>(workspace_limit_bytes);
    o.max_logits_share = static_cast<float>(max_logits_share);  // lce checks it: in [0, 1]
    // Every gradient op returns fresh grad_weight / grad_bias tensors: lce writes them
    // whole, so they are never zeroed first (a [V, H] pass, and a read of it, saved).
    o.overwrite_weight_gradients = true;
    return o;
  }

  // lce holds temperature and softcap as float32: a finite value that float32 would hold
  // as 0, a subnormal or inf (|v| outside 1.2e-38 .. 3.4e38) raises here, naming the value
  // passed, rather than turning the soft-cap off or the logits to NaN. (NaN, inf and signs
  // are lce's to judge.)
  static float as_float(double v, const char* name) {
    const float f = static_cast<float>(v);
    TORCH_CHECK(!std::isfinite(v) || v == 0 || std::isnormal(f), "lce: options.", name, " = ", v,
                " does not fit a normal float32, which lce holds it in (magnitudes from ",
                std::numeric_limits<float>::min(), " to ", std::numeric_limits<float>::max(), ")");
    return f;
  }
};

// Whether two option sets make the same operator.
inline bool same_options(const lce::options& a, const lce::options& b) {
  return a.vocab_start == b.vocab_start && a.ignore_index == b.ignore_index && a.temperature == b.temperature &&
         a.softcap == b.softcap && a.sequence_parallel == b.sequence_parallel && a.chunk_tokens == b.chunk_tokens &&
         a.workspace_limit_bytes == b.workspace_limit_bytes && a.max_logits_share == b.max_logits_share &&
         a.overwrite_weight_gradients == b.overwrite_weight_gradients;
}

// This thread's operators of one type, by options and a device's key (a
// group and thread count, a device and stream): at most 8, the oldest going
// first. A CUDA operator evicted and made again costs a cuBLAS handle's
// destruction and creation and the device synchronisation that comes with
// them: code cycling through more than 8 streams or option sets pays it on
// every call.
template <class Op, class Key>
class operator_table {
 public:
  template <class Make>
  Op& get(const lce::options& o, const Key& key, Make&& make) {
    for (auto& e : entries_)
      if (e.key == key && same_options(e.options, o)) return *e.op;
    if (entries_.size() >= 8) entries_.erase(entries_.begin());
    entries_.push_back({o, key, make()});
    return *entries_.back().op;
  }

 private:
  struct entry {
    lce::options options;
    Key key;
    std::unique_ptr<Op> op;
  };
  std::vector<entry> entries_;
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

// grad_weight: a fresh [V, H] block, left unset: the operator writes it whole
// (options.overwrite_weight_gradients, set by config::to_options).
inline at::Tensor weight_gradient(std::int64_t rows, std::int64_t cols, const at::TensorOptions& options) {
  return at::empty({rows, cols}, options.memory_format(at::MemoryFormat::Contiguous));
}

// A 1-D unit-stride tensor of the same elements (per-token vectors; small).
inline at::Tensor as_vector(const at::Tensor& x) {
  at::Tensor v = x.reshape({-1});
  if (v.numel() > 1 && v.stride(0) != 1) v = v.contiguous();
  return v;
}

// Per-token inputs (lse, grad_logprobs, grad_entropy) in the result dtype, on
// the device of hidden.
inline at::Tensor per_token(const at::Tensor& x, at::ScalarType result, std::int64_t n, const char* name,
                            const at::Device& device) {
  TORCH_CHECK(x.device() == device, "lce_torch: ", name, " must be on ", device, " with hidden, got ", x.device());
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


// Gives the scratch back after a call (also when it raised) unless keep_workspace().
template <class Op>
struct workspace_release {
  Op& op;
  ~workspace_release() {
    if (!keep_workspace()) op.release_workspace();
  }
};


// Calls f with the targets as an lce vector view of int32 or int64.
template <class F>
decltype(auto) with_targets(const at::Tensor& t, F&& f) {
  if (t.scalar_type() == at::kInt) return f(vector_of<const std::int32_t>(t));
  return f(vector_of<const std::int64_t>(t));
}


inline bool given(const std::optional<at::Tensor>& t) { return t && t->defined(); }

// An empty lce view (the row term is absent) or the tensor's.
template <class E>
lce::vector_view<E> optional_vector(const at::Tensor& t) {
  return t.defined() ? vector_of<E>(t) : lce::vector_view<E>{};
}


// The head's optional bias [V_r] (weight's dtype and device) as a unit-stride
// vector, or an undefined tensor without one.
inline at::Tensor bias_vector(const std::optional<at::Tensor>& bias, const at::Tensor& weight) {
  if (!given(bias)) return {};
  const at::Tensor& b = *bias;
  TORCH_CHECK(b.dim() == 1 && weight.dim() == 2 && b.size(0) == weight.size(0), "lce_torch: bias must be [V_local] = [",
              weight.dim() == 2 ? weight.size(0) : -1, "] (one entry per row of weight), got ", b.sizes());
  TORCH_CHECK_TYPE(b.scalar_type() == weight.scalar_type(), "lce_torch: bias (", b.scalar_type(),
                   ") must have the dtype of weight (", weight.scalar_type(), ")");
  TORCH_CHECK(b.device() == weight.device(), "lce_torch: bias must be on ", weight.device(), " with weight, got ",
              b.device());
  return as_vector(b);
}

// The head lce is handed (or its gradient): the weight with_bias its bias of
// elements B or, without one, an empty view (lce's plain head, bit for bit:
// one instantiation serves both).
template <class B, class E>
auto head_of(const lce::matrix_view<E>& weight, const at::Tensor& bias) {
  return lce::with_bias{weight, optional_vector<B>(bias)};
}

// grad_bias in the compute type R, left unset as grad_weight above, or undefined without a bias.
template <class R>
at::Tensor bias_gradient(const at::Tensor& bias) {
  return bias.defined() ? at::empty({bias.numel()}, bias.options().dtype(c10::CppTypeToScalarType<R>::value))
                        : at::Tensor();
}

// What a gradient op returns for the bias: grad_bias in the bias's dtype, or [0].
inline at::Tensor bias_gradient_result(const at::Tensor& grad_bias, const at::Tensor& bias, const at::Tensor& weight) {
  return bias.defined() ? grad_bias.to(bias.scalar_type()) : at::empty({0}, weight.options());
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
inline at::Tensor per_id(const at::Tensor& x, at::ScalarType result, const sets_view& s, const char* name,
                         const at::Device& device) {
  TORCH_CHECK(x.device() == device, "lce_torch: ", name, " must be on ", device, " with hidden, got ", x.device());
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


}  // namespace lce_torch
