// Target sets ([N, K] ids per token) over several ranks: vocabulary and
// sequence parallel results equal a single-rank run, the K logits travel in
// the row statistics' one collective per chunk, and ranks that disagree on K
// raise together. Bodies run on every rank (threads and MPI suites).
#pragma once

#include "distributed_cases.hpp"

namespace lce_dist {

// K ids per token for a configuration: ids in every shard (its first and last
// row among them), a repeated id, ignored ids, and every fifth token all ignored.
inline std::vector<std::int64_t> make_target_sets(const case_config& cfg, std::int64_t k, std::int64_t n,
                                                  std::int64_t ignore_index = -100) {
  const std::int64_t v = cfg.vocab();
  std::vector<std::int64_t> ids(static_cast<std::size_t>(n * k));
  for (std::int64_t e = 0; e < n * k; ++e)
    ids[static_cast<std::size_t>(e)] = static_cast<std::int64_t>(mix(cfg.seed * 131 + static_cast<std::uint64_t>(e)) % v);
  for (std::size_t r = 0; r < cfg.shard_rows.size(); ++r) {
    const auto at = static_cast<std::int64_t>(r) % n;
    ids[static_cast<std::size_t>(at * k)] = cfg.vocab_start(static_cast<int>(r));
    ids[static_cast<std::size_t>(at * k + 1)] = cfg.vocab_start(static_cast<int>(r)) + cfg.shard_rows[r] - 1;
  }
  for (std::int64_t i = 0; i < n; ++i) {
    ids[static_cast<std::size_t>(i * k + k - 1)] = ids[static_cast<std::size_t>(i * k)];  // a repeat
    if (i % 3 == 1) ids[static_cast<std::size_t>(i * k + 2)] = ignore_index;
    if (i % 5 == 4)
      for (std::int64_t e = 0; e < k; ++e) ids[static_cast<std::size_t>(i * k + e)] = ignore_index;
  }
  return ids;
}

template <class T>
struct set_results {
  using R = typename io_types<T>::result;
  using GX = typename io_types<T>::grad_hidden;
  using GW = typename io_types<T>::grad_weight;
  std::vector<R> logprobs, lse, entropy, logprobs_fused;
  std::vector<GX> dx, dx_fused;
  std::vector<GW> dw, dw_fused;
};

// forward (log-probs, lse, entropy), backward (dL/dlogp [N, K] and dL/dentropy),
// forward_backward (the same gradients) on `op`, over this rank's rows and shard.
template <class T, class Op>
set_results<T> exercise_sets(Op& op, std::int64_t h, std::int64_t k, const std::vector<T>& hidden,
                             std::int64_t hidden_rows, const std::vector<T>& weight, std::int64_t weight_rows,
                             const std::vector<std::int64_t>& ids, const std::vector<double>& g,
                             const std::vector<double>& e, const std::vector<double>& weight_grad_initial,
                             collective_counts* counts = nullptr, collective_counts* forward_issued = nullptr) {
  using S = set_results<T>;
  using R = typename S::R;
  const auto n = static_cast<std::int64_t>(ids.size()) / k;
  S out;
  out.logprobs.assign(static_cast<std::size_t>(n * k), not_a_number<R>());
  out.logprobs_fused = out.logprobs;
  out.lse.assign(static_cast<std::size_t>(n), not_a_number<R>());
  out.entropy = out.lse;
  out.dx.assign(static_cast<std::size_t>(hidden_rows * h), not_a_number<typename S::GX>());
  out.dx_fused = out.dx;
  out.dw = converted<typename S::GW>(weight_grad_initial);
  out.dw_fused = out.dw;
  const std::vector<R> grads = converted<R>(g), grad_entropy = converted<R>(e);
  const lce::matrix_view<const T> X{hidden.data(), hidden_rows, h, h}, W{weight.data(), weight_rows, h, h};
  const lce::matrix_view<const std::int64_t> Y{ids.data(), n, k, k};
  const lce::matrix_view<const R> G{grads.data(), n, k, k};
  const lce::vector_view<const R> HG{grad_entropy.data(), n};
  const collective_counts before = counts ? *counts : collective_counts{};
  op.forward(X, W, Y,
             lce::target_set_outputs<R>{{out.logprobs.data(), n, k, k}, {out.lse.data(), n}, {out.entropy.data(), n}, {}});
  if (counts && forward_issued) *forward_issued = *counts - before;
  const lce::vector_view<const R> lse{out.lse.data(), n};
  op.backward(X, W, Y, lse, lce::target_set_gradients<R>{G, HG, {}, {}},
              lce::matrix_view<typename S::GX>{out.dx.data(), hidden_rows, h, h},
              lce::matrix_view<typename S::GW>{out.dw.data(), weight_rows, h, h});
  op.forward_backward(X, W, Y, lce::target_set_gradients<R>{G, HG, {}, {}},
                      lce::target_set_outputs<R>{{out.logprobs_fused.data(), n, k, k}, {}, {}, {}},
                      lce::matrix_view<typename S::GX>{out.dx_fused.data(), hidden_rows, h, h},
                      lce::matrix_view<typename S::GW>{out.dw_fused.data(), weight_rows, h, h});
  return out;
}

template <class T, class Comm>
void check_target_sets_against_single_rank(const Comm& comm, const case_config& cfg, std::int64_t k) {
  using A = lce::compute_t<T>;
  const int ranks = comm.size(), rank = comm.rank();
  const std::string where = cfg.describe(rank, ranks, type_name<T>()) + " target sets of " + std::to_string(k);
  const problem<T> p = make_problem<T>(cfg);
  const std::int64_t h = p.h, n = p.n;
  const auto ids = make_target_sets(cfg, k, n);
  std::vector<double> g(static_cast<std::size_t>(n * k));
  for (std::size_t e = 0; e < g.size(); ++e) g[e] = uniform(cfg.seed + 9, e);
  const std::int64_t v0 = cfg.vocab_start(rank), vr = cfg.shard_rows[static_cast<std::size_t>(rank)];
  const std::int64_t local_rows = cfg.sequence_parallel ? n / ranks : n;
  const std::int64_t row0 = cfg.sequence_parallel ? rank * local_rows : 0;

  lce::options reference_options;
  reference_options.temperature = cfg.temperature;
  reference_options.softcap = cfg.softcap;
  reference_options.chunk_tokens = cfg.chunk_tokens;
  lce::ChunkedHiddenToLogprobs<lce::comm::single, T, lce::budget_chunk, lce::host> reference(
      lce::comm::single{}, reference_options, lce::host{1});
  const set_results<T> want = exercise_sets<T>(reference, h, k, p.x, n, p.w, p.v, ids, g, p.e, p.weight_grad);

  const std::vector<T> weight = rows_of(p.w, h, v0, vr);
  const std::vector<T> hidden = rows_of(p.x, h, row0, local_rows);
  const std::vector<double> weight_grad = rows_of(p.weight_grad, h, v0, vr);
  lce::options options = reference_options;
  options.vocab_start = v0;
  options.sequence_parallel = cfg.sequence_parallel;
  collective_counts counts, forward_issued;
  lce::ChunkedHiddenToLogprobs<counting<Comm>, T, lce::budget_chunk, lce::host> op(counting<Comm>(comm, &counts),
                                                                                      options, lce::host{1});
  (void)op.workspace_bytes(n, h, vr, k);  // the first call's agreement is then the only extra exchange
  const set_results<T> got =
      exercise_sets<T>(op, h, k, hidden, local_rows, weight, vr, ids, g, p.e, weight_grad, &counts, &forward_issued);

  // Vocabulary parallel forward: one all_gather per chunk carries the row
  // statistics and the K logits (plus the call's agreement), nothing else.
  if (ranks > 1 && !cfg.sequence_parallel && cfg.chunk_tokens > 0) {
    const std::int64_t chunks = (n + cfg.chunk_tokens - 1) / cfg.chunk_tokens;
    CHECK_MESSAGE(forward_issued.all_gather_bytes == chunks, where << ": forward issued " << forward_issued.str());
    CHECK_MESSAGE(forward_issued.all_reduce_sum == 0, where << ": forward issued " << forward_issued.str());
    std::int64_t bytes = 0;
    for (std::int64_t first = 0; first < n; first += cfg.chunk_tokens) {
      const std::int64_t rows = std::min(cfg.chunk_tokens, n - first);
      bytes += static_cast<std::int64_t>(lce::detail::workspace_plan<A>::exchange_record(rows, k).value *
                                         sizeof(lce::detail::row_partial<A>));
    }
    CHECK_MESSAGE(forward_issued.gathered_bytes == bytes, where << ": forward issued " << forward_issued.str());
  }

  const double rel = relative_tolerance<T>();
  using GX = typename io_types<T>::grad_hidden;
  using GW = typename io_types<T>::grad_weight;
  const auto check = [&](const char* what, const comparison& c, std::int64_t count) {
    CHECK_MESSAGE(c.ok, where << ": " << c.describe(what, count));
  };
  check("logprobs [N, K]", compare<T>(got.logprobs, want.logprobs, 0, n * k, rel), n * k);
  check("lse", compare<T>(got.lse, want.lse, 0, n, rel), n);
  check("entropy", compare<T>(got.entropy, want.entropy, 0, n, rel), n);
  check("logprobs (forward_backward)", compare<T>(got.logprobs_fused, want.logprobs_fused, 0, n * k, rel), n * k);
  const std::int64_t x_elems = local_rows * h, x_first = row0 * h;
  check("grad_hidden", compare<GX>(got.dx, want.dx, x_first, x_elems, rel, !std::is_floating_point_v<GX>), x_elems);
  check("grad_hidden (forward_backward)",
        compare<GX>(got.dx_fused, want.dx_fused, x_first, x_elems, rel, !std::is_floating_point_v<GX>), x_elems);
  const std::int64_t w_elems = vr * h, w_first = v0 * h;
  check("grad_weight", compare<GW>(got.dw, want.dw, w_first, w_elems, rel, !std::is_floating_point_v<GW>), w_elems);
  check("grad_weight (forward_backward)",
        compare<GW>(got.dw_fused, want.dw_fused, w_first, w_elems, rel, !std::is_floating_point_v<GW>), w_elems);
}

template <class T, class Comm>
void check_target_sets(const Comm& comm) {
  for (const case_config& cfg : configurations(comm.size())) check_target_sets_against_single_rank<T>(comm, cfg, 4);
}

// Ranks passing target sets of different K (or one passing plain targets)
// raise lce::error together, naming the calls.
template <class Comm>
void check_target_set_disagreement(const Comm& comm) {
  using T = float;
  const int ranks = comm.size(), rank = comm.rank();
  if (ranks == 1) return;
  case_config cfg;
  cfg.name = "target set disagreement";
  cfg.n_tokens = 9;
  cfg.hidden = 8;
  cfg.shard_rows = vocab_split(1000, ranks, 0);
  cfg.chunk_tokens = 4;
  cfg.seed = 5;
  const problem<T> p = make_problem<T>(cfg);
  const std::int64_t k = rank == ranks - 1 ? 3 : 2;  // the last rank passes one more id per token
  const auto ids = make_target_sets(cfg, k, p.n);
  const std::int64_t v0 = cfg.vocab_start(rank), vr = cfg.shard_rows[static_cast<std::size_t>(rank)];
  const std::vector<T> weight = rows_of(p.w, p.h, v0, vr);
  lce::options options;
  options.vocab_start = v0;
  options.chunk_tokens = cfg.chunk_tokens;
  lce::ChunkedHiddenToLogprobs<Comm, T> op(comm, options);
  std::vector<float> lp(static_cast<std::size_t>(p.n * k), -7.0f), lse(static_cast<std::size_t>(p.n), -7.0f);
  const std::string message = error_of([&] {
    op.forward(lce::matrix_view<const T>{p.x.data(), p.n, p.h, p.h},
               lce::matrix_view<const T>{weight.data(), vr, p.h, p.h},
               lce::matrix_view<const std::int64_t>{ids.data(), p.n, k, k},
               lce::target_set_outputs<float>{{lp.data(), p.n, k, k}, {lse.data(), p.n}, {}, {}});
  });
  CHECK_MESSAGE(contains(message, "target sets of 2"), "rank " << rank << ": " << message);
  CHECK_MESSAGE(contains(message, "target sets of 3"), "rank " << rank << ": " << message);
  CHECK(all_equal(lp, -7.0));
  CHECK(all_equal(lse, -7.0));
}

}  // namespace lce_dist
