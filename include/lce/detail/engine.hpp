#pragma once
// The chunk loop behind ChunkedHiddenToLogprobs.
//
// Each call: check every argument on every rank (before touching any
// output), plan the workspace, then sweep the tokens one chunk at a time:
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
#include <lce/core/chunking.hpp>
#include <lce/core/config.hpp>
#include <lce/core/dtypes.hpp>
#include <lce/core/error.hpp>
#include <lce/core/options.hpp>
#include <lce/core/views.hpp>
#include <lce/detail/arguments.hpp>
#include <lce/detail/workspace.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

LCE_BEGIN_NAMESPACE
namespace detail {

template <class T, class I>
struct operator_inputs {
  matrix_view<const T> hidden;
  matrix_view<const T> weight;
  vector_view<const I> targets;
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

  void* reserve(Backend& backend, std::size_t bytes) {
    if (bytes > bytes_) {
      release(backend);
      data_ = backend.allocate(bytes);
      bytes_ = bytes;
    }
    return data_;
  }
  void release(Backend& backend) {
    if (data_) backend.deallocate(data_, bytes_);
    data_ = nullptr;
    bytes_ = 0;
  }

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

template <communicator Comm, storage_type T, chunk_policy Chunk, backend Backend>
class engine {
  static_assert(std::is_void_v<typename Comm::memory_space> ||
                    std::is_same_v<typename Comm::memory_space, typename Backend::memory_space>,
                "the communicator's collectives must work on the backend's memory (e.g. NCCL needs a CUDA backend)");

 public:
  using A = compute_t<T>;

  engine(Comm comm, options opt, Backend backend)
      : comm_(std::move(comm)), options_(opt), backend_(std::move(backend)) {
    check_options(options_);
  }
  engine(engine&&) noexcept = default;
  ~engine() {
    workspace_.release(backend_);
    weight_gradient_.release(backend_);
  }

  const options& settings() const { return options_; }
  const Comm& comm() const { return comm_; }

  // Rows of the logit block per chunk for a call over n_tokens tokens.
  std::int64_t chunk_tokens(std::int64_t n_tokens, std::int64_t hidden, std::int64_t vocab_local) const {
    return plan_for(n_tokens, hidden, vocab_local).chunk;
  }

  // The buffer of a sweep plus, for a 2-byte T, the wide dW accumulator a
  // grad_weight of type T needs (dW across chunks accumulates in fp32).
  std::size_t workspace_bytes(std::int64_t n_tokens, std::int64_t hidden, std::int64_t vocab_local) const {
    expects(n_tokens >= 0 && hidden >= 0 && vocab_local >= 0, "workspace_bytes: negative size (n_tokens ", n_tokens,
            ", hidden ", hidden, ", vocab_local ", vocab_local, ")");
    const std::size_t accumulator =
        std::same_as<T, A> ? 0 : static_cast<std::size_t>(vocab_local * hidden) * sizeof(A);
    return plan_for(n_tokens, hidden, vocab_local).bytes + accumulator;
  }

  // ---- forward -------------------------------------------------------------

  template <class I, class RL, class RS, class RE>
  void forward(const operator_inputs<T, I>& in, vector_view<RL> logprobs, vector_view<RS> lse,
               vector_view<RE> entropy, bool with_entropy) {
    validate(in, [&](std::int64_t n) {
      check_rows(logprobs, "logprobs", n, "targets");
      check_rows(lse, "lse", n, "targets");
      if (with_entropy) check_rows(entropy, "entropy", n, "targets");
      check_no_alias({hidden_bytes(in), weight_bytes(in), target_bytes(in)},
                     {bytes_of(logprobs, "logprobs"), bytes_of(lse, "lse"), bytes_of(entropy, "entropy")});
    });
    sweep(in, [&](const auto& c) {
      forward_statistics(c, with_entropy, /*keep_exp=*/false);
      scatter_rows(c, row_logprobs, logprobs);
      scatter_rows(c, row_lse, lse);
      if (with_entropy) scatter_rows(c, row_entropy, entropy);
    });
  }

