// 2-byte GEMMs on the CPU's bf16 instructions (oneDNN's matmul: AVX512-BF16 or AMX)
// against what lce's host backend does now for a bf16 weight (widen to fp32, OpenBLAS
// sgemm), at lce's three GEMMs of one chunk of C tokens:
//
//   logits  z[C, V]  = X[C, H] W[V, H]^T      (lce: X widened once per chunk, W per tile)
//   dX      dX[C, H] = dz[C, V] W[V, H]        (dz is fp32 in lce)
//   dW      dW[V, H] += dz[C, V]^T X[C, H]     (fp32 accumulator; lce: all fp32)
//
//   lce_bf16_gemm [--threads 1,2] [--tokens 1024] [--hidden 1024] [--vocab 32000]
//                 [--reps 5] [--rounds 3] [--isa all|avx512_core_bf16|avx512_core]
//                 [--check-rows 32]
//
// Rows, per thread count (milliseconds, best of rounds x reps; every competitor timed in
// each round, so they share the machine's state):
//   lce float      lce::host with a float weight (sgemm tiles)
//   lce bf16       lce::host with a bf16 weight, on the bf16 GEMM it chose (the header's
//                  "bf16 GEMMs:" says which; LCE_BF16_GEMM=amx|avx512bf16|onednn|widen asks):
//                  on lce's own kernel, logits bf16 and dX, dW with dz split into hi + lo as the
//                  kernel packs it; on oneDNN, logits and dX (dz split in a pass of its
//                  own), dW sgemm; widened, all sgemm. The widening of X (once per chunk,
//                  which the engine does) is in `logits`
//   dnnl bf16      oneDNN bf16 x bf16 -> f32; X, W as they are; dz rounded to bf16 once
//                  per chunk (that conversion, by lce's threads, is in `dz->bf16`)
//   dnnl bf16 x2   dz kept to 16 bits as two bf16 parts hi + lo, two GEMMs each for dX, dW
//   dnnl f32xbf16  dz kept fp32, W or X bf16 (only if this oneDNN has the mixed kernel)
//   dnnl f32       oneDNN's own f32 matmul (for scale)
//   lce bf16 ops   lce::host_bf16_operands (lce::cblas_gemm_bf16_operands): the host
//                  backend's tiles, all three GEMMs on the chosen bf16 kernel, dz rounded
//                  to bf16 once per chunk (in `dz->bf16`)
//   lce amx,       lce's own kernel (lce/host/detail/own_bf16_gemm.hpp) on AMX tiles or on
//   lce avx512     AVX512-BF16 (lce_torch's LCE_TORCH_BF16_GEMM=amx or avx512bf16), dz
//                  rounded to bf16 as in `dnnl bf16`, one
//                  single-threaded call per tile from OpenMP's threads as lce's host backend
//                  calls a provider: logits in vocabulary tiles of 2,000, dX in one piece of
//                  columns per thread over the whole vocabulary, dW in vocabulary tiles of
//                  1,024 (each only on a CPU with that unit)
//   lce amx calls, the same kernel on lce_torch's own calls (traced at N = 512): per
//   lce avx512 calls  vocabulary tile of 1,024 rows, each GEMM in two halves of 512 (one per
//                  thread on two threads), logits into fp32 tiles, dX over dz kept in the
//                  first half of each fp32 logit row (rows 4 KiB apart), dW into a bf16
//                  weight gradient. bench/bf16_gemm_torch.py --lce-torch-calls times torch.mm
//                  on the same calls
// Then accuracy on sampled rows against a double-precision reference of the same inputs
// (the bf16 values, and dz in fp32): max |error| / sum |a_i b_i| (the bound an fp32
// accumulation keeps near 1e-7 and a bf16 one could not), and rms error / rms value.
#include <lce/host/blas_info.hpp>
#include <lce/host/detail/own_bf16_gemm.hpp>
#include <lce/lce.hpp>

#include <oneapi/dnnl/dnnl.hpp>
#include <omp.h>

#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace {

using bf16_t = lce::bfloat16;
using lce::matrix_view;
using clock_type = std::chrono::steady_clock;
using dt = dnnl::memory::data_type;

std::vector<long long> parse_list(const char* text) {
  std::vector<long long> out;
  for (const char* p = text; *p;) {
    char* end = nullptr;
    out.push_back(std::strtoll(p, &end, 10));
    if (end == p) break;
    p = *end == ',' ? end + 1 : end;
  }
  return out;
}

struct config {
  std::vector<long long> threads{1, 2};
  long long C = 1024, H = 1024, V = 32000;
  int reps = 5, rounds = 3, check_rows = 32;
  std::string isa = "all";
};

