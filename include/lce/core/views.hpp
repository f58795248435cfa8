#pragma once
// Non-owning views of the caller's tensors, and the customisation point
// through which the operator accepts any equivalent view without a copy:
// lce's own matrix_view / vector_view, std::span, cuda::std::mdspan and
// std::mdspan built in, and any other type for which the user specialises
// lce::view_traits (below; docs/views.md).
//
// Rows are contiguous (unit inner stride); consecutive rows are `ld`
// elements apart, so a slice of a wider buffer can be passed as is.

#include <lce/core/config.hpp>
#include <lce/core/error.hpp>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <utility>

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

// ===========================================================================
// Your own tensor types: lce::view_traits<V>
// ===========================================================================
// lce reads every matrix and vector argument through view_traits<V>, V being
// the argument's type without const or reference. Specialise it for a type of
// yours and lce takes that type as it is, reading and writing its memory in
// place (no copy):
//
//   template <>
//   struct lce::view_traits<my::matrix> {
//     using element_type = const float;   // const: read-only (inputs)
//     static constexpr int rank = 2;      // 2: a matrix, 1: a vector
//     static element_type* data(const my::matrix& m) { return m.data(); }
//     static std::int64_t extent(const my::matrix& m, int i) { return i == 0 ? m.rows() : m.cols(); }
//     static std::int64_t stride(const my::matrix& m, int i) { return i == 0 ? m.cols() : 1; }
//   };
//
//   element_type  the element: T of the operator (float, double,
//                 lce::bfloat16, lce::float16), std::int32_t / std::int64_t
//                 for targets, float / double for per-token values; const for
//                 read-only memory (outputs need a non-const element_type)
//   rank          2 for hidden, weight and gradients; 1 for per-token vectors
//   data(v)       element_type*: the first element, used as is
//   extent(v, i)  rank 2: rows (i = 0), columns (i = 1); rank 1: the size (i = 0)
//   stride(v, i)  in elements, as std::mdspan's stride(i): rank 2: stride(v, 0)
//                 is the distance between rows (the leading dimension, ld),
//                 stride(v, 1) the distance between columns, which must be 1;
//                 rank 1: stride(v, 0), which must be 1
//
// extent and stride may return any integer type. Only the last dimension must
// be contiguous: an inner stride other than 1 is refused at run time with an
// lce::error that names the argument (a column-major matrix is such a case).
// Declare the specialisation right after the type, before any use with lce.
//
// Built in: lce::matrix_view, lce::vector_view, std::span (rank 1), and any
// mdspan-shaped type (data_handle(), extent(i), stride(i), extents_type:
// cuda::std::mdspan, std::mdspan) over a plain-pointer accessor and a strided
// layout (layout_right; layout_stride with unit inner stride).
//
// What goes wrong reads as a static_assert starting "lce:" in
// detail::to_matrix_view / to_vector_view: a type that looks like a tensor
// (has data() or data_handle()) but has no view_traits, an incomplete
// specialisation, an mdspan with a custom accessor or an unstrided layout, or
// a view of the wrong rank (a 3-D mdspan). Types that look like no tensor at
// all, and vectors passed for matrices (or the reverse), fail the concepts
// matrix_like / vector_like instead.
template <class V>
struct view_traits {
  // The primary template: V is not adapted. Specialise view_traits<V>.
  using lce_unspecialised = void;
};

template <class T>
struct view_traits<matrix_view<T>> {
  using element_type = T;
  static constexpr int rank = 2;
  LCE_HOST_DEVICE static constexpr T* data(const matrix_view<T>& v) { return v.data; }
  LCE_HOST_DEVICE static constexpr std::int64_t extent(const matrix_view<T>& v, int i) {
    return i == 0 ? v.rows : v.cols;
  }
  LCE_HOST_DEVICE static constexpr std::int64_t stride(const matrix_view<T>& v, int i) { return i == 0 ? v.ld : 1; }
};

template <class T>
struct view_traits<vector_view<T>> {
  using element_type = T;
  static constexpr int rank = 1;
  LCE_HOST_DEVICE static constexpr T* data(const vector_view<T>& v) { return v.data; }
  LCE_HOST_DEVICE static constexpr std::int64_t extent(const vector_view<T>& v, int) { return v.size; }
  LCE_HOST_DEVICE static constexpr std::int64_t stride(const vector_view<T>&, int) { return 1; }
};

template <class T, std::size_t Extent>
struct view_traits<std::span<T, Extent>> {
  using element_type = T;
  static constexpr int rank = 1;
  static constexpr T* data(const std::span<T, Extent>& v) { return v.data(); }
  static constexpr std::int64_t extent(const std::span<T, Extent>& v, int) {
    return static_cast<std::int64_t>(v.size());
  }
  static constexpr std::int64_t stride(const std::span<T, Extent>&, int) { return 1; }
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

// Shaped like std::mdspan (cuda::std::mdspan and std::mdspan both are),
// without lce including either header.
template <class V>
concept mdspan_shaped = requires(const V& view) {
  typename V::element_type;
  typename V::extents_type;
  { V::extents_type::rank() } -> std::convertible_to<std::size_t>;
  view.data_handle();
  { view.extent(0) } -> std::integral;
  { view.stride(0) } -> std::integral;
};

// default_accessor and its like: the handle is element_type*, an access is
// an element_type& (no proxy, no scaling, no fancy pointer).
template <class V>
concept mdspan_plain_accessor =
    std::is_same_v<std::remove_cvref_t<decltype(std::declval<const V&>().data_handle())>,
                   typename V::element_type*> &&
    (!requires { typename V::reference; } || std::is_same_v<typename V::reference, typename V::element_type&>);

template <class V>
concept mdspan_strided_layout = !requires { typename V::mapping_type; } || V::mapping_type::is_always_strided();

}  // namespace detail

