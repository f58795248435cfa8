// Memory and time of the LM-head step against the sequence length: materialised
// logits against lce, each measured and each set beside lce::plan_step's figure.
//
// For every vocabulary V and token count N, on each rank (single process, or
// every rank of an MPI job for the lce_bench_memory_mpi build), each method does
// one untimed step, then --reps timed ones (best kept):
//   materialised  bench/support/materialised.hpp: [N, V_r] fp32 logits, softmax,
//                 dX and dW by sgemm (3 GEMMs of N x H x V_r)
//   lce           op.forward_backward (the fused sweep, 3 GEMMs per chunk)
// Memory of a step, from just before its inputs are allocated to its end:
//   counted   peak bytes live through operator new (support/allocation_counter)
//   resident  peak resident set (VmHWM) above the resident set before (reset
//             through /proc/self/clear_refs), which also sees the BLAS's and
//             MPI's own buffers
//   planned   lce::plan_step(...).total() for that scheme (4-byte elements)
// --check TOL fails (exit 1) when a measured figure differs from the planned one
// by more than TOL (0.10 = 10%) on any rank: the planner's measured check.
//
//   lce_bench_memory [--hidden 1024] [--vocab 32000,128256] [--tokens 1024,2048,4096,8192]
//                    [--methods materialised,lce] [--threads 0] [--reps 1] [--workspace 256]
//                    [--sp] [--check 0.10] [--no-resident] [--drop workspace|logits]
//                    [--json FILE] [--svg PREFIX] [--markdown FILE]
//   mpiexec -n 2 lce_bench_memory_mpi --sp ...
// --svg PREFIX writes PREFIX-memory-V<V>.svg and PREFIX-time-V<V>.svg (one point per N);
// --drop removes a part from the planned figure (to show the check fails without it).
#include <lce/host/blas_info.hpp>
#include <lce/lce.hpp>
#include <lce/plan.hpp>
#ifdef LCE_BENCH_MPI
#include <lce/comm/mpi.hpp>
#include <mpi.h>
#endif

#include "allocation_counter.hpp"
#include "command_line.hpp"
#include "support/json_writer.hpp"
#include "support/materialised.hpp"
#include "support/memory_probe.hpp"
#include "support/svg_plot.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

extern "C" void openblas_set_num_threads(int) __attribute__((weak));

namespace {

#ifdef LCE_BENCH_MPI
using comm_type = lce::comm::mpi;
comm_type make_comm() { return lce::comm::mpi{MPI_COMM_WORLD}; }
double max_over_ranks(double v) {
  MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return v;
}
double min_over_ranks(double v) {
  MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_DOUBLE, MPI_MIN, MPI_COMM_WORLD);
  return v;
}
void barrier() { MPI_Barrier(MPI_COMM_WORLD); }
#else
using comm_type = lce::comm::single;
comm_type make_comm() { return {}; }
double max_over_ranks(double v) { return v; }
double min_over_ranks(double v) { return v; }
void barrier() {}
#endif

constexpr double mib = 1024.0 * 1024.0;
std::size_t sz(std::int64_t v) { return static_cast<std::size_t>(v); }
double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

float value(std::uint64_t stream, std::uint64_t index, float scale) {
  std::uint64_t z = stream * 0x9E3779B97F4A7C15ull + index + 0x632BE59BD9B4E019ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return scale * (static_cast<float>(z >> 40) * (2.0f / 16777216.0f) - 1.0f);
}

std::vector<std::int64_t> parse_list(const std::string& s) {
  std::vector<std::int64_t> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');)
    if (!item.empty()) out.push_back(std::atoll(item.c_str()));
  return out;
}

struct settings {
  std::int64_t hidden = 1024;
  std::vector<std::int64_t> vocab{32000, 128256}, tokens{1024, 2048, 4096, 8192};
  bool run_materialised = true, run_lce = true, sp = false, resident = true;
  int threads = 0, reps = 1;
  std::size_t workspace = std::size_t{256} << 20;
  double check = 0;
  std::string drop, json, svg, markdown;
};

