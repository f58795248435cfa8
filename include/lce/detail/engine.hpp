#pragma once
// The calls behind ChunkedHiddenToLogprobs: check, plan, agree, sweep.
//
// Every call runs in the same four steps:
//   1. check   this rank's arguments, the view conversions' verdict, and the
//              BLAS/communicator integer ranges (detail/arguments.hpp);
//   2. plan    this rank's chunk and workspace, and reserve both (the
//              workspace and, for a 2-byte grad_weight, its fp32 accumulator);
//   3. agree   with the other ranks on all of it (detail/agreement.hpp): every
//              rank runs with the smallest chunk, or every rank raises;
//   4. sweep   the chunks (detail/sweep.hpp).
// Nothing that can fail on one rank only happens after step 3, so ranks
// cannot be left waiting in a collective. Nothing is written before step 4.

#include <lce/comm/communicator.hpp>
#include <lce/core/backend.hpp>
#include <lce/core/chunking.hpp>
#include <lce/core/config.hpp>
#include <lce/core/dtypes.hpp>
#include <lce/core/error.hpp>
#include <lce/core/options.hpp>
#include <lce/core/views.hpp>
#include <lce/detail/agreement.hpp>
#include <lce/detail/arguments.hpp>
#include <lce/detail/row_terms.hpp>
#include <lce/detail/sweep.hpp>
#include <lce/detail/workspace.hpp>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <new>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

LCE_BEGIN_NAMESPACE
namespace detail {

// The first lce::error raised while converting a call's views to lce's own,
// kept so that the ranks agree on it before anyone throws.
class deferred_failure {
 public:
  template <class Convert>
  auto operator()(Convert&& convert) -> decltype(convert()) {
    try {
      return convert();
    } catch (const error& e) {
      if (message_.empty()) message_ = e.what();
      return {};
    }
  }
  const std::string& message() const { return message_; }

