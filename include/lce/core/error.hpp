#pragma once
// The one error type of the library, and the checks that raise it.
//
// Every check runs before any output is touched, so a caught lce::error
// means the caller's buffers are exactly as they were.

#include <lce/core/config.hpp>

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

LCE_BEGIN_NAMESPACE

class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {

template <class... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  std::ostringstream message;
  message << "lce: ";
  (message << ... << parts);
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
