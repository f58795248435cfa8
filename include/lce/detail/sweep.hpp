#pragma once
// The chunk loop: one pass over the tokens, a chunk of rows at a time, in a
// workspace that was planned, reserved and agreed on before (detail/engine.hpp).
//
//   forward           logits GEMM -> row statistics -> [gather ranks] -> log-probs, lse, entropy
//   backward          logits GEMM -> [E_p[z] - lse, summed over ranks] -> dz in place -> dX GEMM [reduced] -> dW GEMM
//   forward_backward  logits GEMM -> statistics keeping exp -> [gather] -> dz by row scaling -> dX, dW
//
// Under sequence parallelism each chunk gathers a slice of every rank's
// hidden rows first and reduce-scatters dX back, so no rank ever holds the
// whole [N, H]. The backend does the arithmetic, the communicator the
// collectives; this file only orders them, so it serves every backend.

#include <lce/comm/communicator.hpp>
#include <lce/core/backend.hpp>
#include <lce/core/config.hpp>
#include <lce/core/dtypes.hpp>
#include <lce/core/error.hpp>
#include <lce/core/options.hpp>
#include <lce/core/row_math.hpp>
#include <lce/core/views.hpp>
#include <lce/detail/workspace.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

LCE_BEGIN_NAMESPACE
namespace detail {

// `targets` holds one id per token, or with set_size = K > 0 a target set
// of K ids per token, row-major ([N, K] flattened).
template <class T, class Index>
struct operator_inputs {
  matrix_view<const T> hidden;
  matrix_view<const T> weight;
  vector_view<const Index> targets;
  std::int64_t set_size = 0;
  vector_view<const T> bias{};  // [V_local] (lce::with_bias), or empty

  std::int64_t ids_per_token() const { return set_size > 0 ? set_size : 1; }
  std::int64_t tokens() const { return targets.size / ids_per_token(); }
};

// How the raw logits s = x . w become the logits z of the softmax:
// z = s / tau, or (cap / tau) tanh(s / cap) with a soft-cap. The logits GEMM
// scales by 1/tau only when no soft-cap follows; the gradient GEMMs always
// carry the 1/tau of the chain rule.
template <class Compute>
struct logit_scaling {
  Compute temperature_scale = 1;  // 1 / tau
  Compute logits_alpha = 1;       // alpha of the logits GEMM
  soft_cap_map<Compute> soft_cap;

  static logit_scaling from(const options& opt) {
    logit_scaling scaling;
    const auto tau = static_cast<Compute>(opt.temperature);
    scaling.temperature_scale = Compute(1) / tau;
    scaling.soft_cap = soft_cap_map<Compute>::make(static_cast<Compute>(opt.softcap), tau);
    scaling.logits_alpha = scaling.soft_cap.enabled() ? Compute(1) : scaling.temperature_scale;
    return scaling;
  }
};

// One chunk: its rows and the scratch carved out for it. The rows of the
// logit block map to token rows in `segments` runs of `segment_rows`: one
// run normally; under sequence parallelism one per rank, run s starting at
// token s * local_tokens + local_first.
template <class T, class Compute, class Operand, class Index>
struct chunk {
  using index = Index;
  std::int64_t ordinal = 0;         // 0, 1, ... in sweep order
  std::int64_t local_first = 0;     // first row of this rank's hidden in the chunk
  std::int64_t rows = 0;            // rows of the logit block
  int segments = 1;
  std::int64_t segment_rows = 0;
  std::int64_t local_tokens = 0;    // hidden rows per rank (sequence parallel)
  std::int64_t vocab_first = 0;     // first weight row of the block's columns (a vocabulary tile), else 0
  std::int64_t slice_first = 0;     // first row of a token slice within its chunk (the vocabulary order), else 0
  matrix_view<const Operand> hidden;  // [rows, H] in the GEMMs' operand type
  matrix_view<const T> weight;        // [V_local, H]
  vector_view<const T> bias;          // [V_local] or empty
  vector_view<const Index> targets;   // [rows]: the targets, or a target set's stand-ins (target_set_args)
  vector_view<const Index> set_ids;   // [rows * set_size] (a target-set call), else empty
  std::int64_t set_size = 0;
  Compute* set_logits = nullptr;      // [rows * set_size]: z at the ids, right after this rank's partials
  Compute* set_logprobs = nullptr;    // [rows * set_size]
  Compute* set_grads = nullptr;       // [rows * set_size]
  matrix_view<Compute> logits;        // [rows, V_local], becomes dz
  matrix_view<Operand> dz_operand;    // dz in the GEMMs' operand type when that is not Compute, else empty
  matrix_view<Compute> grad_hidden_stage;
  void* weight_block = nullptr;
  row_partial<Compute>* partials = nullptr;  // this rank's
  row_partial<Compute>* gathered = nullptr;  // every rank's, [ranks][rows]
  Compute* row_base = nullptr;
  std::int64_t row_stride = 0;
  Compute* grad_hidden_local = nullptr;  // [segment_rows, H] (sequence parallel)

