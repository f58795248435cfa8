#pragma once
// What the chunk loop asks of a backend, and the concept that spells it out.
//
// The operator's sweep (detail/sweep.hpp) is written once; a backend supplies
// memory, the three GEMMs of a chunk, element conversions and the row passes.
// Row passes receive one of the small argument structs below, so that a new
// backend (CUDA) implements the same list with its own kernels around the
// shared row math of core/row_math.hpp.

#include <lce/core/config.hpp>
#include <lce/core/dtypes.hpp>
#include <lce/core/row_math.hpp>
#include <lce/core/views.hpp>

#include <concepts>
#include <cstddef>
#include <cstdint>

LCE_BEGIN_NAMESPACE

// Where a backend's (and a communicator's) buffers live.
struct host_memory {};
struct device_memory {};

// The element type a backend's GEMMs read hidden rows and dz in. The host's
// BLAS has no 2-byte GEMM, so it widens them to the compute type; a backend
// with mixed-precision GEMMs (cuBLAS: bf16 x bf16 accumulated in fp32) says
// `template <class T> using gemm_operand = T;` and reads them as stored.
template <class Backend, class T>
struct gemm_operand_of {
  using type = compute_t<T>;
};
template <class Backend, class T>
  requires requires { typename Backend::template gemm_operand<T>; }
struct gemm_operand_of<Backend, T> {
  using type = typename Backend::template gemm_operand<T>;
};
template <class Backend, class T>
using gemm_operand_t = typename gemm_operand_of<Backend, T>::type;

// Whether the fused sweep should let the statistics pass leave exp(z - max)
// in the logit block (one exp per logit in all: right where exp is dear, as
// on a CPU) or recompute exp(z - lse) in the gradient pass (right where the
// block's extra read-modify-write costs more than the exp, as on a GPU).
template <class Backend>
constexpr bool reuses_exp_block() {
  if constexpr (requires { Backend::reuses_exp_block; })
    return Backend::reuses_exp_block;
  else
    return true;
}

// Optional, on every grad_weight below and the backend concept's: a trailing
// weight_element<T>{} telling the weight's storage type T (the operands are of the
// compute or GEMM operand type either way). The engine passes it where the backend
// takes it; the host backend runs a bfloat16 weight's dW on its provider's split bf16
// GEMM with it (the hidden rows are then bf16 values).
template <class T>
struct weight_element {};

// Optional: dw += alpha dz^T x into a grad_weight `dw` whose element type G is
// not the compute type A (a 2-byte grad_weight; float for T = double), each
// vocabulary tile of the product summed in A in `scratch` (slots of
// weight_gradient_tile_elements<A>(hidden, vocab_local, tokens) elements, from
// the shapes alone: `tokens` is the most rows of dz one call passes,
// weight_gradient_tile_slots() of them) and added into dw once. A call whose tokens fit in one chunk then
// needs no [V_local, H] accumulator: nothing is carried between chunks, and
// dw gets the sum it would get from the accumulator, without its fill, its
// memory and its final pass.
template <class B, class O, class A, class G>
concept adds_weight_gradient_tiles =
    requires(B& b, matrix_view<const O> operand, matrix_view<G> dw, A alpha, A* scratch, std::int64_t count) {
      { b.template weight_gradient_tile_elements<A>(count, count, count) } -> std::convertible_to<std::int64_t>;
      { b.weight_gradient_tile_slots() } -> std::convertible_to<int>;
      b.grad_weight(operand, operand, alpha, dw, scratch);
    };

// Optional: dx = alpha dz w + beta dx, beta 0 or 1. With it and the dW
// tiles above, a call on one rank can take all its tokens at once and the
// vocabulary a tile at a time (the engine's vocabulary order): each tile's
// share of dX is summed into one [N, H] block in order, and each tile of dW
// is final when its GEMM ends, so the [V_local, H] accumulator of a
// 2-byte grad_weight is replaced by an [N, H] one (smaller when N < V_local).
// With rounds_accumulated_weight_gradient too, a long call's tokens go
// through each tile in slices, the tile's dW summed in a [tile, H] one.
template <class B, class O, class T, class A>
concept adds_grad_hidden =
    requires(B& b, matrix_view<const O> dz, matrix_view<const T> w, A alpha, matrix_view<A> dx, void* block) {
      b.grad_hidden(dz, w, alpha, dx, block, alpha);
    };

