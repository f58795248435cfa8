#pragma once
// How the ranks of a group agree on a call before any collective moves data.
//
// Each rank checks its own arguments, plans its own workspace and reserves
// it, then tells the others, in one exchange of a few integers, everything
// the call depends on: whether its checks passed, the shapes, its shard of
// the vocabulary, the options that change the numbers, a hash of its targets
// and the largest chunk it can afford. Every rank then holds the same
// records, so every rank takes the same decision: all run the call with the
// smallest chunk, or all raise the same lce::error. No rank is left waiting
// in a collective; no rank computes with another's settings.

#include <lce/comm/communicator.hpp>
#include <lce/core/backend.hpp>
#include <lce/core/config.hpp>
#include <lce/core/dtypes.hpp>
#include <lce/core/error.hpp>
#include <lce/core/options.hpp>
#include <lce/core/views.hpp>

#include <algorithm>
#include <bit>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

LCE_BEGIN_NAMESPACE
namespace detail {

// Which call a rank is making; the record's `call` is the kind, the head's
// bits (a bias, a grad_bias) and, from bit 8 up, which optional per-token
// vectors it has (row_terms.hpp masks).
enum class call_kind : std::int64_t { forward = 1, backward = 3, forward_backward = 5 };
// A bias is a property of the model and grad_bias of the call: a rank without
// them while the others have them is a caller's mistake, not a shard's choice.
inline constexpr std::int64_t call_with_bias = 1 << 6, call_with_grad_bias = 1 << 7;

// "forward(logprobs, lse, entropy)" for a record's `call`, for error messages.
inline std::string describe_call(std::int64_t call) {
  static constexpr const char* outputs[] = {"logprobs", "lse", "entropy", "mean_logit"};
  static constexpr const char* gradients[] = {"grad_logprobs", "grad_entropy", "grad_lse", "grad_mean_logit"};
  // Bits 0-5 the kind, 6-7 the head's, 8-19 which per-token vectors
  // (forward_backward: 5 gradient bits, then the outputs'), 20 on the target
  // set's size K.
  static constexpr const char* squared = "lse_squared";
  const std::int64_t kind = call & 0x3f, terms = call >> 8 & 0xfff, set_size = call >> 20;
  std::string text;
  std::int64_t output_bits = 0, gradient_bits = 0;
  if (kind == static_cast<std::int64_t>(call_kind::forward)) {
    text = "forward(";
    output_bits = terms;
  } else if (kind == static_cast<std::int64_t>(call_kind::backward)) {
    text = "backward(lse, ";
    gradient_bits = terms;
  } else {
    text = "forward_backward(";
    gradient_bits = terms & 0x1f;
    output_bits = terms >> 5;
  }
  bool first = true;
  const auto list = [&](const char* const* names, std::int64_t bits) {
    for (int k = 0; k < 4; ++k) {
      if (!(bits >> k & 1)) continue;
      text += first ? "" : ", ";
      text += names[k];
      first = false;
    }
  };
  list(gradients, gradient_bits & 0xf);
  if (gradient_bits & 0x10) list(&squared, 1);
  list(outputs, output_bits);
  static constexpr const char* head[] = {"bias", "grad_bias"};
  list(head, call >> 6 & 0x3);
  if (set_size > 0) text += (first ? "" : ", ") + std::string("target sets of ") + std::to_string(set_size);
  return text + ")";
}

// The element types of a call, T and its compute type, as one code (element_types_code): ranks
// whose types differ would gather rows of one size into buffers of another, or read bf16 bytes
// as fp16.
inline constexpr const char* element_type_names[] = {"?", "float", "double", "bfloat16", "float16"};

template <class E>
constexpr std::int64_t element_type_code() {
  if constexpr (std::same_as<E, float>) return 1;
  if constexpr (std::same_as<E, double>) return 2;
  if constexpr (std::same_as<E, bfloat16>) return 3;
  if constexpr (std::same_as<E, float16>) return 4;
  return 0;
}

template <class T, class Compute>
constexpr std::int64_t element_types_code() {
  return element_type_code<T>() | element_type_code<Compute>() << 4;
}

inline std::string describe_element_types(std::int64_t code) {
  const auto name = [](std::int64_t c) { return element_type_names[c >= 0 && c <= 4 ? c : 0]; };
  return std::string(name(code & 0xf)) + " (computing in " + name(code >> 4 & 0xf) + ")";
}

// What one rank tells the others about a call (host values).
struct call_record {
  static constexpr std::int64_t values = 15;

