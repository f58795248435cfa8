#pragma once
// The one error type of the library, and the checks that raise it.
//
// lce::error (a std::runtime_error) is what lce raises; its message starts
// "lce: " and names the argument or option at fault with its values. What a
// caught one means (README "Guarantees", docs/API.md):
//   - bad input: every check (shapes, strides and ld, null data, aliasing,
//     targets in [0, V) or ignore_index, options, the GEMMs' int range named
//     as the caller's argument, workspace and dW-accumulator allocation)
//     runs before anything is written: every output is bit-for-bit untouched;
//   - several ranks: one exchange per call of each rank's verdict, shapes,
//     shard, number-changing options, call kind, targets hash and chunk; any
//     failure or disagreement raises on every rank (the others read "rank r
//     rejected its arguments"), never a hang; the smallest chunk wins;
//   - mid-sweep (after all checks, only a communicator failure): the message
//     names the chunk ("in chunk k of K, hidden rows [a, b) of this rank");
//     earlier chunks' outputs are written and grad_weight holds their
//     contributions (one that goes through the wide accumulator, as a 2-byte
//     one does, is untouched): restore it before a retry; the group is broken;
//   - a second thread calling an operator that is running: raised there,
//     nothing touched, the running call unaffected.

#include <lce/core/config.hpp>

#include <charconv>
#include <cstddef>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

LCE_BEGIN_NAMESPACE

class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {

// An lce::error's message without the "lce: " it starts with, to wrap it in another.
inline const char* message_body(const error& e) {
  const char* text = e.what();
  constexpr char prefix[] = "lce: ";
  for (std::size_t i = 0; i + 1 < sizeof(prefix); ++i)
    if (text[i] != prefix[i]) return text;
  return text + sizeof(prefix) - 1;
}

// A float (an option as the caller set it) is written as the shortest text that reads back
// as itself: a stream's default 6 digits would show a rejected 1.00000012 as the valid 1, and
// the largest subnormal (refused) as FLT_MIN (accepted). Doubles keep 6 digits: they are sums
// and widened values, whose every digit would only be noise.
template <class Part>
void write_part(std::ostringstream& message, const Part& part) {
  if constexpr (std::is_same_v<Part, float>) {
    char text[40];
    const auto written = std::to_chars(text, text + sizeof(text), part);
    message.write(text, written.ptr - text);
  } else {
    message << part;
  }
}

template <class... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  std::ostringstream message;
  message << "lce: ";
  (write_part(message, parts), ...);
  throw error(message.str());
}

// `expects(condition, parts...)` joins the parts into the message only on failure.
template <class... Parts>
LCE_ALWAYS_INLINE void expects(bool condition, const Parts&... parts) {
  if (!condition) [[unlikely]]
    fail(parts...);
}

}  // namespace detail

LCE_END_NAMESPACE
