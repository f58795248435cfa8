#pragma once
// The chunk loop behind ChunkedHiddenToLogprobs.
//
// Each call: check every argument (before touching any output), plan the
// workspace, then sweep the tokens one chunk at a time:
//
//   forward           logits GEMM -> row statistics -> [combine ranks] -> log-probs, lse, entropy
//   backward          logits GEMM -> [E_p[z]] -> dz in place -> dX GEMM [reduce ranks] -> dW GEMM
//   forward_backward  logits GEMM -> statistics with exp kept -> [combine] -> dz by scaling -> dX, dW
//
// The backend does the arithmetic, the communicator the collectives; this
// file only orders them, so it is shared by every backend.

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
#include <utility>

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
  Backend& backend() { return backend_; }

  std::int64_t chunk_tokens(std::int64_t n_tokens, std::int64_t hidden, std::int64_t vocab_local) const {
    const auto shape = shape_of(hidden, vocab_local);
    std::int64_t chunk = options_.chunk_tokens;
    if (chunk <= 0) {
      chunk_request request;
      request.n_tokens = n_tokens;
      request.hidden = hidden;
      request.vocab_local = vocab_local;
      request.bytes_per_token = workspace_plan<A>::bytes_per_token(shape);
      request.fixed_bytes = workspace_plan<A>::fixed_bytes(shape);
      request.workspace_limit_bytes = options_.workspace_limit_bytes;
      chunk = static_cast<std::int64_t>(Chunk{}.tokens_per_chunk(request));
    }
    return std::clamp<std::int64_t>(chunk, 1, std::max<std::int64_t>(n_tokens, 1));
  }

  // The buffer of a sweep plus, for a 2-byte T, the wide dW accumulator a
  // grad_weight of type T needs (dW across chunks accumulates in fp32).
  std::size_t workspace_bytes(std::int64_t n_tokens, std::int64_t hidden, std::int64_t vocab_local) const {
    expects(n_tokens >= 0 && hidden >= 0 && vocab_local >= 0, "workspace_bytes: negative size (n_tokens ", n_tokens,
            ", hidden ", hidden, ", vocab_local ", vocab_local, ")");
    const auto plan = plan_for(n_tokens, hidden, vocab_local);
    const std::size_t accumulator =
        std::same_as<T, A> ? 0 : static_cast<std::size_t>(vocab_local * hidden) * sizeof(A);
    return plan.bytes + accumulator;
  }

  // ---- forward -------------------------------------------------------------

  template <class I, class RL, class RS, class RE>
  void forward(const operator_inputs<T, I>& in, vector_view<RL> logprobs, vector_view<RS> lse,
               vector_view<RE> entropy, bool with_entropy) {
    const std::int64_t n = in.targets.size;
    validate(in, [&] {
      check_rows(logprobs, "logprobs", n, "targets");
      check_rows(lse, "lse", n, "targets");
      if (with_entropy) check_rows(entropy, "entropy", n, "targets");
      check_no_alias({hidden_bytes(in), weight_bytes(in), target_bytes(in)},
                     {bytes_of(logprobs, "logprobs"), bytes_of(lse, "lse"), bytes_of(entropy, "entropy")});
    });
    sweep(in, [&](const auto& c) {
      forward_statistics(c, with_entropy, /*keep_exp=*/false);
      backend_.copy(c.row_vector(row_logprobs), logprobs.slice(c.first, c.rows));
      backend_.copy(c.row_vector(row_lse), lse.slice(c.first, c.rows));
      if (with_entropy) backend_.copy(c.row_vector(row_entropy), entropy.slice(c.first, c.rows));
    });
  }

  // ---- backward ------------------------------------------------------------

  template <class I, class RS, class RG, class RH, class GX, class GW>
  void backward(const operator_inputs<T, I>& in, vector_view<const RS> lse, vector_view<const RG> grad_logprobs,
                vector_view<const RH> grad_entropy, bool with_entropy, matrix_view<GX> grad_hidden,
                matrix_view<GW> grad_weight) {
    const std::int64_t n = in.targets.size;
    validate(in, [&] {
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
      backend_.logits(c.hidden, c.weight, alpha(), c.logits, c.weight_block);
      if (softcap() > A(0)) backend_.soft_cap(c.logits, softcap());
      backend_.copy(lse.slice(c.first, c.rows), c.row_vector(row_lse));
      backend_.copy(grad_logprobs.slice(c.first, c.rows), c.row_vector(row_grad_logprobs));
      if (with_entropy) {
        backend_.copy(grad_entropy.slice(c.first, c.rows), c.row_vector(row_grad_entropy));
        backend_.expected_logits(expected_logit_args<A, I>{c.logits, c.targets, options_.ignore_index,
                                                           c.row(row_lse), c.row(row_expected)});
        if (comm_.size() > 1) comm_.all_reduce_sum(c.row(row_expected), c.rows);
      }
      auto args = gradient_base(c);
      args.grad_entropy = with_entropy ? c.row(row_grad_entropy) : nullptr;
      args.expected_logit = with_entropy ? c.row(row_expected) : nullptr;
      backend_.logit_gradients(args);
      propagate(c, grad_hidden, weight_gradient);
    });
    end_weight_gradient(weight_gradient, grad_weight);
  }

  // ---- forward_backward ----------------------------------------------------

  template <class I, class RG, class RL, class GX, class GW>
  void forward_backward(const operator_inputs<T, I>& in, vector_view<const RG> grad_logprobs,
                        vector_view<RL> logprobs, matrix_view<GX> grad_hidden, matrix_view<GW> grad_weight) {
    const std::int64_t n = in.targets.size;
    validate(in, [&] {
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
    const bool keep_exp = !(softcap() > A(0));
    sweep(in, [&](const auto& c) {
      forward_statistics(c, /*with_entropy=*/false, keep_exp);
      backend_.copy(c.row_vector(row_logprobs), logprobs.slice(c.first, c.rows));
      backend_.copy(grad_logprobs.slice(c.first, c.rows), c.row_vector(row_grad_logprobs));
      auto args = gradient_base(c);
      args.exp_row_max = keep_exp ? c.partials : nullptr;
      backend_.logit_gradients(args);
      propagate(c, grad_hidden, weight_gradient);
    });
    end_weight_gradient(weight_gradient, grad_weight);
  }

 private:
  // One chunk of rows and the scratch carved out for it.
  template <class I>
  struct chunk {
    std::int64_t first = 0;
    std::int64_t rows = 0;
    matrix_view<const A> hidden;  // [rows, H] in compute type
    matrix_view<const T> weight;  // [V_local, H]
    vector_view<const I> targets;
    matrix_view<A> logits;        // [rows, V_local], becomes dz
    matrix_view<A> grad_hidden_stage;
    void* weight_block = nullptr;
    row_partial<A>* partials = nullptr;  // this rank's
    row_partial<A>* gathered = nullptr;  // every rank's, [ranks][rows]
    A* row_base = nullptr;
    std::int64_t row_stride = 0;

    A* row(row_array which) const { return row_base + which * row_stride; }
    vector_view<A> row_vector(row_array which) const { return {row(which), rows}; }
  };

  A alpha() const { return A(1) / static_cast<A>(options_.temperature); }
  A softcap() const { return static_cast<A>(options_.softcap); }

  workspace_shape shape_of(std::int64_t hidden, std::int64_t vocab_local) const {
    workspace_shape shape;
    shape.hidden = hidden;
    shape.vocab_local = vocab_local;
    shape.ranks = comm_.size();
    shape.stage_hidden = !std::same_as<T, A>;
    shape.weight_block_elements = Backend::template weight_block_elements<T>(hidden, vocab_local);
    return shape;
  }

  workspace_plan<A> plan_for(std::int64_t n_tokens, std::int64_t hidden, std::int64_t vocab_local) const {
    return workspace_plan<A>::make(shape_of(hidden, vocab_local), chunk_tokens(n_tokens, hidden, vocab_local));
  }

  // Checks shared by every call, then the call's own (shapes of outputs,
  // aliasing), then the targets against the whole vocabulary. Throws before
  // anything is written.
  template <class I, class CallChecks>
  void validate(const operator_inputs<T, I>& in, CallChecks&& call_checks) {
    check_matrix(in.hidden, "hidden");
    check_matrix(in.weight, "weight");
    check_vector(in.targets, "targets");
    expects(in.hidden.cols == in.weight.cols, "hidden: ", in.hidden.cols, " columns do not match weight's ",
            in.weight.cols, " columns (the hidden size)");
    expects(in.hidden.cols > 0, "hidden: the hidden size (columns) must be > 0, got ", in.hidden.cols);
    expects(in.targets.size == in.hidden.rows, "targets: size ", in.targets.size, " does not match the ",
            in.hidden.rows, " rows of hidden");
    expects(in.weight.rows > 0, "weight: this rank's vocabulary shard is empty (0 rows)");
    call_checks();
    const std::int64_t vocab = vocabulary_size(in.weight.rows);
    check_targets(in.targets, vocab, options_.ignore_index);
  }

  template <class I>
  static byte_range hidden_bytes(const operator_inputs<T, I>& in) { return bytes_of(in.hidden, "hidden"); }
  template <class I>
  static byte_range weight_bytes(const operator_inputs<T, I>& in) { return bytes_of(in.weight, "weight"); }
  template <class I>
  static byte_range target_bytes(const operator_inputs<T, I>& in) { return bytes_of(in.targets, "targets"); }

  // One rank: the shard is the vocabulary, so it must start at 0.
  std::int64_t vocabulary_size(std::int64_t vocab_local) const {
    expects(options_.vocab_start == 0, "vocab_start = ", options_.vocab_start,
            " on a single rank: the shard must cover the whole vocabulary [0, ", vocab_local, ")");
    return vocab_local;
  }

  template <class I, class GX, class GW>
  static void check_gradients(const operator_inputs<T, I>& in, const matrix_view<GX>& grad_hidden,
                              const matrix_view<GW>& grad_weight) {
    check_shape(grad_hidden, "grad_hidden", in.hidden.rows, in.hidden.cols, "hidden");
    check_shape(grad_weight, "grad_weight", in.weight.rows, in.weight.cols, "weight");
  }

  // Runs body(chunk) over the tokens with the workspace laid out for this call.
  template <class I, class Body>
  void sweep(const operator_inputs<T, I>& in, Body&& body) {
    const std::int64_t n = in.targets.size;
    if (n == 0) return;
    const auto plan = plan_for(n, in.hidden.cols, in.weight.rows);
    auto* base = static_cast<char*>(workspace_.reserve(backend_, plan.bytes));
    chunk<I> c;
    c.weight = in.weight;
    c.weight_block = base + plan.weight_block;
    c.partials = reinterpret_cast<row_partial<A>*>(base + plan.partials);
    c.gathered = reinterpret_cast<row_partial<A>*>(base + plan.gathered);
    c.row_base = reinterpret_cast<A*>(base + plan.rows);
    c.row_stride = plan.chunk;
    A* const logits = reinterpret_cast<A*>(base + plan.logits);
    A* const hidden_stage = reinterpret_cast<A*>(base + plan.hidden_stage);
    A* const grad_hidden_stage = reinterpret_cast<A*>(base + plan.grad_hidden_stage);
    const std::int64_t h = in.hidden.cols;
    for (std::int64_t first = 0; first < n; first += plan.chunk) {
      c.first = first;
      c.rows = std::min(plan.chunk, n - first);
      c.targets = in.targets.slice(first, c.rows);
      c.logits = {logits, c.rows, in.weight.rows, plan.logits_ld};
      c.grad_hidden_stage = {grad_hidden_stage, c.rows, h, h};
      c.hidden = stage_hidden(in.hidden.rows_slice(first, c.rows), hidden_stage);
      body(c);
    }
  }

  matrix_view<const A> stage_hidden(matrix_view<const T> rows, A* stage) {
    if constexpr (std::same_as<T, A>) {
      return rows;
    } else {
      matrix_view<A> widened{stage, rows.rows, rows.cols, rows.cols};
      backend_.copy(rows, widened);
      return widened;
    }
  }

  // Logits of the chunk, their row statistics, combined over ranks, then
  // log-prob, lse and entropy per row into the chunk's row arrays.
  template <class I>
  void forward_statistics(const chunk<I>& c, bool with_entropy, bool keep_exp) {
    backend_.logits(c.hidden, c.weight, alpha(), c.logits, c.weight_block);
    statistics_args<A, I> statistics{c.logits,         c.targets,  options_.vocab_start, options_.ignore_index,
                                     softcap(),        with_entropy, keep_exp,           c.partials};
    backend_.row_statistics(statistics);
    const row_partial<A>* merged = c.partials;
    if (comm_.size() > 1) {
      // One collective per chunk: every rank's partials, merged locally in rank order.
      comm_.all_gather_bytes(c.partials, c.gathered, static_cast<std::size_t>(c.rows) * sizeof(row_partial<A>));
      backend_.merge_partials(c.gathered, comm_.size(), c.rows, c.gathered);
      merged = c.gathered;
    }
    finalize_args<A, I> results{merged, c.targets, options_.ignore_index, c.row(row_logprobs), c.row(row_lse),
                                with_entropy ? c.row(row_entropy) : nullptr};
    backend_.finalize_rows(results, c.rows);
  }

  template <class I>
  gradient_args<A, I> gradient_base(const chunk<I>& c) const {
    gradient_args<A, I> args;
    args.logits = c.logits;
    args.targets = c.targets;
    args.vocab_start = options_.vocab_start;
    args.ignore_index = options_.ignore_index;
    args.soft_cap = softcap();
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
      if (rows == 0 || cols == 0) return {nullptr, rows, cols, cols};
      auto* data = static_cast<A*>(weight_gradient_.reserve(backend_, static_cast<std::size_t>(rows * cols) * sizeof(A)));
      matrix_view<A> accumulator{data, rows, cols, cols};
      backend_.fill_zero(accumulator);
      return accumulator;
    }
  }

  template <class GW>
  void end_weight_gradient(const matrix_view<A>& accumulator, const matrix_view<GW>& grad_weight) {
    if constexpr (!std::same_as<GW, A>) {
      if (accumulator.data) backend_.add(matrix_view<const A>(accumulator), grad_weight);
    }
  }

  // dz (in the logit block) -> dX rows (reduced over ranks) and dW.
  template <class I, class GX>
  void propagate(const chunk<I>& c, const matrix_view<GX>& grad_hidden, const matrix_view<A>& weight_gradient) {
    const matrix_view<const A> dz = c.logits;
    const auto out = grad_hidden.rows_slice(c.first, c.rows);
    bool written = false;
    if constexpr (std::same_as<GX, A>) {
      if (comm_.size() == 1) {
        backend_.grad_hidden(dz, c.weight, alpha(), out, c.weight_block);
        written = true;
      }
    }
    if (!written) {
      backend_.grad_hidden(dz, c.weight, alpha(), c.grad_hidden_stage, c.weight_block);
      if (comm_.size() > 1) comm_.all_reduce_sum(c.grad_hidden_stage.data, c.rows * c.grad_hidden_stage.cols);
      backend_.copy(matrix_view<const A>(c.grad_hidden_stage), out);
    }
    backend_.grad_weight(dz, c.hidden, alpha(), weight_gradient);
  }

  Comm comm_;
  options options_;
  Backend backend_;
  scratch<Backend> workspace_;
  scratch<Backend> weight_gradient_;
};

}  // namespace detail
LCE_END_NAMESPACE
