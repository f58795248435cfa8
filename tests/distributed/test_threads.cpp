// Distributed tests on lce::comm::threads: P ranks as threads of one process.
//
// Every body in distributed_cases.hpp runs on every rank and compares the
// rank's results with a single-rank run of the same operation (computed on
// each rank). A rank stuck in a collective is reported by run_on_threads and
// ends the process (a hang becomes a failure).
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include "distributed_cases.hpp"
#include "hardening_cases.hpp"
#include "target_set_cases.hpp"
#include "bias_cases.hpp"

#include <lce/comm/threads.hpp>

static_assert(lce::communicator<lce_dist::counting<lce::comm::threads>>);

namespace {
constexpr int max_ranks = 4;
}

TEST_CASE_TEMPLATE("threads: vocabulary and sequence parallel results equal a single-rank run", T, float, double,
                   lce::bfloat16, lce::float16) {
  for (int ranks = 1; ranks <= max_ranks; ++ranks) {
    CAPTURE(ranks);
    lce_dist::run_on_threads(ranks, [](lce::comm::threads comm) { lce_dist::check_all_configurations<T>(comm); });
  }
}

TEST_CASE_TEMPLATE("threads: target sets [N, K] over vocabulary and sequence parallel ranks equal a single-rank run", T,
                   float, double, lce::bfloat16) {
  for (int ranks = 1; ranks <= max_ranks; ++ranks) {
    CAPTURE(ranks);
    lce_dist::run_on_threads(ranks, [](lce::comm::threads comm) { lce_dist::check_target_sets<T>(comm); });
  }
}

TEST_CASE_TEMPLATE("threads: an LM head with a bias over vocabulary and sequence parallel ranks equals a single-rank run",
                   T, float, double, lce::bfloat16) {
  for (int ranks = 1; ranks <= max_ranks; ++ranks) {
    CAPTURE(ranks);
    lce_dist::run_on_threads(ranks, [](lce::comm::threads comm) { lce_dist::check_bias<T>(comm); });
  }
}

TEST_CASE("threads: ranks passing target sets of different K raise lce::error together") {
  for (int ranks = 2; ranks <= max_ranks; ++ranks) {
    CAPTURE(ranks);
    lce_dist::run_on_threads(ranks, [](lce::comm::threads comm) { lce_dist::check_target_set_disagreement(comm); });
  }
}

TEST_CASE("threads: bad input on one rank raises lce::error on every rank, before any output is written") {
  for (int ranks = 1; ranks <= max_ranks; ++ranks) {
    CAPTURE(ranks);
    lce_dist::run_on_threads(ranks, [](lce::comm::threads comm) { lce_dist::check_bad_input_everywhere(comm); },
                             std::chrono::seconds(60));
  }
}

TEST_CASE("threads: a shard that changes size is re-checked on every rank") {
  for (int ranks = 1; ranks <= max_ranks; ++ranks) {
    CAPTURE(ranks);
    lce_dist::run_on_threads(ranks, [](lce::comm::threads comm) { lce_dist::check_shard_change(comm); });
  }
}

TEST_CASE_TEMPLATE("threads: context parallel slices equal a one-rank run; global_token_count", T, float, double) {
  for (int ranks : {3, 2, 4, 1}) {
    CAPTURE(ranks);
    lce_dist::run_on_threads(ranks, [](lce::comm::threads comm) { lce_dist::check_context_parallel<T>(comm); });
  }
}