  Compute* row(row_array which) const { return row_base + which * row_stride; }
  std::int64_t token_of_segment(int s) const { return segments == 1 ? local_first : s * local_tokens + local_first; }
};

// Where a chunk's dW goes: summed into `accumulator` chunk by chunk
// (grad_weight itself when it has the compute type), or, `into_grad_weight`,
// straight into `grad_weight` by the backend's tiles (a one-chunk call; see
// adds_weight_gradient_tiles), with `tile_scratch` (null where the backend's
// tiles need none). `fused`: the backend
// overwrites the accumulator in the first chunk and adds it into
// grad_weight in the last (rounds_accumulated_weight_gradient).
template <class Compute, class GradWeight>
struct weight_gradient_sink {
  matrix_view<Compute> accumulator;
  matrix_view<GradWeight> grad_weight;
  bool into_grad_weight = false;
  Compute* tile_scratch = nullptr;
  bool fused = false;
  // The backend writes grad_weight's rows instead of adding into them (overwrites_weight_gradient).
  bool overwrite = false;
  // Where set, the accumulator's rows after accumulator.rows (the token order's dW sum held in
  // part in grad_weight's storage): each chunk's dW in two GEMMs, the first chunk's with beta 0.
  matrix_view<Compute> accumulator_rest{};
};

template <communicator Comm, storage_type T, class Backend>
class chunk_sweep {
 public:
  using Compute = compute_t<T>;
  using Operand = gemm_operand_t<Backend, T>;
  static constexpr bool dz_in_own_block = !std::same_as<Operand, Compute>;
  // ... which may be the logit block's own rows, overwritten (dz_operand_in_logit_rows).
  static constexpr bool dz_in_logit_rows = dz_in_own_block && dz_operand_in_logit_rows<Backend>();

  // `vocab` is the whole vocabulary V (the mean logit's denominator).
  chunk_sweep(const Comm& comm, Backend& backend, const options& opt, const workspace_plan<Compute>& plan,
              void* workspace, std::int64_t vocab)
      : comm_(comm), backend_(backend), options_(opt), scaling_(logit_scaling<Compute>::from(opt)), plan_(plan),
        base_(static_cast<char*>(workspace)), inverse_vocab_(Compute(1) / static_cast<Compute>(vocab)) {}

  const logit_scaling<Compute>& scaling() const { return scaling_; }
  bool sequence_parallel() const { return options_.sequence_parallel && comm_.size() > 1; }

