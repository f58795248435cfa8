#pragma once
// The blocks lce::cuda_backend carves from a caller's device buffer
// (cuda_backend_options::workspace). Plain C++ over offsets, never touching the
// memory, so that the host compiler tests it behind the real engine
// (tests/unit/test_caller_workspace.cpp).

#include <lce/core/config.hpp>
#include <lce/detail/workspace.hpp>

#include <cstddef>
#include <iterator>
#include <new>
#include <utility>
#include <vector>

LCE_BEGIN_NAMESPACE
namespace detail {

// The operator holds at most two blocks, the sweep's scratch and a 2-byte
// grad_weight's fp32 accumulator, and regrows either while the other lives;
// workspace_bytes counts the larger of each, side by side. Each block
// therefore sits against one end of the buffer: a new block goes at the
// front when the room before the first live block holds it, otherwise
// top-down against the back. A block regrown while the other lives then gets
// the freed end, and two blocks fit whenever their sizes (whole multiples of
// workspace_alignment, as the engine asks for) add up to the buffer. First fit
// from the front would put a regrown scratch after the accumulator and
// overrun a buffer of exactly workspace_bytes.
class caller_workspace {
 public:
  caller_workspace(void* base, std::size_t bytes) : base_(static_cast<char*>(base)), bytes_(bytes) {}

  // Throws std::bad_alloc when no gap holds `bytes` (the engine turns that
  // into an lce::error naming the block).
  void* carve(std::size_t bytes) {
    if (bytes > bytes_) throw std::bad_alloc();
    if (blocks_.empty() || blocks_.front().first >= bytes) return take(blocks_.begin(), 0, bytes);
    // Top-down: the gaps from the back, each [end of the block before, start of the next).
    std::size_t gap_end = bytes_;
    for (auto next = blocks_.end(); next != blocks_.begin(); --next) {
      const std::size_t gap_begin = align_up(checked_size(std::prev(next)->second)).value;
      if (gap_end >= bytes) {
        const std::size_t at = (gap_end - bytes) / workspace_alignment * workspace_alignment;
        if (at >= gap_begin) return take(next, at, bytes);
      }
      gap_end = std::prev(next)->first;
    }
    throw std::bad_alloc();
  }

  void give_back(void* pointer) noexcept {
    const auto offset = static_cast<std::size_t>(static_cast<char*>(pointer) - base_);
    for (auto block = blocks_.begin(); block != blocks_.end(); ++block)
      if (block->first == offset) {
        blocks_.erase(block);
        return;
      }
  }

  // [offset, end) of each live block, by offset.
  const std::vector<std::pair<std::size_t, std::size_t>>& blocks() const { return blocks_; }

 private:
  void* take(std::vector<std::pair<std::size_t, std::size_t>>::iterator before, std::size_t at, std::size_t bytes) {
    blocks_.insert(before, {at, at + bytes});
    return base_ + at;
  }

  char* base_;
  std::size_t bytes_;
  std::vector<std::pair<std::size_t, std::size_t>> blocks_;
};

}  // namespace detail
LCE_END_NAMESPACE
