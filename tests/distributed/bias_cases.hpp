// An LM head with a bias (lce::with_bias) over several ranks: each rank holds
// its shard's bias; vocabulary and sequence parallel results (log-probs, dX,
// dW and db) equal a single-rank run with the whole bias.
#pragma once

#include "distributed_cases.hpp"

namespace lce_dist {

template <class T, class Comm>
void check_bias_against_single_rank(const Comm& comm, const case_config& cfg) {
  using R = typename io_types<T>::result;
  using A = lce::compute_t<T>;
  const int ranks = comm.size(), rank = comm.rank();
  const std::string where = cfg.describe(rank, ranks, type_name<T>()) + " with a bias";
  const problem<T> p = make_problem<T>(cfg);
  const std::int64_t h = p.h, n = p.n, v = p.v;
  std::vector<T> bias(static_cast<std::size_t>(v));
  for (std::int64_t j = 0; j < v; ++j) bias[static_cast<std::size_t>(j)] = from_double<T>(2.0 * uniform(cfg.seed + 7, j));
  const std::vector<R> g = converted<R>(p.g);
  const std::int64_t v0 = cfg.vocab_start(rank), vr = cfg.shard_rows[static_cast<std::size_t>(rank)];
  const std::int64_t local_rows = cfg.sequence_parallel ? n / ranks : n;
  const std::int64_t row0 = cfg.sequence_parallel ? rank * local_rows : 0;

  struct outcome {
    std::vector<R> logprobs, lse;
    std::vector<A> dx, dw, db;
  };
  const auto run = [&](auto& op, const std::vector<T>& hidden, std::int64_t rows, const T* weight, const T* b,
                       std::int64_t shard) {
    outcome o;
    o.logprobs.assign(static_cast<std::size_t>(n), not_a_number<R>());
    o.lse = o.logprobs;
    o.dx.assign(static_cast<std::size_t>(rows * h), not_a_number<A>());
    o.dw.assign(static_cast<std::size_t>(shard * h), A(0));
    o.db.assign(static_cast<std::size_t>(shard), A(0.25));
    const lce::matrix_view<const T> X{hidden.data(), rows, h, h}, W{weight, shard, h, h};
    const lce::vector_view<const T> B{b, shard};
    const lce::vector_view<const std::int64_t> Y{p.y.data(), n};
    op.forward(X, lce::with_bias{W, B}, Y, lce::vector_view<R>{o.logprobs.data(), n}, lce::vector_view<R>{o.lse.data(), n});
    op.backward(X, lce::with_bias{W, B}, Y, lce::vector_view<const R>{o.lse.data(), n},
                lce::vector_view<const R>{g.data(), n}, lce::matrix_view<A>{o.dx.data(), rows, h, h},
                lce::with_bias{lce::matrix_view<A>{o.dw.data(), shard, h, h}, lce::vector_view<A>{o.db.data(), shard}});
    return o;
  };
  lce::options reference_options;
  reference_options.temperature = cfg.temperature;
  reference_options.softcap = cfg.softcap;
  reference_options.chunk_tokens = cfg.chunk_tokens;
  lce::ChunkedHiddenToLogprobs<lce::comm::single, T> reference(lce::comm::single{}, reference_options, lce::host{1});
  const outcome want = run(reference, p.x, n, p.w.data(), bias.data(), v);

  lce::options options = reference_options;
  options.vocab_start = v0;
  options.sequence_parallel = cfg.sequence_parallel;
  lce::ChunkedHiddenToLogprobs<Comm, T> op(comm, options, lce::host{1});
  const std::vector<T> hidden = rows_of(p.x, h, row0, local_rows);
  const std::vector<T> weight = rows_of(p.w, h, v0, vr);
  const outcome got = run(op, hidden, local_rows, weight.data(), bias.data() + v0, vr);

  const double rel = relative_tolerance<T>();
  const auto check = [&](const char* what, const comparison& c, std::int64_t count) {
    CHECK_MESSAGE(c.ok, where << ": " << c.describe(what, count));
  };
  check("logprobs", compare<T>(got.logprobs, want.logprobs, 0, n, rel), n);
  check("grad_hidden", compare<A>(got.dx, want.dx, row0 * h, local_rows * h, rel), local_rows * h);
  check("grad_weight", compare<A>(got.dw, want.dw, v0 * h, vr * h, rel), vr * h);
  check("grad_bias", compare<A>(got.db, want.db, v0, vr, rel), vr);
}

template <class T, class Comm>
void check_bias(const Comm& comm) {
  for (const case_config& cfg : configurations(comm.size())) check_bias_against_single_rank<T>(comm, cfg);
}

}  // namespace lce_dist