// Any mdspan-shaped type. What lce cannot use (a custom accessor, a layout
// that is not strided, a rank other than 1 or 2) is refused at compile time
// by the conversions below, with a message that says so.
template <class V>
  requires detail::mdspan_shaped<V>
struct view_traits<V> {
  using lce_from_mdspan = void;
  using element_type = typename V::element_type;
  static constexpr int rank = static_cast<int>(V::extents_type::rank());
  static constexpr auto data(const V& v) -> std::remove_cvref_t<decltype(v.data_handle())> {
    return v.data_handle();
  }
  static constexpr std::int64_t extent(const V& v, int i) { return static_cast<std::int64_t>(v.extent(i)); }
  static constexpr std::int64_t stride(const V& v, int i) { return static_cast<std::int64_t>(v.stride(i)); }
};

namespace detail {

template <class U>
concept view_traits_specialised = !requires { typename view_traits<U>::lce_unspecialised; };

// Everything a specialisation must give (see above).
template <class U>
concept view_traits_complete = view_traits_specialised<U> && requires(const U& view) {
  typename view_traits<U>::element_type;
  { view_traits<U>::rank } -> std::convertible_to<int>;
  view_traits<U>::data(view);
  { view_traits<U>::extent(view, 0) } -> std::convertible_to<std::int64_t>;
  { view_traits<U>::stride(view, 0) } -> std::convertible_to<std::int64_t>;
};

// A type that is not adapted but looks like a tensor: it gets through the
// concepts so that to_matrix_view / to_vector_view can say what it lacks.
template <class U>
concept looks_like_a_tensor = requires(const U& v) { v.data(); } || requires(const U& v) { v.data_handle(); };

// The element type: view_traits', else (for a type not adapted) the type's own
// element_type or what its data() points to.
template <class U>
struct guessed_element {};
template <class U>
  requires requires { typename U::element_type; }
struct guessed_element<U> {
  using type = typename U::element_type;
};
template <class U>
  requires(!requires { typename U::element_type; } &&
           requires(const U& v) { { v.data() } -> std::convertible_to<const volatile void*>; })
struct guessed_element<U> {
  using type = std::remove_pointer_t<decltype(std::declval<const U&>().data())>;
};

template <class U>
struct element_lookup : guessed_element<U> {};
template <class U>
  requires requires { typename view_traits<U>::element_type; }
struct element_lookup<U> {
  using type = typename view_traits<U>::element_type;
};

template <class U>
concept view_candidate =
    view_traits_complete<U> ||
    (requires { typename element_lookup<U>::type; } && (view_traits_specialised<U> || looks_like_a_tensor<U>));

// The rank when known; -1 for a candidate that is not adapted.
template <class U>
inline constexpr int rank_of = -1;
template <class U>
  requires view_traits_complete<U>
inline constexpr int rank_of<U> = static_cast<int>(view_traits<U>::rank);

// Named so that a failed constraint reads "!(is_rank_1_view<...>)".
template <class U>
concept is_rank_1_view = rank_of<U> == 1;
template <class U>
concept is_rank_2_view = rank_of<U> == 2;

}  // namespace detail

// matrix_like / vector_like: what the operator's matrix / vector parameters
// accept. Adapted views of rank 2 / rank 1 — and, so that the conversion can
// explain what is wrong in a static_assert, types that look like views but
// cannot be used (not adapted, incomplete traits, custom accessor, rank 3).
// A vector is never matrix_like, nor a matrix vector_like.
template <class V>
concept matrix_like = detail::view_candidate<std::remove_cvref_t<V>> && !detail::is_rank_1_view<std::remove_cvref_t<V>>;

template <class V>
concept vector_like = detail::view_candidate<std::remove_cvref_t<V>> && !detail::is_rank_2_view<std::remove_cvref_t<V>>;

template <class V>
using element_of = typename detail::element_lookup<std::remove_cvref_t<V>>::type;

template <class V>
using value_of = std::remove_const_t<element_of<V>>;

