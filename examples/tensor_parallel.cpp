// lce tensor-parallel example: a Megatron-style language-model head.
//
// The MPI ranks form a grid of data-parallel replicas x tensor-parallel ranks
// (4 ranks: 2 x 2; otherwise 1 x P). Inside a tensor-parallel group every rank
// holds a vocabulary shard of the output weight, W_r = rows [v0_r, v0_r + V_r)
// of W [V, H], and the same tokens; each data-parallel replica has its own
// tokens. One training step of the head computes the mean NLL over every
// counted token of every replica, L = -(1 / count) sum logp, and its gradients:
//
//   count = lce::global_token_count(data-parallel comm, targets)   (padding excluded)
//   op.forward_backward(X, W_r, targets, dL/dlogp = -1/count, logp, dX, dW_r)
//
// with op = lce::ChunkedHiddenToLogprobs<lce::comm::mpi, float> on the
// tensor-parallel communicator: one sweep, no [tokens, vocab] logits anywhere,
// and one small all-gather plus one dX reduction per chunk between shards.
// It runs the step twice: plain vocabulary parallel (every rank holds all of X
// and gets all of dX) and with sequence parallelism (rank r holds rows
// r N/P .. of X and gets the same rows of dX).
//
// Rank 0 then checks the loss and the gradients against a one-rank computation
// of the whole batch with the whole weight, and exits non-zero on a mismatch.
//
//   mpiexec -n 4 lce_tensor_parallel [--tokens 512] [--hidden 256] [--vocab 32000]
#include <lce/comm/mpi.hpp>
#include <lce/lce.hpp>

#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

// The same pseudo-random numbers on every rank: splitmix64 of (stream, index).
float value(std::uint64_t stream, std::uint64_t index, float scale) {
  std::uint64_t z = stream * 0x9E3779B97F4A7C15ull + index + 0x632BE59BD9B4E019ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return scale * (static_cast<float>(z >> 40) * (2.0f / 16777216.0f) - 1.0f);
}

struct shape {
  std::int64_t tokens = 512;  // per data-parallel replica
  std::int64_t hidden = 256;
  std::int64_t vocab = 32000;
};

// Replica d's hidden states, rows [first, first + rows) of its [tokens, H].
std::vector<float> hidden_rows(const shape& s, int replica, std::int64_t first, std::int64_t rows) {
  std::vector<float> x(static_cast<std::size_t>(rows * s.hidden));
  for (std::int64_t i = 0; i < rows * s.hidden; ++i)
    x[static_cast<std::size_t>(i)] = value(100 + replica, static_cast<std::uint64_t>(first * s.hidden + i), 1.7f);
  return x;
}

// Rows [first, first + rows) of the output weight W [V, H].
std::vector<float> weight_rows(const shape& s, std::int64_t first, std::int64_t rows) {
  const float scale = 3.0f / std::sqrt(static_cast<float>(s.hidden));
  std::vector<float> w(static_cast<std::size_t>(rows * s.hidden));
  for (std::int64_t i = 0; i < rows * s.hidden; ++i)
    w[static_cast<std::size_t>(i)] = value(7, static_cast<std::uint64_t>(first * s.hidden + i), scale);
  return w;
}

// Replica d's targets: the last 5% of every 128-token sequence is padding (ignored).
std::vector<std::int64_t> targets_of(const shape& s, int replica) {
  std::vector<std::int64_t> y(static_cast<std::size_t>(s.tokens));
  for (std::int64_t i = 0; i < s.tokens; ++i) {
    const bool padding = i % 128 >= 122;
    const auto r = static_cast<std::uint64_t>(std::fabs(value(200 + replica, static_cast<std::uint64_t>(i), 1.0f)) * 1e6f);
    y[static_cast<std::size_t>(i)] = padding ? -100 : static_cast<std::int64_t>(r % static_cast<std::uint64_t>(s.vocab));
  }
  return y;
}

double sum_of_squares(const std::vector<float>& v) {
  double total = 0.0;
  for (float e : v) total += static_cast<double>(e) * e;
  return total;
}

struct step_result {
  double loss = 0.0;         // mean NLL over every counted token of every replica
  double dx_norm2 = 0.0;     // |dL/dX|^2 over all replicas' tokens
  double dw_norm2 = 0.0;     // |dL/dW|^2 over the whole vocabulary (summed over replicas)
  std::int64_t count = 0;    // counted tokens over the data-parallel group
};

