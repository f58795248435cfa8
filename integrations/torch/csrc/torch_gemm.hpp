#pragma once
// The GEMM provider of lce_torch's operators (lce/host/gemm_provider.hpp).
//
// fp32 and fp64: the sgemm/dgemm of that same MKL on an Intel CPU (the GEMMs
// PyTorch's own fp32 matmuls run, which MKL tunes for Intel's cores: on a
// 2-core AMX Xeon lce took 0.90-0.94x plain PyTorch's time with them against
// 0.95-1.03x with OpenBLAS's SkylakeX kernels), and wherever lce's OpenBLAS
// would run slower kernels than the CPU has (lce::blas_info() says "slow": an
// OpenBLAS 0.3.21 that does not know this CPU model falls back to SSE3
// kernels, 4x slower, and a library user cannot set OPENBLAS_CORETYPE after
// `import torch`); otherwise (AMD and others) the CBLAS lce links (OpenBLAS),
// as lce::cblas_gemm. LCE_TORCH_FP32_BLAS=mkl or =openblas forces either.
// blas_info says which runs.
// bfloat16: lce's own kernel (lce/host/detail/own_bf16_gemm.hpp) on a CPU with
// AMX (Sapphire Rapids and later Xeons) or else AVX512-BF16 (AMD Zen 4 and
// later, Intel Cooper Lake). On a 2-core AMX Xeon, in one process, a bf16 step
// took 0.99-1.23x plain PyTorch's time with it against 1.18-1.37x with MKL's
// (README, PyTorch); on a 2-core Zen 5, where MKL's bf16 GEMM runs a quarter
// of the CPU's bf16 rate, lce's kernel on AVX512-BF16 took it from 3.0-4.5x
// plain's time to 0.79-0.94x at N <= 512 (docs/measurements.md, "On an AMD EPYC (Zen 5 ...)").
// Elsewhere with bf16 instructions, the bf16 x bf16 ->
// fp32 GEMM of the MKL that PyTorch's x86 wheels carry inside libtorch_cpu
// (cblas_gemm_bf16bf16f32, fp32 accumulation), looked up at run time in the
// libtorch_cpu this process loaded, so a torch without it (aarch64, a build
// without MKL) still loads. Without bf16 instructions (MKL's emulation of them
// was the slower) or without that MKL, a bfloat16 call runs on
// torch_widening_gemm below instead: the host backend's own fp32 path.
// LCE_TORCH_BF16_GEMM=amx|avx512bf16|mkl|widen asks for one
// (lce_torch.set_bf16_gemm between calls); blas_info says which runs.
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
#include <lce/host/blas_info.hpp>
#include <lce/host/detail/own_bf16_gemm.hpp>
#include <lce/host/detail/widening_bf16_gemm.hpp>

#include <dlfcn.h>

#include <atomic>
#include <concepts>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

namespace lce_torch {

namespace detail {

// MKL's CBLAS (LP64) as libtorch_cpu exports it: layout, transposes as CBLAS's enum values.
using mkl_bf16_gemm_fn = void (*)(int layout, int trans_a, int trans_b, int m, int n, int k, float alpha,
                                  const std::uint16_t* a, int lda, const std::uint16_t* b, int ldb, float beta,
                                  float* c, int ldc);
// The Fortran (column-major, LP64) GEMMs: libtorch_cpu exports these, not cblas_sgemm.
template <class A>
using mkl_fortran_gemm_fn = void (*)(const char* trans_a, const char* trans_b, const int* m, const int* n,
                                     const int* k, const A* alpha, const A* a, const int* lda, const A* b,
                                     const int* ldb, const A* beta, A* c, const int* ldc);
using mkl_set_threads_local_fn = int (*)(int);
using mkl_version_fn = void (*)(char*, int);

struct torch_mkl {
  mkl_bf16_gemm_fn bf16_gemm = nullptr;
  mkl_fortran_gemm_fn<float> sgemm = nullptr;   // set only when fp32/fp64 GEMMs go to MKL
  mkl_fortran_gemm_fn<double> dgemm = nullptr;
  std::string full_gemm_reason;  // why fp32/fp64 GEMMs go to MKL ("" when they do not)
  mkl_set_threads_local_fn set_threads_local = nullptr;
  std::string version;

  static const torch_mkl& get() {
    static const torch_mkl found = find();
    return found;
  }

