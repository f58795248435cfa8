#pragma once
// The exchange of verdicts that precedes every lce_torch call on a group
// (register.cpp's operators, losses.cpp's losses, lce.agree_on_group).
//
// Every such exchange gathers the same record from each rank, {ok, kind, a
// fingerprint of the call's settings, two values of the call's own}, so that a
// rank whose Python-side checks reject its arguments before it reaches an
// operator (lce.agree_on_group with ok false) still meets the other ranks'
// exchange, whichever call they are in, and every rank raises. The kind names
// the call: ranks in different calls (a training loop out of step across the
// group) raise saying so, rather than reading one call's values as the other's.
// The settings are text that the ranks of one call must share: a loss's
// options, or what a Python wrapper makes of an operator's results
// (linear_cross_entropy's reduction, smoothing and class weights, passed to the
// operator as caller_settings so that the check also holds inside torch.compile,
// where no Python-side exchange runs).

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
  python_checks,  // lce.agree_on_group: a Python wrapper's own checks, before its operator
  values_check,   // lce.agree_on_values: a tensor of settings (class weights) inside torch.compile
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
    case exchange_kind::python_checks: return "a Python wrapper's checks";
    case exchange_kind::values_check: return "a comparison of a wrapper's settings tensor (lce.agree_on_values)";
  }
  return "an unknown lce_torch call";
}

// FNV-1a of bytes: equal bytes give an equal value on every rank and build.
inline std::int64_t bytes_fingerprint(const void* data, std::size_t size) {
  std::uint64_t h = 14695981039346656037ull;
  const auto* bytes = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < size; ++i) h = (h ^ bytes[i]) * 1099511628211ull;
  return static_cast<std::int64_t>(h >> 1);
}

inline std::int64_t settings_fingerprint(const std::string& settings) {
  return bytes_fingerprint(settings.data(), settings.size());
}

struct verdict {
  static constexpr std::size_t fields = 5;
  std::int64_t ok = 0;
  std::int64_t kind = 0;
  std::int64_t settings = 0;  // settings_fingerprint of the call's settings
  std::int64_t first = 0;     // the call's own values
  std::int64_t second = 0;
};

// Gathers every rank's verdict, mine made of {ok, kind, settings' fingerprint,
// first, second}. A rank that failed gets the records back and raises its own
// error (the caller rethrows it); on the others this raises "rank r rejected
// its arguments" where one did, then names the ranks' calls where they differ,
// then their settings. Returns the records, rank by rank.
inline std::vector<verdict> exchange_verdicts(const process_group& comm, bool ok, exchange_kind kind,
                                              const std::string& settings, std::int64_t first, std::int64_t second) {
  const verdict mine{ok ? 1 : 0, static_cast<std::int64_t>(kind), ok ? settings_fingerprint(settings) : 0, first,
                     second};
  std::vector<std::int64_t> all(verdict::fields * static_cast<std::size_t>(comm.size()));
  const std::int64_t sent[verdict::fields] = {mine.ok, mine.kind, mine.settings, mine.first, mine.second};
  comm.all_gather_host(sent, all.data(), static_cast<std::int64_t>(verdict::fields));
  std::vector<verdict> records(static_cast<std::size_t>(comm.size()));
  for (std::size_t r = 0; r < records.size(); ++r) {
    const std::int64_t* v = all.data() + verdict::fields * r;
    records[r] = verdict{v[0], v[1], v[2], v[3], v[4]};
  }
  if (mine.ok != 1) return records;
  for (int r = 0; r < comm.size(); ++r)
    TORCH_CHECK(records[static_cast<std::size_t>(r)].ok == 1, "lce_torch: rank ", r, " rejected its arguments");
  for (int r = 0; r < comm.size(); ++r) {
    const std::int64_t theirs = records[static_cast<std::size_t>(r)].kind;
    TORCH_CHECK(theirs == mine.kind, "lce_torch: the ranks of group '", comm.name(), "' are in different calls: rank ",
                comm.rank(), " in ", exchange_kind_name(mine.kind), settings.empty() ? "" : ", called as ", settings,
                ", rank ", r, " in ", exchange_kind_name(theirs),
                " (every rank of a group must make the same lce_torch calls in the same order)");
  }
  for (int r = 0; r < comm.size(); ++r)
    TORCH_CHECK(records[static_cast<std::size_t>(r)].settings == mine.settings,
                "lce_torch: the call's settings differ across the ranks of group '", comm.name(), "': rank ",
                comm.rank(), " has ", settings.empty() ? std::string("none") : settings, ", rank ", r,
                " others (every rank must make the same call with the same options, dtypes and class weights)");
  return records;
}

}  // namespace lce_torch
