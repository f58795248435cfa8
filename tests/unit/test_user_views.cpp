// The customisation point lce::view_traits: a user's own tensor types (a plain
// struct, Eigen::Map, std::span) are taken in place, give bitwise the results
// of lce::matrix_view over the same memory, and bad layouts are refused with
// an lce::error naming the argument. Compile-time refusals are checked by the
// compile_fail.* tests (tests/compile_fail/).
#include "support/harness.hpp"

#include <span>

#if LCE_TESTS_HAVE_CCCL && __has_include(<cuda/std/mdspan>)
#include <cuda/std/mdspan>
#define LCE_T_UV_CUDA_MDSPAN 1
#endif
#if LCE_TESTS_HAVE_EIGEN
#include <Eigen/Core>
#endif

// ---------------------------------------------------------------------------
// A user's own types: rows()/cols()/data(), a row pitch, no element_type.
// ---------------------------------------------------------------------------
namespace user {

template <class E>
struct matrix {
  E* ptr = nullptr;
  long rows_ = 0, cols_ = 0, pitch = 0;
  long col_step = 1;  // 1 unless a test wants a non-contiguous row
  E* data() const { return ptr; }
  long rows() const { return rows_; }
  long cols() const { return cols_; }
};

template <class E>
struct vector {
  E* ptr = nullptr;
  std::size_t n = 0;
  E* data() const { return ptr; }
  std::size_t size() const { return n; }
};

// Counts the calls of view_traits<...>::data: the operator reads the pointer
// through the traits, never through a copy.
inline int data_calls = 0;

}  // namespace user

template <class E>
struct lce::view_traits<user::matrix<E>> {
  using element_type = E;
  static constexpr int rank = 2;
  static E* data(const user::matrix<E>& m) {
    ++user::data_calls;
    return m.data();
  }
  static long extent(const user::matrix<E>& m, int i) { return i == 0 ? m.rows() : m.cols(); }
  static long stride(const user::matrix<E>& m, int i) { return i == 0 ? m.pitch : m.col_step; }
};

template <class E>
struct lce::view_traits<user::vector<E>> {
  using element_type = E;
  static constexpr int rank = 1;
  static E* data(const user::vector<E>& v) { return v.data(); }
  static std::size_t extent(const user::vector<E>& v, int) { return v.size(); }
  static int stride(const user::vector<E>&, int) { return 1; }
};

#if LCE_TESTS_HAVE_EIGEN
// Any Eigen::Map of a dynamic matrix: the strides Eigen reports, in mdspan's
// terms. Row-major maps have unit inner stride; column-major ones do not and
// are refused at run time.
template <class S, int Options, int MapOptions, class Stride>
struct lce::view_traits<Eigen::Map<const Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic, Options>, MapOptions, Stride>> {
  using map = Eigen::Map<const Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic, Options>, MapOptions, Stride>;
  static constexpr bool row_major = (Options & Eigen::RowMajor) != 0;
  using element_type = const S;
  static constexpr int rank = 2;
  static const S* data(const map& m) { return m.data(); }
  static Eigen::Index extent(const map& m, int i) { return i == 0 ? m.rows() : m.cols(); }
  static Eigen::Index stride(const map& m, int i) {
    return (i == 0) == row_major ? m.outerStride() : m.innerStride();
  }
};
template <class S>
struct lce::view_traits<Eigen::Map<Eigen::Matrix<S, Eigen::Dynamic, 1>>> {
  using map = Eigen::Map<Eigen::Matrix<S, Eigen::Dynamic, 1>>;
  using element_type = S;
  static constexpr int rank = 1;
  // A const Map still maps writable memory (as a const pointer is not a pointer to const).
  static S* data(const map& v) { return const_cast<S*>(v.data()); }
  static Eigen::Index extent(const map& v, int) { return v.size(); }
  static Eigen::Index stride(const map& v, int) { return v.innerStride(); }
};
#endif