 private:
  std::string message_;
};

// A scratch buffer obtained from the backend, kept across calls and grown on demand.
template <class Backend>
class scratch {
 public:
  scratch() = default;
  scratch(const scratch&) = delete;
  scratch& operator=(const scratch&) = delete;
  scratch(scratch&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

  // Raises lce::error (naming `what`) if the backend cannot allocate.
  void* reserve(Backend& backend, std::size_t bytes, const char* what) {
    if (bytes > bytes_) {
      release(backend);
      try {
        data_ = backend.allocate(bytes);
      } catch (const std::bad_alloc&) {
        fail(what, ": could not allocate ", bytes, " bytes (", bytes >> 20,
             " MiB); lower options.workspace_limit_bytes or chunk_tokens, or free memory");
      }
      bytes_ = bytes;
    }
    return data_;
  }
  void release(Backend& backend) {
    if (data_) backend.deallocate(data_, bytes_);
    data_ = nullptr;
    bytes_ = 0;
  }
  std::size_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

// Marks an operator busy for the length of one call: a second thread calling
// the same operator meanwhile gets an lce::error instead of sharing scratch.
class exclusive_call {
 public:
  class flag {
   public:
    flag() = default;
    flag(flag&&) noexcept {}  // a moved-to operator is idle
    flag& operator=(flag&&) = delete;

   private:
    friend class exclusive_call;
    std::atomic<bool> busy_{false};
  };

  exclusive_call(flag& f, const char* call) : flag_(f) {
    expects(!flag_.busy_.exchange(true, std::memory_order_acquire), call,
            ": this operator is already running a call on another thread; an operator (and its scratch) serves one "
            "call at a time: give each thread its own");
  }
  ~exclusive_call() { flag_.busy_.store(false, std::memory_order_release); }
  exclusive_call(const exclusive_call&) = delete;
  exclusive_call& operator=(const exclusive_call&) = delete;

 private:
  flag& flag_;
};

// The largest extent a backend's GEMMs take (BLAS: int); none if it says nothing.
template <class Backend>
constexpr std::int64_t gemm_extent_limit() {
  if constexpr (requires { Backend::max_gemm_extent; })
    return static_cast<std::int64_t>(Backend::max_gemm_extent);
  else
    return INT64_MAX;
}

// The largest message a communicator's collectives take in bytes (MPI: int counts).
template <class Comm>
std::int64_t message_byte_limit(const Comm& comm) {
  if constexpr (requires { comm.max_message_bytes(); })
    return static_cast<std::int64_t>(comm.max_message_bytes());
  else
    return INT64_MAX;
}

template <communicator Comm, storage_type T, chunk_policy Chunk, backend Backend>
class engine {
  static_assert(std::is_void_v<typename Comm::memory_space> ||
                    std::is_same_v<typename Comm::memory_space, typename Backend::memory_space>,
                "the communicator's collectives must work on the backend's memory (e.g. NCCL needs a CUDA backend)");

 public:
  using Compute = compute_t<T>;
  using Operand = gemm_operand_t<Backend, T>;
  using sweep_type = chunk_sweep<Comm, T, Backend>;

  engine(Comm comm, options opt, Backend backend)
      : comm_(std::move(comm)), options_(opt), backend_(std::move(backend)) {
    check_options(options_);
    if constexpr (requires { comm_.stream() == backend_.stream(); }) {
      expects(comm_.stream() == backend_.stream(),
              "the communicator and the backend were given different streams: their collectives and kernels must "
              "be ordered on one stream");
    }
    if constexpr (fixed_chunk_policy<Chunk>) {
      expects(options_.chunk_tokens == 0 || options_.chunk_tokens == Chunk::tokens, "options.chunk_tokens = ",
              options_.chunk_tokens, " conflicts with the compile-time chunk policy fixed_chunk<", Chunk::tokens,
              ">: leave chunk_tokens at 0, or use budget_chunk to choose the chunk at run time");
    }
  }
  engine(engine&&) noexcept = default;
  ~engine() {
    workspace_.release(backend_);
    weight_gradient_.release(backend_);
  }

  const options& settings() const { return options_; }
  const Comm& comm() const { return comm_; }

  // Rows of the logit block per chunk this rank would use for a call over
  // n_tokens tokens (with several ranks, the call uses the smallest over ranks).
  // `set_size`: K for calls with target sets of K ids per token.
  std::int64_t chunk_tokens(std::int64_t n_tokens, std::int64_t hidden, std::int64_t vocab_local,
                            std::int64_t set_size = 0) const {
    check_sizes("chunk_tokens", n_tokens, hidden, vocab_local, set_size);
    return plan_for(n_tokens, hidden, vocab_local, 0, set_size).chunk;
  }

  // The most an operator holds over every kind of call: the larger of its
  // sweeps' buffers (a forward's, and the sweep of a call with a grad_weight
  // of another element type than the compute type, which any T but float
  // allows), plus that call's dW scratch: the [V_local, H] accumulator in the
  // compute type (dW across chunks accumulates in fp32, or double for T =
  // double), or only the backend's dW tiles for a call that is one chunk on
  // one rank or sweeps the vocabulary order with all its rows at once
  // (adds_weight_gradient_tiles, vocabulary_tiles_plan), or one vocabulary
  // tile's accumulator when that order takes the tokens in slices. Raises
  // lce::error if it does not fit in size_t.
  std::size_t workspace_bytes(std::int64_t n_tokens, std::int64_t hidden, std::int64_t vocab_local,
                              std::int64_t set_size = 0) const {
    check_sizes("workspace_bytes", n_tokens, hidden, vocab_local, set_size);
    using NarrowGradWeight = std::conditional_t<std::same_as<T, double>, float, T>;
    // A forward, and a backward or forward_backward with a grad_weight of the compute type.
    std::size_t sweep =
        direct_plan_for<no_weight_gradient_t>(call_kind::forward, n_tokens, hidden, vocab_local, set_size).plan.bytes;
    for (const call_kind kind : {call_kind::backward, call_kind::forward_backward})
      sweep = std::max(sweep, direct_plan_for<Compute>(kind, n_tokens, hidden, vocab_local, set_size).plan.bytes);
    // One that writes such a grad_weight over on one rank may keep its logits there: a plan no
    // larger than the token order's, which may hold more than the plan taken without it.
    if (options_.overwrite_weight_gradients && comm_.size() == 1)
      sweep = std::max(sweep, direct_plan_for<Compute>(call_kind::forward_backward, n_tokens, hidden, vocab_local,
                                                       set_size, /*logits_fit=*/true)
                                  .plan.bytes);
    checked_size total(sweep);
    if constexpr (!std::same_as<T, float>) {
      const auto gradient = gradient_plan_for<NarrowGradWeight>(n_tokens, hidden, vocab_local, set_size);
      total = checked_size(std::max(sweep, gradient.plan.bytes)) +
              weight_gradient_scratch_bytes<NarrowGradWeight>(gradient, hidden, vocab_local);
      // A forward_backward that writes grad_weight over may hold its dW sum in part there instead.
      if constexpr (backend_holds_accumulator_in<NarrowGradWeight>) {
        if (options_.overwrite_weight_gradients && comm_.size() == 1 && !total.overflow) {
          for (const auto& split : {accumulator_in_grad_weight_plan<NarrowGradWeight>(n_tokens, hidden, vocab_local,
                                                                                      set_size),
                                    tail_sweep_plan<NarrowGradWeight>(n_tokens, hidden, vocab_local, set_size)}) {
            if (!split) continue;
            const checked_size held =
                checked_size(std::max({sweep, split->plan.bytes, split->tail_plan.bytes})) +
                weight_gradient_scratch_bytes<NarrowGradWeight>(*split, hidden, vocab_local);
            if (!held.overflow && held.value > total.value) total = held;
          }
        }
      }
    }
    expects(!total.overflow, "workspace_bytes: the dW accumulator of vocab_local ", vocab_local, " x hidden ",
            hidden, " needs more bytes than size_t holds");
    return total.value;
  }

  // Bytes this operator holds between calls: the sweep's scratch and the dW
  // accumulator, both kept for the next call.
  std::size_t held_workspace_bytes() const { return workspace_.bytes() + weight_gradient_.bytes(); }

  // Frees both; the next call allocates again.
  void release_workspace() {
    exclusive_call busy(busy_, "release_workspace");
    workspace_.release(backend_);
    weight_gradient_.release(backend_);
  }

  // ---- forward -------------------------------------------------------------

  template <class Index, class Logprobs, class Lse, class Entropy, class MeanLogit>
  void forward(const deferred_failure& conversion, const operator_inputs<T, Index>& in,
               const row_output_views<Logprobs, Lse, Entropy, MeanLogit>& out) {
    exclusive_call busy(busy_, "forward");
    const auto call = prepare(conversion, in, call_kind::forward, out.mask(), no_weight_gradient, {},
                              [&](std::int64_t n) { check_outputs(in, out, n, {}); });
    if (in.targets.size == 0) return;
    [[maybe_unused]] const auto backend_call = begin_backend_call();
    sweep_type sweep(comm_, backend_, options_, call.plan, call.workspace, call.vocab);
    if (call.vocab_tile > 0) {
      sweep.run(in, [&](const auto& whole) {
        statistics_by_vocabulary_tiles(sweep, whole, call, out.has_entropy, out.has_mean_logit);
        scatter_outputs(sweep, whole, out);
      });
      return;
    }
    sweep.run(in, [&](const auto& c) {
      if (c.set_size > 0) sweep.target_set_rows(c, /*with_grads=*/false);
      sweep.forward_statistics(c, out.has_entropy, /*keep_exp=*/false, out.has_mean_logit);
      scatter_outputs(sweep, c, out);
    });
  }

  // ---- backward ------------------------------------------------------------

  // Given lse from forward and the loss's gradients: grad_hidden overwritten,
  // grad_weight accumulated. 3 GEMMs per chunk (the logits again).
  template <class Index, class ElementLse, class GradLogprobs, class GradEntropy, class GradLse, class GradMeanLogit,
            class GradHidden, class GradWeight>
  void backward(const deferred_failure& conversion, const operator_inputs<T, Index>& in,
                vector_view<const ElementLse> lse,
                const row_gradient_views<GradLogprobs, GradEntropy, GradLse, GradMeanLogit>& grads,
                matrix_view<GradHidden> grad_hidden, matrix_view<GradWeight> grad_weight,
                vector_view<Compute> grad_bias = {}) {
    exclusive_call busy(busy_, "backward");
    const auto call = prepare(conversion, in, call_kind::backward, grads.mask(), grad_weight, grad_bias,
                              [&](std::int64_t n) {
      check_rows(lse, "lse", n, "targets");
      check_given(grads, n, in.set_size);
      check_gradients(in, grad_hidden, grad_weight, grad_bias);
      check_no_alias({hidden_bytes(in), weight_bytes(in), target_bytes(in), bytes_of(in.bias, "bias"), bytes_of(lse, "lse"),
                      bytes_of(grads.logprobs, "grad_logprobs"), bytes_of(grads.entropy, "grad_entropy"),
                      bytes_of(grads.lse, "grad_lse"), bytes_of(grads.mean_logit, "grad_mean_logit"),
                      bytes_of(grads.lse_squared, "lse_squared")},
                     {bytes_of(grad_hidden, "grad_hidden"), bytes_of(grad_weight, "grad_weight"),
                      bytes_of(grad_bias, "grad_bias")});
    });
    if (in.targets.size == 0) return zero_weight_gradients_of_empty_call(grad_weight, grad_bias);
    [[maybe_unused]] const auto backend_call = begin_backend_call();
    const auto weight_gradient = begin_weight_gradient(call, in.hidden.rows, grad_weight, grad_bias);
    sweep_type sweep(comm_, backend_, options_, call.plan, call.workspace, call.vocab);
    if (call.vocab_tile > 0) {
      if constexpr (backend_sweeps_vocabulary_tiles<GradWeight>) {
        sweep.run(in, [&](const auto& whole) {
          using Chunk_ = std::remove_cvref_t<decltype(whole)>;
          sweep.gather_rows(whole, lse, row_lse);
          auto args = gather_given(sweep, whole, grads);
          if (grads.has_entropy) {
            // E_p[z] - lse: each tile's share, summed in vocabulary order (one more sweep of logits).
            for_vocabulary_tiles(sweep, whole, call, [&](const Chunk_& slice, std::size_t tile) {
              const bool first_tile = tile == 0;
              sweep.recompute_logits(slice);
              backend_.mean_centred_logits(mean_centred_logit_args<Compute, typename Chunk_::index>{
                  slice.logits, slice.targets, options_.ignore_index, slice.row(row_lse),
                  slice.row(first_tile ? row_mean_centred : row_mean_logit)});
              if (!first_tile)
                backend_.add(matrix_view<const Compute>{slice.row(row_mean_logit), 1, slice.rows, slice.rows},
                             matrix_view<Compute>{slice.row(row_mean_centred), 1, slice.rows, slice.rows});
            });
            args.mean_centred_logit = whole.row(row_mean_centred);
          }
          gradient_by_vocabulary_tiles(sweep, whole, call, args, grad_hidden, weight_gradient, grad_bias);
        });
      }
      return;
    }
    sweep.run(in, [&](const auto& c) {
      using Chunk_ = std::remove_cvref_t<decltype(c)>;
      sweep.recompute_logits(c);
      begin_target_set(sweep, c, grads);
      sweep.gather_rows(c, lse, row_lse);
      auto args = gather_given(sweep, c, grads);
      if (c.set_size > 0 && grads.has_logprobs && sweep.scaling().soft_cap.enabled()) sweep.target_set_logits(c);
      if (grads.has_entropy) {
        backend_.mean_centred_logits(mean_centred_logit_args<Compute, typename Chunk_::index>{
            c.logits, c.targets, options_.ignore_index, c.row(row_lse), c.row(row_mean_centred)});
        if (comm_.size() > 1) comm_.all_reduce_sum(c.row(row_mean_centred), c.rows);
        args.mean_centred_logit = c.row(row_mean_centred);
      }
      backend_.logit_gradients(args);
      sweep.propagate(c, grad_hidden, weight_gradient, grad_bias);
    });
    end_weight_gradient(weight_gradient, grad_weight);
  }

  // ---- forward_backward ----------------------------------------------------

  // Both in one sweep when the loss's gradients are known before the forward
  // (NLL, weighted or label-smoothed cross-entropy, an entropy bonus with
  // fixed coefficients): 3 GEMMs per chunk instead of 4. The entropy
  // gradient's row term E_p[z] - lse is -entropy, known once the row
  // statistics are merged.
  template <class Index, class GradLogprobs, class GradEntropy, class GradLse, class GradMeanLogit, class Logprobs,
            class Lse, class Entropy, class MeanLogit, class GradHidden, class GradWeight>
  void forward_backward(const deferred_failure& conversion, const operator_inputs<T, Index>& in,
                        const row_gradient_views<GradLogprobs, GradEntropy, GradLse, GradMeanLogit>& grads,
                        const row_output_views<Logprobs, Lse, Entropy, MeanLogit>& out,
                        matrix_view<GradHidden> grad_hidden, matrix_view<GradWeight> grad_weight,
                        vector_view<Compute> grad_bias = {}) {
    exclusive_call busy(busy_, "forward_backward");
    const auto call = prepare(conversion, in, call_kind::forward_backward, grads.mask() | out.mask() << 5,
                              grad_weight, grad_bias, [&](std::int64_t n) {
                                check_given(grads, n, in.set_size);
                                check_outputs(in, out, n,
                                              {bytes_of(grads.logprobs, "grad_logprobs"),
                                               bytes_of(grads.entropy, "grad_entropy"), bytes_of(grads.lse, "grad_lse"),
                                               bytes_of(grads.mean_logit, "grad_mean_logit"),
                                               bytes_of(grads.lse_squared, "lse_squared")},
                                              {bytes_of(grad_hidden, "grad_hidden"),
                                               bytes_of(grad_weight, "grad_weight"), bytes_of(grad_bias, "grad_bias")});
                                check_gradients(in, grad_hidden, grad_weight, grad_bias);
                              });
    if (in.targets.size == 0) return zero_weight_gradients_of_empty_call(grad_weight, grad_bias);
    [[maybe_unused]] const auto backend_call = begin_backend_call();
    const auto weight_gradient = begin_weight_gradient(call, in.hidden.rows, grad_weight, grad_bias);
    sweep_type sweep(comm_, backend_, options_, call.plan, call.workspace, call.vocab);
    const bool with_entropy = out.has_entropy || grads.has_entropy;
    // Without a soft-cap (or an entropy term) the statistics pass leaves
    // exp(z - max) behind, and dz = -g exp(z - lse) is a per-row rescale of
    // it: one exp per logit.
    // A target set's logits are read after the statistics pass: no exp left in the block then.
    const bool keep_exp = reuses_exp_block<Backend>() && !sweep.scaling().soft_cap.enabled() && !with_entropy &&
                          in.set_size == 0;
    if (call.vocab_tile > 0) {
      if constexpr (backend_sweeps_vocabulary_tiles<GradWeight>) {
        // The logits twice: every row's lse is known only after the last tile.
        // Or once, kept in grad_weight in between (logits_fit_grad_weight).
        const matrix_view<GradWeight> keep_logits_in =
            call.keeps_logits_in_grad_weight() ? grad_weight : matrix_view<GradWeight>{};
        if constexpr (touches_pages<Backend>) {
          if (keep_logits_in.data)
            backend_.touch_pages(keep_logits_in.data, static_cast<std::size_t>(call.vocab_tiles.kept_bytes));
        }
        // Kept as ratios, the kept tiles' statistics leave exp(z - max) for the ratios to round.
        const bool exp_ratios = keeps_exp_ratios<Backend> && keep_exp && call.vocab_tiles.ratios;
        sweep.run(in, [&](const auto& whole) {
          statistics_by_vocabulary_tiles(sweep, whole, call, with_entropy, out.has_mean_logit, keep_logits_in,
                                         exp_ratios);
          scatter_outputs(sweep, whole, out);
          auto args = gather_given(sweep, whole, grads);
          if (grads.has_entropy) args.mean_centred_logit = whole.row(row_mean_centred);
          if constexpr (backend_keeps_logits_in<GradWeight>) {
            if (keep_logits_in.data)
              return gradient_by_kept_logits(sweep, whole, call, args, grad_hidden, keep_logits_in, weight_gradient,
                                             grad_bias, exp_ratios);
          }
          gradient_by_vocabulary_tiles(sweep, whole, call, args, grad_hidden, weight_gradient, grad_bias);
        });
      }
      return;
    }
    sweep.run(in, [&](const auto& c) {
      begin_target_set(sweep, c, grads);
      sweep.forward_statistics(c, with_entropy, keep_exp, out.has_mean_logit);
      scatter_outputs(sweep, c, out);
      if (call.tail_rows > 0) keep_first_sweep_rows(sweep, c, call, grads.has_entropy);
      auto args = gather_given(sweep, c, grads);
      args.exp_row_max = keep_exp ? c.partials : nullptr;
      if (grads.has_entropy) args.mean_centred_logit = c.row(row_mean_centred);
      backend_.logit_gradients(args);
      sweep.propagate(c, grad_hidden, weight_gradient, grad_bias);
    });
    end_weight_gradient(weight_gradient, grad_weight);
    if constexpr (!std::same_as<GradWeight, Compute> && backend_holds_accumulator_in<GradWeight>) {
      if (call.tail_rows > 0) tail_gradient(in, call, grads, grad_weight);
    }
  }

 private:
  // The vocabulary order's tiles: the first weight row of each, in order, and
  // V_local after the last. With kept logits (kept_logits_plan), also where
  // each tile's fp32 logits stay between the two sweeps: a byte offset into
  // grad_weight, or in_logit_block (computed again in the second sweep,
  // but for the last such tile, whose logits the block still holds).
  struct vocabulary_tiles {
    static constexpr std::int64_t in_logit_block = -1;
    std::vector<std::int64_t> bounds;
    std::vector<std::int64_t> kept_at;  // one per tile; empty without kept logits
    std::int64_t kept_bytes = 0;        // from grad_weight's start, that the kept logits take
    bool ratios = false;                // kept as bf16 ratios and row centres (kept_ratios_plan), not fp32 logits
    std::vector<std::int64_t> centres_at;  // with ratios, one per tile: where its row centres are kept

    static std::int64_t whole_lines(std::int64_t bytes) {
      constexpr auto line = static_cast<std::int64_t>(workspace_alignment);
      return detail::ceil_div(bytes, line) * line;
    }

    std::size_t count() const { return bounds.empty() ? 0 : bounds.size() - 1; }
    std::int64_t first_row(std::size_t tile) const { return bounds[tile]; }
    std::int64_t rows(std::size_t tile) const { return bounds[tile + 1] - bounds[tile]; }
    bool kept(std::size_t tile) const { return !kept_at.empty() && kept_at[tile] != in_logit_block; }
    // The tile whose logits the block holds after the first sweep (with ratios, where every
    // tile passes through it, the last, which is never kept).
    std::size_t last_in_logit_block() const {
      std::size_t last = 0;
      for (std::size_t t = 0; t < count(); ++t)
        if (!kept(t)) last = t;
      return last;
    }
  };

  // What steps 1-3 hand to the sweep.
  struct prepared_call {
    workspace_plan<Compute> plan;
    void* workspace = nullptr;
    // For a grad_weight not of the compute type: the [V_local, H] accumulator,
    // or (tiles_into_grad_weight) the backend's per-thread dW tiles, or in the
    // vocabulary order with token slices a [vocab_tile, H] accumulator.
    Compute* weight_gradient_scratch = nullptr;
    bool tiles_into_grad_weight = false;
    std::int64_t vocab_tile = 0;            // > 0: the vocabulary order (vocabulary_tiles_plan), its widest tile
    // > 0: the first tile's columns: the tiles' logits kept in grad_weight
    // (kept_logits_plan), but those in the logit block.
    std::int64_t first_vocab_tile = 0;
    // The vocabulary order's tiles (vocabulary_tiles_of).
    vocabulary_tiles vocab_tiles;
    // The token order's dW sum in part in grad_weight's storage (accumulator_in_grad_weight_or),
    // and the tail its second sweep takes (gradient_plan's tail_*).
    bool accumulator_in_grad_weight = false;
    std::int64_t tail_rows = 0;
    std::int64_t tail_tile = 0;
    workspace_plan<Compute> tail_plan{};
    // With a tail, in the dW scratch after the sum's rest: each token's lse (and with an entropy
    // gradient its mean-centred logit) from the first sweep, for the second; then the backend's
    // dW tiles of the tail's GEMMs (null where it rounds them into grad_weight itself).
    Compute* first_sweep_rows = nullptr;
    Compute* tail_tile_scratch = nullptr;
    std::int64_t vocab = 0;                 // the whole vocabulary V

    bool keeps_logits_in_grad_weight() const { return first_vocab_tile > 0; }
  };

  // ---- the vocabulary order (vocabulary_tiles_plan) ------------------------------

  // body(slice, tile) over the vocabulary tiles (numbered from 0) in order,
  // and within each over its token slices (the rows the logit block holds) in order.
  template <class Chunk_, class Body>
  static void for_vocabulary_tiles(sweep_type& sweep, const Chunk_& whole, const prepared_call& call, Body&& body) {
    const std::int64_t rows = whole.logits.rows;
    const auto& tiles = call.vocab_tiles;
    for (std::size_t t = 0; t < tiles.count(); ++t) {
      const auto tile = sweep.vocabulary_tile(whole, tiles.first_row(t), tiles.rows(t));
      for (std::int64_t row = 0; row < whole.rows; row += rows)
        body(sweep.token_slice(tile, row, std::min(rows, whole.rows - row)), t);
    }
  }

  // Every row's statistics from the tiles' logits, merged in vocabulary
  // order; the logits left in `keep_in` (grad_weight) where it is given, in
  // fp32 or as ratios (kept_ratios_plan), with exp_ratios from the exps
  // that the statistics leave (keeps_exp_ratios).
  template <class Chunk_, class G = Compute>
  void statistics_by_vocabulary_tiles(sweep_type& sweep, const Chunk_& whole, const prepared_call& call,
                                      bool with_entropy, bool with_mean_logit, const matrix_view<G>& keep_in = {},
                                      bool exp_ratios = false) {
    const auto& tiles = call.vocab_tiles;
    for_vocabulary_tiles(sweep, whole, call, [&](const Chunk_& slice, std::size_t tile) {
      const bool as_ratios = keep_in.data && tiles.ratios;
      const bool ratios_kept = as_ratios && tiles.kept(tile);
      const auto* partials =
          sweep.tile_statistics(keep_in.data && !as_ratios ? logits_kept_in(keep_in, slice, call, tile) : slice,
                                tile == 0, with_entropy, with_mean_logit, ratios_kept && exp_ratios);
      if constexpr (keeps_ratios) {
        if (ratios_kept) {
          const auto block = matrix_view<const Compute>(slice.logits);
          const auto ratios = ratios_kept_in(keep_in, slice, call, tile);
          Compute* const centres = ratio_centres_of(keep_in, call, tile);
          if constexpr (keeps_exp_ratios<Backend>) {
            if (exp_ratios) return backend_.keep_exp_ratios(block, partials, ratios, centres);
          }
          backend_.keep_logit_ratios(block, ratios, centres);
        }
      }
    });
    sweep.finish_tile_statistics(whole, with_entropy, with_mean_logit);
  }

  // Where a tile's fp32 logits are kept (kept_logits_plan): in the bytes of
  // grad_weight's rows before the tile's own, or in the logit block. dz goes
  // in their place (in the GEMMs' operand type over the first half of each
  // row where that is 2-byte: dz_operand_in_logit_rows). The gradient sweep
  // then runs the tiles last to first, so that each tile's dW, written over
  // its own rows, lands on logits already consumed.
  template <class Chunk_, class G>
  static Chunk_ logits_kept_in(const matrix_view<G>& grad_weight, const Chunk_& slice, const prepared_call& call,
                               std::size_t tile) {
    if (!call.vocab_tiles.kept(tile)) return slice;
    auto c = slice;
    auto* const kept = reinterpret_cast<Compute*>(reinterpret_cast<std::byte*>(grad_weight.data) +
                                                  call.vocab_tiles.kept_at[tile]);
    const std::int64_t rows = slice.logits.rows, cols = slice.logits.cols;
    c.logits = {kept, rows, cols, cols};
    if constexpr (sweep_type::dz_in_logit_rows) {
      constexpr auto per_compute = static_cast<std::int64_t>(sizeof(Compute) / sizeof(Operand));
      c.dz_operand = {reinterpret_cast<Operand*>(kept), rows, cols, cols * per_compute};
    }
    return c;
  }

  // Whether the backend can keep the vocabulary order's fp32 logits in 2 bytes (kept_ratios_plan),
  // and may: only where dz goes to its GEMMs in bf16 (bf16 operands), whose rounding (2^-8 of
  // each p) the ratios' does not exceed. With fp32 operands (fp16 inputs, or bf16 ones widened
  // or split into two bf16 parts) dz keeps 16 bits or more, and dX and dW, rounded to fp16's
  // 2^-11, would carry up to 2^-8 from the ratios.
  static constexpr bool keeps_ratios =
      std::same_as<Compute, float> && std::same_as<Operand, bfloat16> && keeps_logit_ratios<Backend>;

  // Where a tile's logits are kept as ratios (kept_ratios_plan): in the bytes
  // of grad_weight's rows before the tile's own, [N, tile columns] of bf16,
  // then (from the next line) their N row centres.
  template <class Chunk_, class G>
  static matrix_view<bfloat16> ratios_kept_in(const matrix_view<G>& grad_weight, const Chunk_& slice,
                                              const prepared_call& call, std::size_t tile) {
    auto* const kept = reinterpret_cast<bfloat16*>(reinterpret_cast<std::byte*>(grad_weight.data) +
                                                   call.vocab_tiles.kept_at[tile]);
    return {kept, slice.logits.rows, slice.logits.cols, slice.logits.cols};
  }
  template <class G>
  static Compute* ratio_centres_of(const matrix_view<G>& grad_weight, const prepared_call& call, std::size_t tile) {
    return reinterpret_cast<Compute*>(reinterpret_cast<std::byte*>(grad_weight.data) +
                                      call.vocab_tiles.centres_at[tile]);
  }

  // gradient_by_vocabulary_tiles on the logits kept in grad_weight (soft-capped
  // there by the statistics pass): the tiles last to first, all the rows at
  // once, each tile's dz made in place of its kept logits and its dW written
  // over grad_weight's rows (beta 0). The tiles not kept take their logits
  // again in the block, but the last of them, whose logits it still holds.
  // Kept as ratios, every tile's logits are written back into the block
  // (expand_logit_ratios) but the last tile's, still there; with exp_ratios
  // the kept tiles' dz is made from their ratios as they are.
  template <class Chunk_, class Args, class GradHidden, class G>
  void gradient_by_kept_logits(sweep_type& sweep, const Chunk_& whole, const prepared_call& call, const Args& args,
                               const matrix_view<GradHidden>& grad_hidden, const matrix_view<G>& grad_weight,
                               const weight_gradient_sink<Compute, G>& weight_gradient,
                               const vector_view<Compute>& grad_bias, bool exp_ratios) {
    matrix_view<Compute> sum = whole.grad_hidden_stage;
    if constexpr (std::same_as<GradHidden, Compute>) sum = grad_hidden;
    const auto& tiles = call.vocab_tiles;
    const std::size_t in_block = tiles.last_in_logit_block();
    for (std::size_t t = tiles.count(); t-- > 0;) {
      const auto tile = sweep.vocabulary_tile(whole, tiles.first_row(t), tiles.rows(t));
      const auto in_logit_block = sweep.token_slice(tile, 0, whole.rows);
      const auto slice = tiles.ratios ? in_logit_block : logits_kept_in(grad_weight, in_logit_block, call, t);
      auto tile_args = sweep.gradient_of_tile(args, slice);
      if (t != in_block && !tiles.kept(t)) {
        sweep.recompute_logits(slice);
      } else if (t != in_block && tiles.ratios) {
        if constexpr (keeps_ratios) {
          const auto ratios = ratios_kept_in(grad_weight, slice, call, t);
          if (exp_ratios) {
            tile_args.exp_ratios = ratios.data;
            tile_args.exp_ratios_ld = ratios.ld;
            tile_args.exp_ratio_centres = ratio_centres_of(grad_weight, call, t);
          } else {
            backend_.expand_logit_ratios(matrix_view<const bfloat16>(ratios), ratio_centres_of(grad_weight, call, t),
                                         slice.logits);
          }
        }
      }
      backend_.logit_gradients(tile_args);
      sweep.propagate_tile(slice, t + 1 == tiles.count(), sum, weight_gradient, grad_bias);
    }
    if constexpr (!std::same_as<GradHidden, Compute>) backend_.copy(matrix_view<const Compute>(sum), grad_hidden);
  }

  // dz tile by tile (the logits again), each tile's dW final after its last
  // slice and its share of dX summed in vocabulary order: into grad_hidden
  // itself when it has the compute type, else into the plan's [N, H] stage,
  // converted at the end.
  template <class Chunk_, class Args, class GradHidden, class GradWeight>
  void gradient_by_vocabulary_tiles(sweep_type& sweep, const Chunk_& whole, const prepared_call& call, const Args& args,
                                    const matrix_view<GradHidden>& grad_hidden,
                                    const weight_gradient_sink<Compute, GradWeight>& weight_gradient,
                                    const vector_view<Compute>& grad_bias) {
    matrix_view<Compute> sum = whole.grad_hidden_stage;
    if constexpr (std::same_as<GradHidden, Compute>) sum = grad_hidden;
    for_vocabulary_tiles(sweep, whole, call, [&](const Chunk_& slice, std::size_t tile) {
      sweep.recompute_logits(slice);
      backend_.logit_gradients(sweep.gradient_of_tile(args, slice));
      sweep.propagate_tile(slice, tile == 0, sum, weight_gradient, grad_bias);
    });
    if constexpr (!std::same_as<GradHidden, Compute>) backend_.copy(matrix_view<const Compute>(sum), grad_hidden);
  }


  // ---- the tail of a dW sum held in grad_weight (tail_sweep_plan) ---------------

  // A chunk's rows that the tail sweep reads: its lse, and its mean-centred logit with an entropy gradient.
  template <class Chunk_>
  void keep_first_sweep_rows(sweep_type& sweep, const Chunk_& c, const prepared_call& call, bool with_entropy) {
    const std::int64_t n = c.local_tokens;
    sweep.scatter_rows(c, row_lse, vector_view<Compute>{call.first_sweep_rows, n});
    if (with_entropy) sweep.scatter_rows(c, row_mean_centred, vector_view<Compute>{call.first_sweep_rows + n, n});
  }

  // The tail's dW, once the sum is rounded out of grad_weight's storage: every token at once, the
  // tail's vocabulary tiles in turn, each tile's logits computed again, its dz made from the first
  // sweep's rows and the given gradients, its dW written over its rows of grad_weight.
  template <class Index, class GradLogprobs, class GradEntropy, class GradLse, class GradMeanLogit, class G>
  void tail_gradient(const operator_inputs<T, Index>& in, const prepared_call& call,
                     const row_gradient_views<GradLogprobs, GradEntropy, GradLse, GradMeanLogit>& grads,
                     const matrix_view<G>& grad_weight) {
    sweep_type tail(comm_, backend_, options_, call.tail_plan, call.workspace, call.vocab);
    const std::int64_t n = in.tokens(), vocab_local = in.weight.rows;
    weight_gradient_sink<Compute, G> sink;
    sink.grad_weight = grad_weight;
    sink.into_grad_weight = true;
    sink.overwrite = true;
    sink.tile_scratch = call.tail_tile_scratch;
    tail.run(in, [&](const auto& whole) {
      auto args = gather_given(tail, whole, grads);
      backend_.copy(vector_view<const Compute>{call.first_sweep_rows, n}, vector_view<Compute>{whole.row(row_lse), n});
      if (grads.has_entropy) {
        backend_.copy(vector_view<const Compute>{call.first_sweep_rows + n, n},
                      vector_view<Compute>{whole.row(row_mean_centred), n});
        args.mean_centred_logit = whole.row(row_mean_centred);
      }
      for (std::int64_t first = vocab_local - call.tail_rows; first < vocab_local; first += call.tail_tile) {
        const auto tile = tail.vocabulary_tile(whole, first, std::min(call.tail_tile, vocab_local - first));
        const auto slice = tail.token_slice(tile, 0, n);
        tail.recompute_logits(slice);
        backend_.logit_gradients(tail.gradient_of_tile(args, slice));
        tail.weight_gradient_of_tile(slice, sink);
      }
    });
  }

  // ---- the optional per-token vectors ------------------------------------------

  template <class Index, class Logprobs, class Lse, class Entropy, class MeanLogit>
  void check_outputs(const operator_inputs<T, Index>& in, const row_output_views<Logprobs, Lse, Entropy, MeanLogit>& out,
                     std::int64_t n, std::initializer_list<byte_range> more_inputs,
                     std::initializer_list<byte_range> more_outputs = {}) const {
    if (out.has_logprobs) check_logprob_rows(out.logprobs, "logprobs", n, in.set_size);
    if (out.has_lse) check_rows(out.lse, "lse", n, "targets");
    if (out.has_entropy) check_rows(out.entropy, "entropy", n, "targets");
    if (out.has_mean_logit) check_rows(out.mean_logit, "mean_logit", n, "targets");
    std::vector<byte_range> inputs{hidden_bytes(in), weight_bytes(in), target_bytes(in), bytes_of(in.bias, "bias")};
    inputs.insert(inputs.end(), more_inputs.begin(), more_inputs.end());
    std::vector<byte_range> outputs{bytes_of(out.logprobs, "logprobs"), bytes_of(out.lse, "lse"),
                                    bytes_of(out.entropy, "entropy"), bytes_of(out.mean_logit, "mean_logit")};
    outputs.insert(outputs.end(), more_outputs.begin(), more_outputs.end());
    check_no_alias(inputs, outputs);
  }

  // Log-probs and their gradients: one per token, or [N, K] (flattened) for target sets of K.
  template <class E>
  static void check_logprob_rows(const vector_view<E>& v, const char* name, std::int64_t n, std::int64_t set_size) {
    if (set_size == 0) return check_rows(v, name, n, "targets");
    check_vector(v, name);
    expects(v.size == n * set_size, name, ": ", v.size, " values do not match the targets' [", n, ", ", set_size,
            "] (one per target id)");
  }

  template <class GradLogprobs, class GradEntropy, class GradLse, class GradMeanLogit>
  static void check_given(const row_gradient_views<GradLogprobs, GradEntropy, GradLse, GradMeanLogit>& grads,
                          std::int64_t n, std::int64_t set_size) {
    if (grads.has_logprobs) check_logprob_rows(grads.logprobs, "grad_logprobs", n, set_size);
    if (grads.has_entropy) check_rows(grads.entropy, "grad_entropy", n, "targets");
    if (grads.has_lse) check_rows(grads.lse, "grad_lse", n, "targets");
    if (grads.has_mean_logit) check_rows(grads.mean_logit, "grad_mean_logit", n, "targets");
    if (grads.has_lse_squared) check_rows(grads.lse_squared, "lse_squared", n, "targets");
  }

  template <class Chunk_, class Logprobs, class Lse, class Entropy, class MeanLogit>
  static void scatter_outputs(sweep_type& sweep, const Chunk_& c,
                              const row_output_views<Logprobs, Lse, Entropy, MeanLogit>& out) {
    if (out.has_logprobs) {
      if (c.set_size > 0) sweep.scatter_set(c, c.set_logprobs, out.logprobs);
      else sweep.scatter_rows(c, row_logprobs, out.logprobs);
    }
    if (out.has_lse) sweep.scatter_rows(c, row_lse, out.lse);
    if (out.has_entropy) sweep.scatter_rows(c, row_entropy, out.entropy);
    if (out.has_mean_logit) sweep.scatter_rows(c, row_mean_logit, out.mean_logit);
  }

  // The chunk's rows of the given gradients, and the gradient pass's
  // arguments pointing at them (absent ones: null, or zero for grad_logprobs).
  template <class Chunk_, class GradLogprobs, class GradEntropy, class GradLse, class GradMeanLogit>
  auto gather_given(sweep_type& sweep, const Chunk_& c,
                    const row_gradient_views<GradLogprobs, GradEntropy, GradLse, GradMeanLogit>& grads) {
    if (grads.has_logprobs && c.set_size == 0) {
      sweep.gather_rows(c, grads.logprobs, row_grad_logprobs);
    } else if (!grads.has_logprobs) {
      backend_.fill_zero(matrix_view<Compute>{c.row(row_grad_logprobs), 1, c.rows, c.rows});
    }  // else: a target set's row sums, from begin_target_set
    auto args = sweep.gradient_base(c);
    if (!grads.has_logprobs) {
      args.set_ids = nullptr;
      args.set_grads = nullptr;
      args.set_size = 0;
    }
    if (grads.has_entropy) {
      sweep.gather_rows(c, grads.entropy, row_grad_entropy);
      args.grad_entropy = c.row(row_grad_entropy);
    }
    if (grads.has_lse) {
      sweep.gather_rows(c, grads.lse, row_grad_lse);
      args.grad_lse = c.row(row_grad_lse);
    }
    if (grads.has_mean_logit) {
      sweep.gather_rows(c, grads.mean_logit, row_grad_mean_logit);
      args.grad_mean_logit = c.row(row_grad_mean_logit);
    }
    if (grads.has_lse_squared) {
      sweep.gather_rows(c, grads.lse_squared, row_lse_squared);
      args.lse_squared = c.row(row_lse_squared);
    }
    return args;
  }
  // A target-set chunk: its gradients (if given) gathered, then its stand-in
  // targets and their rows' gradient sums, before any pass reads c.targets.
  template <class Chunk_, class GradLogprobs, class GradEntropy, class GradLse, class GradMeanLogit>
  static void begin_target_set(sweep_type& sweep, const Chunk_& c,
                               const row_gradient_views<GradLogprobs, GradEntropy, GradLse, GradMeanLogit>& grads) {
    if (c.set_size == 0) return;
    if (grads.has_logprobs) sweep.gather_set(c, grads.logprobs, c.set_grads);
    sweep.target_set_rows(c, grads.has_logprobs);
  }

  struct no_weight_gradient_t {};
  static constexpr no_weight_gradient_t no_weight_gradient{};

  bool sequence_parallel() const { return options_.sequence_parallel && comm_.size() > 1; }

  // A backend may hold state for the length of a sweep (host: the BLAS's
  // thread count, set once per call rather than around every GEMM).
  auto begin_backend_call() {
    if constexpr (requires { backend_.begin_call(); })
      return backend_.begin_call();
    else
      return 0;
  }

  static void check_sizes(const char* call, std::int64_t n_tokens, std::int64_t hidden, std::int64_t vocab_local,
                          std::int64_t set_size = 0) {
    expects(n_tokens >= 0 && hidden >= 0 && vocab_local >= 0 && set_size >= 0, call, ": negative size (n_tokens ",
            n_tokens, ", hidden ", hidden, ", vocab_local ", vocab_local, ", set_size ", set_size, ")");
  }

  workspace_shape shape_of(std::int64_t hidden, std::int64_t vocab_local, std::int64_t set_size = 0) const {
    workspace_shape shape;
    shape.hidden = hidden;
    shape.vocab_local = vocab_local;
    shape.ranks = comm_.size();
    shape.widen_hidden = !std::same_as<T, Operand>;
    shape.operand_bytes = sizeof(Operand);
    shape.gradient_operand_bytes =
        std::same_as<Operand, Compute> || dz_operand_in_logit_rows<Backend>() ? 0 : sizeof(Operand);
    shape.sequence_parallel = sequence_parallel();
    shape.storage_bytes = sizeof(T);
    shape.weight_block_elements = backend_.template weight_block_elements<T>(hidden, vocab_local);
    shape.set_size = set_size;
    return shape;
  }

  // This rank's chunk, counted in logit-block rows (see core/chunking.hpp for
  // who decides), and the plan for it; `agreed_rows` > 0 caps it at what the
  // ranks agreed on.
  // `limit`: the bytes the chunks may take, where not the options' workspace_limit_bytes (0).
  workspace_plan<Compute> plan_for(std::int64_t n_tokens, std::int64_t hidden, std::int64_t vocab_local,
                                   std::int64_t agreed_rows = 0, std::int64_t set_size = 0,
                                   std::size_t limit = 0) const {
    const auto shape = shape_of(hidden, vocab_local, set_size);
    std::int64_t rows = 0;
    bool evened = false;  // a run-time policy's answer: the most rows a chunk may take
    if constexpr (fixed_chunk_policy<Chunk>) {
      rows = Chunk::tokens;
    } else if (options_.chunk_tokens > 0) {
      rows = options_.chunk_tokens;
    } else {
      const auto saturated = [](checked_size size) { return size.overflow ? SIZE_MAX : size.value; };
      chunk_request request;
      request.n_tokens = n_tokens;
      request.hidden = hidden;
      request.vocab_local = vocab_local;
      request.bytes_per_token = saturated(workspace_plan<Compute>::bytes_per_token(shape));
      request.fixed_bytes = saturated(workspace_plan<Compute>::fixed_bytes(shape));
      request.workspace_limit_bytes = limit > 0 ? limit : options_.workspace_limit_bytes;
      request.enough_rows = enough_chunk_rows<Backend>();
      request.min_efficient_rows = min_efficient_chunk_rows<Backend>();
      rows = std::max<std::int64_t>(1, static_cast<std::int64_t>(Chunk{}.tokens_per_chunk(request)));
      evened = true;
    }
    // The ranks' agreed chunk is some rank's finished plan: taken as it is, so
    // that every rank runs the same chunks.
    if (agreed_rows > 0 && agreed_rows < rows) rows = agreed_rows, evened = false;
    rows = std::min(rows, message_row_limit(hidden, set_size));
    const std::int64_t share = shape.sequence_parallel ? shape.ranks : 1;
    const std::int64_t local_tokens = n_tokens / share;
    std::int64_t local_chunk = std::clamp<std::int64_t>(rows / share, 1, std::max<std::int64_t>(local_tokens, 1));
    if (evened) {  // core/chunking.hpp; a backend without min_efficient_chunk_rows has no floor
      const std::int64_t least = std::max<std::int64_t>(1, min_efficient_chunk_rows<Backend>() / share);
      local_chunk = evened_chunk_rows(local_tokens, local_chunk, least);
    }
    return workspace_plan<Compute>::make(shape, local_chunk);
  }

  // The most logit-block rows whose per-chunk messages (dX rows of H, the
  // gathered hidden rows, the row partials) fit the communicator's count.
  std::int64_t message_row_limit(std::int64_t hidden, std::int64_t set_size) const {
    if (comm_.size() == 1) return INT64_MAX;
    const auto compute_bytes = static_cast<std::int64_t>(sizeof(Compute));
    const std::int64_t widest =
        std::max(compute_bytes * std::max<std::int64_t>(hidden, 1),
                 static_cast<std::int64_t>(sizeof(row_partial<Compute>)) + compute_bytes * set_size + 1);
    return std::max<std::int64_t>(1, message_byte_limit(comm_) / widest);
  }

  // ---- steps 1-3 -------------------------------------------------------------

  // `terms` says which optional per-token vectors the call has: ranks must agree on it too.
  template <class Index, class GradWeight, class CallChecks>
  prepared_call prepare(const deferred_failure& conversion, const operator_inputs<T, Index>& in, call_kind kind,
                        std::int64_t terms, const GradWeight& grad_weight, const vector_view<Compute>& grad_bias,
                        CallChecks&& call_checks) {
    prepared_call call;
    call_record mine;
    target_scan targets;
    std::string failure = conversion.message();
    if (failure.empty()) {
      failure = failure_of([&] {
        check_inputs(in);
        call_checks(in.tokens());
        targets = scan(in.targets);
        if constexpr (narrow_weight_gradient<GradWeight>()) {
          using G = element_of<GradWeight>;
          auto gradient = gradient_plan_for<G>(in.tokens(), in.hidden.cols, in.weight.rows, in.set_size);
          if (logits_fit_grad_weight(kind, grad_weight, in.tokens()))
            gradient = kept_logits_or<G>(gradient, in.tokens(), in.hidden.cols, in.weight.rows, in.set_size);
          if (accumulator_fits_grad_weight(kind, grad_weight, in.tokens()))
            gradient =
                accumulator_in_grad_weight_or<G>(gradient, in.tokens(), in.hidden.cols, in.weight.rows, in.set_size);
          take_plan<G>(call, gradient, in);
          const checked_size dw_bytes = weight_gradient_scratch_bytes<G>(gradient, in.hidden.cols, in.weight.rows);
          expects(!dw_bytes.overflow, "grad_weight: the fp32 scratch of its dW for vocab_local ", in.weight.rows,
                  " x hidden ", in.hidden.cols, " needs more bytes than size_t holds");
          // None where the backend rounds its dW tiles into grad_weight itself (then told so by a null scratch).
          if (dw_bytes.value > 0)
            call.weight_gradient_scratch = static_cast<Compute*>(weight_gradient_.reserve(
                backend_, dw_bytes.value,
                call.tiles_into_grad_weight ? "grad_weight (fp32 tiles of it)" : "grad_weight (its fp32 accumulator)"));
          if (call.tail_rows > 0) {
            call.first_sweep_rows = call.weight_gradient_scratch +
                                    sum_rest_bytes<G>(gradient, in.hidden.cols, in.weight.rows).value / sizeof(Compute);
            if (weight_gradient_tile_elements<G>(in.hidden.cols, call.tail_tile, in.tokens()) > 0)
              call.tail_tile_scratch =
                  call.first_sweep_rows + first_sweep_rows_bytes(in.tokens()).value / sizeof(Compute);
          }
        } else {
          take_plan<Compute>(call, direct_plan_for<GradWeight>(kind, in.tokens(), in.hidden.cols, in.weight.rows,
                                                               in.set_size,
                                                               logits_fit_grad_weight(kind, grad_weight, in.tokens())),
                             in);
        }
      });
    }
    if (comm_.size() == 1) {
      if (!failure.empty()) throw error(failure);
      expects(options_.vocab_start == 0, "options.vocab_start = ", options_.vocab_start,
              " on a single rank: the shard must cover the whole vocabulary [0, ", in.weight.rows, ")");
      check_target_ids(targets, in.targets, in.weight.rows, in.set_size);
      call.vocab = in.weight.rows;
      return call;
    }
    mine.ok = failure.empty() ? 1 : 0;
    if (failure.empty()) {
      mine.n_tokens = in.tokens();
      mine.hidden = in.hidden.cols;
      mine.vocab_start = options_.vocab_start;
      mine.vocab_local = in.weight.rows;
      mine.chunk = call.plan.chunk;
      mine.sequence_parallel = options_.sequence_parallel ? 1 : 0;
      mine.ignore_index = options_.ignore_index;
      mine.temperature_bits = float_bits(options_.temperature);
      mine.softcap_bits = float_bits(options_.softcap);
      mine.call = static_cast<std::int64_t>(kind) | (in.bias.size ? call_with_bias : 0) |
                  (grad_bias.size ? call_with_grad_bias : 0) | terms << 8 | in.set_size << 20;
      mine.targets_hash = targets.hash;
      mine.element_types = element_types_code<T, Compute>();
      mine.targets_lowest = targets.lowest;
      mine.targets_highest = targets.highest;
    }
    const agreed_call agreed = agreement_.agree(comm_, mine, failure);
    // The vocabulary is known now. Every rank holds the same targets (their hashes agree), so
    // each reaches the same verdict from its own; from the exchanged extremes all the same, where
    // a rank's ids that leave the vocabulary passed the hash.
    check_target_ids(targets, in.targets, agreement_.vocab(), in.set_size);
    const std::int64_t lowest = agreed.targets_lowest, highest = agreed.targets_highest;
    expects(lowest > highest || (lowest >= 0 && highest < agreement_.vocab()), "targets: another rank's ids reach ",
            lowest < 0 ? lowest : highest, ", outside the vocabulary [0, ", agreement_.vocab(),
            ") (not ignore_index): every rank must pass the same N targets");
    call.vocab = agreement_.vocab();
    if (agreed.chunk < call.plan.chunk)
      call.plan = plan_for(in.tokens(), in.hidden.cols, in.weight.rows, agreed.chunk, in.set_size);
    return call;
  }

  // The host reads the targets where they are; a backend whose memory it
  // cannot read scans them itself (hash and extremes in one pass).
  template <class Index>
  static constexpr bool backend_scans_targets =
      requires(Backend& b, const vector_view<const Index>& t) { b.scan_targets(t, std::int64_t{}); };

  template <class Index>
  target_scan scan(const vector_view<const Index>& targets) {
    if constexpr (backend_scans_targets<Index>) {
      return backend_.scan_targets(targets, options_.ignore_index);
    } else {
      // The range is checked id by id (check_targets); the extremes tell the other ranks.
      return comm_.size() > 1 ? scan_targets_on_host(targets, options_.ignore_index) : target_scan{};
    }
  }

  template <class Index>
  void check_target_ids(const target_scan& scanned, const vector_view<const Index>& targets, std::int64_t vocab,
                        std::int64_t set_size) {
    if constexpr (backend_scans_targets<Index>) {
      const auto outside = [&](std::int64_t at, std::int64_t id) {
        fail(target_place{at, set_size}, " = ", id, " is outside the vocabulary [0, ", vocab,
             ") and is not ignore_index (", options_.ignore_index, ")");
      };
      if (scanned.highest < scanned.lowest) return;  // every target ignored
      if (scanned.lowest < 0) outside(scanned.lowest_at, scanned.lowest);
      if (scanned.highest >= vocab) outside(scanned.highest_at, scanned.highest);
    } else {
      check_targets(targets, vocab, options_.ignore_index, set_size);
    }
  }

  template <class Checks>
  static std::string failure_of(Checks&& checks) {
    try {
      checks();
    } catch (const error& e) {
      return e.what();
    }
    return {};
  }

  template <class Index>
  void check_inputs(const operator_inputs<T, Index>& in) const {
    constexpr std::int64_t gemm_limit = gemm_extent_limit<Backend>();
    check_matrix(in.hidden, "hidden", gemm_limit);
    check_matrix(in.weight, "weight", gemm_limit);
    check_vector(in.targets, "targets");
    expects(in.hidden.cols == in.weight.cols, "hidden: ", in.hidden.cols, " columns do not match weight's ",
            in.weight.cols, " columns (the hidden size)");
    expects(in.hidden.cols > 0, "hidden: the hidden size (columns) must be > 0, got ", in.hidden.cols);
    if (sequence_parallel()) {
      expects(in.tokens() == in.hidden.rows * comm_.size(), "targets: size ", in.tokens(),
              " is not ranks (", comm_.size(), ") x the ", in.hidden.rows,
              " rows of hidden on this rank (sequence parallel: every rank holds an equal share of the tokens)");
    } else {
      expects(in.tokens() == in.hidden.rows, "targets: size ", in.tokens(), " does not match the ",
              in.hidden.rows, " rows of hidden");
    }
    expects(in.weight.rows > 0, "weight: this rank's vocabulary shard is empty (0 rows)");
    if (in.bias.data || in.bias.size) check_rows(in.bias, "bias", in.weight.rows, "weight");
    expects(workspace_plan<Compute>::padded_ld(in.weight.rows) <= gemm_limit, "weight: a shard of ",
            in.weight.rows, " vocabulary rows exceeds the GEMMs' integer range (", gemm_limit, ")");
  }

  template <class Index>
  static byte_range hidden_bytes(const operator_inputs<T, Index>& in) { return bytes_of(in.hidden, "hidden"); }
  template <class Index>
  static byte_range weight_bytes(const operator_inputs<T, Index>& in) { return bytes_of(in.weight, "weight"); }
  template <class Index>
  static byte_range target_bytes(const operator_inputs<T, Index>& in) { return bytes_of(in.targets, "targets"); }

  template <class Index, class GradHidden, class GradWeight>
  static void check_gradients(const operator_inputs<T, Index>& in, const matrix_view<GradHidden>& grad_hidden,
                              const matrix_view<GradWeight>& grad_weight, const vector_view<Compute>& grad_bias) {
    constexpr std::int64_t gemm_limit = gemm_extent_limit<Backend>();
    check_shape(grad_hidden, "grad_hidden", in.hidden.rows, in.hidden.cols, "hidden", gemm_limit);
    check_shape(grad_weight, "grad_weight", in.weight.rows, in.weight.cols, "weight", gemm_limit);
    if (grad_bias.data || grad_bias.size) check_rows(grad_bias, "grad_bias", in.weight.rows, "weight");
  }

  // A grad_weight of another type than the compute type takes each tile of
  // dW straight from the backend (no [V_local, H] accumulator) when the call
  // is one chunk on one rank and the backend can. One rank only: with
  // several, the agreed chunk may come out smaller than this rank's, and the
  // accumulator could then only be allocated after the agreement, where a
  // failure would leave the other ranks waiting.
  template <class GradWeight>
  static constexpr bool backend_adds_weight_gradient_tiles =
      adds_weight_gradient_tiles<Backend, Operand, Compute, GradWeight>;

  // Whether a forward_backward may keep the logits of its first sweep over
  // the vocabulary tiles in grad_weight until its second: dz made in place
  // of the kept logits (GEMMs on the compute type, or dz in the operand type
  // over the first half of the logits' rows: no operand block of a tile's
  // width), grad_weight written over and never read
  // (options.overwrite_weight_gradients, with a backend whose dW GEMM writes
  // its rows with beta 0: in the compute type, or a narrower grad_weight
  // straight from the backend's tiles), its rows contiguous and aligned for
  // the compute type, and a row of it holding half a logit column of every
  // token or more (N x sizeof(Compute) <= 2 H x sizeof(G): N <= 2 H in fp32,
  // N <= H for a bf16 grad_weight), or kept as bf16 ratios (kept_ratios_plan)
  // a quarter of a 2-byte column (N <= 4 H for a 2-byte grad_weight). The
  // tiles' [N, V_local] logits then take grad_weight's storage instead of being
  // computed twice (see gradient_by_kept_logits): all of them where a row holds
  // a whole column, else those of the tiles whose logits the rows before them
  // hold (vocabulary_tiles_of).
  template <class G>
  static std::int64_t kept_logits_reach(std::int64_t hidden) {
    const std::int64_t row_bytes = hidden * static_cast<std::int64_t>(sizeof(G));
    if constexpr (sizeof(G) < sizeof(Compute) && keeps_ratios)
      return kept_ratios_reach * row_bytes / static_cast<std::int64_t>(sizeof(bfloat16));
    else
      return 2 * row_bytes / static_cast<std::int64_t>(sizeof(Compute));
  }

  template <class GradWeight>
  bool logits_fit_grad_weight(call_kind kind, const GradWeight& grad_weight, std::int64_t n_tokens) const {
    return grad_weight_storage_serves<storage_use::kept_logits>(kind, grad_weight, n_tokens);
  }

  // What a forward_backward may keep in a grad_weight's free storage, where the backend can:
  // the vocabulary order's logits (logits_fit_grad_weight) or the token order's dW sum
  // (accumulator_fits_grad_weight).
  enum class storage_use { kept_logits, dw_sum };
  template <storage_use Use, class GradWeight>
  bool grad_weight_storage_serves(call_kind kind, const GradWeight& grad_weight, std::int64_t n_tokens) const {
    if constexpr (std::same_as<GradWeight, no_weight_gradient_t>) {
      return false;
    } else {
      using G = element_of<GradWeight>;
      constexpr bool backend_can =
          Use == storage_use::kept_logits ? backend_keeps_logits_in<G> : backend_holds_accumulator_in<G>;
      if constexpr (!backend_can) {
        return false;
      } else {
        if (!grad_weight_storage_free(kind, grad_weight, n_tokens)) return false;
        if constexpr (Use == storage_use::kept_logits) return n_tokens <= kept_logits_reach<G>(grad_weight.cols);
        else return accumulator_rows_in_grad_weight<G>(grad_weight.rows) > 0;
      }
    }
  }

  // Whether grad_weight's storage is free until a forward_backward's dW lands there: written
  // over and never read (options.overwrite_weight_gradients), on one rank, its rows contiguous
  // and aligned for the compute type.
  template <class GradWeight>
  bool grad_weight_storage_free(call_kind kind, const GradWeight& grad_weight, std::int64_t n_tokens) const {
    return kind == call_kind::forward_backward && options_.overwrite_weight_gradients && comm_.size() == 1 &&
           n_tokens > 0 && grad_weight.ld == grad_weight.cols &&
           reinterpret_cast<std::uintptr_t>(grad_weight.data) % alignof(Compute) == 0;
  }

  // Whether a forward_backward may hold the token order's [V_local, H] dW sum in the compute
  // type partly in a narrower grad_weight's own storage (accumulator_in_grad_weight_or): a
  // backend whose dW GEMMs into the compute type take beta (the first chunk writes the sum),
  // and that keeps logits in such a grad_weight (its storage as the compute type).
  template <class GradWeight>
  bool accumulator_fits_grad_weight(call_kind kind, const GradWeight& grad_weight, std::int64_t n_tokens) const {
    return grad_weight_storage_serves<storage_use::dw_sum>(kind, grad_weight, n_tokens);
  }

  // The rows of the dW sum that a narrower grad_weight of vocab_local rows holds in the compute
  // type: all its storage but the first row's worth (the sum's row r lies at the compute-type
  // row r + 1, so that rounding the rows in place never writes over a row not yet read; see
  // round_accumulator_in_grad_weight).
  template <class G>
  static std::int64_t accumulator_rows_in_grad_weight(std::int64_t vocab_local) {
    return std::max<std::int64_t>(
        0, vocab_local * static_cast<std::int64_t>(sizeof(G)) / static_cast<std::int64_t>(sizeof(Compute)) - 1);
  }

  // The decisions below weigh one tile (from the shapes alone), so that
  // the chunks, and with them the bits, never depend on the thread count.
  template <class GradWeight>
  bool one_chunk_without_accumulator(std::int64_t n_tokens, const workspace_plan<Compute>& plan) const {
    if constexpr (backend_adds_weight_gradient_tiles<GradWeight>) {
      return comm_.size() == 1 && n_tokens <= plan.local_chunk;
    } else {
      return false;
    }
  }

  // One dW tile of the backend's, in compute-type elements, for GEMMs of at most `tokens` rows of dz.
  template <class GradWeight>
  std::size_t weight_gradient_tile_elements(std::int64_t hidden, std::int64_t vocab_local, std::int64_t tokens) const {
    if constexpr (!backend_adds_weight_gradient_tiles<GradWeight>)
      return 0;
    else if constexpr (requires {
                         backend_.template weight_gradient_tile_elements<Compute, Operand, GradWeight>(hidden, vocab_local,
                                                                                                   tokens);
                       })
      return static_cast<std::size_t>(
          backend_.template weight_gradient_tile_elements<Compute, Operand, GradWeight>(hidden, vocab_local, tokens));
    else
      return static_cast<std::size_t>(
          backend_.template weight_gradient_tile_elements<Compute>(hidden, vocab_local, tokens));
  }

  template <class GradWeight>
  std::size_t weight_gradient_tile_slots() const {
    if constexpr (backend_adds_weight_gradient_tiles<GradWeight>)
      return static_cast<std::size_t>(std::max(1, backend_.weight_gradient_tile_slots()));
    else
      return 0;
  }

  // Whether a call writes a grad_weight whose element is not the compute type.
  template <class GradWeight>
  static constexpr bool narrow_weight_gradient() {
    if constexpr (std::same_as<GradWeight, no_weight_gradient_t>)
      return false;
    else
      return !std::same_as<element_of<GradWeight>, Compute>;
  }

  struct gradient_plan {
    workspace_plan<Compute> plan;
    bool tiles_into_grad_weight = false;
    // > 0: the vocabulary order, this many weight rows at a time; with
    // tiles_into_grad_weight all the tokens at once, else in slices of
    // plan.block_rows, each tile's dW summed in a [vocab_tile, H] accumulator.
    std::int64_t vocab_tile = 0;
    // > 0: a forward_backward in the vocabulary order, all its rows at once, that keeps its
    // logits between the two sweeps in grad_weight (kept_logits_plan); the first tile's columns,
    // and the kept tiles' widths are whole multiples of kept_step columns (vocabulary_tiles_of).
    std::int64_t first_vocab_tile = 0;
    std::int64_t kept_step = 0;
    // With kept logits: kept as bf16 ratios (kept_ratios_plan).
    bool kept_as_ratios = false;
    // The token order, its [V_local, H] dW sum in part in grad_weight's storage
    // (accumulator_in_grad_weight_or).
    bool accumulator_in_grad_weight = false;
    // With it, > 0: the sum leaves out the shard's last tail_rows rows, whose dW a second sweep
    // makes (tail_sweep_plan): every token at once, tail_tile of them at a time, in tail_plan.
    std::int64_t tail_rows = 0;
    std::int64_t tail_tile = 0;
    workspace_plan<Compute> tail_plan{};
  };

  // The plan of a call that writes a grad_weight of element G (not the
  // compute type). Under the budget policy, a call of several chunks holds
  // the [V_local, H] accumulator on top of its chunk; when all its tokens
  // in one chunk, with the backend's dW tiles, hold no more than that, the
  // call takes them in one chunk: less memory, and no accumulator to fill,
  // sum into and read back. Then, where the vocabulary order holds less
  // still than the token order so chosen (one chunk, or several and the
  // accumulator), the call sweeps that way (vocabulary_tiles_plan), even
  // where its tokens fit the policy's chunk: one chunk's fp32 logits hold
  // twice what the materialised 2-byte logits would, and a forward_backward
  // over all N <= 512 tokens in 1,024-column tiles (4 GEMMs) took the time
  // of the one chunk (3 GEMMs) in a fresh process (lce_torch, bf16, H
  // 1,024, Xeon with AMX, 2 threads, these tiles / one chunk: 0.069 / 0.070 s at V 32,000 and
  // N 256, 0.108 / 0.106 s at N 512, 0.373 / 0.420 s at V 128,256 and N
  // 512), with 4-14 MiB instead of 40-260; with memory reused (a warm
  // allocator) it took 1.0-1.35x the one chunk's time. Each side is
  // weighed with one dW tile, or the vocabulary order with token slices
  // with its tile's accumulator (from the shapes alone), so that the plan,
  // and with it the bits, never depend on the thread count.
  template <class G>
  gradient_plan gradient_plan_for(std::int64_t n_tokens, std::int64_t hidden, std::int64_t vocab_local,
                                  std::int64_t set_size) const {
    gradient_plan result{plan_for(n_tokens, hidden, vocab_local, 0, set_size)};
    const bool budget_decides = !fixed_chunk_policy<Chunk> && options_.chunk_tokens <= 0;
    // The dW scratch with one slot of tiles: the same on any thread count.
    const auto scratch = [&](const gradient_plan& plan) {
      return weight_gradient_scratch_bytes<G>(plan, hidden, vocab_local, /*slots=*/1);
    };
    // Every token in one chunk within the budget: the fewest GEMMs, weighed below against the vocabulary order.
    result.tiles_into_grad_weight = one_chunk_without_accumulator<G>(n_tokens, result.plan);
    if (!budget_decides || n_tokens < 1 || n_tokens > message_row_limit(hidden, set_size)) return result;
    const checked_size several = checked_size(result.plan.bytes) +
                                 checked_size::of(vocab_local) * checked_size::of(hidden) * sizeof(Compute);
    checked_size held = result.tiles_into_grad_weight ? checked_size(result.plan.bytes) + scratch(result) : several;
    if (!result.tiles_into_grad_weight) {
      const auto shape = shape_of(hidden, vocab_local, set_size);
      const checked_size one = workspace_plan<Compute>::fixed_bytes(shape) +
                               checked_size::of(n_tokens) * workspace_plan<Compute>::bytes_per_token(shape) +
                               scratch({.plan = {.block_rows = n_tokens}, .tiles_into_grad_weight = true});
      if (!one.overflow && (several.overflow || one.value <= several.value)) {
        const auto whole = workspace_plan<Compute>::make(shape, n_tokens);
        if (one_chunk_without_accumulator<G>(n_tokens, whole)) {
          result = {whole, true};
          held = one;
        }
      }
    }
    if (set_size == 0) {
      const auto tiled = vocabulary_tiles_plan<G>(n_tokens, hidden, vocab_local, /*with_slices=*/true);
      if (tiled.vocab_tile > 0) {
        const checked_size tiled_held = checked_size(tiled.plan.bytes) + scratch(tiled);
        if (!tiled_held.overflow && (held.overflow || tiled_held.value < held.value)) return tiled;
      }
    }
    return result;
  }

  // Whether this backend can sweep the vocabulary order for a grad_weight of
  // element G, and with the tokens in slices (a tile's dW summed over them).
  // A forward needs nothing more than the token order does; a grad_weight in
  // the compute type takes each tile's dW GEMM as it is (beta 1).
  template <class G>
  static constexpr bool backend_sweeps_vocabulary_tiles =
      std::same_as<G, no_weight_gradient_t> ||
      (adds_grad_hidden<Backend, Operand, T, Compute> &&
       (std::same_as<G, Compute> || backend_adds_weight_gradient_tiles<G>));
  // In slices a forward needs nothing more either; a grad_weight in the
  // compute type takes each slice's dW GEMM as it is.
  template <class G>
  static constexpr bool backend_slices_vocabulary_tiles =
      backend_sweeps_vocabulary_tiles<G> && (std::same_as<G, no_weight_gradient_t> || std::same_as<G, Compute> ||
                                             rounds_accumulated_weight_gradient<Backend, Operand, Compute, G>);
  // And whether it can keep a forward_backward's logits in such a grad_weight (logits_fit_grad_weight).
  template <class G>
  static constexpr bool backend_keeps_logits_in =
      (std::same_as<Operand, Compute> || dz_operand_in_logit_rows<Backend>()) && backend_sweeps_vocabulary_tiles<G> &&
      (std::same_as<G, Compute>
           ? overwrites_compute_weight_gradient<Backend, Operand, Compute>
           : backend_adds_weight_gradient_tiles<G> && overwrites_weight_gradient<Backend, Operand, Compute, G>);

  // And whether it can hold a forward_backward's dW sum in part in such a grad_weight
  // (accumulator_fits_grad_weight): its dW GEMMs into the compute type take beta.
  template <class G>
  static constexpr bool backend_holds_accumulator_in = backend_keeps_logits_in<G> &&
                                                       overwrites_compute_weight_gradient<Backend, Operand, Compute> &&
                                                       sizeof(Compute) % sizeof(G) == 0;

  // The plan of a call with no dW scratch: a forward (GradWeight is
  // no_weight_gradient_t), or a grad_weight in the compute type, which each
  // dW GEMM adds into in either order. One rank takes the vocabulary order,
  // all its rows at once, where that holds less than the token order's
  // chunk (one chunk of all N <= enough_chunk_rows rows holds all the
  // logits). A forward or a backward runs the same GEMMs in either order.
  // A forward_backward runs one more (the logits twice). With 2-byte
  // inputs it takes the vocabulary order all the same: their fp32 logits
  // of one chunk would hold twice what materialising the 2-byte logits
  // does, and it took the token order's time in a fresh process (bf16, V
  // 32,000 / 128,256, N 256-512; see gradient_plan_for). With float or
  // double inputs it took 1.3-1.5x the token order's time at V 32,000 and
  // N 256-1,024 (2 threads, lce_torch on MKL's sgemm, Xeon), so there it
  // takes the vocabulary order only where the budget starves the token
  // order, its chunk below the backend's min_efficient_chunk_rows (8 MiB
  // at V 128,256 makes chunks of 16 rows: 3.4x the time of 256-512).
  template <class GradWeight>
  gradient_plan direct_plan_for(call_kind kind, std::int64_t n_tokens, std::int64_t hidden, std::int64_t vocab_local,
                                std::int64_t set_size, bool logits_fit = false) const {
    gradient_plan result{plan_for(n_tokens, hidden, vocab_local, 0, set_size)};
    using G = std::conditional_t<std::same_as<GradWeight, no_weight_gradient_t>, no_weight_gradient_t, Compute>;
    const bool budget_decides = !fixed_chunk_policy<Chunk> && options_.chunk_tokens <= 0;
    if (!budget_decides || set_size != 0 || n_tokens < 1) return result;
    constexpr std::int64_t least = min_efficient_chunk_rows<Backend>();
    const bool starved = least != INT64_MAX && result.plan.local_chunk < std::min(n_tokens, least);
    // Its logits kept in grad_weight, a forward_backward in the vocabulary order runs the token order's
    // three GEMMs in a block of one narrow tile. Where they fit only in part (H < N <= 2 H), it runs
    // about three and a half: fewer than the vocabulary order's four, more than the token order's three.
    if (logits_fit && kind == call_kind::forward_backward && (n_tokens <= hidden || !std::same_as<T, Compute>)) {
      const auto kept = kept_logits_or<Compute>(result, n_tokens, hidden, vocab_local, set_size);
      if (kept.first_vocab_tile > 0) return kept;
    }
    if (kind == call_kind::forward_backward && std::same_as<T, Compute> && !starved) return result;
    // Token slices only where the token order is starved too: a slice's GEMMs re-read every
    // hidden row once per 4,096 vocabulary rows, where a chunk's read them once.
    const auto tiled = vocabulary_tiles_plan<G>(n_tokens, hidden, vocab_local, /*with_slices=*/starved);
    if (tiled.vocab_tile == 0) return result;
    // Starved, both orders hold about the budget; the vocabulary order's GEMMs are the wider.
    const std::size_t room = starved ? std::max(result.plan.bytes, options_.workspace_limit_bytes) : 0;
    if (tiled.plan.bytes < result.plan.bytes || tiled.plan.bytes <= room) return tiled;
    return result;
  }

  // The vocabulary order of a call on one rank: every token in one chunk, the
  // vocabulary `vocab_tile` weight rows at a time (whole cache lines, at
  // least vocabulary_tile_min_columns rows). It holds an [N, H] sum of dX in
  // the compute type where the token order holds the [V_local, H] dW
  // accumulator (or all of [N, V_local] in one chunk), and costs the
  // forward_backward one more GEMM (the logits before and after every row's
  // lse is known).
  //  - All N rows at a time where [N, vocabulary_tile_min_columns] fits
  //    both the budget and vocabulary_tile_block_bytes: the widest tile that
  //    does, but at most a vocabulary_share of the shard down to the
  //    backend's min_efficient_vocabulary_tile. Each tile's dW is then final
  //    when its GEMM ends.
  //  - Else (a long call) the tile is vocabulary_tile_min_columns rows and
  //    the tokens go in slices: the most rows whose [slice, tile] block fits
  //    both (at least one). A [tile, H] accumulator in the compute type sums
  //    each tile's dW over its slices (tiles_into_grad_weight is false).
  // The block bound is the backend's (vocabulary_block_bytes in
  // core/backend.hpp). vocab_tile = 0: not available here (several ranks, a
  // backend without adds_grad_hidden, or a tile as wide as the shard).
  static constexpr std::size_t vocabulary_tile_block_bytes = vocabulary_block_bytes<Backend>();
  // Narrower tiles make every GEMM re-read (and the host's dW GEMMs re-pack)
  // all the slice's hidden rows once per few hundred vocabulary rows: bf16
  // on the CPU at N = 4,096-8,192 with all N rows in 1,024- and 512-column
  // tiles took 1.4-1.7x PyTorch's plain time where the token order took
  // 0.6-0.95x.
  static constexpr std::int64_t vocabulary_tile_min_columns = 4096;
  // The fp32 block of a tile that holds a 32nd of the shard holds a 16th of
  // what the shard's bf16 logits would, and with the [N, H] sum, the widened
  // rows and the dW tiles a 2-byte call holds about a tenth of what
  // materialising does (plain PyTorch, bf16, N 1,024, H 1,024, V 32,000:
  // 123-185 MiB against 15-16 MiB, one tile of 4,000 had held 32-36).
  // Narrower than 4,096 columns only here, with all N <= 1,024 rows at once:
  // the hidden rows every GEMM re-reads stay in cache.
  static constexpr std::int64_t vocabulary_share = 32;

  // Compute elements in a cache line (workspace_alignment): the tiles' column granularity.
  static constexpr std::int64_t line_elements = static_cast<std::int64_t>(workspace_alignment / sizeof(Compute));

  // The workspace of the vocabulary order's tiles of `tile` columns, `block_rows` rows at a time (0: all).
  workspace_shape vocabulary_tile_shape(std::int64_t hidden, std::int64_t tile, std::int64_t block_rows) const {
    auto shape = shape_of(hidden, tile);
    shape.ranks = 2;  // two exchange records: the running merge and the tile's
    shape.block_rows = block_rows;
    return shape;
  }

  // The vocabulary order of a forward_backward whose logits fit grad_weight
  // (logits_fit_grad_weight), all its rows at once, the logits of its tiles
  // kept in grad_weight's rows before each tile's own (vocabulary_tiles_of),
  // the first tile's in the logit block. Where a row holds a logit column of
  // every token (N sizeof(Compute) <= H sizeof(G)), every later tile's logits
  // are kept, and a tile may be as many times wider than the one before as
  // those rows hold logit columns (4 in fp32 at N = H / 4, 2 for a bf16
  // grad_weight at N = H / 4). Only the first tile's logits take the block,
  // so the tiles start narrow and grow to `widest`: the first as narrow as
  // one step allows, and narrower by more steps (kept_logits_ramp) while it
  // stays kept_logits_least_first columns wide. Through lce_torch (float32,
  // H 1,024, V 32,000, N 256 / 1,024, 2 threads, Xeon) tiles of 1,024
  // columns had taken 0.227 / 0.736 s where 4,000 took 0.167 / 0.552, and
  // 16,000 no less; so fp32 tiles grow to vocabulary_tile_min_columns.
  // Where a row holds less (a bf16 grad_weight at H / 2 < N <= H), the
  // logits are kept in 2 bytes where the backend can (kept_ratios_plan);
  // elsewhere the first tile is `widest`, and the tiles whose logits the rows
  // before them cannot hold (in kept_logits_step columns or more) take the
  // block too, their logits computed again in the second sweep: at N = H
  // about half of them.
  static constexpr int kept_logits_ramp = 3;
  static constexpr std::int64_t kept_logits_least_first = 512;
  static constexpr std::int64_t kept_logits_step = 1024;

  template <class G>
  gradient_plan kept_logits_plan(std::int64_t n_tokens, std::int64_t hidden, std::int64_t vocab_local,
                                 std::int64_t widest) const {
    if constexpr (!backend_sweeps_vocabulary_tiles<G>) {
      return {};
    } else {
      if (vocab_local <= widest) return {};
      const auto rows_for = [&](std::int64_t tile, std::size_t element_bytes) {
        const std::int64_t bytes = tile * n_tokens * static_cast<std::int64_t>(element_bytes);
        const std::int64_t row_bytes = hidden * static_cast<std::int64_t>(sizeof(G));
        return detail::ceil_div(detail::ceil_div(bytes, row_bytes), line_elements) * line_elements;
      };
      const auto before = [&](std::int64_t tile) { return rows_for(tile, sizeof(Compute)); };
      if constexpr (sizeof(G) == sizeof(bfloat16) && keeps_ratios) {
        if (before(widest) > widest) return kept_ratios_plan(n_tokens, hidden, widest);
      }
      std::int64_t first = std::min(widest, before(widest));
      for (int step = 1; step < kept_logits_ramp; ++step) {
        const std::int64_t narrower = before(first);
        if (narrower >= first || narrower < kept_logits_least_first) break;
        first = narrower;
      }
      // A row of a narrower grad_weight holding exactly a column (bf16 at N = H / 2): the tiles
      // cannot grow, but two half tiles in the block (the first computed again) make room for
      // every later tile of `widest` columns, so the block holds half of one: bf16 through
      // lce_torch at V 32,000, N 512 held 4 MiB against plain's 31-33 (8.1-8.7x less) with the
      // whole tile, 2.8-2.9 MiB (10.8-11.1x) with half, in 0.85-0.88x plain's time (0.78-0.88x
      // with the whole tile, 2 / 1 threads, one run each).
      std::int64_t kept_step = first;
      if (sizeof(G) < sizeof(Compute) && first == widest && before(first) == first) {
        first = std::max(kept_logits_least_first, widest / 2 / line_elements * line_elements);
        kept_step = widest;
      }
      auto shape = vocabulary_tile_shape(hidden, first, 0);
      shape.weight_block_elements = backend_.template weight_block_elements<T>(hidden, widest);  // the widest tile's
      const auto plan = workspace_plan<Compute>::make(shape, n_tokens);
      if (plan.bytes > options_.workspace_limit_bytes) return {};
      return {.plan = plan,
              .tiles_into_grad_weight = true,
              .vocab_tile = widest,
              .first_vocab_tile = first,
              .kept_step = std::min(kept_step, kept_logits_step)};
    }
  }

  // kept_logits_plan where a 2-byte grad_weight's rows cannot hold the fp32
  // logits of the tiles after them (N > H / 2) but hold them in 2 bytes
  // (N <= H; up to 4 H in part, below): as bf16 ratios to each row's largest
  // (keeps_logit_ratios), every tile through the logit block in the first
  // sweep, all but the first kept. The second sweep takes the last tile's
  // logits from the block, expands the others' there, and computes the first's
  // again (at N = H the second's too: its row centres would take rows the
  // first leaves). At V 32,000, N = H = 1,024, 40 tiles of 42 are kept, where
  // fp32 logits left half of them to be computed again: a bf16 step through
  // lce_torch 8-10% faster at N 768 and 1,024 (Zen 5, 1 and 2 threads).
  // The tiles are kept_ratios_tile_columns wide: the block holds [N, 768] of
  // fp32, not [N, 1,024] (at N 768 lce held 7 MiB, 11x less than plain's 77, where
  // 1,024 columns held 8 MiB, 9.7x), in the same time (0.194 / 0.193 s, 2 threads;
  // 0.357 / 0.355 s, one; the same at N 1,024, and with warm memory); 512 columns
  // were 3-4% slower.
  static constexpr std::int64_t kept_ratios_tile_columns = 768;
  // Past N = H a row holds less than a 2-byte column of every token: the tiles
  // whose ratios the rows before them hold are kept, about H / N of them, the
  // others computed again; still fewer logits GEMMs than the vocabulary order's
  // two per tile, in a block of 768 columns, not 4,096. Through lce_torch (bf16,
  // V 32,000, 2 threads, Zen 5) N 2,048 took 0.94x plain's time where the
  // vocabulary order took 1.02x (15 MiB held, 20x less than plain, where it held
  // 40 MiB, 7.7x), N 4,096 0.97x (1.03x); at N 8,192, an eighth kept, 1.02x
  // against 0.99x, within a run's noise: the ratios stop at N = 4 H.
  static constexpr std::int64_t kept_ratios_reach = 4;

  gradient_plan kept_ratios_plan(std::int64_t n_tokens, std::int64_t hidden, std::int64_t widest) const {
    widest = std::min(widest, kept_ratios_tile_columns);
    const auto plan = workspace_plan<Compute>::make(vocabulary_tile_shape(hidden, widest, 0), n_tokens);
    if (plan.bytes > options_.workspace_limit_bytes) return {};
    return {.plan = plan,
            .tiles_into_grad_weight = true,
            .vocab_tile = widest,
            .first_vocab_tile = widest,
            .kept_step = std::min(widest, kept_logits_step),
            .kept_as_ratios = true};
  }

  // The plan `base` (a narrower grad_weight's, or the token order's for one
  // of the compute type), or the kept logits' where they hold no more: tiles
  // growing to vocabulary_tile_min_columns, else to base's tile (a bf16
  // grad_weight at N = H / 2 holds one tile's logits in a tile's rows: the
  // tiles cannot grow). Through lce_torch (bf16, H 1,024,
  // N 256, 2 threads, Xeon with AMX, warm memory) tiles growing from 512 to
  // 4,096 columns took 1.00x / 1.04x plain's time at V 32,000 / 128,256
  // where tiles growing from 512 to 1,024 took 1.12x / 1.15x.
  template <class G>
  gradient_plan kept_logits_or(const gradient_plan& base, std::int64_t n_tokens, std::int64_t hidden,
                               std::int64_t vocab_local, std::int64_t set_size) const {
    const bool budget_decides = !fixed_chunk_policy<Chunk> && options_.chunk_tokens <= 0;
    if (!budget_decides || set_size != 0) return base;
    // Each part no larger, so that workspace_bytes (from `base`) still bounds the call. dW of
    // the compute type goes straight into grad_weight: no scratch to compare.
    const auto scratch = [&](const gradient_plan& plan) {
      if constexpr (std::same_as<G, Compute>)
        return checked_size(0);
      else
        return weight_gradient_scratch_bytes<G>(plan, hidden, vocab_local, 1);
    };
    const checked_size tiles = scratch(base);
    const auto holds_no_more = [&](const gradient_plan& kept) {
      const checked_size kept_tiles = scratch(kept);
      return kept.vocab_tile > 0 && kept.plan.bytes <= base.plan.bytes && !kept_tiles.overflow &&
             (tiles.overflow || kept_tiles.value <= tiles.value);
    };
    const std::int64_t widths[] = {vocabulary_tile_min_columns, base.vocab_tile};
    for (const std::int64_t widest : widths) {
      if (widest == 0) continue;
      const auto kept = kept_logits_plan<G>(n_tokens, hidden, vocab_local, widest);
      if (holds_no_more(kept)) return kept;
    }
    return base;
  }

  // The token order's [V_local, H] dW sum in the compute type, for a call of several chunks
  // with its grad_weight's storage free (accumulator_fits_grad_weight): all but one row's
  // worth of a 2-byte grad_weight holds half of it, so the scratch is the other half
  // (V_local H sizeof(G) bytes, plus a row). A call in that order takes it with the same
  // chunks.
  //
  // A forward_backward in the vocabulary order runs the logits' GEMM twice (or, with logits
  // kept in grad_weight, for the tiles it could not keep): four GEMMs where the token order
  // runs three, for less memory: the token order's cost is that dW sum. A call in the
  // vocabulary order takes the token order with the sum so held where the rest
  // and its chunks hold at most options.max_logits_share of the call's logits in the compute
  // type (a tenth by default), and the budget: past some N the sum costs less than the vocabulary order's
  // GEMM (bf16 through lce_torch, H 1,024, V 32,000, N 8,192, 2 threads, Zen 5: chunks of
  // 256 in 0.78x the vocabulary order's time). Chunks under the backend's
  // min_efficient_chunk_rows are not worth it.
  std::size_t logits_share_limit(std::size_t logits_bytes) const {
    const double share = static_cast<double>(logits_bytes) * static_cast<double>(options_.max_logits_share);
    if (share >= static_cast<double>(options_.workspace_limit_bytes)) return options_.workspace_limit_bytes;
    return static_cast<std::size_t>(share);
  }

  template <class G>
  gradient_plan accumulator_in_grad_weight_or(const gradient_plan& base, std::int64_t n_tokens, std::int64_t hidden,
                                              std::int64_t vocab_local, std::int64_t set_size) const {
    // The token order's chunks already: the same chunks, half the sum in grad_weight (whose
    // rows the caller checked: accumulator_fits_grad_weight).
    if (base.vocab_tile == 0) {
      if (base.tiles_into_grad_weight || set_size != 0) return base;
      gradient_plan split = base;
      split.accumulator_in_grad_weight = true;
      return split;
    }
    if (auto whole_sum = accumulator_in_grad_weight_plan<G>(n_tokens, hidden, vocab_local, set_size))
      return *whole_sum;
    const auto tail = tail_sweep_plan<G>(n_tokens, hidden, vocab_local, set_size);
    if (tail && tail_sweep_cost(*tail, n_tokens, vocab_local) <
                    static_cast<double>(recomputed_logit_columns<G>(base, n_tokens, hidden, vocab_local)))
      return *tail;
    return base;
  }

  // What the tail's plan costs beyond three GEMMs, in logit columns computed again (2 N H flops
  // each): its tail rows, and its chunks' passes over the sum's other rows, each read and
  // written in the compute type, weighed by the backend's gemm_flops_per_memory_byte. Against
  // the vocabulary order's columns computed again, where the GEMMs outrun memory the order
  // without passes wins. Through lce_torch (bf16, H 1,024, 2 threads, warm memory) on a Xeon
  // with AMX (80), vocabulary order (logits kept as ratios) / tail: 0.48 / 0.54 s at V 32,000
  // and N 3,072, 0.62 / 0.69 s at N 4,096, 1.86 / 2.51 s at V 128,256 and N 3,072, 2.70 /
  // 3.47 s at N 4,096, with less memory (23 / 39 MiB at V 32,000, N 3,072); level at N 6,144
  // (none kept). On an AMD Zen 4 (16) the tail had won at N 4,096-8,192 (docs/performance.md).
  double tail_sweep_cost(const gradient_plan& tail, std::int64_t n_tokens, std::int64_t vocab_local) const {
    const auto chunks = static_cast<double>(ceil_div(n_tokens, tail.plan.local_chunk));
    const auto sum_rows = static_cast<double>(vocab_local - tail.tail_rows);
    return static_cast<double>(tail.tail_rows) + chunks * sum_rows * static_cast<double>(sizeof(Compute)) *
                                                      gemm_flops_per_memory_byte<T>(backend_) /
                                                      static_cast<double>(n_tokens);
  }

  // Where the whole sum does not fit the limit, the token order may still hold the part of it that
  // grad_weight's storage and the rest of the limit do: the sum leaves out the shard's last rows,
  // whose dW a second sweep makes, every token at once, their logits computed again, once the
  // sum is rounded out of the storage (tail_gradient). Its chunks are of the backend's
  // min_efficient_chunk_rows, so that the limit leaves the most for the sum, and the tail's tiles
  // as wide as the chunks' block holds, at most vocabulary_tile_min_columns. Taken over the
  // vocabulary order (with or without logits kept) where it costs less (tail_sweep_cost):
  // 3 + tail / V GEMMs (about 3.3 at N 4,096, H 1,024, V 32,000 and a tenth of the logits'
  // memory) and a pass over most of the sum every chunk, against about 3.75 or 4 GEMMs.
  static constexpr std::int64_t tail_least_columns = 512;

  template <class G>
  std::optional<gradient_plan> tail_sweep_plan(std::int64_t n_tokens, std::int64_t hidden, std::int64_t vocab_local,
                                               std::int64_t set_size) const {
    if constexpr (std::same_as<G, Compute> || !backend_holds_accumulator_in<G>) {
      return std::nullopt;
    } else {
      constexpr std::int64_t least = min_efficient_chunk_rows<Backend>();
      const bool budget_decides = !fixed_chunk_policy<Chunk> && options_.chunk_tokens <= 0;
      const std::int64_t front = accumulator_rows_in_grad_weight<G>(vocab_local);
      if (!budget_decides || set_size != 0 || least == INT64_MAX || n_tokens < 2 * least || front < 1 ||
          vocab_local - front <= tail_least_columns)
        return std::nullopt;
      const checked_size logits = checked_size::of(n_tokens) * checked_size::of(vocab_local) * sizeof(Compute);
      if (logits.overflow) return std::nullopt;
      const std::size_t limit = logits_share_limit(logits.value);
      gradient_plan split;
      split.accumulator_in_grad_weight = true;
      split.plan = workspace_plan<Compute>::make(shape_of(hidden, vocab_local), ceil_div(n_tokens, n_tokens / least));
      const auto tail_shape = [&](std::int64_t columns) {
        auto shape = shape_of(hidden, columns);
        shape.stages_grad_hidden = false;
        return shape;
      };
      const auto narrowest_shape = tail_shape(line_elements);
      const auto narrowest = workspace_plan<Compute>::make(narrowest_shape, n_tokens);
      if (narrowest.bytes > split.plan.bytes) return std::nullopt;
      const auto column_bytes =
          static_cast<std::size_t>(n_tokens) * (sizeof(Compute) + narrowest_shape.gradient_operand_bytes);
      const std::int64_t widest = std::min<std::int64_t>(
          vocabulary_tile_min_columns,
          line_elements + static_cast<std::int64_t>((split.plan.bytes - narrowest.bytes) / column_bytes) /
                              line_elements * line_elements);
      if (widest < tail_least_columns) return std::nullopt;
      const checked_size fixed = checked_size(split.plan.bytes) + first_sweep_rows_bytes(n_tokens) +
                                 align_up(checked_size::of(static_cast<std::int64_t>(
                                              weight_gradient_tile_elements<G>(hidden, widest, n_tokens))) *
                                          sizeof(Compute));
      const std::size_t row_bytes = static_cast<std::size_t>(hidden) * sizeof(Compute);
      if (fixed.overflow || fixed.value + workspace_alignment + row_bytes > limit) return std::nullopt;
      const auto rest = std::min<std::int64_t>(static_cast<std::int64_t>((limit - fixed.value - workspace_alignment) / row_bytes),
                                               vocab_local - front - tail_least_columns);
      split.tail_rows = vocab_local - front - rest;
      const std::int64_t tiles = ceil_div(split.tail_rows, widest);
      split.tail_tile = ceil_div(ceil_div(split.tail_rows, tiles), line_elements) * line_elements;
      split.tail_plan = workspace_plan<Compute>::make(tail_shape(split.tail_tile), n_tokens);
      const checked_size held = checked_size(std::max(split.plan.bytes, split.tail_plan.bytes)) +
                                weight_gradient_scratch_bytes<G>(split, hidden, vocab_local, /*slots=*/1);
      if (held.overflow || held.value > limit) return std::nullopt;
      return split;
    }
  }

  // The logit columns a forward_backward in `order` computes twice: the vocabulary order's tiles
  // not kept in grad_weight (all without kept logits, but the one the block still holds), or a
  // tail (tail_sweep_plan).
  template <class G>
  static std::int64_t recomputed_logit_columns(const gradient_plan& order, std::int64_t n_tokens, std::int64_t hidden,
                                               std::int64_t vocab_local) {
    if (order.vocab_tile == 0) return order.tail_rows;
    if (order.first_vocab_tile == 0) return vocab_local;
    const auto tiles = vocabulary_tiles_of<G>(order, n_tokens, hidden, vocab_local);
    const std::size_t in_block = tiles.last_in_logit_block();
    std::int64_t columns = 0;
    for (std::size_t t = 0; t < tiles.count(); ++t)
      if (t != in_block && !tiles.kept(t)) columns += tiles.rows(t);
    return columns;
  }

  // That order's plan, where the call would take it over the vocabulary order's.
  template <class G>
  std::optional<gradient_plan> accumulator_in_grad_weight_plan(std::int64_t n_tokens, std::int64_t hidden,
                                                               std::int64_t vocab_local, std::int64_t set_size) const {
    const bool budget_decides = !fixed_chunk_policy<Chunk> && options_.chunk_tokens <= 0;
    if (!budget_decides || set_size != 0 || n_tokens < 1 || accumulator_rows_in_grad_weight<G>(vocab_local) < 1)
      return std::nullopt;
    gradient_plan split;
    split.accumulator_in_grad_weight = true;
    const checked_size rest = weight_gradient_scratch_bytes<G>(split, hidden, vocab_local, 1);
    const checked_size logits = checked_size::of(n_tokens) * checked_size::of(vocab_local) * sizeof(Compute);
    if (rest.overflow || logits.overflow) return std::nullopt;
    const std::size_t limit = logits_share_limit(logits.value);
    if (rest.value >= limit) return std::nullopt;
    split.plan = plan_for(n_tokens, hidden, vocab_local, 0, set_size, limit - rest.value);
    const std::int64_t least = std::min(n_tokens, min_efficient_chunk_rows<Backend>());
    const checked_size held = checked_size(split.plan.bytes) + rest;
    if (split.plan.local_chunk < least || split.plan.local_chunk >= n_tokens || held.overflow || held.value > limit)
      return std::nullopt;
    return split;
  }

  // The call takes `order`: its plan, its vocabulary tiles (if any, for a grad_weight of
  // element G) and its workspace.
  template <class G, class Index>
  void take_plan(prepared_call& call, const gradient_plan& order, const operator_inputs<T, Index>& in) {
    call.plan = order.plan;
    call.tiles_into_grad_weight = order.tiles_into_grad_weight;
    call.vocab_tile = order.vocab_tile;
    call.first_vocab_tile = order.first_vocab_tile;
    call.accumulator_in_grad_weight = order.accumulator_in_grad_weight;
    call.tail_rows = order.tail_rows;
    call.tail_tile = order.tail_tile;
    call.tail_plan = order.tail_plan;
    call.vocab_tiles = vocabulary_tiles_of<G>(order, in.tokens(), in.hidden.cols, in.weight.rows);
    call.workspace = workspace_.reserve(backend_, std::max(call.plan.bytes, call.tail_plan.bytes), "workspace");
  }

  // The vocabulary order's tiles of `order`: of order.vocab_tile columns, or
  // with kept logits (order.first_vocab_tile > 0) the first of that many,
  // then each as wide as the bytes of grad_weight's rows before it that no
  // tile's kept logits take yet hold its logits (up to order.vocab_tile, in
  // whole steps of order.kept_step columns: kept_logits_step, or the first
  // tile where it is narrower, so that the rows of a first tile that hold
  // its logits hold a step; or the widest tile after a halved first one),
  // there kept; or where that is under one step (and not the rest of the
  // shard), one of first_vocab_tile columns in the logit block.
  // Whole steps split evenly over the threads' GEMM tiles: bf16 through
  // lce_torch at N 768 (H 1,024, V 32,000, 2 threads, Zen 5) took 0.26 s in
  // steps of 512 columns, 0.245 s in steps of 1,024, where the logit block
  // alone took 0.28 s. Each tile's kept logits lie in rows before its own,
  // apart from every other tile's: the first sweep writes them over no
  // logits it keeps, the second (last tile to first) writes each tile's dW
  // over logits already consumed.
  template <class G>
  static vocabulary_tiles vocabulary_tiles_of(const gradient_plan& order, std::int64_t n_tokens, std::int64_t hidden,
                                              std::int64_t vocab_local) {
    vocabulary_tiles tiles;
    if (order.vocab_tile == 0) return tiles;
    const bool keeps = order.first_vocab_tile > 0;
    const std::int64_t first = keeps ? order.first_vocab_tile : order.vocab_tile;
    const std::int64_t row_bytes = hidden * static_cast<std::int64_t>(sizeof(G));
    const std::int64_t column_bytes =
        n_tokens * static_cast<std::int64_t>(order.kept_as_ratios ? sizeof(bfloat16) : sizeof(Compute));
    const std::int64_t step = order.kept_step;
    tiles.ratios = order.kept_as_ratios;
    // A kept tile's ratios, padded to whole lines, then its N row centres.
    const std::int64_t centre_bytes =
        tiles.ratios ? vocabulary_tiles::whole_lines(n_tokens * static_cast<std::int64_t>(sizeof(Compute))) : 0;
    std::int64_t used = 0;  // bytes from grad_weight's first row that kept logits take
    tiles.bounds.push_back(0);
    for (std::int64_t start = 0; start < vocab_local;) {
      const std::int64_t rest = vocab_local - start;
      std::int64_t width = std::min(first, rest);
      std::int64_t kept_at = vocabulary_tiles::in_logit_block;
      // With ratios the last tile stays in the block (the second sweep starts from it).
      if (keeps && start > 0 && !(tiles.ratios && rest <= first)) {
        const std::int64_t room =
            std::min(order.vocab_tile, (start * row_bytes - used - centre_bytes) / column_bytes);
        const std::int64_t whole = room / step * step;
        if (rest <= room || whole > 0) {
          width = rest <= room ? rest : whole;
          kept_at = used;
          used += vocabulary_tiles::whole_lines(width * column_bytes);
          if (tiles.ratios) tiles.centres_at.push_back(used);
          used += centre_bytes;
        }
      }
      if (tiles.ratios && kept_at == vocabulary_tiles::in_logit_block) tiles.centres_at.push_back(kept_at);
      if (keeps) tiles.kept_at.push_back(kept_at);
      start += width;
      tiles.bounds.push_back(start);
    }
    tiles.kept_bytes = used;
    return tiles;
  }

  template <class G>
  gradient_plan vocabulary_tiles_plan(std::int64_t n_tokens, std::int64_t hidden, std::int64_t vocab_local,
                                      bool with_slices) const {
    if constexpr (!backend_sweeps_vocabulary_tiles<G>) {
      return {};
    } else {
      if (comm_.size() != 1 || n_tokens < 1 || vocab_local <= vocabulary_tile_min_columns) return {};
      const auto shape_with = [&](std::int64_t tile, std::int64_t block_rows) {
        return vocabulary_tile_shape(hidden, tile, block_rows);
      };
      const std::size_t limit = options_.workspace_limit_bytes;
      const std::size_t column_bytes = sizeof(Compute) + shape_of(hidden, vocab_local).gradient_operand_bytes;
      // Each vocabulary column adds a column of n_tokens to the logit block (and to dz's own block).
      const auto narrowest = workspace_plan<Compute>::make(shape_with(vocabulary_tile_min_columns, 0), n_tokens);
      if (narrowest.bytes <= limit &&
          static_cast<std::size_t>(n_tokens) * vocabulary_tile_min_columns * sizeof(Compute) <=
              vocabulary_tile_block_bytes) {
        const std::size_t per_column = static_cast<std::size_t>(n_tokens) * column_bytes;
        const auto by_budget = static_cast<std::int64_t>(std::min<std::size_t>(
            vocabulary_tile_min_columns + (limit - narrowest.bytes) / per_column, static_cast<std::size_t>(vocab_local)));
        const auto by_block = static_cast<std::int64_t>(
            vocabulary_tile_block_bytes / (static_cast<std::size_t>(n_tokens) * sizeof(Compute)));
        const std::int64_t by_share = std::max(min_efficient_vocabulary_tile<Backend>(),
                                               detail::ceil_div(vocab_local, vocabulary_share));
        std::int64_t tile = std::min({by_budget, by_block, by_share});
        tile = tile / line_elements * line_elements;
        while (tile > vocabulary_tile_min_columns &&
               workspace_plan<Compute>::make(shape_with(tile, 0), n_tokens).bytes > limit)
          tile -= line_elements;
        if (tile >= vocab_local) return {};
        return {workspace_plan<Compute>::make(shape_with(tile, 0), n_tokens), true, tile};
      }
      if constexpr (!backend_slices_vocabulary_tiles<G>) {
        return {};
      } else {
        if (!with_slices) return {};
        constexpr std::int64_t tile = vocabulary_tile_min_columns;
        const auto one_row = workspace_plan<Compute>::make(shape_with(tile, 1), n_tokens);
        const std::size_t per_row = static_cast<std::size_t>(workspace_plan<Compute>::padded_ld(tile)) * column_bytes;
        std::int64_t rows = one_row.bytes < limit ? 1 + static_cast<std::int64_t>((limit - one_row.bytes) / per_row) : 1;
        rows = std::clamp<std::int64_t>(
            std::min<std::int64_t>(rows, static_cast<std::int64_t>(vocabulary_tile_block_bytes /
                                                                   (static_cast<std::size_t>(tile) * sizeof(Compute)))),
            1, n_tokens);
        return {workspace_plan<Compute>::make(shape_with(tile, rows), n_tokens), rows >= n_tokens, tile};
      }
    }
  }

  // The bytes of a call's dW scratch beside its plan: the backend's tiles
  // (`slots` of them; 0: one per worker, as the call reserves), or the accumulator.
  template <class G>
  checked_size weight_gradient_scratch_bytes(const gradient_plan& gradient, std::int64_t hidden,
                                             std::int64_t vocab_local, int slots = 0) const {
    // The vocabulary order hands the backend one vocabulary tile at a time (its dW tiles grow with the
    // shard); with token slices, the tile's accumulator.
    // Whole cache lines, as the plan's blocks: a caller's buffer of workspace_bytes then holds
    // the two blocks in either order (see cuda/detail/caller_workspace.hpp).
    if (gradient.vocab_tile > 0) vocab_local = gradient.vocab_tile;
    if (gradient.accumulator_in_grad_weight) {
      const checked_size sum = sum_rest_bytes<G>(gradient, hidden, vocab_local);
      if (gradient.tail_rows == 0) return sum;
      return sum + first_sweep_rows_bytes(gradient.tail_plan.chunk) +
             align_up(checked_size::of(static_cast<std::int64_t>(weight_gradient_tile_elements<G>(
                          hidden, gradient.tail_tile, gradient.tail_plan.chunk))) *
                      (slots > 0 ? static_cast<std::size_t>(slots) : weight_gradient_tile_slots<G>()) *
                      sizeof(Compute));
    }
    if (gradient.tiles_into_grad_weight)
      return align_up(checked_size::of(static_cast<std::int64_t>(
                          weight_gradient_tile_elements<G>(hidden, vocab_local, gradient.plan.block_rows))) *
                      (slots > 0 ? static_cast<std::size_t>(slots) : weight_gradient_tile_slots<G>()) *
                      sizeof(Compute));
    return align_up(checked_size::of(vocab_local) * checked_size::of(hidden) * sizeof(Compute));
  }

  // The bytes, in whole lines, of the token order's dW sum rows that grad_weight's storage does not
  // hold (accumulator_in_grad_weight), but the tail's (tail_sweep_plan): the scratch's first rows.
  template <class G>
  static checked_size sum_rest_bytes(const gradient_plan& gradient, std::int64_t hidden, std::int64_t vocab_local) {
    const std::int64_t rows = vocab_local - accumulator_rows_in_grad_weight<G>(vocab_local) - gradient.tail_rows;
    return align_up(checked_size::of(rows) * checked_size::of(hidden) * sizeof(Compute));
  }

  // The rows a call with a tail keeps from its first sweep for the second: lse, and the
  // mean-centred logit (an entropy gradient's row term).
  static constexpr std::int64_t first_sweep_row_arrays = 2;
  static checked_size first_sweep_rows_bytes(std::int64_t n_tokens) {
    return align_up(checked_size::of(n_tokens) * checked_size(first_sweep_row_arrays * sizeof(Compute)));
  }

  // Where dW goes: grad_weight itself when it has the compute type; else
  // the backend's tiles straight into it (one chunk), or the reserved wide
  // accumulator, added into it once, at the end.
  //
  // With options.overwrite_weight_gradients, grad_bias is zeroed first, and so is
  // grad_weight unless this call writes every row of it over: the
  // accumulator copied in at the end, or the backend's tiles or last chunk
  // writing rows (overwrites_weight_gradient) in a sweep that reaches every row.
  template <class GradWeight>
  weight_gradient_sink<Compute, GradWeight> begin_weight_gradient(const prepared_call& call, std::int64_t hidden_rows,
                                                                  const matrix_view<GradWeight>& grad_weight,
                                                                  const vector_view<Compute>& grad_bias) {
    weight_gradient_sink<Compute, GradWeight> sink = weight_gradient_sink_of(call, grad_weight);
    if (!options_.overwrite_weight_gradients) return sink;
    zero(grad_bias);
    const bool rows_reached = hidden_rows > 0;  // a rank with no rows of a sequence-parallel call sweeps no chunk
    if constexpr (std::same_as<GradWeight, Compute>) {
      if (overwrites_compute_weight_gradient<Backend, Operand, Compute> && rows_reached) {  // first chunk: beta 0
        sink.overwrite = true;
        return sink;
      }
    } else {
      if (!sink.into_grad_weight && !sink.fused && rows_reached) return sink;  // copied in by end_weight_gradient
      if constexpr (overwrites_weight_gradient<Backend, Operand, Compute, GradWeight>) {
        if (rows_reached) {
          sink.overwrite = true;
          return sink;
        }
      }
    }
    backend_.fill_zero(grad_weight);
    return sink;
  }

  template <class GradWeight>
  weight_gradient_sink<Compute, GradWeight> weight_gradient_sink_of(const prepared_call& call,
                                                                    const matrix_view<GradWeight>& grad_weight) {
    if constexpr (std::same_as<GradWeight, Compute>) {
      return {.accumulator = grad_weight, .grad_weight = grad_weight};
    } else if (call.tiles_into_grad_weight) {
      return {.accumulator = {},
              .grad_weight = grad_weight,
              .into_grad_weight = true,
              .tile_scratch = call.weight_gradient_scratch};
    } else if (call.accumulator_in_grad_weight) {
      // Written by the first chunk, so not zeroed; rounded into grad_weight at the end.
      // A tail's rows are the second sweep's (tail_gradient): the sum's rest may have none.
      const std::int64_t front = accumulator_rows_in_grad_weight<GradWeight>(grad_weight.rows), h = grad_weight.cols;
      weight_gradient_sink<Compute, GradWeight> sink;
      sink.accumulator = {reinterpret_cast<Compute*>(grad_weight.data) + h, front, h, h};
      sink.accumulator_rest = {call.weight_gradient_scratch, grad_weight.rows - front - call.tail_rows, h, h};
      sink.grad_weight = grad_weight;
      return sink;
    } else if (call.vocab_tile > 0) {
      // One vocabulary tile's dW at a time, overwritten by its first slice, added into grad_weight by its last.
      return {.accumulator = {call.weight_gradient_scratch, call.vocab_tile, grad_weight.cols, grad_weight.cols},
              .grad_weight = grad_weight,
              .fused = true};
    } else {
      matrix_view<Compute> accumulator{call.weight_gradient_scratch, grad_weight.rows, grad_weight.cols,
                                       grad_weight.cols};
      constexpr bool fused = rounds_accumulated_weight_gradient<Backend, Operand, Compute, GradWeight>;
      if (!fused) backend_.fill_zero(accumulator);
      return {.accumulator = accumulator, .grad_weight = grad_weight, .fused = fused};
    }
  }

  template <class GradWeight>
  void end_weight_gradient(const weight_gradient_sink<Compute, GradWeight>& sink,
                           const matrix_view<GradWeight>& grad_weight) {
    if constexpr (!std::same_as<GradWeight, Compute>) {
      if (sink.accumulator_rest.data) return round_accumulator_in_grad_weight(sink, grad_weight);
      if (sink.into_grad_weight || sink.fused) return;
      if (options_.overwrite_weight_gradients)
        backend_.copy(matrix_view<const Compute>(sink.accumulator), grad_weight);
      else
        backend_.add(matrix_view<const Compute>(sink.accumulator), grad_weight);
    }
  }

  // The dW sum held in part in grad_weight's storage (accumulator_in_grad_weight_or) rounded
  // into grad_weight: its rows there first, in place, in rounds of rows [a, b) whose narrower
  // rows take only bytes of sum rows before a, already rounded, and none of their own (the
  // sum's row r lies at the compute-type row r + 1: b <= q (a + 1) for q narrow rows in a wide
  // one); then the rest from the scratch, into bytes whose sum rows are all rounded by then.
  template <class GradWeight>
  void round_accumulator_in_grad_weight(const weight_gradient_sink<Compute, GradWeight>& sink,
                                        const matrix_view<GradWeight>& grad_weight) {
    constexpr std::int64_t narrow_per_wide = static_cast<std::int64_t>(sizeof(Compute) / sizeof(GradWeight));
    const std::int64_t front = sink.accumulator.rows;
    for (std::int64_t a = 0, b = 0; a < front; a = b) {
      b = std::min(narrow_per_wide * (a + 1), front);
      backend_.copy(matrix_view<const Compute>(sink.accumulator.rows_slice(a, b - a)), grad_weight.rows_slice(a, b - a));
    }
    if (sink.accumulator_rest.rows > 0)
      backend_.copy(matrix_view<const Compute>(sink.accumulator_rest),
                    grad_weight.rows_slice(front, sink.accumulator_rest.rows));
  }

  // A call with no tokens writes no gradient, except over grad_weight and grad_bias when asked
  // to overwrite them: they are then zero.
  template <class GradWeight>
  void zero_weight_gradients_of_empty_call(const matrix_view<GradWeight>& grad_weight,
                                           const vector_view<Compute>& grad_bias) {
    if (!options_.overwrite_weight_gradients) return;
    [[maybe_unused]] const auto backend_call = begin_backend_call();
    backend_.fill_zero(grad_weight);
    zero(grad_bias);
  }

  void zero(const vector_view<Compute>& v) {
    if (v.size) backend_.fill_zero(matrix_view<Compute>{v.data, 1, v.size, v.size});
  }

  Comm comm_;
  options options_;
  Backend backend_;
  scratch<Backend> workspace_;
  scratch<Backend> weight_gradient_;
  rank_agreement<Comm> agreement_;
  exclusive_call::flag busy_;
};

}  // namespace detail
LCE_END_NAMESPACE
