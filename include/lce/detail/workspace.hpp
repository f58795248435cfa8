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
  bool widen_hidden = false;              // T is not the compute type: hidden rows are widened per chunk
  bool sequence_parallel = false;         // hidden rows are gathered per chunk, dX reduce-scattered
  std::size_t storage_bytes = 4;          // sizeof(T)
  std::int64_t weight_block_elements = 0; // compute-type scratch to widen weight blocks
};

// Per-chunk arrays of one value per row, in compute type.
enum row_array : int { row_lse, row_logprobs, row_entropy, row_grad_logprobs, row_grad_entropy, row_mean_centred, row_arrays };

template <class A>
struct workspace_plan {
  std::int64_t chunk = 1;        // rows of the logit block
  std::int64_t local_chunk = 1;  // of which this rank's own hidden rows (sequence parallel), else = chunk
  std::int64_t logits_ld = 0;    // padded to whole cache lines so every row starts aligned
  std::size_t logits = 0, hidden_stage = 0, hidden_gather = 0, hidden_send = 0;
  std::size_t grad_hidden_stage = 0, grad_hidden_local = 0, weight_block = 0;
  std::size_t partials = 0, gathered = 0, rows = 0, targets = 0;
  std::size_t bytes = 0;

  static constexpr std::size_t parts = 11;

  static std::int64_t padded_ld(std::int64_t vocab_local) {
    constexpr auto per_line = static_cast<std::int64_t>(workspace_alignment / sizeof(A));
    return std::max<std::int64_t>(per_line, (vocab_local + per_line - 1) / per_line * per_line);
  }

  // Bytes a row of the logit block costs (an upper bound), for the chunk policy.
  static std::size_t bytes_per_token(const workspace_shape& shape) {
    const auto a = sizeof(A);
    const auto h = static_cast<std::size_t>(shape.hidden);
    const auto ranks = static_cast<std::size_t>(shape.ranks);
    std::size_t bytes = static_cast<std::size_t>(padded_ld(shape.vocab_local)) * a + h * a + row_arrays * a +
                        (ranks > 1 ? 1 + ranks : 1) * sizeof(row_partial<A>);
    if (shape.widen_hidden) bytes += h * a;
    if (shape.sequence_parallel) bytes += 2 * h * shape.storage_bytes + h * a + sizeof(std::int64_t);
    return bytes;
  }
  static std::size_t fixed_bytes(const workspace_shape& shape) {
    return static_cast<std::size_t>(shape.weight_block_elements) * sizeof(A) + parts * workspace_alignment;
  }

  // `local_chunk` rows of hidden per rank; the logit block has ranks times as
  // many under sequence parallelism.
  static workspace_plan make(const workspace_shape& shape, std::int64_t local_chunk) {
    workspace_plan plan;
    const std::int64_t gathered_rows = shape.sequence_parallel ? local_chunk * shape.ranks : local_chunk;
    plan.chunk = gathered_rows;
    plan.local_chunk = local_chunk;
    plan.logits_ld = padded_ld(shape.vocab_local);
    const auto c = static_cast<std::size_t>(gathered_rows);
    const auto c_local = static_cast<std::size_t>(local_chunk);
    const auto h = static_cast<std::size_t>(shape.hidden);
    const auto ranks = static_cast<std::size_t>(shape.ranks);
    const bool sp = shape.sequence_parallel;
    std::size_t offset = 0;
    const auto take = [&offset](std::size_t bytes) {
      const std::size_t at = offset;
      offset += align_up(bytes);
      return at;
    };
    plan.logits = take(c * static_cast<std::size_t>(plan.logits_ld) * sizeof(A));
    plan.hidden_stage = take(shape.widen_hidden ? c * h * sizeof(A) : 0);
    plan.hidden_gather = take(sp ? c * h * shape.storage_bytes : 0);
    plan.hidden_send = take(sp ? c_local * h * shape.storage_bytes : 0);
    plan.grad_hidden_stage = take(c * h * sizeof(A));
    plan.grad_hidden_local = take(sp ? c_local * h * sizeof(A) : 0);
    plan.weight_block = take(static_cast<std::size_t>(shape.weight_block_elements) * sizeof(A));
    plan.partials = take(c * sizeof(row_partial<A>));
    plan.gathered = take(ranks > 1 ? c * ranks * sizeof(row_partial<A>) : 0);
    plan.rows = take(c * row_arrays * sizeof(A));
    plan.targets = take(sp ? c * sizeof(std::int64_t) : 0);
    plan.bytes = offset;
    return plan;
  }
};

}  // namespace detail
LCE_END_NAMESPACE