  // ---- backward ------------------------------------------------------------

  template <class I, class RS, class RG, class RH, class GX, class GW>
  void backward(const operator_inputs<T, I>& in, vector_view<const RS> lse, vector_view<const RG> grad_logprobs,
                vector_view<const RH> grad_entropy, bool with_entropy, matrix_view<GX> grad_hidden,
                matrix_view<GW> grad_weight) {
    validate(in, [&](std::int64_t n) {
      check_rows(lse, "lse", n, "targets");
      check_rows(grad_logprobs, "grad_logprobs", n, "targets");
      if (with_entropy) check_rows(grad_entropy, "grad_entropy", n, "targets");
      check_gradients(in, grad_hidden, grad_weight);
      check_no_alias({hidden_bytes(in), weight_bytes(in), target_bytes(in), bytes_of(lse, "lse"),
                      bytes_of(grad_logprobs, "grad_logprobs"), bytes_of(grad_entropy, "grad_entropy")},
                     {bytes_of(grad_hidden, "grad_hidden"), bytes_of(grad_weight, "grad_weight")});
    });
    const auto weight_gradient = begin_weight_gradient(grad_weight);
    sweep(in, [&](const auto& c) {
      using I_ = typename std::remove_cvref_t<decltype(c)>::index;
      backend_.logits(c.hidden, c.weight, logit_scale(), c.logits, c.weight_block);
      if (soft_cap().enabled()) backend_.soft_cap(c.logits, soft_cap());
      gather_rows(c, lse, row_lse);
      gather_rows(c, grad_logprobs, row_grad_logprobs);
      if (with_entropy) {
        gather_rows(c, grad_entropy, row_grad_entropy);
        backend_.mean_centred_logits(mean_centred_logit_args<A, I_>{c.logits, c.targets, options_.ignore_index,
                                                                    c.row(row_lse), c.row(row_mean_centred)});
        if (comm_.size() > 1) comm_.all_reduce_sum(c.row(row_mean_centred), c.rows);
      }
      auto args = gradient_base(c);
      args.grad_entropy = with_entropy ? c.row(row_grad_entropy) : nullptr;
      args.mean_centred_logit = with_entropy ? c.row(row_mean_centred) : nullptr;
      backend_.logit_gradients(args);
      propagate(c, grad_hidden, weight_gradient);
    });
    end_weight_gradient(weight_gradient, grad_weight);
  }

  // ---- forward_backward ----------------------------------------------------

  template <class I, class RG, class RL, class GX, class GW>
  void forward_backward(const operator_inputs<T, I>& in, vector_view<const RG> grad_logprobs,
                        vector_view<RL> logprobs, matrix_view<GX> grad_hidden, matrix_view<GW> grad_weight) {
    validate(in, [&](std::int64_t n) {
      check_rows(grad_logprobs, "grad_logprobs", n, "targets");
      check_rows(logprobs, "logprobs", n, "targets");
      check_gradients(in, grad_hidden, grad_weight);
      check_no_alias({hidden_bytes(in), weight_bytes(in), target_bytes(in), bytes_of(grad_logprobs, "grad_logprobs")},
                     {bytes_of(logprobs, "logprobs"), bytes_of(grad_hidden, "grad_hidden"),
                      bytes_of(grad_weight, "grad_weight")});
    });
    const auto weight_gradient = begin_weight_gradient(grad_weight);
    // Without a soft-cap the statistics pass leaves exp(z - max) behind, and
    // dz = -g exp(z - lse) is a per-row rescale of it: one exp per logit.
    const bool keep_exp = !soft_cap().enabled();
    sweep(in, [&](const auto& c) {
      forward_statistics(c, /*with_entropy=*/false, keep_exp);
      scatter_rows(c, row_logprobs, logprobs);
      gather_rows(c, grad_logprobs, row_grad_logprobs);
      auto args = gradient_base(c);
      args.exp_row_max = keep_exp ? c.partials : nullptr;
      backend_.logit_gradients(args);
      propagate(c, grad_hidden, weight_gradient);
    });
    end_weight_gradient(weight_gradient, grad_weight);
  }

