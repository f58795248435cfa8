#pragma once
// What the chunk loop asks of a backend, and the concept that spells it out.
//
// The operator's sweep (detail/sweep.hpp) is written once; a backend supplies
// memory, the three GEMMs of a chunk, element conversions and the row passes.
// Row passes receive one of the small argument structs below, so that a new
// backend (CUDA) implements the same list with its own kernels around the
// shared row math of core/row_math.hpp.

#include <lce/core/config.hpp>
#include <lce/core/dtypes.hpp>
#include <lce/core/row_math.hpp>
#include <lce/core/views.hpp>

#include <concepts>
#include <cstddef>
#include <cstdint>

LCE_BEGIN_NAMESPACE

// Where a backend's (and a communicator's) buffers live.
struct host_memory {};
struct device_memory {};

// Statistics of each row of a logit block: its soft-cap applied in place, the
// partial (max, sums, target logit) over this rank's vocabulary.
template <class Compute, class Index>
struct statistics_args {
  matrix_view<Compute> logits;           // [rows, vocab_local]
  vector_view<const Index> targets;    // [rows], global ids
  std::int64_t vocab_start = 0;
  std::int64_t ignore_index = -100;
  detail::soft_cap_map<Compute> soft_cap;  // raw logits in; capped and tempered out (disabled: none)
  bool with_entropy = false;       // also sum exp(z - max)(z - max)
  bool keep_exp = false;           // overwrite logits with exp(z - max) (no soft-cap only)
  detail::row_partial<Compute>* partials = nullptr;  // out [rows]
};

// Per-row results from merged partials; ignored rows give log-prob 0 and entropy 0.
template <class Compute, class Index>
struct finalize_args {
  const detail::row_partial<Compute>* partials = nullptr;  // [rows]
  vector_view<const Index> targets;
  std::int64_t ignore_index = -100;
  Compute* logprobs = nullptr;  // out [rows]
  Compute* lse = nullptr;       // out [rows]
  Compute* entropy = nullptr;   // out [rows]
};

// Turns a logit block into dL/dlogits in place. Rows whose target is ignored
// become zero. With `exp_row_max` set, the block already holds exp(z - max)
// from a keep_exp statistics pass, and only a per-row scale is left to do.
template <class Compute, class Index>
struct gradient_args {
  matrix_view<Compute> logits;             // [rows, vocab_local], soft-capped if soft_cap is enabled
  vector_view<const Index> targets;
  std::int64_t vocab_start = 0;
  std::int64_t ignore_index = -100;
  detail::soft_cap_map<Compute> soft_cap;
  const Compute* lse = nullptr;            // [rows]
  const Compute* grad_logprobs = nullptr;  // [rows]
  const Compute* grad_entropy = nullptr;        // [rows] or null
  const Compute* mean_centred_logit = nullptr;  // [rows] E_p[z] - lse; needed with grad_entropy
  const detail::row_partial<Compute>* exp_row_max = nullptr;  // [rows] or null: see above
};

// sum_v p (z - lse) over this rank's vocabulary, p = exp(z - lse): its
// share of E_p[z] - lse (= -entropy), which the entropy gradient needs.
template <class Compute, class Index>
struct mean_centred_logit_args {
  matrix_view<const Compute> logits;     // soft-capped if a soft-cap is set
  vector_view<const Index> targets;    // rows whose target is ignored give 0
  std::int64_t ignore_index = -100;
  const Compute* lse = nullptr;
  Compute* out = nullptr;
};

// The contract of a backend, checked on fp32 and a 2-byte storage type.
template <class B>
concept backend =
    std::movable<B> && requires { typename B::memory_space; } &&
    requires(B& b, std::size_t bytes, void* pointer, matrix_view<const float> cmat, matrix_view<float> mat,
             matrix_view<const bfloat16> wmat, matrix_view<bfloat16> out_half, vector_view<const double> cvec,
             vector_view<float> vec, statistics_args<float, std::int64_t> statistics,
             finalize_args<float, std::int32_t> finalize, gradient_args<float, std::int64_t> gradient,
             mean_centred_logit_args<float, std::int32_t> mean_centred, const detail::row_partial<float>* gathered, detail::row_partial<float>* merged,
             std::int64_t count, int ranks, float alpha) {
      // Workspace: 64-byte aligned, allocated before a sweep, never inside it.
      { b.allocate(bytes) } -> std::same_as<void*>;
      b.deallocate(pointer, bytes);
      // Scratch elements of fp32 the GEMMs need to widen a 2-byte weight, for a hidden size and a vocabulary shard.
      { b.template weight_block_elements<bfloat16>(count, count) } -> std::convertible_to<std::int64_t>;
      // logits = alpha x w^T;  dx = alpha dz w;  dw += alpha dz^T x
      b.logits(cmat, wmat, alpha, mat, pointer);
      b.grad_hidden(cmat, wmat, alpha, mat, pointer);
      b.grad_weight(cmat, cmat, alpha, mat);
      // Element conversions and accumulations between storage and compute types.
      b.copy(cmat, out_half);
      b.copy(cvec, vec);
      b.add(cmat, out_half);
      b.fill_zero(mat);
      // Row passes.
      b.soft_cap(mat, detail::soft_cap_map<float>{});
      b.row_statistics(statistics);
      b.merge_partials(gathered, ranks, count, merged);
      b.finalize_rows(finalize, count);
      b.logit_gradients(gradient);
      b.mean_centred_logits(mean_centred);
    };

LCE_END_NAMESPACE
