#pragma once
// Chunk policies: how many token rows go through the GEMMs at once.
//
// Bigger chunks make better GEMMs; the logit block of a chunk is the one
// buffer whose size grows with the vocabulary, so the chunk is what bounds
// memory.
//
// Who decides, in order:
//   fixed_chunk<K>        K, always; an options.chunk_tokens other than 0 or K is an error
//   options.chunk_tokens  > 0: that many rows (with budget_chunk or any run-time policy)
//   the policy            asked with the call's shapes and options.workspace_limit_bytes;
//                         its answer is the most rows a chunk may take: the tokens
//                         go in the fewest such chunks, as even as rows allow
//                         (1,100 tokens under a 1,024-row answer: 552 + 548,
//                         evened_chunk_rows below)
// budget_chunk answers the largest chunk within the budget, at most the
// backend's enough rows, and, for a call longer than those, at most an
// eighth of its tokens unless that would starve the GEMMs (the backend's
// min_efficient rows, which evening respects too): a call of N tokens then
// never holds more than an eighth of the logits it would materialise, from
// N = 8 x min_efficient up.
// With several ranks every rank proposes its chunk and all use the smallest,
// so ranks may differ in budget or threads. The chunk is also capped so that
// each per-chunk message fits a communicator's int count (MPI). A fixed
// chunk cannot size the scratch at compile time: its logit block is
// K x V_local, and V_local is known at run time only.

#include <lce/core/config.hpp>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>

LCE_BEGIN_NAMESPACE

// What a policy is told when asked for a chunk size.
struct chunk_request {
  std::int64_t n_tokens = 0;
  std::int64_t hidden = 0;
  std::int64_t vocab_local = 0;
  std::size_t bytes_per_token = 0;  // workspace bytes each chunk row costs
  std::size_t fixed_bytes = 0;      // workspace bytes independent of the chunk
  std::size_t workspace_limit_bytes = 0;
  // The backend's rows from which a bigger chunk buys little but memory
  // (enough_chunk_rows in core/backend.hpp); INT64_MAX: no such point.
  std::int64_t enough_rows = INT64_MAX;
  // The backend's rows below which a chunk's GEMMs lose speed
  // (min_efficient_chunk_rows in core/backend.hpp); INT64_MAX, or anything
  // from enough_rows up: no share, a long call keeps enough_rows.
  std::int64_t min_efficient_rows = INT64_MAX;
};

template <class P>
concept chunk_policy = std::default_initializable<P> && requires(const P& policy, const chunk_request& request) {
  { policy.tokens_per_chunk(request) } -> std::convertible_to<std::int64_t>;
};

// A chunk fixed at compile time: it wins over options.chunk_tokens.
template <std::int64_t Tokens>
  requires(Tokens > 0)
struct fixed_chunk {
  static constexpr std::int64_t tokens = Tokens;
  constexpr std::int64_t tokens_per_chunk(const chunk_request&) const { return Tokens; }
};

namespace detail {
// Pieces of b that hold a (b > 0): chunks of rows, tiles of a GEMM.
constexpr std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return a / b + (a % b != 0); }
}  // namespace detail

// The default: the largest chunk whose workspace fits `workspace_limit_bytes`
// (at least one row, whatever the limit), and no more than the backend's
// enough_rows: past them it would hold memory for little speed. A call longer
// than enough_rows takes at most 1/call_share of its tokens per chunk, but
// never fewer than min_efficient_rows for that: the memory saved over
// materialising the logits is then call_share-fold at least, from
// call_share x min_efficient_rows tokens on, for a few percent of speed
// (the host's numbers are in host.hpp). A call of at most enough_rows keeps
// one chunk: the fewest GEMMs, and for a 2-byte grad_weight no accumulator.
struct budget_chunk {
  static constexpr std::int64_t call_share = 8;

  constexpr std::int64_t tokens_per_chunk(const chunk_request& request) const {
    const std::size_t per_token = std::max<std::size_t>(request.bytes_per_token, 1);
    if (request.workspace_limit_bytes <= request.fixed_bytes) return 1;
    const std::size_t fits = (request.workspace_limit_bytes - request.fixed_bytes) / per_token;
    std::int64_t rows = std::min(static_cast<std::int64_t>(std::min<std::size_t>(fits, INT64_MAX)), request.enough_rows);
    if (request.n_tokens > request.enough_rows)
      rows = std::min(rows, std::max(request.min_efficient_rows, detail::ceil_div(request.n_tokens, call_share)));
    return std::max<std::int64_t>(1, rows);
  }
};