 private:
  static torch_mkl find() {
    torch_mkl m;
    // The copy this process already loaded (torch is imported before this extension).
    void* torch_cpu = dlopen("libtorch_cpu.so", RTLD_NOW | RTLD_NOLOAD);
    if (!torch_cpu) return m;
    m.bf16_gemm = reinterpret_cast<mkl_bf16_gemm_fn>(dlsym(torch_cpu, "cblas_gemm_bf16bf16f32"));
    // The C entry (by value); mkl_set_num_threads_local is the Fortran one (by pointer).
    m.set_threads_local = reinterpret_cast<mkl_set_threads_local_fn>(dlsym(torch_cpu, "MKL_Set_Num_Threads_Local"));
    if (!m.set_threads_local) {  // without it each call would start MKL's own threads
      m.bf16_gemm = nullptr;
      return m;
    }
    m.choose_full_precision_gemm(torch_cpu);
    if (auto version = reinterpret_cast<mkl_version_fn>(dlsym(torch_cpu, "MKL_Get_Version_String"))) {
      char text[198] = {};
      version(text, static_cast<int>(sizeof text) - 1);
      m.version = text;
    }
    return m;
  }

  void choose_full_precision_gemm(void* torch_cpu) {
    const char* asked = std::getenv("LCE_TORCH_FP32_BLAS");
    const std::string choice = asked ? asked : "";
    if (choice == "openblas") return;
    if (choice == "mkl") {
      full_gemm_reason = "LCE_TORCH_FP32_BLAS=mkl";
    } else {
      const lce::blas_report own = lce::blas_info();
      if (own.slow)
        full_gemm_reason = own.reason;
      else if (own.cpu.vendor == "GenuineIntel")
        full_gemm_reason = "an Intel CPU: PyTorch's own fp32 GEMMs";
      else
        return;
    }
    sgemm = reinterpret_cast<mkl_fortran_gemm_fn<float>>(dlsym(torch_cpu, "sgemm_"));
    dgemm = reinterpret_cast<mkl_fortran_gemm_fn<double>>(dlsym(torch_cpu, "dgemm_"));
    if (!sgemm || !dgemm) sgemm = nullptr, dgemm = nullptr, full_gemm_reason.clear();
  }
};

// Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: the same call with the
// operands and extents swapped.
template <class A>
void column_major_gemm(mkl_fortran_gemm_fn<A> fn, mkl_set_threads_local_fn set_threads, lce::transpose ta,
                       lce::transpose tb, int m, int n, int k, A alpha, const A* a, int lda, const A* b, int ldb,
                       A beta, A* c, int ldc) {
  if (m <= 0 || n <= 0) return;
  const char op_a = ta == lce::transpose::yes ? 'T' : 'N', op_b = tb == lce::transpose::yes ? 'T' : 'N';
  const int previous = set_threads(1);
  fn(&op_b, &op_a, &n, &m, &k, &alpha, b, &ldb, a, &lda, &beta, c, &ldc);
  set_threads(previous);
}

// Which bf16 GEMM runs: lce's own kernel where the CPU has AMX or AVX512-BF16, else MKL's where
// this torch has it (and the CPU has bf16 instructions, which it then lacks), else widening. Without bf16 instructions
// MKL's bf16 GEMM emulates them and is the slower: on a 2-core AMD EPYC (Zen 3, AVX2) a bf16
// step at N = 1,024 took 1.05-1.27x the time of the widened path (torch_widening_gemm) with it
// (docs/measurements.md, "On an AMD EPYC").
// LCE_TORCH_BF16_GEMM=amx|avx512bf16|mkl|widen at the first use, or lce_torch.set_bf16_gemm()
// at any time between calls, asks for one; an unavailable choice falls to the default.
enum class bf16_kernel { amx, avx512bf16, mkl, widen };

inline bool cpu_has_bf16_instructions() {
  static const bool has = lce::blas_detail::detect_cpu().avx512_bf16;  // the CPU probe alone, no BLAS lookup
  return has;
}

inline const char* bf16_kernel_name(bf16_kernel kernel) {
  switch (kernel) {
    case bf16_kernel::amx: return "amx";
    case bf16_kernel::avx512bf16: return "avx512bf16";
    case bf16_kernel::mkl: return "mkl";
    case bf16_kernel::widen: break;
  }
  return "widen";
}

// The kernel that runs when `choice` ("amx", "avx512bf16", "mkl", "widen", or anything else for the
// default) is asked for.
inline bf16_kernel resolve_bf16_kernel(std::string_view choice) {
  if (choice == "widen") return bf16_kernel::widen;
  const bool amx = lce::detail::amx_bf16_gemm_available(), mkl = torch_mkl::get().bf16_gemm != nullptr;
  const bool avx512bf16 = lce::detail::avx512_bf16_gemm_available();
  if (choice == "mkl" && mkl) return bf16_kernel::mkl;
  if (choice == "avx512bf16" && avx512bf16) return bf16_kernel::avx512bf16;
  if (amx) return bf16_kernel::amx;
  if (avx512bf16) return bf16_kernel::avx512bf16;
  return mkl && (choice == "mkl" || cpu_has_bf16_instructions()) ? bf16_kernel::mkl : bf16_kernel::widen;
}

inline std::atomic<bf16_kernel>& chosen_bf16_kernel() {
  static std::atomic<bf16_kernel> chosen{[] {
    const char* asked = std::getenv("LCE_TORCH_BF16_GEMM");
    return resolve_bf16_kernel(asked ? asked : "");
  }()};
  return chosen;
}

inline bf16_kernel choose_bf16_kernel() { return chosen_bf16_kernel().load(std::memory_order_relaxed); }

// The unit of lce's own kernel where it is the one chosen.
inline std::optional<lce::detail::bf16_unit> own_unit_of(bf16_kernel kernel) {
  if (kernel == bf16_kernel::amx) return lce::detail::bf16_unit::amx;
  if (kernel == bf16_kernel::avx512bf16) return lce::detail::bf16_unit::avx512;
  return std::nullopt;
}

}  // namespace detail

struct torch_gemm {
  // OpenBLAS: one thread per call while lce runs; no slow-kernel warning (MKL takes over then).
  using call_scope = lce::detail::single_threaded_blas;
  static constexpr bool bf16_operands = true;

