#pragma once
// bf16 x bf16 -> fp32 GEMMs on the CPU's bf16 instructions (AVX512-BF16, AMX) through
// oneDNN's matmul, for the host backend's bfloat16 weights on CPUs with AVX512-BF16 but no
// AMX (where lce's own kernel runs instead; bf16_gemm_choice.hpp), in builds that define
// LCE_BF16_GEMM_ONEDNN and link oneDNN (-DLCE_BF16_GEMM=auto|onednn; bench/bf16_gemm.cpp
// measures it).
// Products of bf16 values are exact in fp32 and oneDNN accumulates in fp32.
//
// Each call is one single-threaded oneDNN matmul from one of lce's threads, on a tile
// fixed by the shapes, like the sgemm tiles: results do not depend on thread counts.
// oneDNN runs on OpenMP: the calling thread's OpenMP thread count is set to 1 around
// the call and restored. Primitives are created once per shape and thread and kept.

#include <lce/core/config.hpp>
#include <lce/core/dtypes.hpp>

#include <oneapi/dnnl/dnnl.hpp>
#include <omp.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <tuple>

LCE_BEGIN_NAMESPACE
namespace detail {

inline constexpr bool bf16_gemm_onednn = true;

// Whether oneDNN runs bf16 matmuls on this CPU's bf16 instructions (AVX512-BF16 or AMX);
// without them the host backend widens to fp32 as before.
inline bool onednn_bf16_gemm_available() {
  static const bool available = [] {
    try {
      const auto isa = dnnl::get_effective_cpu_isa();
      return isa == dnnl::cpu_isa::avx512_core_bf16 || isa == dnnl::cpu_isa::avx512_core_amx;
    } catch (...) {
      return false;
    }
  }();
  return available;
}

// C[m, n] = alpha A[m, k] B[k, n] + beta C (beta = 0 overwrites C), A and B bf16 given by their
// row and column strides (so either may be a transpose), C fp32 row-major with ldc.
inline void onednn_bf16_gemm(std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const bfloat16* a,
                             std::int64_t a_row, std::int64_t a_col, const bfloat16* b, std::int64_t b_row,
                             std::int64_t b_col, float beta, float* c, std::int64_t ldc) {
  if (m == 0 || n == 0) return;
  struct one_thread {
    int saved = omp_get_max_threads();
    one_thread() {
      if (saved != 1) omp_set_num_threads(1);
    }
    ~one_thread() {
      if (saved != 1) omp_set_num_threads(saved);
    }
  } openmp;
  using key_type = std::tuple<std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t,
                              std::int64_t, std::int64_t, std::uint32_t, std::uint32_t>;
  struct cache_type {
    dnnl::engine engine{dnnl::engine::kind::cpu, 0};
    dnnl::stream stream{engine};
    std::map<key_type, std::tuple<dnnl::matmul, dnnl::memory::desc, dnnl::memory::desc, dnnl::memory::desc>> entries;
  };
  thread_local cache_type cache;  // primitives are not shared between threads
  std::uint32_t alpha_bits, beta_bits;
  std::memcpy(&alpha_bits, &alpha, sizeof alpha_bits);
  std::memcpy(&beta_bits, &beta, sizeof beta_bits);
  const key_type key{m, n, k, a_row, a_col, b_row, b_col, ldc, alpha_bits, beta_bits};
  auto found = cache.entries.find(key);
  if (found == cache.entries.end()) {
    // A few shapes per operator and call (full and last tiles, chunks): a
    // small bound keeps the cache's memory constant however many shapes
    // (ragged last chunks, temperatures) a long run sees.
    constexpr std::size_t max_entries = 32;
    if (cache.entries.size() >= max_entries) cache.entries.clear();
    using dt = dnnl::memory::data_type;
    const dnnl::memory::desc ad({m, k}, dt::bf16, {a_row, a_col}), bd({k, n}, dt::bf16, {b_row, b_col}),
        cd({m, n}, dt::f32, {ldc, 1});
    dnnl::primitive_attr attr;
    if (alpha != 1.0f) attr.set_output_scales(0, {alpha});
    if (beta != 0.0f) {
      dnnl::post_ops ops;
      ops.append_sum(beta);
      attr.set_post_ops(ops);
    }
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(ad, bd, cd), attr, cache.engine);
    found = cache.entries.emplace(key, std::tuple{dnnl::matmul(pd), ad, bd, cd}).first;
  }
  auto& [primitive, ad, bd, cd] = found->second;
  dnnl::memory am(ad, cache.engine, const_cast<bfloat16*>(a)), bm(bd, cache.engine, const_cast<bfloat16*>(b)),
      cm(cd, cache.engine, c);
  primitive.execute(cache.stream, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}});
  cache.stream.wait();
}

// What runs these GEMMs, for lce::blas_info(): "oneDNN 2.6.3, brg:avx512_core_amx_bf16".
inline std::string onednn_bf16_gemm_description() {
  const auto* v = dnnl::version();
  std::string out = "oneDNN " + std::to_string(v->major) + "." + std::to_string(v->minor) + "." +
                    std::to_string(v->patch);
  try {
    using dt = dnnl::memory::data_type;
    const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
    const dnnl::memory::desc ad({256, 256}, dt::bf16, {256, 1}), bd({256, 256}, dt::bf16, {256, 1}),
        cd({256, 256}, dt::f32, {256, 1});
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(ad, bd, cd), engine);
    out += std::string(", ") + pd.impl_info_str();
  } catch (const dnnl::error&) {
    out += ", no bf16 matmul";
  }
  return out;
}

}  // namespace detail
LCE_END_NAMESPACE
