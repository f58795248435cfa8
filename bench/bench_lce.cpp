// lce benchmark: each call of the operator against the bare GEMMs it cannot avoid.
//
// For every shape (H, V, N) and one chunk size C, in the same run and interleaved,
// best of R repetitions:
//   forward           lce forward (logprobs + lse)                floor: 1 GEMM per chunk
//   backward          lce backward (no entropy)                   floor: 3 GEMMs per chunk
//   fwd+bwd           forward then backward, back to back         floor: 4 GEMMs per chunk
//   fused             lce forward_backward (one sweep)            floor: 3 GEMMs per chunk
// The floors are measured with the same BLAS and threads on preallocated buffers, per
// chunk: logits = X_c W^T (NT, C x V x H), dX_c = dz W (NN, C x H x V),
// dW += dz^T X_c (TN, V x H x C). The ratio lce / GEMMs is the cost of everything
// that is not a GEMM (row passes, bookkeeping); 1.00 is the floor. An untimed warm-up on
// the first chunk pays the one-time costs first (first touch of the workspace and of the
// BLAS's buffers, which with OpenBLAS 0.3.21 makes narrow GEMMs ~3x slower until a wide
// one has run), so even R = 1 measures the steady state.
//
//   lce_bench [--hidden 512,1024,2048] [--vocab 32000,128256] [--tokens 4096,16384]
//             [--chunk 512] [--threads 0] [--reps 2] [--quick] [--shapes HxVxN,...]
//             [--json FILE] [--markdown FILE]
// (--chunk 0: the op's own choice from its default workspace budget; --quick: H = 512,1024
// and N = 4096 only.) The lce calls and the GEMMs use the same thread count.
#include <lce/host/blas_info.hpp>
#include <lce/lce.hpp>

#include "command_line.hpp"
#include "support/json_writer.hpp"

#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <cstring>
#include <ctime>
#include <limits>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

// OpenBLAS's thread control, when the BLAS is OpenBLAS (weak: absent otherwise).
extern "C" void openblas_set_num_threads(int) __attribute__((weak));

namespace {

constexpr std::size_t sz(std::int64_t n) { return static_cast<std::size_t>(n); }

using clock_type = std::chrono::steady_clock;
double now_s() {
  return std::chrono::duration<double>(clock_type::now().time_since_epoch()).count();
}
// CPU time of the whole process (all threads): less sensitive than wall time to other
// processes sharing the cores, though it counts BLAS threads that spin while waiting.
double cpu_s() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}
// Wall and CPU seconds, each the best over the repetitions.
struct seconds {
  double wall = std::numeric_limits<double>::infinity(), cpu = wall;
  void keep_best(double w, double c) { wall = std::min(wall, w), cpu = std::min(cpu, c); }
};

struct rng {  // splitmix64, fixed seed
  std::uint64_t s;
  std::uint64_t next() {
    std::uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  float unit() {  // uniform, mean 0, variance 1
    return (float(next() >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f) * 1.7320508f;
  }
};

std::vector<std::int64_t> parse_list(const std::string& s) {
  std::vector<std::int64_t> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');)
    if (!item.empty()) out.push_back(std::atoll(item.c_str()));
  return out;
}

struct config {
  std::vector<std::int64_t> hidden{512, 1024, 2048}, vocab{32000, 128256}, tokens{4096, 16384};
  std::int64_t chunk = 512;
  int threads = 0, reps = 2;
  std::string json, markdown;  // --json FILE, --markdown FILE: the results, machine-readable / as README rows
  std::vector<std::int64_t> shapes;  // --shapes HxVxN,...: these (H, V, N) instead of the grid, flattened
};

struct column {
  seconds lce;   // the lce call
  seconds gemm;  // the bare GEMMs for that call
  double ratio() const { return lce.wall / gemm.wall; }
  double cpu_ratio() const { return lce.cpu / gemm.cpu; }
};

struct result {
  std::int64_t H, V, N, C;
  column fwd, bwd, fwdbwd, fused;
  double gflops_nt, gflops_nn, gflops_tn;
  double check;  // max relative difference of fused vs two-call logprobs and dX
};

double max_rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0, m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    d = std::max(d, std::fabs(double(a[i]) - double(b[i])));
    m = std::max(m, std::fabs(double(b[i])));
  }
  return m > 0 ? d / m : d;
}

