#pragma once
// Chunk policies: how many token rows go through the GEMMs at once.
//
// Bigger chunks make better GEMMs; the logit block of a chunk is the one
// buffer whose size grows with the vocabulary, so the chunk is what bounds
// memory. `options.chunk_tokens > 0` overrides any policy at run time.

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
};

template <class P>
concept chunk_policy = std::default_initializable<P> && requires(const P& policy, const chunk_request& request) {
  { policy.tokens_per_chunk(request) } -> std::convertible_to<std::int64_t>;
};

// A chunk fixed at compile time.
template <std::int64_t Tokens>
  requires(Tokens > 0)
struct fixed_chunk {
  static constexpr std::int64_t tokens = Tokens;
  constexpr std::int64_t tokens_per_chunk(const chunk_request&) const { return Tokens; }
};

// The default: the largest chunk whose workspace fits `workspace_limit_bytes`
// (at least one row, whatever the limit).
struct budget_chunk {
  constexpr std::int64_t tokens_per_chunk(const chunk_request& request) const {
    const std::size_t per_token = std::max<std::size_t>(request.bytes_per_token, 1);
    if (request.workspace_limit_bytes <= request.fixed_bytes) return 1;
    const std::size_t fits = (request.workspace_limit_bytes - request.fixed_bytes) / per_token;
    return std::max<std::int64_t>(1, static_cast<std::int64_t>(std::min<std::size_t>(fits, INT64_MAX)));
  }
};

static_assert(chunk_policy<budget_chunk> && chunk_policy<fixed_chunk<256>>);

LCE_END_NAMESPACE
