// Per-thread allocation counts kept by the operator new / delete replacements
// of alloc_counting.cpp (linked into lce_thread_tests only).
#pragma once

#include <cstdint>

namespace per_thread {

std::int64_t current();  // bytes this thread allocated and has not freed (may be < 0)
std::int64_t peak();     // the highest current() since the last reset_peak()
void reset_peak();

// Peak bytes this thread allocated above its level at construction.
struct scope {
  std::int64_t base = current();
  scope() { reset_peak(); }
  std::int64_t peak_delta() const { return peak() - base; }
};

}  // namespace per_thread
