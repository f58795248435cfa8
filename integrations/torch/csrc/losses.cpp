// lce's training losses (include/lce/loss/) as torch operators over packed
// sequences. Every value and gradient comes from the C++ loss functions, run
// with the thrust::host policy on the tensors' storage: this file only wraps
// tensors as lce::vector_view, computes the normaliser (over a
// torch.distributed group when one is given) and returns the loss, its
// gradients and the metrics. Fake kernels and autograd are registered in
// Python (lce_torch/_losses.py): backward multiplies the gradients returned
// here by the incoming scalar gradient.
//
//   lce::next_token_targets  token_ids, cu_seqlens? -> targets
//   lce::sequence_logprobs   logprobs, targets?, cu_seqlens?, weights? -> seq_logprobs, seq_tokens
//   lce::sft_loss            logprobs, targets?, cu_seqlens?, weights?, lse?, mean_logit?
//                            -> loss, grad_logprobs, grad_lse, grad_mean_logit, metrics
//   lce::dpo_loss            logprobs, ref_seq_logprobs, targets?, cu_seqlens?, weights?, pairs?
//                            -> loss, grad_logprobs, seq_logprobs, seq_grad, seq_tokens, metrics
//   lce::policy_gradient_loss logprobs, advantages, old_logprobs?, ref_logprobs?, generation_logprobs?,
//                            entropy?, targets?, cu_seqlens?, weights?
//                            -> loss, grad_logprobs, grad_entropy, seq_tokens, metrics
//   lce::distill_loss        student_logprobs [N, K], teacher_logprobs [N, K], ids [N, K], targets?,
//                            cu_seqlens?, weights? -> loss, grad_logprobs [N, K], seq_kl, seq_tokens, metrics
//
// Per-token tensors are 1-D [N] (the Python functions flatten a [B, T]
// layout), contiguous or not (a contiguous copy is made). Log-probs and the
// other per-token floats are float32 or float64 (one dtype per call, the
// gradients come back in it); weights are float32 (lce's packed_tokens);
// targets, cu_seqlens and pairs are int32 or int64 (read as int64: one
// instantiation of each loss per float dtype keeps the build short).

#include "forward_ad.hpp"
#include "op_tags.hpp"
#include "process_group_comm.hpp"
#include "verdicts.hpp"

#include <lce/loss/losses.hpp>

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

namespace lce_torch {
namespace {

using index_t = std::int64_t;
using batch_t = lce::packed_tokens<index_t, index_t>;

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "lce_torch: ", name, " must be a CPU tensor (the losses run on the host), got ",
              t.device());
}

void check_vector(const at::Tensor& t, const char* name) {
  check_cpu(t, name);
  TORCH_CHECK(t.dim() == 1, "lce_torch: ", name, " must be 1-D, got shape ", t.sizes());
}

// An int32 / int64 vector as a contiguous int64 one (undefined when absent).
at::Tensor index_vector(const std::optional<at::Tensor>& t, const char* name) {
  if (!t) return {};
  check_vector(*t, name);
  TORCH_CHECK_TYPE(t->scalar_type() == at::kInt || t->scalar_type() == at::kLong, "lce_torch: ", name,
                   " must be int32 or int64, got ", t->scalar_type());
  return t->to(at::kLong).contiguous();
}

// A floating vector of exactly `dtype`, contiguous (undefined when absent).
at::Tensor float_vector(const std::optional<at::Tensor>& t, at::ScalarType dtype, const char* name,
                        const char* why) {
  if (!t) return {};
  check_vector(*t, name);
  TORCH_CHECK_TYPE(t->scalar_type() == dtype, "lce_torch: ", name, " must be ", dtype, " (", why, "), got ",
                   t->scalar_type());
  return t->contiguous();
}

template <class T>
lce::vector_view<T> view_of(const at::Tensor& t) {
  if (!t.defined()) return {};
  using bare = std::remove_const_t<T>;
  return {const_cast<bare*>(t.const_data_ptr<bare>()), t.numel()};
}

// The batch description every loss takes; holds the tensors its views point into.
struct batch_tensors {
  at::Tensor targets, cu_seqlens, weights;
  std::int64_t sequences = 1;  // S (an absent or empty cu_seqlens: one sequence, as lce reads it)
  batch_t batch;
};

