// lce demo: the output layer of a Llama-3-sized vocabulary (V = 128,256) on 8,192
// tokens, computed two ways with the same BLAS and threads:
//
//   (a) lce forward_backward: one fused sweep over token chunks; the [N, V] logits
//       never exist, only one [C, V] block at a time;
//   (b) the materialised reference: a single GEMM for the full fp32 [N, V] logits,
//       a log-softmax row pass, then two GEMMs for dX and dW.
//
// Both compute the per-token log-probs and the gradients dX, dW of the mean NLL
// (dL/dlogp = -1/N). The demo prints the wall time and the peak extra memory of each
// (bytes allocated beyond the inputs and outputs, counted by replacing the global
// operator new/delete), and how far apart their results are.
//
// --dtype bfloat16 stores X and W as bf16 (lce::host: bf16 GEMMs on the CPU's bf16
// instructions where it has them, dz kept to 16 bits as hi + lo); --dtype bf16-operands
// runs lce::host_bf16_operands (all three GEMMs in bf16, dz rounded once to bf16, as on
// a GPU). The reference then runs on the same bf16 values, widened to fp32.
//
//   lce_demo [--tokens N] [--hidden H] [--vocab V] [--threads T] [--chunk C] [--reps R]
//            [--dtype float|bfloat16|bf16-operands] [--no-reference]
#include <lce/host/blas_info.hpp>
#include <lce/lce.hpp>

#include "allocation_counter.hpp"
#include "command_line.hpp"

#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

// OpenBLAS's thread control, when the BLAS is OpenBLAS (weak: absent otherwise).
extern "C" void openblas_set_num_threads(int) __attribute__((weak));

// The bytes a method allocates (current and peak) are read off a counting
// global operator new (support/allocation_counter.cpp, linked into this program).
namespace counting = lce_support::allocations;

// ---------------------------------------------------------------------------
namespace {

constexpr std::size_t sz(std::int64_t n) { return static_cast<std::size_t>(n); }

using clock_type = std::chrono::steady_clock;
double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

double mib(double bytes) { return bytes / (1024.0 * 1024.0); }

// Peak resident set size of the process (VmHWM), in bytes; -1 if unavailable.
long long peak_rss_bytes() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind("VmHWM:", 0) == 0) return std::atoll(line.c_str() + 6) * 1024LL;
  return -1;
}
// Resets VmHWM to the current RSS (Linux >= 4.0); false if the kernel refused.
bool reset_peak_rss() {
  std::ofstream clear("/proc/self/clear_refs");
  clear << "5";
  clear.flush();
  return bool(clear);
}

// Small fixed-seed generator (splitmix64): fast enough for 10^8 numbers.
struct rng {
  std::uint64_t s;
  std::uint64_t next() {
    std::uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // uniform on [-sqrt(3), sqrt(3)): mean 0, variance 1
  float unit() { return (float(next() >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f) * 1.7320508f; }
};

template <class F>
void parallel_rows(std::int64_t rows, int threads, F&& f) {
  std::vector<std::thread> pool;
  const std::int64_t per = (rows + threads - 1) / threads;
  for (int t = 0; t < threads; ++t) {
    const std::int64_t lo = t * per, hi = std::min(rows, lo + per);
    if (lo < hi) pool.emplace_back([&f, lo, hi] { f(lo, hi); });
  }
  for (auto& th : pool) th.join();
}

// (b) The materialised reference: full [N, V] fp32 logits.
void reference(std::int64_t N, std::int64_t H, std::int64_t V, int threads, const float* x,
               const float* w, const std::int64_t* y, const float* g, float* logp, float* dx,
               float* dw) {
  std::unique_ptr<float[]> z(new float[std::size_t(N) * std::size_t(V)]);
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(N), int(V), int(H), 1.0f, x, int(H),
              w, int(H), 0.0f, z.get(), int(V));
  // log-softmax row pass, then dz = g_i * (onehot(y_i) - p_i) in place of the logits
  parallel_rows(N, threads, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t i = lo; i < hi; ++i) {
      float* row = z.get() + i * V;
      const float m = *std::max_element(row, row + V);
      const float zy = row[y[i]];
      double s = 0.0;
      for (std::int64_t v = 0; v < V; ++v) {
        row[v] = std::exp(row[v] - m);
        s += row[v];
      }
      logp[i] = float(double(zy) - (double(m) + std::log(s)));
      const float scale = float(-g[i] / s);
      for (std::int64_t v = 0; v < V; ++v) row[v] *= scale;
      row[y[i]] += g[i];
    }
  });
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(N), int(H), int(V), 1.0f, z.get(),
              int(V), w, int(H), 0.0f, dx, int(H));
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(V), int(H), int(N), 1.0f, z.get(),
              int(V), x, int(H), 0.0f, dw, int(H));
}

