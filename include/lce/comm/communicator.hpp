#pragma once
// The communicator concept: what the operator needs from a group of ranks.
//
// Each rank holds a shard of the vocabulary (and, under sequence
// parallelism, a shard of the token rows). The data collectives act on
// buffers in `memory_space` (host memory for MPI and threads, device memory
// for NCCL; `void` for a single rank, which never touches them). Two control
// collectives take host values: `all_agree`, so that every rank fails
// together on bad input instead of leaving the others waiting in a
// collective, and `all_gather_host`, to exchange shard bounds.

#include <lce/core/config.hpp>

#include <concepts>
#include <cstddef>
#include <cstdint>

LCE_BEGIN_NAMESPACE

template <class C>
concept communicator =
    std::copy_constructible<C> && requires { typename C::memory_space; } &&
    requires(const C& comm, const void* send, void* receive, std::size_t bytes, float* f, double* d,
             const float* cf, const double* cd, std::int64_t count, bool flag, const std::int64_t* host_send,
             std::int64_t* host_receive) {
      { comm.rank() } -> std::convertible_to<int>;
      { comm.size() } -> std::convertible_to<int>;
      // receive[size() * bytes] = every rank's send[bytes], in rank order
      comm.all_gather_bytes(send, receive, bytes);
      // data[count] = sum over ranks, in place
      comm.all_reduce_sum(f, count);
      comm.all_reduce_sum(d, count);
      // receive[count] = sum over ranks of send[rank() * count .. + count]
      comm.reduce_scatter_sum(cf, f, count);
      comm.reduce_scatter_sum(cd, d, count);
      // true when every rank passed true (host values)
      { comm.all_agree(flag) } -> std::same_as<bool>;
      // host_receive[size() * count] = every rank's host_send[count], in rank order (host values)
      comm.all_gather_host(host_send, host_receive, count);
    };

LCE_END_NAMESPACE