batch_tensors make_batch(const std::optional<at::Tensor>& targets, const std::optional<at::Tensor>& cu_seqlens,
                         const std::optional<at::Tensor>& weights, std::int64_t ignore_index) {
  batch_tensors b;
  b.targets = index_vector(targets, "targets");
  b.cu_seqlens = index_vector(cu_seqlens, "cu_seqlens");
  b.weights = float_vector(weights, at::kFloat, "weights", "lce's per-token weights; a mask: mask.float()");
  if (b.cu_seqlens.defined() && b.cu_seqlens.numel() > 0) b.sequences = b.cu_seqlens.numel() - 1;
  b.batch.targets = view_of<const index_t>(b.targets);
  b.batch.cu_seqlens = view_of<const index_t>(b.cu_seqlens);
  b.batch.weights = view_of<const float>(b.weights);
  b.batch.ignore_index = ignore_index;
  return b;
}

at::ScalarType logprobs_dtype(const at::Tensor& logprobs) {
  check_vector(logprobs, "logprobs");
  const auto t = logprobs.scalar_type();
  TORCH_CHECK_TYPE(t == at::kFloat || t == at::kDouble, "lce_torch: logprobs must be float32 or float64 (as ",
                   "linear_logprobs returns them), got ", t);
  return t;
}

// Calls f.template operator()<R>() for logprobs' dtype (float or double).
template <class F>
decltype(auto) dispatch(at::ScalarType t, F&& f) {
  if (t == at::kDouble) return f.template operator()<double>();
  return f.template operator()<float>();
}

lce::loss_reduction parse_reduction(const std::string& r) {
  if (r == "token_mean") return lce::loss_reduction::token_mean;
  TORCH_CHECK_VALUE(r == "sequence_mean", "lce_torch: reduction must be 'token_mean' or 'sequence_mean', got '", r,
                    "'");
  return lce::loss_reduction::sequence_mean;
}

// A loss's exchange of verdicts over a group (verdicts.hpp), which a rank whose Python
// wrapper rejected its arguments meets through lce_torch.agree_on_group. Every rank sends
// {ok, its call's kind, a fingerprint of its settings, its count of loss units}. A rank
// that failed returns (and raises its own error); every other rank raises "rank r
// rejected its arguments", or, where two ranks' calls or settings differ, names them. So
// bad input or disagreeing options on one rank raise on every rank, never leaving the
// others waiting in a later collective or computing with settings of their own. Returns
// the units summed over the group.
std::int64_t agree_verdicts(const process_group& comm, exchange_kind kind, bool ok, const std::string& settings,
                            std::int64_t units) {
  const auto all = exchange_verdicts(comm, ok, kind, settings, units, 0);
  std::int64_t total = 0;
  for (const verdict& theirs : all) total += theirs.first;
  return ok ? total : 0;
}

// The normaliser of a loss: prepare() runs the local checks, sets up the
// call's tensors and returns this rank's count of loss units (tokens,
// sequences or pairs). A normaliser given explicitly (a constant divisor) is
// used as it is. Otherwise it is the count, summed over the group in
// agree_verdicts, which also compares the call's `settings` (its options and
// dtype) across the ranks.
//
// With a group, the whole loss also runs once with the local count before the
// exchange (validate(local count), its results dropped): every check of lce's
// loss (a NaN log-prob, bad pairs, a bad option) is then part of the verdict.
template <class Prepare, class Validate>
double normaliser_of(exchange_kind kind, const std::optional<double>& normaliser,
                     const std::optional<std::string>& group_name, const std::string& settings, Prepare&& prepare,
                     Validate&& validate) {
  if (!group_name) {
    const std::int64_t units = prepare();
    return normaliser ? *normaliser : static_cast<double>(units);
  }
  std::int64_t units = 0;
  std::exception_ptr failure;
  try {
    TORCH_CHECK_VALUE(!normaliser, "lce_torch: pass normaliser (a constant divisor) or group (the global count of ",
                      "this loss's units), not both");
    units = prepare();
    validate(static_cast<double>(units));
  } catch (...) {
    failure = std::current_exception();
  }
  std::int64_t total = units;
  try {
    const process_group comm(*group_name, at::kCPU);
    if (comm.size() > 1) total = agree_verdicts(comm, kind, !failure, settings, units);
  } catch (...) {
    if (failure) std::rethrow_exception(failure);  // this rank's own error says more than the group's
    throw;
  }
  if (failure) std::rethrow_exception(failure);
  return static_cast<double>(total);
}

// lce.agree_on_group: a Python wrapper's side of the exchange, where its own checks
// rejected its arguments before its operator (ok false).
void agree_on_group(const std::string& group_name, c10::Device device, bool ok) {
  const process_group comm(group_name, device);
  if (comm.size() > 1) exchange_verdicts(comm, ok, exchange_kind::python_checks, "", 0, 0);
}

