#pragma once
// lce::ChunkedHiddenToLogprobs: per-token log-probabilities, entropies and
// their gradients straight from hidden states and a (vocabulary-sharded)
// output weight, one chunk of tokens at a time, never holding the
// [tokens, vocab] logits.
//
//   Comm     who holds the other vocabulary shards      lce::comm::single, mpi, nccl, threads
//   T        storage type of hidden and weight           float, double, lce::bfloat16, lce::float16
//   Chunk    how many tokens per chunk                    lce::budget_chunk (default), lce::fixed_chunk<K>
//   Backend  where the arithmetic runs                   lce::host (default)
//
// Arguments are any views modelling matrix_like / vector_like (lce's views,
// cuda::std::mdspan, std::mdspan, or any type with an lce::view_traits
// specialisation). Every argument is checked before any output is written; a
// bad one raises lce::error naming it, on every rank at once. An operator
// serves one call at a time (it keeps its scratch): a second thread calling
// it meanwhile gets an lce::error.

#include <lce/comm/communicator.hpp>
#include <lce/core/backend.hpp>
#include <lce/core/chunking.hpp>
#include <lce/core/config.hpp>
#include <lce/core/dtypes.hpp>
#include <lce/core/lm_head.hpp>
#include <lce/core/options.hpp>
#include <lce/core/row_terms.hpp>
#include <lce/core/views.hpp>
#include <lce/detail/engine.hpp>
#include <lce/host/host.hpp>

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

LCE_BEGIN_NAMESPACE

template <communicator Comm, storage_type T, chunk_policy Chunk = budget_chunk, backend Backend = host>
class ChunkedHiddenToLogprobs {
 public:
  using value_type = T;
  using compute_type = compute_t<T>;
  using communicator_type = Comm;
  using chunk_policy_type = Chunk;
  using backend_type = Backend;

  // Throws lce::error on bad options (temperature, softcap, chunk_tokens).
  ChunkedHiddenToLogprobs(Comm comm, options opt = {}) : engine_(std::move(comm), opt, Backend{}) {}
  ChunkedHiddenToLogprobs(Comm comm, options opt, Backend backend)
      : engine_(std::move(comm), opt, std::move(backend)) {}

  // hidden [N, H], weight [V_local, H], targets [N] (int32 or int64, global ids)
  // -> logprobs [N], lse [N] (and entropy [N]); float or double elements.
  template <matrix_like Hidden, head_like Weight, vector_like Targets, vector_like Logprobs, vector_like Lse>
  void forward(const Hidden& hidden, const Weight& weight, const Targets& targets, const Logprobs& logprobs,
               const Lse& lse) {
    detail::deferred_failure failure;
    const auto in = failure([&] { return inputs(hidden, weight, targets); });
    detail::row_output_views<value_of<Logprobs>, value_of<Lse>, compute_type, compute_type> out;
    out.logprobs = failure([&] { return result(logprobs, "logprobs"); });
    out.lse = failure([&] { return result(lse, "lse"); });
    out.has_logprobs = out.has_lse = true;
    engine_.forward(failure, in, out);
  }

  template <matrix_like Hidden, head_like Weight, vector_like Targets, vector_like Logprobs, vector_like Lse,
            vector_like Entropy>
  void forward(const Hidden& hidden, const Weight& weight, const Targets& targets, const Logprobs& logprobs,
               const Lse& lse, const Entropy& entropy) {
    detail::deferred_failure failure;
    const auto in = failure([&] { return inputs(hidden, weight, targets); });
    detail::row_output_views<value_of<Logprobs>, value_of<Lse>, value_of<Entropy>, compute_type> out;
    out.logprobs = failure([&] { return result(logprobs, "logprobs"); });
    out.lse = failure([&] { return result(lse, "lse"); });
    out.entropy = failure([&] { return result(entropy, "entropy"); });
    out.has_logprobs = out.has_lse = out.has_entropy = true;
    engine_.forward(failure, in, out);
  }

  // Any of log-probs, lse, entropy and mean logit (lce::row_outputs: the
  // empty ones are not computed).
  template <matrix_like Hidden, head_like Weight, vector_like Targets, result_type E>
  void forward(const Hidden& hidden, const Weight& weight, const Targets& targets, const row_outputs<E>& outputs) {
    detail::deferred_failure failure;
    const auto in = failure([&] { return inputs(hidden, weight, targets); });
    engine_.forward(failure, in, output_views(outputs));
  }

