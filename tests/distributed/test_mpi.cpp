// Distributed tests on lce::comm::mpi: the bodies of distributed_cases.hpp on
// MPI_COMM_WORLD, whatever its size (ctest runs 1, 2, 3 and 4 ranks).
//
// Every rank runs doctest and every test case, so every rank issues the same
// collectives. Rank 0 prints the usual report; the other ranks print only
// their failures. The exit status is the same on every rank: non-zero when
// any rank failed.
#define DOCTEST_CONFIG_IMPLEMENT
#include "distributed_cases.hpp"
#include "hardening_cases.hpp"
#include "target_set_cases.hpp"

#include <lce/comm/mpi.hpp>

#include <mpi.h>

#include <cstdio>

static_assert(lce::communicator<lce_dist::counting<lce::comm::mpi>>);

namespace {
lce::comm::mpi world() { return lce::comm::mpi{MPI_COMM_WORLD}; }
}  // namespace

TEST_CASE_TEMPLATE("mpi: vocabulary and sequence parallel results equal a single-rank run", T, float, double,
                   lce::bfloat16, lce::float16) {
  lce_dist::check_all_configurations<T>(world());
}

TEST_CASE_TEMPLATE("mpi: target sets [N, K] over vocabulary and sequence parallel ranks equal a single-rank run", T,
                   float, lce::bfloat16) {
  lce_dist::check_target_sets<T>(world());
}

TEST_CASE("mpi: ranks passing target sets of different K raise lce::error together") {
  lce_dist::check_target_set_disagreement(world());
}

TEST_CASE("mpi: bad input on one rank raises lce::error on every rank, before any output is written") {
  lce_dist::check_bad_input_everywhere(world());
}

TEST_CASE("mpi: a shard that changes size is re-checked on every rank") { lce_dist::check_shard_change(world()); }

TEST_CASE_TEMPLATE("mpi: context parallel slices equal a one-rank run; global_token_count", T, float, double) {
  lce_dist::check_context_parallel<T>(world());
}

// Run as their own ctest entries (lce_mpi_tests_agreement_np*): a library
// that gets these wrong aborts the job (MPI_ERR_TRUNCATE) or hangs.
TEST_CASE_TEMPLATE("agreement: the default chunk policy with uneven shards (mpi)", T, float, double) {
  lce_dist::check_budget_chunk_uneven_shards<T>(world());
}

TEST_CASE("agreement: ranks that disagree on N or H raise lce::error on every rank (mpi)") {
  lce_dist::check_ranks_disagree(world());
}

TEST_CASE("agreement: ranks with other options or targets raise lce::error on every rank (mpi)") {
  lce_hard::check_options_disagree(world());
}

TEST_CASE("agreement: element types, a soft-cap of -0 and colliding targets, told by the exchange (mpi)") {
  lce_hard::check_what_only_the_exchange_tells(world());
}

TEST_CASE_TEMPLATE("agreement: ranks with other budgets, chunks and threads agree on one chunk (mpi)", T, float,
                   lce::bfloat16) {
  lce_hard::check_resources_may_differ<T>(world());
}

TEST_CASE("agreement: a failure on one rank before the exchange raises on every rank (mpi)") {
  lce_hard::check_failure_on_one_rank(world());
}

TEST_CASE("agreement: chunks shrink to the communicator's message limit (mpi)") {
  lce_hard::check_message_limit(world());
}

TEST_CASE("agreement: a collective failing mid-sweep names its chunk; earlier chunks are written (mpi)") {
  lce_hard::check_mid_sweep_failure(world());
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);

  doctest::Context context;
  context.applyCommandLine(argc, argv);
  if (rank != 0) context.setOption("minimal", true);  // only failures from the other ranks
  const int result = context.run();

  int worst = result;
  MPI_Allreduce(&result, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0 && !context.shouldExit())
    std::printf("lce_mpi_tests: %d rank%s, %s\n", ranks, ranks == 1 ? "" : "s",
                worst == 0 ? "every rank passed" : "a rank FAILED (see its report above)");
  MPI_Finalize();
  return worst;
}