// lce.refuse_on_group: agree_on_group for a wrapper traced by torch.compile whose checks
// rejected this rank's arguments while it traced. Python cannot exchange anything at trace
// time, and a rank that raised there would leave the others waiting in their operators'
// exchange; so the compiled graph runs this op in the wrapper's operator's place: the rank
// meets the others' exchange (they raise "rank r rejected its arguments") and then raises
// its own error, as the Python type the check raised. Never returns.
at::Tensor refuse_on_group(const at::Tensor& anchor, const std::string& group_name, const std::string& message,
                           const std::string& error_type) {
  try {
    agree_on_group(group_name, anchor.device(), false);
  } catch (...) {  // the group itself failing: this rank's own error says more
  }
  TORCH_CHECK_TYPE(error_type != "TypeError", message);
  TORCH_CHECK_VALUE(error_type != "ValueError", message);
  TORCH_CHECK_NOT_IMPLEMENTED(error_type != "NotImplementedError", message);
  C10_THROW_ERROR(Error, message);
}

// lce.agree_on_values: the values of a tensor the ranks must share beyond lce's own call
// (linear_cross_entropy's class weights), compared across the group. Outside
// torch.compile the wrapper puts a CRC of them in its op's caller_settings; a trace
// cannot read them, so a compiled wrapper runs this op instead, and uses its result (a
// zero of values' dtype) so that the graph keeps it. `what` names the tensor with its
// dtype and shape: ranks whose `what` differs raise as settings that differ, ranks whose
// bytes differ raise naming the tensor, on every rank.
at::Tensor agree_on_values(const at::Tensor& values, const std::string& group_name, const std::string& what) {
  const process_group comm(group_name, values.device());
  if (comm.size() > 1) {
    const at::Tensor host = values.detach().contiguous().cpu();
    const std::int64_t mine = bytes_fingerprint(host.data_ptr(), host.nbytes());
    const auto all = exchange_verdicts(comm, true, exchange_kind::values_check, what, mine, 0);
    for (int r = 0; r < comm.size(); ++r)
      TORCH_CHECK(all[static_cast<std::size_t>(r)].first == mine, "lce_torch: ", what,
                  " differ across the ranks of group '", comm.name(), "': rank ", comm.rank(),
                  "'s values are not rank ", r, "'s (every rank must pass the same)");
  }
  return at::zeros({}, values.options());
}

// A call's settings as text, for agree_verdicts (doubles to 17 digits: equal text, equal values).
template <class... Parts>
std::string settings_of(const Parts&... parts) {
  std::ostringstream text;
  text.precision(17);
  (text << ... << parts);
  return text.str();
}

at::Tensor double_tensor(std::initializer_list<double> values) {
  at::Tensor t = at::empty({static_cast<std::int64_t>(values.size())}, at::TensorOptions().dtype(at::kDouble));
  std::copy(values.begin(), values.end(), t.mutable_data_ptr<double>());
  return t;
}

// --- next-token targets / sequence log-probs ----------------------------------

at::Tensor next_token_targets(const at::Tensor& token_ids, const std::optional<at::Tensor>& cu_seqlens,
                              std::int64_t ignore_index) {
  check_vector(token_ids, "token_ids");
  const auto t = token_ids.scalar_type();
  TORCH_CHECK_TYPE(t == at::kInt || t == at::kLong, "lce_torch: token_ids must be int32 or int64, got ", t);
  const at::Tensor tokens = token_ids.contiguous();
  const at::Tensor cu = index_vector(cu_seqlens, "cu_seqlens");
  at::Tensor targets = at::empty_like(tokens, at::MemoryFormat::Contiguous);
  const auto cu_view = view_of<const index_t>(cu);
  if (t == at::kInt)
    lce::shift_targets_packed(thrust::host, view_of<const std::int32_t>(tokens), cu_view,
                              view_of<std::int32_t>(targets), ignore_index);
  else
    lce::shift_targets_packed(thrust::host, view_of<const std::int64_t>(tokens), cu_view,
                              view_of<std::int64_t>(targets), ignore_index);
  return targets;
}

std::tuple<at::Tensor, at::Tensor> sequence_logprobs(const at::Tensor& logprobs,
                                                     const std::optional<at::Tensor>& targets,
                                                     const std::optional<at::Tensor>& cu_seqlens,
                                                     const std::optional<at::Tensor>& weights,
                                                     std::int64_t ignore_index, bool length_average) {
  refuse_forward_ad({logprobs, weights});
  const auto dtype = logprobs_dtype(logprobs);
  const batch_tensors b = make_batch(targets, cu_seqlens, weights, ignore_index);
  const at::Tensor logp = logprobs.contiguous();
  at::Tensor seq_logprobs = at::empty({b.sequences}, logprobs.options().dtype(at::kDouble));
  at::Tensor seq_tokens = at::empty({b.sequences}, logprobs.options().dtype(at::kLong));
  dispatch(dtype, [&]<class R>() {
    lce::sequence_logprobs(thrust::host, b.batch, view_of<const R>(logp), view_of<double>(seq_logprobs),
                           view_of<std::int64_t>(seq_tokens), length_average);
  });
  return {seq_logprobs, seq_tokens};
}

