#pragma once
// Non-owning views of the caller's tensors, and the concepts through which
// the operator accepts any equivalent view (lce's own, cuda::std::mdspan,
// std::mdspan).
//
// Rows are contiguous (unit inner stride); consecutive rows are `ld`
// elements apart, so a slice of a wider buffer can be passed as is.

#include <lce/core/config.hpp>
#include <lce/core/error.hpp>

#include <concepts>
#include <cstdint>
#include <type_traits>

LCE_BEGIN_NAMESPACE

template <class T>
struct matrix_view {
  using element_type = T;
  T* data = nullptr;
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::int64_t ld = cols;

  LCE_HOST_DEVICE constexpr T* row(std::int64_t r) const { return data + r * ld; }
  LCE_HOST_DEVICE constexpr matrix_view rows_slice(std::int64_t first, std::int64_t count) const {
    return {data + first * ld, count, cols, ld};
  }
  // Implicit view-of-const, as T* converts to const T*.
  template <class U>
    requires(std::is_same_v<U, const T> && !std::is_const_v<T>)
  constexpr operator matrix_view<U>() const {
    return {data, rows, cols, ld};
  }
};

template <class T>
struct vector_view {
  using element_type = T;
  T* data = nullptr;
  std::int64_t size = 0;

  LCE_HOST_DEVICE constexpr T& operator[](std::int64_t i) const { return data[i]; }
  LCE_HOST_DEVICE constexpr vector_view slice(std::int64_t first, std::int64_t count) const {
    return {data + first, count};
  }
  template <class U>
    requires(std::is_same_v<U, const T> && !std::is_const_v<T>)
  constexpr operator vector_view<U>() const {
    return {data, size};
  }
};

namespace detail {

template <class V>
inline constexpr bool is_lce_matrix_view = false;
template <class T>
inline constexpr bool is_lce_matrix_view<matrix_view<T>> = true;

template <class V>
inline constexpr bool is_lce_vector_view = false;
template <class T>
inline constexpr bool is_lce_vector_view<vector_view<T>> = true;

}  // namespace detail

// Anything shaped like std::mdspan over plain memory: cuda::std::mdspan and
// std::mdspan both qualify, without lce including either header.
template <class V>
concept mdspan_over_pointer = requires(const V& view) {
  typename V::element_type;
  typename V::extents_type;
  { V::extents_type::rank() } -> std::convertible_to<std::size_t>;
  { view.data_handle() } -> std::convertible_to<typename V::element_type*>;
  { view.extent(0) } -> std::integral;
  { view.stride(0) } -> std::integral;
};

template <class V>
concept matrix_like = detail::is_lce_matrix_view<std::remove_cvref_t<V>> ||
                      (mdspan_over_pointer<std::remove_cvref_t<V>> &&
                       std::remove_cvref_t<V>::extents_type::rank() == 2);

template <class V>
concept vector_like = detail::is_lce_vector_view<std::remove_cvref_t<V>> ||
                      (mdspan_over_pointer<std::remove_cvref_t<V>> &&
                       std::remove_cvref_t<V>::extents_type::rank() == 1);

template <class V>
using element_of = typename std::remove_cvref_t<V>::element_type;

template <class V>
using value_of = std::remove_const_t<element_of<V>>;

namespace detail {

// Brings any accepted view to lce's own, checking what lce's views cannot
// express: a unit inner stride. `name` is the API argument name for messages.
template <matrix_like V>
matrix_view<element_of<V>> to_matrix_view(const V& view, const char* name) {
  using U = std::remove_cvref_t<V>;
  if constexpr (is_lce_matrix_view<U>) {
    return view;
  } else {
    const auto rows = static_cast<std::int64_t>(view.extent(0));
    const auto cols = static_cast<std::int64_t>(view.extent(1));
    // An empty extent makes strides meaningless; any layout of nothing is fine.
    if (rows > 0 && cols > 1) {
      expects(view.stride(1) == 1, name, ": the inner (column) stride must be 1, got ", view.stride(1),
              " (shape ", rows, " x ", cols, ")");
    }
    const auto ld = rows > 1 ? static_cast<std::int64_t>(view.stride(0)) : cols;
    return {view.data_handle(), rows, cols, ld};
  }
}

template <vector_like V>
vector_view<element_of<V>> to_vector_view(const V& view, const char* name) {
  using U = std::remove_cvref_t<V>;
  if constexpr (is_lce_vector_view<U>) {
    return view;
  } else {
    const auto size = static_cast<std::int64_t>(view.extent(0));
    if (size > 1) {
      expects(view.stride(0) == 1, name, ": the stride must be 1, got ", view.stride(0), " (size ", size, ")");
    }
    return {view.data_handle(), size};
  }
}

}  // namespace detail

LCE_END_NAMESPACE