  // Runs body(chunk) over the tokens. An lce::error raised inside a chunk
  // (only the communicator can fail there) comes out naming the chunk and
  // what the earlier chunks left in the outputs.
  template <class Index, class Body>
  void run(const operator_inputs<T, Index>& in, Body&& body) {
    const std::int64_t h = in.hidden.cols;
    const bool sp = sequence_parallel();
    const std::int64_t chunks = (in.hidden.rows + plan_.local_chunk - 1) / plan_.local_chunk;

    chunk<T, Compute, Operand, Index> c;
    c.weight = in.weight;
    c.bias = in.bias;
    c.weight_block = at(plan_.weight_block);
    c.partials = static_cast<row_partial<Compute>*>(at(plan_.partials));
    c.gathered = static_cast<row_partial<Compute>*>(at(plan_.gathered));
    c.row_base = static_cast<Compute*>(at(plan_.rows));
    c.row_stride = plan_.chunk;
    c.grad_hidden_local = static_cast<Compute*>(at(plan_.grad_hidden_local));
    c.segments = sp ? comm_.size() : 1;
    c.local_tokens = in.hidden.rows;
    auto* const logits = static_cast<Compute*>(at(plan_.logits));
    auto* const grad_hidden_stage = static_cast<Compute*>(at(plan_.grad_hidden_stage));
    auto* const gathered_targets = static_cast<Index*>(at(plan_.targets));
    auto* const dz_operand = static_cast<Operand*>(at(plan_.gradient_operand));
    const std::int64_t k_ids = in.set_size;
    c.set_size = k_ids;
    auto* const gathered_set_ids = static_cast<Index*>(at(plan_.set_ids));
    c.set_logprobs = static_cast<Compute*>(at(plan_.set_logprobs));
    c.set_grads = static_cast<Compute*>(at(plan_.set_grads));

    for (std::int64_t first = 0; first < in.hidden.rows; first += plan_.local_chunk, ++c.ordinal) {
      c.local_first = first;
      c.segment_rows = std::min(plan_.local_chunk, in.hidden.rows - first);
      c.rows = c.segment_rows * c.segments;
      // All the chunk's rows, but for the vocabulary order's token slices (plan_.block_rows).
      const std::int64_t block_rows = std::min(c.rows, plan_.block_rows);
      c.logits = {logits, block_rows, in.weight.rows, plan_.logits_ld};
      if constexpr (dz_in_logit_rows) {
        static_assert(sizeof(Compute) % sizeof(Operand) == 0);
        c.dz_operand = {reinterpret_cast<Operand*>(logits), block_rows, in.weight.rows,
                        plan_.logits_ld * static_cast<std::int64_t>(sizeof(Compute) / sizeof(Operand))};
      } else if constexpr (dz_in_own_block) {
        c.dz_operand = {dz_operand, block_rows, in.weight.rows, plan_.logits_ld};
      }
      c.grad_hidden_stage = {grad_hidden_stage, c.rows, h, h};
      c.set_logits = reinterpret_cast<Compute*>(c.partials + c.rows);
      try {
        if (k_ids > 0) {
          // The set's ids (gathered from the ranks' segments under sequence parallelism); the
          // stand-in targets are written by the body (target_set_rows) before any row pass.
          if (sp) {
            for (int s = 0; s < c.segments; ++s)
              backend_.copy(in.targets.slice(c.token_of_segment(s) * k_ids, c.segment_rows * k_ids),
                            vector_view<Index>{gathered_set_ids + s * c.segment_rows * k_ids, c.segment_rows * k_ids});
            c.set_ids = {gathered_set_ids, c.rows * k_ids};
          } else {
            c.set_ids = in.targets.slice(first * k_ids, c.rows * k_ids);
          }
          c.targets = {gathered_targets, c.rows};
        } else if (sp) {
          for (int s = 0; s < c.segments; ++s)
            backend_.copy(in.targets.slice(c.token_of_segment(s), c.segment_rows),
                          vector_view<Index>{gathered_targets + s * c.segment_rows, c.segment_rows});
          c.targets = {gathered_targets, c.rows};
        } else {
          c.targets = in.targets.slice(first, c.rows);
        }
        if (sp) c.hidden = gather_hidden(in.hidden.rows_slice(first, c.segment_rows));
        else c.hidden = widen_hidden(in.hidden.rows_slice(first, c.rows), static_cast<Operand*>(at(plan_.hidden_stage)));
        body(c);
      } catch (const error& e) {
        fail(message_body(e), " (in chunk ", c.ordinal, " of ", chunks, ", hidden rows [",
             first, ", ", first + c.segment_rows,
             ") of this rank: the outputs of earlier chunks are written, and grad_weight holds their "
             "contributions, so restore it before a retry)");
      }
    }
  }

