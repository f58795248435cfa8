#pragma once
// lce: log-probabilities, entropies and their gradients from hidden states,
// without materialising the [tokens, vocab] logits.
//
// This umbrella brings the core, the CPU (BLAS) backend and the one-rank
// communicator. MPI, NCCL and CUDA live in their own headers:
//   <lce/comm/mpi.hpp>   <lce/comm/nccl.cuh>   <lce/cuda.cuh>

#include <lce/chunked_hidden_to_logprobs.hpp>
#include <lce/comm/communicator.hpp>
#include <lce/comm/single.hpp>
#include <lce/core/backend.hpp>
#include <lce/core/chunking.hpp>
#include <lce/core/dtypes.hpp>
#include <lce/core/error.hpp>
#include <lce/core/options.hpp>
#include <lce/core/row_terms.hpp>
#include <lce/core/views.hpp>
#include <lce/host/host.hpp>
#include <lce/loss/token_count.hpp>