  // Given lse from forward and dL/dlogprobs: grad_hidden OVERWRITTEN, grad_weight ACCUMULATED (+=)
  // (OVERWRITTEN with options.overwrite_weight_gradients).
  template <matrix_like Hidden, head_like Weight, vector_like Targets, vector_like Lse, vector_like GradLogprobs,
            matrix_like GradHidden, head_like GradWeight>
  void backward(const Hidden& hidden, const Weight& weight, const Targets& targets, const Lse& lse,
                const GradLogprobs& grad_logprobs, const GradHidden& grad_hidden, const GradWeight& grad_weight) {
    detail::deferred_failure failure;
    const auto in = failure([&] { return inputs(hidden, weight, targets); });
    const auto ls = failure([&] { return given(lse, "lse"); });
    detail::row_gradient_views<value_of<GradLogprobs>, compute_type, compute_type, compute_type> grads;
    grads.logprobs = failure([&] { return given(grad_logprobs, "grad_logprobs"); });
    grads.has_logprobs = true;
    const auto gx = failure([&] { return gradient(grad_hidden, "grad_hidden"); });
    const auto gw = failure([&] { return weight_gradient(grad_weight); });
    engine_.backward(failure, in, ls, grads, gx, gw.weight, gw.bias);
  }

  // As above, with dL/dentropy as well.
  template <matrix_like Hidden, head_like Weight, vector_like Targets, vector_like Lse, vector_like GradLogprobs,
            vector_like GradEntropy, matrix_like GradHidden, head_like GradWeight>
  void backward(const Hidden& hidden, const Weight& weight, const Targets& targets, const Lse& lse,
                const GradLogprobs& grad_logprobs, const GradEntropy& grad_entropy, const GradHidden& grad_hidden,
                const GradWeight& grad_weight) {
    detail::deferred_failure failure;
    const auto in = failure([&] { return inputs(hidden, weight, targets); });
    const auto ls = failure([&] { return given(lse, "lse"); });
    detail::row_gradient_views<value_of<GradLogprobs>, value_of<GradEntropy>, compute_type, compute_type> grads;
    grads.logprobs = failure([&] { return given(grad_logprobs, "grad_logprobs"); });
    grads.entropy = failure([&] { return given(grad_entropy, "grad_entropy"); });
    grads.has_logprobs = grads.has_entropy = true;
    const auto gx = failure([&] { return gradient(grad_hidden, "grad_hidden"); });
    const auto gw = failure([&] { return weight_gradient(grad_weight); });
    engine_.backward(failure, in, ls, grads, gx, gw.weight, gw.bias);
  }

  // As above, with any of dL/dlogprobs, dL/dentropy, dL/dlse (a z-loss) and
  // dL/d(mean logit) (label smoothing) (lce::row_gradients: empty ones are 0).
  template <matrix_like Hidden, head_like Weight, vector_like Targets, vector_like Lse, result_type E,
            matrix_like GradHidden, head_like GradWeight>
  void backward(const Hidden& hidden, const Weight& weight, const Targets& targets, const Lse& lse,
                const row_gradients<E>& gradients, const GradHidden& grad_hidden, const GradWeight& grad_weight) {
    detail::deferred_failure failure;
    const auto in = failure([&] { return inputs(hidden, weight, targets); });
    const auto ls = failure([&] { return given(lse, "lse"); });
    const auto gx = failure([&] { return gradient(grad_hidden, "grad_hidden"); });
    const auto gw = failure([&] { return weight_gradient(grad_weight); });
    engine_.backward(failure, in, ls, gradient_views(gradients), gx, gw.weight, gw.bias);
  }

  // One sweep when dL/dlogprobs is known before the forward (NLL, weighted CE):
  // 3 GEMMs per chunk instead of 4.
  template <matrix_like Hidden, head_like Weight, vector_like Targets, vector_like GradLogprobs,
            vector_like Logprobs, matrix_like GradHidden, head_like GradWeight>
  void forward_backward(const Hidden& hidden, const Weight& weight, const Targets& targets,
                        const GradLogprobs& grad_logprobs, const Logprobs& logprobs, const GradHidden& grad_hidden,
                        const GradWeight& grad_weight) {
    detail::deferred_failure failure;
    const auto in = failure([&] { return inputs(hidden, weight, targets); });
    detail::row_gradient_views<value_of<GradLogprobs>, compute_type, compute_type, compute_type> grads;
    grads.logprobs = failure([&] { return given(grad_logprobs, "grad_logprobs"); });
    grads.has_logprobs = true;
    detail::row_output_views<value_of<Logprobs>, compute_type, compute_type, compute_type> out;
    out.logprobs = failure([&] { return result(logprobs, "logprobs"); });
    out.has_logprobs = true;
    const auto gx = failure([&] { return gradient(grad_hidden, "grad_hidden"); });
    const auto gw = failure([&] { return weight_gradient(grad_weight); });
    engine_.forward_backward(failure, in, grads, out, gx, gw.weight, gw.bias);
  }

