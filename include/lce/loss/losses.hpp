#pragma once
// Training losses over packed sequences, computed on the operator's per-token
// outputs (logp, entropy; distillation: the K log-probs of target sets): each returns the loss value and dL/dlogp (and
// dL/dentropy) to feed op.backward / op.forward_backward. Host and device from
// one source (Thrust execution policies); needs CCCL (Thrust) on the include path.

#include <lce/loss/distillation.hpp>
#include <lce/loss/dpo.hpp>
#include <lce/loss/packed.hpp>
#include <lce/loss/policy_gradient.hpp>
#include <lce/loss/sft.hpp>
#include <lce/loss/token_count.hpp>