  std::int64_t ok = 0;  // 1: this rank's own checks and workspace passed
  std::int64_t n_tokens = 0;
  std::int64_t hidden = 0;
  std::int64_t vocab_start = 0;
  std::int64_t vocab_local = 0;
  std::int64_t chunk = 0;  // logit-block rows this rank's workspace allows
  std::int64_t sequence_parallel = 0;
  std::int64_t ignore_index = 0;
  std::int64_t temperature_bits = 0;
  std::int64_t softcap_bits = 0;
  std::int64_t call = 0;  // which call (call_kind): every rank must make the same one
  std::int64_t targets_hash = 0;
  std::int64_t element_types = 0;  // element_types_code<T, Compute>
  // The extremes of its ids other than ignore_index (highest < lowest: none), so that a rank
  // whose ids pass the hash but not the range cannot raise alone.
  std::int64_t targets_lowest = 0;
  std::int64_t targets_highest = -1;
};
static_assert(sizeof(call_record) == call_record::values * sizeof(std::int64_t));

// -0 as 0: the options take them alike (a soft-cap of -0 is none, as 0 is).
inline std::int64_t float_bits(float value) { return value == 0.0f ? 0 : std::bit_cast<std::int32_t>(value); }
inline float float_from_bits(std::int64_t bits) { return std::bit_cast<float>(static_cast<std::int32_t>(bits)); }

// A 64-bit fingerprint of the targets, over their values as int64 (int32 and
// int64 targets of the same ids agree), and the extremes of the ids other than
// ignore_index, in one pass on the host. One multiply per token. The hash tells
// mistakes apart (targets of another batch, order or length), not a crafted
// colliding list: that would still be refused where its ids leave the vocabulary.
template <class Index>
target_scan scan_targets_on_host(const vector_view<const Index>& targets, std::int64_t ignore_index) {
  target_scan scanned;
  std::uint64_t hash = 0x9E3779B97F4A7C15ull ^ static_cast<std::uint64_t>(targets.size);
  std::int64_t lowest = INT64_MAX, highest = INT64_MIN;
  for (std::int64_t i = 0; i < targets.size; ++i) {
    const auto id = static_cast<std::int64_t>(targets.data[i]);
    hash ^= static_cast<std::uint64_t>(id);
    hash *= 0xBF58476D1CE4E5B9ull;
    hash ^= hash >> 31;
    if (id == ignore_index) continue;
    lowest = std::min(lowest, id);
    highest = std::max(highest, id);
  }
  scanned.hash = static_cast<std::int64_t>(hash);
  if (lowest <= highest) {
    scanned.lowest = lowest;
    scanned.highest = highest;
  }
  return scanned;
}

// The vocabulary shards of all ranks, in rank order.
struct shard_layout {
  std::int64_t vocab = 0;  // 0: not known yet
  std::vector<std::int64_t> starts, rows;