TEST_CASE("threads: the counting communicator counts what it forwards") {
  lce_dist::run_on_threads(3, [](lce::comm::threads comm) {
    lce_dist::collective_counts counts;
    const lce_dist::counting<lce::comm::threads> c(comm, &counts);
    const lce_dist::counting<lce::comm::threads> copy = c;  // copies share the counts
    float f[5] = {1, 2, 3, 4, 5};
    double d[3] = {1, 1, 1};
    copy.all_reduce_sum(f, 5);
    c.all_reduce_sum(d, 3);
    float scattered[2];
    const float send[6] = {1, 1, 2, 2, 3, 3};
    c.reduce_scatter_sum(send, scattered, 2);
    char bytes[3];
    const char mine = static_cast<char>('a' + comm.rank());
    c.all_gather_bytes(&mine, bytes, 1);
    std::int64_t host[6];
    const std::int64_t host_mine[2] = {comm.rank(), 7};
    c.all_gather_host(host_mine, host, 2);
    const bool agreed = c.all_agree(comm.rank() != 1);
    CHECK(f[4] == 15.0f);
    CHECK(d[0] == 3.0);
    CHECK(scattered[0] == 3.0f * static_cast<float>(comm.rank() + 1));
    CHECK(bytes[2] == 'c');
    CHECK(host[4] == 2);
    CHECK(!agreed);
    lce_dist::collective_counts want;
    want.all_reduce_sum = 2;
    want.reduced_bytes = 5 * 4 + 3 * 8;
    want.reduce_scatter_sum = 1;
    want.scattered_bytes = 2 * 4;
    want.all_gather_bytes = 1;
    want.gathered_bytes = 1;
    want.all_gather_host = 1;
    want.host_values = 2;
    want.all_agree = 1;
    CHECK_MESSAGE(counts == want, counts.str() << " vs " << want.str());
  });
}

// Run as their own ctest entry (lce_thread_tests_agreement): a library that
// gets these wrong hangs (caught by the watchdog) instead of failing a check.
TEST_CASE_TEMPLATE("agreement: the default chunk policy with uneven shards (threads)", T, float, double) {
  for (int ranks = 2; ranks <= max_ranks; ++ranks) {
    CAPTURE(ranks);
    lce_dist::run_on_threads(ranks, [](lce::comm::threads comm) {
      lce_dist::check_budget_chunk_uneven_shards<T>(comm);
    }, std::chrono::seconds(30));
  }
}

TEST_CASE("agreement: ranks that disagree on N or H raise lce::error on every rank (threads)") {
  for (int ranks = 2; ranks <= max_ranks; ++ranks) {
    CAPTURE(ranks);
    lce_dist::run_on_threads(ranks, [](lce::comm::threads comm) { lce_dist::check_ranks_disagree(comm); },
                             std::chrono::seconds(30));
  }
}

TEST_CASE("agreement: ranks with other options or targets raise lce::error on every rank (threads)") {
  for (int ranks = 2; ranks <= max_ranks; ++ranks) {
    CAPTURE(ranks);
    lce_dist::run_on_threads(ranks, [](lce::comm::threads comm) { lce_hard::check_options_disagree(comm); },
                             std::chrono::seconds(30));
  }
}

TEST_CASE("agreement: element types, a soft-cap of -0 and colliding targets, told by the exchange (threads)") {
  for (int ranks = 2; ranks <= max_ranks; ++ranks) {
    CAPTURE(ranks);
    lce_dist::run_on_threads(ranks, [](lce::comm::threads comm) { lce_hard::check_what_only_the_exchange_tells(comm); },
                             std::chrono::seconds(30));
  }
}

TEST_CASE_TEMPLATE("agreement: ranks with other budgets, chunks and threads agree on one chunk (threads)", T, float,
                   lce::bfloat16) {
  for (int ranks = 1; ranks <= 3; ++ranks) {
    CAPTURE(ranks);
    lce_dist::run_on_threads(ranks, [](lce::comm::threads comm) { lce_hard::check_resources_may_differ<T>(comm); },
                             std::chrono::seconds(60));
  }
}

TEST_CASE("agreement: a failure on one rank before the exchange raises on every rank (threads)") {
  for (int ranks = 1; ranks <= 3; ++ranks) {
    CAPTURE(ranks);
    lce_dist::run_on_threads(ranks, [](lce::comm::threads comm) { lce_hard::check_failure_on_one_rank(comm); },
                             std::chrono::seconds(30));
  }
}

TEST_CASE("agreement: chunks shrink to the communicator's message limit (threads)") {
  lce_dist::run_on_threads(2, [](lce::comm::threads comm) { lce_hard::check_message_limit(comm); },
                           std::chrono::seconds(30));
}

TEST_CASE("agreement: a collective failing mid-sweep names its chunk; earlier chunks are written (threads)") {
  for (int ranks = 2; ranks <= 3; ++ranks) {
    CAPTURE(ranks);
    lce_dist::run_on_threads(ranks, [](lce::comm::threads comm) { lce_hard::check_mid_sweep_failure(comm); },
                             std::chrono::seconds(30));
  }
}