// Optional: dw = alpha dz^T x + beta dw on the [V_local, H] accumulator of a
// call of several chunks, and with `round_into` (the last chunk) each
// finished vocabulary tile of dw added into that grad_weight of element G
// right after its GEMM. The first chunk passes beta = 0: the accumulator is
// neither zeroed beforehand nor read back in a pass of its own at the end.
template <class B, class O, class A, class G>
concept rounds_accumulated_weight_gradient =
    requires(B& b, matrix_view<const O> operand, matrix_view<A> dw, matrix_view<G> round_into, A alpha) {
      b.grad_weight(operand, operand, alpha, dw, alpha, round_into);
    };

// How a backend's dW meets a grad_weight of another element type: added into it, or
// written over it (options.overwrite_weight_gradients).
enum class weight_gradient_write : bool { add = false, overwrite = true };

// Optional, with adds_weight_gradient_tiles and rounds_accumulated_weight_gradient: the
// same two calls with a trailing weight_gradient_write, which with `overwrite` write each
// row of grad_weight they reach (the tiles, or round_into) instead of adding into it. Each
// row is reached by one call of a sweep, so grad_weight is then never read. Without them,
// the engine zeroes such a grad_weight before the sweep and adds.
template <class B, class O, class A, class G>
concept overwrites_weight_gradient =
    requires(B& b, matrix_view<const O> operand, matrix_view<G> dw, matrix_view<A> accumulator, A alpha, A* scratch) {
      b.grad_weight(operand, operand, alpha, dw, scratch, weight_gradient_write::overwrite);
      b.grad_weight(operand, operand, alpha, accumulator, alpha, dw, weight_gradient_write::overwrite);
    };

// Optional: the dW GEMM into a grad_weight of the compute type with a beta, 0 or 1. With
// it, under options.overwrite_weight_gradients, a sweep's first chunk (or a vocabulary
// tile's first slice) writes grad_weight's rows with beta 0 instead of the engine zeroing
// grad_weight first.
template <class B, class O, class A>
concept overwrites_compute_weight_gradient =
    requires(B& b, matrix_view<const O> operand, matrix_view<A> dw, A alpha) {
      b.grad_weight(operand, operand, alpha, dw, alpha);
    };

// Optional: the logits of a vocabulary tile kept in 2 bytes each between the
// vocabulary order's two sweeps, where a 2-byte grad_weight's rows cannot hold
// them in fp32 (N > H / 2): keep_logit_ratios writes each row's
// bf16(exp(z - c)) and its centre c (the row's largest), expand_logit_ratios
// writes c + log of them back (see the host's keep_ratio_row). Without it
// those tiles' logits are computed again in the second sweep. Used only where
// dz goes to the GEMMs in bf16 (gemm_operand_t bfloat16), whose rounding the
// ratios' 2^-8 does not exceed.
template <class B>
concept keeps_logit_ratios = requires(B& b, matrix_view<const float> logits, matrix_view<bfloat16> ratios,
                                      matrix_view<const bfloat16> kept, float* centres, matrix_view<float> out) {
  b.keep_logit_ratios(logits, ratios, centres);
  b.expand_logit_ratios(kept, static_cast<const float*>(centres), out);
};