  // Logits of the chunk, their row statistics, combined over ranks, then
  // log-prob, lse and entropy per row into the chunk's row arrays.
  // Also the mean logit (into row_mean_logit) with `with_mean_logit`. A
  // target-set chunk (its stand-ins written) also gets the K log-probs of
  // each row (into set_logprobs); keep_exp must then be off, since the
  // logits at the ids are read after the statistics pass.
  template <class Index>
  void forward_statistics(const chunk<T, Compute, Operand, Index>& c, bool with_entropy, bool keep_exp,
                          bool with_mean_logit = false) {
    compute_logits(c);
    row_statistics(c, with_entropy, keep_exp, with_mean_logit, c.partials);
    if (c.set_size > 0) backend_.target_set_logits(target_set(c), c.rows);
    const row_partial<Compute>* merged = c.partials;
    Compute* set_logits = c.set_logits;
    if (comm_.size() > 1) {
      // One collective per chunk: every rank's partials (and the set's logits, which
      // only their shard's rank holds, 0 elsewhere), merged locally in rank order.
      const std::int64_t record = workspace_plan<Compute>::exchange_record(c.rows, c.set_size).value;
      comm_.all_gather_bytes(c.partials, c.gathered, static_cast<std::size_t>(record) * sizeof(row_partial<Compute>));
      backend_.merge_partials(c.gathered, comm_.size(), c.rows, record, c.gathered);
      merged = c.gathered;
      if (c.set_size > 0) {
        set_logits = reinterpret_cast<Compute*>(c.gathered + c.rows);
        const std::int64_t n = c.rows * c.set_size;
        for (int k = 1; k < comm_.size(); ++k)
          backend_.add(matrix_view<const Compute>{reinterpret_cast<const Compute*>(c.gathered + k * record + c.rows), 1, n, n},
                       matrix_view<Compute>{set_logits, 1, n, n});
      }
    }

    finalize_rows(c, merged, with_entropy, with_mean_logit);
    if (c.set_size > 0) {
      auto args = target_set(c);
      args.values = set_logits;
      args.lse = c.row(row_lse);
      args.out = c.set_logprobs;
      backend_.target_set_logprobs(args, c.rows);
    }
  }

  // ---- the vocabulary order (engine: vocabulary_tiles) ------------------------
  // One rank, every token in one chunk (`whole`, from run() with a plan of
  // local_chunk = N), the vocabulary `tile` weight rows at a time, and within
  // a tile the tokens a slice of plan.block_rows rows at a time (all N when
  // [N, tile] fits the block): the logit block holds [slice, tile]. The plan
  // has two exchange records of N rows in `gathered`: the running merge of
  // the row partials and the current tile's.

  // The chunk `whole` narrowed to weight rows [first, first + count).
  template <class Index>
  chunk<T, Compute, Operand, Index> vocabulary_tile(const chunk<T, Compute, Operand, Index>& whole, std::int64_t first,
                                                    std::int64_t count) const {
    auto c = whole;
    c.vocab_first = first;
    c.weight = whole.weight.rows_slice(first, count);
    if (whole.bias.size) c.bias = whole.bias.slice(first, count);
    c.logits = {whole.logits.data, whole.logits.rows, count, plan_.logits_ld};
    if constexpr (dz_in_own_block) c.dz_operand = {whole.dz_operand.data, whole.dz_operand.rows, count, whole.dz_operand.ld};
    return c;
  }

  // A tile narrowed to its rows [first, first + rows), which the logit block
  // holds. Its ordinal counts the tile's slices, so that the dW of a tile
  // summed over several goes through add_weight_gradient like a chunk's.
  template <class Index>
  chunk<T, Compute, Operand, Index> token_slice(const chunk<T, Compute, Operand, Index>& tile, std::int64_t first,
                                                std::int64_t rows) const {
    auto c = tile;
    c.ordinal = first / plan_.block_rows;
    c.slice_first = first;
    c.local_first = tile.local_first + first;
    c.rows = c.segment_rows = rows;
    c.hidden = tile.hidden.rows_slice(first, rows);
    c.targets = tile.targets.slice(first, rows);
    c.logits.rows = rows;
    if constexpr (dz_in_own_block) c.dz_operand.rows = rows;
    c.grad_hidden_stage = tile.grad_hidden_stage.rows_slice(first, rows);
    c.partials = tile.partials + first;
    c.gathered = tile.gathered + first;
    c.row_base = tile.row_base + first;  // row_stride stays the whole chunk's
    return c;
  }

  // The slice's logits and their row partials, merged into the running ones
  // (the first tile's become them). Tiles are merged in vocabulary order.
  // Returns the slice's own partials, valid until the next slice's statistics;
  // with keep_exp the block is left as exp(z - their max).
  template <class Index>
  const row_partial<Compute>* tile_statistics(const chunk<T, Compute, Operand, Index>& slice, bool first_tile,
                                              bool with_entropy, bool with_mean_logit, bool keep_exp = false) {
    compute_logits(slice);
    const std::int64_t record = workspace_plan<Compute>::exchange_record(plan_.chunk, 0).value;
    row_partial<Compute>* own = first_tile ? slice.gathered : slice.gathered + record;
    row_statistics(slice, with_entropy, keep_exp, with_mean_logit, own);
    if (!first_tile) backend_.merge_partials(slice.gathered, 2, slice.rows, record, slice.gathered);
    return own;
  }

