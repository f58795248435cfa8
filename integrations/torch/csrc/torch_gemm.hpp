#pragma once
// The GEMM provider of lce_torch's operators (lce/host/gemm_provider.hpp).
//
// fp32 and fp64: the CBLAS lce links (OpenBLAS), as lce::cblas_gemm.
// bfloat16: the bf16 x bf16 -> fp32 GEMM of the MKL that PyTorch's x86 wheels
// carry inside libtorch_cpu (cblas_gemm_bf16bf16f32: AMX or AVX512-BF16
// kernels where the CPU has them, fp32 accumulation), the library PyTorch's
// own bf16 matmuls reach. It is looked up at run time in the libtorch_cpu
// this process loaded, so a torch without it (aarch64, a build without MKL)
// still loads; there each bf16 GEMM widens its operands to fp32 for the BLAS
// (lce::detail::widening_bf16_gemm), and blas_info says which.
//
// With bf16_operands, a bfloat16 operator's three GEMMs per chunk read the
// hidden rows as stored and dz rounded once to bf16 (unit roundoff 2^-8),
// like lce's CUDA backend and GPU fused losses; PyTorch's own bf16 path rounds
// the logits themselves and their whole gradient to bf16. lce keeps the
// logits, their statistics and grad_weight's sum over chunks in fp32.
//
// Threads: lce calls one GEMM tile per pool thread; MKL is held to one
// thread per call (mkl_set_num_threads_local) so the tiles do not
// oversubscribe the cores that torch.set_num_threads gave lce.

#include <lce/lce.hpp>
#include <lce/host/detail/widening_bf16_gemm.hpp>

#include <dlfcn.h>

#include <concepts>
#include <cstdint>
#include <cstdlib>
#include <string>

namespace lce_torch {

namespace detail {

// MKL's CBLAS (LP64) as libtorch_cpu exports it: layout, transposes as CBLAS's enum values.
using mkl_bf16_gemm_fn = void (*)(int layout, int trans_a, int trans_b, int m, int n, int k, float alpha,
                                  const std::uint16_t* a, int lda, const std::uint16_t* b, int ldb, float beta,
                                  float* c, int ldc);
using mkl_set_threads_local_fn = int (*)(int);
using mkl_version_fn = void (*)(char*, int);

struct torch_mkl {
  mkl_bf16_gemm_fn bf16_gemm = nullptr;
  mkl_set_threads_local_fn set_threads_local = nullptr;
  std::string version;

  static const torch_mkl& get() {
    static const torch_mkl found = find();
    return found;
  }

 private:
  static torch_mkl find() {
    torch_mkl m;
    if (std::getenv("LCE_TORCH_NO_MKL")) return m;  // to test the widening path on a machine with MKL
    // The copy this process already loaded (torch is imported before this extension).
    void* torch_cpu = dlopen("libtorch_cpu.so", RTLD_NOW | RTLD_NOLOAD);
    if (!torch_cpu) return m;
    m.bf16_gemm = reinterpret_cast<mkl_bf16_gemm_fn>(dlsym(torch_cpu, "cblas_gemm_bf16bf16f32"));
    // The C entry (by value); mkl_set_num_threads_local is the Fortran one (by pointer).
    m.set_threads_local = reinterpret_cast<mkl_set_threads_local_fn>(dlsym(torch_cpu, "MKL_Set_Num_Threads_Local"));
    if (!m.set_threads_local) m.bf16_gemm = nullptr;  // without it each call would start MKL's own threads
    if (auto version = reinterpret_cast<mkl_version_fn>(dlsym(torch_cpu, "MKL_Get_Version_String"))) {
      char text[198] = {};
      version(text, static_cast<int>(sizeof text) - 1);
      m.version = text;
    }
    return m;
  }
};

}  // namespace detail

struct torch_gemm {
  using call_scope = lce::cblas_gemm::call_scope;  // OpenBLAS: one thread per call while lce runs
  static constexpr bool bf16_operands = true;

  template <class A>
    requires std::same_as<A, float> || std::same_as<A, double>
  void gemm(lce::transpose ta, lce::transpose tb, std::int64_t m, std::int64_t n, std::int64_t k, A alpha,
            const A* a, std::int64_t lda, const A* b, std::int64_t ldb, A beta, A* c, std::int64_t ldc) const {
    lce::detail::gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }

  // Not asked with bf16_operands (bf16_gemm runs everywhere); true where MKL's kernels run.
  bool bf16_gemm_available() const { return detail::torch_mkl::get().bf16_gemm != nullptr; }

  void bf16_gemm(lce::transpose ta, lce::transpose tb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                 const lce::bfloat16* a, std::int64_t lda, const lce::bfloat16* b, std::int64_t ldb, float beta,
                 float* c, std::int64_t ldc) const {
    const auto& mkl = detail::torch_mkl::get();
    if (!mkl.bf16_gemm) {
      lce::detail::widening_bf16_gemm(
          [this](auto... args) { gemm(args...); }, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
      return;
    }
    if (m <= 0 || n <= 0) return;
    constexpr int row_major = 101, no_trans = 111, trans = 112;  // CBLAS's enum values
    const int previous = mkl.set_threads_local(1);
    mkl.bf16_gemm(row_major, ta == lce::transpose::yes ? trans : no_trans,
                  tb == lce::transpose::yes ? trans : no_trans, extent(m), extent(n), extent(k), alpha,
                  reinterpret_cast<const std::uint16_t*>(a), extent(lda), reinterpret_cast<const std::uint16_t*>(b),
                  extent(ldb), beta, c, extent(ldc));
    mkl.set_threads_local(previous);
  }

  // What runs the bf16 GEMMs, for blas_info.
  static std::string bf16_description() {
    const auto& mkl = detail::torch_mkl::get();
    if (!mkl.bf16_gemm) return "widened to fp32 for the BLAS (no MKL bf16 GEMM in this torch)";
    return "MKL's cblas_gemm_bf16bf16f32 from libtorch_cpu (" + (mkl.version.empty() ? "MKL" : mkl.version) +
           "), dz rounded to bf16";
  }

 private:
  // The operator checks every extent against the host's max_gemm_extent (INT_MAX) before any GEMM.
  static int extent(std::int64_t v) { return static_cast<int>(v); }
};

static_assert(lce::gemm_provider<torch_gemm> && lce::gemm_reads_bf16_operands<torch_gemm>);

}  // namespace lce_torch