  // As above with any of the row terms known before the forward (label
  // smoothing: dL/dlse and dL/d(mean logit) are constants; an entropy bonus
  // with fixed coefficients) and any of the outputs: still one sweep of 3 GEMMs.
  template <matrix_like Hidden, head_like Weight, vector_like Targets, result_type E, result_type F,
            matrix_like GradHidden, head_like GradWeight>
  void forward_backward(const Hidden& hidden, const Weight& weight, const Targets& targets,
                        const row_gradients<E>& gradients, const row_outputs<F>& outputs,
                        const GradHidden& grad_hidden, const GradWeight& grad_weight) {
    detail::deferred_failure failure;
    const auto in = failure([&] { return inputs(hidden, weight, targets); });
    const auto gx = failure([&] { return gradient(grad_hidden, "grad_hidden"); });
    const auto gw = failure([&] { return weight_gradient(grad_weight); });
    engine_.forward_backward(failure, in, gradient_views(gradients), output_views(outputs), gx, gw.weight, gw.bias);
  }

  // ---- target sets: targets [N, K], K ids per token ---------------------------
  // (a teacher's top-K for distillation, several candidates). The K log-probs
  // of each token come out of the same single collective per chunk as the
  // row statistics; nothing [N, V] is ever held. Matrices of K values per
  // token are dense (ld = K).

  template <matrix_like Hidden, head_like Weight, matrix_like TargetSets, result_type E>
  void forward(const Hidden& hidden, const Weight& weight, const TargetSets& targets,
               const target_set_outputs<E>& outputs) {
    detail::deferred_failure failure;
    const auto in = failure([&] { return set_inputs(hidden, weight, targets); });
    const auto out = set_output_views(failure, outputs, targets);
    engine_.forward(failure, in, out);
  }

  // grad_logprobs [N, K]: grad_hidden OVERWRITTEN, grad_weight ACCUMULATED (+=; see overwrite_weight_gradients).
  template <matrix_like Hidden, head_like Weight, matrix_like TargetSets, vector_like Lse, result_type E,
            matrix_like GradHidden, head_like GradWeight>
  void backward(const Hidden& hidden, const Weight& weight, const TargetSets& targets, const Lse& lse,
                const target_set_gradients<E>& gradients, const GradHidden& grad_hidden,
                const GradWeight& grad_weight) {
    detail::deferred_failure failure;
    const auto in = failure([&] { return set_inputs(hidden, weight, targets); });
    const auto ls = failure([&] { return given(lse, "lse"); });
    const auto grads = set_gradient_views(failure, gradients, targets);
    const auto gx = failure([&] { return gradient(grad_hidden, "grad_hidden"); });
    const auto gw = failure([&] { return weight_gradient(grad_weight); });
    engine_.backward(failure, in, ls, grads, gx, gw.weight, gw.bias);
  }

  // Both in one sweep when the gradients are known before the forward (a
  // cross-entropy against fixed soft targets over the K ids).
  template <matrix_like Hidden, head_like Weight, matrix_like TargetSets, result_type E, result_type F,
            matrix_like GradHidden, head_like GradWeight>
  void forward_backward(const Hidden& hidden, const Weight& weight, const TargetSets& targets,
                        const target_set_gradients<E>& gradients, const target_set_outputs<F>& outputs,
                        const GradHidden& grad_hidden, const GradWeight& grad_weight) {
    detail::deferred_failure failure;
    const auto in = failure([&] { return set_inputs(hidden, weight, targets); });
    const auto grads = set_gradient_views(failure, gradients, targets);
    const auto out = set_output_views(failure, outputs, targets);
    const auto gx = failure([&] { return gradient(grad_hidden, "grad_hidden"); });
    const auto gw = failure([&] { return weight_gradient(grad_weight); });
    engine_.forward_backward(failure, in, grads, out, gx, gw.weight, gw.bias);
  }