  // Log-prob, lse, entropy (and mean logit) of every row from the merged partials.
  template <class Index>
  void finish_tile_statistics(const chunk<T, Compute, Operand, Index>& whole, bool with_entropy,
                              bool with_mean_logit) {
    finalize_rows(whole, whole.gathered, with_entropy, with_mean_logit);
  }

  // The gradient pass's arguments (from gradient_base of `whole`, the rows
  // gathered) pointed at a slice's block and rows.
  template <class Index>
  gradient_args<Compute, Index, Operand> gradient_of_tile(gradient_args<Compute, Index, Operand> args,
                                                          const chunk<T, Compute, Operand, Index>& slice) const {
    args.logits = slice.logits;
    args.targets = slice.targets;
    args.vocab_start = options_.vocab_start + slice.vocab_first;
    const std::int64_t r = slice.slice_first;
    for (const Compute** row : {&args.lse, &args.grad_logprobs, &args.grad_entropy, &args.mean_centred_logit,
                                &args.grad_lse, &args.lse_squared, &args.grad_mean_logit})
      if (*row) *row += r;
    if constexpr (dz_in_own_block) {
      args.gradient_operand = slice.dz_operand.data;
      args.gradient_operand_ld = slice.dz_operand.ld;
    }
    return args;
  }

  // dz of a slice -> its share of dX, summed into its rows of
  // `grad_hidden_sum` ([N, H] in the compute type; the first tile
  // overwrites them), and of dW and db. dW goes through add_weight_gradient
  // with the sink narrowed to the tile: straight into grad_weight through
  // the backend's tiles (a tile of one slice), or summed over the slices in
  // the sink's [tile, H] accumulator and added into grad_weight with the last.
  template <class Index, class GradWeight>
  void propagate_tile(const chunk<T, Compute, Operand, Index>& slice, bool first_tile,
                      const matrix_view<Compute>& grad_hidden_sum,
                      const weight_gradient_sink<Compute, GradWeight>& weight_gradient,
                      const vector_view<Compute>& grad_bias = {}) {
    if constexpr (adds_grad_hidden<Backend, Operand, T, Compute> &&
                  (std::same_as<GradWeight, Compute> || adds_weight_gradient_tiles<Backend, Operand, Compute, GradWeight>)) {
      const matrix_view<const Operand> dz = dz_of(slice);
      const Compute alpha = scaling_.temperature_scale;
      const std::int64_t first = slice.vocab_first, count = slice.logits.cols;
      if (grad_bias.size) backend_.column_sums(dz, alpha, grad_bias.slice(first, count));
      backend_.grad_hidden(dz, slice.weight, alpha, grad_hidden_sum.rows_slice(slice.slice_first, slice.rows),
                           slice.weight_block, first_tile ? Compute(0) : Compute(1));
      auto tile_sink = weight_gradient;
      tile_sink.grad_weight = weight_gradient.grad_weight.rows_slice(first, count);
      // A grad_weight in the compute type is its own accumulator: the tile's rows of it.
      if constexpr (std::same_as<GradWeight, Compute>)
        tile_sink.accumulator = tile_sink.grad_weight;
      else if (tile_sink.accumulator.data)
        tile_sink.accumulator = weight_gradient.accumulator.rows_slice(0, count);
      add_weight_gradient(slice, dz, alpha, tile_sink);
    } else {
      static_assert(sizeof(GradWeight) == 0, "the vocabulary order needs adds_grad_hidden and adds_weight_gradient_tiles");
    }
  }

  // A slice's dW alone, written over (or added into) its tile's rows of grad_weight through the
  // backend's tiles: the engine's tail sweep, whose dX and db the first sweep made.
  template <class Index, class GradWeight>
  void weight_gradient_of_tile(const chunk<T, Compute, Operand, Index>& slice,
                               const weight_gradient_sink<Compute, GradWeight>& weight_gradient) {
    if constexpr (adds_weight_gradient_tiles<Backend, Operand, Compute, GradWeight>) {
      auto tile_sink = weight_gradient;
      tile_sink.grad_weight = weight_gradient.grad_weight.rows_slice(slice.vocab_first, slice.logits.cols);
      add_weight_gradient(slice, dz_of(slice), scaling_.temperature_scale, tile_sink);
    } else {
      static_assert(sizeof(GradWeight) == 0, "a tail sweep needs adds_weight_gradient_tiles");
    }
  }

