#pragma once
// SFT / NLL over packed sequences: L = -(1/normaliser) sum_i w_i logp_i
// (token_mean), or the per-sequence-mean variant (loss_reduction, packed.hpp).
//
// The gradient dL/dlogp_i = -w_i / normaliser (or -w_i / (n_s normaliser))
// depends only on targets, weights and the normaliser, never on logp: compute
// it with sft_grad_logprobs BEFORE the forward and hand it to
// op.forward_backward, which returns logp and both gradients in one sweep
// (3 GEMMs per chunk instead of forward's 1 plus backward's 3); then sft_loss
// gives the loss value from the returned logp (with an empty grad_logprobs).
//
//   packed_tokens<> batch{targets, cu_seqlens, mask};
//   double norm = global_token_count(comm, count_loss_units(thrust::host, batch, N));
//   sft_grad_logprobs(thrust::host, batch, norm, grad, {});
//   op.forward_backward(X, W, targets, grad, logp, dX, dW);
//   double loss = sft_loss(thrust::host, batch, logp, norm, sft_outputs<float>{}).loss;
//
// With label smoothing (sft_options::label_smoothing = eps, PyTorch's), a
// counted token's loss is (1 - eps)(-logp) + eps (lse - mean logit), eps times
// the mean over the vocabulary of -log p_v. Its gradients with respect to
// logp, lse and the mean logit are still known before the forward
// (sft_gradients), so it stays one sweep through the operator's row-term form:
//
//   sft_gradients(thrust::host, batch, norm, sft_row_gradients<float>{g_lp, g_lse, g_mean}, {}, opts);
//   op.forward_backward(X, W, targets, lce::row_gradients<float>{g_lp, {}, g_lse, g_mean},
//                       lce::row_outputs<float>{logp, lse, {}, mean_logit}, dX, dW);
//   double loss = sft_loss(thrust::host, batch, logp, norm, sft_outputs<float>{}, opts,
//                          sft_smoothing_inputs<const float>{lse, mean_logit}).loss;
//
// A z-loss (sft_options::z_loss = lambda, lambda lse^2 per counted token) is
// one more row term: sft_gradients writes each token's coefficient of lse^2
// into sft_row_gradients::lse_squared, which the operator (as
// lce::row_gradients::lse_squared) turns into dL/dlse = 2 lambda c_i lse with
// the lse of the same sweep.

#include <lce/loss/packed.hpp>

LCE_BEGIN_NAMESPACE

struct sft_options {
  loss_reduction reduction = loss_reduction::token_mean;
  double label_smoothing = 0;  // eps in [0, 1] (PyTorch's label_smoothing); > 0 needs lse and the mean logit
  double z_loss = 0;           // lambda >= 0: adds lambda lse^2 per counted token (PaLM's z-loss); > 0 needs lse
};

// dL/dlogp, dL/dlse and dL/d(mean logit) of the SFT loss [N] each (written by
// sft_gradients); the last two may be empty when label_smoothing is 0. With a
// z-loss, lse_squared [N] receives each token's coefficient of lse^2 (lambda
// times its scale), which the operator turns into 2 lambda lse in the same
// sweep (lce::row_gradients::lse_squared).
template <class G = float>
struct sft_row_gradients {
  vector_view<G> logprobs;
  vector_view<G> lse;
  vector_view<G> mean_logit;
  vector_view<G> lse_squared{};
};

// The operator's lse and mean logit [N] (lce::row_outputs), for the loss with label smoothing.
template <class R = const float>
struct sft_smoothing_inputs {
  vector_view<R> lse;
  vector_view<R> mean_logit;
};

template <class G = float>
struct sft_outputs {
  vector_view<G> grad_logprobs{};          // [N] dL/dlogp (written), or empty
  vector_view<double> seq_nll{};           // [S] sum_{i in s} w_i (-logp_i) (written), or empty
  vector_view<std::int64_t> seq_tokens{};  // [S] counted tokens (written), or empty; required for sequence_mean
};

struct sft_result {
  double loss = 0;             // this rank's share of the global loss (sum over ranks = the global loss)
  double nll_sum = 0;          // sum_i w_i (-logp_i) over this rank's tokens
  double lse_square_sum = 0;   // sum_i w_i lse_i^2 (with lse given): the z-loss's metric
  std::int64_t tokens = 0;     // counted tokens here
  std::int64_t sequences = 0;  // sequences here with at least one counted token
};