  // Bytes of scratch the calls above allocate for these sizes: the sweep's
  // buffer plus, for a 2-byte T, the fp32 [V_local, H] dW accumulator that a
  // grad_weight of type T needs across chunks, or the backend's dW tiles for
  // a call of one chunk on one rank (an upper bound over the calls). With several
  // ranks a call uses the smallest chunk over ranks, so at most this.
  // `set_size`: K, for the calls with target sets of K ids per token.
  std::size_t workspace_bytes(std::int64_t n_tokens, std::int64_t hidden, std::int64_t vocab_local,
                              std::int64_t set_size = 0) const {
    return engine_.workspace_bytes(n_tokens, hidden, vocab_local, set_size);
  }

  // The chunk (rows of the logit block) this rank would use for these sizes.
  std::int64_t chunk_tokens(std::int64_t n_tokens, std::int64_t hidden, std::int64_t vocab_local,
                            std::int64_t set_size = 0) const {
    return engine_.chunk_tokens(n_tokens, hidden, vocab_local, set_size);
  }

  // Scratch is kept between calls (the next call of the same size allocates
  // nothing); these say how much is held and give it back.
  std::size_t held_workspace_bytes() const { return engine_.held_workspace_bytes(); }
  void release_workspace() { engine_.release_workspace(); }

  const options& settings() const { return engine_.settings(); }
  const Comm& comm() const { return engine_.comm(); }

 private:
  template <class Hidden, class Weight, class Targets>
  static auto inputs(const Hidden& hidden, const Weight& weight, const Targets& targets) {
    static_assert(std::is_same_v<value_of<Hidden>, T>, "hidden: element type must be the operator's T");
    static_assert(std::is_same_v<value_of<detail::head_weight_t<Weight>>, T>,
                  "weight: element type must be the operator's T");
    static_assert(target_id_type<value_of<Targets>>, "targets: element type must be std::int32_t or std::int64_t");
    detail::operator_inputs<T, value_of<Targets>> in{detail::to_matrix_view(hidden, "hidden"),
                                                     detail::to_matrix_view(detail::head_weight(weight), "weight"),
                                                     detail::to_vector_view(targets, "targets")};
    in.bias = bias_of(weight);
    return in;
  }

  // The bias of a with_bias head ([V_r], the operator's T), or none.
  template <class Weight>
  static vector_view<const T> bias_of(const Weight& weight) {
    if constexpr (detail::is_biased_head<Weight>) {
      static_assert(std::is_same_v<value_of<decltype(weight.bias)>, T>, "bias: element type must be the operator's T");
      return vector_view<const T>(detail::to_vector_view(weight.bias, "bias"));
    } else {
      return {};
    }
  }

  // grad_weight, and grad_bias when it comes with_bias (float or double).
  template <class GradWeight>
  static auto weight_gradient(const GradWeight& grad) {
    using GW = value_of<detail::head_weight_t<GradWeight>>;
    struct views {
      matrix_view<GW> weight;
      vector_view<compute_type> bias;
    } out;
    out.weight = gradient(detail::head_weight(grad), "grad_weight");
    if constexpr (detail::is_biased_head<GradWeight>) {
      using E = element_of<decltype(grad.bias)>;
      static_assert(std::is_same_v<E, compute_type>,
                    "grad_bias: element type must be the operator's compute type (float, double for T = double)");
      out.bias = detail::to_vector_view(grad.bias, "grad_bias");
    }
    return out;
  }

  // Target sets [N, K]: dense rows of K >= 1 ids, flattened for the engine.
  template <class Hidden, class Weight, class TargetSets>
  static auto set_inputs(const Hidden& hidden, const Weight& weight, const TargetSets& targets) {
    static_assert(std::is_same_v<value_of<Hidden>, T>, "hidden: element type must be the operator's T");
    static_assert(std::is_same_v<value_of<detail::head_weight_t<Weight>>, T>,
                  "weight: element type must be the operator's T");
    static_assert(target_id_type<value_of<TargetSets>>,
                  "targets: element type must be std::int32_t or std::int64_t");
    const auto ids = detail::to_matrix_view(targets, "targets");
    detail::expects(ids.cols > 0, "targets: a target set needs K >= 1 ids per token, got [", ids.rows, ", ", ids.cols, "]");
    detail::expects(ids.rows <= 1 || ids.ld == ids.cols, "targets: target sets [", ids.rows, ", ", ids.cols,
            "] must be dense rows (ld ", ids.ld, " != K ", ids.cols, ")");
    detail::operator_inputs<T, value_of<TargetSets>> in{detail::to_matrix_view(hidden, "hidden"),
                                                        detail::to_matrix_view(detail::head_weight(weight), "weight"),
                                                        {ids.data, ids.rows * ids.cols}};
    in.set_size = ids.cols;
    in.bias = bias_of(weight);
    return in;
  }

