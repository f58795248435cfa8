#pragma once
// The CPU backend: BLAS GEMMs per chunk and vectorised row passes spread
// over a small thread pool.
//
//   lce::host{}           all hardware threads for the row passes
//   lce::host{threads}    that many (the BLAS keeps its own setting)
//
// Results are bitwise the same whatever the thread count: rows are
// independent and each is reduced in a fixed order.

#include <lce/core/backend.hpp>
#include <lce/core/config.hpp>
#include <lce/core/dtypes.hpp>
#include <lce/core/row_math.hpp>
#include <lce/core/views.hpp>
#include <lce/host/detail/blas.hpp>
#include <lce/host/detail/convert.hpp>
#include <lce/host/detail/row_passes.hpp>
#include <lce/host/detail/thread_pool.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <thread>

LCE_BEGIN_NAMESPACE

class host {
 public:
  using memory_space = host_memory;

  explicit host(int threads = 0)
      : pool_(std::make_unique<detail::thread_pool>(
            threads > 0 ? threads : std::max(1, static_cast<int>(std::thread::hardware_concurrency())))) {}

  int threads() const { return pool_->size(); }

  // ---- memory --------------------------------------------------------------

  static constexpr std::size_t alignment = 64;

  void* allocate(std::size_t bytes) { return ::operator new(bytes, std::align_val_t{alignment}); }
  void deallocate(void* pointer, std::size_t) { ::operator delete(pointer, std::align_val_t{alignment}); }

  // ---- GEMMs ----------------------------------------------------------------
  // Each GEMM is split into tiles that depend on the shapes only and run on
  // this backend's threads, each tile one single-threaded BLAS call: the
  // result is the same whatever the thread counts (lce's or the BLAS's). A
  // 2-byte weight is widened to fp32 one tile at a time (CBLAS has no 2-byte
  // GEMM), into a per-thread block that stays in cache for its GEMM.

  template <storage_type T>
  std::int64_t weight_block_elements(std::int64_t hidden, std::int64_t vocab_local) const {
    if constexpr (!half_precision<T>) {
      return 0;
    } else {
      return threads() * vocab_tile_rows<T>(hidden, vocab_local) * hidden;
    }
  }

  // out = alpha x w^T, tiled over vocabulary rows.
  template <class A, class T>
  void logits(matrix_view<const A> x, matrix_view<const T> w, A alpha, matrix_view<A> out, void* weight_block) {
    const std::int64_t tile = vocab_tile_rows<T>(w.cols, w.rows);
    detail::single_threaded_blas scope;
    for_tiles(ceil_div(w.rows, tile), [&](std::int64_t t, int part) {
      const std::int64_t first = t * tile, rows = std::min(tile, w.rows - first);
      const auto block = widened(w.rows_slice(first, rows), weight_block, part, w);
      detail::gemm(detail::transpose::no, detail::transpose::yes, x.rows, rows, x.cols, alpha, x.data, x.ld,
                   block.data, block.ld, A(0), out.data + first, out.ld);
    });
  }

  // dx = alpha dz w (overwrites dx), tiled over halves of dx's rows: whole
  // rows of dx per tile measured faster than splitting its columns.
  template <class A, class T>
  void grad_hidden(matrix_view<const A> dz, matrix_view<const T> w, A alpha, matrix_view<A> dx, void* weight_block) {
    const std::int64_t row_tile = dx.rows >= 64 ? ceil_div(dx.rows, 2) : std::max<std::int64_t>(dx.rows, 1);
    detail::single_threaded_blas scope;
    for_tiles(ceil_div(dx.rows, row_tile), [&](std::int64_t t, int part) {
      const std::int64_t r0 = t * row_tile, rows = std::min(row_tile, dx.rows - r0);
      if constexpr (!half_precision<T>) {
        detail::gemm(detail::transpose::no, detail::transpose::no, rows, dx.cols, w.rows, alpha, dz.row(r0), dz.ld,
                     w.data, w.ld, A(0), dx.row(r0), dx.ld);
      } else {
        // Widen the weight one tile of vocabulary rows at a time; dx sums over the tiles in order.
        const std::int64_t tile = vocab_tile_rows<T>(w.cols, w.rows);
        for (std::int64_t v0 = 0; v0 < w.rows; v0 += tile) {
          const std::int64_t vrows = std::min(tile, w.rows - v0);
          const auto block = widened(w.rows_slice(v0, vrows), weight_block, part, w);
          detail::gemm(detail::transpose::no, detail::transpose::no, rows, dx.cols, vrows, alpha, dz.row(r0) + v0,
                       dz.ld, block.data, block.ld, v0 == 0 ? A(0) : A(1), dx.row(r0), dx.ld);
        }
      }
    });
  }