namespace detail {

enum class view_issue {
  none,
  not_adapted,
  incomplete_traits,
  custom_accessor,
  unstrided_layout,
  wrong_rank,
  data_not_pointer,
};

// The first thing that keeps U from being taken as a view of rank Rank.
template <class U, int Rank>
consteval view_issue first_view_issue() {
  if constexpr (!view_traits_complete<U>) {
    return view_traits_specialised<U> ? view_issue::incomplete_traits : view_issue::not_adapted;
  } else {
    constexpr bool from_mdspan = requires { typename view_traits<U>::lce_from_mdspan; };
    if constexpr (from_mdspan && !mdspan_plain_accessor<U>) {
      return view_issue::custom_accessor;
    } else if constexpr (from_mdspan && !mdspan_strided_layout<U>) {
      return view_issue::unstrided_layout;
    } else if constexpr (rank_of<U> != Rank) {
      return view_issue::wrong_rank;
    } else if constexpr (!std::is_convertible_v<decltype(view_traits<U>::data(std::declval<const U&>())),
                                               typename view_traits<U>::element_type*>) {
      return view_issue::data_not_pointer;
    } else {
      return view_issue::none;
    }
  }
}

// One static_assert per issue, so the compiler prints the one that applies.
template <view_issue Issue, int Rank>
constexpr void diagnose_view() {
  static_assert(Issue != view_issue::not_adapted,
                "lce: this argument's type is not a view lce knows: specialise lce::view_traits<YourType> "
                "(element_type, rank, data(v), extent(v, i), stride(v, i); see lce/core/views.hpp)");
  static_assert(Issue != view_issue::incomplete_traits,
                "lce: lce::view_traits<YourType> is incomplete: it needs element_type, static constexpr int rank, "
                "and static functions data(v), extent(v, i), stride(v, i) (see lce/core/views.hpp)");
  static_assert(Issue != view_issue::custom_accessor,
                "lce: mdspan with a custom accessor: only plain-pointer accessors (default_accessor) are supported");
  static_assert(Issue != view_issue::unstrided_layout,
                "lce: mdspan with a layout that is not strided: use layout_right, or layout_stride with unit "
                "inner stride");
  static_assert(Rank != 2 || Issue != view_issue::wrong_rank,
                "lce: a matrix argument must be a rank-2 view (rows x cols, unit inner stride); this one's rank is "
                "not 2");
  static_assert(Rank != 1 || Issue != view_issue::wrong_rank,
                "lce: a vector argument must be a rank-1 view (unit stride); this one's rank is not 1");
  static_assert(Issue != view_issue::data_not_pointer,
                "lce: lce::view_traits<YourType>::data(v) must return element_type* (the first element)");
}

}  // namespace detail

// Types lce takes as a matrix / vector with nothing left to check at compile
// time (the strides are checked at run time). For a user's static_assert.
template <class V>
concept viewable_matrix =
    matrix_like<V> && detail::first_view_issue<std::remove_cvref_t<V>, 2>() == detail::view_issue::none;

template <class V>
concept viewable_vector =
    vector_like<V> && detail::first_view_issue<std::remove_cvref_t<V>, 1>() == detail::view_issue::none;

// mdspan-shaped over plain memory (kept for code that named it).
template <class V>
concept mdspan_over_pointer = detail::mdspan_shaped<V> && detail::mdspan_plain_accessor<V>;

namespace detail {

// Brings any accepted view to lce's own, checking what lce's views cannot
// express: a unit inner stride. `name` is the API argument name for messages.
// Reads only view_traits<V>: the data pointer is the caller's, never a copy.
template <matrix_like V>
matrix_view<element_of<V>> to_matrix_view(const V& view, const char* name) {
  using U = std::remove_cvref_t<V>;
  if constexpr (is_lce_matrix_view<U>) {
    return view;
  } else {
    constexpr view_issue issue = first_view_issue<U, 2>();
    diagnose_view<issue, 2>();
    if constexpr (issue != view_issue::none) {
      return {};
    } else {
      using traits = view_traits<U>;
      const auto rows = static_cast<std::int64_t>(traits::extent(view, 0));
      const auto cols = static_cast<std::int64_t>(traits::extent(view, 1));
      // An empty extent makes strides meaningless; any layout of nothing is fine.
      if (rows > 0 && cols > 1) {
        const auto inner = static_cast<std::int64_t>(traits::stride(view, 1));
        expects(inner == 1, name, ": the inner (column) stride must be 1, got ", inner, " (shape ", rows, " x ",
                cols, "); rows must be contiguous (row-major)");
      }
      const auto ld = rows > 1 ? static_cast<std::int64_t>(traits::stride(view, 0)) : cols;
      return {traits::data(view), rows, cols, ld};
    }
  }
}

template <vector_like V>
vector_view<element_of<V>> to_vector_view(const V& view, const char* name) {
  using U = std::remove_cvref_t<V>;
  if constexpr (is_lce_vector_view<U>) {
    return view;
  } else {
    constexpr view_issue issue = first_view_issue<U, 1>();
    diagnose_view<issue, 1>();
    if constexpr (issue != view_issue::none) {
      return {};
    } else {
      using traits = view_traits<U>;
      const auto size = static_cast<std::int64_t>(traits::extent(view, 0));
      if (size > 1) {
        const auto stride = static_cast<std::int64_t>(traits::stride(view, 0));
        expects(stride == 1, name, ": the stride must be 1, got ", stride, " (size ", size, ")");
      }
      return {traits::data(view), size};
    }
  }
}

}  // namespace detail

LCE_END_NAMESPACE