namespace {

using op_type = lce::ChunkedHiddenToLogprobs<lce::comm::single, float>;

// A small problem with values exact in float.
struct problem_data {
  std::int64_t n, h, v;
  std::vector<float> x, w;
  std::vector<std::int64_t> y;
  problem_data(std::int64_t n_, std::int64_t h_, std::int64_t v_, std::int64_t ld_x) : n(n_), h(h_), v(v_) {
    std::uint64_t s = 12345;
    auto next = [&] {
      s = s * 6364136223846793005ULL + 1442695040888963407ULL;
      return static_cast<float>(static_cast<int>((s >> 33) % 257) - 128) / 64.0f;
    };
    x.assign(static_cast<std::size_t>(n * ld_x), -7.0f);  // padding past h
    for (std::int64_t i = 0; i < n; ++i)
      for (std::int64_t k = 0; k < h; ++k) x[static_cast<std::size_t>(i * ld_x + k)] = next();
    w.resize(static_cast<std::size_t>(v * h));
    for (auto& e : w) e = next();
    y.resize(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i) y[static_cast<std::size_t>(i)] = (i * 7 + 3) % v;
    y[1] = -100;  // an ignored token
  }
};

template <class F>
std::vector<unsigned char> bytes_of(const std::vector<F>& v) {
  std::vector<unsigned char> b(v.size() * sizeof(F));
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

// forward() over lce's own views: the reference for every adapted type.
struct reference_forward {
  std::vector<float> lp, lse;
  reference_forward(const problem_data& d, std::int64_t ld_x) : lp(static_cast<std::size_t>(d.n)), lse(lp.size()) {
    op_type op{lce::comm::single{}, lce::options{.chunk_tokens = 4}};
    op.forward(lce::matrix_view<const float>{d.x.data(), d.n, d.h, ld_x},
               lce::matrix_view<const float>{d.w.data(), d.v, d.h}, lce::vector_view<const std::int64_t>{d.y.data(), d.n},
               lce::vector_view<float>{lp.data(), d.n}, lce::vector_view<float>{lse.data(), d.n});
  }
};

}  // namespace

// ---------------------------------------------------------------------------
// What the concepts say about each kind of type
// ---------------------------------------------------------------------------
static_assert(lce::viewable_matrix<user::matrix<const float>>);
static_assert(lce::viewable_matrix<const user::matrix<float>&>);
static_assert(!lce::vector_like<user::matrix<float>>, "a rank-2 view is not a vector");
static_assert(lce::viewable_vector<user::vector<float>>);
static_assert(!lce::matrix_like<user::vector<float>>, "a rank-1 view is not a matrix");
static_assert(std::is_same_v<lce::element_of<user::matrix<const float>>, const float>);
static_assert(std::is_same_v<lce::value_of<user::matrix<const float>>, float>);
static_assert(lce::viewable_matrix<lce::matrix_view<const float>> && lce::viewable_vector<lce::vector_view<float>>);
static_assert(lce::viewable_vector<std::span<const std::int64_t>> && lce::viewable_vector<std::span<float, 4>>);
static_assert(!lce::matrix_like<int> && !lce::vector_like<std::int64_t>, "no view at all: not even a candidate");

namespace user {
struct tensor_not_adapted {  // looks like a tensor, has no view_traits
  const float* data() const { return nullptr; }
};
}  // namespace user
// Let through the concept so that to_matrix_view's static_assert can say
// "specialise lce::view_traits<YourType>", but not viewable.
static_assert(lce::matrix_like<user::tensor_not_adapted> && !lce::viewable_matrix<user::tensor_not_adapted>);
static_assert(std::is_same_v<lce::value_of<user::tensor_not_adapted>, float>);

#if LCE_T_UV_CUDA_MDSPAN
namespace {
using uv_ext1 = cuda::std::dextents<std::int64_t, 1>;
using uv_ext2 = cuda::std::dextents<std::int64_t, 2>;
using uv_ext3 = cuda::std::dextents<std::int64_t, 3>;
template <class E>
struct scaling_accessor {  // not plain memory: an access returns a value
  using offset_policy = scaling_accessor;
  using element_type = E;
  using reference = std::remove_const_t<E>;
  using data_handle_type = E*;
  constexpr reference access(data_handle_type p, std::size_t i) const { return p[i] * 2; }
  constexpr data_handle_type offset(data_handle_type p, std::size_t i) const { return p + i; }
};
}  // namespace
static_assert(lce::viewable_matrix<cuda::std::mdspan<const float, uv_ext2>>);
static_assert(lce::viewable_matrix<cuda::std::mdspan<const float, uv_ext2, cuda::std::layout_stride>>);
static_assert(lce::viewable_vector<cuda::std::mdspan<float, uv_ext1>>);
static_assert(!lce::vector_like<cuda::std::mdspan<float, uv_ext2>> && !lce::matrix_like<cuda::std::mdspan<float, uv_ext1>>);
// Candidates refused by static_assert when used (compile_fail.* tests):
static_assert(lce::matrix_like<cuda::std::mdspan<const float, uv_ext3>> &&
              !lce::viewable_matrix<cuda::std::mdspan<const float, uv_ext3>>);
using uv_scaled = cuda::std::mdspan<const float, uv_ext2, cuda::std::layout_right, scaling_accessor<const float>>;
static_assert(lce::matrix_like<uv_scaled> && !lce::viewable_matrix<uv_scaled> && !lce::mdspan_over_pointer<uv_scaled>);
#endif

// ---------------------------------------------------------------------------
// A user struct: same results, in place
// ---------------------------------------------------------------------------
TEST_CASE("user views: a struct with data()/rows()/cols() gives bitwise the results of matrix_view") {
  const std::int64_t n = 13, h = 8, v = 29, ldx = h + 3;  // padded rows in hidden
  const problem_data d(n, h, v, ldx);
  const reference_forward ref(d, ldx);

  std::vector<float> lp(static_cast<std::size_t>(n), -1.0f), lse(lp.size(), -1.0f);
  const user::matrix<const float> X{d.x.data(), n, h, ldx}, W{d.w.data(), v, h, h};
  const user::vector<const std::int64_t> Y{d.y.data(), static_cast<std::size_t>(n)};
  op_type op{lce::comm::single{}, lce::options{.chunk_tokens = 4}};
  user::data_calls = 0;
  op.forward(X, W, Y, user::vector<float>{lp.data(), lp.size()}, user::vector<float>{lse.data(), lse.size()});
  CHECK(user::data_calls >= 2);  // hidden and weight, through view_traits::data
  CHECK(bytes_of(lp) == bytes_of(ref.lp));
  CHECK(bytes_of(lse) == bytes_of(ref.lse));

  // mixed with lce's own views and std::span
  std::vector<float> lp2(lp.size()), lse2(lp.size());
  op.forward(X, lce::matrix_view<const float>{d.w.data(), v, h}, std::span<const std::int64_t>(d.y),
             std::span<float>(lp2), lce::vector_view<float>{lse2.data(), n});
  CHECK(bytes_of(lp2) == bytes_of(ref.lp));
  CHECK(bytes_of(lse2) == bytes_of(ref.lse));
}

TEST_CASE("user views: the operator uses the user's pointers (no copy)") {
  std::vector<float> buf(24);
  const user::matrix<float> M{buf.data() + 2, 3, 5, 7};
  const auto m = lce::detail::to_matrix_view(M, "hidden");
  CHECK(m.data == buf.data() + 2);
  CHECK(m.rows == 3);
  CHECK(m.cols == 5);
  CHECK(m.ld == 7);
  const user::vector<float> V{buf.data() + 1, 4};
  const auto vv = lce::detail::to_vector_view(V, "logprobs");
  CHECK(vv.data == buf.data() + 1);
  CHECK(vv.size == 4);
  const std::span<const float> S(buf.data() + 3, 6);
  const auto sv = lce::detail::to_vector_view(S, "lse");
  CHECK(sv.data == buf.data() + 3);
  CHECK(sv.size == 6);
  // backward writes its gradients straight into the user's memory
  const std::int64_t n = 5, h = 4, v = 7;
  const problem_data d(n, h, v, h);
  std::vector<float> lp(static_cast<std::size_t>(n)), lse(lp.size()), g(lp.size(), 1.0f);
  std::vector<float> gx(static_cast<std::size_t>(n * h), 9.0f), gw(static_cast<std::size_t>(v * h), 0.0f);
  std::vector<float> gx_ref = gx, gw_ref = gw;
  op_type op{lce::comm::single{}, lce::options{}};
  const user::matrix<const float> X{d.x.data(), n, h, h}, W{d.w.data(), v, h, h};
  op.forward(X, W, std::span<const std::int64_t>(d.y), std::span<float>(lp), std::span<float>(lse));
  op.backward(X, W, std::span<const std::int64_t>(d.y), std::span<const float>(lse), std::span<const float>(g),
              user::matrix<float>{gx.data(), n, h, h}, user::matrix<float>{gw.data(), v, h, h});
  op.backward(lce::matrix_view<const float>{d.x.data(), n, h}, lce::matrix_view<const float>{d.w.data(), v, h},
              lce::vector_view<const std::int64_t>{d.y.data(), n}, lce::vector_view<const float>{lse.data(), n},
              lce::vector_view<const float>{g.data(), n}, lce::matrix_view<float>{gx_ref.data(), n, h},
              lce::matrix_view<float>{gw_ref.data(), v, h});
  CHECK(bytes_of(gx) == bytes_of(gx_ref));
  CHECK(bytes_of(gw) == bytes_of(gw_ref));
}

TEST_CASE("user views: a non-unit inner stride from view_traits is an lce::error naming the argument") {
  const std::int64_t n = 6, h = 5, v = 9;
  const problem_data d(n, h, v, 2 * h);
  std::vector<float> lp(static_cast<std::size_t>(n), -3.0f), lse(lp.size(), -3.0f);
  const auto lp_before = lp, lse_before = lse;
  op_type op{lce::comm::single{}, lce::options{}};
  const user::matrix<const float> W{d.w.data(), v, h, h};
  const user::vector<const std::int64_t> Y{d.y.data(), static_cast<std::size_t>(n)};
  auto expect_error = [&](const auto& X, const auto& Wt, const char* name) {
    try {
      op.forward(X, Wt, Y, user::vector<float>{lp.data(), lp.size()}, user::vector<float>{lse.data(), lse.size()});
      FAIL_CHECK("no lce::error for a non-unit inner stride");
    } catch (const lce::error& e) {
      const std::string what = e.what();
      INFO("message: " << what);
      CHECK(what.find(name) != std::string::npos);
      CHECK(what.find("stride") != std::string::npos);
    }
    CHECK(lp == lp_before);  // nothing written
    CHECK(lse == lse_before);
  };
  SUBCASE("hidden: every other element") {
    user::matrix<const float> X{d.x.data(), n, h, 2 * h};
    X.col_step = 2;
    expect_error(X, W, "hidden");
  }
  SUBCASE("weight: column-major (transposed) storage") {
    user::matrix<const float> Wt{d.w.data(), v, h, 1};
    Wt.col_step = v;
    const user::matrix<const float> X{d.x.data(), n, h, 2 * h};
    expect_error(X, Wt, "weight");
  }
  SUBCASE("one column: the inner stride does not matter") {
    const problem_data d1(n, 1, v, 1);
    user::matrix<const float> X{d1.x.data(), n, 1, 1}, W1{d1.w.data(), v, 1, 1};
    X.col_step = 3;
    W1.col_step = 3;
    op.forward(X, W1, Y, user::vector<float>{lp.data(), lp.size()}, user::vector<float>{lse.data(), lse.size()});
    CHECK(lse != lse_before);
  }
}

#if LCE_TESTS_HAVE_EIGEN
// ---------------------------------------------------------------------------
// Eigen::Map
// ---------------------------------------------------------------------------
using eigen_row_major = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using eigen_col_major = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::ColMajor>;
static_assert(lce::viewable_matrix<Eigen::Map<const eigen_row_major>>);
static_assert(lce::viewable_matrix<Eigen::Map<const eigen_col_major>>, "accepted by type; refused at run time");
static_assert(lce::viewable_vector<Eigen::Map<Eigen::VectorXf>>);

TEST_CASE("user views: Eigen::Map (row-major) gives bitwise the results of matrix_view") {
  const std::int64_t n = 11, h = 6, v = 23, ldx = h + 2;
  const problem_data d(n, h, v, ldx);
  const reference_forward ref(d, ldx);
  const Eigen::Map<const eigen_row_major, Eigen::Unaligned, Eigen::OuterStride<>> X(d.x.data(), n, h,
                                                                                    Eigen::OuterStride<>(ldx));
  const Eigen::Map<const eigen_row_major> W(d.w.data(), v, h);
  std::vector<float> lp(static_cast<std::size_t>(n), -1.0f), lse(lp.size(), -1.0f);
  const auto Xv = lce::detail::to_matrix_view(X, "hidden");
  CHECK(Xv.data == d.x.data());
  CHECK(Xv.ld == ldx);
  op_type op{lce::comm::single{}, lce::options{.chunk_tokens = 4}};
  op.forward(X, W, std::span<const std::int64_t>(d.y), Eigen::Map<Eigen::VectorXf>(lp.data(), n),
             Eigen::Map<Eigen::VectorXf>(lse.data(), n));
  CHECK(bytes_of(lp) == bytes_of(ref.lp));
  CHECK(bytes_of(lse) == bytes_of(ref.lse));
}

TEST_CASE("user views: a column-major Eigen::Map is an lce::error (inner stride is not 1)") {
  const std::int64_t n = 4, h = 3, v = 5;
  const problem_data d(n, h, v, h);
  const Eigen::Map<const eigen_row_major> X(d.x.data(), n, h);
  const Eigen::Map<const eigen_col_major> W(d.w.data(), v, h);
  std::vector<float> lp(static_cast<std::size_t>(n), -2.0f), lse(lp.size(), -2.0f);
  const auto before = lp;
  op_type op{lce::comm::single{}, lce::options{}};
  try {
    op.forward(X, W, std::span<const std::int64_t>(d.y), std::span<float>(lp), std::span<float>(lse));
    FAIL_CHECK("no lce::error for a column-major weight");
  } catch (const lce::error& e) {
    const std::string what = e.what();
    INFO("message: " << what);
    CHECK(what.find("weight") != std::string::npos);
    CHECK(what.find("inner (column) stride must be 1, got 5") != std::string::npos);
  }
  CHECK(lp == before);
  CHECK(lse == before);
}
#endif