  // dw += alpha dz^T x, tiled over vocabulary rows.
  template <class A>
  void grad_weight(matrix_view<const A> dz, matrix_view<const A> x, A alpha, matrix_view<A> dw) {
    const std::int64_t tile = vocab_tile_rows<A>(x.cols, dz.cols);
    detail::single_threaded_blas scope;
    for_tiles(ceil_div(dz.cols, tile), [&](std::int64_t t, int) {
      const std::int64_t first = t * tile, rows = std::min(tile, dz.cols - first);
      detail::gemm(detail::transpose::yes, detail::transpose::no, rows, x.cols, dz.rows, alpha, dz.data + first, dz.ld,
                   x.data, x.ld, A(1), dw.row(first), dw.ld);
    });
  }

  // ---- element conversions -------------------------------------------------

  template <class From, class To>
  void copy(matrix_view<From> source, matrix_view<To> target) {
    for_rows(source.rows, source.cols, [&](std::int64_t r) { detail::convert_span(source.row(r), target.row(r), source.cols); });
  }

  template <class From, class To>
  void copy(vector_view<From> source, vector_view<To> target) {
    detail::convert_span(source.data, target.data, source.size);
  }

  template <class From, class To>
  void add(matrix_view<From> source, matrix_view<To> target) {
    for_rows(source.rows, source.cols, [&](std::int64_t r) { detail::add_span(source.row(r), target.row(r), source.cols); });
  }

  template <class A>
  void fill_zero(matrix_view<A> target) {
    for_rows(target.rows, target.cols, [&](std::int64_t r) { detail::zero_row(target.row(r), target.cols); });
  }

  // ---- row passes ----------------------------------------------------------

  template <class A>
  void soft_cap(matrix_view<A> logits, const detail::soft_cap_map<A>& cap) {
    for_rows(logits.rows, logits.cols, [&](std::int64_t r) { detail::soft_cap_row(logits.row(r), logits.cols, cap); });
  }

  template <class A, class I>
  void row_statistics(const statistics_args<A, I>& args) {
    for_rows(args.logits.rows, args.logits.cols, [&](std::int64_t r) {
      A* row = args.logits.row(r);
      const std::int64_t n = args.logits.cols;
      if (args.soft_cap.enabled()) detail::soft_cap_row(row, n, args.soft_cap);
      detail::row_partial<A> partial;
      partial.max = detail::row_max(row, n);
      const std::int64_t target = local_target(args.targets[r], args.vocab_start, args.ignore_index, n);
      if (target >= 0) partial.target_logit = row[target];
      if (args.keep_exp) {
        partial.sum_exp = detail::exp_in_place_row(row, n, partial.max);
      } else if (args.with_entropy) {
        detail::sum_exp_row<A, true>(row, n, partial.max, partial.sum_exp, partial.sum_exp_offset);
      } else {
        detail::sum_exp_row<A, false>(row, n, partial.max, partial.sum_exp, partial.sum_exp_offset);
      }
      args.partials[r] = partial;
    });
  }

  // gathered holds `ranks` consecutive arrays of `rows` partials, merged in rank order.
  template <class A>
  void merge_partials(const detail::row_partial<A>* gathered, int ranks, std::int64_t rows,
                      detail::row_partial<A>* merged) {
    for (std::int64_t r = 0; r < rows; ++r) {
      detail::row_partial<A> total = gathered[r];
      for (int k = 1; k < ranks; ++k) total = detail::merge(total, gathered[k * rows + r]);
      merged[r] = total;
    }
  }

  template <class A, class I>
  void finalize_rows(const finalize_args<A, I>& args, std::int64_t rows) {
    for (std::int64_t r = 0; r < rows; ++r) {
      const auto result = detail::finalize(args.partials[r], args.targets[r] == args.ignore_index);
      if (args.logprobs) args.logprobs[r] = result.logprob;
      if (args.lse) args.lse[r] = result.lse;
      if (args.entropy) args.entropy[r] = result.entropy;
    }
  }

  template <class A, class I>
  void mean_centred_logits(const mean_centred_logit_args<A, I>& args) {
    for_rows(args.logits.rows, args.logits.cols, [&](std::int64_t r) {
      const bool ignored = args.targets[r] == args.ignore_index;
      args.out[r] = ignored ? A(0) : detail::mean_centred_logit_row(args.logits.row(r), args.logits.cols, args.lse[r]);
    });
  }

