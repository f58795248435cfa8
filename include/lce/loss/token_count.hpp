#pragma once
// Token counts for normalising losses.
//
// Under context (or data) parallelism each rank holds a slice of the tokens
// with targets already shifted; the operator needs nothing for that, but a
// mean loss must divide by the number of counted tokens over the whole
// group, not by the local count.

#include <lce/comm/communicator.hpp>
#include <lce/core/config.hpp>
#include <lce/core/dtypes.hpp>
#include <lce/core/views.hpp>

#include <cstdint>
#include <vector>

LCE_BEGIN_NAMESPACE

// Targets that are not ignore_index (host memory).
template <vector_like Targets>
std::int64_t count_tokens(const Targets& targets, std::int64_t ignore_index = -100) {
  static_assert(target_id_type<value_of<Targets>>, "targets: element type must be std::int32_t or std::int64_t");
  const auto view = detail::to_vector_view(targets, "targets");
  std::int64_t count = 0;
  for (std::int64_t i = 0; i < view.size; ++i) count += static_cast<std::int64_t>(view.data[i]) != ignore_index;
  return count;
}

// The sum of every rank's local_count (exact; a host-side exchange).
template <communicator Comm>
std::int64_t global_token_count(const Comm& comm, std::int64_t local_count) {
  std::vector<std::int64_t> counts(static_cast<std::size_t>(comm.size()));
  comm.all_gather_host(&local_count, counts.data(), 1);
  std::int64_t total = 0;
  for (const std::int64_t count : counts) total += count;
  return total;
}

template <communicator Comm, vector_like Targets>
std::int64_t global_token_count(const Comm& comm, const Targets& targets, std::int64_t ignore_index = -100) {
  return global_token_count(comm, count_tokens(targets, ignore_index));
}

LCE_END_NAMESPACE
