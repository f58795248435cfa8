#pragma once
// The CPU backend: GEMMs per chunk from a GEMM provider (gemm_provider.hpp;
// lce::cblas_gemm, the BLAS lce links, by default) and vectorised row passes
// spread over a small thread pool.
//
//   lce::host{}           one thread per CPU of the process's affinity mask
//                         (taskset, cpusets, an MPI rank's binding)
//   lce::host{threads}    that many, for the GEMM tiles and the row passes
//                         (the BLAS runs one thread per GEMM tile)
//   lce::basic_host<P>{provider, threads}   the GEMMs from another provider
//   ..., lce::scratch_pages::base           no transparent huge pages for the
//                                           scratch (a caller that frees it after
//                                           every call; see scratch_pages)
//
// Results are bitwise the same whatever the thread count: rows are
// independent and each is reduced in a fixed order; GEMM tiles and the
// scratch are cut from the shapes alone.

#include <lce/core/backend.hpp>
#include <lce/core/chunking.hpp>
#include <lce/core/config.hpp>
#include <lce/core/dtypes.hpp>
#include <lce/core/error.hpp>
#include <lce/core/row_math.hpp>
#include <lce/core/views.hpp>
#include <lce/host/cblas_gemm.hpp>
#include <lce/host/detail/convert.hpp>
#include <lce/host/detail/huge_pages.hpp>
#include <lce/host/detail/row_passes.hpp>
#include <lce/host/detail/thread_pool.hpp>
#include <lce/host/gemm_provider.hpp>

#include <algorithm>
#include <atomic>
#include <climits>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <thread>
#include <type_traits>
#include <utility>

LCE_BEGIN_NAMESPACE

namespace detail {
// The provider's call_scope, or nothing.
template <class P>
struct provider_call_scope {
  struct type {};
};
template <class P>
  requires requires { typename P::call_scope; }
struct provider_call_scope<P> {
  using type = typename P::call_scope;
};
}  // namespace detail

// Whether the host backend's large scratch blocks ask for transparent huge
// pages. With scratch kept between calls (the operator's default) the advice
// trades one fault per 4 KiB for one per 2 MiB, once. A caller that frees the
// scratch after every call (lce_torch) maps it afresh each time, and there,
// in a virtual machine, fresh huge pages can cost more than the faults they
// save: through lce_torch at N = 1,024, V = 32,000 on 2 cores, a call right
// after PyTorch's own ops took 0.45 s with them and 0.23 s without (bf16;
// float32 0.87 s and 0.75 s), the wall time lost outside the process.
enum class scratch_pages {
  transparent_huge,  // madvise(MADV_HUGEPAGE) on blocks of 8 MiB or more (Linux)
  base,              // the allocator's pages as they come
};

template <gemm_provider Gemm>
class basic_host {
 public:
  using memory_space = host_memory;
  using gemm_type = Gemm;

  // The GEMMs' operand type (core/backend.hpp): bfloat16 hidden rows and dz
  // go to a provider with bf16_operands as bf16; otherwise the compute type.
  static constexpr bool bf16_operands = gemm_reads_bf16_operands<Gemm>;
  template <class T>
  using gemm_operand = std::conditional_t<bf16_operands && std::same_as<std::remove_cv_t<T>, bfloat16>, bfloat16,
                                          compute_t<T>>;

  // threads <= 0: one per CPU this process may run on (its affinity mask).
  explicit basic_host(int threads = 0, scratch_pages pages = scratch_pages::transparent_huge)
    requires std::default_initializable<Gemm>
      : basic_host(Gemm{}, threads, pages) {}

  explicit basic_host(Gemm gemm, int threads = 0, scratch_pages pages = scratch_pages::transparent_huge)
      : gemm_(std::move(gemm)),
        pool_(std::make_unique<detail::thread_pool>(threads > 0 ? threads : detail::available_cpus())),
        pages_(pages) {}

  int threads() const { return pool_->size(); }

  const Gemm& gemm() const { return gemm_; }

  // ---- per-call provider setting ---------------------------------------------
  // While a call_scope lives, the provider's call_scope lives. For
  // lce::cblas_gemm that makes the BLAS run one thread per call (lce's GEMM
  // tiles need that for results independent of thread counts). OpenBLAS has
  // no per-thread setting (its openblas_set_num_threads_local, 0.3.27 on,
  // sets the process-wide count too), so this is the process-wide setting,
  // changed once when the first concurrent scope starts and restored when
  // the last one ends. The engine holds one per operator call; each GEMM
  // also holds one, which inside a call only counts (no BLAS call).
  class call_scope {
   public:
    call_scope() = default;
    call_scope(const call_scope&) = delete;
    call_scope& operator=(const call_scope&) = delete;

   private:
    [[no_unique_address]] typename detail::provider_call_scope<Gemm>::type provider_;
  };

  [[nodiscard]] call_scope begin_call() { return {}; }

  // ---- memory --------------------------------------------------------------

  static constexpr std::size_t alignment = 64;

  // CBLAS counts rows, columns and leading dimensions in int; the operator
  // checks its arguments against this before any work.
  static constexpr std::int64_t max_gemm_extent = INT_MAX;

  // From 512 rows a bigger chunk buys little but memory. Through lce_torch
  // (MKL's sgemm) at H 1,024, V 32,000, 2 threads, N 1,024 and 4,096 took the
  // same time in chunks of 512 as in the budget's 1,024 and 2,048 (0.60 /
  // 0.61 s, 2.44 / 2.43 s; 384 rows within 3%, 256 rows 8% slower), with half
  // to a third of the workspace (62 MiB against 125 / 167). On OpenBLAS
  // (lce_demo, float, N 4,096) chunks of 512 took 2.69-2.76 s against
  // 2.48-2.65 for chunks of 2,048 (four rounds): about 6% for 3 more passes
  // over dW, for 64.5 MiB of workspace instead of 256.
  static constexpr std::int64_t enough_chunk_rows = 512;
  // A long call takes an eighth of its tokens per chunk down to these rows
  // (budget_chunk): at N 1,024, H 1,024, V 32,000, float, 2 threads, on
  // OpenBLAS (Zen 3; lce_demo --chunk, best of 3) chunks of 512 / 256 / 192
  // / 128 rows took 1.18 / 1.20 / 1.24 / 1.32 s against 1.26 s for the
  // materialised logits: 192 rows cost 5% for a third of the workspace.
  // Through lce_torch on MKL's sgemm (Xeon, 2 threads) chunks of 192 took
  // 0.71 s against plain's 0.75 s, six evened ones of 171 0.82 s: evening
  // stops at these rows too (evened_chunk_rows).
  static constexpr std::int64_t min_efficient_chunk_rows = 192;
  // The vocabulary order's tiles (a 32nd of the shard) stop narrowing here: at
  // N 1,024, H 1,024, bf16 through lce_torch on OpenBLAS (Zen 3, sgemm on
  // widened tiles, 2 threads, one process, interleaved), 1,024-column tiles
  // took the time of 4,000-column ones (1.79-1.89 s against 1.93-1.94 s at
  // V 32,000; 7.41 s against 7.38 s at V 128,256) in half the memory, and
  // 512-column ones 3-8% more for a quarter less again.
  static constexpr std::int64_t min_efficient_vocabulary_tile = 1024;

  // How fast a T operator's GEMMs run against memory (core/backend.hpp): the provider's own
  // figure where they run on its bf16 GEMM (gemm_provider.hpp), else the default.
  template <class T>
  double gemm_flops_per_memory_byte() const {
    if constexpr (std::same_as<std::remove_cv_t<T>, bfloat16> && bf16_gemm_provider<Gemm> &&
                  requires(const Gemm& g) {
                    { g.bf16_gemm_flops_per_memory_byte() } -> std::convertible_to<double>;
                  }) {
      if (bf16_operands || gemm_.bf16_gemm_available()) return gemm_.bf16_gemm_flops_per_memory_byte();
    }
    return default_gemm_flops_per_memory_byte;
  }