struct diff {
  double max_abs = 0, max_ref = 0;
};
diff compare(const std::vector<float>& a, const std::vector<float>& ref) {
  diff d;
  for (std::size_t i = 0; i < a.size(); ++i) {
    d.max_abs = std::max(d.max_abs, std::fabs(double(a[i]) - double(ref[i])));
    d.max_ref = std::max(d.max_ref, std::fabs(double(ref[i])));
  }
  return d;
}

void usage(const char* argv0) {
  std::fprintf(stderr,
               "usage: %s [--tokens N] [--hidden H] [--vocab V] [--threads T] [--chunk C] [--reps R]\n"
               "          [--dtype float|bfloat16|bf16-operands] (how X and W are stored; default float)\n"
               "          [--no-reference]   (lce only: skip the materialised reference)\n"
               "defaults: N = 8192, H = 256, V = 128256 (Llama-3), T = 0 (all hardware threads),\n"
               "          C = 0 (chosen by the op from its workspace budget), R = 1 (best of R runs)\n",
               argv0);
}

}  // namespace

int main(int argc, char** argv) {
  // OpenBLAS on a CPU model it does not know runs SSE3 kernels: restart once with the
  // OPENBLAS_CORETYPE this CPU allows (not when it or LCE_NO_REEXEC is set).
  lce::reexec_with_fast_blas(argv);
  std::int64_t N = 8192, H = 256, V = 128256, chunk = 0;
  int threads = 0, reps = 1;
  bool with_reference = true;
  std::string dtype = "float";
  for (int i = 1; i < argc; ++i) {
    lce_support::flag f;
    if (!lce_support::read_flag(i, argc, argv, {"-h", "--help", "--no-reference"}, f)) return usage(argv[0]), 2;
    const std::string& arg = f.name;
    if (arg == "-h" || arg == "--help") return usage(argv[0]), 0;
    if (arg == "--no-reference") {
      with_reference = false;
      continue;
    }
    if (arg == "--dtype") {
      dtype = f.value;
      if (dtype != "float" && dtype != "bfloat16" && dtype != "bf16-operands") return usage(argv[0]), 2;
      continue;
    }
    const long long n = std::atoll(f.value.c_str());
    if (arg == "--tokens") N = n;
    else if (arg == "--hidden") H = n;
    else if (arg == "--vocab") V = n;
    else if (arg == "--threads") threads = int(n);
    else if (arg == "--chunk") chunk = n;
    else if (arg == "--reps") reps = int(n);
    else return usage(argv[0]), 2;
  }
  if (N < 1 || H < 1 || V < 1 || threads < 0 || chunk < 0 || reps < 1) return usage(argv[0]), 2;
  if (threads == 0) threads = int(std::max(1u, std::thread::hardware_concurrency()));
  if (openblas_set_num_threads) openblas_set_num_threads(threads);

  // Inputs and outputs: allocated before any measurement, so not counted as extra.
  rng gen{20240607};
  const float w_scale = 3.0f / std::sqrt(float(H));  // logits x.w have std ~3
  std::vector<float> x(sz(N * H)), w(sz(V * H));
  std::vector<std::int64_t> y(sz(N));
  const bool bf16 = dtype != "float";
  // bf16 storage: the reference gets the same values (bf16 widens to fp32 exactly).
  const auto stored = [&](float v) { return bf16 ? static_cast<float>(lce::bfloat16(v)) : v; };
  for (float& v : x) v = stored(gen.unit());
  for (float& v : w) v = stored(gen.unit() * w_scale);
  std::vector<lce::bfloat16> xb(bf16 ? x.size() : 0), wb(bf16 ? w.size() : 0);
  std::copy(x.begin(), x.begin() + std::ptrdiff_t(xb.size()), xb.begin());
  std::copy(w.begin(), w.begin() + std::ptrdiff_t(wb.size()), wb.begin());
  for (std::int64_t& t : y) t = std::int64_t(gen.next() % std::uint64_t(V));
  std::vector<float> g(sz(N), -1.0f / float(N));  // mean NLL: dL/dlogp = -1/N
  std::vector<float> logp(sz(N)), dx(sz(N * H)), dw(sz(V * H), 0.0f);

  double zsum = 0, zsq = 0;  // spread of the logits, from a sample of 8 rows
  const std::int64_t sample_rows = std::min<std::int64_t>(8, N);
  for (std::int64_t i = 0; i < sample_rows; ++i)
    for (std::int64_t v = 0; v < V; ++v) {
      double dot = 0;
      for (std::int64_t k = 0; k < H; ++k) dot += double(x[i * H + k]) * w[v * H + k];
      zsum += dot, zsq += dot * dot;
    }
  const double zcount = double(sample_rows * V), zmean = zsum / zcount;
  const double zstd = std::sqrt(std::max(0.0, zsq / zcount - zmean * zmean));

  lce::options opt;
  opt.chunk_tokens = chunk;
  // The operator --dtype asks for (only that one is made: each holds a thread pool), and
  // with_op(f) calls f(op, X, W) on it with X and W as it stores them.
  using single = lce::comm::single;
  std::optional<lce::ChunkedHiddenToLogprobs<single, float, lce::budget_chunk, lce::host>> op_float;
  std::optional<lce::ChunkedHiddenToLogprobs<single, lce::bfloat16, lce::budget_chunk, lce::host>> op_bf16;
  std::optional<lce::ChunkedHiddenToLogprobs<single, lce::bfloat16, lce::budget_chunk, lce::host_bf16_operands>>
      op_operands;
  if (dtype == "float") op_float.emplace(single{}, opt, lce::host{threads});
  else if (dtype == "bfloat16") op_bf16.emplace(single{}, opt, lce::host{threads});
  else op_operands.emplace(single{}, opt, lce::host_bf16_operands{threads});
  const auto with_op = [&](auto&& f) {
    if (op_float) return f(*op_float, x.data(), w.data());
    if (op_bf16) return f(*op_bf16, xb.data(), wb.data());
    return f(*op_operands, xb.data(), wb.data());
  };
  const std::size_t workspace = with_op([&](auto& op, auto*, auto*) { return op.workspace_bytes(N, H, V); });
  const std::int64_t chunk_used = with_op([&](auto& op, auto*, auto*) { return op.chunk_tokens(N, H, V); });

  const double element = bf16 ? 2.0 : 4.0;  // X and W as stored; dX and dW in fp32
  const double io_bytes = element * double(N * H + V * H) + 4.0 * double(N * H + V * H + 2 * N) + 8.0 * double(N);
  // dW of a bf16 weight runs on the split bf16 GEMM where the chosen kernel has one (AMX), else on sgemm;
  // without a bf16 GEMM (no bf16 instructions) the weight is widened to fp32 for sgemm throughout.
  const lce::cblas_gemm provider;
  const char* gemms = dtype == "float" ? "sgemm"
                      : dtype != "bfloat16"
                          ? (provider.bf16_gemm_available() ? "bf16 GEMMs, dz rounded to bf16"
                                                            : "bf16 operands widened in each GEMM, dz rounded to bf16")
                      : !provider.bf16_gemm_available()        ? "weight widened to fp32, sgemm, dz in fp32"
                      : provider.split_bf16_gemm_available() ? "bf16 GEMMs, dz as hi + lo"
                                                               : "bf16 GEMMs, dz as hi + lo, dW sgemm";
  std::printf("lce demo: N = %lld tokens, H = %lld, V = %lld, %s, %d threads, %s%s\n", (long long)N, (long long)H,
              (long long)V, dtype.c_str(), threads, gemms,
              reps > 1 ? (", best of " + std::to_string(reps) + " runs").c_str() : "");
  std::printf("%s\n", lce::blas_info().line().c_str());
  std::printf("inputs + outputs: %.1f MiB (X, W, targets, dL/dlogp, logprobs, dX, dW); "
              "logits std %.2f (sampled)\n\n",
              mib(io_bytes), zstd);

  {  // start the BLAS thread pool outside the timings
    std::vector<float> a(64 * 64, 1.0f), c(64 * 64);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, 64, 64, 64, 1.0f, a.data(), 64, a.data(),
                64, 0.0f, c.data(), 64);
  }
  // Each method runs R times (best time, largest memory), with the allocation peak and
  // VmHWM reset just before each run. The first run in a process can be slower than the
  // next (the BLAS's first calls); --reps 2 shows the steady state.
  struct measurement {
    double seconds, extra_bytes, peak_rss_bytes;
  };
  bool rss_resets = true;
  auto measure = [&](auto&& prepare, auto&& method) {
    measurement best{1e300, 0, 0};
    for (int rep = 0; rep < reps; ++rep) {
      prepare();
      rss_resets = reset_peak_rss() && rss_resets;
      counting::reset_peak();
      const std::int64_t base = counting::current();
      const auto t0 = clock_type::now();
      method();
      best.seconds = std::min(best.seconds, seconds_since(t0));
      best.extra_bytes = std::max(best.extra_bytes, double(counting::peak() - base));
      best.peak_rss_bytes = std::max(best.peak_rss_bytes, double(peak_rss_bytes()));
    }
    return best;
  };

  // (a) lce: fused forward + backward sweep
  const auto zero_dw = [&] { std::fill(dw.begin(), dw.end(), 0.0f); };  // dW accumulates
  const auto sweep = [&](auto& which, const auto* xs, const auto* ws) {
    using E = std::remove_cv_t<std::remove_pointer_t<decltype(xs)>>;
    which.forward_backward(lce::matrix_view<const E>{xs, N, H}, lce::matrix_view<const E>{ws, V, H},
                           lce::vector_view<const std::int64_t>{y.data(), N},
                           lce::vector_view<const float>{g.data(), N}, lce::vector_view<float>{logp.data(), N},
                           lce::matrix_view<float>{dx.data(), N, H}, lce::matrix_view<float>{dw.data(), V, H});
  };
  const measurement a = measure(zero_dw, [&] { with_op(sweep); });
  // (b) materialised reference; its outputs are allocated (and touched) only now, so
  // that they are not in the peak RSS of (a)
  std::vector<float> ref_logp(sz(N)), ref_dx(sz(with_reference ? N * H : 0)),
      ref_dw(sz(with_reference ? V * H : 0));
  const measurement b = with_reference ? measure([] {}, [&] {
    reference(N, H, V, threads, x.data(), w.data(), y.data(), g.data(), ref_logp.data(),
              ref_dx.data(), ref_dw.data());
  }) : measurement{};

  const double gemm_flops = 3.0 * 2.0 * double(N) * double(V) * double(H);
  std::printf("| method                                      | time [s] | GEMM GFLOP/s | peak extra memory |\n");
  std::printf("|---------------------------------------------|---------:|-------------:|------------------:|\n");
  std::printf("| (a) lce forward_backward (fused sweep)      | %8.2f | %12.1f | %13.1f MiB |\n",
              a.seconds, gemm_flops / a.seconds * 1e-9, mib(a.extra_bytes));
  if (with_reference) {
    std::printf("| (b) materialised logits + log-softmax       | %8.2f | %12.1f | %13.1f MiB |\n",
                b.seconds, gemm_flops / b.seconds * 1e-9, mib(b.extra_bytes));
    std::printf("| (b) / (a)                                   | %7.2fx |              | %16.1fx |\n",
                b.seconds / a.seconds, b.extra_bytes / std::max(1.0, a.extra_bytes));
  }
  std::printf("\nlce: chunk of %lld tokens, workspace_bytes(N, H, V) = %.1f MiB; "
              "the [N, V] fp32 logits alone are %.1f MiB\n",
              (long long)chunk_used, mib(double(workspace)),
              mib(4.0 * double(N) * double(V)));
  std::printf("process peak RSS (VmHWM%s): (a) %.1f MiB", rss_resets ? ", reset before each" : ", cumulative",
              mib(a.peak_rss_bytes));
  if (with_reference) std::printf(", (b) %.1f MiB", mib(b.peak_rss_bytes));
  double nll = 0, ref_nll = 0;
  for (std::int64_t i = 0; i < N; ++i) nll -= logp[i], ref_nll -= ref_logp[i];
  std::printf("\nmean NLL: lce %.6f", nll / double(N));
  if (!with_reference) {
    std::printf(" nats (log V = %.6f)\n", std::log(double(V)));
    return std::isfinite(nll) ? 0 : 1;
  }
  std::printf(", reference %.6f nats (log V = %.6f)\n", ref_nll / double(N), std::log(double(V)));

  const diff dl = compare(logp, ref_logp), dX = compare(dx, ref_dx), dW = compare(dw, ref_dw);
  std::printf("max |lce - reference|: logprobs %.3g (%.2g of max %.3g), dX %.3g (%.2g of max %.3g), "
              "dW %.3g (%.2g of max %.3g)\n",
              dl.max_abs, dl.max_abs / dl.max_ref, dl.max_ref, dX.max_abs, dX.max_abs / dX.max_ref,
              dX.max_ref, dW.max_abs, dW.max_abs / dW.max_ref, dW.max_ref);

  // Exit status for scripts and ctest: the two methods must agree (dz rounded to bf16 in
  // bf16-operands: its unit roundoff 2^-8 reaches the gradients).
  const double tolerance = dtype == "bf16-operands" ? 1e-2 : 1e-3;
  const double worst = std::max({dl.max_abs / std::max(dl.max_ref, 1e-30),
                                 dX.max_abs / std::max(dX.max_ref, 1e-30),
                                 dW.max_abs / std::max(dW.max_ref, 1e-30)});
  if (!(worst <= tolerance)) {
    std::printf("FAILED: lce and the reference differ by %.3g of max |value| (tolerance %.0e)\n",
                worst, tolerance);
    return 1;
  }
  std::printf("OK: lce matches the materialised reference (worst %.2g of max |value|)\n", worst);
  return 0;
}
