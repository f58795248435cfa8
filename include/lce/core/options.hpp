#pragma once
// Run-time settings of the operator (see API.md).

#include <lce/core/config.hpp>

#include <cstddef>
#include <cstdint>

LCE_BEGIN_NAMESPACE

struct options {
  std::int64_t vocab_start = 0;        // global id of row 0 of this rank's weight shard
  std::int64_t ignore_index = -100;    // such targets: logprob 0, entropy 0, no gradient
  float temperature = 1.0f;            // logits divided by it, after the soft-cap; must be > 0
  float softcap = 0.0f;                // > 0: s -> softcap * tanh(s / softcap) on the raw logit s = x.w
  bool sequence_parallel = false;      // hidden rows sharded across the communicator
  std::int64_t chunk_tokens = 0;       // 0: chosen by the chunk policy
  std::size_t workspace_limit_bytes = std::size_t{256} << 20;
  // false: grad_weight and grad_bias accumulate (+=); true: a call overwrites them with its own
  // gradients, neither reading nor keeping what they held (no zeroing beforehand)
  bool overwrite_weight_gradients = false;
  // The most a forward_backward may hold to compute each logit once (three GEMMs, not up to
  // four), as a share of its [N, V_local] logits in the compute type, within
  // workspace_limit_bytes: on one rank with overwrite_weight_gradients and a 2-byte
  // grad_weight, the token order's fp32 dW sum (half of it in grad_weight's storage) and its
  // chunks. In [0, 1]; 0: the budget's plan as it is (see API.md)
  float max_logits_share = 0.1f;
};

LCE_END_NAMESPACE