  template <class A>
    requires std::same_as<A, float> || std::same_as<A, double>
  void gemm(lce::transpose ta, lce::transpose tb, std::int64_t m, std::int64_t n, std::int64_t k, A alpha,
            const A* a, std::int64_t lda, const A* b, std::int64_t ldb, A beta, A* c, std::int64_t ldc) const {
    const auto& mkl = detail::torch_mkl::get();
    if constexpr (std::same_as<A, float>) {
      if (mkl.sgemm)
        return detail::column_major_gemm(mkl.sgemm, mkl.set_threads_local, ta, tb, extent(m), extent(n), extent(k),
                                         alpha, a, extent(lda), b, extent(ldb), beta, c, extent(ldc));
    } else {
      if (mkl.dgemm)
        return detail::column_major_gemm(mkl.dgemm, mkl.set_threads_local, ta, tb, extent(m), extent(n), extent(k),
                                         alpha, a, extent(lda), b, extent(ldb), beta, c, extent(ldc));
    }
    lce::detail::gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }

  // Not asked with bf16_operands (bf16_gemm runs everywhere); true where lce's or MKL's kernels run.
  bool bf16_gemm_available() const { return detail::choose_bf16_kernel() != detail::bf16_kernel::widen; }

  // lce's kernel and MKL's both run on AMX tiles where the CPU has them (bf16_gemm_choice.hpp).
  double bf16_gemm_flops_per_memory_byte() const {
    const detail::bf16_kernel kernel = detail::choose_bf16_kernel();
    const bool on_amx = kernel == detail::bf16_kernel::amx ||
                        (kernel == detail::bf16_kernel::mkl && lce::detail::amx_bf16_gemm_available());
    return on_amx ? lce::detail::amx_gemm_flops_per_memory_byte : lce::default_gemm_flops_per_memory_byte;
  }

