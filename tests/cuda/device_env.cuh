// The CUDA Env of the shared test bodies (tests/cases/*.hpp): an operator
// over lce::cuda_backend behind the host operator's interface.
//
// device_op<T>::forward(host views...) mirrors every view on the device
// (the whole span the view covers, row padding included, between two guard
// zones of the harness's pad byte), calls the device operator on the test's
// stream with device views of the same shape and leading dimension,
// synchronises, and then, error or not:
//   - copies every writable view's span back over the host buffer, so the
//     harness's checks (values, row padding intact, "nothing written" after
//     an lce::error, grad_weight accumulated onto its prefill) see exactly
//     what the device holds;
//   - checks that no input's device copy changed and that no guard zone
//     was written (a write before the first or past the last element).
// Uploads, the call and the downloads are ordered on one non-blocking stream
// and nothing synchronises in between: the operator must be stream-ordered.
#pragma once

#include <lce/cuda.cuh>

#include "cases/host_env.hpp"

#include <cuda_runtime.h>

#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace lce_test {

inline void cuda_check(cudaError_t status, const char* call) {
  if (status != cudaSuccess)
    throw std::runtime_error(std::string("test harness: ") + call + " failed: " + cudaGetErrorName(status) + " (" +
                             cudaGetErrorString(status) + ")");
}
#define LCE_T_CUDA(call) ::lce_test::cuda_check((call), #call)

// The stream every device operator of the suite runs on.
inline cudaStream_t test_stream() {
  static const cudaStream_t stream = [] {
    cudaStream_t s = nullptr;
    LCE_T_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    return s;
  }();
  return stream;
}

// A device allocation, freed on scope exit.
struct device_buffer {
  void* pointer = nullptr;
  std::size_t bytes = 0;
  device_buffer() = default;
  explicit device_buffer(std::size_t n) : bytes(n) { LCE_T_CUDA(cudaMalloc(&pointer, n > 0 ? n : 1)); }
  device_buffer(device_buffer&& o) noexcept
      : pointer(std::exchange(o.pointer, nullptr)), bytes(std::exchange(o.bytes, 0)) {}
  device_buffer& operator=(device_buffer&& o) noexcept {
    std::swap(pointer, o.pointer);
    std::swap(bytes, o.bytes);
    return *this;
  }
  ~device_buffer() {
    if (pointer) (void)cudaFree(pointer);
  }
  template <class E>
  E* as() const {
    return static_cast<E*>(pointer);
  }
};

inline constexpr std::size_t device_guard_bytes = 256;  // keeps the mirrored data 256-byte aligned

// One host span of `count` elements (E const: an input) mirrored on the device.
template <class E>
class mirrored_span {
 public:
  mirrored_span(E* host, std::size_t count, const char* what)
      : host_(host), count_(count), what_(what) {
    if (!host_) return;  // a null view stays null on the device
    buffer_ = device_buffer(bytes() + 2 * device_guard_bytes);
    LCE_T_CUDA(cudaMemsetAsync(buffer_.pointer, pad_byte, buffer_.bytes, test_stream()));
    if (count_ > 0)
      LCE_T_CUDA(cudaMemcpyAsync(buffer_.as<unsigned char>() + device_guard_bytes, host_, bytes(),
                                 cudaMemcpyHostToDevice, test_stream()));
  }
  mirrored_span(mirrored_span&&) noexcept = default;

  E* device() const {
    return host_ ? reinterpret_cast<E*>(buffer_.as<unsigned char>() + device_guard_bytes) : nullptr;
  }

  // After the stream is synchronised.
  void finish() {
    if (!host_) return;
    std::vector<unsigned char> all(buffer_.bytes);
    LCE_T_CUDA(cudaMemcpy(all.data(), buffer_.pointer, all.size(), cudaMemcpyDeviceToHost));
    bool guards = true;
    for (std::size_t k = 0; k < device_guard_bytes; ++k)
      guards = guards && all[k] == pad_byte && all[all.size() - 1 - k] == pad_byte;
    CHECK_MESSAGE(guards, "device: a write before or after the span of '" << what_ << "'");
    const unsigned char* data = all.data() + device_guard_bytes;
    if constexpr (std::is_const_v<E>) {
      CHECK_MESSAGE(std::memcmp(data, static_cast<const void*>(host_), bytes()) == 0,
                    "device: input '" << what_ << "' was modified");
    } else {
      std::memcpy(static_cast<void*>(host_), data, bytes());
    }
  }