  // Large blocks get transparent huge pages where the kernel offers them
  // (detail/huge_pages.hpp), unless this backend was made with scratch_pages::base.
  void* allocate(std::size_t bytes) {
    void* block = ::operator new(bytes, std::align_val_t{alignment});
    if (pages_ == scratch_pages::transparent_huge) detail::advise_huge_pages(block, bytes);
    return block;
  }
  void deallocate(void* pointer, std::size_t) { ::operator delete(pointer, std::align_val_t{alignment}); }

  // ---- GEMMs ----------------------------------------------------------------
  // With a provider's bf16 GEMM (lce::cblas_gemm: lce's AMX kernel or oneDNN), a
  // bfloat16 weight's logits and dX GEMMs run as bf16 x bf16 -> fp32 GEMMs
  // (bf16_logits, bf16_grad_hidden) when bf16_gemm_available(), in the same
  // scratch and still tiled by the shapes alone; with its split bf16 GEMM
  // (split_bf16_gemm_available()), dX and dW take the fp32 dz as it is, kept to
  // 16 bits as hi + lo (weight_gradient_gemm); otherwise as below.
  // Each GEMM is split into tiles that depend on the shapes only and run on
  // this backend's threads, each tile one single-threaded provider call: the
  // result is the same whatever the thread counts (lce's or the BLAS's). (A
  // provider that parallelises itself gets one call per vocabulary tile from
  // the calling thread instead: gemm_parallelises_itself.) A
  // 2-byte weight is widened to fp32 one vocabulary tile at a time (CBLAS has
  // no 2-byte GEMM), by all threads into one of two shared slots, which that
  // tile's GEMM tiles then read from cache while the next tile is widened into
  // the other: each weight row is widened once per GEMM (for_widened_tiles).

  // The fp32 elements of those two slots (0 for a weight of the compute type):
  // from the shapes alone, so the chunk (and the bits) do not depend on threads().
  template <storage_type T>
  std::int64_t weight_block_elements(std::int64_t hidden, std::int64_t vocab_local) const {
    if constexpr (!half_precision<T> || std::same_as<gemm_operand<T>, T>) {
      return 0;
    } else {
      // Saturates (the workspace plan then reports the overflow as an lce::error).
      const std::int64_t rows = 2 * vocab_tile_rows<T>(hidden, vocab_local);
      return hidden > INT64_MAX / rows ? INT64_MAX : rows * hidden;
    }
  }

  // out = alpha x w^T, tiled over vocabulary rows (a 2-byte weight: over the
  // output tiles of each widened vocabulary tile, all in one pass). O is the
  // GEMM operand type: the compute type, or bf16 for a provider with bf16_operands
  // (then the weight is read as stored too, in the same tiles as an fp32 one).
  template <class O, class T, class A>
  void logits(matrix_view<const O> x, matrix_view<const T> w, A alpha, matrix_view<A> out, void* weight_block) {
    [[maybe_unused]] const provider_scope scope;
    if constexpr (weight_as_stored<O, T>) {
      // As many tiles as the widened path's logits (half of dX's target). Vocabulary
      // tiles alone re-read the tokens' rows least (the 4,008-row tiles at V 128,256
      // took 5-7% longer as 2 x 4 than as 1 x 4); a narrow weight (the vocabulary
      // order's 1,024-row tile, a small shard) is cut into narrower vocabulary tiles,
      // down to 512 rows (a shard too narrow for two: tiles over tokens too), or its one
      // GEMM would keep one thread busy: bf16 through
      // lce_torch on AMX (Xeon, 2 threads, N 1,024, V 32,000) took 0.24-0.25 s with one
      // GEMM per 1,024-row tile, 0.19 s as 2 x 2 GEMMs of tokens and vocabulary, and
      // 1 x 2 packs the weight half as often (one thread: 2-3% faster than 2 x 2).
      constexpr std::int64_t target = std::max<std::int64_t>(1, tile_target / 2);
      constexpr std::int64_t least = std::same_as<O, bfloat16> ? output_tiling::bf16_operand_floor : output_tiling::min_rows;
      const std::int64_t tile = vocab_tile_rows<compute_t<T>>(w.cols, w.rows);
      output_tiling tiles = detail::ceil_div(w.rows, tile) >= target
                                ? output_tiling::in_columns_of(x.rows, w.rows, tile)
                                : output_tiling(x.rows, w.rows, target, w.rows >= 2 * least ? x.rows : least, least);
      // One tile (a 768 x 768 GEMM: the logits of kept_ratios_plan's tiles at N 768) is
      // cut over the tokens in two, or one thread runs it whole: through lce_torch (bf16,
      // N 768, 2 threads, Zen 5) 768-column tiles took 0.25-0.27 s as one GEMM, 0.19 s in
      // two. Two from the shapes alone, not one per thread, so that the bits do not
      // depend on threads() with any provider.
      if (!provider_parallel && tiles.count() == 1)
        tiles = output_tiling(x.rows, w.rows, 2, output_tiling::min_rows, least);
      for_gemm_tiles(tiles.count(), [&](std::int64_t t) {
        const auto [r0, rows, c0, cols] = tiles.tile(t);
        operand_gemm(transpose::no, transpose::yes, rows, cols, x.cols, alpha, x.row(r0), x.ld, w.row(c0), w.ld, A(0),
                     out.row(r0) + c0, out.ld);
      });
    } else {
      if (x.rows == 0) return;
      if constexpr (bf16_weight<A, T>) {
        if (bf16_logits(x, w, alpha, out, weight_block)) return;
      }
      // The same tiles for every vocabulary tile (the last, shorter one clips
      // them); half as many as for dX: two vocabulary tiles' are in flight.
      const output_tiling tiles(x.rows, vocab_tile_rows<T>(w.cols, w.rows), std::max<std::int64_t>(1, tile_target / 2));
      for_widened_tiles(w, weight_block, tiles.count(), /*chained=*/false,
                        [&](matrix_view<const A> block, std::int64_t v0, std::int64_t t) {
                          const auto [r0, rows, c0, cols] = tiles.tile(t);
                          if (c0 >= block.rows) return;
                          gemm_.gemm(transpose::no, transpose::yes, rows,
                                       std::min(cols, block.rows - c0), x.cols, alpha, x.row(r0), x.ld, block.row(c0),
                                       block.ld, A(0), out.row(r0) + v0 + c0, out.ld);
                        });
    }
  }