// --- SFT ------------------------------------------------------------------------

// metrics: [nll_sum, tokens, sequences, normaliser] (float64)
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> sft_loss(
    const at::Tensor& logprobs, const std::optional<at::Tensor>& targets, const std::optional<at::Tensor>& cu_seqlens,
    const std::optional<at::Tensor>& weights, const std::optional<at::Tensor>& lse,
    const std::optional<at::Tensor>& mean_logit, std::int64_t ignore_index, const std::string& reduction,
    double label_smoothing, std::optional<double> normaliser, std::optional<std::string> group_name) {
  lce::sft_options opt;
  at::ScalarType dtype{};
  batch_tensors b;
  at::Tensor logp, lse_v, mean_v;
  const auto run = [&](double norm) {
    const std::int64_t n = logp.numel();
    const bool smoothing = opt.label_smoothing != 0.0;
    const auto options = logp.options();
    at::Tensor grad_logprobs = at::empty({n}, options);
    at::Tensor grad_lse = at::empty({smoothing ? n : 0}, options);
    at::Tensor grad_mean = at::empty({smoothing ? n : 0}, options);
    at::Tensor seq_tokens = at::empty({b.sequences}, options.dtype(at::kLong));
    return dispatch(dtype, [&]<class R>() {
      const auto lp = view_of<const R>(logp);
      const lce::sft_outputs<R> out{{}, {}, view_of<std::int64_t>(seq_tokens)};
      // The loss first: it checks every value a counted token reads.
      const lce::sft_result r =
          smoothing ? lce::sft_loss(thrust::host, b.batch, lp, norm, out, opt,
                                    lce::sft_smoothing_inputs<const R>{view_of<const R>(lse_v), view_of<const R>(mean_v)})
                    : lce::sft_loss(thrust::host, b.batch, lp, norm, out, opt);
      lce::sft_gradients(thrust::host, b.batch, norm,
                         lce::sft_row_gradients<R>{view_of<R>(grad_logprobs), view_of<R>(grad_lse), view_of<R>(grad_mean)},
                         view_of<std::int64_t>(seq_tokens), opt);
      at::Tensor loss = at::scalar_tensor(r.loss, options);
      at::Tensor metrics =
          double_tensor({r.nll_sum, static_cast<double>(r.tokens), static_cast<double>(r.sequences), norm});
      return std::make_tuple(loss, grad_logprobs, grad_lse, grad_mean, metrics);
    });
  };
  const auto prepare = [&] {
    refuse_forward_ad({logprobs, lse, mean_logit, weights});
    opt.reduction = parse_reduction(reduction);
    opt.label_smoothing = label_smoothing;
    dtype = logprobs_dtype(logprobs);
    b = make_batch(targets, cu_seqlens, weights, ignore_index);
    logp = logprobs.contiguous();
    lse_v = float_vector(lse, dtype, "lse", "the dtype of logprobs");
    mean_v = float_vector(mean_logit, dtype, "mean_logit", "the dtype of logprobs");
    return lce::count_loss_units(thrust::host, b.batch, logp.numel(), opt.reduction);
  };
  const std::string settings =
      settings_of("sft_loss(reduction=", reduction, ", label_smoothing=", label_smoothing, ", ignore_index=", ignore_index,
                  ", logprobs ", logprobs.scalar_type(), ")");
  return run(normaliser_of(exchange_kind::sft_loss, normaliser, group_name, settings, prepare, run));
}

// --- DPO ------------------------------------------------------------------------

