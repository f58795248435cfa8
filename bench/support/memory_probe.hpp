#pragma once
// Peak memory of one measured step, two ways (for the benchmarks and the
// planner's measured check):
//   counted   bytes live through operator new above the level at begin()
//             (support/allocation_counter.cpp must be linked: it replaces
//             the global operator new)
//   resident  the process's peak resident set (VmHWM) above its resident set
//             at begin(): begin() returns freed heap pages to the system
//             (malloc_trim) and resets VmHWM to the current RSS by writing
//             "5" to /proc/self/clear_refs (Linux 4.0+). Includes what
//             operator new does not see (the BLAS's and MPI's buffers) and
//             counts whole touched pages.
// Linux only for `resident`; elsewhere it reads -1.

#include "allocation_counter.hpp"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace lce_bench {

// A field of /proc/self/status in bytes (VmRSS, VmHWM), -1 if unreadable.
inline std::int64_t proc_status_bytes(const char* field) {
  std::FILE* f = std::fopen("/proc/self/status", "r");
  if (!f) return -1;
  char line[256];
  std::int64_t bytes = -1;
  const std::size_t n = std::strlen(field);
  while (std::fgets(line, sizeof line, f))
    if (std::strncmp(line, field, n) == 0 && line[n] == ':') {
      bytes = std::atoll(line + n + 1) * 1024;  // kB
      break;
    }
  std::fclose(f);
  return bytes;
}

// Resets VmHWM to the current RSS; false where the kernel does not allow it.
inline bool reset_resident_peak() {
  std::FILE* f = std::fopen("/proc/self/clear_refs", "w");
  if (!f) return false;
  const bool ok = std::fputs("5", f) >= 0;
  return std::fclose(f) == 0 && ok;
}

struct peak_probe {
  std::int64_t counted_base = 0, resident_base = -1;
  bool resident_ok = false;

  void begin() {
#if defined(__GLIBC__)
    malloc_trim(0);
#endif
    resident_ok = reset_resident_peak();
    resident_base = proc_status_bytes("VmRSS");
    counted_base = lce_support::allocations::current();
    lce_support::allocations::reset_peak();
  }
  std::int64_t counted() const { return lce_support::allocations::peak() - counted_base; }
  std::int64_t resident() const {
    const std::int64_t hwm = proc_status_bytes("VmHWM");
    return resident_ok && hwm >= 0 && resident_base >= 0 ? hwm - resident_base : -1;
  }
};

}  // namespace lce_bench