  // The chunk's target set as the set passes take it (stand-ins into c.targets'
  // buffer, this rank's logits at the ids into set_logits).
  template <class Index>
  target_set_args<Compute, Index> target_set(const chunk<T, Compute, Operand, Index>& c) const {
    target_set_args<Compute, Index> args;
    args.ids = c.set_ids;
    args.set_size = c.set_size;
    args.vocab_start = options_.vocab_start + c.vocab_first;
    args.ignore_index = options_.ignore_index;
    args.stand_ins = const_cast<Index*>(c.targets.data);  // the chunk's own scratch (plan.targets)
    args.logits = c.logits;
    args.values = c.set_logits;
    return args;
  }

  // A target-set chunk's stand-in targets, and with gradients given the sum of
  // each row's (into row_grad_logprobs): before any row pass reads c.targets.
  template <class Index>
  void target_set_rows(const chunk<T, Compute, Operand, Index>& c, bool with_grads) {
    auto args = target_set(c);
    if (with_grads) {
      args.grads = c.set_grads;
      args.grad_sums = c.row(row_grad_logprobs);
    }
    backend_.target_set_rows(args, c.rows);
  }

  // This rank's logits at the set's ids (backward with a soft-cap: the slope at each id).
  template <class Index>
  void target_set_logits(const chunk<T, Compute, Operand, Index>& c) {
    backend_.target_set_logits(target_set(c), c.rows);
  }

  // The chunk's logits again (backward), soft-capped and tempered.
  template <class Index>
  void recompute_logits(const chunk<T, Compute, Operand, Index>& c) {
    compute_logits(c);
    if (scaling_.soft_cap.enabled()) backend_.soft_cap(c.logits, scaling_.soft_cap);
  }

  // x w^T (+ b) with the logits GEMM's alpha: the bias joins the raw logit.
  template <class Index>
  void compute_logits(const chunk<T, Compute, Operand, Index>& c) {
    backend_.logits(c.hidden, c.weight, scaling_.logits_alpha, c.logits, c.weight_block);
    if (c.bias.size) backend_.add_bias(c.logits, c.bias, scaling_.logits_alpha);
  }

  template <class Index>
  gradient_args<Compute, Index, Operand> gradient_base(const chunk<T, Compute, Operand, Index>& c) const {
    gradient_args<Compute, Index, Operand> args;
    args.logits = c.logits;
    args.targets = c.targets;
    args.vocab_start = options_.vocab_start + c.vocab_first;
    args.ignore_index = options_.ignore_index;
    args.soft_cap = scaling_.soft_cap;
    args.lse = c.row(row_lse);
    args.grad_logprobs = c.row(row_grad_logprobs);
    args.inverse_vocab = inverse_vocab_;
    if constexpr (dz_in_own_block) {
      args.gradient_operand = c.dz_operand.data;
      args.gradient_operand_ld = c.dz_operand.ld;
    }
    if (c.set_size > 0) {
      args.set_ids = c.set_ids.data;
      args.set_grads = c.set_grads;
      args.set_logits = c.set_logits;
      args.set_size = c.set_size;
    }
    return args;
  }

  // Per-token values between the caller's [N] vectors and the chunk's row arrays.
  template <class Index, class Element>
  void gather_rows(const chunk<T, Compute, Operand, Index>& c, vector_view<const Element> source, row_array which) {
    for (int s = 0; s < c.segments; ++s)
      backend_.copy(source.slice(c.token_of_segment(s), c.segment_rows),
                    vector_view<Compute>{c.row(which) + s * c.segment_rows, c.segment_rows});
  }
  template <class Index, class Element>
  void scatter_rows(const chunk<T, Compute, Operand, Index>& c, row_array which, vector_view<Element> target) {
    for (int s = 0; s < c.segments; ++s)
      backend_.copy(vector_view<const Compute>{c.row(which) + s * c.segment_rows, c.segment_rows},
                    target.slice(c.token_of_segment(s), c.segment_rows));
  }

