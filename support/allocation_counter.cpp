// Counting replacements of the global operator new / delete; see the header.
#include "allocation_counter.hpp"

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <new>

namespace lce_support::allocations {
namespace {

std::atomic<std::int64_t> live{0}, live_peak{0};
thread_local std::int64_t thread_live = 0, thread_live_peak = 0;

void raise(std::atomic<std::int64_t>& high, std::int64_t now) {
  std::int64_t seen = high.load(std::memory_order_relaxed);
  while (now > seen && !high.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
  }
}

void note(std::int64_t bytes) {
  raise(live_peak, live.fetch_add(bytes, std::memory_order_relaxed) + bytes);
  thread_live += bytes;
  thread_live_peak = std::max(thread_live_peak, thread_live);
}

// Each block carries a 16-byte header just before the user's pointer: the
// offset back to what malloc returned, and the size asked for. So every form
// of delete can release any block, whatever form allocated it.
struct header {
  std::size_t offset;
  std::size_t bytes;
};
static_assert(sizeof(header) == 16);

void* allocate(std::size_t bytes, std::size_t alignment) {
  alignment = std::max<std::size_t>(alignment, sizeof(header));
  const std::size_t total = (alignment + bytes + alignment - 1) / alignment * alignment;
  auto* raw = static_cast<unsigned char*>(std::aligned_alloc(alignment, total));
  if (!raw) return nullptr;
  unsigned char* user = raw + alignment;
  reinterpret_cast<header*>(user)[-1] = {alignment, bytes};
  note(static_cast<std::int64_t>(bytes));
  return user;
}

void* allocate_or_throw(std::size_t bytes, std::size_t alignment) {
  if (void* p = allocate(bytes, alignment)) return p;
  throw std::bad_alloc();
}

void release(void* pointer) noexcept {
  if (!pointer) return;
  const header h = static_cast<header*>(pointer)[-1];
  note(-static_cast<std::int64_t>(h.bytes));
  std::free(static_cast<unsigned char*>(pointer) - h.offset);
}

constexpr std::size_t default_alignment = __STDCPP_DEFAULT_NEW_ALIGNMENT__;

}  // namespace

std::int64_t current() { return live.load(); }
std::int64_t peak() { return live_peak.load(); }
void reset_peak() { live_peak.store(live.load()); }
std::int64_t thread_current() { return thread_live; }
std::int64_t thread_peak() { return thread_live_peak; }
void reset_thread_peak() { thread_live_peak = thread_live; }

}  // namespace lce_support::allocations

namespace counter = lce_support::allocations;

void* operator new(std::size_t n) { return counter::allocate_or_throw(n, counter::default_alignment); }
void* operator new[](std::size_t n) { return counter::allocate_or_throw(n, counter::default_alignment); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept { return counter::allocate(n, counter::default_alignment); }
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept { return counter::allocate(n, counter::default_alignment); }
void* operator new(std::size_t n, std::align_val_t a) { return counter::allocate_or_throw(n, static_cast<std::size_t>(a)); }
void* operator new[](std::size_t n, std::align_val_t a) { return counter::allocate_or_throw(n, static_cast<std::size_t>(a)); }
void* operator new(std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return counter::allocate(n, static_cast<std::size_t>(a));
}
void* operator new[](std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return counter::allocate(n, static_cast<std::size_t>(a));
}
void operator delete(void* p) noexcept { counter::release(p); }
void operator delete[](void* p) noexcept { counter::release(p); }
void operator delete(void* p, std::size_t) noexcept { counter::release(p); }
void operator delete[](void* p, std::size_t) noexcept { counter::release(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { counter::release(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { counter::release(p); }
void operator delete(void* p, std::align_val_t) noexcept { counter::release(p); }
void operator delete[](void* p, std::align_val_t) noexcept { counter::release(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { counter::release(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { counter::release(p); }
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept { counter::release(p); }
void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept { counter::release(p); }
