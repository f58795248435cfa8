#pragma once
// Checks on the caller's arguments, all done before any output is touched.
//
// Every message starts with the API name of the offending argument and shows
// the values that broke the rule, so a failure can be read without a debugger.

#include <lce/core/config.hpp>
#include <lce/core/error.hpp>
#include <lce/core/options.hpp>
#include <lce/core/views.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <vector>

LCE_BEGIN_NAMESPACE
namespace detail {

inline void check_options(const options& opt) {
  // A subnormal temperature or soft-cap passes "> 0" but its reciprocal, which scales the
  // logits, overflows: NaN logits. A soft-cap past 1 / FLT_MIN (8.5e37) has a subnormal
  // reciprocal, which holds too few bits for the raw logits it scales.
  expects(std::isnormal(opt.temperature) && opt.temperature > 0.0f,
          "temperature must be finite, > 0 and a normal float, got ", opt.temperature);
  expects(opt.softcap == 0.0f || (std::isnormal(opt.softcap) && opt.softcap > 0.0f && std::isnormal(1.0f / opt.softcap)),
          "softcap must be 0 (none) or finite, > 0, a normal float and at most 8.5e37 (1 / FLT_MIN), got ", opt.softcap);
  expects(opt.chunk_tokens >= 0, "chunk_tokens must be >= 0 (0 lets the chunk policy decide), got ",
          opt.chunk_tokens);
  expects(opt.vocab_start >= 0, "vocab_start must be >= 0, got ", opt.vocab_start);
  expects(opt.max_logits_share >= 0.0f && opt.max_logits_share <= 1.0f,
          "max_logits_share must be between 0 and 1 (a share of the call's logits), got ",
          opt.max_logits_share);
}

// `extent_limit`: the largest rows, cols and ld the backend's GEMMs take
// (BLAS counts in int), named here as the caller's argument.
template <class E>
void check_matrix(const matrix_view<E>& m, const char* name, std::int64_t extent_limit = INT64_MAX) {
  expects(m.rows >= 0 && m.cols >= 0, name, ": negative shape ", m.rows, " x ", m.cols);
  expects(m.rows == 0 || m.ld >= std::max<std::int64_t>(m.cols, 1), name, ": leading dimension ld = ", m.ld,
          m.cols > 0 ? " is smaller than cols = " : " must be at least 1 (cols = ", m.cols, m.cols > 0 ? " (rows " : ", rows ",
          m.rows, ")");
  expects(m.data != nullptr || m.rows == 0 || m.cols == 0, name, ": null data for a ", m.rows, " x ", m.cols,
          " matrix");
  expects(m.rows <= extent_limit && m.cols <= extent_limit && m.ld <= extent_limit, name, ": shape ", m.rows,
          " x ", m.cols, " with ld ", m.ld, " exceeds the GEMMs' integer range (", extent_limit, ")");
}

template <class E>
void check_vector(const vector_view<E>& v, const char* name) {
  expects(v.size >= 0, name, ": negative size ", v.size);
  expects(v.data != nullptr || v.size == 0, name, ": null data for ", v.size, " elements");
}

template <class E>
void check_rows(const vector_view<E>& v, const char* name, std::int64_t rows, const char* rows_of) {
  check_vector(v, name);
  expects(v.size == rows, name, ": size ", v.size, " does not match the ", rows, " rows of ", rows_of);
}

template <class E>
void check_shape(const matrix_view<E>& m, const char* name, std::int64_t rows, std::int64_t cols, const char* like,
                 std::int64_t extent_limit = INT64_MAX) {
  check_matrix(m, name, extent_limit);
  expects(m.rows == rows && m.cols == cols, name, ": shape ", m.rows, " x ", m.cols, " does not match ", like,
          " (", rows, " x ", cols, ")");
}

// The bytes a view spans, for alias checks.
struct byte_range {
  const char* name;
  std::uintptr_t begin = 0;
  std::uintptr_t end = 0;  // one past the last byte; begin == end: empty
};

template <class E>
byte_range bytes_of(const matrix_view<E>& m, const char* name) {
  if (m.rows == 0 || m.cols == 0) return {name};
  const auto begin = reinterpret_cast<std::uintptr_t>(m.data);
  const auto elements = static_cast<std::uintptr_t>((m.rows - 1) * m.ld + m.cols);
  return {name, begin, begin + elements * sizeof(E)};
}

template <class E>
byte_range bytes_of(const vector_view<E>& v, const char* name) {
  if (v.size == 0) return {name};
  const auto begin = reinterpret_cast<std::uintptr_t>(v.data);
  return {name, begin, begin + static_cast<std::uintptr_t>(v.size) * sizeof(E)};
}

inline bool overlap(const byte_range& a, const byte_range& b) {
  return a.begin < a.end && b.begin < b.end && a.begin < b.end && b.begin < a.end;
}

// No output may overlap an input or another output.
template <class Inputs, class Outputs>
void check_no_alias_in(const Inputs& inputs, const Outputs& outputs) {
  for (auto output = outputs.begin(); output != outputs.end(); ++output) {
    for (const auto& input : inputs)
      expects(!overlap(*output, input), output->name, " overlaps the input ", input.name,
              ": outputs must not alias inputs");
    for (auto other = outputs.begin(); other != output; ++other)
      expects(!overlap(*output, *other), output->name, " overlaps the output ", other->name,
              ": outputs must not alias each other");
  }
}
inline void check_no_alias(std::initializer_list<byte_range> inputs, std::initializer_list<byte_range> outputs) {
  check_no_alias_in(inputs, outputs);
}
inline void check_no_alias(const std::vector<byte_range>& inputs, const std::vector<byte_range>& outputs) {
  check_no_alias_in(inputs, outputs);
}

// Where a target sits, as the caller wrote it: targets[i], or targets[i, e]
// in target sets of K ids per token (held flat, [N K]).
struct target_place {
  std::int64_t at;
  std::int64_t set_size;  // 0: one target per token
  friend std::ostream& operator<<(std::ostream& os, const target_place& p) {
    if (p.set_size == 0) return os << "targets[" << p.at << "]";
    return os << "targets[" << p.at / p.set_size << ", " << p.at % p.set_size << "]";
  }
};

// Targets are global ids in [0, vocab) or ignore_index.
template <class I>
void check_targets(const vector_view<const I>& targets, std::int64_t vocab, std::int64_t ignore_index,
                   std::int64_t set_size = 0) {
  for (std::int64_t i = 0; i < targets.size; ++i) {
    const auto target = static_cast<std::int64_t>(targets.data[i]);
    if (target == ignore_index) continue;
    expects(target >= 0 && target < vocab, target_place{i, set_size}, " = ", target,
            " is outside the vocabulary [0, ", vocab, ") and is not ignore_index (", ignore_index, ")");
  }
}

}  // namespace detail
LCE_END_NAMESPACE
