// Bare sgemm GFLOP/s of one CBLAS library, loaded at run time, in the three layouts lce
// runs (row-major, as bench_lce measures them, here for one chunk of C tokens):
//
//   NT  logits  z[C, V]  = X_c[C, H] W[V, H]^T     (m = C, n = V, k = H)
//   NN  dX      dX[C, H] = dz[C, V] W[V, H]        (m = C, n = H, k = V)
//   TN  dW      dW[V, H] = dz[C, V]^T X_c[C, H]    (m = V, n = H, k = C)
//
//   lce_blas_compare --lib PATH [--threads 1,2] [--tokens 1024] [--hidden 1024]
//                    [--vocab 32000] [--reps 3]
//
// PATH is a shared library exporting cblas_sgemm (libopenblas.so.0, BLIS's libblis.so.4,
// MKL's libmkl_rt.so.N, ...). OpenBLAS reads OPENBLAS_CORETYPE when it is loaded, so set
// it in the environment of this program (it loads the library only after start-up).
// Threads are set through the library's own call (openblas_set_num_threads,
// bli_thread_set_num_threads, MKL_Set_Num_Threads). Output: one line per thread count,
// "lib | kernels | threads | NT | NN | TN | NT | NN | TN": GFLOP/s of wall time, then
// GFLOP per second of process CPU time (best of --reps each), for bench/blas_compare.sh.
// On shared cores the CPU-time rate of one thread is what a core does while it runs
// this GEMM, whatever else is scheduled; with more threads it also counts their waiting.
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <vector>

namespace {

using sgemm_fn = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*,
                          int);
constexpr int row_major = 101, no_trans = 111, trans = 112;  // CBLAS enum values, the same in every CBLAS

std::vector<long long> parse_list(const char* text) {
  std::vector<long long> out;
  for (const char* p = text; *p;) {
    char* end = nullptr;
    out.push_back(std::strtoll(p, &end, 10));
    p = *end == ',' ? end + 1 : end;
    if (end == p && *p) break;
  }
  return out;
}

template <class F>
F symbol(void* lib, const char* name) {
  return reinterpret_cast<F>(dlsym(lib, name));
}

}  // namespace

int main(int argc, char** argv) {
  const char* path = nullptr;
  std::vector<long long> threads{1, 2};
  long long C = 1024, H = 1024, V = 32000;
  int reps = 3;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--lib") path = argv[i + 1];
    else if (a == "--threads") threads = parse_list(argv[i + 1]);
    else if (a == "--tokens") C = std::atoll(argv[i + 1]);
    else if (a == "--hidden") H = std::atoll(argv[i + 1]);
    else if (a == "--vocab") V = std::atoll(argv[i + 1]);
    else if (a == "--reps") reps = std::max(1, std::atoi(argv[i + 1]));
  }
  if (!path) {
    std::fprintf(stderr, "usage: %s --lib PATH [--threads 1,2] [--tokens C] [--hidden H] [--vocab V] [--reps R]\n",
                 argv[0]);
    return 2;
  }
  void* lib = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
  if (!lib) {
    std::fprintf(stderr, "dlopen %s: %s\n", path, dlerror());
    return 1;
  }
  auto sgemm = symbol<sgemm_fn>(lib, "cblas_sgemm");
  if (!sgemm) {
    std::fprintf(stderr, "%s has no cblas_sgemm\n", path);
    return 1;
  }

  // Which library, which kernels, and how to set its threads.
  std::string name = "unknown", kernels = "?";
  auto openblas_threads = symbol<void (*)(int)>(lib, "openblas_set_num_threads");
  auto blis_threads = symbol<void (*)(std::int64_t)>(lib, "bli_thread_set_num_threads");
  auto mkl_threads = symbol<void (*)(int)>(lib, "MKL_Set_Num_Threads");
  if (auto core = symbol<char* (*)()>(lib, "openblas_get_corename")) {
    name = "OpenBLAS", kernels = core();
    if (auto config = symbol<char* (*)()>(lib, "openblas_get_config")) name = config(), name.resize(std::min<std::size_t>(name.size(), 15));
  } else if (auto version = symbol<const char* (*)()>(lib, "bli_info_get_version_str")) {
    name = std::string("BLIS ") + version();
    auto arch_id = symbol<int (*)()>(lib, "bli_arch_query_id");
    auto arch_name = symbol<const char* (*)(int)>(lib, "bli_arch_string");
    if (arch_id && arch_name) kernels = arch_name(arch_id());
  } else if (auto mkl_version = symbol<void (*)(char*, int)>(lib, "MKL_Get_Version_String")) {
    char text[512] = {};
    mkl_version(text, sizeof text);
    name = text;
    if (auto cut = name.find(" Product"); cut != std::string::npos) name.resize(cut);
    // The code path MKL dispatched to shows in MKL_VERBOSE=1 output; MKL_Enable_Instructions
    // tells nothing without a call. Report what the CPU offers MKL instead.
    kernels = std::getenv("MKL_ENABLE_INSTRUCTIONS") ? std::getenv("MKL_ENABLE_INSTRUCTIONS") : "auto";
  }

  const std::size_t sx = std::size_t(C * H), sw = std::size_t(V * H), sz = std::size_t(C * V);
  std::vector<float> x(sx), w(sw), z(sz), dx(sx), dw(sw);
  std::uint64_t s = 12345;
  auto unit = [&] {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return float(s >> 40) * (1.0f / 16777216.0f) - 0.5f;
  };
  for (float& v : x) v = unit();
  for (float& v : w) v = unit();
  for (float& v : z) v = unit();

  const double flops = 2.0 * double(C) * double(V) * double(H);
  using clock = std::chrono::steady_clock;
  auto cpu_now = [] {
    timespec t{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
  };
  struct rate {
    double wall, cpu;
  };
  auto best_gflops = [&](auto&& call) {
    call();  // warm-up: thread pool, buffers
    double best = 1e300, best_cpu = 1e300;
    for (int r = 0; r < reps; ++r) {
      const auto t0 = clock::now();
      const double c0 = cpu_now();
      call();
      best_cpu = std::min(best_cpu, cpu_now() - c0);
      best = std::min(best, std::chrono::duration<double>(clock::now() - t0).count());
    }
    return rate{flops / best * 1e-9, flops / best_cpu * 1e-9};
  };
  const int c = int(C), h = int(H), v = int(V);
  for (long long t : threads) {
    if (openblas_threads) openblas_threads(int(t));
    else if (blis_threads) blis_threads(t);
    else if (mkl_threads) mkl_threads(int(t));
    const rate nt = best_gflops([&] { sgemm(row_major, no_trans, trans, c, v, h, 1.0f, x.data(), h, w.data(), h, 0.0f, z.data(), v); });
    const rate nn = best_gflops([&] { sgemm(row_major, no_trans, no_trans, c, h, v, 1.0f, z.data(), v, w.data(), h, 0.0f, dx.data(), h); });
    const rate tn = best_gflops([&] { sgemm(row_major, trans, no_trans, v, h, c, 1.0f, z.data(), v, x.data(), h, 0.0f, dw.data(), h); });
    std::printf("%-28s | %-12s | %lld | %6.1f | %6.1f | %6.1f | %6.1f | %6.1f | %6.1f\n", name.c_str(), kernels.c_str(), t,
                nt.wall, nn.wall, tn.wall, nt.cpu, nn.cpu, tn.cpu);
    std::fflush(stdout);
  }
  return 0;
}