namespace loss_detail {

// c_i times a constant: the SFT gradients are -(1 - eps) c_i (logp), eps c_i
// (lse) and -eps c_i (mean logit), c_i the token's scale.
template <class G, class C, class I>
struct sft_grad {
  token_scale<C, I> scale;
  double factor = -1;
  LCE_HOST_DEVICE G operator()(std::int64_t i) const { return static_cast<G>(factor * scale(i)); }
};

template <class R, class C, class I>
struct sft_terms {  // {loss, nll, tokens, w lse^2}
  const R* logp;
  token_scale<C, I> scale;
  const R* lse = nullptr;   // with label smoothing or a z-loss
  const R* mean = nullptr;  // with label smoothing
  double eps = 0;
  double z_loss = 0;
  LCE_HOST_DEVICE sums<4> operator()(std::int64_t i) const {
    sums<4> r;
    const double w = scale.w(i);
    if (w == 0.0) return r;
    const double lp = static_cast<double>(logp[i]);
    const double smoothed = eps == 0.0 ? 0.0 : static_cast<double>(lse[i]) - static_cast<double>(mean[i]);
    const double lse_square = lse ? static_cast<double>(lse[i]) * static_cast<double>(lse[i]) : 0.0;
    r.v[0] = scale(i) * ((1.0 - eps) * -lp + eps * smoothed + z_loss * lse_square);
    r.v[1] = -w * lp;
    r.v[2] = 1;
    r.v[3] = w * lse_square;
    return r;
  }
};

template <class R, class I>
struct weighted_nll {
  const R* logp;
  token_weight<I> w;
  LCE_HOST_DEVICE double operator()(std::int64_t i) const {
    const double wi = w(i);
    return wi == 0.0 ? 0.0 : -wi * static_cast<double>(logp[i]);
  }
};

template <class Policy, class I, class C>
void sft_checks(Policy&&, const packed_tokens<I, C>&, const seqs<C>& sq, double normaliser, std::int64_t counted,
                std::int64_t seq_tokens, const sft_options& options) {
  expects(options.label_smoothing >= 0.0 && options.label_smoothing <= 1.0, "options.label_smoothing = ",
          options.label_smoothing, " is outside [0, 1]");
  check_non_negative("options.z_loss", options.z_loss);
  check_normaliser(normaliser, counted, "counted tokens");
  check_size("seq_tokens", seq_tokens, sq.count, "the number of sequences", true);
  expects(options.reduction != loss_reduction::sequence_mean || seq_tokens == sq.count,
          "seq_tokens: sequence_mean needs it ([", sq.count, "] per-sequence counts), got size ", seq_tokens);
}

}  // namespace loss_detail

// The SFT loss's gradients with respect to the operator's per-token outputs,
// before the forward: dL/dlogp_i = -(1 - eps) c_i, dL/dlse_i = eps c_i,
// dL/d(mean logit)_i = -eps c_i, with c_i = w_i / normaliser (token_mean) or
// w_i / (n_s normaliser) (sequence_mean; seq_tokens [S] receives n_s).
// N = out.logprobs.size; lse and mean_logit are [N], or empty when eps = 0.
// Uncounted tokens get 0.
template <class Policy, class I, class C, class G>
  requires loss_detail::is_policy<Policy>
