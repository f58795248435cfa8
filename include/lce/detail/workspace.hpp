#pragma once
// How one buffer of scratch is carved up for a sweep, and how big it is.
//
// The same plan answers workspace_bytes(), feeds the chunk policy and lays
// out the buffer the sweep uses, so the reported size is the allocated size.
// Only the logit block scales with the vocabulary, times the chunk.

#include <lce/core/config.hpp>
#include <lce/core/error.hpp>
#include <lce/core/row_math.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>

LCE_BEGIN_NAMESPACE
namespace detail {

inline constexpr std::size_t workspace_alignment = 64;

// A byte count that remembers whether it ever wrapped: sizes come from the
// caller's shapes, and workspace_bytes(1, 2^32, 2^32) must say "too big",
// not a wrapped small number.
struct checked_size {
  std::size_t value = 0;
  bool overflow = false;

  checked_size() = default;
  constexpr checked_size(std::size_t v) : value(v) {}  // NOLINT: plain sizes mix in freely
  static constexpr checked_size of(std::int64_t v) {
    checked_size size;
    size.overflow = v < 0;
    size.value = v < 0 ? 0 : static_cast<std::size_t>(v);
    return size;
  }
  friend constexpr checked_size operator+(checked_size a, checked_size b) {
    checked_size sum;
    sum.overflow = a.overflow || b.overflow || __builtin_add_overflow(a.value, b.value, &sum.value);
    return sum;
  }
  friend constexpr checked_size operator*(checked_size a, checked_size b) {
    checked_size product;
    product.overflow = a.overflow || b.overflow || __builtin_mul_overflow(a.value, b.value, &product.value);
    return product;
  }
};

constexpr checked_size align_up(checked_size bytes) {
  checked_size padded = bytes + checked_size(workspace_alignment - 1);
  padded.value = padded.value / workspace_alignment * workspace_alignment;
  return padded;
}

// What shapes the scratch, apart from the chunk.
struct workspace_shape {
  std::int64_t hidden = 0;
  std::int64_t vocab_local = 0;
  int ranks = 1;
  bool widen_hidden = false;              // T is not the GEMMs' operand type: hidden rows are widened per chunk
  std::size_t operand_bytes = 4;          // sizeof the GEMMs' operand type (the widened hidden rows)
  std::size_t gradient_operand_bytes = 0; // > 0: dz is also written in the GEMMs' operand type (not the compute type)
  bool sequence_parallel = false;         // hidden rows are gathered per chunk, dX reduce-scattered
  std::size_t storage_bytes = 4;          // sizeof(T)
  std::int64_t weight_block_elements = 0; // compute-type scratch to widen weight blocks
  std::int64_t set_size = 0;              // K ids per row (a target-set call), else 0
  std::int64_t block_rows = 0;            // > 0: the logit block holds this many of the chunk's rows at a
                                          // time (the vocabulary order's token slices), else all of them
  bool stages_grad_hidden = true;         // false: a sweep that writes no dX (the engine's tail sweep)
};

// Per-chunk arrays of one value per row, in compute type.
enum row_array : int {
  row_lse,
  row_logprobs,
  row_entropy,
  row_grad_logprobs,
  row_grad_entropy,
  row_grad_lse,
  row_grad_mean_logit,
  row_mean_centred,
  row_mean_logit,
  row_lse_squared,
  row_arrays
};

template <class Compute>
struct workspace_plan {
  std::int64_t chunk = 1;        // rows of the logit block
  std::int64_t local_chunk = 1;  // of which this rank's own hidden rows (sequence parallel), else = chunk
  std::int64_t logits_ld = 0;    // padded to whole cache lines so every row starts aligned
  std::int64_t block_rows = 1;   // rows the logit block (and dz's own block) holds: chunk, or fewer (block_rows)
  std::size_t logits = 0, hidden_stage = 0, hidden_gather = 0, hidden_send = 0;
  std::size_t grad_hidden_stage = 0, grad_hidden_local = 0, weight_block = 0;
  std::size_t partials = 0, gathered = 0, rows = 0, targets = 0, gradient_operand = 0;
  std::size_t set_ids = 0, set_logprobs = 0, set_grads = 0;
  std::size_t bytes = 0;

  static constexpr std::size_t parts = 15;

  // What one rank contributes to a chunk's collective, in partials: `rows`
  // partials, then (target sets) the rows' K logits at the set's ids, padded
  // to whole partials so that every rank's share starts on one.
  static checked_size exchange_record(std::int64_t rows, std::int64_t set_size) {
    const checked_size values = checked_size::of(rows) * checked_size::of(set_size) * sizeof(Compute);
    constexpr std::size_t partial = sizeof(row_partial<Compute>);
    checked_size padded = values + checked_size(partial - 1);
    padded.value /= partial;
    return checked_size::of(rows) + padded;
  }

  // vocab_local rounded up to whole cache lines; INT64_MAX where that overflows.
  static constexpr std::int64_t padded_ld(std::int64_t vocab_local) {
    constexpr auto per_line = static_cast<std::int64_t>(workspace_alignment / sizeof(Compute));
    if (vocab_local > INT64_MAX - per_line) return INT64_MAX;
    return std::max<std::int64_t>(per_line, (vocab_local + per_line - 1) / per_line * per_line);
  }

