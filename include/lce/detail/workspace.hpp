#pragma once
// How one buffer of scratch is carved up for a sweep, and how big it is.
//
// The same plan answers workspace_bytes(), feeds the chunk policy and lays
// out the buffer the sweep uses, so the reported size is the allocated size.
// Only the logit block scales with the vocabulary, times the chunk.

#include <lce/core/config.hpp>
#include <lce/core/row_math.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>

LCE_BEGIN_NAMESPACE
namespace detail {

inline constexpr std::size_t workspace_alignment = 64;

constexpr std::size_t align_up(std::size_t bytes) {
  return (bytes + workspace_alignment - 1) / workspace_alignment * workspace_alignment;
}

// What shapes the scratch, apart from the chunk.
struct workspace_shape {
  std::int64_t hidden = 0;
  std::int64_t vocab_local = 0;
  int ranks = 1;
  bool stage_hidden = false;              // hidden rows copied (widened or gathered) per chunk
  std::int64_t weight_block_elements = 0; // compute-type scratch to widen weight blocks
};

// Per-chunk arrays of one value per row, in compute type.
enum row_array : int { row_lse, row_logprobs, row_entropy, row_grad_logprobs, row_grad_entropy, row_expected, row_arrays };

template <class A>
struct workspace_plan {
  std::int64_t chunk = 1;
  std::int64_t logits_ld = 0;  // padded to whole cache lines so every row starts aligned
  std::size_t logits = 0, hidden_stage = 0, grad_hidden_stage = 0, weight_block = 0;
  std::size_t partials = 0, gathered = 0, rows = 0;
  std::size_t bytes = 0;

  static constexpr std::size_t parts = 7;

  static std::int64_t padded_ld(std::int64_t vocab_local) {
    constexpr auto per_line = static_cast<std::int64_t>(workspace_alignment / sizeof(A));
    return std::max<std::int64_t>(per_line, (vocab_local + per_line - 1) / per_line * per_line);
  }

  // Bytes a chunk row costs and bytes independent of the chunk, for the policy.
  static std::size_t bytes_per_token(const workspace_shape& shape) {
    const auto a = sizeof(A);
    const auto h = static_cast<std::size_t>(shape.hidden);
    const std::size_t partial_copies = shape.ranks > 1 ? 1 + static_cast<std::size_t>(shape.ranks) : 1;
    return static_cast<std::size_t>(padded_ld(shape.vocab_local)) * a + (shape.stage_hidden ? h * a : 0) + h * a +
           partial_copies * sizeof(row_partial<A>) + row_arrays * a;
  }
  static std::size_t fixed_bytes(const workspace_shape& shape) {
    return static_cast<std::size_t>(shape.weight_block_elements) * sizeof(A) + parts * workspace_alignment;
  }

  static workspace_plan make(const workspace_shape& shape, std::int64_t chunk) {
    workspace_plan plan;
    plan.chunk = chunk;
    plan.logits_ld = padded_ld(shape.vocab_local);
    const auto c = static_cast<std::size_t>(chunk);
    const auto h = static_cast<std::size_t>(shape.hidden);
    std::size_t offset = 0;
    const auto take = [&offset](std::size_t bytes) {
      const std::size_t at = offset;
      offset += align_up(bytes);
      return at;
    };
    plan.logits = take(c * static_cast<std::size_t>(plan.logits_ld) * sizeof(A));
    plan.hidden_stage = take(shape.stage_hidden ? c * h * sizeof(A) : 0);
    plan.grad_hidden_stage = take(c * h * sizeof(A));
    plan.weight_block = take(static_cast<std::size_t>(shape.weight_block_elements) * sizeof(A));
    plan.partials = take(c * sizeof(row_partial<A>));
    plan.gathered = take(shape.ranks > 1 ? c * static_cast<std::size_t>(shape.ranks) * sizeof(row_partial<A>) : 0);
    plan.rows = take(c * row_arrays * sizeof(A));
    plan.bytes = offset;
    return plan;
  }
};

}  // namespace detail
LCE_END_NAMESPACE