  // dx = alpha dz w + beta dx (beta 0: overwritten, or 1: adds_grad_hidden),
  // over tiles of dx (rows x columns, from the shapes: enough for every
  // thread). A 2-byte weight is widened one vocabulary tile at a time and each
  // dx tile summed over those in order.
  template <class O, class T, class A>
  void grad_hidden(matrix_view<const O> dz, matrix_view<const T> w, A alpha, matrix_view<A> dx, void* weight_block,
                   A beta = A(0)) {
    if (dx.rows == 0 || dx.cols == 0) return;
    [[maybe_unused]] const provider_scope scope;
    // Tiles over the whole vocabulary on a bf16 GEMM (bf16 dz, or dz split as it is packed)
    // are at least 512 x 512; the others at least 256 x 256.
    bool whole_depth_bf16 = std::same_as<O, bfloat16>;
    if constexpr (split_bf16_weight<A, T>) whole_depth_bf16 = gemm_.split_bf16_gemm_available();
    const output_tiling tiles(dx.rows, dx.cols, tile_target,
                              whole_depth_bf16 ? output_tiling::bf16_operand_floor : output_tiling::min_rows,
                              whole_depth_bf16 ? output_tiling::bf16_operand_floor : output_tiling::min_cols);
    if constexpr (weight_as_stored<O, T>) {
      for_gemm_tiles(tiles.count(), [&](std::int64_t t) {
        const auto [r0, rows, c0, cols] = tiles.tile(t);
        operand_gemm(transpose::no, transpose::no, rows, cols, w.rows, alpha, dz.row(r0), dz.ld, w.data + c0, w.ld,
                     beta, dx.row(r0) + c0, dx.ld);
      });
    } else {
      if constexpr (split_bf16_weight<A, T>) {
        // dz as it is, split as the provider packs it: dX's tiles over the whole vocabulary.
        if (whole_depth_bf16) {
          for_gemm_tiles(tiles.count(), [&](std::int64_t t) {
            const auto [r0, rows, c0, cols] = tiles.tile(t);
            gemm_.split_bf16_gemm(transpose::no, transpose::no, rows, cols, w.rows, alpha, dz.row(r0), dz.ld,
                                  w.data + c0, w.ld, beta, dx.row(r0) + c0, dx.ld);
          });
          return;
        }
      }
      if constexpr (bf16_weight<A, T>) {
        if (bf16_grad_hidden(dz, w, alpha, dx, tiles, weight_block, beta)) return;
      }
      for_widened_tiles(w, weight_block, tiles.count(), /*chained=*/true,
                        [&](matrix_view<const A> block, std::int64_t v0, std::int64_t t) {
                          const auto [r0, rows, c0, cols] = tiles.tile(t);
                          gemm_.gemm(transpose::no, transpose::no, rows, cols, block.rows, alpha,
                                       dz.row(r0) + v0, dz.ld, block.data + c0, block.ld, v0 == 0 ? beta : A(1),
                                       dx.row(r0) + c0, dx.ld);
                        });
    }
  }

  // dw += alpha dz^T x, tiled over vocabulary rows. W, the weight's storage type (the
  // engine's weight_element), picks the GEMM (weight_gradient_gemm).
  template <class O, class A, class W = A>
  void grad_weight(matrix_view<const O> dz, matrix_view<const O> x, A alpha, matrix_view<A> dw,
                   weight_element<W> weight = {}) {
    grad_weight(dz, x, alpha, dw, A(1), weight);
  }

  // dw = alpha dz^T x + beta dw, beta 0 (dw's first chunk under options.overwrite_weight_gradients:
  // not read) or 1.
  template <class O, class A, class W = A>
  void grad_weight(matrix_view<const O> dz, matrix_view<const O> x, A alpha, matrix_view<A> dw, A beta,
                   weight_element<W> = {}) {
    const std::int64_t tile = vocab_tile_rows<A>(x.cols, dz.cols);
    [[maybe_unused]] const provider_scope scope;
    for_gemm_tiles(detail::ceil_div(dz.cols, tile), [&](std::int64_t t) {
      const std::int64_t first = t * tile, rows = std::min(tile, dz.cols - first);
      weight_gradient_gemm<W>(rows, x.cols, dz.rows, alpha, dz.data + first, dz.ld, x.data, x.ld, beta, dw.row(first),
                              dw.ld);
    });
  }

  // Scratch for the grad_weight below: one dW tile of about 4 MiB
  // (rounded_tile_rows; from the shapes alone) per slot, one slot per worker
  // (the provider's own threads count as one). `tokens`: the most rows of dz
  // one call passes.
  // None where the tiles go straight into a bf16 grad_weight (rounds_weight_gradient_into): O is
  // the GEMM operand type, G grad_weight's element.
  template <class A, class O = A, class G = A>
  std::int64_t weight_gradient_tile_elements(std::int64_t hidden, std::int64_t vocab_local, std::int64_t tokens) const {
    if (rounds_weight_gradient_into<A, O, G>(tokens)) return 0;
    const std::int64_t rows = rounded_tile_rows<A>(hidden, vocab_local, tokens);
    return hidden > INT64_MAX / rows ? INT64_MAX : rows * hidden;  // saturates
  }
  int weight_gradient_tile_slots() const { return provider_parallel ? 1 : threads(); }

  // dw += alpha dz^T x into a dw of another element type (adds_weight_gradient_tiles):
  // each tile of vocabulary rows is one GEMM into the worker's scratch, then
  // added into dw while in cache. Tiles from the shapes alone, as above. A
  // bf16 dw whose tiles the provider rounds in itself (rounds_weight_gradient_into;
  // `scratch` then null) takes them straight, with the same bits.
  template <class O, class A, class G, class W = A>
    requires(!std::same_as<A, G>)
  void grad_weight(matrix_view<const O> dz, matrix_view<const O> x, A alpha, matrix_view<G> dw, A* scratch,
                   weight_element<W> weight = {}) {
    grad_weight(dz, x, alpha, dw, scratch, weight_gradient_write::add, weight);
  }

  // The same, dw's rows written over with `overwrite` (overwrites_weight_gradient).
  template <class O, class A, class G, class W = A>
    requires(!std::same_as<A, G>)
  void grad_weight(matrix_view<const O> dz, matrix_view<const O> x, A alpha, matrix_view<G> dw, A* scratch,
                   weight_gradient_write write, weight_element<W> = {}) {
    [[maybe_unused]] const provider_scope scope;
    const bool overwrite = write == weight_gradient_write::overwrite;
    if constexpr (into_bf16_weight_gradient<A, O, G>) {
      if (!scratch || rounds_weight_gradient_into<A, O, G>(dz.rows)) {
        // No scratch to size, so tiles for the threads alone: the bits do not depend on them
        // (each element's sum runs over the tokens only, in one depth block).
        const std::int64_t tile = std::clamp<std::int64_t>(
            detail::ceil_div(detail::ceil_div(dz.cols, std::max(1, threads())), 32) * 32, 128, 512);
        const float beta = overwrite ? 0.0f : 1.0f;
        for_gemm_tiles(detail::ceil_div(dz.cols, tile), [&](std::int64_t t) {
          const std::int64_t first = t * tile, rows = std::min(tile, dz.cols - first);
          if constexpr (std::same_as<O, bfloat16>)
            gemm_.bf16_gemm_into_bf16(transpose::yes, transpose::no, rows, x.cols, dz.rows, alpha, dz.data + first,
                                      dz.ld, x.data, x.ld, beta, dw.row(first), dw.ld);
          else
            gemm_.split_bf16_gemm_into_bf16(transpose::yes, transpose::no, rows, x.cols, dz.rows, alpha,
                                            dz.data + first, dz.ld, x.data, x.ld, beta, dw.row(first), dw.ld);
        });
        return;
      }
    }
    const std::int64_t tile = rounded_tile_rows<A>(x.cols, dz.cols, dz.rows), h = x.cols;
    for_gemm_tiles_by_worker(detail::ceil_div(dz.cols, tile), [&](std::int64_t t, int worker) {
      const std::int64_t first = t * tile, rows = std::min(tile, dz.cols - first);
      A* sum = scratch + static_cast<std::int64_t>(worker) * tile * h;
      weight_gradient_gemm<W>(rows, h, dz.rows, alpha, dz.data + first, dz.ld, x.data, x.ld, A(0), sum, h);
      for (std::int64_t r = 0; r < rows; ++r) {
        if (overwrite)
          detail::convert_span(static_cast<const A*>(sum + r * h), dw.row(first + r), h);
        else
          detail::add_span(static_cast<const A*>(sum + r * h), dw.row(first + r), h);
      }
    });
  }

  // dw = alpha dz^T x + beta dw on an accumulator (rounds_accumulated_weight_gradient),
  // in the tiles above; with round_into.data, each tile is then added into
  // round_into while in cache.
  template <class O, class A, class G, class W = A>
    requires(!std::same_as<A, G>)
  void grad_weight(matrix_view<const O> dz, matrix_view<const O> x, A alpha, matrix_view<A> dw, A beta,
                   matrix_view<G> round_into, weight_element<W> weight = {}) {
    grad_weight(dz, x, alpha, dw, beta, round_into, weight_gradient_write::add, weight);
  }