void sft_gradients(Policy&& exec, const packed_tokens<I, C>& batch, double normaliser,
                   const sft_row_gradients<G>& out, vector_view<std::int64_t> seq_tokens,
                   const sft_options& options = {}) {
  using namespace loss_detail;
  const std::int64_t n = out.logprobs.size;
  std::int64_t counted = 0;
  const auto sq = check_batch(exec, batch, n, &counted);
  sft_checks(exec, batch, sq, normaliser, counted, seq_tokens.size, options);
  const double eps = options.label_smoothing;
  const bool smoothing_terms = out.lse.size != 0 || out.mean_logit.size != 0;
  expects(eps == 0.0 || (out.lse.size == n && out.mean_logit.size == n), "options.label_smoothing = ", eps,
          " needs grad_lse and grad_mean_logit of ", n, " tokens, got sizes ", out.lse.size, " and ",
          out.mean_logit.size);
  if (smoothing_terms) {
    check_size("grad_lse", out.lse.size, n, "grad_logprobs", false);
    check_size("grad_mean_logit", out.mean_logit.size, n, "grad_logprobs", false);
  }
  expects(options.z_loss == 0.0 || out.lse_squared.size == n, "options.z_loss = ", options.z_loss,
          " needs lse_squared of ", n, " tokens, got size ", out.lse_squared.size);
  check_size("lse_squared", out.lse_squared.size, n, "grad_logprobs", true);
  check_no_alias({bytes_of(batch.targets, "targets"), bytes_of(batch.cu_seqlens, "cu_seqlens"),
                  bytes_of(batch.weights, "weights")},
                 {bytes_of(out.logprobs, "grad_logprobs"), bytes_of(out.lse, "grad_lse"),
                  bytes_of(out.mean_logit, "grad_mean_logit"), bytes_of(out.lse_squared, "lse_squared"),
                  bytes_of(seq_tokens, "seq_tokens")});
  const auto w = weight_of(batch);
  const std::int64_t* counts = nullptr;
  if (seq_tokens.size) {
    sequence_token_counts(exec, sq, w, seq_tokens.data);
    if (options.reduction == loss_reduction::sequence_mean) counts = seq_tokens.data;
  }
  if (n == 0) return;
  const token_scale<C, I> scale{sq, w, counts, inverse(normaliser)};
  const auto idx = thrust::make_counting_iterator<std::int64_t>(0);
  thrust::transform(exec, idx, idx + n, out.logprobs.data, sft_grad<G, C, I>{scale, -(1.0 - eps)});
  if (smoothing_terms) {
    thrust::transform(exec, idx, idx + n, out.lse.data, sft_grad<G, C, I>{scale, eps});
    thrust::transform(exec, idx, idx + n, out.mean_logit.data, sft_grad<G, C, I>{scale, -eps});
  }
  if (out.lse_squared.size)
    thrust::transform(exec, idx, idx + n, out.lse_squared.data, sft_grad<G, C, I>{scale, options.z_loss});
}

// grad_logprobs[i] = dL/dlogp_i = -w_i / normaliser (token_mean) or
// -w_i / (n_s normaliser) (sequence_mean; seq_tokens [S] receives n_s, needed
// there, optional otherwise). N = grad_logprobs.size. Uncounted tokens get 0.
template <class Policy, class I, class C, class G>
  requires loss_detail::is_policy<Policy>
void sft_grad_logprobs(Policy&& exec, const packed_tokens<I, C>& batch, double normaliser,
                       vector_view<G> grad_logprobs, vector_view<std::int64_t> seq_tokens,
                       const sft_options& options = {}) {
  using namespace loss_detail;
  expects(options.label_smoothing == 0.0 && options.z_loss == 0.0, "options.label_smoothing = ",
          options.label_smoothing, ", options.z_loss = ", options.z_loss,
          ": with label smoothing or a z-loss the gradient has lse and mean-logit terms too; use sft_gradients");
  sft_gradients(exec, batch, normaliser, sft_row_gradients<G>{grad_logprobs, {}, {}}, seq_tokens, options);
}

// The loss from logp (op.forward's or op.forward_backward's), with the
// optional outputs (gradient, per-sequence NLL sums and token counts).
// With label smoothing (options.label_smoothing > 0), the overload below
// that takes lse and the mean logit.
template <class Policy, class I, class C, class R, class G>
  requires loss_detail::is_policy<Policy>
sft_result sft_loss(Policy&& exec, const packed_tokens<I, C>& batch, vector_view<R> logprobs, double normaliser,
                    const sft_outputs<G>& out, const sft_options& options = {}) {
  detail::expects(options.label_smoothing == 0.0 && options.z_loss == 0.0, "options.label_smoothing = ",
                  options.label_smoothing, ", options.z_loss = ", options.z_loss,
                  ": the smoothed loss and the z-loss need lse (and the mean logit; pass sft_smoothing_inputs)");
  return sft_loss(exec, batch, logprobs, normaliser, out, options, sft_smoothing_inputs<R>{});
}

