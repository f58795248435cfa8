#pragma once
// lce::comm::mpi: an MPI communicator (CMake target lce::mpi).
//
//   lce::comm::mpi comm{MPI_COMM_WORLD};
//
// The operator neither owns nor frees the MPI_Comm. Buffers are host memory.
// An MPI failure raises lce::error (under MPI_ERRORS_RETURN; with MPI's
// default handler the job aborts first).

#include <lce/comm/communicator.hpp>
#include <lce/core/backend.hpp>
#include <lce/core/config.hpp>
#include <lce/core/error.hpp>

#include <mpi.h>

#include <climits>
#include <cstddef>
#include <cstdint>
#include <type_traits>

LCE_BEGIN_NAMESPACE
namespace comm {

class mpi {
 public:
  using memory_space = host_memory;

  explicit mpi(MPI_Comm comm) : comm_(comm) {
    check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
    check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
  }

  int rank() const { return rank_; }
  int size() const { return size_; }
  MPI_Comm handle() const { return comm_; }

  // MPI counts in int: the operator sizes its per-chunk messages below this.
  static constexpr std::size_t max_message_bytes() { return INT_MAX; }

  void all_gather_bytes(const void* send, void* receive, std::size_t bytes) const {
    check(MPI_Allgather(send, count_of(bytes), MPI_BYTE, receive, count_of(bytes), MPI_BYTE, comm_),
          "MPI_Allgather");
  }

  template <class A>
  void all_reduce_sum(A* data, std::int64_t count) const {
    check(MPI_Allreduce(MPI_IN_PLACE, data, count_of(count), type_of<A>(), MPI_SUM, comm_), "MPI_Allreduce");
  }

  template <class A>
  void reduce_scatter_sum(const A* send, A* receive, std::int64_t count) const {
    check(MPI_Reduce_scatter_block(send, receive, count_of(count), type_of<A>(), MPI_SUM, comm_),
          "MPI_Reduce_scatter_block");
  }

  void all_gather_host(const std::int64_t* send, std::int64_t* receive, std::int64_t count) const {
    check(MPI_Allgather(send, count_of(count), MPI_INT64_T, receive, count_of(count), MPI_INT64_T, comm_),
          "MPI_Allgather");
  }

  bool all_agree(bool flag) const {
    int all = flag ? 1 : 0;
    check(MPI_Allreduce(MPI_IN_PLACE, &all, 1, MPI_INT, MPI_LAND, comm_), "MPI_Allreduce");
    return all != 0;
  }

 private:
  template <class A>
  static MPI_Datatype type_of() {
    static_assert(std::is_same_v<A, float> || std::is_same_v<A, double>, "sums are over float or double");
    return std::is_same_v<A, float> ? MPI_FLOAT : MPI_DOUBLE;
  }

  template <class Count>
  static int count_of(Count count) {
    detail::expects(static_cast<std::uint64_t>(count) <= static_cast<std::uint64_t>(INT_MAX), "mpi: message of ",
                    count, " elements exceeds MPI's int count");
    return static_cast<int>(count);
  }

  static void check(int status, const char* call) {
    if (status == MPI_SUCCESS) return;
    char text[MPI_MAX_ERROR_STRING];
    int length = 0;
    MPI_Error_string(status, text, &length);
    detail::fail("mpi: ", call, " failed: ", text);
  }

  MPI_Comm comm_;
  int rank_ = 0;
  int size_ = 1;
};

static_assert(communicator<mpi>);

}  // namespace comm
LCE_END_NAMESPACE