  // The same, round_into's rows written over with `overwrite` (overwrites_weight_gradient).
  template <class O, class A, class G, class W = A>
    requires(!std::same_as<A, G>)
  void grad_weight(matrix_view<const O> dz, matrix_view<const O> x, A alpha, matrix_view<A> dw, A beta,
                   matrix_view<G> round_into, weight_gradient_write write, weight_element<W> = {}) {
    const std::int64_t tile = rounded_tile_rows<A>(x.cols, dz.cols, dz.rows), h = x.cols;
    [[maybe_unused]] const provider_scope scope;
    for_gemm_tiles(detail::ceil_div(dz.cols, tile), [&](std::int64_t t) {
      const std::int64_t first = t * tile, rows = std::min(tile, dz.cols - first);
      weight_gradient_gemm<W>(rows, h, dz.rows, alpha, dz.data + first, dz.ld, x.data, x.ld, beta, dw.row(first),
                              dw.ld);
      if (round_into.data) {
        for (std::int64_t r = 0; r < rows; ++r) {
          if (write == weight_gradient_write::overwrite)
            detail::convert_span(static_cast<const A*>(dw.row(first + r)), round_into.row(first + r), h);
          else
            detail::add_span(static_cast<const A*>(dw.row(first + r)), round_into.row(first + r), h);
        }
      }
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

  template <class A, class B>
  void add_bias(matrix_view<A> logits, vector_view<const B> bias, A alpha) {
    for_rows(logits.rows, logits.cols, [&](std::int64_t r) {
      A* row = logits.row(r);
      for (std::int64_t j = 0; j < logits.cols; ++j) row[j] += alpha * static_cast<A>(bias.data[j]);
    });
  }

  // out[j] += alpha sum_r dz[r, j], summed in row order per column: column tiles
  // from the shapes alone, so the bits do not depend on threads().
  template <class O, class A>
  void column_sums(matrix_view<const O> dz, A alpha, vector_view<A> out) {
    constexpr std::int64_t tile = 512;
    pool_->parallel_for(detail::ceil_div(dz.cols, tile), 1, [&](std::int64_t begin, std::int64_t end, int) {
      for (std::int64_t t = begin; t < end; ++t) {
        const std::int64_t first = t * tile, cols = std::min(tile, dz.cols - first);
        A sums[tile] = {};
        for (std::int64_t r = 0; r < dz.rows; ++r) {
          const O* row = dz.row(r) + first;
          for (std::int64_t j = 0; j < cols; ++j) sums[j] += static_cast<A>(row[j]);
        }
        for (std::int64_t j = 0; j < cols; ++j) out.data[first + j] += alpha * sums[j];
      }
    });
  }

  template <class A>
  void fill_zero(matrix_view<A> target) {
    for_rows(target.rows, target.cols, [&](std::int64_t r) { detail::zero_row(target.row(r), target.cols); });
  }

  // A zero byte into every 4 KiB page of [data, data + bytes), the threads over disjoint
  // ranges of pages (core/backend.hpp: touches_pages).
  void touch_pages(void* data, std::size_t bytes) {
    if (bytes == 0) return;
    constexpr std::uintptr_t page = 4096;
    const auto begin = reinterpret_cast<std::uintptr_t>(data), end = begin + bytes;
    const auto first_page = static_cast<std::int64_t>(begin / page);
    const auto pages = static_cast<std::int64_t>((end - 1) / page) - first_page + 1;
    pool_->parallel_for(pages, 256, [&](std::int64_t from, std::int64_t to, int) {
      for (std::int64_t p = from; p < to; ++p) {
        const std::uintptr_t at = std::max(begin, static_cast<std::uintptr_t>(first_page + p) * page);
        *reinterpret_cast<volatile unsigned char*>(at) = 0;
      }
    });
  }

  // ---- row passes ----------------------------------------------------------

  template <class A>
  void soft_cap(matrix_view<A> logits, const detail::soft_cap_map<A>& cap) {
    for_rows(logits.rows, logits.cols, [&](std::int64_t r) { detail::soft_cap_row(logits.row(r), logits.cols, cap); });
  }

  // The vocabulary order's logits kept in 2 bytes between its sweeps (keeps_logit_ratios).
  void keep_logit_ratios(matrix_view<const float> logits, matrix_view<bfloat16> ratios, float* centres) {
    for_rows(logits.rows, logits.cols,
             [&](std::int64_t r) { centres[r] = detail::keep_ratio_row(logits.row(r), logits.cols, ratios.row(r)); });
  }
  // The same ratios from a block that row_statistics left as exp(z - c) (keep_exp): rounded, c kept.
  void keep_exp_ratios(matrix_view<const float> exps, const detail::row_partial<float>* partials,
                       matrix_view<bfloat16> ratios, float* centres) {
    for_rows(exps.rows, exps.cols, [&](std::int64_t r) {
      detail::convert_span(exps.row(r), ratios.row(r), exps.cols);
      centres[r] = partials[r].max;
    });
  }
  void expand_logit_ratios(matrix_view<const bfloat16> ratios, const float* centres, matrix_view<float> logits) {
    for_rows(logits.rows, logits.cols,
             [&](std::int64_t r) { detail::expand_ratio_row(ratios.row(r), logits.cols, centres[r], logits.row(r)); });
  }

  template <class A, class I>
  void row_statistics(const statistics_args<A, I>& args) {
    for_rows(args.logits.rows, args.logits.cols, [&](std::int64_t r) {
      A* row = args.logits.row(r);
      const std::int64_t n = args.logits.cols;
      if (args.soft_cap.enabled()) detail::soft_cap_row(row, n, args.soft_cap);
      detail::row_partial<A> partial;
      partial.max = detail::exp_centre(detail::row_max(row, n));  // a row of -inf: centred on 0, adds 0
      const std::int64_t target = detail::local_target(args.targets[r], args.vocab_start, args.ignore_index, n);
      if (target >= 0) partial.target_logit = row[target];
      if (args.with_logit_sum) partial.sum_logit = detail::reduce_row(row, n, A(0), [](auto v) { return v; }, detail::plus);
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

  // gathered holds `ranks` arrays of `rows` partials, `stride` apart, merged in rank order.
  template <class A>
  void merge_partials(const detail::row_partial<A>* gathered, int ranks, std::int64_t rows, std::int64_t stride,
                      detail::row_partial<A>* merged) {
    for (std::int64_t r = 0; r < rows; ++r) {
      detail::row_partial<A> total = gathered[r];
      for (int k = 1; k < ranks; ++k) total = detail::merge(total, gathered[k * stride + r]);
      merged[r] = total;
    }
  }

  template <class A, class I>
  void finalize_rows(const finalize_args<A, I>& args, std::int64_t rows) {
    for (std::int64_t r = 0; r < rows; ++r) {
      const bool ignored = args.targets[r] == args.ignore_index;
      const auto result = detail::finalize(args.partials[r], ignored);
      if (args.logprobs) args.logprobs[r] = result.logprob;
      if (args.lse) args.lse[r] = result.lse;
      if (args.entropy) args.entropy[r] = result.entropy;
      if (args.mean_centred) args.mean_centred[r] = -result.entropy;
      if (args.mean_logit) args.mean_logit[r] = ignored ? A(0) : args.partials[r].sum_logit * args.inverse_vocab;
    }
  }

  template <class A, class I>
  void mean_centred_logits(const mean_centred_logit_args<A, I>& args) {
    for_rows(args.logits.rows, args.logits.cols, [&](std::int64_t r) {
      const bool ignored = args.targets[r] == args.ignore_index;
      args.out[r] = ignored ? A(0) : detail::mean_centred_logit_row(args.logits.row(r), args.logits.cols, args.lse[r]);
    });
  }

  // With a gradient operand (bf16 operands), each row of dz is computed in
  // the logit block as always, then rounded once, while it is still in
  // cache, over the first half of its own row (dz_operand_in_logit_rows: no
  // operand block, so a chunk holds 4 bytes per logit, not 6).
  static constexpr bool dz_operand_in_logit_rows = bf16_operands;

  template <class A, class I, class O>
  void logit_gradients(const gradient_args<A, I, O>& args) {
    for_rows(args.logits.rows, args.logits.cols, [&](std::int64_t r) {
      A* row = args.logits.row(r);
      logit_gradient_row(args, r, row);
      if constexpr (!std::same_as<O, A>) {
        detail::round_row_to_bf16(row, args.gradient_operand + r * args.gradient_operand_ld, args.logits.cols);
      }
    });
  }

  // Each id of row r's target set held here adds its g (times the soft-cap's slope at its logit).
  template <class A, class I, class O>
  static void add_target_set_gradients(const gradient_args<A, I, O>& args, std::int64_t r, A* row) {
    if (!args.set_grads) return;
    const I* ids = args.set_ids + r * args.set_size;
    const A* grads = args.set_grads + r * args.set_size;
    for (std::int64_t k = 0; k < args.set_size; ++k) {
      const std::int64_t column = detail::local_target(ids[k], args.vocab_start, args.ignore_index, args.logits.cols);
      if (column < 0) continue;
      const A slope = args.soft_cap.enabled()
                          ? detail::soft_cap_slope(args.set_logits[r * args.set_size + k], args.soft_cap)
                          : A(1);
      row[column] += grads[k] * slope;
    }
  }

  // ---- target sets (top-K): see target_set_args --------------------------------

  template <class A, class I>
  void target_set_rows(const target_set_args<A, I>& args, std::int64_t rows) {
    const std::int64_t k_ids = args.set_size;
    for (std::int64_t r = 0; r < rows; ++r) {
      const I* ids = args.ids.data + r * k_ids;
      bool counted = false;
      A sum = 0;
      for (std::int64_t k = 0; k < k_ids; ++k) {
        if (static_cast<std::int64_t>(ids[k]) == args.ignore_index) continue;
        counted = true;
        if (args.grads) sum += args.grads[r * k_ids + k];
      }
      args.stand_ins[r] = static_cast<I>(counted ? detail::held_by_no_shard(args.ignore_index) : args.ignore_index);
      if (args.grads) args.grad_sums[r] = sum;
    }
  }

  template <class A, class I>
  void target_set_logits(const target_set_args<A, I>& args, std::int64_t rows) {
    const std::int64_t k_ids = args.set_size;
    for (std::int64_t r = 0; r < rows; ++r) {
      for (std::int64_t k = 0; k < k_ids; ++k) {
        const std::int64_t column =
            detail::local_target(args.ids.data[r * k_ids + k], args.vocab_start, args.ignore_index, args.logits.cols);
        args.values[r * k_ids + k] = column >= 0 ? args.logits.row(r)[column] : A(0);
      }
    }
  }

  template <class A, class I>
  void target_set_logprobs(const target_set_args<A, I>& args, std::int64_t rows) {
    const std::int64_t k_ids = args.set_size;
    for (std::int64_t r = 0; r < rows; ++r) {
      for (std::int64_t k = 0; k < k_ids; ++k) {
        const std::int64_t at = r * k_ids + k;
        const bool ignored = static_cast<std::int64_t>(args.ids.data[at]) == args.ignore_index;
        args.out[at] = ignored ? A(0) : args.values[at] - args.lse[r];
      }
    }
  }

 private:
  using provider_scope = typename detail::provider_call_scope<Gemm>::type;
  static constexpr bool provider_parallel = gemm_parallelises_itself<Gemm>;

  // Whether the GEMMs read the weight as stored: it has the compute type, or it
  // is bf16 and so are the operands (bf16_operands); else it is widened per tile.
  template <class O, class T>
  static constexpr bool weight_as_stored = !half_precision<T> || std::same_as<O, std::remove_cv_t<T>>;

  // One provider call on operands of type O: its fp32 / fp64 GEMM, or its bf16 GEMM.
  template <class O, class W, class A>
  void operand_gemm(transpose ta, transpose tb, std::int64_t m, std::int64_t n, std::int64_t k, A alpha, const O* a,
                    std::int64_t lda, const W* b, std::int64_t ldb, A beta, A* c, std::int64_t ldc) const {
    if constexpr (std::same_as<O, bfloat16>) {
      gemm_.bf16_gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    } else {
      gemm_.gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    }
  }

  template <class A, class I, class O>
  static void logit_gradient_row(const gradient_args<A, I, O>& args, std::int64_t r, A* row) {
    const bool capped = args.soft_cap.enabled();
    const std::int64_t n = args.logits.cols;
    const A g = args.grad_logprobs[r];
    const A h = args.grad_entropy ? args.grad_entropy[r] : A(0);
    const A q = detail::lse_gradient(args.grad_lse, args.lse_squared, args.lse, r);
    const A m = args.grad_mean_logit ? args.grad_mean_logit[r] : A(0);
    const bool ignored = args.targets[r] == args.ignore_index;
    if (ignored || (g == A(0) && h == A(0) && q == A(0) && m == A(0))) {
      detail::zero_row(row, n);
      if (!ignored) add_target_set_gradients(args, r, row);  // a set's +g terms need no row sum
      return;
    }
    const std::int64_t target = detail::local_target(args.targets[r], args.vocab_start, args.ignore_index, n);
    const A target_slope = target >= 0 && capped ? detail::soft_cap_slope(row[target], args.soft_cap) : A(1);
    const auto terms = detail::fold_row_terms(g, q, m, args.inverse_vocab);
    if (args.exp_ratios) {
      detail::scale_ratio_row(args.exp_ratios + r * args.exp_ratios_ld, n,
                              -terms.grad_logprob_of_p * std::exp(args.exp_ratio_centres[r] - args.lse[r]),
                              terms.uniform, row);
    } else if (args.exp_row_max) {
      detail::scale_row(row, n, -terms.grad_logprob_of_p * std::exp(args.exp_row_max[r].max - args.lse[r]),
                        terms.uniform);
    } else {
      dispatch_gradient_row(row, n, args.lse[r], terms.grad_logprob_of_p, h,
                            args.mean_centred_logit ? args.mean_centred_logit[r] : A(0), terms.uniform,
                            args.soft_cap, args.grad_entropy != nullptr, capped);
    }
    if (target >= 0) row[target] += g * target_slope;
    add_target_set_gradients(args, r, row);
  }

  // Vocabulary rows per GEMM tile, from the shapes alone: about 16 tiles to
  // share, but never under 1024 rows (single-threaded BLAS GEMMs only reach
  // full speed from about 512 columns up) nor over 4096. A 2-byte weight's
  // tiles are widened into two slots of scratch that the GEMM tiles read from
  // cache (for_widened_tiles), so there they are half as tall (about 32 tiles,
  // 512 to 2048 rows) and each stays within about 2^20 fp32 elements (but at
  // least 256 rows): the two slots together as large as one tile before.
  // They are also at most a quarter of the rows at hand (down to 256): the
  // vocabulary order's 1,024-row tiles widen 256 rows at a time, which took
  // the same time as 512 (N 1,024, V 32,000, OpenBLAS on Zen 3) in 2 MiB
  // less.
  template <class T>
  static constexpr std::int64_t vocab_tile_rows(std::int64_t hidden, std::int64_t vocab_local) {
    std::int64_t rows = 0;
    if constexpr (half_precision<T>) {
      rows = std::clamp<std::int64_t>(detail::ceil_div(vocab_local, 32), 512, 2048);
      rows = std::min(rows, std::max<std::int64_t>(256, (std::int64_t{1} << 20) / std::max<std::int64_t>(hidden, 1)));
      rows = std::min(rows, std::max<std::int64_t>(256, vocab_local / 4));
    } else {
      rows = std::clamp<std::int64_t>(detail::ceil_div(vocab_local, 16), 1024, 4096);
    }
    return std::max<std::int64_t>(1, std::min(rows, vocab_local));
  }

  // Vocabulary rows of a dW tile that is added into a grad_weight of another
  // type right after its GEMM: about 4 MiB (each GEMM packs all of x again,
  // so not much smaller; the add reads the tile back from cache, so not much
  // larger), at least 16 rows, and at most a sixteenth of the rows at hand
  // (the shard, or the vocabulary order's tile of it) so that the tiles of a
  // few threads stay well below one [V_local, H] accumulator; or, where that
  // is fewer, as many as the call's `tokens` (x's rows, the GEMM's depth), up
  // to a quarter of the rows at hand: a tile then holds no more than x's rows
  // would in fp32, and its GEMM repays packing them. A sixteenth of the
  // vocabulary order's 4,096-row tile (256-row GEMMs) made bf16 at N = 1,024,
  // H = 1,024, V = 128,256 on one thread take 2.09 s, 1.91 s with 1,024 rows.
  template <class A>
  static constexpr std::int64_t rounded_tile_rows(std::int64_t hidden, std::int64_t vocab_local, std::int64_t tokens) {
    constexpr std::int64_t tile_bytes = std::int64_t{4} << 20;
    const std::int64_t rows = std::max<std::int64_t>(
        16, tile_bytes / static_cast<std::int64_t>(sizeof(A)) / std::max<std::int64_t>(hidden, 1));
    const std::int64_t share = std::max(detail::ceil_div(vocab_local, 16), std::min(tokens, detail::ceil_div(vocab_local, 4)));
    return std::max<std::int64_t>(1, std::min(rows, share));
  }

  // Tiles of a GEMM's [rows, cols] output, from the shapes alone: about
  // `target` of them (8: every thread of a small pool gets some), no thinner than 256
  // rows or 256 columns: single-threaded GEMMs slow down below that, with the
  // dX GEMM's long depth (the vocabulary) most. Measured at depth 32,000, one
  // thread, [256, 1,024] of dX: MKL's sgemm ran 256 x 128 tiles at 74 GFLOP/s,
  // 256 x 256 at 127, 128 x 1,024 at 92; OpenBLAS (SkylakeX) 95, 108 and 111.
  // (Chunks of 256 tokens had made lce_torch 1.27x slower than one chunk.) Each
  // piece of rows re-reads the operand shared by the rows (cols x k), each
  // piece of columns the rows' operand (rows x k): of the splits that reach
  // the target, the one that reads the least.
  //
  // GEMMs on bf16 operands (AMX tiles, MKL's cblas_gemm_bf16bf16f32) want
  // larger pieces still: dX at depth V, [512, 1,024] and [1,024, 1,024], two
  // threads each running single-threaded calls, took 753-1,070 GFLOP/s in 2 x 4
  // tiles and 986-1,288 in two (one thread: 517-569 against 618-736); hence
  // bf16_operand_floor, 512 x 512.
  struct output_tiling {
    static constexpr std::int64_t default_target = 8, min_rows = 256, min_cols = 256, bf16_operand_floor = 512;
    static constexpr std::int64_t max_count = 2 * default_target;  // r pieces x ceil(target / r) < 2 target
    std::int64_t row_tile = 1, col_tile = 1, row_tiles = 0, col_tiles = 0;

    struct range {
      std::int64_t row, rows, col, cols;
    };

    output_tiling(std::int64_t rows, std::int64_t cols, std::int64_t target = default_target,
                  std::int64_t least_rows = min_rows, std::int64_t least_cols = min_cols) {
      if (rows <= 0 || cols <= 0) return;
      const std::int64_t max_row_pieces = std::max<std::int64_t>(1, rows / least_rows);
      const std::int64_t max_col_pieces = std::max<std::int64_t>(1, cols / least_cols);
      std::int64_t best_rows = 1, best_cols = 1, best_tiles = 0, best_reads = 0;
      for (std::int64_t r = 1; r <= std::min(max_row_pieces, target); ++r) {
        const std::int64_t c = std::min(max_col_pieces, detail::ceil_div(target, r));
        const std::int64_t tiles = std::min(r * c, target), reads = r * cols + c * rows;
        if (tiles > best_tiles || (tiles == best_tiles && reads < best_reads)) {
          best_rows = r, best_cols = c, best_tiles = tiles, best_reads = reads;
        }
      }
      row_tile = detail::ceil_div(rows, best_rows);
      col_tile = std::min(cols, detail::ceil_div(detail::ceil_div(cols, best_cols), 16) * 16);  // whole cache lines
      row_tiles = detail::ceil_div(rows, row_tile);
      col_tiles = detail::ceil_div(cols, col_tile);
      last_row_ = rows, last_col_ = cols;
    }

    // All the rows at once, the columns `width` at a time (the last tile shorter).
    static output_tiling in_columns_of(std::int64_t rows, std::int64_t cols, std::int64_t width) {
      output_tiling tiles(rows, cols, 1);
      if (tiles.count() > 0) {
        tiles.col_tile = std::clamp<std::int64_t>(width, 1, cols);
        tiles.col_tiles = detail::ceil_div(cols, tiles.col_tile);
      }
      return tiles;
    }

    std::int64_t count() const { return row_tiles * col_tiles; }

    range tile(std::int64_t t) const {
      const std::int64_t r0 = t / col_tiles * row_tile, c0 = t % col_tiles * col_tile;
      return {r0, std::min(row_tile, last_row_ - r0), c0, std::min(col_tile, last_col_ - c0)};
    }

   private:
    std::int64_t last_row_ = 0, last_col_ = 0;
  };

  // Whether the provider can round dW tiles into a bf16 grad_weight itself: bf16 operands
  // (bf16_gemm_into_bf16), or dz in fp32 split as it is packed and the hidden rows as floats
  // holding bf16 values (split_bf16_gemm_into_bf16; a bf16 grad_weight means a bf16 weight).
  template <class A, class O, class G>
  static constexpr bool into_bf16_weight_gradient =
      std::same_as<A, float> && std::same_as<G, bfloat16> &&
      ((std::same_as<O, bfloat16> && bf16_into_bf16_gemm_provider<Gemm>) ||
       (std::same_as<O, float> && split_bf16_into_bf16_gemm_provider<Gemm>));

  // Whether dW tiles of at most `tokens` rows of dz go straight into a bf16 grad_weight now: the
  // provider runs it well here and the tokens fit one of its depth blocks (the sum is rounded once).
  template <class A, class O, class G>
  bool rounds_weight_gradient_into(std::int64_t tokens) const {
    if constexpr (into_bf16_weight_gradient<A, O, G>) {
      if (tokens > max_depth_rounded_into_bf16 || !gemm_.gemm_into_bf16_available()) return false;
      if constexpr (std::same_as<O, float>) return gemm_.split_bf16_gemm_available();
      return true;
    } else {
      return false;
    }
  }
  // Deeper tiles keep the fp32 scratch: at 1,024 tokens the kernel's one depth block holds
  // half of H = 1,024 columns of packed X, so dz^T is packed twice, where the scratch path
  // packs it once in two 512-deep blocks (lce_torch, bf16, N = 1,024, 2 threads: 0.175 s
  // against 0.181 s at V = 32,000, 0.620 s against 0.650 s at V = 128,256).
  static constexpr std::int64_t max_depth_rounded_into_bf16 = 512;

  template <class A, class T>
  static constexpr bool bf16_weight =
      bf16_gemm_provider<Gemm> && std::is_same_v<A, float> && std::is_same_v<std::remove_cv_t<T>, bfloat16>;
  template <class A, class T>
  static constexpr bool split_bf16_weight = bf16_weight<A, T> && split_bf16_gemm_provider<Gemm>;

  // One tile of dW: c = alpha dz^T x + beta c. For a bfloat16 weight (W) whose hidden rows x
  // are therefore bf16 values, on the provider's split bf16 GEMM where it has one (dz kept
  // to 16 bits, x exact); otherwise on the operand type's GEMM.
  template <class W, class O, class A>
  void weight_gradient_gemm(std::int64_t m, std::int64_t n, std::int64_t k, A alpha, const O* dz, std::int64_t ldz,
                            const O* x, std::int64_t ldx, A beta, A* c, std::int64_t ldc) const {
    if constexpr (split_bf16_weight<A, W> && std::same_as<O, float>) {
      if (gemm_.split_bf16_gemm_available()) {
        gemm_.split_bf16_gemm(transpose::yes, transpose::no, m, n, k, alpha, dz, ldz, x, ldx, beta, c, ldc);
        return;
      }
    }
    operand_gemm(transpose::yes, transpose::no, m, n, k, alpha, dz, ldz, x, ldx, beta, c, ldc);
  }

  // Logits from a bf16 weight through the provider's bf16 GEMM: the chunk's hidden rows (fp32,
  // widened from bf16 by the engine) are rounded back to bf16 in blocks of rows
  // that fit the weight scratch, then each vocabulary tile of each block is one
  // bf16 GEMM. Returns false (nothing to keep: the caller recomputes `out`) when
  // the CPU lacks bf16 GEMMs, a row is too long for the scratch, or a hidden value
  // is not a bf16 value (so rounding would change it).
  bool bf16_logits(matrix_view<const float> x, matrix_view<const bfloat16> w, float alpha, matrix_view<float> out,
                   void* scratch) {
    if (x.cols == 0 || w.rows == 0 || !gemm_.bf16_gemm_available()) return false;
    const std::int64_t capacity = 2 * weight_block_elements<bfloat16>(x.cols, w.rows);  // bf16 elements
    const std::int64_t block_rows = std::min(x.rows, capacity / std::max<std::int64_t>(x.cols, 1));
    if (block_rows < 1) return false;
    auto* const xb = static_cast<bfloat16*>(scratch);
    const std::int64_t tile = vocab_tile_rows<float>(w.cols, w.rows), tiles = detail::ceil_div(w.rows, tile);
    for (std::int64_t first = 0; first < x.rows; first += block_rows) {
      const std::int64_t rows = std::min(block_rows, x.rows - first);
      std::atomic<bool> inexact{false};
      for_rows(rows, x.cols, [&](std::int64_t r) {
        if (!detail::round_to_bf16_exact(x.row(first + r), xb + r * x.cols, x.cols)) inexact.store(true);
      });
      if (inexact.load()) return false;
      for_gemm_tiles(tiles, [&](std::int64_t t) {
        const std::int64_t v0 = t * tile, cols = std::min(tile, w.rows - v0);
        gemm_.bf16_gemm(transpose::no, transpose::yes, rows, cols, x.cols, alpha, xb, x.cols, w.row(v0), w.ld, 0.0f,
                        out.row(first) + v0, out.ld);
      });
    }
    return true;
  }

  // dX = alpha dz w + beta dx from a bf16 weight through the provider's bf16 GEMM. dz (fp32) is kept to
  // 16 significant bits as two bf16 parts, hi = bf16(dz) and lo = bf16(dz - hi),
  // staged one tile of vocabulary columns at a time into the two slots of the
  // weight scratch (for_staged_tiles); each output tile of dX adds hi w + lo w
  // tile after tile, in order. Returns false (dx untouched) when the CPU lacks
  // bf16 GEMMs or the scratch holds too few columns of dz.
  bool bf16_grad_hidden(matrix_view<const float> dz, matrix_view<const bfloat16> w, float alpha,
                        matrix_view<float> dx, const output_tiling& tiles, void* scratch, float beta) {
    if (w.rows == 0 || dz.rows == 0 || !gemm_.bf16_gemm_available()) return false;
    const std::int64_t capacity = 2 * weight_block_elements<bfloat16>(w.cols, w.rows);  // bf16 elements
    // Two slots, each hi and lo of [dz.rows, tile] (whole cache lines of columns).
    std::int64_t tile = std::min(w.rows, capacity / (4 * std::max<std::int64_t>(dz.rows, 1)));
    if (tile < w.rows) tile = tile / 32 * 32;
    if (tile < std::min<std::int64_t>(w.rows, 128)) return false;
    const std::int64_t slot = 2 * dz.rows * tile;
    const std::int64_t piece = std::max<std::int64_t>(1, (std::int64_t{1} << 16) / tile);
    auto* const base = static_cast<bfloat16*>(scratch);
    for_staged_tiles(
        detail::ceil_div(w.rows, tile), detail::ceil_div(dz.rows, piece), tiles.count(), /*chained=*/true,
        [&](std::int64_t k, std::int64_t p) {
          const std::int64_t v0 = k * tile, cols = std::min(tile, w.rows - v0);
          bfloat16* const hi = base + k % 2 * slot;
          for (std::int64_t r = p * piece; r < std::min(dz.rows, (p + 1) * piece); ++r)
            detail::split_to_bf16(dz.row(r) + v0, hi + r * tile, hi + (dz.rows + r) * tile, cols);
        },
        [&](std::int64_t k, std::int64_t j) {
          const auto [r0, rows, c0, cols] = tiles.tile(j);
          const std::int64_t v0 = k * tile, depth = std::min(tile, w.rows - v0);
          const bfloat16* const hi = base + k % 2 * slot;
          gemm_.bf16_gemm(transpose::no, transpose::no, rows, cols, depth, alpha, hi + r0 * tile, tile,
                          w.row(v0) + c0, w.ld, k > 0 ? 1.0f : beta, dx.row(r0) + c0, dx.ld);
          gemm_.bf16_gemm(transpose::no, transpose::no, rows, cols, depth, alpha, hi + (dz.rows + r0) * tile, tile,
                          w.row(v0) + c0, w.ld, 1.0f, dx.row(r0) + c0, dx.ld);
        });
    return true;
  }

  // Runs gemm(block, v0, j) for every tile of vocabulary rows [v0, v0 +
  // block.rows) of a 2-byte weight and every output tile j in [0, jobs), in
  // one pass of the pool: tile k is widened to fp32 (once, by all threads, in
  // pieces) into slot k % 2 of `scratch` (weight_block_elements<T>) while the
  // GEMMs of tile k - 1 run, so no thread waits at a barrier between tiles
  // (for_staged_tiles).
  template <class T, class Multiply>
  void for_widened_tiles(matrix_view<const T> w, void* scratch, std::int64_t jobs, bool chained, Multiply&& gemm) {
    const std::int64_t tile = vocab_tile_rows<T>(w.cols, w.rows), tiles = detail::ceil_div(w.rows, tile);
    const std::int64_t piece = std::max<std::int64_t>(1, (std::int64_t{1} << 16) / std::max<std::int64_t>(w.cols, 1));
    float* const slots[2] = {static_cast<float*>(scratch), static_cast<float*>(scratch) + tile * w.cols};
    for_staged_tiles(
        tiles, detail::ceil_div(tile, piece), jobs, chained,
        [&](std::int64_t k, std::int64_t p) {
          const std::int64_t v0 = k * tile, rows = std::min(tile, w.rows - v0);
          for (std::int64_t r = p * piece; r < std::min(rows, (p + 1) * piece); ++r)
            detail::convert_span(w.row(v0 + r), slots[k % 2] + r * w.cols, w.cols);
        },
        [&](std::int64_t k, std::int64_t j) {
          const std::int64_t v0 = k * tile, rows = std::min(tile, w.rows - v0);
          gemm(matrix_view<const float>{slots[k % 2], rows, w.cols, w.cols}, v0, j);
        });
  }

  // Runs stage(k, p) for every piece p in [0, pieces) of every tile k in [0,
  // tiles), which writes that piece of tile k into slot k % 2 of some scratch,
  // and gemm(k, j) for every job j in [0, jobs), which reads slot k % 2, all in
  // one pass of the pool. Grains are handed out in the order W0 W1 G0 G1 W2 G2
  // W3 G3 ... (Wk: the pieces of staging k, Gk: its GEMMs); each waits only for
  // what it needs, all of it earlier in that order (so someone is already on it):
  //   Wk (k >= 2)  the GEMMs of tile k - 2, which read the slot it rewrites;
  //   Gk, job j    Wk, and with `chained` job j of tile k - 1, which it adds to
  //                (so each output tile sums over the vocabulary tiles in order).
  // A provider that parallelises itself: tile after tile, its pieces staged by
  // the pool, then its GEMMs from the calling thread, in order.
  template <class Stage, class Multiply>
  void for_staged_tiles(std::int64_t tiles, std::int64_t pieces, std::int64_t jobs, bool chained, Stage&& stage,
                        Multiply&& gemm) {
    if (jobs <= 0 || tiles <= 0) return;
    if constexpr (provider_parallel) {
      for (std::int64_t k = 0; k < tiles; ++k) {
        pool_->parallel_for(pieces, 1, [&](std::int64_t begin, std::int64_t end, int) {
          for (std::int64_t p = begin; p < end; ++p) stage(k, p);
        });
        pool_->rest();
        for (std::int64_t j = 0; j < jobs; ++j) gemm(k, j);
      }
    } else {
      for_staged_tiles_concurrently(tiles, pieces, jobs, chained, stage, gemm);
    }
  }

  template <class Stage, class Multiply>
  void for_staged_tiles_concurrently(std::int64_t tiles, std::int64_t pieces, std::int64_t jobs, bool chained,
                                     Stage& stage, Multiply& gemm) {

    // Progress, counted up (never reset): pieces staged and GEMMs done into
    // each slot over all its tiles so far, and per job the tiles it has done.
    struct alignas(64) counter {
      std::atomic<std::int64_t> value{0};
    };
    counter staged[2], gemms_done[2];
    counter job_tiles[output_tiling::max_count];  // with `chained` (its jobs are output tiles)
    detail::expects(!chained || jobs <= output_tiling::max_count, "for_staged_tiles: ", jobs, " chained jobs");
    std::atomic<bool> failed{false};
    const auto wait_for = [&failed](auto&& ready) {
      for (unsigned spin = 0;; ++spin) {
        if (ready()) return true;
        if (failed.load(std::memory_order_relaxed)) return false;  // a grain threw: the pool rethrows it
        if (spin < 4096) detail::spin_pause();
        else std::this_thread::yield();
      }
    };
    const auto at_least = [](const counter& c, std::int64_t n) { return c.value.load(std::memory_order_acquire) >= n; };

    const auto prepare = [&](std::int64_t k, std::int64_t p) {
      if (k >= 2 && !wait_for([&] { return at_least(gemms_done[k % 2], k / 2 * jobs); })) return;
      stage(k, p);
      staged[k % 2].value.fetch_add(1, std::memory_order_release);
    };
    const auto multiply = [&](std::int64_t k, std::int64_t j) {
      if (!wait_for([&] { return at_least(staged[k % 2], (k / 2 + 1) * pieces); })) return;
      if (chained && k >= 1 && !wait_for([&] { return at_least(job_tiles[j], k); })) return;
      gemm(k, j);
      if (chained) job_tiles[j].value.store(k + 1, std::memory_order_release);
      gemms_done[k % 2].value.fetch_add(1, std::memory_order_release);
    };
    // Grain i of the order above.
    const std::int64_t head = std::min<std::int64_t>(tiles, 2) * pieces + std::min<std::int64_t>(tiles, 2) * jobs;
    const auto run = [&](std::int64_t i) {
      if (i < head) {
        const std::int64_t stagings = std::min<std::int64_t>(tiles, 2) * pieces;
        if (i < stagings) return prepare(i / pieces, i % pieces);
        return multiply((i - stagings) / jobs, (i - stagings) % jobs);
      }
      const std::int64_t k = 2 + (i - head) / (pieces + jobs), r = (i - head) % (pieces + jobs);
      return r < pieces ? prepare(k, r) : multiply(k, r - pieces);
    };
    pool_->parallel_for(tiles * (pieces + jobs), 1, [&](std::int64_t begin, std::int64_t end, int) {
      try {
        for (std::int64_t i = begin; i < end; ++i) run(i);
      } catch (...) {
        failed.store(true, std::memory_order_relaxed);
        throw;
      }
    });
  }

  // GEMM tiles on the pool, or in order on the calling thread for a provider
  // that parallelises itself.
  template <class Body>
  void for_gemm_tiles(std::int64_t tiles, Body&& body) {
    if constexpr (provider_parallel) {
      pool_->rest();  // the provider's threads take the cores
      for (std::int64_t t = 0; t < tiles; ++t) body(t);
    } else {
      pool_->parallel_for(tiles, 1, [&](std::int64_t begin, std::int64_t end, int) {
        for (std::int64_t t = begin; t < end; ++t) body(t);
      });
    }
  }

  // The same, telling body(t, worker) which worker (0 .. threads() - 1) runs it.
  template <class Body>
  void for_gemm_tiles_by_worker(std::int64_t tiles, Body&& body) {
    if constexpr (provider_parallel) {
      pool_->rest();
      for (std::int64_t t = 0; t < tiles; ++t) body(t, 0);
    } else {
      pool_->parallel_for(tiles, 1, [&](std::int64_t begin, std::int64_t end, int worker) {
        for (std::int64_t t = begin; t < end; ++t) body(t, worker);
      });
    }
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

  template <class A>
  static void dispatch_gradient_row(A* row, std::int64_t n, A lse, A g, A h, A mean_centred, A uniform,
                                    const detail::soft_cap_map<A>& cap, bool with_entropy, bool capped) {
    if (with_entropy) {
      capped ? detail::gradient_row<A, true, true>(row, n, lse, g, h, mean_centred, uniform, cap)
             : detail::gradient_row<A, true, false>(row, n, lse, g, h, mean_centred, uniform, cap);
    } else {
      capped ? detail::gradient_row<A, false, true>(row, n, lse, g, h, mean_centred, uniform, cap)
             : detail::gradient_row<A, false, false>(row, n, lse, g, h, mean_centred, uniform, cap);
    }
  }

  // Output tiles per GEMM: enough for every thread, or one for a provider
  // that parallelises itself.
  static constexpr std::int64_t tile_target = provider_parallel ? 1 : output_tiling::default_target;

  Gemm gemm_;
  std::unique_ptr<detail::thread_pool> pool_;
  scratch_pages pages_;
};

// The CPU backend with the BLAS lce links.
using host = basic_host<cblas_gemm>;
// The same, with a bfloat16 operator's three GEMMs on bf16 operands (dz rounded once to bf16).
using host_bf16_operands = basic_host<cblas_gemm_bf16_operands>;

static_assert(backend<host>);
static_assert(backend<host_bf16_operands>);
static_assert(overwrites_weight_gradient<host, float, float, bfloat16> &&
              overwrites_weight_gradient<host_bf16_operands, bfloat16, float, bfloat16> &&
              overwrites_compute_weight_gradient<host, float, float>);

LCE_END_NAMESPACE
