#pragma once
// Row-major GEMM on top of CBLAS, in the three layouts the operator needs.
// Empty products are skipped here so callers need no special cases.

#include <lce/core/config.hpp>
#include <lce/core/error.hpp>
#include <lce/host/gemm_provider.hpp>

#include <cblas.h>

#include <climits>
#include <cstdint>
#include <mutex>

LCE_BEGIN_NAMESPACE
namespace detail {

using lce::transpose;

// A threaded BLAS GEMM gives different bits for different thread counts
// (OpenBLAS splits tiles differently). lce therefore splits every GEMM into
// tiles fixed by the shapes alone, runs them on its own threads, and asks
// the BLAS for one thread per call while an lce call is running. Nested and
// concurrent lce calls share one scope; the caller's setting comes back when
// the last one ends. BLAS libraries without a run-time switch are left as
// they are (then set their threads to 1 for bitwise reproducibility).
//
// The setting is process-wide: OpenBLAS has no per-thread one. Its
// openblas_set_num_threads_local (0.3.27 on) calls openblas_set_num_threads
// and only records the count for OpenMP builds (driver/others/
// openblas_set_num_threads.c), so it is not used here: restoring it from one
// thread would hand the other threads' GEMMs a multi-threaded BLAS. To
// change the setting once per operator call rather than per GEMM, hold a
// host::call_scope for the call (the GEMMs' own scopes then only count).
class single_threaded_blas {
 public:
  single_threaded_blas() {
#ifdef OPENBLAS_VERSION
    std::lock_guard lock(state().mutex);
    if (state().users++ == 0) {
      state().saved_threads = openblas_get_num_threads();
      if (state().saved_threads != 1) openblas_set_num_threads(1);
    }
#endif
  }
  ~single_threaded_blas() {
#ifdef OPENBLAS_VERSION
    std::lock_guard lock(state().mutex);
    if (--state().users == 0 && state().saved_threads != 1) openblas_set_num_threads(state().saved_threads);
#endif
  }
  single_threaded_blas(const single_threaded_blas&) = delete;
  single_threaded_blas& operator=(const single_threaded_blas&) = delete;

 private:
  struct shared_state {
    std::mutex mutex;
    int users = 0;
    int saved_threads = 1;
  };
  static shared_state& state() {
    static shared_state instance;
    return instance;
  }
};

inline int blas_int(std::int64_t value, const char* what) {
  expects(value <= INT_MAX, what, " = ", value, " exceeds the BLAS integer range (", INT_MAX, ")");
  return static_cast<int>(value);
}

// C[m, n] = alpha * op(A)[m, k] * op(B)[k, n] + beta * C
template <class A>
void gemm(transpose trans_a, transpose trans_b, std::int64_t m, std::int64_t n, std::int64_t k, A alpha, const A* a,
          std::int64_t lda, const A* b, std::int64_t ldb, A beta, A* c, std::int64_t ldc) {
  if (m == 0 || n == 0) return;
  const auto ta = trans_a == transpose::yes ? CblasTrans : CblasNoTrans;
  const auto tb = trans_b == transpose::yes ? CblasTrans : CblasNoTrans;
  const int im = blas_int(m, "gemm m"), in = blas_int(n, "gemm n"), ik = blas_int(k, "gemm k");
  const int ilda = blas_int(lda, "gemm lda"), ildb = blas_int(ldb, "gemm ldb"), ildc = blas_int(ldc, "gemm ldc");
  if constexpr (sizeof(A) == sizeof(float)) {
    cblas_sgemm(CblasRowMajor, ta, tb, im, in, ik, alpha, a, ilda, b, ildb, beta, c, ildc);
  } else {
    cblas_dgemm(CblasRowMajor, ta, tb, im, in, ik, alpha, a, ilda, b, ildb, beta, c, ildc);
  }
}

}  // namespace detail
LCE_END_NAMESPACE
