#pragma once
// lce on NVIDIA GPUs (nvcc only; CMake target lce::cuda): the operator of
// <lce/lce.hpp> with lce::cuda_backend, whose views hold device pointers.
//
//   using op_t = lce::ChunkedHiddenToLogprobs<lce::comm::single, lce::bfloat16,
//                                             lce::budget_chunk, lce::cuda_backend>;
//   op_t op{lce::comm::single{}, opts, lce::cuda_backend{stream}};
//
// With several GPUs, lce::comm::nccl{comm, stream} (<lce/comm/nccl.cuh>) on
// the backend's stream; a communicator over host memory (mpi, threads) does
// not compile with this backend.

#include <lce/cuda/backend.cuh>
#include <lce/lce.hpp>
