// A backend shaped like lce::cuda_backend as far as the engine can tell at
// compile time and in its plan: cuda_backend's own plan traits
// (lce::detail::cuda_plan_traits: GEMMs that read 2-byte rows as stored, dz
// recomputed in the gradient pass, int GEMM extents, dW tiles with no
// scratch), the optional concepts' signatures (dX with beta, dW straight into a
// grad_weight of the operand type, the accumulator rounded in by the last
// chunk), and two parameters to compare: the memory space (device by default)
// and the vocabulary-order block bound (cuda_backend's by default). Nothing here runs: allocation fails and every pass is empty.
// Used where a device-style backend is needed without nvcc (the workspace-plan
// tests, the compile-fail test pairing it with a host communicator).
#pragma once

#include <lce/cuda/detail/plan_traits.hpp>
#include <lce/lce.hpp>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <new>

namespace lce_test {

template <class MemorySpace = lce::device_memory,
          std::size_t VocabularyBlockBytes = lce::detail::cuda_plan_traits::vocabulary_block_bytes>
struct device_shaped_backend : lce::detail::cuda_plan_traits {
  using memory_space = MemorySpace;
  static constexpr std::size_t vocabulary_block_bytes = VocabularyBlockBytes;

  void* allocate(std::size_t) { throw std::bad_alloc(); }
  void deallocate(void*, std::size_t) noexcept {}
  template <class T>
  std::int64_t weight_block_elements(std::int64_t, std::int64_t) const {
    return 0;
  }
  template <class In, class A>
  void logits(lce::matrix_view<const In>, lce::matrix_view<const In>, A, lce::matrix_view<A>, void*) {}
  template <class In, class A>
  void grad_hidden(lce::matrix_view<const In>, lce::matrix_view<const In>, A, lce::matrix_view<A>, void*,
                   A = A(0)) {}
  template <class In, class A>
  void grad_weight(lce::matrix_view<const In>, lce::matrix_view<const In>, A, lce::matrix_view<A>) {}
  template <class O, class A, class G>
    requires(!std::same_as<A, G> && std::same_as<O, G>)
  void grad_weight(lce::matrix_view<const O>, lce::matrix_view<const O>, A, lce::matrix_view<G>, A*) {}
  template <class O, class A, class G>
    requires(!std::same_as<A, G>)
  void grad_weight(lce::matrix_view<const O>, lce::matrix_view<const O>, A, lce::matrix_view<A>, A,
                   lce::matrix_view<G>) {}
  template <class From, class To>
  void copy(lce::matrix_view<From>, lce::matrix_view<To>) {}
  template <class From, class To>
  void copy(lce::vector_view<From>, lce::vector_view<To>) {}
  template <class From, class To>
  void add(lce::matrix_view<From>, lce::matrix_view<To>) {}
  template <class A>
  void fill_zero(lce::matrix_view<A>) {}
  template <class A, class B>
  void add_bias(lce::matrix_view<A>, lce::vector_view<const B>, A) {}
  template <class O, class A>
  void column_sums(lce::matrix_view<const O>, A, lce::vector_view<A>) {}
  template <class A>
  void soft_cap(lce::matrix_view<A>, const lce::detail::soft_cap_map<A>&) {}
  template <class A, class I>
  void row_statistics(const lce::statistics_args<A, I>&) {}
  template <class A>
  void merge_partials(const lce::detail::row_partial<A>*, int, std::int64_t, std::int64_t,
                      lce::detail::row_partial<A>*) {}
  template <class A, class I>
  void finalize_rows(const lce::finalize_args<A, I>&, std::int64_t) {}
  template <class A, class I>
  void mean_centred_logits(const lce::mean_centred_logit_args<A, I>&) {}
  template <class A, class I, class Out>
  void logit_gradients(const lce::gradient_args<A, I, Out>&) {}
  template <class A, class I>
  void target_set_rows(const lce::target_set_args<A, I>&, std::int64_t) {}
  template <class A, class I>
  void target_set_logits(const lce::target_set_args<A, I>&, std::int64_t) {}
  template <class A, class I>
  void target_set_logprobs(const lce::target_set_args<A, I>&, std::int64_t) {}
};

}  // namespace lce_test