 private:
  std::size_t bytes() const { return count_ * sizeof(E); }
  E* host_;
  std::size_t count_;
  const char* what_;
  device_buffer buffer_;
};

// Elements a view spans: (rows - 1) * ld + cols (0 when empty).
template <class E>
std::size_t span_of(const lce::matrix_view<E>& v) {
  if (v.rows <= 0 || v.cols <= 0) return 0;
  const std::int64_t span = (v.rows - 1) * v.ld + v.cols;
  return span > 0 ? static_cast<std::size_t>(span) : 0;
}
template <class E>
std::size_t span_of(const lce::vector_view<E>& v) {
  return v.size > 0 ? static_cast<std::size_t>(v.size) : 0;
}

template <class E>
struct mirrored_matrix {
  lce::matrix_view<E> host;
  mirrored_span<E> span;
  lce::matrix_view<E> view() const { return {span.device(), host.rows, host.cols, host.ld}; }
  void finish() { span.finish(); }
};
template <class E>
struct mirrored_vector {
  lce::vector_view<E> host;
  mirrored_span<E> span;
  lce::vector_view<E> view() const { return {span.device(), host.size}; }
  void finish() { span.finish(); }
};

template <class E>
mirrored_matrix<E> mirror(const lce::matrix_view<E>& v, const char* what) {
  return {v, mirrored_span<E>(v.data, span_of(v), what)};
}
template <class E>
mirrored_vector<E> mirror(const lce::vector_view<E>& v, const char* what) {
  return {v, mirrored_span<E>(v.data, span_of(v), what)};
}

// Target-set calls take their per-token views in a struct: each member mirrored.
template <class E>
struct mirrored_set_outputs {
  mirrored_matrix<E> logprobs;
  mirrored_vector<E> lse, entropy, mean_logit;
  lce::target_set_outputs<E> view() const { return {logprobs.view(), lse.view(), entropy.view(), mean_logit.view()}; }
  void finish() {
    logprobs.finish();
    lse.finish();
    entropy.finish();
    mean_logit.finish();
  }
};
template <class E>
mirrored_set_outputs<E> mirror(const lce::target_set_outputs<E>& o, const char*) {
  return {mirror(o.logprobs, "logprobs"), mirror(o.lse, "lse"), mirror(o.entropy, "entropy"),
          mirror(o.mean_logit, "mean_logit")};
}
template <class E>
struct mirrored_set_gradients {
  mirrored_matrix<const E> logprobs;
  mirrored_vector<const E> entropy, lse, mean_logit;
  lce::target_set_gradients<E> view() const {
    return {logprobs.view(), entropy.view(), lse.view(), mean_logit.view()};
  }
  void finish() {
    logprobs.finish();
    entropy.finish();
    lse.finish();
    mean_logit.finish();
  }
};
template <class E>
mirrored_set_gradients<E> mirror(const lce::target_set_gradients<E>& g, const char*) {
  return {mirror(g.logprobs, "grad_logprobs"), mirror(g.entropy, "grad_entropy"), mirror(g.lse, "grad_lse"),
          mirror(g.mean_logit, "grad_mean_logit")};
}

// A head with its bias (lce::with_bias): the weight, or grad_weight, and its bias mirrored.
template <class WE, class BE>
struct mirrored_head {
  mirrored_matrix<WE> weight;
  mirrored_vector<BE> bias;
  auto view() const { return lce::with_bias{weight.view(), bias.view()}; }
  void finish() {
    weight.finish();
    bias.finish();
  }
};
template <class WE, class BE>
mirrored_head<WE, BE> mirror(const lce::with_bias<lce::matrix_view<WE>, lce::vector_view<BE>>& head, const char* what) {
  const bool gradient = std::string(what) == "grad_weight";
  return {mirror(head.weight, what), mirror(head.bias, gradient ? "grad_bias" : "bias")};
}

// The device operator behind the host operator's interface (see above).
template <class T, class Chunk = lce::budget_chunk>
class device_op {
 public:
  using op_type = lce::ChunkedHiddenToLogprobs<lce::comm::single, T, Chunk, lce::cuda_backend>;
  using backend_type = lce::cuda_backend;