 private:
  // One chunk: its rows and the scratch carved out for it. The rows of the
  // logit block map to token rows in `segments` runs of `segment_rows`:
  // one run normally; under sequence parallelism one per rank, run s
  // starting at token s * local_tokens + local_first.
  template <class I>
  struct chunk {
    using index = I;
    std::int64_t local_first = 0;    // first row of this rank's hidden in the chunk
    std::int64_t rows = 0;           // rows of the logit block
    int segments = 1;
    std::int64_t segment_rows = 0;
    std::int64_t local_tokens = 0;   // hidden rows per rank (sequence parallel)
    matrix_view<const A> hidden;     // [rows, H] in compute type
    matrix_view<const T> weight;     // [V_local, H]
    vector_view<const I> targets;    // [rows]
    matrix_view<A> logits;           // [rows, V_local], becomes dz
    matrix_view<A> grad_hidden_stage;
    void* weight_block = nullptr;
    row_partial<A>* partials = nullptr;  // this rank's
    row_partial<A>* gathered = nullptr;  // every rank's, [ranks][rows]
    A* row_base = nullptr;
    std::int64_t row_stride = 0;
    A* grad_hidden_local = nullptr;  // [segment_rows, H] (sequence parallel)

    A* row(row_array which) const { return row_base + which * row_stride; }
    std::int64_t token_of_segment(int s) const { return segments == 1 ? local_first : s * local_tokens + local_first; }
  };

  // z = s / tau, or (cap / tau) tanh(s / cap) with a soft-cap (s = x . w): the
  // logits GEMM scales by 1/tau only when no soft-cap follows; the gradient
  // GEMMs always carry the 1/tau of the chain rule.
  A temperature_scale() const { return A(1) / static_cast<A>(options_.temperature); }
  A logit_scale() const { return soft_cap().enabled() ? A(1) : temperature_scale(); }
  soft_cap_map<A> soft_cap() const {
    return soft_cap_map<A>::make(static_cast<A>(options_.softcap), static_cast<A>(options_.temperature));
  }
  bool sequence_parallel() const { return options_.sequence_parallel && comm_.size() > 1; }

  workspace_shape shape_of(std::int64_t hidden, std::int64_t vocab_local) const {
    workspace_shape shape;
    shape.hidden = hidden;
    shape.vocab_local = vocab_local;
    shape.ranks = comm_.size();
    shape.widen_hidden = !std::same_as<T, A>;
    shape.sequence_parallel = sequence_parallel();
    shape.storage_bytes = sizeof(T);
    shape.weight_block_elements = backend_.template weight_block_elements<T>(hidden, vocab_local);
    return shape;
  }

  // The chunk is counted in logit-block rows; under sequence parallelism
  // each rank contributes an equal share of them.
  workspace_plan<A> plan_for(std::int64_t n_tokens, std::int64_t hidden, std::int64_t vocab_local) const {
    const auto shape = shape_of(hidden, vocab_local);
    std::int64_t rows = options_.chunk_tokens;
    if (rows <= 0) {
      // Every rank must sweep the same chunks: the policy sizes them for the
      // widest shard (once known), which keeps every rank within its budget.
      const auto widest = shape_of(hidden, std::max(vocab_local, shards_.widest));
      chunk_request request;
      request.n_tokens = n_tokens;
      request.hidden = hidden;
      request.vocab_local = widest.vocab_local;
      request.bytes_per_token = workspace_plan<A>::bytes_per_token(widest);
      request.fixed_bytes = workspace_plan<A>::fixed_bytes(widest);
      request.workspace_limit_bytes = options_.workspace_limit_bytes;
      rows = static_cast<std::int64_t>(Chunk{}.tokens_per_chunk(request));
    }
    const std::int64_t share = shape.sequence_parallel ? shape.ranks : 1;
    const std::int64_t local_tokens = n_tokens / share;
    const std::int64_t local_chunk = std::clamp<std::int64_t>(rows / share, 1, std::max<std::int64_t>(local_tokens, 1));
    return workspace_plan<A>::make(shape, local_chunk);
  }