  template <class A, class I>
  void logit_gradients(const gradient_args<A, I>& args) {
    const bool capped = args.soft_cap.enabled();
    for_rows(args.logits.rows, args.logits.cols, [&](std::int64_t r) {
      A* row = args.logits.row(r);
      const std::int64_t n = args.logits.cols;
      const A g = args.grad_logprobs[r];
      const A h = args.grad_entropy ? args.grad_entropy[r] : A(0);
      if (args.targets[r] == args.ignore_index || (g == A(0) && h == A(0))) {
        detail::zero_row(row, n);
        return;
      }
      const std::int64_t target = local_target(args.targets[r], args.vocab_start, args.ignore_index, n);
      const A target_slope = target >= 0 && capped ? detail::soft_cap_slope(row[target], args.soft_cap) : A(1);
      if (args.exp_row_max) {
        detail::scale_row(row, n, -g * std::exp(args.exp_row_max[r].max - args.lse[r]));
      } else {
        dispatch_gradient_row(row, n, args.lse[r], g, h, args.mean_centred_logit ? args.mean_centred_logit[r] : A(0),
                              args.soft_cap, args.grad_entropy != nullptr, capped);
      }
      if (target >= 0) row[target] += g * target_slope;
    });
  }

 private:
  static constexpr std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

  // Vocabulary rows per GEMM tile, from the shapes alone: about 16 tiles to
  // share, but never under 1024 rows (single-threaded BLAS GEMMs only reach
  // full speed from about 512 columns up) nor over 4096. A 2-byte weight's
  // tile is widened into per-thread scratch, so there it also stays within
  // about 2^21 fp32 elements (but at least 512 rows).
  template <class T>
  static constexpr std::int64_t vocab_tile_rows(std::int64_t hidden, std::int64_t vocab_local) {
    std::int64_t rows = std::clamp<std::int64_t>(ceil_div(vocab_local, 16), 1024, 4096);
    if constexpr (half_precision<T>)
      rows = std::min(rows, std::max<std::int64_t>(512, (std::int64_t{1} << 21) / std::max<std::int64_t>(hidden, 1)));
    return std::max<std::int64_t>(1, std::min(rows, vocab_local));
  }

  // The weight rows of a tile in compute type: themselves, or widened into
  // this thread's share of the scratch.
  template <class T>
  static auto widened(matrix_view<const T> rows, void* scratch, int part, const matrix_view<const T>& weight) {
    if constexpr (!half_precision<T>) {
      return rows;
    } else {
      float* block = static_cast<float*>(scratch) + part * vocab_tile_rows<T>(weight.cols, weight.rows) * weight.cols;
      for (std::int64_t r = 0; r < rows.rows; ++r) detail::convert_span(rows.row(r), block + r * rows.cols, rows.cols);
      return matrix_view<const float>{block, rows.rows, rows.cols, rows.cols};
    }
  }

  template <class Body>
  void for_tiles(std::int64_t tiles, Body&& body) {
    pool_->parallel_for(tiles, 1, [&](std::int64_t begin, std::int64_t end, int part) {
      for (std::int64_t t = begin; t < end; ++t) body(t, part);
    });
  }

  // Rows are handed out in grains of about 2^16 elements: small enough to
  // balance the threads, large enough that taking one costs nothing.
  template <class Body>
  void for_rows(std::int64_t rows, std::int64_t row_length, Body&& body) {
    const std::int64_t grain = std::max<std::int64_t>(1, (std::int64_t{1} << 16) / std::max<std::int64_t>(row_length, 1));
    pool_->parallel_for(rows, grain, [&](std::int64_t begin, std::int64_t end, int) {
      for (std::int64_t r = begin; r < end; ++r) body(r);
    });
  }

  template <class I>
  static std::int64_t local_target(I target, std::int64_t vocab_start, std::int64_t ignore_index, std::int64_t n) {
    const std::int64_t local = static_cast<std::int64_t>(target) - vocab_start;
    return static_cast<std::int64_t>(target) != ignore_index && local >= 0 && local < n ? local : -1;
  }

  template <class A>
  static void dispatch_gradient_row(A* row, std::int64_t n, A lse, A g, A h, A mean_centred,
                                    const detail::soft_cap_map<A>& cap,
                                    bool with_entropy, bool capped) {
    if (with_entropy) {
      capped ? detail::gradient_row<A, true, true>(row, n, lse, g, h, mean_centred, cap)
             : detail::gradient_row<A, true, false>(row, n, lse, g, h, mean_centred, cap);
    } else {
      capped ? detail::gradient_row<A, false, true>(row, n, lse, g, h, mean_centred, cap)
             : detail::gradient_row<A, false, false>(row, n, lse, g, h, mean_centred, cap);
    }
  }

  std::unique_ptr<detail::thread_pool> pool_;
};

static_assert(backend<host>);

LCE_END_NAMESPACE