// Optional, with keeps_logit_ratios: the same ratios without a log and an exp per
// logit. keep_exp_ratios rounds a block that a keep_exp statistics pass left as
// exp(z - c) (c = its partials' max, the centre keep_logit_ratios would take), and
// logit_gradients reads them back as they are (gradient_args::exp_ratios): dz is a
// per-row rescale of each ratio. Only where the gradient needs no z itself (no
// soft-cap, no entropy term), as for exp_row_max. Through lce_torch (bf16, H 1,024,
// V 32,000, N 1,024, 2 threads, Xeon with AMX) the expand (a log per logit) and the
// gradient's exp had taken about a tenth of a step.
template <class B>
concept keeps_exp_ratios =
    keeps_logit_ratios<B> && requires(B& b, matrix_view<const float> exps, const detail::row_partial<float>* partials,
                                      matrix_view<bfloat16> ratios, float* centres) {
      b.keep_exp_ratios(exps, partials, ratios, centres);
    };

// The most bytes of logits a block of the vocabulary order (see
// adds_grad_hidden) holds, beside the workspace budget. The bound is for
// speed: on the host the block's row passes then run near the cache, which
// repays the order's extra GEMM (bf16, N = 1,024, V = 128,256, one thread:
// 1.99 s with 16 MiB blocks, 3.40 s with two blocks of 256 MiB, 1.95 s for
// the token order's one chunk of 525 MB). A GPU streams the block from
// device memory at any size and says
// `static constexpr std::size_t vocabulary_block_bytes = SIZE_MAX;`: the
// budget alone bounds it, for fewer and larger GEMMs.
template <class Backend>
constexpr std::size_t vocabulary_block_bytes() {
  if constexpr (requires { Backend::vocabulary_block_bytes; })
    return Backend::vocabulary_block_bytes;
  else
    return std::size_t{16} << 20;
}

// How fast a backend's GEMMs for operands of type T run against its memory: the flops they do
// in the time a pass through memory moves one byte (the machine's balance). A plan that trades
// passes over an fp32 sum against logits computed again weighs the two with it (detail/engine.hpp:
// tail_sweep_cost). A backend that leaves out
// `template <class T> double gemm_flops_per_memory_byte() const;` gets
// default_gemm_flops_per_memory_byte: a CPU whose GEMMs run a few hundred GFLOP/s on two cores
// (AVX-512 sgemm, AVX512-BF16 on an AMD Zen 4) against some 25 GB/s of passes.
inline constexpr double default_gemm_flops_per_memory_byte = 16.0;

template <class T, class Backend>
double gemm_flops_per_memory_byte(const Backend& backend) {
  if constexpr (requires {
                  { backend.template gemm_flops_per_memory_byte<T>() } -> std::convertible_to<double>;
                })
    return backend.template gemm_flops_per_memory_byte<T>();
  else
    return default_gemm_flops_per_memory_byte;
}

// The chunk rows from which a bigger chunk buys this backend little but
// memory: budget_chunk stops there (chunk_request::enough_rows). Each chunk
// costs a read-modify-write of the [V_local, H] dW, against 6 C V_local H
// flops for its three GEMMs: the share of time it costs falls as 1 / C at any
// vocabulary and hidden size. A backend whose GEMMs run far faster than its
// memory streams dW (a GPU: a fraction of the chunk's time at 512 rows)
// leaves it out and the budget alone decides, for the fewest chunks.
template <class Backend>
constexpr std::int64_t enough_chunk_rows() {
  if constexpr (requires { Backend::enough_chunk_rows; }) {
    static_assert(Backend::enough_chunk_rows > 0, "a backend's enough_chunk_rows must be at least one row");
    return Backend::enough_chunk_rows;
  } else {
    return INT64_MAX;
  }
}

// The chunk rows below which this backend's GEMMs lose speed: budget_chunk
// takes an eighth of a long call's tokens per chunk, never fewer than these
// (chunk_request::min_efficient_rows). A backend that leaves it out keeps its
// enough_chunk_rows for every call longer than them (no share).
template <class Backend>
constexpr std::int64_t min_efficient_chunk_rows() {
  if constexpr (requires { Backend::min_efficient_chunk_rows; }) {
    static_assert(Backend::min_efficient_chunk_rows > 0 &&
                      Backend::min_efficient_chunk_rows <= enough_chunk_rows<Backend>(),
                  "a backend's min_efficient_chunk_rows must be at least one row and at most its enough_chunk_rows");
    return Backend::min_efficient_chunk_rows;
  } else {
    return INT64_MAX;
  }
}