  // The same for a target set's K values per token ([N * K] row-major).
  template <class Index, class Element>
  void gather_set(const chunk<T, Compute, Operand, Index>& c, vector_view<const Element> source, Compute* set) {
    const std::int64_t k_ids = c.set_size;
    for (int s = 0; s < c.segments; ++s)
      backend_.copy(source.slice(c.token_of_segment(s) * k_ids, c.segment_rows * k_ids),
                    vector_view<Compute>{set + s * c.segment_rows * k_ids, c.segment_rows * k_ids});
  }
  template <class Index, class Element>
  void scatter_set(const chunk<T, Compute, Operand, Index>& c, const Compute* set, vector_view<Element> target) {
    const std::int64_t k_ids = c.set_size;
    for (int s = 0; s < c.segments; ++s)
      backend_.copy(vector_view<const Compute>{set + s * c.segment_rows * k_ids, c.segment_rows * k_ids},
                    target.slice(c.token_of_segment(s) * k_ids, c.segment_rows * k_ids));
  }

  // dz (in the logit block) -> this rank's dX rows (summed over the ranks'
  // vocabulary shards, in the compute type) and dW.
  // With grad_bias, also db += alpha sum_rows dz (this rank's shard, over every row of the chunk).
  template <class Index, class GradHidden, class GradWeight>
  void propagate(const chunk<T, Compute, Operand, Index>& c, const matrix_view<GradHidden>& grad_hidden,
                 const weight_gradient_sink<Compute, GradWeight>& weight_gradient,
                 const vector_view<Compute>& grad_bias = {}) {
    const matrix_view<const Operand> dz = dz_of(c);
    const Compute alpha = scaling_.temperature_scale;
    if (grad_bias.size) backend_.column_sums(dz, alpha, grad_bias);
    const auto out = grad_hidden.rows_slice(c.local_first, c.segment_rows);
    if constexpr (std::same_as<GradHidden, Compute>) {
      if (comm_.size() == 1) {
        backend_.grad_hidden(dz, c.weight, alpha, out, c.weight_block);
        add_weight_gradient(c, dz, alpha, weight_gradient);
        return;
      }
    }
    const auto stage = c.grad_hidden_stage;
    backend_.grad_hidden(dz, c.weight, alpha, stage, c.weight_block);
    if (sequence_parallel()) {
      const std::int64_t h = stage.cols;
      comm_.reduce_scatter_sum(stage.data, c.grad_hidden_local, c.segment_rows * h);
      backend_.copy(matrix_view<const Compute>{c.grad_hidden_local, c.segment_rows, h, h}, out);
    } else {
      if (comm_.size() > 1) comm_.all_reduce_sum(stage.data, c.rows * stage.cols);
      backend_.copy(matrix_view<const Compute>(stage), out);
    }
    add_weight_gradient(c, dz, alpha, weight_gradient);
  }

 private:
  void* at(std::size_t offset) const { return base_ + offset; }

  template <class Index>
  void row_statistics(const chunk<T, Compute, Operand, Index>& c, bool with_entropy, bool keep_exp,
                      bool with_mean_logit, row_partial<Compute>* partials) {
    backend_.row_statistics(statistics_args<Compute, Index>{c.logits, c.targets, options_.vocab_start + c.vocab_first,
                                                            options_.ignore_index, scaling_.soft_cap, with_entropy,
                                                            keep_exp, with_mean_logit, partials});
  }

  template <class Index>
  void finalize_rows(const chunk<T, Compute, Operand, Index>& c, const row_partial<Compute>* merged,
                     bool with_entropy, bool with_mean_logit) {
    backend_.finalize_rows(finalize_args<Compute, Index>{merged, c.targets, options_.ignore_index,
                                                         c.row(row_logprobs), c.row(row_lse),
                                                         with_entropy ? c.row(row_entropy) : nullptr,
                                                         with_entropy ? c.row(row_mean_centred) : nullptr,
                                                         with_mean_logit ? c.row(row_mean_logit) : nullptr,
                                                         inverse_vocab_},
                           c.rows);
  }