struct measurement {
  std::string method;
  std::int64_t v = 0, n = 0, chunk = 0;
  double seconds = 0, counted = 0, resident = 0, planned = 0;  // bytes: largest rank; seconds: slowest rank
  double counted_error = 0, resident_error = 0;                // worst rank's (measured / planned - 1)
  double nll = 0;
};

// One step of one method at (V, N) on this rank; everything it needs is allocated inside the probe.
measurement measure(const settings& s, const comm_type& comm, bool lce_method, std::int64_t v, std::int64_t n,
                    int threads) {
  const int rank = comm.rank(), ranks = comm.size();
  const std::int64_t h = s.hidden, v0 = v * rank / ranks, vl = v * (rank + 1) / ranks - v0;
  const bool sp = s.sp && ranks > 1;
  const std::int64_t rows = sp ? n / ranks : n, row0 = sp ? rank * rows : 0;
  measurement m;
  m.method = lce_method ? "lce" : "materialised";
  m.v = v, m.n = n;

  lce::plan_request r;
  r.hidden = h, r.vocab = v, r.tensor_parallel = ranks, r.sequence_parallel = sp, r.element_bytes = 4;
  r.workspace_limit_bytes = s.workspace;
  lce::step_memory plan = lce::plan_step(r, lce_method ? lce::plan_scheme::lce : lce::plan_scheme::materialised, n);
  // the measured check runs on the largest shard's plan; this rank's own shard may be smaller by a row
  if (s.drop == "workspace") plan.workspace = 0;
  if (s.drop == "logits") plan.logits = 0;
  m.planned = static_cast<double>(plan.total());
  m.chunk = plan.chunk;

  barrier();
  lce_bench::peak_probe probe;
  probe.begin();
  double best = 1e300, nll = 0;
  {
    std::vector<float> x(sz(rows * h)), w(sz(vl * h)), g(sz(n), -1.0f / static_cast<float>(std::max<std::int64_t>(n, 1)));
    std::vector<std::int64_t> y(sz(n));
    std::vector<float> logp(sz(n)), lse(sz(n)), dx(sz(rows * h)), dw(sz(vl * h));
    for (std::int64_t i = 0; i < rows * h; ++i) x[sz(i)] = value(1, static_cast<std::uint64_t>(row0 * h + i), 1.7f);
    const float scale = 3.0f / std::sqrt(static_cast<float>(h));
    for (std::int64_t i = 0; i < vl * h; ++i) w[sz(i)] = value(2, static_cast<std::uint64_t>(v0 * h + i), scale);
    for (std::int64_t i = 0; i < n; ++i)
      y[sz(i)] = static_cast<std::int64_t>(std::fabs(value(3, static_cast<std::uint64_t>(i), 1.0f)) * 1e6f) % v;

    auto run_steps = [&](auto&& step) {
      for (int rep = 0; rep <= s.reps; ++rep) {  // rep 0: untimed (first touch of every buffer)
        std::fill(dw.begin(), dw.end(), 0.0f);
        barrier();
        const double t0 = now_s();
        step();
        const double t = max_over_ranks(now_s() - t0);
        if (rep > 0) best = std::min(best, t);
      }
    };
    if (lce_method) {
      lce::options opt;
      opt.vocab_start = v0;
      opt.sequence_parallel = sp;
      opt.workspace_limit_bytes = s.workspace;
      lce::ChunkedHiddenToLogprobs<comm_type, float> op(comm, opt, lce::host{threads});
      const lce::matrix_view<const float> X{x.data(), rows, h}, W{w.data(), vl, h};
      const lce::vector_view<const std::int64_t> Y{y.data(), n};
      const lce::vector_view<const float> G{g.data(), n};
      const lce::vector_view<float> LP{logp.data(), n};
      const lce::matrix_view<float> DX{dx.data(), rows, h}, DW{dw.data(), vl, h};
      run_steps([&] { op.forward_backward(X, W, Y, G, LP, DX, DW); });
    } else {
      lce_bench::materialised_args a;
      a.n = n, a.h = h, a.v_local = vl, a.vocab_start = v0, a.sequence_parallel = sp, a.threads = threads;
      a.x = x.data(), a.w = w.data(), a.y = y.data(), a.g = g.data();
      a.logp = logp.data(), a.lse = lse.data(), a.dx = dx.data(), a.dw = dw.data();
      run_steps([&] { lce_bench::materialised_step(comm, a); });
    }
    for (float e : logp) nll -= e;
    nll /= static_cast<double>(std::max<std::int64_t>(n, 1));
  }
  const double counted = static_cast<double>(probe.counted()), resident = static_cast<double>(probe.resident());
  m.seconds = best;
  m.nll = nll;
  m.counted = max_over_ranks(counted);
  m.resident = resident >= 0 ? max_over_ranks(resident) : -1;
  // worst deviation over ranks: each rank against the (largest-shard) plan
  auto worst = [&](double measured) {
    const double e = measured / m.planned - 1;
    const double hi = max_over_ranks(e), lo = min_over_ranks(e);
    return std::fabs(hi) >= std::fabs(lo) ? hi : lo;
  };
  m.counted_error = worst(counted);
  m.resident_error = resident >= 0 ? worst(resident) : 0;
  return m;
}