  void bf16_gemm(lce::transpose ta, lce::transpose tb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                 const lce::bfloat16* a, std::int64_t lda, const lce::bfloat16* b, std::int64_t ldb, float beta,
                 float* c, std::int64_t ldc) const {
    const detail::bf16_kernel kernel = detail::choose_bf16_kernel();
    if (const auto unit = detail::own_unit_of(kernel))
      return lce::detail::own_bf16_gemm(*unit, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    const auto& mkl = detail::torch_mkl::get();
    if (kernel == detail::bf16_kernel::widen) {  // set_bf16_gemm("widen") from another thread mid-call
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

  // bf16_gemm into a bf16 C (gemm_provider.hpp): lce's own kernel rounds dW's tiles into a
  // bfloat16 grad_weight as their sums are done, so lce keeps no fp32 tiles for them. MKL's
  // GEMM has no bf16 C: there lce keeps its tiles (available() is false), and a call made all
  // the same (the kernel changed mid-call) sums into a buffer of its own first.
  bool gemm_into_bf16_available() const { return detail::own_unit_of(detail::choose_bf16_kernel()).has_value(); }

  void bf16_gemm_into_bf16(lce::transpose ta, lce::transpose tb, std::int64_t m, std::int64_t n, std::int64_t k,
                           float alpha, const lce::bfloat16* a, std::int64_t lda, const lce::bfloat16* b,
                           std::int64_t ldb, float beta, lce::bfloat16* c, std::int64_t ldc) const {
    lce::detail::bf16_gemm_into_bf16_of(*this, detail::own_unit_of(detail::choose_bf16_kernel()), ta, tb, m, n, k,
                                        alpha, a, lda, b, ldb, beta, c, ldc);
  }

  // What runs the fp32/fp64 GEMMs when it is not lce's BLAS ("" when it is), for blas_info.
  static std::string full_precision_description() {
    const auto& mkl = detail::torch_mkl::get();
    if (!mkl.sgemm) return "";
    return "MKL's sgemm/dgemm from libtorch_cpu (" + mkl.full_gemm_reason + ")";
  }

  // What runs the bf16 GEMMs, for blas_info.
  static std::string bf16_description() {
    const auto& mkl = detail::torch_mkl::get();
    switch (detail::choose_bf16_kernel()) {
      case detail::bf16_kernel::amx:
        return "lce's own kernel on AMX (lce/host/detail/own_bf16_gemm.hpp), dz rounded to bf16";
      case detail::bf16_kernel::avx512bf16:
        return "lce's own kernel on AVX512-BF16 (lce/host/detail/own_bf16_gemm.hpp), dz rounded to bf16";
      case detail::bf16_kernel::widen: {
        const char* why = !mkl.bf16_gemm ? "no MKL bf16 GEMM in this torch"
                          : !detail::cpu_has_bf16_instructions()
                              ? "no bf16 instructions on this CPU, where MKL's bf16 GEMM is slower"
                              : "asked for";
        return std::string("weight widened to fp32 for the BLAS, dz in fp32 (") + why + ")";
      }
      case detail::bf16_kernel::mkl:
        break;
    }
    return "MKL's cblas_gemm_bf16bf16f32 from libtorch_cpu (" + (mkl.version.empty() ? "MKL" : mkl.version) +
           "), dz rounded to bf16";
  }

 private:
  // The operator checks every extent against the host's max_gemm_extent (INT_MAX) before any GEMM.
  static int extent(std::int64_t v) { return static_cast<int>(v); }
};

// Asks for a bf16 GEMM ("amx", "avx512bf16", "mkl", "widen", "auto"; between operator calls) and
// returns the one that now runs.
inline std::string set_bf16_gemm(std::string_view kernel) {
  if (kernel != "amx" && kernel != "avx512bf16" && kernel != "mkl" && kernel != "widen" && kernel != "auto")
    throw std::invalid_argument("lce_torch.set_bf16_gemm: kernel is \"" + std::string(kernel) +
                                "\"; expected \"amx\", \"avx512bf16\", \"mkl\", \"widen\" or \"auto\"");
  const detail::bf16_kernel chosen = detail::resolve_bf16_kernel(kernel);
  detail::chosen_bf16_kernel().store(chosen, std::memory_order_relaxed);
  return detail::bf16_kernel_name(chosen);
}

// The provider of bfloat16 operators while the widening bf16 GEMM is chosen (a CPU without bf16
// instructions, or set_bf16_gemm("widen")): the fp32/fp64 GEMMs alone. Without a bf16 GEMM,
// lce's host backend widens each weight tile once per chunk into its slots and keeps dz in fp32,
// where widening inside each bf16 x bf16 GEMM would widen both operands of every call and round
// dz to bf16 first: faster and as accurate as sgemm.
struct torch_widening_gemm {
  using call_scope = torch_gemm::call_scope;

  template <class A>
    requires std::same_as<A, float> || std::same_as<A, double>
  void gemm(lce::transpose ta, lce::transpose tb, std::int64_t m, std::int64_t n, std::int64_t k, A alpha,
            const A* a, std::int64_t lda, const A* b, std::int64_t ldb, A beta, A* c, std::int64_t ldc) const {
    torch_gemm{}.gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
};

inline bool bf16_gemm_widens() { return detail::choose_bf16_kernel() == detail::bf16_kernel::widen; }

static_assert(lce::gemm_provider<torch_gemm> && lce::gemm_reads_bf16_operands<torch_gemm> &&
              lce::bf16_into_bf16_gemm_provider<torch_gemm>);
static_assert(lce::gemm_provider<torch_widening_gemm> && !lce::bf16_gemm_provider<torch_widening_gemm>);

}  // namespace lce_torch