// metrics: [dpo_loss, sft_loss, pairs, reward_accuracy, mean_margin, chosen_reward, rejected_reward, normaliser]
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> dpo_loss(
    const at::Tensor& logprobs, const at::Tensor& ref_seq_logprobs, const std::optional<at::Tensor>& targets,
    const std::optional<at::Tensor>& cu_seqlens, const std::optional<at::Tensor>& weights,
    const std::optional<at::Tensor>& pairs, std::int64_t ignore_index, double beta, double sft_coef,
    bool length_average, std::optional<double> normaliser, std::optional<std::string> group_name) {
  at::ScalarType dtype{};
  batch_tensors b;
  at::Tensor logp, ref, pair_list;
  lce::dpo_options opt;
  opt.beta = beta;
  opt.sft_coef = sft_coef;
  opt.length_average = length_average;
  const auto run = [&](double norm) {
    const auto options = logp.options();
    const std::int64_t s = b.sequences;
    at::Tensor grad_logprobs = at::empty({logp.numel()}, options);
    at::Tensor seq_logprobs = at::empty({s}, options.dtype(at::kDouble));
    at::Tensor seq_grad = at::empty({s}, options.dtype(at::kDouble));
    at::Tensor seq_tokens = at::empty({s}, options.dtype(at::kLong));
    return dispatch(dtype, [&]<class R>() {
      const lce::dpo_result r = lce::dpo_loss(
          thrust::host, b.batch,
          lce::dpo_inputs<R, index_t>{view_of<const R>(logp), view_of<const double>(ref),
                                      view_of<const index_t>(pair_list)},
          norm,
          lce::dpo_outputs<R>{view_of<R>(grad_logprobs), view_of<double>(seq_logprobs), view_of<double>(seq_grad),
                              view_of<std::int64_t>(seq_tokens)},
          opt);
      at::Tensor loss = at::scalar_tensor(r.loss, options);
      at::Tensor metrics = double_tensor({r.dpo_loss, r.sft_loss, static_cast<double>(r.pairs), r.reward_accuracy,
                                          r.mean_margin, r.chosen_reward, r.rejected_reward, norm});
      return std::make_tuple(loss, grad_logprobs, seq_logprobs, seq_grad, seq_tokens, metrics);
    });
  };
  const auto prepare = [&] {
    refuse_forward_ad({logprobs, ref_seq_logprobs, weights});
    dtype = logprobs_dtype(logprobs);
    b = make_batch(targets, cu_seqlens, weights, ignore_index);
    logp = logprobs.contiguous();
    ref = float_vector(ref_seq_logprobs, at::kDouble, "ref_seq_logprobs", "lce's per-sequence sums are double");
    pair_list = index_vector(pairs, "pairs");
    // This rank's pairs (lce::count_pairs): the listed ones, or consecutive sequences.
    return pair_list.defined() && pair_list.numel() > 0 ? pair_list.numel() / 2 : b.sequences / 2;
  };
  const std::string settings =
      settings_of("dpo_loss(beta=", beta, ", sft_coef=", sft_coef, ", length_average=", length_average,
                  ", ignore_index=", ignore_index, ", logprobs ", logprobs.scalar_type(), ")");
  return run(normaliser_of(exchange_kind::dpo_loss, normaliser, group_name, settings, prepare, run));
}

// --- policy gradient ------------------------------------------------------------

lce::kl_estimator parse_kl(const std::string& kl) {
  if (kl == "k1") return lce::kl_estimator::k1;
  TORCH_CHECK_VALUE(kl == "k3", "lce_torch: kl must be 'k1' or 'k3', got '", kl, "'");
  return lce::kl_estimator::k3;
}