// Every layout of sgemm the steps use, with one dimension long in each position in turn:
// OpenBLAS touches more of its own (per-thread) buffers the larger a GEMM is, up to its
// blocking sizes, and those pages must be resident before a step is measured.
void warm_blas() {
  const int big = 32768, small = 768;
  std::vector<float> a(sz(big) * small, 0.01f), b(sz(big) * small, 0.01f), c(sz(big) * small);
  for (auto [ta, tb] : {std::pair{CblasNoTrans, CblasTrans}, {CblasNoTrans, CblasNoTrans}, {CblasTrans, CblasNoTrans}})
    for (int position = 0; position < 3; ++position) {
      const int m = position == 0 ? big : small, n = position == 1 ? big : small, k = position == 2 ? big : small;
      cblas_sgemm(CblasRowMajor, ta, tb, m, n, k, 1.0f, a.data(), ta == CblasNoTrans ? k : m, b.data(),
                  tb == CblasNoTrans ? n : k, 0.0f, c.data(), n);
    }
}

void usage(const char* argv0) {
  std::fprintf(stderr,
               "usage: %s [--hidden 1024] [--vocab 32000,128256] [--tokens 1024,2048,4096,8192]\n"
               "          [--methods materialised,lce] [--threads 0] [--reps 1] [--workspace MiB (256)]\n"
               "          [--sp] [--check TOL] [--no-resident] [--drop workspace|logits]\n"
               "          [--json FILE] [--svg PREFIX] [--markdown FILE]\n",
               argv0);
}

}  // namespace

