// Counting replacements of every global operator new / delete, for the
// bounded-memory test of lce_thread_tests (test_threads_memory.cpp). They keep,
// per thread, the bytes currently allocated and their peak. In a translation
// unit of their own, so that the compiler does not inline them into callers
// (where g++ 12 warns, wrongly, about the header arithmetic).
#include "alloc_counting.hpp"

#include <algorithm>
#include <cstdlib>
#include <new>

namespace per_thread {

namespace {
thread_local std::int64_t current_bytes = 0;  // may go negative on a thread that frees what another allocated
thread_local std::int64_t peak_bytes = 0;
}  // namespace

std::int64_t current() { return current_bytes; }
std::int64_t peak() { return peak_bytes; }
void reset_peak() { peak_bytes = current_bytes; }

constexpr std::size_t header = 16;  // == __STDCPP_DEFAULT_NEW_ALIGNMENT__ on x86-64

namespace {
void note_alloc(std::size_t n) {
  current_bytes += static_cast<std::int64_t>(n);
  if (current_bytes > peak_bytes) peak_bytes = current_bytes;
}
void note_free(std::size_t n) { current_bytes -= static_cast<std::int64_t>(n); }
}  // namespace

void* alloc(std::size_t n) {
  auto* raw = static_cast<unsigned char*>(std::malloc(n + header));
  if (!raw) return nullptr;
  *reinterpret_cast<std::size_t*>(raw) = n;
  note_alloc(n);
  return raw + header;
}
void release(void* p) {
  if (!p) return;
  auto* raw = static_cast<unsigned char*>(p) - header;
  note_free(*reinterpret_cast<std::size_t*>(raw));
  std::free(raw);
}
void* alloc_aligned(std::size_t n, std::align_val_t al) {
  const std::size_t a = std::max<std::size_t>(static_cast<std::size_t>(al), header);
  const std::size_t bytes = (n + a + a - 1) / a * a;
  auto* raw = static_cast<unsigned char*>(std::aligned_alloc(a, bytes));
  if (!raw) return nullptr;
  *reinterpret_cast<std::size_t*>(raw + a - sizeof(std::size_t)) = n;
  note_alloc(n);
  return raw + a;
}
void release_aligned(void* p, std::align_val_t al) {
  if (!p) return;
  const std::size_t a = std::max<std::size_t>(static_cast<std::size_t>(al), header);
  auto* user = static_cast<unsigned char*>(p);
  note_free(*reinterpret_cast<std::size_t*>(user - sizeof(std::size_t)));
  std::free(user - a);
}

}  // namespace per_thread

void* operator new(std::size_t n) {
  if (void* p = per_thread::alloc(n)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n) {
  if (void* p = per_thread::alloc(n)) return p;
  throw std::bad_alloc();
}
void* operator new(std::size_t n, const std::nothrow_t&) noexcept { return per_thread::alloc(n); }
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept { return per_thread::alloc(n); }
void* operator new(std::size_t n, std::align_val_t al) {
  if (void* p = per_thread::alloc_aligned(n, al)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n, std::align_val_t al) {
  if (void* p = per_thread::alloc_aligned(n, al)) return p;
  throw std::bad_alloc();
}
void* operator new(std::size_t n, std::align_val_t al, const std::nothrow_t&) noexcept {
  return per_thread::alloc_aligned(n, al);
}
void* operator new[](std::size_t n, std::align_val_t al, const std::nothrow_t&) noexcept {
  return per_thread::alloc_aligned(n, al);
}
void operator delete(void* p) noexcept { per_thread::release(p); }
void operator delete[](void* p) noexcept { per_thread::release(p); }
void operator delete(void* p, std::size_t) noexcept { per_thread::release(p); }
void operator delete[](void* p, std::size_t) noexcept { per_thread::release(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { per_thread::release(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { per_thread::release(p); }
void operator delete(void* p, std::align_val_t al) noexcept { per_thread::release_aligned(p, al); }
void operator delete[](void* p, std::align_val_t al) noexcept { per_thread::release_aligned(p, al); }
void operator delete(void* p, std::size_t, std::align_val_t al) noexcept { per_thread::release_aligned(p, al); }
void operator delete[](void* p, std::size_t, std::align_val_t al) noexcept { per_thread::release_aligned(p, al); }
void operator delete(void* p, std::align_val_t al, const std::nothrow_t&) noexcept {
  per_thread::release_aligned(p, al);
}
void operator delete[](void* p, std::align_val_t al, const std::nothrow_t&) noexcept {
  per_thread::release_aligned(p, al);
}