// One step of the head on this rank; the results are the same on every rank.
step_result tensor_parallel_step(const shape& s, MPI_Comm tp, MPI_Comm dp, bool sequence_parallel) {
  int tp_rank = 0, tp_size = 1, dp_rank = 0;
  MPI_Comm_rank(tp, &tp_rank);
  MPI_Comm_size(tp, &tp_size);
  MPI_Comm_rank(dp, &dp_rank);

  // This rank's vocabulary shard (uneven when P does not divide V).
  const std::int64_t v0 = s.vocab * tp_rank / tp_size, vr = s.vocab * (tp_rank + 1) / tp_size - v0;
  // This rank's rows of X: all of them, or 1/P of them under sequence parallelism.
  const std::int64_t rows = sequence_parallel ? s.tokens / tp_size : s.tokens;
  const std::int64_t row0 = sequence_parallel ? tp_rank * rows : 0;

  const std::vector<float> x = hidden_rows(s, dp_rank, row0, rows);
  const std::vector<float> w = weight_rows(s, v0, vr);
  const std::vector<std::int64_t> y = targets_of(s, dp_rank);  // all tokens of the replica, on every rank
  const std::int64_t n = s.tokens, h = s.hidden;

  // Mean over the counted tokens of ALL replicas: count across the data-parallel
  // group (not the tensor-parallel one, whose ranks share the same tokens).
  const lce::comm::mpi data_parallel{dp};
  const std::int64_t count = lce::global_token_count(data_parallel, lce::vector_view<const std::int64_t>{y.data(), n});

  lce::options options;
  options.vocab_start = v0;
  options.sequence_parallel = sequence_parallel;
  lce::ChunkedHiddenToLogprobs<lce::comm::mpi, float> op{lce::comm::mpi{tp}, options};

  std::vector<float> grad_logprobs(static_cast<std::size_t>(n), -1.0f / static_cast<float>(count));
  std::vector<float> logprobs(static_cast<std::size_t>(n));
  std::vector<float> dx(static_cast<std::size_t>(rows * h));
  std::vector<float> dw(static_cast<std::size_t>(vr * h), 0.0f);  // accumulated into: start at zero
  op.forward_backward(lce::matrix_view<const float>{x.data(), rows, h}, lce::matrix_view<const float>{w.data(), vr, h},
                      lce::vector_view<const std::int64_t>{y.data(), n},
                      lce::vector_view<const float>{grad_logprobs.data(), n},
                      lce::vector_view<float>{logprobs.data(), n}, lce::matrix_view<float>{dx.data(), rows, h},
                      lce::matrix_view<float>{dw.data(), vr, h});

  // The data-parallel gradient all-reduce of dW_r, as a trainer would do it.
  MPI_Allreduce(MPI_IN_PLACE, dw.data(), static_cast<int>(dw.size()), MPI_FLOAT, MPI_SUM, dp);

  // Every tensor-parallel rank has the log-probs of all the replica's tokens.
  double local_loss = 0.0;
  for (float lp : logprobs) local_loss -= lp;
  local_loss /= static_cast<double>(count);
  // Norms over the whole model: dX rows are either replicated over the
  // tensor-parallel group (count them on its rank 0) or split across it;
  // dW_r is replicated over replicas (count it on replica 0).
  double parts[3] = {tp_rank == 0 ? local_loss : 0.0, sequence_parallel || tp_rank == 0 ? sum_of_squares(dx) : 0.0,
                     dp_rank == 0 ? sum_of_squares(dw) : 0.0};
  MPI_Allreduce(MPI_IN_PLACE, parts, 3, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  return {parts[0], parts[1], parts[2], count};
}

// The same step on one rank: every replica's tokens, the whole weight.
step_result one_rank_step(const shape& s, int replicas) {
  const std::int64_t n = s.tokens * replicas, h = s.hidden, v = s.vocab;
  std::vector<float> x, dx(static_cast<std::size_t>(n * h)), dw(static_cast<std::size_t>(v * h), 0.0f);
  std::vector<std::int64_t> y;
  for (int d = 0; d < replicas; ++d) {
    const auto xd = hidden_rows(s, d, 0, s.tokens);
    const auto yd = targets_of(s, d);
    x.insert(x.end(), xd.begin(), xd.end());
    y.insert(y.end(), yd.begin(), yd.end());
  }
  const std::vector<float> w = weight_rows(s, 0, v);
  const std::int64_t count = lce::count_tokens(lce::vector_view<const std::int64_t>{y.data(), n});
  std::vector<float> g(static_cast<std::size_t>(n), -1.0f / static_cast<float>(count)), logprobs(static_cast<std::size_t>(n));
  lce::ChunkedHiddenToLogprobs<lce::comm::single, float> op{lce::comm::single{}};
  op.forward_backward(lce::matrix_view<const float>{x.data(), n, h}, lce::matrix_view<const float>{w.data(), v, h},
                      lce::vector_view<const std::int64_t>{y.data(), n}, lce::vector_view<const float>{g.data(), n},
                      lce::vector_view<float>{logprobs.data(), n}, lce::matrix_view<float>{dx.data(), n, h},
                      lce::matrix_view<float>{dw.data(), v, h});
  double loss = 0.0;
  for (float lp : logprobs) loss -= lp;
  return {loss / static_cast<double>(count), sum_of_squares(dx), sum_of_squares(dw), count};
}

bool close(double got, double want, double tolerance) {
  return std::fabs(got - want) <= tolerance * std::max(1.0, std::fabs(want));
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);

  shape s;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const std::int64_t number = std::atoll(argv[i + 1]);
    if (flag == "--tokens") s.tokens = number;
    else if (flag == "--hidden") s.hidden = number;
    else if (flag == "--vocab") s.vocab = number;
  }

  // 4 ranks: 2 replicas x 2 shards; otherwise 1 replica x P shards.
  const int replicas = ranks % 2 == 0 && ranks >= 4 ? 2 : 1;
  const int shards = ranks / replicas;
  if (s.tokens % shards != 0) s.tokens += shards - s.tokens % shards;  // sequence parallel splits the tokens evenly
  MPI_Comm tp, dp;
  MPI_Comm_split(MPI_COMM_WORLD, /*color=*/rank / shards, /*key=*/rank % shards, &tp);
  MPI_Comm_split(MPI_COMM_WORLD, /*color=*/rank % shards, /*key=*/rank / shards, &dp);

  if (rank == 0) {
    std::printf("tensor-parallel LM head: %d rank%s = %d data-parallel replica%s x %d vocabulary shard%s\n", ranks,
                ranks == 1 ? "" : "s", replicas, replicas == 1 ? "" : "s", shards, shards == 1 ? "" : "s");
    std::printf("  %lld tokens per replica, H = %lld, V = %lld (shard rows:", static_cast<long long>(s.tokens),
                static_cast<long long>(s.hidden), static_cast<long long>(s.vocab));
    for (int r = 0; r < shards; ++r)
      std::printf(" %lld", static_cast<long long>(s.vocab * (r + 1) / shards - s.vocab * r / shards));
    std::printf(")\n");
  }

  const step_result reference = rank == 0 ? one_rank_step(s, replicas) : step_result{};
  bool ok = true;
  int status = 0;
  for (bool sequence_parallel : {false, true}) {
    step_result step;
    try {
      step = tensor_parallel_step(s, tp, dp, sequence_parallel);
    } catch (const lce::error& e) {
      std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
      MPI_Abort(MPI_COMM_WORLD, 2);
    }
    if (rank != 0) continue;
    const bool loss_ok = close(step.loss, reference.loss, 1e-5) && step.count == reference.count;
    const bool grads_ok = close(step.dx_norm2, reference.dx_norm2, 1e-4) && close(step.dw_norm2, reference.dw_norm2, 1e-4);
    ok = ok && loss_ok && grads_ok;
    std::printf("  %-20s mean NLL %.6f over %lld tokens | one rank: %.6f | |diff| %.1e | |dX| %.6e (one rank %.6e) |dW| %.6e (one rank %.6e)  %s\n",
                sequence_parallel ? "sequence parallel:" : "vocabulary parallel:", step.loss,
                static_cast<long long>(step.count), reference.loss, std::fabs(step.loss - reference.loss),
                std::sqrt(step.dx_norm2), std::sqrt(reference.dx_norm2), std::sqrt(step.dw_norm2),
                std::sqrt(reference.dw_norm2), loss_ok && grads_ok ? "MATCH" : "MISMATCH");
  }
  if (rank == 0) {
    std::printf("%s\n", ok ? "OK: the tensor-parallel loss and gradients match the one-rank computation"
                           : "FAILED: the tensor-parallel results differ from the one-rank computation");
    status = ok ? 0 : 1;
  }
  MPI_Bcast(&status, 1, MPI_INT, 0, MPI_COMM_WORLD);
  MPI_Comm_free(&tp);
  MPI_Comm_free(&dp);
  MPI_Finalize();
  return status;
}
