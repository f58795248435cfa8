// A communicator over host memory (lce::comm::threads) with a backend whose
// buffers live on a device (as lce::cuda_backend's do): a readable compile
// error, not a crash at the first collective. The control variant gives the
// same backend host memory, and compiles.
// expect: the communicator's collectives must work on the backend's memory
#include <lce/comm/threads.hpp>
#include <lce/lce.hpp>

#include <cstddef>
#include <cstdint>

struct device_like_backend {
#ifdef LCE_COMPILE_FAIL_CONTROL
  using memory_space = lce::host_memory;
#else
  using memory_space = lce::device_memory;
#endif
  template <class T>
  using gemm_operand = T;
  static constexpr bool reuses_exp_block = false;

  void* allocate(std::size_t) { return nullptr; }
  void deallocate(void*, std::size_t) noexcept {}
  template <class T>
  std::int64_t weight_block_elements(std::int64_t, std::int64_t) const { return 0; }
  template <class In, class A>
  void logits(lce::matrix_view<const In>, lce::matrix_view<const In>, A, lce::matrix_view<A>, void*) {}
  template <class In, class A>
  void grad_hidden(lce::matrix_view<const In>, lce::matrix_view<const In>, A, lce::matrix_view<A>, void*) {}
  template <class In, class A>
  void grad_weight(lce::matrix_view<const In>, lce::matrix_view<const In>, A, lce::matrix_view<A>) {}
  template <class From, class To>
  void copy(lce::matrix_view<From>, lce::matrix_view<To>) {}
  template <class From, class To>
  void copy(lce::vector_view<From>, lce::vector_view<To>) {}
  template <class From, class To>
  void add(lce::matrix_view<From>, lce::matrix_view<To>) {}
  template <class A>
  void fill_zero(lce::matrix_view<A>) {}
  template <class A>
  void soft_cap(lce::matrix_view<A>, const lce::detail::soft_cap_map<A>&) {}
  template <class A, class I>
  void row_statistics(const lce::statistics_args<A, I>&) {}
  template <class A>
  void merge_partials(const lce::detail::row_partial<A>*, int, std::int64_t, lce::detail::row_partial<A>*) {}
  template <class A, class I>
  void finalize_rows(const lce::finalize_args<A, I>&, std::int64_t) {}
  template <class A, class I>
  void mean_centred_logits(const lce::mean_centred_logit_args<A, I>&) {}
  template <class A, class I, class Out>
  void logit_gradients(const lce::gradient_args<A, I, Out>&) {}
};
static_assert(lce::backend<device_like_backend>, "the fake backend must satisfy the concept: the failure is the memory");

using op_t = lce::ChunkedHiddenToLogprobs<lce::comm::threads, lce::bfloat16, lce::budget_chunk, device_like_backend>;

std::size_t size() { return sizeof(op_t); }