  // ---- argument checks -----------------------------------------------------

  // The checks of every call, then the call's own (output shapes, aliasing),
  // then targets against the whole vocabulary. On several ranks the verdict
  // is agreed on, so a bad argument on one rank raises lce::error on all of
  // them rather than leaving the others in a collective. Throws before
  // anything is written.
  template <class I, class CallChecks>
  void validate(const operator_inputs<T, I>& in, CallChecks&& call_checks) {
    const auto local_checks = [&] {
      check_matrix(in.hidden, "hidden");
      check_matrix(in.weight, "weight");
      check_vector(in.targets, "targets");
      expects(in.hidden.cols == in.weight.cols, "hidden: ", in.hidden.cols, " columns do not match weight's ",
              in.weight.cols, " columns (the hidden size)");
      expects(in.hidden.cols > 0, "hidden: the hidden size (columns) must be > 0, got ", in.hidden.cols);
      if (sequence_parallel()) {
        expects(in.targets.size == in.hidden.rows * comm_.size(), "targets: size ", in.targets.size,
                " is not ranks (", comm_.size(), ") x the ", in.hidden.rows,
                " rows of hidden on this rank (sequence parallel: every rank holds an equal share of the tokens)");
      } else {
        expects(in.targets.size == in.hidden.rows, "targets: size ", in.targets.size, " does not match the ",
                in.hidden.rows, " rows of hidden");
      }
      expects(in.weight.rows > 0, "weight: this rank's vocabulary shard is empty (0 rows)");
      call_checks(in.targets.size);
    };
    if (comm_.size() == 1) {
      local_checks();
      expects(options_.vocab_start == 0, "vocab_start = ", options_.vocab_start,
              " on a single rank: the shard must cover the whole vocabulary [0, ", in.weight.rows, ")");
      check_targets(in.targets, in.weight.rows, options_.ignore_index);
      return;
    }
    // Several ranks: each checks its own arguments (and its targets, against
    // the vocabulary of the last checked layout), then one exchange of a few
    // integers tells every rank everything: who failed, whether the ranks
    // agree on N and H, and the shard layout. All ranks see the same
    // records, so they take the same branch and throw alike.
    const std::string failure = failure_of(local_checks);
    const bool layout_known = shards_.vocab > 0 && failure.empty();
    const std::string target_failure =
        layout_known ? failure_of([&] { check_targets(in.targets, shards_.vocab, options_.ignore_index); })
                     : std::string();
    const rank_record mine{failure.empty() ? 1 : 0,
                           layout_known ? (target_failure.empty() ? 1 : 2) : 0,
                           in.targets.size,
                           in.hidden.cols,
                           options_.vocab_start,
                           in.weight.rows};
    std::vector<rank_record> records(static_cast<std::size_t>(comm_.size()));
    comm_.all_gather_host(&mine.ok, &records.front().ok, rank_record::values);
    bool all_ok = true;
    for (const auto& record : records) all_ok = all_ok && record.ok;
    if (!all_ok) throw_agreed(failure);
    check_ranks_agree(records);
    const bool same_layout = shards_.vocab > 0 && records_match_layout(records);
    const shard_layout layout = same_layout ? shards_ : tile_shards(records);
    bool targets_checked = same_layout;
    bool targets_ok = true;
    for (const auto& record : records) {
      targets_checked = targets_checked && record.targets != 0;
      targets_ok = targets_ok && record.targets != 2;
    }
    if (targets_checked) {  // the usual case: one exchange, nothing more
      if (!targets_ok) throw_agreed(target_failure);
      return;
    }
    agree_or_throw(failure_of([&] { check_targets(in.targets, layout.vocab, options_.ignore_index); }));
    shards_ = layout;
  }

  // What each rank tells the others before a call (host values).
  struct rank_record {
    static constexpr std::int64_t values = 6;
    std::int64_t ok;          // its own arguments passed
    std::int64_t targets;     // 0 unchecked, 1 within the known vocabulary, 2 not
    std::int64_t n_tokens;
    std::int64_t hidden;
    std::int64_t vocab_start;
    std::int64_t vocab_local;
  };
  static_assert(sizeof(rank_record) == rank_record::values * sizeof(std::int64_t));