int main(int argc, char** argv) {
  lce::reexec_with_fast_blas(argv);  // before MPI_Init and threads: OpenBLAS's SSE3 fallback -> restart
#ifdef LCE_BENCH_MPI
  MPI_Init(&argc, &argv);
#endif
  settings s;
  bool bad = false;
  for (int i = 1; i < argc && !bad; ++i) {
    lce_support::flag f;
    if (!lce_support::read_flag(i, argc, argv, {"-h", "--help", "--sp", "--no-resident"}, f)) {
      bad = true;
      break;
    }
    const std::string &a = f.name, &v = f.value;
    if (a == "-h" || a == "--help") bad = true;
    else if (a == "--sp") s.sp = true;
    else if (a == "--no-resident") s.resident = false;
    else if (a == "--hidden") s.hidden = std::atoll(v.c_str());
    else if (a == "--vocab") s.vocab = parse_list(v);
    else if (a == "--tokens") s.tokens = parse_list(v);
    else if (a == "--methods") {
      s.run_materialised = v.find("materialised") != std::string::npos;
      s.run_lce = v.find("lce") != std::string::npos;
    } else if (a == "--threads") s.threads = std::atoi(v.c_str());
    else if (a == "--reps") s.reps = std::atoi(v.c_str());
    else if (a == "--workspace") s.workspace = static_cast<std::size_t>(std::atof(v.c_str()) * mib);
    else if (a == "--check") s.check = std::atof(v.c_str());
    else if (a == "--drop") s.drop = v;
    else if (a == "--json") s.json = v;
    else if (a == "--svg") s.svg = v;
    else if (a == "--markdown") s.markdown = v;
    else bad = true;
  }
  const comm_type comm = make_comm();
  const int rank = comm.rank(), ranks = comm.size();
  if (bad || s.hidden < 1 || s.vocab.empty() || s.tokens.empty() || s.reps < 1 || s.check < 0 ||
      (!s.drop.empty() && s.drop != "workspace" && s.drop != "logits")) {
    if (rank == 0) usage(argv[0]);
#ifdef LCE_BENCH_MPI
    MPI_Finalize();
#endif
    return 2;
  }
  const int cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  const int threads = s.threads > 0 ? s.threads : std::max(1, cores / ranks);
  if (openblas_set_num_threads) openblas_set_num_threads(threads);
  const bool sp = s.sp && ranks > 1;
  for (std::int64_t& n : s.tokens)
    if (sp) n = std::max<std::int64_t>(ranks, n / ranks * ranks);  // sequence parallel: N a multiple of P
  const lce::blas_report blas = lce::blas_info();

  if (rank == 0) {
    std::printf("# lce_bench_memory: H = %lld, float, %d rank%s%s x %d thread%s, lce workspace limit %.0f MiB, best of %d\n",
                static_cast<long long>(s.hidden), ranks, ranks == 1 ? "" : "s", sp ? " (sequence parallel)" : "",
                threads, threads == 1 ? "" : "s", static_cast<double>(s.workspace) / mib, s.reps);
    std::printf("# %s\n", blas.line().c_str());
    std::printf("# MiB per rank (largest rank); error = measured / planned - 1, worst rank\n");
    std::printf("# %-12s %7s %6s %6s %10s %10s %10s %8s %10s %8s %9s\n", "method", "V", "N", "chunk", "ms",
                "planned", "counted", "error", "resident", "error", "mean NLL");
    std::fflush(stdout);
  }

  // Warm-up, untimed and unreported: the BLAS's and the communicator's own buffers
  // are touched once here, so the measured steps see only their own memory.
  // (the BLAS at large shapes first; then each method at the first vocabulary and the most
  // tokens, which also touches lce's threads' single-threaded BLAS buffers)
  warm_blas();
  const std::int64_t warm_n = *std::max_element(s.tokens.begin(), s.tokens.end());
  if (s.run_materialised) measure(s, comm, false, s.vocab.front(), warm_n, threads);
  if (s.run_lce) measure(s, comm, true, s.vocab.front(), warm_n, threads);

  std::vector<measurement> results;
  bool ok = true;
  for (std::int64_t v : s.vocab)
    for (std::int64_t n : s.tokens)
      for (bool lce_method : {false, true}) {
        if ((lce_method && !s.run_lce) || (!lce_method && !s.run_materialised)) continue;
        measurement m;
        try {
          m = measure(s, comm, lce_method, v, n, threads);
        } catch (const lce::error& e) {
          std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
          ok = false;
          break;
        }
        results.push_back(m);
        const bool counted_bad = s.check > 0 && std::fabs(m.counted_error) > s.check;
        const bool resident_bad = s.check > 0 && s.resident && m.resident >= 0 && std::fabs(m.resident_error) > s.check;
        if (counted_bad || resident_bad) ok = false;
        if (rank == 0) {
          std::printf("  %-12s %7lld %6lld %6lld %10.1f %10.1f %10.1f %+7.1f%% %10.1f %+7.1f%% %9.5f%s\n",
                      m.method.c_str(), static_cast<long long>(v), static_cast<long long>(n),
                      static_cast<long long>(m.chunk), m.seconds * 1e3, m.planned / mib, m.counted / mib,
                      100 * m.counted_error, m.resident / mib, 100 * m.resident_error, m.nll,
                      counted_bad || resident_bad ? "  <-- outside the tolerance" : "");
          std::fflush(stdout);
        }
      }

  if (rank == 0 && s.check > 0)
    std::printf("%s: planned vs measured (counted%s) within %.0f%% on every rank\n", ok ? "OK" : "FAIL",
                s.resident ? " and resident" : "", 100 * s.check);

  if (rank == 0 && !s.json.empty()) {
    lce_bench::json_writer j;
    j.begin_object();
    j.field("program", ranks > 1 ? "lce_bench_memory_mpi" : "lce_bench_memory");
    j.field("dtype", "float32");
    j.field("hidden", static_cast<long long>(s.hidden));
    j.field("ranks", ranks);
    j.field("sequence_parallel", sp);
    j.field("threads_per_rank", threads);
    j.field("blas", blas.line());
    j.field("blas_kernels", blas.kernels);
    j.field("workspace_limit_bytes", static_cast<unsigned long long>(s.workspace));
    j.field("timed_reps", s.reps);
    j.key("results");
    j.begin_array();
    for (const measurement& m : results) {
      j.begin_object();
      j.field("method", m.method);
      j.field("vocab", static_cast<long long>(m.v));
      j.field("tokens", static_cast<long long>(m.n));
      j.field("chunk", static_cast<long long>(m.chunk));
      j.field("seconds", m.seconds);
      j.field("planned_bytes", m.planned);
      j.field("counted_bytes", m.counted);
      j.field("resident_bytes", m.resident);
      j.field("counted_error", m.counted_error);
      j.field("resident_error", m.resident_error);
      j.field("mean_nll", m.nll);
      j.end_object();
    }
    j.end_array();
    j.end_object();
    if (!j.save(s.json)) std::fprintf(stderr, "cannot write %s\n", s.json.c_str()), ok = false;
  }
  if (rank == 0 && !s.svg.empty())
    for (std::int64_t v : s.vocab) {
      lce_bench::line_plot memory, time;
      const std::string shape = "H = " + std::to_string(s.hidden) + ", V = " + std::to_string(v) + ", float, " +
                                std::to_string(ranks) + (ranks > 1 ? " ranks" : " rank") + (sp ? " (SP)" : "");
      memory.title = "Peak memory of forward + backward, " + shape;
      memory.subtitle = "per rank: inputs, weight, gradients and the method's own buffers (counted by operator new)";
      memory.x_label = "tokens N", memory.y_label = "MiB", memory.x_log2 = true;
      time.title = "Time of forward + backward, " + shape;
      time.subtitle = std::to_string(threads) + " threads per rank; " + blas.name + " " + blas.version + " (" +
                      blas.kernels + " kernels)";
      time.x_label = "tokens N", time.y_label = "seconds", time.x_log2 = true;
      int colour = 0;
      for (const char* method : {"materialised", "lce"}) {
        std::vector<std::pair<double, double>> counted, planned, seconds;
        for (const measurement& m : results)
          if (m.v == v && m.method == method) {
            counted.emplace_back(double(m.n), m.counted / mib);
            planned.emplace_back(double(m.n), m.planned / mib);
            seconds.emplace_back(double(m.n), m.seconds);
          }
        if (counted.empty()) continue;
        const std::string name = std::string(method) == "lce" ? "lce (fused)" : "materialised";
        memory.add(name + ", measured", counted, false, colour);
        memory.add(name + ", planned", planned, true, colour);
        time.add(name, seconds, false, colour);
        ++colour;
      }
      const std::string stem = s.svg + "-V" + std::to_string(v);
      if (!memory.empty() && (!memory.write(stem + "-memory.svg") || !time.write(stem + "-time.svg")))
        std::fprintf(stderr, "cannot write %s-*.svg\n", stem.c_str()), ok = false;
    }
  if (rank == 0 && !s.markdown.empty()) {
    std::FILE* f = std::fopen(s.markdown.c_str(), "w");
    if (f) {
      std::fprintf(f, "| V | N | method | time s | planned MiB | counted MiB | resident MiB |\n|---:|---:|---|---:|---:|---:|---:|\n");
      for (const measurement& m : results)
        std::fprintf(f, "| %lld | %lld | %s | %.2f | %.1f | %.1f (%+.1f%%) | %.1f (%+.1f%%) |\n",
                     static_cast<long long>(m.v), static_cast<long long>(m.n), m.method.c_str(), m.seconds,
                     m.planned / mib, m.counted / mib, 100 * m.counted_error, m.resident / mib,
                     100 * m.resident_error);
      std::fclose(f);
    }
  }
#ifdef LCE_BENCH_MPI
  MPI_Finalize();
#endif
  return ok ? 0 : 1;
}