// The vocabulary tile columns below which this backend's GEMMs lose speed:
// where the vocabulary order (adds_grad_hidden) holds all of a call's tokens at
// once, a tile takes at most a 32nd of the shard's columns, never fewer than
// these. A backend that leaves it out takes the widest tile its budget and
// vocabulary_block_bytes allow (no share).
template <class Backend>
constexpr std::int64_t min_efficient_vocabulary_tile() {
  if constexpr (requires { Backend::min_efficient_vocabulary_tile; }) {
    static_assert(Backend::min_efficient_vocabulary_tile > 0,
                  "a backend's min_efficient_vocabulary_tile must be at least one vocabulary row");
    return Backend::min_efficient_vocabulary_tile;
  } else {
    return INT64_MAX;
  }
}

// Whether the gradient pass writes each row's dz, in the GEMM operand type,
// over the start of that row's own logits (the host: a row is read before it
// is overwritten, one row at a time), so that no separate operand block is
// needed: the GEMMs then read dz with the logit block's ld in operand
// elements (twice it for bf16). A backend that writes dz from many threads
// per row (a GPU) keeps the block.
template <class Backend>
constexpr bool dz_operand_in_logit_rows() {
  if constexpr (requires { Backend::dz_operand_in_logit_rows; })
    return Backend::dz_operand_in_logit_rows;
  else
    return false;
}

// Optional: backend.touch_pages(data, bytes) writes into every page of
// [data, data + bytes) once (memory the call writes over anyway), its threads
// over disjoint ranges of pages. The engine calls it on the bytes of
// grad_weight that will hold kept logits, before the logits GEMMs write
// them: those GEMMs' threads write column tiles of the same rows, and on a
// freshly mapped grad_weight they took each page's first-touch fault
// together, the second one waiting on the first (the host, 2 threads: two
// faults per page, 27 ms of a 0.24 s bf16 step at N 768 against 10 ms).
template <class Backend>
concept touches_pages = requires(Backend& b, void* data, std::size_t bytes) { b.touch_pages(data, bytes); };

// What one pass over the targets tells the engine: a fingerprint, for the
// ranks to agree they hold the same targets, and the extremes of the ids that
// are not ignore_index, for the range check. A backend whose targets live
// where the host cannot read them provides scan_targets(targets, ignore_index).
struct target_scan {
  std::int64_t hash = 0;
  std::int64_t lowest = 0, highest = -1;        // over ids != ignore_index; highest < lowest: none
  std::int64_t lowest_at = -1, highest_at = -1;  // where they are
};

// Statistics of each row of a logit block: its soft-cap applied in place, the
// partial (max, sums, target logit) over this rank's vocabulary.
template <class Compute, class Index>
struct statistics_args {
  matrix_view<Compute> logits;           // [rows, vocab_local]
  vector_view<const Index> targets;    // [rows], global ids
  std::int64_t vocab_start = 0;
  std::int64_t ignore_index = -100;
  detail::soft_cap_map<Compute> soft_cap;  // raw logits in; capped and tempered out (disabled: none)
  bool with_entropy = false;       // also sum exp(z - max)(z - max)
  bool keep_exp = false;           // overwrite logits with exp(z - max) (no soft-cap only)
  bool with_logit_sum = false;     // also sum z (for the mean logit), before keep_exp overwrites it
  detail::row_partial<Compute>* partials = nullptr;  // out [rows]
};

// Per-row results from merged partials; ignored rows give log-prob 0 and entropy 0.
template <class Compute, class Index>
struct finalize_args {
  const detail::row_partial<Compute>* partials = nullptr;  // [rows]
  vector_view<const Index> targets;
  std::int64_t ignore_index = -100;
  Compute* logprobs = nullptr;  // out [rows]
  Compute* lse = nullptr;       // out [rows]
  Compute* entropy = nullptr;   // out [rows]
  Compute* mean_centred = nullptr;  // out [rows]: E_p[z] - lse = -entropy, the entropy gradient's row term
  Compute* mean_logit = nullptr;    // out [rows]: sum z / V (partials kept with_logit_sum); ignored rows 0
  Compute inverse_vocab = 0;        // 1 / V, the whole vocabulary
};