template <class Policy, class I, class C, class R, class G>
  requires loss_detail::is_policy<Policy>
sft_result sft_loss(Policy&& exec, const packed_tokens<I, C>& batch, vector_view<R> logprobs, double normaliser,
                    const sft_outputs<G>& out, const sft_options& options, const sft_smoothing_inputs<R>& smoothing) {
  using namespace loss_detail;
  using R0 = std::remove_const_t<R>;
  const double eps = options.label_smoothing;
  const std::int64_t n = logprobs.size;
  std::int64_t counted = 0;
  const auto sq = check_batch(exec, batch, n, &counted);
  expects(n == 0 || logprobs.data, "logprobs: null data for ", n, " tokens");
  check_size("grad_logprobs", out.grad_logprobs.size, n, "logprobs", true);
  check_size("seq_nll", out.seq_nll.size, sq.count, "the number of sequences", true);
  sft_checks(exec, batch, sq, normaliser, counted, out.seq_tokens.size, options);
  check_no_alias({bytes_of(logprobs, "logprobs"), bytes_of(batch.targets, "targets"),
                  bytes_of(batch.cu_seqlens, "cu_seqlens"), bytes_of(batch.weights, "weights"),
                  bytes_of(smoothing.lse, "lse"), bytes_of(smoothing.mean_logit, "mean_logit")},
                 {bytes_of(out.grad_logprobs, "grad_logprobs"), bytes_of(out.seq_nll, "seq_nll"),
                  bytes_of(out.seq_tokens, "seq_tokens")});
  const auto w = weight_of(batch);
  check_finite_values(exec, "logprobs", static_cast<const R0*>(logprobs.data), sq, w);
  check_size("lse", smoothing.lse.size, n, "logprobs", true);
  if (eps != 0.0 || options.z_loss != 0.0)
    check_size("lse", smoothing.lse.size, n, "logprobs", false, "label_smoothing or z_loss != 0");
  // Read wherever given (lse_square_sum), so checked wherever given.
  if (smoothing.lse.size) check_finite_values(exec, "lse", static_cast<const R0*>(smoothing.lse.data), sq, w);
  if (eps != 0.0) {
    check_size("mean_logit", smoothing.mean_logit.size, n, "logprobs", false, "label_smoothing");
    check_finite_values(exec, "mean_logit", static_cast<const R0*>(smoothing.mean_logit.data), sq, w);
  }
  const std::int64_t* counts = nullptr;
  if (out.seq_tokens.size) {
    sequence_token_counts(exec, sq, w, out.seq_tokens.data);
    if (options.reduction == loss_reduction::sequence_mean) counts = out.seq_tokens.data;
  }
  const token_scale<C, I> scale{sq, w, counts, inverse(normaliser)};
  const auto idx = thrust::make_counting_iterator<std::int64_t>(0);
  sft_result result;
  if (n > 0) {
    const bool with_lse = smoothing.lse.size == n && n > 0;
    const sft_terms<R0, C, I> terms{logprobs.data, scale, with_lse ? smoothing.lse.data : nullptr,
                                    eps != 0.0 ? smoothing.mean_logit.data : nullptr, eps, options.z_loss};
    const sums<4> s = thrust::transform_reduce(exec, idx, idx + n, terms, sums<4>{}, sums_plus<4>{});
    result.loss = s.v[0];
    result.nll_sum = s.v[1];
    result.tokens = static_cast<std::int64_t>(s.v[2]);
    result.lse_square_sum = s.v[3];
    result.sequences = thrust::transform_reduce(exec, idx, idx + sq.count, sequence_has_tokens<C, I>{sq, w},
                                                std::int64_t{0}, thrust::plus<std::int64_t>());
  }
  if (out.grad_logprobs.size && n > 0)
    thrust::transform(exec, idx, idx + n, out.grad_logprobs.data, sft_grad<G, C, I>{scale, -(1.0 - eps)});
  if (out.seq_nll.size) {
    thrust::fill(exec, out.seq_nll.data, out.seq_nll.data + sq.count, 0.0);
    segmented_sum<double>(exec, sq, weighted_nll<R0, I>{logprobs.data, w}, store_to<double>{out.seq_nll.data});
  }
  return result;
}

LCE_END_NAMESPACE