result run_shape(const config& cfg, std::int64_t H, std::int64_t V, std::int64_t N) {
  rng gen{0x1ce + std::uint64_t(H * 7 + V * 13 + N)};
  const float w_scale = 3.0f / std::sqrt(float(H));  // logits with std ~3
  std::vector<float> x(sz(N * H)), w(sz(V * H));
  std::vector<std::int64_t> y(sz(N));
  for (float& v : x) v = gen.unit();
  for (float& v : w) v = gen.unit() * w_scale;
  for (std::int64_t& t : y) t = std::int64_t(gen.next() % std::uint64_t(V));
  std::vector<float> g(sz(N), -1.0f / float(N));
  std::vector<float> logp(sz(N)), lse(sz(N)), logp_fused(sz(N));
  std::vector<float> dx(sz(N * H)), dx_fused(sz(N * H)), dw(sz(V * H));

  lce::options opt;  // --chunk 0: the op's own choice (budget_chunk, default workspace limit)
  opt.chunk_tokens = cfg.chunk;
  if (cfg.chunk > 0) opt.workspace_limit_bytes = std::size_t{16} << 30;  // chunk given: no cap
  lce::ChunkedHiddenToLogprobs<lce::comm::single, float, lce::budget_chunk, lce::host> op{
      lce::comm::single{}, opt, lce::host{cfg.threads}};
  const std::int64_t C = std::min(op.chunk_tokens(N, H, V), N);  // the bare GEMMs use the same
  std::vector<float> z(sz(C * V)), dx_gemm(sz(N * H));            // bare GEMMs' buffers

  lce::matrix_view<const float> X{x.data(), N, H}, W{w.data(), V, H};
  lce::vector_view<const std::int64_t> Y{y.data(), N};
  lce::vector_view<const float> G{g.data(), N}, LSEc{lse.data(), N};
  lce::vector_view<float> LP{logp.data(), N}, LSE{lse.data(), N}, LPf{logp_fused.data(), N};
  lce::matrix_view<float> DX{dx.data(), N, H}, DXf{dx_fused.data(), N, H}, DW{dw.data(), V, H};

  auto zero_dw = [&] { std::memset(dw.data(), 0, dw.size() * sizeof(float)); };
  result r{H, V, N, C, {}, {}, {}, {}, 0, 0, 0, 0};
  seconds nt, nn, tn;

  // Warm-up on the first chunk, untimed: pays the one-time costs (first touch of the
  // workspace and of the BLAS's buffers) so that every repetition is steady state.
  {
    const std::int64_t c = std::min(C, N);
    op.forward_backward(lce::matrix_view<const float>{x.data(), c, H}, W,
                        lce::vector_view<const std::int64_t>{y.data(), c}, lce::vector_view<const float>{g.data(), c},
                        lce::vector_view<float>{logp_fused.data(), c}, lce::matrix_view<float>{dx_fused.data(), c, H},
                        DW);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(c), int(V), int(H), 1.0f, x.data(), int(H), w.data(),
                int(H), 0.0f, z.data(), int(V));
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(c), int(H), int(V), 1.0f, z.data(), int(V), w.data(),
                int(H), 0.0f, dx_gemm.data(), int(H));
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(V), int(H), int(c), 1.0f, z.data(), int(V), x.data(),
                int(H), 1.0f, dw.data(), int(H));
  }

  for (int rep = 0; rep < cfg.reps; ++rep) {
    // forward, then backward: each timed, and the pair timed as fwd+bwd
    zero_dw();
    const double t0 = now_s(), c0 = cpu_s();
    op.forward(X, W, Y, LP, LSE);
    const double t1 = now_s(), c1 = cpu_s();
    op.backward(X, W, Y, LSEc, G, DX, DW);
    const double t2 = now_s(), c2 = cpu_s();
    r.fwd.lce.keep_best(t1 - t0, c1 - c0);
    r.bwd.lce.keep_best(t2 - t1, c2 - c1);
    r.fwdbwd.lce.keep_best(t2 - t0, c2 - c0);

    // fused sweep
    zero_dw();
    const double t3 = now_s(), c3 = cpu_s();
    op.forward_backward(X, W, Y, G, LPf, DXf, DW);
    r.fused.lce.keep_best(now_s() - t3, cpu_s() - c3);

    // bare GEMMs, same chunking, each one timed
    zero_dw();
    double w_nt = 0, w_nn = 0, w_tn = 0, c_nt = 0, c_nn = 0, c_tn = 0;
    for (std::int64_t r0 = 0; r0 < N; r0 += C) {
      const int c = int(std::min(C, N - r0));
      const float* xc = x.data() + r0 * H;
      const double ta = now_s(), ca = cpu_s();
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, c, int(V), int(H), 1.0f, xc, int(H),
                  w.data(), int(H), 0.0f, z.data(), int(V));
      const double tb = now_s(), cb = cpu_s();
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, c, int(H), int(V), 1.0f, z.data(),
                  int(V), w.data(), int(H), 0.0f, dx_gemm.data() + r0 * H, int(H));
      const double tc = now_s(), cc = cpu_s();
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(V), int(H), c, 1.0f, z.data(),
                  int(V), xc, int(H), 1.0f, dw.data(), int(H));
      const double td = now_s(), cd = cpu_s();
      w_nt += tb - ta, w_nn += tc - tb, w_tn += td - tc;
      c_nt += cb - ca, c_nn += cc - cb, c_tn += cd - cc;
    }
    nt.keep_best(w_nt, c_nt), nn.keep_best(w_nn, c_nn), tn.keep_best(w_tn, c_tn);
  }
  r.check = std::max(max_rel_diff(logp_fused, logp), max_rel_diff(dx_fused, dx));
  auto sum = [](std::initializer_list<seconds> parts) {
    seconds total{0, 0};
    for (const seconds& p : parts) total.wall += p.wall, total.cpu += p.cpu;
    return total;
  };
  r.fwd.gemm = nt;
  r.bwd.gemm = sum({nt, nn, tn});
  r.fwdbwd.gemm = sum({nt, nt, nn, tn});
  r.fused.gemm = sum({nt, nn, tn});
  const double flop = 2.0 * double(N) * double(V) * double(H);
  r.gflops_nt = flop / nt.wall * 1e-9, r.gflops_nn = flop / nn.wall * 1e-9, r.gflops_tn = flop / tn.wall * 1e-9;
  return r;
}