  // The vocabulary shards of all ranks, in rank order.
  struct shard_layout {
    std::int64_t vocab = 0;   // 0: not known yet
    std::int64_t widest = 0;  // every rank sizes its chunk for the widest shard
    std::vector<std::int64_t> starts, rows;
  };

  template <class Checks>
  static std::string failure_of(Checks&& checks) {
    try {
      checks();
    } catch (const error& e) {
      return e.what();
    }
    return {};
  }

  [[noreturn]] void throw_agreed(const std::string& failure) const {
    if (!failure.empty()) throw error(failure);
    fail("another rank (not ", comm_.rank(), ") rejected its arguments; its lce::error names them");
  }

  void agree_or_throw(const std::string& failure) {
    if (!comm_.all_agree(failure.empty())) throw_agreed(failure);
  }

  void check_ranks_agree(const std::vector<rank_record>& records) const {
    for (std::size_t r = 1; r < records.size(); ++r) {
      expects(records[r].n_tokens == records[0].n_tokens, "targets: rank ", r, " has ", records[r].n_tokens,
              " tokens, rank 0 has ", records[0].n_tokens, ": every rank must pass all N tokens");
      expects(records[r].hidden == records[0].hidden, "hidden: rank ", r, " has hidden size ", records[r].hidden,
              ", rank 0 has ", records[0].hidden, ": every rank must pass the same hidden size");
    }
  }

  bool records_match_layout(const std::vector<rank_record>& records) const {
    for (std::size_t r = 0; r < records.size(); ++r)
      if (records[r].vocab_start != shards_.starts[r] || records[r].vocab_local != shards_.rows[r]) return false;
    return true;
  }

  // The shards must tile [0, V) in rank order.
  static shard_layout tile_shards(const std::vector<rank_record>& records) {
    shard_layout layout;
    for (std::size_t r = 0; r < records.size(); ++r) {
      const std::int64_t start = records[r].vocab_start, rows = records[r].vocab_local;
      expects(start == layout.vocab, "vocab_start = ", start, " on rank ", r, " (", rows,
              " rows), but the shards must tile the vocabulary in rank order: expected ", layout.vocab);
      layout.vocab = start + rows;
      layout.widest = std::max(layout.widest, rows);
      layout.starts.push_back(start);
      layout.rows.push_back(rows);
    }
    return layout;
  }

  template <class I>
  static byte_range hidden_bytes(const operator_inputs<T, I>& in) { return bytes_of(in.hidden, "hidden"); }
  template <class I>
  static byte_range weight_bytes(const operator_inputs<T, I>& in) { return bytes_of(in.weight, "weight"); }
  template <class I>
  static byte_range target_bytes(const operator_inputs<T, I>& in) { return bytes_of(in.targets, "targets"); }

  template <class I, class GX, class GW>
  static void check_gradients(const operator_inputs<T, I>& in, const matrix_view<GX>& grad_hidden,
                              const matrix_view<GW>& grad_weight) {
    check_shape(grad_hidden, "grad_hidden", in.hidden.rows, in.hidden.cols, "hidden");
    check_shape(grad_weight, "grad_weight", in.weight.rows, in.weight.cols, "weight");
  }

  // ---- the sweep -----------------------------------------------------------