// One oneDNN matmul, C[m, n] = A[m, k] B[k, n] (+ C with accumulate), its operands
// described by row/column strides so transposes need no copies.
struct matmul {
  dnnl::matmul prim;
  dnnl::memory::desc a, b, c;
  std::string impl;

  static std::optional<matmul> make(const dnnl::engine& eng, long long m, long long n, long long k, dt ta,
                                    dnnl::memory::dims sa, dt tb, dnnl::memory::dims sb, bool accumulate) {
    try {
      matmul out;
      out.a = dnnl::memory::desc({m, k}, ta, sa);
      out.b = dnnl::memory::desc({k, n}, tb, sb);
      out.c = dnnl::memory::desc({m, n}, dt::f32, dnnl::memory::dims{n, 1});
      dnnl::primitive_attr attr;
      if (accumulate) {
        dnnl::post_ops ops;
        ops.append_sum(1.0f);
        attr.set_post_ops(ops);
      }
      dnnl::matmul::desc d(out.a, out.b, out.c);
      dnnl::matmul::primitive_desc pd(d, attr, eng);
      out.impl = pd.impl_info_str();
      out.prim = dnnl::matmul(pd);
      return out;
    } catch (const dnnl::error&) {
      return std::nullopt;
    }
  }

  void run(const dnnl::engine& eng, dnnl::stream& s, const void* pa, const void* pb, float* pc) const {
    dnnl::memory ma(a, eng, const_cast<void*>(pa)), mb(b, eng, const_cast<void*>(pb)), mc(c, eng, pc);
    prim.execute(s, {{DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, mc}});
    s.wait();
  }
};

struct error_stats {
  double max_bound = 0, sq_err = 0, sq_ref = 0;
  void add(double got, double ref, double bound) {
    const double e = std::fabs(got - ref);
    max_bound = std::max(max_bound, bound > 0 ? e / bound : e);
    sq_err += e * e, sq_ref += ref * ref;
  }
  double rms() const { return sq_ref > 0 ? std::sqrt(sq_err / sq_ref) : 0; }
};

// What the AVX512-BF16 unit can do on `threads` threads, the scale of the GEMM rows'
// GFLOP/s: 12 independent VDPBF16PS chains per thread on registers, no memory, 64 FLOPs
// each (a Zen 4 runs one a cycle on its 256-bit units, a Zen 5 two).
__attribute__((target("avx512f,avx512bf16"))) double avx512_bf16_peak_gflops(int threads) {
  constexpr int chains = 12;
  constexpr long long steps = 4'000'000;
  const auto t0 = clock_type::now();
#pragma omp parallel num_threads(threads)
  {
    __m512 acc[chains];
    for (auto& a : acc) a = _mm512_setzero_ps();
    const __m512bh one = (__m512bh)_mm512_set1_epi16(0x3f80);
    for (long long i = 0; i < steps; ++i) {
#pragma GCC unroll 12  // the chains in registers, not an array in memory
      for (int c = 0; c < chains; ++c) {
        acc[c] = _mm512_dpbf16_ps(acc[c], one, one);
        asm volatile("" ::"v"(acc[c]));  // keeps each chain's every step
      }
    }
    float sum = 0;
    for (auto& a : acc) sum += _mm512_reduce_add_ps(a);
    asm volatile("" ::"r"(sum));
  }
  const double seconds = std::chrono::duration<double>(clock_type::now() - t0).count();
  return double(threads) * steps * chains * 64 / seconds * 1e-9;
}

}  // namespace

