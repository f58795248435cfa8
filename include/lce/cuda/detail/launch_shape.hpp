#pragma once
// Grid shapes of the CUDA backend's kernels, from the shapes of their data
// alone. Plain C++ (no CUDA headers), so the host compiler tests them.
//
//   one_block_per_row   reductions over a row (statistics, E_p[z]): a block
//                       strides along its row, CUB reduces the threads
//   element_tiles       elementwise passes over a [rows, cols] block (dz,
//                       soft-cap, conversions): tiles of one row's columns,
//                       several elements per thread, grid-strided past the
//                       grid limit
//   one_thread_per_item per-row finalisation and merges, vectors

#include <lce/core/config.hpp>

#include <algorithm>
#include <cstdint>

LCE_BEGIN_NAMESPACE
namespace detail::cuda_launch {

// Threads per block of every lce kernel: a multiple of the warp that keeps a
// row's reduction in one block on every architecture since sm_80.
inline constexpr int block_threads = 256;
// Elements each thread of an elementwise kernel handles per tile.
inline constexpr int items_per_thread = 4;
inline constexpr std::int64_t tile_elements = std::int64_t{block_threads} * items_per_thread;
// gridDim.x's limit.
inline constexpr std::int64_t max_blocks = 2147483647;

struct shape {
  std::int64_t blocks = 0;  // 0: nothing to launch
  int threads = block_threads;
};

inline shape one_block_per_row(std::int64_t rows) {
  return {std::clamp<std::int64_t>(rows, 0, max_blocks), block_threads};
}

struct tiles {
  std::int64_t per_row = 0;  // column tiles of one row
  std::int64_t count = 0;    // rows x per_row; blocks stride over them
  shape launch;
};

inline tiles element_tiles(std::int64_t rows, std::int64_t cols) {
  tiles t;
  if (rows <= 0 || cols <= 0) return t;
  t.per_row = (cols + tile_elements - 1) / tile_elements;
  t.count = rows > INT64_MAX / t.per_row ? INT64_MAX : rows * t.per_row;
  t.launch = {std::min(t.count, max_blocks), block_threads};
  return t;
}

inline shape one_thread_per_item(std::int64_t items) {
  if (items <= 0) return {0, block_threads};
  return {std::min((items + block_threads - 1) / block_threads, max_blocks), block_threads};
}

}  // namespace detail::cuda_launch
LCE_END_NAMESPACE