  // Runs body(chunk) over the tokens with the workspace laid out for this call.
  template <class I, class Body>
  void sweep(const operator_inputs<T, I>& in, Body&& body) {
    const std::int64_t n = in.targets.size;
    if (n == 0) return;
    const auto plan = plan_for(n, in.hidden.cols, in.weight.rows);
    auto* base = static_cast<char*>(workspace_.reserve(backend_, plan.bytes));
    const auto at = [base](std::size_t offset) { return static_cast<void*>(base + offset); };
    const std::int64_t h = in.hidden.cols;
    const bool sp = sequence_parallel();

    chunk<I> c;
    c.weight = in.weight;
    c.weight_block = at(plan.weight_block);
    c.partials = static_cast<row_partial<A>*>(at(plan.partials));
    c.gathered = static_cast<row_partial<A>*>(at(plan.gathered));
    c.row_base = static_cast<A*>(at(plan.rows));
    c.row_stride = plan.chunk;
    c.grad_hidden_local = static_cast<A*>(at(plan.grad_hidden_local));
    c.segments = sp ? comm_.size() : 1;
    c.local_tokens = in.hidden.rows;
    A* const logits = static_cast<A*>(at(plan.logits));
    A* const grad_hidden_stage = static_cast<A*>(at(plan.grad_hidden_stage));
    I* const gathered_targets = static_cast<I*>(at(plan.targets));

    for (std::int64_t first = 0; first < in.hidden.rows; first += plan.local_chunk) {
      c.local_first = first;
      c.segment_rows = std::min(plan.local_chunk, in.hidden.rows - first);
      c.rows = c.segment_rows * c.segments;
      c.logits = {logits, c.rows, in.weight.rows, plan.logits_ld};
      c.grad_hidden_stage = {grad_hidden_stage, c.rows, h, h};
      if (sp) {
        for (int s = 0; s < c.segments; ++s)
          backend_.copy(in.targets.slice(c.token_of_segment(s), c.segment_rows),
                        vector_view<I>{gathered_targets + s * c.segment_rows, c.segment_rows});
        c.targets = {gathered_targets, c.rows};
        c.hidden = gather_hidden(in.hidden.rows_slice(first, c.segment_rows), plan, base);
      } else {
        c.targets = in.targets.slice(first, c.rows);
        c.hidden = widen_hidden(in.hidden.rows_slice(first, c.rows), static_cast<A*>(at(plan.hidden_stage)));
      }
      body(c);
    }
  }

  matrix_view<const A> widen_hidden(matrix_view<const T> rows, A* stage) {
    if constexpr (std::same_as<T, A>) {
      return rows;
    } else {
      matrix_view<A> widened{stage, rows.rows, rows.cols, rows.cols};
      backend_.copy(rows, widened);
      return widened;
    }
  }

  // Sequence parallel: this rank's rows of the chunk, packed, gathered from
  // every rank in rank order, then widened.
  matrix_view<const A> gather_hidden(matrix_view<const T> local, const workspace_plan<A>& plan, char* base) {
    const std::int64_t h = local.cols;
    matrix_view<T> send{reinterpret_cast<T*>(base + plan.hidden_send), local.rows, h, h};
    matrix_view<T> gathered{reinterpret_cast<T*>(base + plan.hidden_gather), local.rows * comm_.size(), h, h};
    backend_.copy(local, send);
    comm_.all_gather_bytes(send.data, gathered.data, static_cast<std::size_t>(local.rows * h) * sizeof(T));
    return widen_hidden(matrix_view<const T>(gathered), reinterpret_cast<A*>(base + plan.hidden_stage));
  }

  // Per-token values between the caller's [N] vectors and the chunk's row arrays.
  template <class I, class R>
  void gather_rows(const chunk<I>& c, vector_view<const R> source, row_array which) {
    for (int s = 0; s < c.segments; ++s)
      backend_.copy(source.slice(c.token_of_segment(s), c.segment_rows),
                    vector_view<A>{c.row(which) + s * c.segment_rows, c.segment_rows});
  }
  template <class I, class R>
  void scatter_rows(const chunk<I>& c, row_array which, vector_view<R> target) {
    for (int s = 0; s < c.segments; ++s)
      backend_.copy(vector_view<const A>{c.row(which) + s * c.segment_rows, c.segment_rows},
                    target.slice(c.token_of_segment(s), c.segment_rows));
  }

