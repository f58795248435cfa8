// The message of the lce::error a call raises, for tests that check it.
#pragma once

#include <lce/core/error.hpp>

#include <exception>
#include <string>

namespace lce_test {

// Runs body(); returns the lce::error message, or "" when nothing was thrown.
// Any other exception is a failure of its own.
template <class Body>
std::string error_of(Body&& body) {
  try {
    body();
  } catch (const lce::error& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("NOT AN lce::error: ") + e.what();
  }
  return {};
}

}  // namespace lce_test
