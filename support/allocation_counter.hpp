#pragma once
// Bytes allocated through operator new, for the memory checks of the tests,
// the demo and the benchmarks (not part of the library).
//
// Linking allocation_counter.cpp into a program replaces the global operator
// new / delete (every form) with counting versions that keep a process-wide
// and a per-thread tally, so a rank run on its own thread can be measured
// on its own.

#include <cstdint>

namespace lce_support::allocations {

std::int64_t current();         // bytes live in the process
std::int64_t peak();            // highest current() since reset_peak()
void reset_peak();

std::int64_t thread_current();  // bytes this thread allocated and has not freed (may be < 0)
std::int64_t thread_peak();     // highest thread_current() since reset_thread_peak()
void reset_thread_peak();

// Peak bytes above the level at construction, process-wide.
struct scope {
  std::int64_t base = current();
  scope() { reset_peak(); }
  std::int64_t peak_delta() const { return peak() - base; }
};

// The same for the calling thread only.
struct thread_scope {
  std::int64_t base = thread_current();
  thread_scope() { reset_thread_peak(); }
  std::int64_t peak_delta() const { return thread_peak() - base; }
};

}  // namespace lce_support::allocations