  // Logits of the chunk, their row statistics, combined over ranks, then
  // log-prob, lse and entropy per row into the chunk's row arrays.
  template <class I>
  void forward_statistics(const chunk<I>& c, bool with_entropy, bool keep_exp) {
    backend_.logits(c.hidden, c.weight, logit_scale(), c.logits, c.weight_block);
    backend_.row_statistics(statistics_args<A, I>{c.logits, c.targets, options_.vocab_start, options_.ignore_index,
                                                  soft_cap(), with_entropy, keep_exp, c.partials});
    const row_partial<A>* merged = c.partials;
    if (comm_.size() > 1) {
      // One collective per chunk: every rank's partials, merged locally in rank order.
      comm_.all_gather_bytes(c.partials, c.gathered, static_cast<std::size_t>(c.rows) * sizeof(row_partial<A>));
      backend_.merge_partials(c.gathered, comm_.size(), c.rows, c.gathered);
      merged = c.gathered;
    }
    backend_.finalize_rows(finalize_args<A, I>{merged, c.targets, options_.ignore_index, c.row(row_logprobs),
                                               c.row(row_lse), with_entropy ? c.row(row_entropy) : nullptr},
                           c.rows);
  }

  template <class I>
  gradient_args<A, I> gradient_base(const chunk<I>& c) const {
    gradient_args<A, I> args;
    args.logits = c.logits;
    args.targets = c.targets;
    args.vocab_start = options_.vocab_start;
    args.ignore_index = options_.ignore_index;
    args.soft_cap = soft_cap();
    args.lse = c.row(row_lse);
    args.grad_logprobs = c.row(row_grad_logprobs);
    return args;
  }

  // Where dW accumulates: grad_weight itself when it has the compute type,
  // else a wide accumulator added into it once, at the end.
  template <class GW>
  matrix_view<A> begin_weight_gradient(const matrix_view<GW>& grad_weight) {
    if constexpr (std::same_as<GW, A>) {
      return grad_weight;
    } else {
      const std::int64_t rows = grad_weight.rows, cols = grad_weight.cols;
      const auto bytes = static_cast<std::size_t>(rows * cols) * sizeof(A);
      matrix_view<A> accumulator{static_cast<A*>(weight_gradient_.reserve(backend_, bytes)), rows, cols, cols};
      backend_.fill_zero(accumulator);
      return accumulator;
    }
  }

  template <class GW>
  void end_weight_gradient(const matrix_view<A>& accumulator, const matrix_view<GW>& grad_weight) {
    if constexpr (!std::same_as<GW, A>) backend_.add(matrix_view<const A>(accumulator), grad_weight);
  }

  // dz (in the logit block) -> this rank's dX rows (summed over the ranks'
  // vocabulary shards, in the compute type) and dW.
  template <class I, class GX>
  void propagate(const chunk<I>& c, const matrix_view<GX>& grad_hidden, const matrix_view<A>& weight_gradient) {
    const matrix_view<const A> dz = c.logits;
    const auto out = grad_hidden.rows_slice(c.local_first, c.segment_rows);
    if constexpr (std::same_as<GX, A>) {
      if (comm_.size() == 1) {
        backend_.grad_hidden(dz, c.weight, temperature_scale(), out, c.weight_block);
        backend_.grad_weight(dz, c.hidden, temperature_scale(), weight_gradient);
        return;
      }
    }
    const auto stage = c.grad_hidden_stage;
    backend_.grad_hidden(dz, c.weight, temperature_scale(), stage, c.weight_block);
    if (sequence_parallel()) {
      const std::int64_t h = stage.cols;
      comm_.reduce_scatter_sum(stage.data, c.grad_hidden_local, c.segment_rows * h);
      backend_.copy(matrix_view<const A>{c.grad_hidden_local, c.segment_rows, h, h}, out);
    } else {
      if (comm_.size() > 1) comm_.all_reduce_sum(stage.data, c.rows * stage.cols);
      backend_.copy(matrix_view<const A>(stage), out);
    }
    backend_.grad_weight(dz, c.hidden, temperature_scale(), weight_gradient);
  }

  Comm comm_;
  options options_;
  Backend backend_;
  scratch<Backend> workspace_;
  scratch<Backend> weight_gradient_;
  shard_layout shards_;  // as last checked on every rank
};

}  // namespace detail
LCE_END_NAMESPACE
