#pragma once
// Transparent huge pages for the host backend's large scratch blocks.
//
// A call's scratch (hundreds of MiB of logits) is fresh memory from the
// allocator: unless the caller keeps it between calls, every call takes one
// page fault per 4 KiB page on first touch, which measured 13-19% of a
// PyTorch-sized call (1,024 tokens x 32,000 logits) here. Kernels with
// transparent huge pages in "madvise" mode (the common default) map 2 MiB at a
// fault only where asked, so the 2 MiB-aligned interior of each large block is
// advised. The allocation itself stays the allocator's (counting allocators,
// sanitizers and operator new replacements see every byte); advice that the
// kernel refuses changes nothing. LCE_NO_HUGE_PAGES=1 turns the advice off.

#include <lce/core/config.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(__linux__)
#include <sys/mman.h>
#endif

LCE_BEGIN_NAMESPACE
namespace detail {

inline constexpr std::size_t huge_page_bytes = std::size_t{2} << 20;
// Smaller blocks keep 4 KiB pages: they would gain at most a few faults and could
// round up a 2 MiB page of mostly unused memory.
inline constexpr std::size_t huge_page_advice_min_bytes = 4 * huge_page_bytes;

inline void advise_huge_pages(void* block, std::size_t bytes) noexcept {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (block == nullptr || bytes < huge_page_advice_min_bytes) return;
  if (const char* off = std::getenv("LCE_NO_HUGE_PAGES"); off && *off && std::strcmp(off, "0") != 0) return;
  const auto first = reinterpret_cast<std::uintptr_t>(block);
  const std::uintptr_t begin = (first + huge_page_bytes - 1) & ~(std::uintptr_t{huge_page_bytes} - 1);
  const std::uintptr_t end = (first + bytes) & ~(std::uintptr_t{huge_page_bytes} - 1);
  if (end > begin) (void)::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)block, (void)bytes;
#endif
}

}  // namespace detail
LCE_END_NAMESPACE