// metrics: [pg_loss, kl_loss, entropy_loss, tokens, clip_frac_low, clip_frac_high, dual_clip_frac,
//           approx_kl, ref_kl, mean_entropy, mean_ratio, normaliser]
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> policy_gradient_loss(
    const at::Tensor& logprobs, const at::Tensor& advantages, const std::optional<at::Tensor>& old_logprobs,
    const std::optional<at::Tensor>& ref_logprobs, const std::optional<at::Tensor>& generation_logprobs,
    const std::optional<at::Tensor>& entropy, const std::optional<at::Tensor>& targets,
    const std::optional<at::Tensor>& cu_seqlens, const std::optional<at::Tensor>& weights, std::int64_t ignore_index,
    const std::string& reduction, double eps_low, double eps_high, double dual_clip, double kl_coef,
    const std::string& kl, double tis_cap, double entropy_coef, bool sequence_advantages,
    std::optional<double> normaliser, std::optional<std::string> group_name) {
  lce::pg_options opt;
  at::ScalarType dtype{};
  batch_tensors b;
  at::Tensor logp, adv, old, ref, gen, ent;
  const auto run = [&](double norm) {
    const std::int64_t n = logp.numel();
    const auto options = logp.options();
    at::Tensor grad_logprobs = at::empty({n}, options);
    // dL/dentropy whenever entropy is given (0 without an entropy bonus), so entropy can always be differentiated.
    at::Tensor grad_entropy = at::empty({ent.defined() ? n : 0}, options);
    at::Tensor seq_tokens = at::empty({b.sequences}, options.dtype(at::kLong));
    return dispatch(dtype, [&]<class R>() {
      const lce::pg_result r = lce::policy_gradient_loss(
          thrust::host, b.batch,
          lce::pg_inputs<R>{view_of<const R>(logp), view_of<const R>(adv), view_of<const R>(old),
                            view_of<const R>(ref), view_of<const R>(gen), view_of<const R>(ent)},
          norm,
          lce::pg_outputs<R>{view_of<R>(grad_logprobs), view_of<R>(grad_entropy), {},
                             view_of<std::int64_t>(seq_tokens)},
          opt);
      at::Tensor loss = at::scalar_tensor(r.loss, options);
      at::Tensor metrics = double_tensor({r.pg_loss, r.kl_loss, r.entropy_loss, static_cast<double>(r.tokens),
                                          r.clip_frac_low, r.clip_frac_high, r.dual_clip_frac, r.approx_kl, r.ref_kl,
                                          r.mean_entropy, r.mean_ratio, norm});
      return std::make_tuple(loss, grad_logprobs, grad_entropy, seq_tokens, metrics);
    });
  };
  const auto prepare = [&] {
    refuse_forward_ad({logprobs, advantages, old_logprobs, ref_logprobs, generation_logprobs, entropy, weights});
    opt.reduction = parse_reduction(reduction);
    opt.kl = parse_kl(kl);
    opt.eps_low = eps_low;
    opt.eps_high = eps_high;
    opt.dual_clip = dual_clip;
    opt.kl_coef = kl_coef;
    opt.tis_cap = tis_cap;
    opt.entropy_coef = entropy_coef;
    opt.sequence_advantages = sequence_advantages;
    dtype = logprobs_dtype(logprobs);
    b = make_batch(targets, cu_seqlens, weights, ignore_index);
    logp = logprobs.contiguous();
    const char* same = "the dtype of logprobs";
    adv = float_vector(advantages, dtype, "advantages", same);
    old = float_vector(old_logprobs, dtype, "old_logprobs", same);
    ref = float_vector(ref_logprobs, dtype, "ref_logprobs", same);
    gen = float_vector(generation_logprobs, dtype, "generation_logprobs", same);
    ent = float_vector(entropy, dtype, "entropy", same);
    return lce::count_loss_units(thrust::host, b.batch, logp.numel(), opt.reduction);
  };
  const std::string settings =
      settings_of("policy_gradient_loss(reduction=", reduction, ", eps_low=", eps_low, ", eps_high=", eps_high,
                  ", dual_clip=", dual_clip, ", kl_coef=", kl_coef, ", kl=", kl, ", tis_cap=", tis_cap,
                  ", entropy_coef=", entropy_coef, ", sequence_advantages=", sequence_advantages,
                  ", ignore_index=", ignore_index, ", logprobs ", logprobs.scalar_type(), ")");
  return run(normaliser_of(exchange_kind::policy_gradient_loss, normaliser, group_name, settings, prepare, run));
}

// --- distillation from a teacher's top-K ------------------------------------------

lce::distill_tail parse_tail(const std::string& tail) {
  if (tail == "bucket") return lce::distill_tail::bucket;
  TORCH_CHECK_VALUE(tail == "renormalise", "lce_torch: tail must be 'bucket' or 'renormalise', got '", tail, "'");
  return lce::distill_tail::renormalise;
}

// An [N, K] input of K values per token, dense (lce reads ld = K).
at::Tensor set_matrix(const at::Tensor& t, const char* name) {
  check_cpu(t, name);
  TORCH_CHECK(t.dim() == 2, "lce_torch: ", name, " must be [N, K], got shape ", t.sizes());
  return t.contiguous();
}

template <class T>
lce::matrix_view<T> matrix_view_of(const at::Tensor& t) {
  using bare = std::remove_const_t<T>;
  return {const_cast<bare*>(t.const_data_ptr<bare>()), t.size(0), t.size(1), t.size(1)};
}