// Rows per chunk when `tokens` rows go in chunks of at most `most_rows`: the
// fewest such chunks, as even as rows allow, ceil(tokens / ceil(tokens /
// most_rows)). A short last chunk would cost a whole pass over dW's
// [V_local, H] for a few rows, and its GEMMs run slowly. Of several chunks,
// those of 8 rows or more are rounded up to a multiple of chunk_row_multiple
// within most_rows (the last one takes the rest): a BLAS runs its register
// blocks of 4-16 rows, and the odd tail of 1,024 tokens in chunks of 171 took
// 1.29-1.32 s against 1.23-1.27 s for 172 or 176 (lce_demo, OpenBLAS Zen,
// H 1,024, V 32,000, 2 threads), 367 rows of 1,100 about 1% more than 368.
// Nor does evening go under `least_rows` where most_rows allows them (the
// backend's min_efficient_chunk_rows: MKL's sgemm ran 1,024 tokens in six
// chunks of 171 slower than plain PyTorch, and in 192 x 5 + 64 faster).
// Neither changes the chunk count, ceil(tokens / most_rows), so evening is
// idempotent (an evened size gives itself back) and ranks that exchange
// evened sizes agree.
inline constexpr std::int64_t chunk_row_multiple = 8;

constexpr std::int64_t evened_chunk_rows(std::int64_t tokens, std::int64_t most_rows, std::int64_t least_rows = 1) {
  if (tokens <= 0 || most_rows <= 0) return most_rows;
  const std::int64_t chunks = detail::ceil_div(tokens, most_rows);
  std::int64_t rows = detail::ceil_div(tokens, chunks);
  if (chunks == 1 || rows < chunk_row_multiple) return rows;
  rows = std::min(detail::ceil_div(rows, chunk_row_multiple) * chunk_row_multiple, most_rows);
  return least_rows <= most_rows ? std::max(rows, least_rows) : rows;
}
static_assert(evened_chunk_rows(1100, 1024) == 552 && evened_chunk_rows(1024, 192) == 176 &&
              evened_chunk_rows(1024, 192, 192) == 192 && evened_chunk_rows(1024, 100, 192) == 96 &&
              evened_chunk_rows(1024, 173) == 173 && evened_chunk_rows(300, 512, 192) == 300 &&
              evened_chunk_rows(13, 4) == 4 && evened_chunk_rows(9, 4) == 3 && evened_chunk_rows(3, 4) == 3);

// A policy whose chunk is a compile-time constant (`P::tokens`).
template <class P>
concept fixed_chunk_policy = chunk_policy<P> && requires {
  { P::tokens } -> std::convertible_to<std::int64_t>;
};

static_assert(chunk_policy<budget_chunk> && fixed_chunk_policy<fixed_chunk<256>> && !fixed_chunk_policy<budget_chunk>);
static_assert(budget_chunk{}.tokens_per_chunk({.bytes_per_token = 100, .workspace_limit_bytes = 100'000}) == 1000 &&
              budget_chunk{}.tokens_per_chunk(
                  {.bytes_per_token = 100, .workspace_limit_bytes = 100'000, .enough_rows = 512}) == 512 &&
              budget_chunk{}.tokens_per_chunk({.bytes_per_token = 100, .workspace_limit_bytes = 10'000,
                                               .enough_rows = 512}) == 100);
// A call's share: 1/8 of 4,096 tokens is 512; of 2,048, 256; of 1,024, the 192 efficient rows;
// a call within the enough rows keeps them; without min_efficient_rows, no share.
static_assert([] {
  chunk_request r{.bytes_per_token = 100, .workspace_limit_bytes = std::size_t{1} << 30, .enough_rows = 512,
                  .min_efficient_rows = 192};
  const auto rows = [&](std::int64_t n) { return r.n_tokens = n, budget_chunk{}.tokens_per_chunk(r); };
  const bool shared = rows(65536) == 512 && rows(4096) == 512 && rows(2048) == 256 && rows(1024) == 192 &&
                      rows(513) == 192 && rows(512) == 512 && rows(300) == 512;
  r.min_efficient_rows = INT64_MAX;
  return shared && rows(1024) == 512;
}());

LCE_END_NAMESPACE
