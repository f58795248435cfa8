// lce distributed benchmark: one problem, split over the ranks of an MPI job.
//
// Run it once per rank count; each run prints its own rows:
//
//   mpiexec -n 1 --bind-to none lce_bench_distributed
//   mpiexec -n 2 lce_bench_distributed
//   mpiexec -n 4 --oversubscribe lce_bench_distributed
//
// (OpenMPI binds each of up to 2 ranks to one core: a single rank's two threads
// would then share a core, hence --bind-to none for one rank.)
//
// The total problem is the same whatever the rank count (default N = 4096
// tokens, H = 1024, V = 32000, float): rank r holds the vocabulary shard
// W_r [V/P, H] (and, under sequence parallelism, the rows r N/P .. of X).
// For each mode (vocabulary parallel; sequence parallel) one row reports:
//
//   fwd+bwd ms     forward (logprobs + lse) then backward: slowest rank, best of --reps
//   fused ms       forward_backward (one sweep): slowest rank, best of --reps
//   payload B/tok  bytes this rank handed to collectives per token and call (all_gather
//                  send + all_reduce buffer + reduce_scatter receive), counted by a wrapper
//                  communicator; "wire" estimates what a ring algorithm moves per rank:
//                  all_gather (P-1) x send, all_reduce 2 (P-1)/P x buffer, reduce_scatter
//                  (P-1) x receive
//   scratch MiB    peak bytes allocated through operator new during the calls (the op's
//                  workspace: replaced operator new in this binary), largest rank
//   VmHWM MiB      the process's peak resident memory (/proc/self/status), largest rank;
//                  includes the inputs, outputs, the BLAS's and MPI's own buffers
//
//   lce_bench_distributed [--tokens 4096] [--hidden 1024] [--vocab 32000] [--chunk 0]
//                         [--reps 3] [--threads 0] [--mode both|vocab|sequence]
//                         [--ranks 1,2,4] [--json FILE] [--svg FILE]
// --threads: threads per rank for lce's row passes and OpenBLAS (0: cores / ranks).
// --chunk: options.chunk_tokens (0: the op's own choice from its workspace budget).
// --ranks: run the problem on the first P ranks of the job for each P listed (the
//   others wait), e.g. `mpiexec -n 4 --oversubscribe lce_bench_distributed --ranks 1,2,4`;
//   default: all ranks of the job. Times with more ranks than cores mean little; the
//   bytes are exact.
// --json FILE: every row (shape, ranks, threads, BLAS, times, bytes, memory);
// --svg FILE: bytes on the wire per token against ranks (both modes, both call forms).
#include <lce/comm/mpi.hpp>
#include <lce/host/blas_info.hpp>
#include <lce/lce.hpp>

#include "allocation_counter.hpp"
#include "command_line.hpp"
#include "support/json_writer.hpp"
#include "support/memory_probe.hpp"
#include "support/svg_plot.hpp"

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <new>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

// OpenBLAS's thread control, when the BLAS is OpenBLAS (weak: absent otherwise).
extern "C" void openblas_set_num_threads(int) __attribute__((weak));

// Current and peak bytes of this process, from a counting global operator new
// (support/allocation_counter.cpp, linked into this program).
namespace heap = lce_support::allocations;