// metrics: [kl_sum, teacher_mass, student_mass, tokens, normaliser] (float64)
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> distill_loss(
    const at::Tensor& student_logprobs, const at::Tensor& teacher_logprobs, const at::Tensor& ids,
    const std::optional<at::Tensor>& targets, const std::optional<at::Tensor>& cu_seqlens,
    const std::optional<at::Tensor>& weights, std::int64_t ignore_index, const std::string& reduction,
    const std::string& tail, std::optional<double> normaliser, std::optional<std::string> group_name) {
  lce::distill_options opt;
  at::ScalarType dtype{};
  batch_tensors b;
  at::Tensor student, teacher, id_matrix;
  const auto run = [&](double norm) {
    const auto options = student.options();
    at::Tensor grad_logprobs = at::empty(student.sizes(), options);
    at::Tensor seq_kl = at::empty({b.sequences}, options.dtype(at::kDouble));
    at::Tensor seq_tokens = at::empty({b.sequences}, options.dtype(at::kLong));
    return dispatch(dtype, [&]<class R>() {
      const lce::distill_result r = lce::distill_loss(
          thrust::host, b.batch,
          lce::distill_inputs<index_t, const R>{matrix_view_of<const index_t>(id_matrix),
                                                matrix_view_of<const R>(teacher), matrix_view_of<const R>(student)},
          norm,
          lce::distill_outputs<R>{matrix_view_of<R>(grad_logprobs), view_of<double>(seq_kl),
                                  view_of<std::int64_t>(seq_tokens)},
          opt);
      at::Tensor loss = at::scalar_tensor(r.loss, options);
      at::Tensor metrics = double_tensor({r.kl_sum, r.teacher_mass, r.student_mass, static_cast<double>(r.tokens), norm});
      return std::make_tuple(loss, grad_logprobs, seq_kl, seq_tokens, metrics);
    });
  };
  const auto prepare = [&] {
    refuse_forward_ad({student_logprobs, teacher_logprobs, weights});
    opt.reduction = parse_reduction(reduction);
    opt.tail = parse_tail(tail);
    student = set_matrix(student_logprobs, "student_logprobs");
    dtype = student.scalar_type();
    TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kDouble, "lce_torch: student_logprobs must be float32 or ",
                     "float64 (as linear_target_set_logprobs returns them), got ", dtype);
    teacher = set_matrix(teacher_logprobs, "teacher_logprobs");
    TORCH_CHECK_TYPE(teacher.scalar_type() == dtype, "lce_torch: teacher_logprobs must be ", dtype,
                     " (the dtype of student_logprobs), got ", teacher.scalar_type());
    id_matrix = set_matrix(ids, "ids");
    TORCH_CHECK_TYPE(id_matrix.scalar_type() == at::kInt || id_matrix.scalar_type() == at::kLong,
                     "lce_torch: ids must be int32 or int64, got ", id_matrix.scalar_type());
    id_matrix = id_matrix.to(at::kLong);  // one instantiation (index_t), as the targets
    b = make_batch(targets, cu_seqlens, weights, ignore_index);
    const std::int64_t n = id_matrix.size(0);
    // A token whose K ids are all ignore_index is an ignored token (as in the
    // operator's target sets): it leaves the batch's counted tokens, so that
    // the normaliser (and sequence_mean's counts) are those of tokens with a
    // teacher distribution. lce's own checks see the batch as given when its
    // sizes are wrong (its message, not a broadcast error here).
    const bool sized = !b.targets.defined() || b.targets.numel() == n;
    if (sized && n > 0 && id_matrix.size(1) > 0) {
      const at::Tensor none = (id_matrix == ignore_index).all(1);
      at::Tensor t = b.targets.defined() ? b.targets : at::zeros({n}, id_matrix.options());
      if (ignore_index == 0 && !b.targets.defined()) t = t.fill_(1);  // a counted stand-in target
      b.targets = t.masked_fill(none, ignore_index);
      b.batch.targets = view_of<const index_t>(b.targets);
    }
    return lce::count_loss_units(thrust::host, b.batch, n, opt.reduction);
  };
  const std::string settings =
      settings_of("distill_loss(reduction=", reduction, ", tail=", tail, ", ignore_index=", ignore_index,
                  ", student_logprobs ", student_logprobs.scalar_type(), ")");
  return run(normaliser_of(exchange_kind::distill_loss, normaliser, group_name, settings, prepare, run));
}

// CUDA tensors: the losses' inputs are per-token vectors (O(N), far smaller
// than the LM head's), so they go to the host, the CPU kernel runs, and every
// tensor it returns goes back to the inputs' device (one synchronisation).
void losses_via_host(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const std::size_t arguments = op.schema().arguments().size();
  std::optional<c10::Device> device;
  for (std::size_t i = stack->size() - arguments; i < stack->size(); ++i) {
    c10::IValue& value = (*stack)[i];
    if (!value.isTensor() || !value.toTensor().defined()) continue;
    const at::Tensor t = value.toTensor();
    refuse_forward_ad({t});  // (a copy to the host would drop its tangent)
    if (t.device().is_cpu()) continue;
    TORCH_CHECK(!device || *device == t.device(), "lce_torch: ", op.schema().name(),
                ": the tensors must be on one device, got ", *device, " and ", t.device());
    device = t.device();
    value = t.cpu();
  }
  // Kernels get no device guard of their own, and a group without a CPU
  // backend (NCCL) stages its host values on the current device: make it the
  // inputs' device, where the rank's other collectives run.
  std::optional<c10::DeviceGuard> on_inputs_device;
  if (device) on_inputs_device.emplace(*device);
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
  const std::size_t returns = op.schema().returns().size();
  for (std::size_t i = stack->size() - returns; device && i < stack->size(); ++i) {
    c10::IValue& value = (*stack)[i];
    if (value.isTensor()) value = value.toTensor().to(*device);
  }
}

}  // namespace
}  // namespace lce_torch

