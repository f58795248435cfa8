#pragma once
// The three GEMMs of a chunk through cublasGemmEx, on row-major views.
//
// cuBLAS is column-major: a row-major [rows, cols] matrix with leading
// dimension ld is, read by cuBLAS, its transpose [cols, rows] with the same
// ld. With x [R, H], w [V, H], z and dz [R, V] row-major, each product is
// computed transposed, so no operand is ever copied:
//   z  = alpha x w^T    as  z^T  = alpha (w^T)^T x^T   gemm(T, N, m V, n R, k H, A w, B x)
//   dx = alpha dz w     as  dx^T = alpha w^T dz^T      gemm(N, N, m H, n R, k V, A w, B dz)
//   dw += alpha dz^T x  as  dw^T += alpha x^T dz       gemm(N, T, m H, n V, k R, A x, B dz)
// Inputs in fp32, bf16 or fp16 accumulate in fp32 (double in double), with
// the output in the compute type, or (dW) in the inputs' own 2-byte type;
// TF32 only when the caller asks for it.

#include <lce/core/config.hpp>
#include <lce/core/dtypes.hpp>
#include <lce/core/error.hpp>
#include <lce/core/views.hpp>

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <library_types.h>

#include <cstdint>
#include <type_traits>

LCE_BEGIN_NAMESPACE
namespace detail {

inline void check_cublas(cublasStatus_t status, const char* call, const char* file, int line) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  fail("cuBLAS: ", call, " failed: ", cublasGetStatusName(status), " (", cublasGetStatusString(status), ") at ",
       file, ":", line);
}

}  // namespace detail
LCE_END_NAMESPACE

#define LCE_CUBLAS_TRY(call) ::lce::detail::check_cublas((call), #call, __FILE__, __LINE__)

LCE_BEGIN_NAMESPACE
namespace detail::cublas {

template <class E>
constexpr cudaDataType_t data_type() {
  if constexpr (std::is_same_v<E, float>) return CUDA_R_32F;
  else if constexpr (std::is_same_v<E, double>) return CUDA_R_64F;
  else if constexpr (std::is_same_v<E, bfloat16>) return CUDA_R_16BF;
  else return CUDA_R_16F;
}

template <class In, class Scalar>
constexpr cublasComputeType_t compute_type(bool allow_tf32) {
  if constexpr (std::is_same_v<Scalar, double>) return CUBLAS_COMPUTE_64F;
  else if constexpr (std::is_same_v<In, float>) return allow_tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  else return CUBLAS_COMPUTE_32F;
}

// C = alpha op(A) op(B) + beta C in cuBLAS's column-major terms; A and B of
// element type In (the same), C of Out (the compute type, or In itself:
// cuBLAS then sums in fp32 and rounds into C once); alpha and beta in the
// compute type.
template <class In, class Out, class Scalar>
void gemm(cublasHandle_t handle, bool allow_tf32, cublasOperation_t transa, cublasOperation_t transb, std::int64_t m,
          std::int64_t n, std::int64_t k, Scalar alpha, const In* a, std::int64_t lda, const In* b, std::int64_t ldb,
          Scalar beta, Out* c, std::int64_t ldc) {
  if (m == 0 || n == 0) return;
  LCE_CUBLAS_TRY(cublasGemmEx(handle, transa, transb, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k),
                              &alpha, a, data_type<In>(), static_cast<int>(lda), b, data_type<In>(),
                              static_cast<int>(ldb), &beta, c, data_type<Out>(), static_cast<int>(ldc),
                              compute_type<In, Scalar>(allow_tf32), CUBLAS_GEMM_DEFAULT));
}

// z = alpha x w^T
template <class In, class Out>
void logits(cublasHandle_t handle, bool allow_tf32, matrix_view<const In> x, matrix_view<const In> w, Out alpha,
            matrix_view<Out> z) {
  gemm(handle, allow_tf32, CUBLAS_OP_T, CUBLAS_OP_N, w.rows, x.rows, x.cols, alpha, w.data, w.ld, x.data, x.ld, Out(0),
       z.data, z.ld);
}

// dx = alpha dz w + beta dx
template <class In, class Out>
void grad_hidden(cublasHandle_t handle, bool allow_tf32, matrix_view<const In> dz, matrix_view<const In> w, Out alpha,
                 matrix_view<Out> dx, Out beta) {
  gemm(handle, allow_tf32, CUBLAS_OP_N, CUBLAS_OP_N, w.cols, dz.rows, w.rows, alpha, w.data, w.ld, dz.data, dz.ld, beta,
       dx.data, dx.ld);
}

// dw = alpha dz^T x + beta dw, dw in the compute type Scalar or in In
template <class In, class Out, class Scalar>
void grad_weight(cublasHandle_t handle, bool allow_tf32, matrix_view<const In> dz, matrix_view<const In> x,
                 Scalar alpha, matrix_view<Out> dw, Scalar beta) {
  gemm(handle, allow_tf32, CUBLAS_OP_N, CUBLAS_OP_T, x.cols, dz.cols, x.rows, alpha, x.data, x.ld, dz.data, dz.ld, beta,
       dw.data, dw.ld);
}

}  // namespace detail::cublas
LCE_END_NAMESPACE