  // Bytes a row of the logit block costs (an upper bound), for the chunk policy.
  static checked_size bytes_per_token(const workspace_shape& shape) {
    const checked_size a = sizeof(Compute);
    const auto h = checked_size::of(shape.hidden);
    const auto ranks = static_cast<std::size_t>(shape.ranks);
    checked_size bytes = checked_size::of(padded_ld(shape.vocab_local)) * a + h * a + row_arrays * a +
                         checked_size(ranks > 1 ? 1 + ranks : 1) * sizeof(row_partial<Compute>);
    if (shape.widen_hidden) bytes = bytes + h * shape.operand_bytes;
    bytes = bytes + checked_size::of(padded_ld(shape.vocab_local)) * shape.gradient_operand_bytes;
    if (shape.sequence_parallel) bytes = bytes + h * (2 * shape.storage_bytes) + h * a + sizeof(std::int64_t);
    if (shape.set_size > 0) {
      // The K logits in this rank's and every rank's exchange record, the K
      // log-probs and gradients, the stand-in target, the gathered ids.
      const auto k = checked_size::of(shape.set_size);
      bytes = bytes + k * a * (ranks > 1 ? 1 + ranks : 1) + k * a * 2 + sizeof(std::int64_t);
      if (shape.sequence_parallel) bytes = bytes + k * sizeof(std::int64_t);
    }
    return bytes;
  }
  static checked_size fixed_bytes(const workspace_shape& shape) {
    const std::size_t records = shape.ranks > 1 ? 1 + static_cast<std::size_t>(shape.ranks) : 1;
    const checked_size record_padding = shape.set_size > 0 ? records * sizeof(row_partial<Compute>) : 0;
    return checked_size::of(shape.weight_block_elements) * sizeof(Compute) + parts * workspace_alignment +
           record_padding;
  }

  // `local_chunk` rows of hidden per rank; the logit block has ranks times as
  // many under sequence parallelism. Raises lce::error if the bytes overflow.
  static workspace_plan make(const workspace_shape& shape, std::int64_t local_chunk) {
    workspace_plan plan;
    const std::int64_t gathered_rows = shape.sequence_parallel ? local_chunk * shape.ranks : local_chunk;
    plan.chunk = gathered_rows;
    plan.local_chunk = local_chunk;
    plan.logits_ld = padded_ld(shape.vocab_local);
    plan.block_rows = shape.block_rows > 0 ? std::min(shape.block_rows, gathered_rows) : gathered_rows;
    const auto c = checked_size::of(gathered_rows);
    const auto block = checked_size::of(plan.block_rows);
    const auto c_local = checked_size::of(local_chunk);
    const auto h = checked_size::of(shape.hidden);
    const checked_size a = sizeof(Compute);
    const auto ranks = static_cast<std::size_t>(shape.ranks);
    const bool sp = shape.sequence_parallel;
    checked_size offset;
    const auto take = [&offset](checked_size bytes) {
      const std::size_t at = offset.value;
      offset = offset + align_up(bytes);
      return at;
    };
    const checked_size none;
    plan.logits = take(block * checked_size::of(plan.logits_ld) * a);
    plan.hidden_stage = take(shape.widen_hidden ? c * h * shape.operand_bytes : none);
    plan.hidden_gather = take(sp ? c * h * shape.storage_bytes : none);
    plan.hidden_send = take(sp ? c_local * h * shape.storage_bytes : none);
    plan.grad_hidden_stage = take(shape.stages_grad_hidden ? c * h * a : none);
    plan.grad_hidden_local = take(sp ? c_local * h * a : none);
    plan.weight_block = take(checked_size::of(shape.weight_block_elements) * a);
    const bool sets = shape.set_size > 0;
    const auto k = checked_size::of(shape.set_size);
    const checked_size record = exchange_record(gathered_rows, shape.set_size);
    plan.partials = take(record * sizeof(row_partial<Compute>));
    plan.gathered = take(ranks > 1 ? record * ranks * sizeof(row_partial<Compute>) : none);
    plan.rows = take(c * row_arrays * a);
    // Sequence parallel: the chunk's targets gathered from the ranks' segments. A
    // target-set call keeps each row's stand-in target there.
    plan.targets = take(sp || sets ? c * sizeof(std::int64_t) : none);
    plan.gradient_operand = take(block * checked_size::of(plan.logits_ld) * shape.gradient_operand_bytes);
    plan.set_ids = take(sets && sp ? c * k * sizeof(std::int64_t) : none);
    plan.set_logprobs = take(c * k * a);
    plan.set_grads = take(c * k * a);
    expects(!offset.overflow, "workspace: a chunk of ", gathered_rows, " rows at hidden size ", shape.hidden,
            " and vocabulary shard ", shape.vocab_local, " needs more bytes than size_t holds");
    plan.bytes = offset.value;
    return plan;
  }
};

}  // namespace detail
LCE_END_NAMESPACE