  template <class Index, class GradWeight>
  void add_weight_gradient(const chunk<T, Compute, Operand, Index>& c, const matrix_view<const Operand>& dz,
                           Compute alpha, const weight_gradient_sink<Compute, GradWeight>& sink) {
    if constexpr (!std::same_as<GradWeight, Compute> &&
                  overwrites_compute_weight_gradient<Backend, Operand, Compute>) {
      if (sink.accumulator_rest.data) {
        const Compute beta = c.ordinal == 0 ? Compute(0) : Compute(1);
        const std::int64_t front = sink.accumulator.rows, rest = sink.accumulator_rest.rows;
        grad_weight(matrix_view<const Operand>{dz.data, dz.rows, front, dz.ld}, c.hidden, alpha, sink.accumulator,
                    beta);
        if (rest > 0)
          grad_weight(matrix_view<const Operand>{dz.data + front, dz.rows, rest, dz.ld}, c.hidden, alpha,
                      sink.accumulator_rest, beta);
        return;
      }
    }
    if constexpr (adds_weight_gradient_tiles<Backend, Operand, Compute, GradWeight>) {
      if (sink.into_grad_weight) {
        if constexpr (overwrites_weight_gradient<Backend, Operand, Compute, GradWeight>) {
          if (sink.overwrite) {
            grad_weight(dz, c.hidden, alpha, sink.grad_weight, sink.tile_scratch, weight_gradient_write::overwrite);
            return;
          }
        }
        grad_weight(dz, c.hidden, alpha, sink.grad_weight, sink.tile_scratch);
        return;
      }
    }
    if constexpr (rounds_accumulated_weight_gradient<Backend, Operand, Compute, GradWeight>) {
      if (sink.fused) {
        const bool last = c.local_first + c.segment_rows >= c.local_tokens;
        const Compute beta = c.ordinal == 0 ? Compute(0) : Compute(1);
        const matrix_view<GradWeight> round_into = last ? sink.grad_weight : matrix_view<GradWeight>{};
        if constexpr (overwrites_weight_gradient<Backend, Operand, Compute, GradWeight>) {
          if (sink.overwrite) {
            grad_weight(dz, c.hidden, alpha, sink.accumulator, beta, round_into, weight_gradient_write::overwrite);
            return;
          }
        }
        grad_weight(dz, c.hidden, alpha, sink.accumulator, beta, round_into);
        return;
      }
    }
    if constexpr (std::same_as<GradWeight, Compute> && overwrites_compute_weight_gradient<Backend, Operand, Compute>) {
      // The first chunk (or a tile's first slice) writes the rows, the others add.
      if (sink.overwrite && c.ordinal == 0) {
        grad_weight(dz, c.hidden, alpha, sink.accumulator, Compute(0));
        return;
      }
    }
    grad_weight(dz, c.hidden, alpha, sink.accumulator);
  }

  // The backend's grad_weight, told the weight's storage type where it takes it (weight_element).
  template <class... Args>
  void grad_weight(const Args&... args) {
    if constexpr (requires { backend_.grad_weight(args..., weight_element<T>{}); }) {
      backend_.grad_weight(args..., weight_element<T>{});
    } else {
      backend_.grad_weight(args...);
    }
  }

  // dz as the gradient GEMMs read it: its own block in the operand type, or the logit block itself.
  template <class Index>
  static matrix_view<const Operand> dz_of(const chunk<T, Compute, Operand, Index>& c) {
    if constexpr (dz_in_own_block) return c.dz_operand;
    else return c.logits;
  }

  matrix_view<const Operand> widen_hidden(matrix_view<const T> rows, Operand* stage) {
    if constexpr (std::same_as<T, Operand>) {
      return rows;
    } else {
      matrix_view<Operand> widened{stage, rows.rows, rows.cols, rows.cols};
      backend_.copy(rows, widened);
      return widened;
    }
  }

  // Sequence parallel: this rank's rows of the chunk, packed, gathered from
  // every rank in rank order, then widened.
  matrix_view<const Operand> gather_hidden(matrix_view<const T> local) {
    const std::int64_t h = local.cols;
    matrix_view<T> send{reinterpret_cast<T*>(base_ + plan_.hidden_send), local.rows, h, h};
    matrix_view<T> gathered{reinterpret_cast<T*>(base_ + plan_.hidden_gather), local.rows * comm_.size(), h, h};
    backend_.copy(local, send);
    comm_.all_gather_bytes(send.data, gathered.data, static_cast<std::size_t>(local.rows * h) * sizeof(T));
    return widen_hidden(matrix_view<const T>(gathered), reinterpret_cast<Operand*>(base_ + plan_.hidden_stage));
  }

  const Comm& comm_;
  Backend& backend_;
  const options& options_;
  logit_scaling<Compute> scaling_;
  const workspace_plan<Compute>& plan_;
  char* base_;
  Compute inverse_vocab_;
};

}  // namespace detail
LCE_END_NAMESPACE
