#pragma once
// The exchange of verdicts that precedes every lce_torch call on a group
// (register.cpp's operators, losses.cpp's losses, lce.agree_on_group).
//
// Every such exchange gathers the same record from each rank, {ok, kind, two
// values of the call's own}, so that a rank whose Python-side checks reject its
// arguments before it reaches an operator (lce.agree_on_group with ok false)
// still meets the other ranks' exchange, whichever call they are in, and every
// rank raises. The kind names the call: ranks in different calls (a training
// loop out of step across the group) raise saying so, rather than reading one
// call's values as the other's.

#include "process_group_comm.hpp"

#include <c10/util/Exception.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace lce_torch {

enum class exchange_kind : std::int64_t {
  logprobs = 1,
  logprobs_backward,
  logprobs_forward_backward,
  target_set_logprobs,
  target_set_logprobs_backward,
  sft_loss,
  dpo_loss,
  policy_gradient_loss,
  distill_loss,
  python_settings,  // lce.agree_on_group: a Python wrapper's settings (linear_cross_entropy's)
};

inline const char* exchange_kind_name(std::int64_t kind) {
  switch (static_cast<exchange_kind>(kind)) {
    case exchange_kind::logprobs: return "lce.logprobs";
    case exchange_kind::logprobs_backward: return "lce.logprobs_backward";
    case exchange_kind::logprobs_forward_backward: return "lce.logprobs_forward_backward";
    case exchange_kind::target_set_logprobs: return "lce.target_set_logprobs";
    case exchange_kind::target_set_logprobs_backward: return "lce.target_set_logprobs_backward";
    case exchange_kind::sft_loss: return "lce.sft_loss";
    case exchange_kind::dpo_loss: return "lce.dpo_loss";
    case exchange_kind::policy_gradient_loss: return "lce.policy_gradient_loss";
    case exchange_kind::distill_loss: return "lce.distill_loss";
    case exchange_kind::python_settings: return "linear_cross_entropy's settings";
  }
  return "an unknown lce_torch call";
}

struct verdict {
  static constexpr std::size_t fields = 4;
  std::int64_t ok = 0;
  std::int64_t kind = 0;
  std::int64_t first = 0;   // the call's own values
  std::int64_t second = 0;
};

// Gathers every rank's verdict. A rank that failed gets the records back and
// raises its own error (the caller rethrows it); on the others this raises
// "rank r rejected its arguments" where one did, then names the ranks' calls
// where they differ. Returns the records, rank by rank.
inline std::vector<verdict> exchange_verdicts(const process_group& comm, const verdict& mine) {
  std::vector<std::int64_t> all(verdict::fields * static_cast<std::size_t>(comm.size()));
  const std::int64_t sent[verdict::fields] = {mine.ok, mine.kind, mine.first, mine.second};
  comm.all_gather_host(sent, all.data(), static_cast<std::int64_t>(verdict::fields));
  std::vector<verdict> records(static_cast<std::size_t>(comm.size()));
  for (std::size_t r = 0; r < records.size(); ++r) {
    const std::int64_t* v = all.data() + verdict::fields * r;
    records[r] = verdict{v[0], v[1], v[2], v[3]};
  }
  if (mine.ok != 1) return records;
  for (int r = 0; r < comm.size(); ++r)
    TORCH_CHECK(records[static_cast<std::size_t>(r)].ok == 1, "lce_torch: rank ", r, " rejected its arguments");
  for (int r = 0; r < comm.size(); ++r) {
    const std::int64_t theirs = records[static_cast<std::size_t>(r)].kind;
    TORCH_CHECK(theirs == mine.kind, "lce_torch: the ranks of group '", comm.name(), "' are in different calls: rank ",
                comm.rank(), " in ", exchange_kind_name(mine.kind), ", rank ", r, " in ", exchange_kind_name(theirs),
                " (every rank of a group must make the same lce_torch calls in the same order)");
  }
  return records;
}

}  // namespace lce_torch