// Turns a logit block into dL/dlogits in place. Rows whose target is ignored
// become zero. With `exp_row_max` set, the block already holds exp(z - max)
// from a keep_exp statistics pass, and only a per-row scale is left to do.
// Operand is the backend's GEMM operand type (gemm_operand_t).
template <class Compute, class Index, class Operand = Compute>
struct gradient_args {
  matrix_view<Compute> logits;             // [rows, vocab_local], soft-capped if soft_cap is enabled
  vector_view<const Index> targets;
  std::int64_t vocab_start = 0;
  std::int64_t ignore_index = -100;
  detail::soft_cap_map<Compute> soft_cap;
  const Compute* lse = nullptr;            // [rows]
  const Compute* grad_logprobs = nullptr;  // [rows]
  const Compute* grad_entropy = nullptr;        // [rows] or null
  const Compute* mean_centred_logit = nullptr;  // [rows] E_p[z] - lse; needed with grad_entropy
  const Compute* grad_lse = nullptr;            // [rows] or null: dL/dlse (a z-loss), adds grad_lse p
  const Compute* lse_squared = nullptr;         // [rows] or null: the coefficient of lse^2, adds 2 it lse p
  const Compute* grad_mean_logit = nullptr;     // [rows] or null: dL/d(mean logit) (label smoothing), adds it / V
  Compute inverse_vocab = 0;                    // 1 / V, the whole vocabulary (with grad_mean_logit)
  const detail::row_partial<Compute>* exp_row_max = nullptr;  // [rows] or null: see above
  // Or the block's rows are made from bf16 ratios exp(z - c) (keeps_exp_ratios), row r's at
  // exp_ratios + r * exp_ratios_ld with c = exp_ratio_centres[r], and then rescaled as with
  // exp_row_max. Set only for a backend that keeps_exp_ratios.
  const bfloat16* exp_ratios = nullptr;
  std::int64_t exp_ratios_ld = 0;
  const Compute* exp_ratio_centres = nullptr;
  // A target set (K ids per row, e.g. a teacher's top-K): grad_logprobs then
  // holds each row's sum of set_grads over its counted ids (the -G p of every
  // logit), and each id this shard holds adds its own g at its column, times
  // the soft-cap's slope at its logit z (set_logits, gathered before the block
  // became dz; read only with a soft-cap). A row of ids all ignored is zero.
  const Index* set_ids = nullptr;          // [rows, set_size], global ids, or null
  const Compute* set_grads = nullptr;      // [rows, set_size]: dL/dlogp of each id
  const Compute* set_logits = nullptr;     // [rows, set_size]: z at each id held here
  std::int64_t set_size = 0;
  // When set, dz goes here in the backend's GEMM operand type, rows
  // gradient_operand_ld apart (the logit block's ld, or twice it where dz
  // overwrites the logit rows: dz_operand_in_logit_rows): set only for a
  // backend whose gemm_operand is not the compute type.
  Operand* gradient_operand = nullptr;
  std::int64_t gradient_operand_ld = 0;
};

// sum_v p (z - lse) over this rank's vocabulary, p = exp(z - lse): its
// share of E_p[z] - lse (= -entropy), which the entropy gradient needs.
template <class Compute, class Index>
struct mean_centred_logit_args {
  matrix_view<const Compute> logits;     // soft-capped if a soft-cap is set
  vector_view<const Index> targets;    // rows whose target is ignored give 0
  std::int64_t ignore_index = -100;
  const Compute* lse = nullptr;
  Compute* out = nullptr;
};