  bool matches(const std::vector<call_record>& records) const {
    if (records.size() != starts.size()) return false;
    for (std::size_t r = 0; r < records.size(); ++r)
      if (records[r].vocab_start != starts[r] || records[r].vocab_local != rows[r]) return false;
    return true;
  }
};

// What the ranks agreed on.
struct agreed_call {
  std::int64_t chunk = 0;  // the smallest of every rank's chunk
  // The extremes of every rank's target ids (other than ignore_index; highest < lowest: none).
  std::int64_t targets_lowest = INT64_MAX;
  std::int64_t targets_highest = INT64_MIN;
};

template <communicator Comm>
class rank_agreement {
 public:
  // Exchanges `mine` (whose `ok` says whether `failure` is empty) and raises
  // the same lce::error on every rank unless all ranks passed and agree.
  // `failure` is this rank's own message, raised as is on this rank.
  agreed_call agree(const Comm& comm, const call_record& mine, const std::string& failure) {
    std::vector<call_record> records(static_cast<std::size_t>(comm.size()));
    comm.all_gather_host(&mine.ok, &records.front().ok, call_record::values);

    std::vector<int> failed;
    for (std::size_t r = 0; r < records.size(); ++r)
      if (records[r].ok != 1) failed.push_back(static_cast<int>(r));
    if (!failed.empty()) {
      if (!failure.empty()) throw error(failure);
      std::ostringstream ranks;
      for (std::size_t k = 0; k < failed.size(); ++k) ranks << (k ? ", " : "") << failed[k];
      fail("rank ", ranks.str(), " rejected its arguments (its lce::error names them); no rank ran the call");
    }

    for (std::size_t r = 1; r < records.size(); ++r)
      expects(records[r].element_types == records[0].element_types,
              "the element type differs across ranks: rank 0 has ", describe_element_types(records[0].element_types),
              ", rank ", r, " has ", describe_element_types(records[r].element_types),
              ": every rank must instantiate the operator on the same T");

    same_on_every_rank(records, &call_record::n_tokens, "targets: the number of tokens",
                       "every rank must pass all N tokens");
    same_on_every_rank(records, &call_record::hidden, "hidden: the hidden size", "");
    same_on_every_rank(records, &call_record::sequence_parallel, "options.sequence_parallel", "");
    same_on_every_rank(records, &call_record::ignore_index, "options.ignore_index", "");
    same_float_on_every_rank(records, &call_record::temperature_bits, "options.temperature");
    same_float_on_every_rank(records, &call_record::softcap_bits, "options.softcap");
    for (std::size_t r = 1; r < records.size(); ++r)
      expects(records[r].call == records[0].call, "the call differs across ranks: rank 0 makes ",
              describe_call(records[0].call), ", rank ", r, " makes ", describe_call(records[r].call),
              ": every rank must make the same call, with the same per-token vectors");
    same_on_every_rank(records, &call_record::targets_hash, "targets: the hash of the target ids",
                       "every rank must pass the same N targets, in the same order");

    if (!layout_.matches(records)) layout_ = tile(records);

    agreed_call agreed;
    agreed.chunk = records.front().chunk;
    for (const auto& record : records) {
      agreed.chunk = std::min(agreed.chunk, record.chunk);
      if (record.targets_lowest > record.targets_highest) continue;
      agreed.targets_lowest = std::min(agreed.targets_lowest, record.targets_lowest);
      agreed.targets_highest = std::max(agreed.targets_highest, record.targets_highest);
    }
    return agreed;
  }

  // The whole vocabulary V as of the last agreed call.
  std::int64_t vocab() const { return layout_.vocab; }

 private:
  static void same_on_every_rank(const std::vector<call_record>& records, std::int64_t call_record::*field,
                                 const char* what, const char* why) {
    for (std::size_t r = 1; r < records.size(); ++r)
      expects(records[r].*field == records[0].*field, what, " differs across ranks: rank 0 has ", records[0].*field,
              ", rank ", r, " has ", records[r].*field, *why ? ": " : "", why,
              *why ? "" : ": every rank must pass the same value");
  }

  static void same_float_on_every_rank(const std::vector<call_record>& records, std::int64_t call_record::*field,
                                       const char* what) {
    for (std::size_t r = 1; r < records.size(); ++r)
      expects(records[r].*field == records[0].*field, what, " differs across ranks: rank 0 has ",
              float_from_bits(records[0].*field), ", rank ", r, " has ", float_from_bits(records[r].*field),
              ": every rank must pass the same value");
  }

  // The shards must tile [0, V) in rank order.
  static shard_layout tile(const std::vector<call_record>& records) {
    shard_layout layout;
    for (std::size_t r = 0; r < records.size(); ++r) {
      const std::int64_t start = records[r].vocab_start, rows = records[r].vocab_local;
      expects(start == layout.vocab, "options.vocab_start = ", start, " on rank ", r, " (", rows,
              " rows), but the shards must tile the vocabulary in rank order: expected ", layout.vocab);
      layout.vocab = start + rows;
      layout.starts.push_back(start);
      layout.rows.push_back(rows);
    }
    return layout;
  }

  shard_layout layout_;  // as last agreed on every rank
};

}  // namespace detail
LCE_END_NAMESPACE
