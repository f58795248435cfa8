#pragma once
// The CUDA backend's row kernels: the row math of core/row_math.hpp (the same
// functions the host's SIMD loops call), one logit per thread at a time.
//
//   row_statistics_kernel   one read of a row: soft-cap (written back), max,
//                           sum exp, entropy term and target logit, kept per
//                           thread as a row_partial updated online and merged
//                           across the block with CUB by row_math's `merge`
//   logit_gradient_kernel   one read-modify-write per logit: dz in place, or
//                           into the GEMMs' operand block (bf16 / fp16)
//
// Kernels are hidden in the versioned namespace (as CUB does), so two shared
// libraries instantiating lce never resolve to each other's kernels.

#include <lce/core/backend.hpp>
#include <lce/core/config.hpp>
#include <lce/core/dtypes.hpp>
#include <lce/core/row_math.hpp>
#include <lce/core/views.hpp>
#include <lce/cuda/detail/launch_shape.hpp>

#include <cub/block/block_reduce.cuh>

#include <cmath>
#include <cstdint>
#include <type_traits>

#define LCE_KERNEL __global__ __attribute__((visibility("hidden")))

LCE_BEGIN_NAMESPACE
namespace detail::cuda_kernels {

using cuda_launch::block_threads;
using cuda_launch::items_per_thread;

// Adds one logit to a running partial, rescaling it when the maximum moves.
// A logit of -inf adds nothing (see exp_centre in core/row_math.hpp); a NaN
// still poisons the sums.
template <class A, bool WithEntropy>
__device__ __forceinline__ void accumulate(row_partial<A>& p, A z) {
  if (z > p.max) {
    // != 0, not > 0: a NaN sum (a NaN logit seen earlier) must stay NaN through the
    // rescale (NaN * scale + 1), as the host's two-pass sum keeps it.
    if (p.sum_exp != A(0)) {
      const A shift = p.max - z;  // < 0
      const A scale = fast_exp(shift);
      if constexpr (WithEntropy) p.sum_exp_offset = scale * (p.sum_exp_offset + shift * p.sum_exp);
      p.sum_exp = p.sum_exp * scale + A(1);
    } else {
      p.sum_exp = A(1);
      p.sum_exp_offset = A(0);
    }
    p.max = z;
  } else if (!(z < lowest_finite<A>)) {
    const A shifted = z - p.max;
    const A e = fast_exp(shifted);
    p.sum_exp += e;
    if constexpr (WithEntropy) p.sum_exp_offset += e * shifted;
  }
}

template <class A>
struct merge_partials_op {
  __device__ __forceinline__ row_partial<A> operator()(const row_partial<A>& a, const row_partial<A>& b) const {
    return merge(a, b);
  }
};

template <class A, class I, bool WithEntropy, bool SoftCap>
LCE_KERNEL void row_statistics_kernel(statistics_args<A, I> args) {
  using reduce_partials = cub::BlockReduce<row_partial<A>, block_threads>;
  using reduce_sums = cub::BlockReduce<A, block_threads>;
  __shared__ union {
    typename reduce_partials::TempStorage partials;
    typename reduce_sums::TempStorage sums;
  } temp;
  __shared__ A row_max;

  const std::int64_t r = blockIdx.x;
  A* const row = args.logits.data + r * args.logits.ld;
  const std::int64_t cols = args.logits.cols;
  const std::int64_t target = local_target(args.targets.data[r], args.vocab_start, args.ignore_index, cols);

  row_partial<A> mine;
  for (std::int64_t j = threadIdx.x; j < cols; j += block_threads) {
    A z = row[j];
    if constexpr (SoftCap) {
      z = soft_cap(z, args.soft_cap);
      row[j] = z;
    }
    if (j == target) mine.target_logit = z;
    mine.sum_logit += z;  // kept always: one add per logit in a pass bound by memory
    accumulate<A, WithEntropy>(mine, z);
  }
  row_partial<A> total = reduce_partials(temp.partials).Reduce(mine, merge_partials_op<A>{});
  if (threadIdx.x == 0) {
    total.max = exp_centre(total.max);  // a row of -inf: centred on 0, adds 0
    args.partials[r] = total;
    row_max = total.max;
  }
  if (!args.keep_exp) return;

  // exp(z - max) left in the block for a gradient pass that only rescales it;
  // the sum is taken again over exactly the values stored.
  __syncthreads();
  const A m = row_max;
  A sum = 0;
  for (std::int64_t j = threadIdx.x; j < cols; j += block_threads) {
    const A e = fast_exp(row[j] - m);
    row[j] = e;
    sum += e;
  }
  const A total_sum = reduce_sums(temp.sums).Sum(sum);
  if (threadIdx.x == 0) args.partials[r].sum_exp = total_sum;
}

// merged[r] = gathered[r] merged with gathered[k * stride + r], k = 1..ranks-1,
// in rank order (each thread reads only its own row's entries, so merged may
// be gathered itself).
template <class A>
LCE_KERNEL void merge_partials_kernel(const row_partial<A>* gathered, int ranks, std::int64_t rows,
                                      std::int64_t stride, row_partial<A>* merged) {
  const std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  row_partial<A> total = gathered[r];
  for (int k = 1; k < ranks; ++k) total = merge(total, gathered[k * stride + r]);
  merged[r] = total;
}

template <class A, class I>
LCE_KERNEL void finalize_rows_kernel(finalize_args<A, I> args, std::int64_t rows) {
  const std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  const bool ignored = static_cast<std::int64_t>(args.targets.data[r]) == args.ignore_index;
  const auto result = finalize(args.partials[r], ignored);
  if (args.logprobs) args.logprobs[r] = result.logprob;
  if (args.lse) args.lse[r] = result.lse;
  if (args.entropy) args.entropy[r] = result.entropy;
  if (args.mean_centred) args.mean_centred[r] = -result.entropy;
  if (args.mean_logit) args.mean_logit[r] = ignored ? A(0) : args.partials[r].sum_logit * args.inverse_vocab;
}

// out[r] = sum_v p (z - lse): this shard's part of E_p[z] - lse.
template <class A, class I>
LCE_KERNEL void mean_centred_logits_kernel(mean_centred_logit_args<A, I> args) {
  using reduce_sums = cub::BlockReduce<A, block_threads>;
  __shared__ typename reduce_sums::TempStorage temp;
  const std::int64_t r = blockIdx.x;
  if (static_cast<std::int64_t>(args.targets.data[r]) == args.ignore_index) {
    if (threadIdx.x == 0) args.out[r] = A(0);
    return;
  }
  const A* const row = args.logits.data + r * args.logits.ld;
  const A lse = args.lse[r];
  A sum = 0;
  for (std::int64_t j = threadIdx.x; j < args.logits.cols; j += block_threads) {
    const A centred = row[j] - lse;
    sum += fast_exp(centred) * above_exp_floor<A>(centred);
  }
  const A total = reduce_sums(temp).Sum(sum);
  if (threadIdx.x == 0) args.out[r] = total;
}

// dz = g (1[v = y] - p) + h p (E_p[z] - z) + q p + m / V, times the soft-cap's slope, for
// one tile of columns of one row per block (grid-strided over the tiles).
// FromExp: the block holds exp(z - max) (keep_exp), dz = -g exp(max - lse) e.
template <class A, class I, class Out, bool WithEntropy, bool SoftCap, bool FromExp>
LCE_KERNEL void logit_gradient_kernel(gradient_args<A, I, Out> args, Out* out, std::int64_t out_ld,
                                      std::int64_t tiles_per_row, std::int64_t tiles) {
  const std::int64_t cols = args.logits.cols;
  for (std::int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const std::int64_t r = tile / tiles_per_row;
    const std::int64_t first = (tile % tiles_per_row) * cuda_launch::tile_elements;
    const A* const row = args.logits.data + r * args.logits.ld;
    Out* const out_row = out + r * out_ld;
    const auto id = static_cast<std::int64_t>(args.targets.data[r]);
    const A g = args.grad_logprobs[r];
    const A h = WithEntropy ? args.grad_entropy[r] : A(0);
    const A q = lse_gradient(args.grad_lse, args.lse_squared, args.lse, r);
    const A m = args.grad_mean_logit ? args.grad_mean_logit[r] : A(0);
    const bool zero = id == args.ignore_index || (g == A(0) && h == A(0) && q == A(0) && m == A(0));
    const auto terms = fold_row_terms(g, q, m, args.inverse_vocab);
    const A g_p = terms.grad_logprob_of_p;
    const std::int64_t target = local_target(id, args.vocab_start, args.ignore_index, cols);
    const A lse = args.lse[r];
    const A mean_centred = WithEntropy ? args.mean_centred_logit[r] : A(0);
    A exp_scale = A(0);
    if constexpr (FromExp) exp_scale = -g_p * std::exp(args.exp_row_max[r].max - lse);

#pragma unroll
    for (int k = 0; k < items_per_thread; ++k) {
      const std::int64_t j = first + static_cast<std::int64_t>(k) * block_threads + threadIdx.x;
      if (j >= cols) break;
      const A z = row[j];
      A d = A(0);
      if (!zero) {
        if constexpr (FromExp) {
          d = z * exp_scale + terms.uniform;
        } else {
          const A centred = z - lse;
          const A p = fast_exp(centred);
          d = (WithEntropy ? logit_gradient(p, centred, g_p, h, mean_centred) : p * -g_p) + terms.uniform;
          if constexpr (SoftCap) d = d * soft_cap_slope(z, args.soft_cap);
        }
        if (j == target) {
          if constexpr (SoftCap && !FromExp) d += g * soft_cap_slope(z, args.soft_cap);
          else d += g;
        }
      }
      out_row[j] = convert<Out>(d);
    }
  }
}

// A target set's +g terms, one thread per (row, id), after logit_gradient_kernel
// wrote the row: the first of equal ids in a row adds the sum of their g (times
// the soft-cap's slope at their logit). In place when dz overwrote the logits;
// into an operand block, the column's dz is recomputed from the logits (still
// there) and rounded once.
template <class A, class I, class Out, bool WithEntropy, bool SoftCap>
LCE_KERNEL void target_set_gradient_kernel(gradient_args<A, I, Out> args, Out* out, std::int64_t out_ld,
                                           std::int64_t rows) {
  const std::int64_t item = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (item >= rows * args.set_size) return;
  const std::int64_t r = item / args.set_size, k = item % args.set_size;
  if (static_cast<std::int64_t>(args.targets.data[r]) == args.ignore_index) return;
  const I* const ids = args.set_ids + r * args.set_size;
  const std::int64_t column = local_target(ids[k], args.vocab_start, args.ignore_index, args.logits.cols);
  if (column < 0) return;
  for (std::int64_t e = 0; e < k; ++e)
    if (ids[e] == ids[k]) return;
  A sum = 0;
  for (std::int64_t e = k; e < args.set_size; ++e)
    if (ids[e] == ids[k]) sum += args.set_grads[r * args.set_size + e];
  const A slope = SoftCap ? soft_cap_slope(args.set_logits[item], args.soft_cap) : A(1);
  Out* const at = out + r * out_ld + column;
  if (static_cast<const void*>(out) == static_cast<const void*>(args.logits.data)) {
    *at = convert<Out>(convert<A>(*at) + sum * slope);
    return;
  }
  const A z = args.logits.data[r * args.logits.ld + column];
  const A g = args.grad_logprobs[r];
  const A h = WithEntropy ? args.grad_entropy[r] : A(0);
  const A q = lse_gradient(args.grad_lse, args.lse_squared, args.lse, r);
  const A m = args.grad_mean_logit ? args.grad_mean_logit[r] : A(0);
  A d = A(0);
  if (!(g == A(0) && h == A(0) && q == A(0) && m == A(0))) {
    const auto terms = fold_row_terms(g, q, m, args.inverse_vocab);
    const A centred = z - args.lse[r];
    const A p = fast_exp(centred);
    d = (WithEntropy ? logit_gradient(p, centred, terms.grad_logprob_of_p, h, args.mean_centred_logit[r])
                     : p * -terms.grad_logprob_of_p) +
        terms.uniform;
    if constexpr (SoftCap) d = d * soft_cap_slope(z, args.soft_cap);
  }
  *at = convert<Out>(d + sum * slope);
}

// stand_ins[r], and with grads the row's sum of them over ids not ignored; one thread per row.
template <class A, class I>
LCE_KERNEL void target_set_rows_kernel(target_set_args<A, I> args, std::int64_t rows) {
  const std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  const I* const ids = args.ids.data + r * args.set_size;
  bool counted = false;
  A sum = 0;
  for (std::int64_t k = 0; k < args.set_size; ++k) {
    if (static_cast<std::int64_t>(ids[k]) == args.ignore_index) continue;
    counted = true;
    if (args.grads) sum += args.grads[r * args.set_size + k];
  }
  args.stand_ins[r] = static_cast<I>(counted ? held_by_no_shard(args.ignore_index) : args.ignore_index);
  if (args.grads) args.grad_sums[r] = sum;
}

// values[r, k] = z at the id where this shard holds it, else 0; one thread per id.
template <class A, class I>
LCE_KERNEL void target_set_logits_kernel(target_set_args<A, I> args, std::int64_t rows) {
  const std::int64_t item = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (item >= rows * args.set_size) return;
  const std::int64_t r = item / args.set_size;
  const std::int64_t column = local_target(args.ids.data[item], args.vocab_start, args.ignore_index, args.logits.cols);
  args.values[item] = column >= 0 ? args.logits.data[r * args.logits.ld + column] : A(0);
}

template <class A, class I>
LCE_KERNEL void target_set_logprobs_kernel(target_set_args<A, I> args, std::int64_t rows) {
  const std::int64_t item = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (item >= rows * args.set_size) return;
  const bool ignored = static_cast<std::int64_t>(args.ids.data[item]) == args.ignore_index;
  args.out[item] = ignored ? A(0) : args.values[item] - args.lse[item / args.set_size];
}

template <class A>
LCE_KERNEL void soft_cap_kernel(matrix_view<A> logits, soft_cap_map<A> cap, std::int64_t tiles_per_row,
                                std::int64_t tiles) {
  for (std::int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const std::int64_t r = tile / tiles_per_row;
    const std::int64_t first = (tile % tiles_per_row) * cuda_launch::tile_elements;
    A* const row = logits.data + r * logits.ld;
#pragma unroll
    for (int k = 0; k < items_per_thread; ++k) {
      const std::int64_t j = first + static_cast<std::int64_t>(k) * block_threads + threadIdx.x;
      if (j < logits.cols) row[j] = soft_cap(row[j], cap);
    }
  }
}

// target = source (Accumulate: target += source, summed in the wider type
// and rounded once), converting element types.
template <class From, class To, bool Accumulate>
LCE_KERNEL void convert_kernel(matrix_view<const From> source, matrix_view<To> target, std::int64_t tiles_per_row,
                               std::int64_t tiles) {
  using Sum = std::conditional_t<std::is_same_v<From, double> || std::is_same_v<To, double>, double, float>;
  for (std::int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const std::int64_t r = tile / tiles_per_row;
    const std::int64_t first = (tile % tiles_per_row) * cuda_launch::tile_elements;
    const From* const in = source.data + r * source.ld;
    To* const out = target.data + r * target.ld;
#pragma unroll
    for (int k = 0; k < items_per_thread; ++k) {
      const std::int64_t j = first + static_cast<std::int64_t>(k) * block_threads + threadIdx.x;
      if (j >= source.cols) break;
      if constexpr (Accumulate)
        out[j] = convert<To>(convert<Sum>(out[j]) + convert<Sum>(in[j]));
      else
        out[j] = convert<To>(in[j]);
    }
  }
}

// logits[r, j] += alpha bias[j] (an LM head's bias, before the soft-cap).
template <class A, class B>
LCE_KERNEL void add_bias_kernel(matrix_view<A> logits, vector_view<const B> bias, A alpha, std::int64_t tiles_per_row,
                                std::int64_t tiles) {
  for (std::int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const std::int64_t r = tile / tiles_per_row;
    const std::int64_t first = (tile % tiles_per_row) * cuda_launch::tile_elements;
    A* const row = logits.data + r * logits.ld;
#pragma unroll
    for (int k = 0; k < items_per_thread; ++k) {
      const std::int64_t j = first + static_cast<std::int64_t>(k) * block_threads + threadIdx.x;
      if (j < logits.cols) row[j] += alpha * convert<A>(bias.data[j]);
    }
  }
}

// out[j] += alpha sum_r dz[r, j], one thread per column, rows in order (the
// threads of a warp read consecutive columns of a row).
template <class O, class A>
LCE_KERNEL void column_sums_kernel(matrix_view<const O> dz, A alpha, A* out) {
  const std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= dz.cols) return;
  A sum = 0;
  for (std::int64_t r = 0; r < dz.rows; ++r) sum += convert<A>(dz.data[r * dz.ld + j]);
  out[j] += alpha * sum;
}

