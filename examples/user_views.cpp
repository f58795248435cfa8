// Your own tensor types, taken in place (no copy): specialise lce::view_traits.
//
//   (a) a framework's tensor wrapper with data() / rows() / cols()
//   (b) Eigen::Map of a row-major Eigen matrix (when Eigen is there); a
//       column-major one is refused with an lce::error, its inner stride
//       not being 1
//
// Each runs lce::ChunkedHiddenToLogprobs<lce::comm::single, float>::forward
// and must give bitwise the log-probs of lce::matrix_view over the same memory.
#include <lce/lce.hpp>

#if LCE_EXAMPLE_HAVE_EIGEN
#include <Eigen/Core>
#endif

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <span>
#include <vector>

// ---------------------------------------------------------------------------
// (a) A framework's tensor type: lce knows nothing about it.
// ---------------------------------------------------------------------------
namespace framework {
template <class E>
class tensor2d {
 public:
  tensor2d(E* data, std::int64_t rows, std::int64_t cols) : data_(data), rows_(rows), cols_(cols) {}
  E* data() const { return data_; }
  std::int64_t rows() const { return rows_; }
  std::int64_t cols() const { return cols_; }

 private:
  E* data_;
  std::int64_t rows_, cols_;
};
}  // namespace framework

// What lce needs to know: element type, rank, where the data is, the extents
// and the strides (in elements, as std::mdspan's: stride(t, 0) between rows,
// stride(t, 1) between columns, which must be 1).
template <class E>
struct lce::view_traits<framework::tensor2d<E>> {
  using element_type = E;  // const E: read-only
  static constexpr int rank = 2;
  static E* data(const framework::tensor2d<E>& t) { return t.data(); }
  static std::int64_t extent(const framework::tensor2d<E>& t, int i) { return i == 0 ? t.rows() : t.cols(); }
  static std::int64_t stride(const framework::tensor2d<E>& t, int i) { return i == 0 ? t.cols() : 1; }
};

// ---------------------------------------------------------------------------
// (b) Eigen::Map of a dynamic float matrix: row-major or column-major, any
// stride. lce takes whatever Eigen reports; a column-major map has inner
// stride = rows and is refused at run time.
// ---------------------------------------------------------------------------
#if LCE_EXAMPLE_HAVE_EIGEN
using row_major_matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using col_major_matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::ColMajor>;

template <int Options, int MapOptions, class Stride>
struct lce::view_traits<Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Options>, MapOptions, Stride>> {
  using map = Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Options>, MapOptions, Stride>;
  static constexpr bool row_major = (Options & Eigen::RowMajor) != 0;
  using element_type = const float;
  static constexpr int rank = 2;
  static const float* data(const map& m) { return m.data(); }
  static Eigen::Index extent(const map& m, int i) { return i == 0 ? m.rows() : m.cols(); }
  // row-major: rows are outerStride() apart; column-major: columns are.
  static Eigen::Index stride(const map& m, int i) { return (i == 0) == row_major ? m.outerStride() : m.innerStride(); }
};
#endif

namespace {

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

int main() {
  const std::int64_t N = 6, H = 16, V = 100;
  std::vector<float> x(N * H), w(V * H);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = 0.01f * static_cast<float>((i * 37) % 101) - 0.5f;
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = 0.02f * static_cast<float>((i * 53) % 97) - 0.97f;
  std::vector<std::int64_t> y = {3, 14, 15, 92, 65, 35};

  lce::ChunkedHiddenToLogprobs<lce::comm::single, float> op(lce::comm::single{});
  const std::span<const std::int64_t> targets(y);
  int failures = 0;

  // Reference: lce's own views over the same memory.
  std::vector<float> ref_logp(N), ref_lse(N);
  op.forward(lce::matrix_view<const float>{x.data(), N, H}, lce::matrix_view<const float>{w.data(), V, H}, targets,
             std::span<float>(ref_logp), std::span<float>(ref_lse));

  // (a) the framework's tensors, as they are
  {
    const framework::tensor2d<const float> X(x.data(), N, H), W(w.data(), V, H);
    std::vector<float> logp(N), lse(N);
    op.forward(X, W, targets, std::span<float>(logp), std::span<float>(lse));
    const bool ok = same_bits(logp, ref_logp) && same_bits(lse, ref_lse);
    std::printf("framework::tensor2d: logp[0] = %.6f  %s\n", static_cast<double>(logp[0]),
                ok ? "(bitwise equal to matrix_view)" : "DIFFERS from matrix_view");
    failures += !ok;
  }

#if LCE_EXAMPLE_HAVE_EIGEN
  // (b) Eigen::Map, row-major: accepted
  {
    const Eigen::Map<const row_major_matrix> X(x.data(), N, H), W(w.data(), V, H);
    std::vector<float> logp(N), lse(N);
    op.forward(X, W, targets, std::span<float>(logp), std::span<float>(lse));
    const bool ok = same_bits(logp, ref_logp) && same_bits(lse, ref_lse);
    std::printf("Eigen::Map (row-major): logp[0] = %.6f  %s\n", static_cast<double>(logp[0]),
                ok ? "(bitwise equal to matrix_view)" : "DIFFERS from matrix_view");
    failures += !ok;
  }
  // (b) Eigen::Map, column-major: refused (its rows are not contiguous)
  {
    const Eigen::Map<const row_major_matrix> X(x.data(), N, H);
    const Eigen::Map<const col_major_matrix> W(w.data(), V, H);
    std::vector<float> logp(N), lse(N);
    try {
      op.forward(X, W, targets, std::span<float>(logp), std::span<float>(lse));
      std::printf("Eigen::Map (column-major): accepted, but must not be\n");
      ++failures;
    } catch (const lce::error& e) {
      std::printf("Eigen::Map (column-major): refused: %s\n", e.what());
    }
  }
#else
  std::printf("Eigen not found at build time: the Eigen::Map part is skipped\n");
#endif

  return failures == 0 ? 0 : 1;
}