  // A matrix of one value per target id ([N, K], like the targets), flattened;
  // an empty one ([0, 0], the default) stays empty: not computed, or zero.
  template <class E, class TargetSets>
  static vector_view<E> per_id(const matrix_view<E>& values, const TargetSets& targets, const char* name) {
    if (values.rows == 0 && values.cols == 0) return {};
    const auto ids = detail::to_matrix_view(targets, "targets");
    detail::expects(values.rows == ids.rows && values.cols == ids.cols, name, ": [", values.rows, ", ", values.cols,
            "] does not match the targets' [", ids.rows, ", ", ids.cols, "]");
    detail::expects(values.rows <= 1 || values.ld == values.cols, name, ": [", values.rows, ", ", values.cols,
            "] must be dense rows (ld ", values.ld, " != ", values.cols, ")");
    return {values.data, values.rows * values.cols};
  }

  // A target-set call's per-token vectors as the engine takes them: the [N, K]
  // log-probs (or their gradients) flattened, the rest as in the row-term forms.
  template <class E, class TargetSets>
  static auto set_output_views(detail::deferred_failure& failure, const target_set_outputs<E>& o,
                               const TargetSets& targets) {
    auto out = output_views(row_outputs<E>{{}, o.lse, o.entropy, o.mean_logit});
    out.logprobs = failure([&] { return per_id(o.logprobs, targets, "logprobs"); });
    out.has_logprobs = out.logprobs.size != 0;
    return out;
  }
  template <class E, class TargetSets>
  static auto set_gradient_views(detail::deferred_failure& failure, const target_set_gradients<E>& g,
                                 const TargetSets& targets) {
    auto grads = gradient_views(row_gradients<E>{{}, g.entropy, g.lse, g.mean_logit, g.lse_squared});
    grads.logprobs = failure([&] { return vector_view<const E>(per_id(g.logprobs, targets, "grad_logprobs")); });
    grads.has_logprobs = grads.logprobs.size != 0;
    return grads;
  }

  // Outputs of per-token results: float or double, writable.
  template <class View>
  static auto result(const View& view, const char* name) {
    static_assert(!std::is_const_v<element_of<View>>, "log-prob, lse and entropy outputs must be writable views");
    static_assert(result_type<value_of<View>>, "log-prob, lse and entropy outputs must hold float or double");
    return detail::to_vector_view(view, name);
  }

  // Per-token inputs (lse, gradients): float or double.
  template <class View>
  static auto given(const View& view, const char* name) {
    static_assert(result_type<value_of<View>>, "lse, grad_logprobs and grad_entropy must hold float or double");
    return vector_view<const value_of<View>>(detail::to_vector_view(view, name));
  }

  template <class E>
  static auto output_views(const row_outputs<E>& o) {
    detail::row_output_views<E, E, E, E> out{o.logprobs, o.lse, o.entropy, o.mean_logit};
    out.has_logprobs = o.logprobs.size != 0;
    out.has_lse = o.lse.size != 0;
    out.has_entropy = o.entropy.size != 0;
    out.has_mean_logit = o.mean_logit.size != 0;
    return out;
  }

  template <class E>
  static auto gradient_views(const row_gradients<E>& g) {
    detail::row_gradient_views<E, E, E, E> grads{g.logprobs, g.entropy, g.lse, g.mean_logit, g.lse_squared};
    grads.has_logprobs = g.logprobs.size != 0;
    grads.has_entropy = g.entropy.size != 0;
    grads.has_lse = g.lse.size != 0;
    grads.has_mean_logit = g.mean_logit.size != 0;
    grads.has_lse_squared = g.lse_squared.size != 0;
    return grads;
  }

  // Gradient outputs: float or T (double for T = double), writable.
  template <class View>
  static auto gradient(const View& view, const char* name) {
    using E = element_of<View>;
    static_assert(!std::is_const_v<E>, "grad_hidden and grad_weight must be writable views");
    static_assert(std::is_same_v<E, float> || std::is_same_v<E, T>,
                  "grad_hidden and grad_weight must hold float or the operator's T");
    return detail::to_matrix_view(view, name);
  }

  detail::engine<Comm, T, Chunk, Backend> engine_;
};

LCE_END_NAMESPACE