template <class A>
LCE_KERNEL void fill_zero_kernel(matrix_view<A> target, std::int64_t tiles_per_row, std::int64_t tiles) {
  for (std::int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const std::int64_t r = tile / tiles_per_row;
    const std::int64_t first = (tile % tiles_per_row) * cuda_launch::tile_elements;
    A* const out = target.data + r * target.ld;
#pragma unroll
    for (int k = 0; k < items_per_thread; ++k) {
      const std::int64_t j = first + static_cast<std::int64_t>(k) * block_threads + threadIdx.x;
      if (j < target.cols) out[j] = A(0);
    }
  }
}

// One pass over the targets (a single block: N ids are few next to the
// GEMMs): a position-mixed fingerprint and the extremes of the ids that are
// not ignore_index, for the engine's agreement and range check.
struct target_extremes {
  std::uint64_t hash = 0;
  std::int64_t lowest = INT64_MAX, lowest_at = -1;
  std::int64_t highest = INT64_MIN, highest_at = -1;
};

struct combine_extremes {
  __device__ __forceinline__ target_extremes operator()(const target_extremes& a, const target_extremes& b) const {
    target_extremes c;
    c.hash = a.hash + b.hash;
    const bool a_lower = a.lowest < b.lowest || (a.lowest == b.lowest && a.lowest_at >= 0 &&
                                                 (b.lowest_at < 0 || a.lowest_at < b.lowest_at));
    c.lowest = a_lower ? a.lowest : b.lowest;
    c.lowest_at = a_lower ? a.lowest_at : b.lowest_at;
    const bool a_higher = a.highest > b.highest || (a.highest == b.highest && a.highest_at >= 0 &&
                                                    (b.highest_at < 0 || a.highest_at < b.highest_at));
    c.highest = a_higher ? a.highest : b.highest;
    c.highest_at = a_higher ? a.highest_at : b.highest_at;
    return c;
  }
};

LCE_HOST_DEVICE inline std::uint64_t target_fingerprint(std::int64_t position, std::int64_t id) {
  std::uint64_t x = static_cast<std::uint64_t>(id) ^ (static_cast<std::uint64_t>(position) * 0x9E3779B97F4A7C15ull);
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

template <class I>
LCE_KERNEL void scan_targets_kernel(vector_view<const I> targets, std::int64_t ignore_index, target_extremes* out) {
  using reduce = cub::BlockReduce<target_extremes, block_threads>;
  __shared__ typename reduce::TempStorage temp;
  target_extremes mine;
  for (std::int64_t i = threadIdx.x; i < targets.size; i += block_threads) {
    const auto id = static_cast<std::int64_t>(targets.data[i]);
    mine.hash += target_fingerprint(i, id);
    if (id == ignore_index) continue;
    if (id < mine.lowest) mine.lowest = id, mine.lowest_at = i;
    if (id > mine.highest) mine.highest = id, mine.highest_at = i;
  }
  const target_extremes total = reduce(temp).Reduce(mine, combine_extremes{});
  if (threadIdx.x == 0) *out = total;
}

}  // namespace detail::cuda_kernels
LCE_END_NAMESPACE