// A fragment of the `lce` library that register.cpp defines (TORCH_LIBRARY may
// appear once per namespace).
TORCH_LIBRARY_FRAGMENT(lce, m) {
  m.def("agree_on_group(str group_name, Device device, bool ok) -> ()", &lce_torch::agree_on_group);
  m.def("refuse_on_group(Tensor anchor, str group_name, str message, str error_type) -> Tensor", lce_torch::op_tags());
  m.def("agree_on_values(Tensor values, str group_name, str what) -> Tensor", lce_torch::op_tags());
  m.def("next_token_targets(Tensor token_ids, Tensor? cu_seqlens=None, *, int ignore_index=-100) -> Tensor",
        lce_torch::op_tags());
  m.def("sequence_logprobs(Tensor logprobs, Tensor? targets=None, Tensor? cu_seqlens=None, Tensor? weights=None, *, "
        "int ignore_index=-100, bool length_average=False) -> (Tensor seq_logprobs, Tensor seq_tokens)",
        lce_torch::op_tags());
  m.def("sft_loss(Tensor logprobs, Tensor? targets=None, Tensor? cu_seqlens=None, Tensor? weights=None, "
        "Tensor? lse=None, Tensor? mean_logit=None, *, int ignore_index=-100, str reduction='token_mean', "
        "float label_smoothing=0.0, float? normaliser=None, str? group_name=None) "
        "-> (Tensor loss, Tensor grad_logprobs, Tensor grad_lse, Tensor grad_mean_logit, Tensor metrics)",
        lce_torch::op_tags());
  m.def("dpo_loss(Tensor logprobs, Tensor ref_seq_logprobs, Tensor? targets=None, Tensor? cu_seqlens=None, "
        "Tensor? weights=None, Tensor? pairs=None, *, int ignore_index=-100, float beta=0.1, float sft_coef=0.0, "
        "bool length_average=False, float? normaliser=None, str? group_name=None) "
        "-> (Tensor loss, Tensor grad_logprobs, Tensor seq_logprobs, Tensor seq_grad, Tensor seq_tokens, "
        "Tensor metrics)",
        lce_torch::op_tags());
  m.def("policy_gradient_loss(Tensor logprobs, Tensor advantages, Tensor? old_logprobs=None, "
        "Tensor? ref_logprobs=None, Tensor? generation_logprobs=None, Tensor? entropy=None, Tensor? targets=None, "
        "Tensor? cu_seqlens=None, Tensor? weights=None, *, int ignore_index=-100, str reduction='token_mean', "
        "float eps_low=0.2, float eps_high=0.2, float dual_clip=0.0, float kl_coef=0.0, str kl='k3', "
        "float tis_cap=0.0, float entropy_coef=0.0, bool sequence_advantages=False, float? normaliser=None, "
        "str? group_name=None) "
        "-> (Tensor loss, Tensor grad_logprobs, Tensor grad_entropy, Tensor seq_tokens, Tensor metrics)",
        lce_torch::op_tags());
  m.def("distill_loss(Tensor student_logprobs, Tensor teacher_logprobs, Tensor ids, Tensor? targets=None, "
        "Tensor? cu_seqlens=None, Tensor? weights=None, *, int ignore_index=-100, str reduction='token_mean', "
        "str tail='bucket', float? normaliser=None, str? group_name=None) "
        "-> (Tensor loss, Tensor grad_logprobs, Tensor seq_kl, Tensor seq_tokens, Tensor metrics)",
        lce_torch::op_tags());
}

TORCH_LIBRARY_IMPL(lce, CompositeExplicitAutograd, m) {
  m.impl("refuse_on_group", &lce_torch::refuse_on_group);
  m.impl("agree_on_values", &lce_torch::agree_on_values);
}

TORCH_LIBRARY_IMPL(lce, CPU, m) {
  m.impl("next_token_targets", &lce_torch::next_token_targets);
  m.impl("sequence_logprobs", &lce_torch::sequence_logprobs);
  m.impl("sft_loss", &lce_torch::sft_loss);
  m.impl("dpo_loss", &lce_torch::dpo_loss);
  m.impl("policy_gradient_loss", &lce_torch::policy_gradient_loss);
  m.impl("distill_loss", &lce_torch::distill_loss);
}

TORCH_LIBRARY_IMPL(lce, CUDA, m) {
  for (const char* name : {"next_token_targets", "sequence_logprobs", "sft_loss", "dpo_loss", "policy_gradient_loss",
                           "distill_loss"})
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&lce_torch::losses_via_host>());
}