// The passes over a chunk's target sets ([rows, K] ids, dense). Each row of a
// set call stands in for the single-target passes with `stand_ins[r]`:
// ignore_index when all its ids are ignored, else an id no shard holds
// (detail::held_by_no_shard), so the row's lse, entropy and dz are computed
// and no single-target term is added.
//   target_set_rows      stand_ins, and (with grads) grad_sums[r] = sum_k grads[r, k] over ids not ignored
//   target_set_logits    values[r, k] = z at ids[r, k] where this shard holds it, else 0 (so ranks sum them)
//   target_set_logprobs  out[r, k] = values[r, k] - lse[r], or 0 for an ignored id
template <class Compute, class Index>
struct target_set_args {
  vector_view<const Index> ids;  // [rows * set_size], row-major
  std::int64_t set_size = 0;
  std::int64_t vocab_start = 0;
  std::int64_t ignore_index = -100;
  Index* stand_ins = nullptr;           // out [rows]
  const Compute* grads = nullptr;       // [rows * set_size] or null
  Compute* grad_sums = nullptr;         // out [rows] (with grads)
  matrix_view<const Compute> logits;    // [rows, vocab_local], soft-capped if a soft-cap is set
  Compute* values = nullptr;            // out (target_set_logits), in (target_set_logprobs)
  const Compute* lse = nullptr;         // [rows]
  Compute* out = nullptr;               // [rows * set_size]
};

// The contract of a backend, checked on fp32 and a 2-byte storage type.
template <class B>
concept backend =
    std::movable<B> && requires { typename B::memory_space; } &&
    requires(B& b, std::size_t bytes, void* pointer, matrix_view<const float> cmat, matrix_view<float> mat,
             matrix_view<const gemm_operand_t<B, bfloat16>> operand, matrix_view<const bfloat16> wmat,
             matrix_view<bfloat16> out_half, vector_view<const double> cvec, vector_view<float> vec,
             statistics_args<float, std::int64_t> statistics, finalize_args<float, std::int32_t> finalize,
             gradient_args<float, std::int64_t> gradient, mean_centred_logit_args<float, std::int32_t> mean_centred,
             target_set_args<float, std::int32_t> target_set, vector_view<const bfloat16> bias,
             const detail::row_partial<float>* gathered,
             detail::row_partial<float>* merged, std::int64_t count, int ranks, float alpha) {
      // Workspace: 64-byte aligned, allocated before a sweep, never inside it.
      { b.allocate(bytes) } -> std::same_as<void*>;
      b.deallocate(pointer, bytes);
      // Scratch elements of fp32 the GEMMs need to widen a 2-byte weight, for a hidden size and a vocabulary shard.
      { b.template weight_block_elements<bfloat16>(count, count) } -> std::convertible_to<std::int64_t>;
      // logits = alpha x w^T;  dx = alpha dz w;  dw += alpha dz^T x  (x and dz in the GEMM operand type)
      b.logits(operand, wmat, alpha, mat, pointer);
      b.grad_hidden(operand, wmat, alpha, mat, pointer);
      b.grad_weight(operand, operand, alpha, mat);
      // Element conversions and accumulations between storage and compute types.
      b.copy(cmat, out_half);
      b.copy(cvec, vec);
      b.add(cmat, out_half);
      b.fill_zero(mat);
      // An LM head's bias: logits[r] += alpha bias; grad_bias += alpha sum_r dz[r] (dz in the GEMM operand type).
      b.add_bias(mat, bias, alpha);
      b.column_sums(operand, alpha, vec);
      // Row passes.
      b.soft_cap(mat, detail::soft_cap_map<float>{});
      b.row_statistics(statistics);
      // Rank k's partials start at gathered + k * stride (stride >= count).
      b.merge_partials(gathered, ranks, count, count, merged);
      b.finalize_rows(finalize, count);
      b.logit_gradients(gradient);
      b.mean_centred_logits(mean_centred);
      b.target_set_rows(target_set, count);
      b.target_set_logits(target_set, count);
      b.target_set_logprobs(target_set, count);
    };

LCE_END_NAMESPACE