  explicit device_op(const lce::options& opt, lce::cuda_backend_options backend_options = {})
      : op_(lce::comm::single{}, opt, lce::cuda_backend{test_stream(), backend_options}) {}

  template <class... Views>
  void forward(const Views&... views) {
    static constexpr const char* names[] = {"hidden", "weight", "targets", "logprobs", "lse", "entropy", "", ""};
    call([this](const auto&... d) { op_.forward(d...); }, names, views...);
  }
  template <class... Views>
  void backward(const Views&... views) {
    static constexpr const char* with_entropy[] = {"hidden",        "weight",       "targets",     "lse",
                                                   "grad_logprobs", "grad_entropy", "grad_hidden", "grad_weight"};
    static constexpr const char* without[] = {"hidden",        "weight",      "targets",    "lse",
                                              "grad_logprobs", "grad_hidden", "grad_weight", ""};
    call([this](const auto&... d) { op_.backward(d...); }, sizeof...(Views) == 8 ? with_entropy : without,
         views...);
  }
  template <class... Views>
  void forward_backward(const Views&... views) {
    static constexpr const char* names[] = {"hidden",   "weight",      "targets",     "grad_logprobs",
                                            "logprobs", "grad_hidden", "grad_weight", ""};
    call([this](const auto&... d) { op_.forward_backward(d...); }, names, views...);
  }

  std::size_t workspace_bytes(std::int64_t n, std::int64_t h, std::int64_t v) const {
    return op_.workspace_bytes(n, h, v);
  }
  std::int64_t chunk_tokens(std::int64_t n, std::int64_t h, std::int64_t v) const {
    return op_.chunk_tokens(n, h, v);
  }
  std::size_t held_workspace_bytes() const { return op_.held_workspace_bytes(); }
  op_type& device() { return op_; }

 private:
  template <class F, class... Views, std::size_t... I>
  void call_impl(F&& f, const char* const* names, std::index_sequence<I...>, const Views&... views) {
    static_assert(sizeof...(Views) <= 8, "device_op: the entry points take at most 8 views");
    auto mirrors = std::make_tuple(mirror(views, names[I])...);
    std::exception_ptr failure;
    try {
      std::apply([&](const auto&... m) { f(m.view()...); }, mirrors);
    } catch (...) {
      failure = std::current_exception();
    }
    // Whatever happened, what the device holds comes back (an lce::error must
    // leave the outputs as they were: the host checks that on these bytes).
    LCE_T_CUDA(cudaStreamSynchronize(test_stream()));
    std::apply([](auto&... m) { (m.finish(), ...); }, mirrors);
    if (failure) std::rethrow_exception(failure);
  }
  template <class F, class... Views>
  void call(F&& f, const char* const* names, const Views&... views) {
    call_impl(std::forward<F>(f), names, std::index_sequence_for<Views...>{}, views...);
  }

  op_type op_;
};

struct cuda_env {
  static constexpr const char* name = "cuda";

  template <class T, class Chunk = lce::budget_chunk>
  static device_op<T, Chunk> make_op(const lce::options& opt, int /*threads: the host's only*/ = 0) {
    return device_op<T, Chunk>(opt);
  }

  // With 2-byte T, lce::cuda_backend rounds dz to T before the two gradient
  // GEMMs (tensor cores take T x T): unit roundoff 2^-8 (bf16, 8 significant
  // bits) or 2^-11 (fp16, 11), and the absolute floor where T's subnormals
  // begin: half the subnormal spacing, 2^-134 (bf16) or 2^-25 (fp16). The
  // tolerance this adds is derived in support/reference.hpp
  // (reference_operand_rounding_bounds). fp32 and double keep dz as computed.
  template <class T>
  static constexpr double gradient_operand_unit =
      std::is_same_v<T, lce::bfloat16> ? 0x1p-8 : std::is_same_v<T, lce::float16> ? 0x1p-11 : 0.0;
  template <class T>
  static constexpr double gradient_operand_floor =
      std::is_same_v<T, lce::bfloat16> ? 0x1p-134 : std::is_same_v<T, lce::float16> ? 0x1p-25 : 0.0;
};

}  // namespace lce_test