int main(int argc, char** argv) {
  lce::reexec_with_fast_blas(argv);  // OpenBLAS's SSE3 fallback: restart with OPENBLAS_CORETYPE set
  config cfg;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--threads") cfg.threads = parse_list(argv[i + 1]);
    else if (a == "--tokens") cfg.C = std::atoll(argv[i + 1]);
    else if (a == "--hidden") cfg.H = std::atoll(argv[i + 1]);
    else if (a == "--vocab") cfg.V = std::atoll(argv[i + 1]);
    else if (a == "--reps") cfg.reps = std::max(1, std::atoi(argv[i + 1]));
    else if (a == "--rounds") cfg.rounds = std::max(1, std::atoi(argv[i + 1]));
    else if (a == "--check-rows") cfg.check_rows = std::max(0, std::atoi(argv[i + 1]));
    else if (a == "--isa") cfg.isa = argv[i + 1];
  }
  if (cfg.isa == "avx512_core_bf16") dnnl::set_max_cpu_isa(dnnl::cpu_isa::avx512_core_bf16);
  else if (cfg.isa == "avx512_core") dnnl::set_max_cpu_isa(dnnl::cpu_isa::avx512_core);
  const long long C = cfg.C, H = cfg.H, V = cfg.V;

  // Inputs: X, W in bf16 (and their exact fp32 values), dz in fp32 and rounded to bf16.
  std::vector<bf16_t> xb(C * H), wb(V * H), dzb(C * V);
  std::vector<float> xf(C * H), wf(V * H), dz(C * V);
  std::uint64_t seed = 12345;
  auto unit = [&] {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    return float(seed >> 40) * (1.0f / 16777216.0f) - 0.5f;
  };
  for (long long i = 0; i < C * H; ++i) xb[i] = bf16_t(2.0f * unit()), xf[i] = float(xb[i]);
  for (long long i = 0; i < V * H; ++i) wb[i] = bf16_t(0.1f * unit()), wf[i] = float(wb[i]);
  for (long long i = 0; i < C * V; ++i) dz[i] = unit() / float(V);
  std::vector<float> z(C * V), dx(C * H), dw(V * H), xw(C * H);
  // dz as two bf16 parts, hi + lo (hi = bf16(dz), lo = bf16(dz - hi)): 16 of fp32's 24
  // significant bits, so two bf16 GEMMs summed in fp32 give dz W to about 2^-17.
  std::vector<bf16_t> dz_hi(C * V), dz_lo(C * V);
  const auto split_dz = [&] {
#pragma omp parallel for schedule(static)
    for (long long r = 0; r < C; ++r)
      for (long long i = r * V; i < (r + 1) * V; ++i) {
        const bf16_t hi(dz[i]);
        dz_hi[i] = hi, dz_lo[i] = bf16_t(dz[i] - float(hi));
      }
  };

  // lce's own kernel, one call per tile (see "lce amx" above); dW adds into dw as the others do.
  using lce::transpose;
  using lce::detail::bf16_unit;
  const auto own_logits = [&](bf16_unit unit, const bf16_t* x, const bf16_t* w, float* out) {
    constexpr long long tile = 2000;
#pragma omp parallel for schedule(dynamic)
    for (long long v0 = 0; v0 < V; v0 += tile)
      lce::detail::own_bf16_gemm(unit, transpose::no, transpose::yes, C, std::min(tile, V - v0), H, 1.0f, x, H,
                                 w + v0 * H, H, 0.0f, out + v0, V);
  };
  const auto own_grad_hidden = [&](bf16_unit unit, const bf16_t* d, const bf16_t* w, float* out, long long pieces) {
    const long long width = (H + pieces - 1) / pieces;
#pragma omp parallel for schedule(static)
    for (long long p = 0; p < pieces; ++p) {
      const long long c0 = p * width, cols = std::min(width, H - c0);
      if (cols > 0)
        lce::detail::own_bf16_gemm(unit, transpose::no, transpose::no, C, cols, V, 1.0f, d, V, w + c0, H, 0.0f, out + c0,
                                   H);
    }
  };
  const auto own_grad_weight = [&](bf16_unit unit, const bf16_t* d, const bf16_t* x, float* out) {
    constexpr long long tile = 1024;
#pragma omp parallel for schedule(dynamic)
    for (long long v0 = 0; v0 < V; v0 += tile)
      lce::detail::own_bf16_gemm(unit, transpose::yes, transpose::no, std::min(tile, V - v0), H, C, 1.0f, d + v0, V, x,
                                 H, 1.0f, out + v0 * H, H);
  };

  // lce_torch's own calls (traced at N = 512, H = 1,024, V = 32,000, on one and two threads):
  // per vocabulary tile of 1,024 rows, each GEMM in two halves of 512, one per thread on two
  // threads. Logits [C, 512] at depth H into the tile's fp32 logits (rows 1,024 floats apart);
  // dX [C, 512] of H's columns over the tile's 1,024 rows of dz, added into fp32 dX (dz kept
  // over the first half of each fp32 logit row: rows 2,048 bf16 apart); dW [512, H] at depth C
  // rounded straight into a bf16 weight gradient. bench/bf16_gemm_torch.py --lce-torch-calls
  // times torch.mm on the same calls.
  constexpr long long call_tile = 1024, half_tile = 512;
  std::vector<float> tile_logits(C * call_tile);
  std::vector<bf16_t> kept_dz(C * 2 * call_tile), dw_bf16(V * H);
  for (long long r = 0; r < C; ++r)
    for (long long j = 0; j < call_tile; ++j) kept_dz[r * 2 * call_tile + j] = dzb[r * V + j];
  const auto tile_halves = [&](auto&& call) {
    for (long long v0 = 0; v0 < V; v0 += call_tile) {
      const long long rows = std::min(call_tile, V - v0);
#pragma omp parallel for schedule(static)
      for (long long h = 0; h < 2; ++h) call(v0, rows, h);
    }
  };
  const auto tile_logits_calls = [&](bf16_unit unit) {
    tile_halves([&](long long v0, long long rows, long long h) {
      const long long first = h * half_tile, n = std::min(half_tile, rows - first);
      if (n > 0)
        lce::detail::own_bf16_gemm(unit, transpose::no, transpose::yes, C, n, H, 1.0f, xb.data(), H,
                                   wb.data() + (v0 + first) * H, H, 0.0f, tile_logits.data() + first, call_tile);
    });
  };
  const auto tile_grad_hidden_calls = [&](bf16_unit unit) {
    tile_halves([&](long long v0, long long rows, long long h) {
      const long long c0 = h * (H / 2);
      lce::detail::own_bf16_gemm(unit, transpose::no, transpose::no, C, H / 2, rows, 1.0f, kept_dz.data(),
                                 2 * call_tile, wb.data() + v0 * H + c0, H, v0 == 0 ? 0.0f : 1.0f, dx.data() + c0, H);
    });
  };
  const auto tile_grad_weight_calls = [&](bf16_unit unit) {
    tile_halves([&](long long v0, long long rows, long long h) {
      const long long first = h * half_tile, n = std::min(half_tile, rows - first);
      if (n > 0)
        lce::detail::own_bf16_gemm_into_bf16(unit, transpose::yes, transpose::no, n, H, C, 1.0f,
                                             kept_dz.data() + first, 2 * call_tile, xb.data(), H, 0.0f,
                                             dw_bf16.data() + (v0 + first) * H, H);
    });
  };

  // The units lce's own kernel runs on here, each with its row.
  std::vector<std::pair<bf16_unit, std::string>> own_units;
  if (lce::detail::amx_bf16_gemm_available()) own_units.emplace_back(bf16_unit::amx, "lce amx");
  if (lce::detail::avx512_bf16_gemm_available()) own_units.emplace_back(bf16_unit::avx512, "lce avx512");

  const auto* dnnl_version = dnnl::version();
  dnnl::engine eng(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(eng);
  std::printf("%s\noneDNN %d.%d.%d (%s), max ISA %s; C = %lld, H = %lld, V = %lld; best of %d rounds x %d reps\n",
              lce::blas_info().line().c_str(), dnnl_version->major, dnnl_version->minor, dnnl_version->patch,
              dnnl_version->cpu_runtime == DNNL_RUNTIME_OMP ? "OpenMP" : "other", cfg.isa.c_str(), C, H, V,
              cfg.rounds, cfg.reps);

  const double gflop = 2.0 * double(C) * double(V) * double(H) * 1e-9;
  for (long long threads : cfg.threads) {
    omp_set_num_threads(int(threads));
    lce::host host{int(threads)};
    lce::host_bf16_operands ops_host{int(threads)};
    std::vector<float> block(std::size_t(host.weight_block_elements<bf16_t>(H, V)));
    using cf = const float;
    using cb = const bf16_t;
    const matrix_view<cb> Xb{xb.data(), C, H, H}, Wb{wb.data(), V, H, H};
    const matrix_view<cf> Xf{xf.data(), C, H, H}, Wf{wf.data(), V, H, H}, Dz{dz.data(), C, V, V};
    const matrix_view<cb> Dzb{dzb.data(), C, V, V};
    const matrix_view<float> Z{z.data(), C, V, V}, DX{dx.data(), C, H, H}, DW{dw.data(), V, H, H},
        XW{xw.data(), C, H, H};

    // oneDNN matmuls; strides {row, column} of A[m, k] and B[k, n] as stored.
    const auto logits_b = matmul::make(eng, C, V, H, dt::bf16, {H, 1}, dt::bf16, {1, H}, false);
    const auto dx_b = matmul::make(eng, C, H, V, dt::bf16, {V, 1}, dt::bf16, {H, 1}, false);
    const auto dw_b = matmul::make(eng, V, H, C, dt::bf16, {1, V}, dt::bf16, {H, 1}, true);
    const auto dx_b_sum = matmul::make(eng, C, H, V, dt::bf16, {V, 1}, dt::bf16, {H, 1}, true);
    const auto dx_m = matmul::make(eng, C, H, V, dt::f32, {V, 1}, dt::bf16, {H, 1}, false);
    const auto dw_m = matmul::make(eng, V, H, C, dt::f32, {1, V}, dt::bf16, {H, 1}, true);
    const auto logits_f = matmul::make(eng, C, V, H, dt::f32, {H, 1}, dt::f32, {1, H}, false);
    const auto dx_f = matmul::make(eng, C, H, V, dt::f32, {V, 1}, dt::f32, {H, 1}, false);
    const auto dw_f = matmul::make(eng, V, H, C, dt::f32, {1, V}, dt::f32, {H, 1}, true);
    if (threads == cfg.threads.front()) {
      std::printf("oneDNN kernels: logits bf16 %s, dX bf16 %s, dW bf16 %s; f32 x bf16: dX %s, dW %s; f32 %s\n",
                  logits_b ? logits_b->impl.c_str() : "-", dx_b ? dx_b->impl.c_str() : "-",
                  dw_b ? dw_b->impl.c_str() : "-", dx_m ? dx_m->impl.c_str() : "unsupported",
                  dw_m ? dw_m->impl.c_str() : "unsupported", logits_f ? logits_f->impl.c_str() : "-");
    }

    // name -> the work, timed as one unit.
    struct entry {
      std::string row, column;
      std::function<void()> call;
      double best = 1e300;
    };
    std::vector<entry> work;
    work.push_back({"lce float", "logits", [&] { host.logits<float, float>(Xf, Wf, 1.0f, Z, nullptr); }});
    work.push_back({"lce float", "dX", [&] { host.grad_hidden<float, float>(Dz, Wf, 1.0f, DX, nullptr); }});
    work.push_back({"lce float", "dW", [&] { host.grad_weight<float>(Dz, Xf, 1.0f, DW); }});
    work.push_back({"lce bf16", "logits", [&] {
                      host.copy(Xb, XW);  // the engine widens the chunk's hidden rows once
                      host.logits<float, bf16_t>(XW, Wb, 1.0f, Z, block.data());
                    }});
    work.push_back({"lce bf16", "dX", [&] { host.grad_hidden<float, bf16_t>(Dz, Wb, 1.0f, DX, block.data()); }});
    // The engine tells the backend the weight's type (lce::weight_element), as here.
    work.push_back({"lce bf16", "dW", [&] {
                      host.grad_weight(Dz, matrix_view<cf>(XW), 1.0f, DW, lce::weight_element<bf16_t>{});
                    }});
    if (logits_b) work.push_back({"dnnl bf16", "logits", [&] { logits_b->run(eng, stream, xb.data(), wb.data(), z.data()); }});
    work.push_back({"dnnl bf16", "dz->bf16", [&] { host.copy(Dz, matrix_view<bf16_t>{dzb.data(), C, V, V}); }});
    if (dx_b) work.push_back({"dnnl bf16", "dX", [&] { dx_b->run(eng, stream, dzb.data(), wb.data(), dx.data()); }});
    if (dw_b) work.push_back({"dnnl bf16", "dW", [&] { dw_b->run(eng, stream, dzb.data(), xb.data(), dw.data()); }});
    if (logits_b) work.push_back({"dnnl bf16 x2", "logits", [&] { logits_b->run(eng, stream, xb.data(), wb.data(), z.data()); }});
    work.push_back({"dnnl bf16 x2", "dz->bf16", split_dz});
    if (dx_b && dx_b_sum) work.push_back({"dnnl bf16 x2", "dX", [&] {
                      dx_b->run(eng, stream, dz_hi.data(), wb.data(), dx.data());
                      dx_b_sum->run(eng, stream, dz_lo.data(), wb.data(), dx.data());
                    }});
    if (dw_b) work.push_back({"dnnl bf16 x2", "dW", [&] {
                      dw_b->run(eng, stream, dz_hi.data(), xb.data(), dw.data());
                      dw_b->run(eng, stream, dz_lo.data(), xb.data(), dw.data());
                    }});
    if (dx_m) work.push_back({"dnnl f32xbf16", "dX", [&] { dx_m->run(eng, stream, dz.data(), wb.data(), dx.data()); }});
    if (dw_m) work.push_back({"dnnl f32xbf16", "dW", [&] { dw_m->run(eng, stream, dz.data(), xb.data(), dw.data()); }});
    if (logits_f) work.push_back({"dnnl f32", "logits", [&] { logits_f->run(eng, stream, xf.data(), wf.data(), z.data()); }});
    if (dx_f) work.push_back({"dnnl f32", "dX", [&] { dx_f->run(eng, stream, dz.data(), wf.data(), dx.data()); }});
    if (dw_f) work.push_back({"dnnl f32", "dW", [&] { dw_f->run(eng, stream, dz.data(), xf.data(), dw.data()); }});

    // lce::host_bf16_operands: the host backend's own tiles over the same bf16 kernel, dz
    // rounded to bf16 by the backend (as the engine does once per chunk).
    work.push_back({"lce bf16 ops", "logits", [&] { ops_host.logits<bf16_t, bf16_t>(Xb, Wb, 1.0f, Z, nullptr); }});
    work.push_back({"lce bf16 ops", "dz->bf16", [&] { ops_host.copy(Dz, matrix_view<bf16_t>{dzb.data(), C, V, V}); }});
    work.push_back({"lce bf16 ops", "dX", [&] { ops_host.grad_hidden<bf16_t, bf16_t>(Dzb, Wb, 1.0f, DX, nullptr); }});
    work.push_back({"lce bf16 ops", "dW", [&] { ops_host.grad_weight<bf16_t>(Dzb, Xb, 1.0f, DW); }});
    for (const auto& own : own_units) {
      const bf16_unit unit = own.first;
      const std::string& row = own.second;
      work.push_back({row, "logits", [&, unit] { own_logits(unit, xb.data(), wb.data(), z.data()); }});
      work.push_back({row, "dz->bf16", [&] { host.copy(Dz, matrix_view<bf16_t>{dzb.data(), C, V, V}); }});
      work.push_back({row, "dX", [&, unit] { own_grad_hidden(unit, dzb.data(), wb.data(), dx.data(), threads); }});
      work.push_back({row, "dW", [&, unit] { own_grad_weight(unit, dzb.data(), xb.data(), dw.data()); }});
      work.push_back({row + " calls", "logits", [&, unit] { tile_logits_calls(unit); }});
      work.push_back({row + " calls", "dX", [&, unit] { tile_grad_hidden_calls(unit); }});
      work.push_back({row + " calls", "dW", [&, unit] { tile_grad_weight_calls(unit); }});
    }

    for (auto& e : work) e.call();  // warm-up
    for (int round = 0; round < cfg.rounds; ++round) {
      for (auto& e : work) {
        for (int r = 0; r < cfg.reps; ++r) {
          const auto t0 = clock_type::now();
          e.call();
          e.best = std::min(e.best, std::chrono::duration<double>(clock_type::now() - t0).count());
        }
      }
    }
    std::map<std::string, std::map<std::string, double>> table;
    std::vector<std::string> order;
    for (const auto& e : work) {
      if (!table.count(e.row)) order.push_back(e.row);
      table[e.row][e.column] = e.best * 1e3;
    }
    std::printf("\nthreads %lld: milliseconds (GFLOP/s)\n", threads);
    if (lce::detail::avx512_bf16_gemm_available())
      std::printf("AVX512-BF16 peak on %lld threads (VDPBF16PS chains on registers): %.0f GFLOP/s\n", threads,
                  avx512_bf16_peak_gflops(int(threads)));
    std::printf("| %-16s | %15s | %15s | %15s | %9s | %9s |\n", "", "logits (NT)", "dX (NN)", "dW (TN)", "dz->bf16",
                "sum");
    std::printf("|------------------|----------------:|----------------:|----------------:|----------:|----------:|\n");
    const double base = table["lce bf16"]["logits"] + table["lce bf16"]["dX"] + table["lce bf16"]["dW"];
    for (const auto& row : order) {
      auto& cols = table[row];
      auto cell = [&](const char* c) {
        char text[64] = "-";
        if (cols.count(c)) std::snprintf(text, sizeof text, "%7.1f (%4.0f)", cols[c], gflop / (cols[c] * 1e-3));
        return std::string(text);
      };
      double sum = 0;
      for (const char* c : {"logits", "dX", "dW", "dz->bf16"}) sum += cols.count(c) ? cols[c] : 0;
      char conv[32] = "-";
      if (cols.count("dz->bf16")) std::snprintf(conv, sizeof conv, "%.1f", cols["dz->bf16"]);
      std::printf("| %-16s | %15s | %15s | %15s | %9s | %9.1f |\n", row.c_str(), cell("logits").c_str(),
                  cell("dX").c_str(), cell("dW").c_str(), conv, sum);
      if (row.rfind("dnnl bf16", 0) == 0 || row == "lce amx" || row == "lce avx512" || row == "lce bf16 ops")
        std::printf("|   lce bf16 / %s, whole sweep: %.2fx |\n", row.c_str(), base / sum);
    }
    std::fflush(stdout);
  }

  // ---- accuracy, on sampled rows (one thread count's results are as good as any) ----
  if (cfg.check_rows == 0) return 0;
  omp_set_num_threads(int(cfg.threads.back()));
  lce::host host{int(cfg.threads.back())};
  std::vector<float> block(std::size_t(host.weight_block_elements<bf16_t>(H, V)));
  std::vector<long long> rows_c, rows_v;
  for (int i = 0; i < cfg.check_rows; ++i) rows_c.push_back(i * C / cfg.check_rows + (i * 7) % std::max(1LL, C / cfg.check_rows));
  for (int i = 0; i < 2 * cfg.check_rows; ++i) rows_v.push_back(i * V / (2 * cfg.check_rows) + (i * 13) % std::max(1LL, V / (2 * cfg.check_rows)));
  for (long long i = 0; i < C * V; ++i) dzb[i] = bf16_t(dz[i]);

  // Results of each method: logits, dX, dW (dW from zero).
  struct results {
    std::vector<float> z, dx, dw;
  };
  auto fresh = [&] { return results{std::vector<float>(C * V), std::vector<float>(C * H), std::vector<float>(V * H, 0.0f)}; };
  std::map<std::string, results> got;
  {
    results r = fresh();
    std::vector<float> xw2(C * H);
    const matrix_view<float> XW{xw2.data(), C, H, H};
    host.copy(matrix_view<const bf16_t>{xb.data(), C, H, H}, XW);
    host.logits<float, bf16_t>(XW, matrix_view<const bf16_t>{wb.data(), V, H, H}, 1.0f,
                                 matrix_view<float>{r.z.data(), C, V, V}, block.data());
    host.grad_hidden<float, bf16_t>(matrix_view<const float>{dz.data(), C, V, V},
                                      matrix_view<const bf16_t>{wb.data(), V, H, H}, 1.0f,
                                      matrix_view<float>{r.dx.data(), C, H, H}, block.data());
    host.grad_weight(matrix_view<const float>{dz.data(), C, V, V}, matrix_view<const float>(XW), 1.0f,
                     matrix_view<float>{r.dw.data(), V, H, H}, lce::weight_element<bf16_t>{});
    got["lce bf16 (host backend)"] = std::move(r);
  }
  {
    results r = fresh();
    auto l = matmul::make(eng, C, V, H, dt::bf16, {H, 1}, dt::bf16, {1, H}, false);
    auto a = matmul::make(eng, C, H, V, dt::bf16, {V, 1}, dt::bf16, {H, 1}, false);
    auto b = matmul::make(eng, V, H, C, dt::bf16, {1, V}, dt::bf16, {H, 1}, true);
    l->run(eng, stream, xb.data(), wb.data(), r.z.data());
    a->run(eng, stream, dzb.data(), wb.data(), r.dx.data());
    b->run(eng, stream, dzb.data(), xb.data(), r.dw.data());
    got["dnnl bf16 (dz rounded)"] = std::move(r);
  }
  {
    results r = fresh();
    auto l = matmul::make(eng, C, V, H, dt::bf16, {H, 1}, dt::bf16, {1, H}, false);
    auto a = matmul::make(eng, C, H, V, dt::bf16, {V, 1}, dt::bf16, {H, 1}, false);
    auto a_sum = matmul::make(eng, C, H, V, dt::bf16, {V, 1}, dt::bf16, {H, 1}, true);
    auto b = matmul::make(eng, V, H, C, dt::bf16, {1, V}, dt::bf16, {H, 1}, true);
    split_dz();
    l->run(eng, stream, xb.data(), wb.data(), r.z.data());
    a->run(eng, stream, dz_hi.data(), wb.data(), r.dx.data());
    a_sum->run(eng, stream, dz_lo.data(), wb.data(), r.dx.data());
    b->run(eng, stream, dz_hi.data(), xb.data(), r.dw.data());
    b->run(eng, stream, dz_lo.data(), xb.data(), r.dw.data());
    got["dnnl bf16 x2 (dz hi+lo)"] = std::move(r);
  }
  {
    results r = fresh();
    lce::host_bf16_operands ops_host{int(cfg.threads.back())};
    ops_host.logits<bf16_t, bf16_t>(matrix_view<const bf16_t>{xb.data(), C, H, H},
                                    matrix_view<const bf16_t>{wb.data(), V, H, H}, 1.0f,
                                    matrix_view<float>{r.z.data(), C, V, V}, nullptr);
    ops_host.grad_hidden<bf16_t, bf16_t>(matrix_view<const bf16_t>{dzb.data(), C, V, V},
                                         matrix_view<const bf16_t>{wb.data(), V, H, H}, 1.0f,
                                         matrix_view<float>{r.dx.data(), C, H, H}, nullptr);
    ops_host.grad_weight<bf16_t>(matrix_view<const bf16_t>{dzb.data(), C, V, V},
                                 matrix_view<const bf16_t>{xb.data(), C, H, H}, 1.0f,
                                 matrix_view<float>{r.dw.data(), V, H, H});
    got["lce bf16 ops (dz rounded)"] = std::move(r);
  }
  for (const auto& [unit, row] : own_units) {
    results r = fresh();
    own_logits(unit, xb.data(), wb.data(), r.z.data());
    own_grad_hidden(unit, dzb.data(), wb.data(), r.dx.data(), cfg.threads.back());
    own_grad_weight(unit, dzb.data(), xb.data(), r.dw.data());
    got[row + " (dz rounded)"] = std::move(r);
  }
  if (auto a = matmul::make(eng, C, H, V, dt::f32, {V, 1}, dt::bf16, {H, 1}, false)) {
    results r = fresh();
    auto b = matmul::make(eng, V, H, C, dt::f32, {1, V}, dt::bf16, {H, 1}, true);
    auto l = matmul::make(eng, C, V, H, dt::bf16, {H, 1}, dt::bf16, {1, H}, false);
    l->run(eng, stream, xb.data(), wb.data(), r.z.data());
    a->run(eng, stream, dz.data(), wb.data(), r.dx.data());
    if (b) b->run(eng, stream, dz.data(), xb.data(), r.dw.data());
    got["dnnl f32xbf16 (dz fp32)"] = std::move(r);
  }

  // Double-precision references on the sampled rows, with the bound sum |a b| per element.
  std::printf("\naccuracy on %zu token rows (logits, dX) and %zu vocabulary rows (dW), all columns:\n"
              "max |err| / sum|a b|, and rms err / rms value; reference in double from the same bf16 X, W and fp32 dz\n",
              rows_c.size(), rows_v.size());
  std::printf("| %-28s | %-21s | %-21s | %-21s |\n", "", "logits", "dX", "dW");
  std::printf("|------------------------------|-----------------------|-----------------------|-----------------------|\n");
  std::map<std::string, error_stats[3]> stats;
  std::map<std::string, error_stats[3]> versus_lce;  // against the host backend's result, same bound
  const auto& lce_now = got["lce bf16 (host backend)"];
  for (long long r : rows_c) {
    for (long long v = 0; v < V; ++v) {
      double ref = 0, bound = 0;
      for (long long h = 0; h < H; ++h) {
        const double p = double(xf[r * H + h]) * double(wf[v * H + h]);
        ref += p, bound += std::fabs(p);
      }
      for (auto& [name, res] : got) {
        stats[name][0].add(res.z[r * V + v], ref, bound);
        versus_lce[name][0].add(res.z[r * V + v], lce_now.z[r * V + v], bound);
      }
    }
    std::vector<double> ref(H, 0.0), bound(H, 0.0);
    for (long long v = 0; v < V; ++v) {
      const double d = dz[r * V + v];
      for (long long h = 0; h < H; ++h) {
        const double p = d * double(wf[v * H + h]);
        ref[h] += p, bound[h] += std::fabs(p);
      }
    }
    for (auto& [name, res] : got)
      for (long long h = 0; h < H; ++h) {
        stats[name][1].add(res.dx[r * H + h], ref[h], bound[h]);
        versus_lce[name][1].add(res.dx[r * H + h], lce_now.dx[r * H + h], bound[h]);
      }
  }
  for (long long v : rows_v) {
    std::vector<double> ref(H, 0.0), bound(H, 0.0);
    for (long long c = 0; c < C; ++c) {
      const double d = dz[c * V + v];
      for (long long h = 0; h < H; ++h) {
        const double p = d * double(xf[c * H + h]);
        ref[h] += p, bound[h] += std::fabs(p);
      }
    }
    for (auto& [name, res] : got)
      for (long long h = 0; h < H; ++h) {
        stats[name][2].add(res.dw[v * H + h], ref[h], bound[h]);
        versus_lce[name][2].add(res.dw[v * H + h], lce_now.dw[v * H + h], bound[h]);
      }
  }
  for (auto& [name, s] : stats) {
    char cells[3][64];
    for (int g = 0; g < 3; ++g) std::snprintf(cells[g], 64, "%.1e, %.1e", s[g].max_bound, s[g].rms());
    std::printf("| %-28s | %-21s | %-21s | %-21s |\n", name.c_str(), cells[0], cells[1], cells[2]);
  }
  for (auto& [name, s] : versus_lce) {
    if (name == "lce bf16 (host backend)") continue;
    char cells[3][64];
    for (int g = 0; g < 3; ++g) std::snprintf(cells[g], 64, "%.1e, %.1e", s[g].max_bound, s[g].rms());
    std::printf("| %-28s | %-21s | %-21s | %-21s |\n", (name + " vs lce").c_str(), cells[0], cells[1], cells[2]);
  }
  return 0;
}