void usage(const char* argv0) {
  std::fprintf(stderr,
               "usage: %s [--hidden 512,1024,2048] [--vocab 32000,128256] [--tokens 4096,16384]\n"
               "          [--chunk 512] [--threads 0] [--reps 2] [--quick] [--shapes HxVxN,...]\n"
               "          [--json FILE] [--markdown FILE]\n"
               "--quick: H = 512,1024 and N = 4096 only; --threads 0: all hardware threads;\n"
               "--chunk 0: the chunk the op chooses from its default workspace budget\n",
               argv0);
}

const char* isa() {
#if defined(__AVX512F__)
  return "AVX-512";
#elif defined(__AVX2__)
  return "AVX2";
#elif defined(__AVX__)
  return "AVX";
#elif defined(__SSE2__)
  return "SSE2 (no -march)";
#else
  return "generic";
#endif
}

}  // namespace

int main(int argc, char** argv) {
  lce::reexec_with_fast_blas(argv);  // OpenBLAS's SSE3 fallback kernels: restart with OPENBLAS_CORETYPE
  config cfg;
  bool quick = false, hidden_given = false, tokens_given = false;
  for (int i = 1; i < argc; ++i) {
    lce_support::flag f;
    if (!lce_support::read_flag(i, argc, argv, {"-h", "--help", "--quick"}, f)) return usage(argv[0]), 2;
    const std::string &arg = f.name, &value = f.value;
    if (arg == "-h" || arg == "--help") return usage(argv[0]), 0;
    if (arg == "--quick") {
      quick = true;
      continue;
    }
    if (arg == "--hidden") cfg.hidden = parse_list(value), hidden_given = true;
    else if (arg == "--vocab") cfg.vocab = parse_list(value);
    else if (arg == "--tokens") cfg.tokens = parse_list(value), tokens_given = true;
    else if (arg == "--chunk") cfg.chunk = std::atoll(value.c_str());
    else if (arg == "--threads") cfg.threads = std::atoi(value.c_str());
    else if (arg == "--reps") cfg.reps = std::atoi(value.c_str());
    else if (arg == "--json") cfg.json = value;
    else if (arg == "--shapes") {
      std::stringstream in(value);
      for (std::string item; std::getline(in, item, ',');) {
        long long h = 0, v = 0, n = 0;
        if (std::sscanf(item.c_str(), "%lldx%lldx%lld", &h, &v, &n) != 3 || h < 1 || v < 1 || n < 1)
          return usage(argv[0]), 2;
        cfg.shapes.insert(cfg.shapes.end(), {h, v, n});
      }
    }
    else if (arg == "--markdown") cfg.markdown = value;
    else return usage(argv[0]), 2;
  }
  if (quick && !hidden_given) cfg.hidden = {512, 1024};
  if (quick && !tokens_given) cfg.tokens = {4096};
  auto positive = [](const std::vector<std::int64_t>& l) {
    return !l.empty() && std::all_of(l.begin(), l.end(), [](std::int64_t v) { return v > 0; });
  };
  if (!positive(cfg.hidden) || !positive(cfg.vocab) || !positive(cfg.tokens) || cfg.chunk < 0 ||
      cfg.threads < 0 || cfg.reps < 1)
    return usage(argv[0]), 2;
  const int threads = cfg.threads > 0 ? cfg.threads : int(std::max(1u, std::thread::hardware_concurrency()));
  cfg.threads = threads;
  if (openblas_set_num_threads) openblas_set_num_threads(threads);

  std::printf("lce bench: float, chunk %s, %d threads, best of %d, compiled %s (g++ %s)\n%s\n",
              cfg.chunk > 0 ? ("C = " + std::to_string(cfg.chunk) + " tokens").c_str()
                            : "chosen by the op (budget_chunk, 256 MiB)",
              threads, cfg.reps, isa(), __VERSION__, lce::blas_info().line().c_str());
  std::printf("wall times in ms, best of %d; GEMMs = the bare sgemm floor for the same call (fwd 1, "
              "bwd 3, fwd+bwd 4, fused 3 per chunk);\nratio = lce / GEMMs (wall); CPU ratio = the same "
              "with process CPU time; check = fused vs two-call max relative difference (logprobs, dX)\n\n",
              cfg.reps);
  std::printf("|    H |      V |     N |    C | fwd ms | GEMMs | ratio | bwd ms | GEMMs | ratio | "
              "fwd+bwd ms | GEMMs | ratio | fused ms | GEMMs | ratio | CPU ratio f/b/fb/fused  | "
              "GEMM GFLOP/s NT/NN/TN | check |\n");
  std::printf("|-----:|-------:|------:|-----:|-------:|------:|------:|-------:|------:|------:|"
              "-----------:|------:|------:|---------:|------:|------:|:-----------------------|"
              "----------------------:|------:|\n");
  std::fflush(stdout);

  const char* names[4] = {"forward", "backward", "fwd+bwd", "fused"};
  double max_ratio[4] = {}, max_cpu_ratio[4] = {}, max_check = 0;
  std::vector<result> results;
  if (cfg.shapes.empty())
    for (std::int64_t H : cfg.hidden)
      for (std::int64_t V : cfg.vocab)
        for (std::int64_t N : cfg.tokens) cfg.shapes.insert(cfg.shapes.end(), {H, V, N});
  for (std::size_t shape = 0; shape + 2 < cfg.shapes.size(); shape += 3) {
        const std::int64_t H = cfg.shapes[shape], V = cfg.shapes[shape + 1], N = cfg.shapes[shape + 2];
        const result r = run_shape(cfg, H, V, N);
        results.push_back(r);
        const column* cols[4] = {&r.fwd, &r.bwd, &r.fwdbwd, &r.fused};
        const int width[4] = {6, 6, 10, 8};
        std::printf("| %4lld | %6lld | %5lld | %4lld |", (long long)H, (long long)V, (long long)N,
                    (long long)r.C);
        for (int k = 0; k < 4; ++k) {
          std::printf(" %*.0f | %5.0f | %5.3f |", width[k], cols[k]->lce.wall * 1e3,
                      cols[k]->gemm.wall * 1e3, cols[k]->ratio());
          max_ratio[k] = std::max(max_ratio[k], cols[k]->ratio());
          max_cpu_ratio[k] = std::max(max_cpu_ratio[k], cols[k]->cpu_ratio());
        }
        char cpu[64];
        std::snprintf(cpu, sizeof cpu, "%.2f/%.2f/%.2f/%.2f", r.fwd.cpu_ratio(), r.bwd.cpu_ratio(),
                      r.fwdbwd.cpu_ratio(), r.fused.cpu_ratio());
        std::printf(" %-23s | %6.0f / %5.0f / %5.0f | %5.0e |\n", cpu, r.gflops_nt, r.gflops_nn,
                    r.gflops_tn, r.check);
        std::fflush(stdout);
        max_check = std::max(max_check, r.check);
      }
  std::printf("\nmax ratio lce / GEMMs (wall):");
  for (int k = 0; k < 4; ++k) std::printf("%s %s %.3f", k ? "," : "", names[k], max_ratio[k]);
  std::printf("\nmax ratio lce / GEMMs (CPU): ");
  for (int k = 0; k < 4; ++k) std::printf("%s %s %.3f", k ? "," : "", names[k], max_cpu_ratio[k]);
  std::printf("\nmax fused vs two-call relative difference: %.1e\n", max_check);

  const lce::blas_report blas = lce::blas_info();
  const char* keys[4] = {"forward", "backward", "forward_then_backward", "fused"};
  if (!cfg.json.empty()) {
    lce_bench::json_writer j;
    j.begin_object();
    j.field("program", "lce_bench");
    j.field("dtype", "float32");
    j.field("threads", threads);
    j.field("reps", cfg.reps);
    j.field("isa", isa());
    j.field("compiler", "g++ " __VERSION__);
    j.field("blas", blas.line());
    j.field("blas_name", blas.name);
    j.field("blas_version", blas.version);
    j.field("blas_kernels", blas.kernels);
    j.field("chunk_option", static_cast<long long>(cfg.chunk));
    j.key("results");
    j.begin_array();
    for (const result& r : results) {
      j.begin_object();
      j.field("hidden", static_cast<long long>(r.H));
      j.field("vocab", static_cast<long long>(r.V));
      j.field("tokens", static_cast<long long>(r.N));
      j.field("chunk", static_cast<long long>(r.C));
      const column* cols[4] = {&r.fwd, &r.bwd, &r.fwdbwd, &r.fused};
      for (int k = 0; k < 4; ++k) {
        j.key(keys[k]);
        j.begin_object();
        j.field("lce_wall_s", cols[k]->lce.wall);
        j.field("lce_cpu_s", cols[k]->lce.cpu);
        j.field("gemm_wall_s", cols[k]->gemm.wall);
        j.field("gemm_cpu_s", cols[k]->gemm.cpu);
        j.field("ratio", cols[k]->ratio());
        j.field("cpu_ratio", cols[k]->cpu_ratio());
        j.end_object();
      }
      j.field("gemm_gflops_nt", r.gflops_nt);
      j.field("gemm_gflops_nn", r.gflops_nn);
      j.field("gemm_gflops_tn", r.gflops_tn);
      j.field("fused_vs_two_call_max_rel_diff", r.check);
      j.end_object();
    }
    j.end_array();
    j.end_object();
    if (!j.save(cfg.json)) return std::fprintf(stderr, "cannot write %s\n", cfg.json.c_str()), 1;
  }
  if (!cfg.markdown.empty()) {
    std::FILE* f = std::fopen(cfg.markdown.c_str(), "w");
    if (!f) return std::fprintf(stderr, "cannot write %s\n", cfg.markdown.c_str()), 1;
    std::fprintf(f, "| H | V | N | forward | backward | fwd+bwd | fused | GEMM GFLOP/s NT/NN/TN |\n"
                    "|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    auto grouped = [](std::int64_t v) {
      std::string digits = std::to_string(v), out;
      for (std::size_t i = 0; i < digits.size(); ++i) {
        if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
        out += digits[i];
      }
      return out;
    };
    for (const result& r : results)
      std::fprintf(f, "| %lld | %s | %s | %.3f | %.3f | %.3f | %.3f | %.0f/%.0f/%.0f |\n", (long long)r.H,
                   grouped(r.V).c_str(), grouped(r.N).c_str(), r.fwd.ratio(), r.bwd.ratio(), r.fwdbwd.ratio(),
                   r.fused.ratio(), r.gflops_nt, r.gflops_nn, r.gflops_tn);
    std::fclose(f);
  }
  return 0;
}