namespace {

// ---------------------------------------------------------------------------
// A communicator that forwards to MPI and counts bytes per collective.
// ---------------------------------------------------------------------------
struct traffic {
  double payload = 0;  // bytes handed to the data collectives
  double wire = 0;     // ring-algorithm estimate of bytes sent per rank
  std::int64_t collectives = 0;
};

class counting_mpi {
 public:
  using memory_space = lce::comm::mpi::memory_space;
  counting_mpi(lce::comm::mpi inner, traffic* t) : inner_(inner), t_(t) {}
  int rank() const { return inner_.rank(); }
  int size() const { return inner_.size(); }
  void all_gather_bytes(const void* send, void* receive, std::size_t bytes) const {
    note(static_cast<double>(bytes), static_cast<double>(size() - 1) * static_cast<double>(bytes));
    inner_.all_gather_bytes(send, receive, bytes);
  }
  template <class A>
  void all_reduce_sum(A* data, std::int64_t count) const {
    const double bytes = static_cast<double>(count) * sizeof(A);
    note(bytes, 2.0 * (size() - 1) / size() * bytes);
    inner_.all_reduce_sum(data, count);
  }
  template <class A>
  void reduce_scatter_sum(const A* send, A* receive, std::int64_t count) const {
    const double bytes = static_cast<double>(count) * sizeof(A);
    note(bytes, static_cast<double>(size() - 1) * bytes);
    inner_.reduce_scatter_sum(send, receive, count);
  }
  bool all_agree(bool flag) const { return inner_.all_agree(flag); }
  void all_gather_host(const std::int64_t* send, std::int64_t* receive, std::int64_t count) const {
    inner_.all_gather_host(send, receive, count);
  }

 private:
  void note(double payload, double wire) const {
    t_->payload += payload;
    t_->wire += wire;
    ++t_->collectives;
  }
  lce::comm::mpi inner_;
  traffic* t_;
};
static_assert(lce::communicator<counting_mpi>);

double seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double vm_hwm_mib() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::atof(line.c_str() + 6) / 1024.0;  // kB
  return -1.0;
}

float value(std::uint64_t stream, std::uint64_t index, float scale) {
  std::uint64_t z = stream * 0x9E3779B97F4A7C15ull + index + 0x632BE59BD9B4E019ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return scale * (static_cast<float>(z >> 40) * (2.0f / 16777216.0f) - 1.0f);
}

struct settings {
  std::int64_t tokens = 4096, hidden = 1024, vocab = 32000, chunk = 0;
  int reps = 3, threads = 0;
  std::string mode = "both", json, svg;
  std::vector<int> ranks;  // --ranks: the group sizes to run (empty: the whole job)
};

// One printed row, kept for --json and --svg (valid on rank 0).
struct row {
  int ranks = 1, threads = 1;
  bool sequence_parallel = false;
  std::int64_t chunk = 0;
  double two_calls_ms = 0, fused_ms = 0;
  double payload_two = 0, wire_two = 0, payload_fused = 0, wire_fused = 0, collectives_fused = 0;  // bytes per token
  double workspace_mib = 0, scratch_mib = 0, vm_hwm_mib = 0, mean_nll = 0;
};

double max_over_ranks(double v, MPI_Comm group) {
  MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_DOUBLE, MPI_MAX, group);
  return v;
}

