// Bounded memory under sequence parallelism, measured per rank.
//
// Every global operator new / delete of this binary (lce_thread_tests) is
// replaced (support/allocation_counter.cpp) by a counting version that keeps, per thread, the bytes currently
// allocated and their peak. A rank is a thread and the operator allocates its
// scratch on the calling thread, so a rank's peak is its thread's peak.
// (malloc / mmap, e.g. OpenBLAS's own buffers, are not seen; the checks make
// sure the op's scratch is.)
//
// At N = 16384 tokens and H = 256, one [N, H] fp32 buffer is 16 MiB; the
// sequence-parallel op must never gather the whole sequence, nor keep an
// [N, H] fp32 gradient: each rank's peak stays within its
// workspace_bytes(N, H, V_local) + 64 KiB, and below a quarter of N x H x 4.
#include "distributed_cases.hpp"

#include <lce/comm/threads.hpp>

#include "allocation_counter.hpp"

namespace {

// Small allocations around a call (views, the agreement's records), and, with
// the host's oneDNN bf16 GEMMs, the primitives oneDNN creates on a thread's
// first use of a shape (kept in a per-thread cache of at most 32 entries).
constexpr std::int64_t slack = (std::int64_t{64} << 10) + (LCE_HOST_BF16_GEMM_ONEDNN ? std::int64_t{512} << 10 : 0);

template <class T>
void sequence_parallel_memory(lce::comm::threads comm) {
  using GW = typename lce_dist::io_types<T>::grad_weight;  // T for 2-byte types: includes the fp32 dW accumulator
  const int ranks = comm.size(), rank = comm.rank();
  const std::int64_t n = 16384, h = 256;
  const std::vector<std::int64_t> shards = {256, 255, 1, 512};  // V = 1024, uneven, one single-row shard
  REQUIRE(static_cast<int>(shards.size()) == ranks);
  const std::int64_t v0 = std::accumulate(shards.begin(), shards.begin() + rank, std::int64_t{0});
  const std::int64_t vr = shards[static_cast<std::size_t>(rank)], v = 1024;
  const std::int64_t local = n / ranks;
  const std::int64_t full_hidden_fp32 = n * h * 4;  // 16 MiB: what gathering the sequence would cost

  // Inputs and outputs first: they are the caller's, not the op's.
  std::vector<T> x(static_cast<std::size_t>(local * h)), w(static_cast<std::size_t>(vr * h));
  for (std::size_t k = 0; k < x.size(); ++k) x[k] = lce_dist::from_double<T>(lce_dist::uniform(11, rank * x.size() + k));
  for (std::size_t k = 0; k < w.size(); ++k) w[k] = lce_dist::from_double<T>(0.2 * lce_dist::uniform(12, v0 * h + k));
  std::vector<std::int64_t> y(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) y[static_cast<std::size_t>(i)] = i % 9 == 4 ? -100 : static_cast<std::int64_t>(lce_dist::mix(i) % v);
  std::vector<float> lp(n), lse(n), ent(n), g(n, -1.0f / static_cast<float>(n)), ge(n, 0.01f), dx(static_cast<std::size_t>(local * h));
  std::vector<GW> dw(static_cast<std::size_t>(vr * h), lce_dist::from_double<GW>(0.0));
  const lce::matrix_view<const T> X{x.data(), local, h};
  const lce::matrix_view<const T> W{w.data(), vr, h};
  const lce::vector_view<const std::int64_t> Y{y.data(), n};
  const lce::vector_view<float> LP{lp.data(), n}, LSE{lse.data(), n}, ENT{ent.data(), n};
  const lce::vector_view<const float> G{g.data(), n}, GE{ge.data(), n}, LSEc{lse.data(), n};
  const lce::matrix_view<float> DX{dx.data(), local, h};
  const lce::matrix_view<GW> DW{dw.data(), vr, h};

  lce::options options;
  options.vocab_start = v0;
  options.sequence_parallel = true;
  options.chunk_tokens = 512;  // 128 hidden rows per rank per chunk
  lce::ChunkedHiddenToLogprobs<lce::comm::threads, T, lce::budget_chunk, lce::host> op(comm, options, lce::host{1});
  const auto workspace = static_cast<std::int64_t>(op.workspace_bytes(n, h, vr));
  const std::string where = std::string("T=") + lce_dist::type_name<T>() + ", rank " + std::to_string(rank) + "/" +
                            std::to_string(ranks) + " (V_local " + std::to_string(vr) + "), workspace_bytes " +
                            std::to_string(workspace) + ": ";
  // (For bf16 the workspace includes the fp32 [V_local, H] dW accumulator.)
  CHECK_MESSAGE(workspace < full_hidden_fp32 / 3, where << "the workspace itself is not far below N x H x 4 = "
                                                        << full_hidden_fp32);

  const std::int64_t life_base = lce_support::allocations::thread_current();
  std::int64_t life_peak = 0;  // over the three calls, above life_base
  const auto measure = [&](const char* what, auto&& call) {
    const lce_support::allocations::thread_scope s;
    call();
    const std::int64_t peak = s.peak_delta();
    life_peak = std::max(life_peak, lce_support::allocations::thread_peak() - life_base);
    CHECK_MESSAGE(peak <= workspace + slack, where << what << ": peak " << peak << " bytes above the call's start");
    CHECK_MESSAGE(peak < full_hidden_fp32 / 4, where << what << ": peak " << peak << " bytes, not far below N x H x 4 = "
                                                     << full_hidden_fp32);
  };
  measure("forward with entropy", [&] { op.forward(X, W, Y, LP, LSE, ENT); });
  measure("backward with grad_entropy", [&] { op.backward(X, W, Y, LSEc, G, GE, DX, DW); });
  measure("forward_backward", [&] { op.forward_backward(X, W, Y, G, LP, DX, DW); });
  const std::int64_t total = life_peak;
  CHECK_MESSAGE(total <= workspace + slack, where << "all three calls: peak " << total);
  // The op's scratch was seen through operator new (it is at least the logit block of a chunk).
  CHECK_MESSAGE(total >= 512 * vr * 4, where << "only " << total << " bytes seen: is the scratch counted?");
  MESSAGE(where << "peak " << total << " bytes (" << 100.0 * static_cast<double>(total) / static_cast<double>(full_hidden_fp32)
                << "% of one [N, H] fp32 buffer)");

  // Sanity: the results are finite.
  CHECK(std::isfinite(lp[0]));
  CHECK(std::isfinite(dx[0]));
  CHECK(std::isfinite(lce_dist::to_double(dw[0])));
}

}  // namespace

TEST_CASE_TEMPLATE("threads: sequence parallel memory per rank stays within workspace_bytes, far below N x H", T,
                   float, lce::bfloat16) {
  lce_dist::run_on_threads(4, [](lce::comm::threads comm) { sequence_parallel_memory<T>(comm); });
}