row run(const settings& s, bool sequence_parallel, MPI_Comm group, int threads) {
  int rank = 0, ranks = 1;
  MPI_Comm_rank(group, &rank);
  MPI_Comm_size(group, &ranks);
  const auto max_over_ranks = [group](double v) { return ::max_over_ranks(v, group); };
  const std::int64_t n = s.tokens, h = s.hidden;
  const std::int64_t v0 = s.vocab * rank / ranks, vr = s.vocab * (rank + 1) / ranks - v0;
  const bool sp = sequence_parallel && ranks > 1;
  const std::int64_t rows = sp ? n / ranks : n, row0 = sp ? rank * rows : 0;

  std::vector<float> x(static_cast<std::size_t>(rows * h)), w(static_cast<std::size_t>(vr * h));
  for (std::int64_t i = 0; i < rows * h; ++i) x[static_cast<std::size_t>(i)] = value(1, static_cast<std::uint64_t>(row0 * h + i), 1.7f);
  const float scale = 3.0f / std::sqrt(static_cast<float>(h));
  for (std::int64_t i = 0; i < vr * h; ++i) w[static_cast<std::size_t>(i)] = value(2, static_cast<std::uint64_t>(v0 * h + i), scale);
  std::vector<std::int64_t> y(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i)
    y[static_cast<std::size_t>(i)] = static_cast<std::int64_t>(std::fabs(value(3, static_cast<std::uint64_t>(i), 1.0f)) * 1e6f) % s.vocab;
  std::vector<float> lp(static_cast<std::size_t>(n)), lse(static_cast<std::size_t>(n)),
      g(static_cast<std::size_t>(n), -1.0f / static_cast<float>(n)), dx(static_cast<std::size_t>(rows * h)),
      dw(static_cast<std::size_t>(vr * h), 0.0f);
  const lce::matrix_view<const float> X{x.data(), rows, h}, W{w.data(), vr, h};
  const lce::vector_view<const std::int64_t> Y{y.data(), n};
  const lce::vector_view<float> LP{lp.data(), n}, LSE{lse.data(), n};
  const lce::vector_view<const float> G{g.data(), n}, LSEc{lse.data(), n};
  const lce::matrix_view<float> DX{dx.data(), rows, h}, DW{dw.data(), vr, h};

  lce::options options;
  options.vocab_start = v0;
  options.sequence_parallel = sp;
  options.chunk_tokens = s.chunk;
  traffic t;
  lce::ChunkedHiddenToLogprobs<counting_mpi, float> op(counting_mpi(lce::comm::mpi{group}, &t), options,
                                                       lce::host{threads});
  const std::int64_t chunk = op.chunk_tokens(n, h, vr);
  const std::int64_t workspace = static_cast<std::int64_t>(op.workspace_bytes(n, h, vr));

  const std::int64_t heap_before = heap::current();
  heap::reset_peak();
  lce_bench::reset_resident_peak();  // VmHWM from here: a job running several group sizes reports each
  // Warm-up (allocates the workspace, agrees on the shards), then timed repetitions.
  op.forward(X, W, Y, LP, LSE);

  double best_two_calls = 1e300, best_fused = 1e300;
  traffic two_calls_traffic, fused_traffic;
  for (int rep = 0; rep < s.reps; ++rep) {
    MPI_Barrier(group);
    t = {};
    double start = seconds();
    op.forward(X, W, Y, LP, LSE);
    op.backward(X, W, Y, LSEc, G, DX, DW);
    best_two_calls = std::min(best_two_calls, max_over_ranks(seconds() - start));
    two_calls_traffic = t;

    MPI_Barrier(group);
    t = {};
    start = seconds();
    op.forward_backward(X, W, Y, G, LP, DX, DW);
    best_fused = std::min(best_fused, max_over_ranks(seconds() - start));
    fused_traffic = t;
  }
  const double scratch = max_over_ranks(static_cast<double>(heap::peak() - heap_before) / 1048576.0);
  const double hwm = max_over_ranks(vm_hwm_mib());
  const double payload_two = max_over_ranks(two_calls_traffic.payload / static_cast<double>(n));
  const double wire_two = max_over_ranks(two_calls_traffic.wire / static_cast<double>(n));
  const double payload_fused = max_over_ranks(fused_traffic.payload / static_cast<double>(n));
  const double wire_fused = max_over_ranks(fused_traffic.wire / static_cast<double>(n));
  const double collectives_fused = max_over_ranks(static_cast<double>(fused_traffic.collectives));
  const double workspace_mib = max_over_ranks(static_cast<double>(workspace) / 1048576.0);
  double nll = 0.0;
  for (float e : lp) nll -= e;
  nll /= static_cast<double>(n);

  if (rank == 0)
    std::printf("%5d  %-8s %6lld %10.1f %9.1f   %8.0f /%8.0f   %8.0f /%8.0f %6.0f %9.1f %8.1f %9.1f %10.5f\n", ranks,
                sp ? "sequence" : "vocab", static_cast<long long>(chunk), best_two_calls * 1e3, best_fused * 1e3,
                payload_two, wire_two, payload_fused, wire_fused, collectives_fused, workspace_mib, scratch, hwm, nll);
  std::fflush(stdout);
  row out;
  out.ranks = ranks, out.threads = threads, out.sequence_parallel = sp, out.chunk = chunk;
  out.two_calls_ms = best_two_calls * 1e3, out.fused_ms = best_fused * 1e3;
  out.payload_two = payload_two, out.wire_two = wire_two, out.payload_fused = payload_fused, out.wire_fused = wire_fused;
  out.collectives_fused = collectives_fused, out.workspace_mib = workspace_mib, out.scratch_mib = scratch;
  out.vm_hwm_mib = hwm, out.mean_nll = nll;
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  // Before MPI_Init: OpenBLAS's SSE3 fallback kernels -> restart with OPENBLAS_CORETYPE.
  lce::reexec_with_fast_blas(argv);
  MPI_Init(&argc, &argv);
  int rank = 0, ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);

  settings s;
  for (int i = 1; i < argc; ++i) {
    lce_support::flag f;
    if (!lce_support::read_flag(i, argc, argv, {}, f)) {
      if (rank == 0) std::fprintf(stderr, "option %s needs a value\n", f.name.c_str());
      break;
    }
    const std::string &flag = f.name, &arg = f.value;
    if (flag == "--tokens") s.tokens = std::atoll(arg.c_str());
    else if (flag == "--hidden") s.hidden = std::atoll(arg.c_str());
    else if (flag == "--vocab") s.vocab = std::atoll(arg.c_str());
    else if (flag == "--chunk") s.chunk = std::atoll(arg.c_str());
    else if (flag == "--reps") s.reps = std::max(1, std::atoi(arg.c_str()));
    else if (flag == "--threads") s.threads = std::atoi(arg.c_str());
    else if (flag == "--mode") s.mode = arg;
    else if (flag == "--json") s.json = arg;
    else if (flag == "--svg") s.svg = arg;
    else if (flag == "--ranks") {
      std::stringstream in(arg);
      for (std::string item; std::getline(in, item, ',');)
        if (!item.empty()) s.ranks.push_back(std::atoi(item.c_str()));
    }
    else if (rank == 0) std::fprintf(stderr, "unknown option %s\n", flag.c_str());
  }
  const int cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  if (s.ranks.empty()) s.ranks = {ranks};
  const lce::blas_report blas = lce::blas_info();

  if (rank == 0) {
    std::printf("# lce_bench_distributed: N = %lld tokens, H = %lld, V = %lld, float; job of %d rank%s; best of %d\n",
                static_cast<long long>(s.tokens), static_cast<long long>(s.hidden), static_cast<long long>(s.vocab),
                ranks, ranks == 1 ? "" : "s", s.reps);
    std::printf("# %s\n", blas.line().c_str());
    std::printf("# %5s  %-8s %6s %10s %9s   %17s   %17s %6s %9s %8s %9s %10s\n", "ranks", "mode", "chunk",
                "fwd+bwd ms", "fused ms", "fwd+bwd B/tok", "fused B/tok", "coll.", "wksp MiB", "peak MiB",
                "VmHWM MiB", "mean NLL");
    std::printf("# %5s  %-8s %6s %10s %9s   %17s   %17s %6s %9s %8s %9s %10s\n", "", "", "", "", "",
                "payload /   wire", "payload /   wire", "fused", "per rank", "new()", "max rank", "");
  }
  bool ok = true;
  std::vector<row> rows;
  for (int group_size : s.ranks) {
    if (group_size < 1 || group_size > ranks) {
      if (rank == 0) std::printf("# %d ranks skipped: the job has %d\n", group_size, ranks);
      continue;
    }
    MPI_Comm group = MPI_COMM_NULL;
    MPI_Comm_split(MPI_COMM_WORLD, rank < group_size ? 0 : MPI_UNDEFINED, rank, &group);
    const int threads = s.threads > 0 ? s.threads : std::max(1, cores / group_size);
    if (openblas_set_num_threads) openblas_set_num_threads(threads);
    if (group != MPI_COMM_NULL) {
      for (bool sequence_parallel : {false, true}) {
        if ((sequence_parallel && s.mode == "vocab") || (!sequence_parallel && s.mode == "sequence")) continue;
        if (sequence_parallel && group_size == 1) {
          if (rank == 0 && s.mode != "sequence")
            std::printf("# (one rank: sequence parallel is the same as vocabulary parallel)\n");
          if (s.mode != "sequence") continue;
        }
        if (sequence_parallel && s.tokens % group_size != 0) {
          if (rank == 0) std::printf("# sequence parallel skipped: %lld tokens do not split over %d ranks\n",
                                     static_cast<long long>(s.tokens), group_size);
          continue;
        }
        try {
          rows.push_back(run(s, sequence_parallel, group, threads));
        } catch (const lce::error& e) {
          std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
          ok = false;
          break;
        }
      }
      MPI_Comm_free(&group);
    }
    // ranks outside the group wait here without spinning (MPI_Barrier busy-polls, which
    // would take the cores from the group at work)
    MPI_Request barrier = MPI_REQUEST_NULL;
    MPI_Ibarrier(MPI_COMM_WORLD, &barrier);
    for (int done = 0; MPI_Test(&barrier, &done, MPI_STATUS_IGNORE), !done;)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }

  if (rank == 0 && !s.json.empty()) {
    lce_bench::json_writer j;
    j.begin_object();
    j.field("program", "lce_bench_distributed");
    j.field("dtype", "float32");
    j.field("tokens", static_cast<long long>(s.tokens));
    j.field("hidden", static_cast<long long>(s.hidden));
    j.field("vocab", static_cast<long long>(s.vocab));
    j.field("job_ranks", ranks);
    j.field("cores", cores);
    j.field("reps", s.reps);
    j.field("blas", blas.line());
    j.field("blas_kernels", blas.kernels);
    j.key("results");
    j.begin_array();
    for (const row& r : rows) {
      j.begin_object();
      j.field("ranks", r.ranks);
      j.field("threads_per_rank", r.threads);
      j.field("mode", r.sequence_parallel ? "sequence" : "vocab");
      j.field("chunk", static_cast<long long>(r.chunk));
      j.field("forward_then_backward_ms", r.two_calls_ms);
      j.field("fused_ms", r.fused_ms);
      j.field("forward_then_backward_payload_bytes_per_token", r.payload_two);
      j.field("forward_then_backward_wire_bytes_per_token", r.wire_two);
      j.field("fused_payload_bytes_per_token", r.payload_fused);
      j.field("fused_wire_bytes_per_token", r.wire_fused);
      j.field("fused_collectives", r.collectives_fused);
      j.field("workspace_mib", r.workspace_mib);
      j.field("scratch_peak_mib", r.scratch_mib);
      j.field("vm_hwm_mib", r.vm_hwm_mib);
      j.field("mean_nll", r.mean_nll);
      j.end_object();
    }
    j.end_array();
    j.end_object();
    if (!j.save(s.json)) std::fprintf(stderr, "cannot write %s\n", s.json.c_str()), ok = false;
  }
  if (rank == 0 && !s.svg.empty()) {
    lce_bench::line_plot plot;
    plot.title = "Bytes on the wire per token and rank, N = " + std::to_string(s.tokens) + ", H = " +
                 std::to_string(s.hidden) + ", V = " + std::to_string(s.vocab);
    plot.subtitle = "ring estimate of what each rank sends, counted at lce's collectives (float)";
    plot.x_label = "ranks P", plot.y_label = "bytes per token", plot.x_log2 = true;
    for (bool sp : {false, true})
      for (bool fused : {false, true}) {
        std::vector<std::pair<double, double>> points;
        for (const row& r : rows)  // one rank: sequence parallel is vocabulary parallel (nothing on the wire)
          if (r.sequence_parallel == sp || (sp && r.ranks == 1))
            points.emplace_back(double(r.ranks), fused ? r.wire_fused : r.wire_two);
        if (points.empty()) continue;
        plot.add(std::string(sp ? "TP + SP" : "TP (vocab)") + (fused ? ", fused" : ", fwd+bwd"),
                 points, !fused);
      }
    if (!plot.write(s.svg)) std::fprintf(stderr, "cannot write %s\n", s.svg.c_str()), ok = false;
  }
  MPI_Finalize();
  return ok ? 0 : 1;
}
