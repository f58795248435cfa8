"""lce's training losses over packed sequences (include/lce/loss/): the Python API,
fake kernels and autograd of the ``torch.ops.lce`` loss operators.

Every value and gradient comes from lce's C++ loss functions (csrc/losses.cpp,
run with ``thrust::host``): each operator returns the loss, its gradient with
respect to its differentiable inputs (dL/dlogp; dL/dentropy; dL/dlse and
dL/dmean_logit under label smoothing) and the metrics, in one call. The
backward registered here multiplies those stored gradients by the incoming
scalar gradient, so ``loss.backward()`` continues into ``linear_logprobs``'s own
backward (lce's op) and reaches ``hidden`` and ``weight``.

Layouts: packed, per-token tensors [N] with ``cu_seqlens`` [S + 1] (int32 / int64;
``None``: one sequence), or a padded batch [B, T] without ``cu_seqlens`` (B
sequences of T tokens; pass the padding mask as ``weights``).
"""
from typing import NamedTuple, Optional

import torch

from . import _C  # noqa: F401  (loads the library: registers torch.ops.lce.*)
from ._ops import (Refused, checked_on_group, group_name_of, number, refuse_create_graph, refuse_forward_ad,
                   require_tensors, shape_tuple)

_ops = torch.ops.lce

# The losses' ops exchange their verdicts over the group's CPU backend (csrc/losses.cpp):
# a rank whose Python-side checks fail takes its part there.
_EXCHANGE_DEVICE = "cpu"


class SFTResult(NamedTuple):
    """``loss`` is differentiable; the rest are 0-dim tensors (float64, counts int64)."""
    loss: torch.Tensor            # this rank's share of the (global) mean loss
    nll_sum: torch.Tensor         # sum_i w_i (-logp_i) over this rank's tokens
    tokens: torch.Tensor          # counted tokens here
    sequences: torch.Tensor       # sequences here with at least one counted token
    normaliser: torch.Tensor      # the divisor used (global count with a group)


class DPOResult(NamedTuple):
    """``loss`` is differentiable; means are over this rank's pairs; rewards are beta (pi - ref)."""
    loss: torch.Tensor
    dpo_loss: torch.Tensor        # its -log sigmoid part
    sft_loss: torch.Tensor        # its sft_coef * NLL part
    pairs: torch.Tensor           # pairs here (int64)
    reward_accuracy: torch.Tensor
    mean_margin: torch.Tensor
    chosen_reward: torch.Tensor
    rejected_reward: torch.Tensor
    normaliser: torch.Tensor
    seq_logprobs: torch.Tensor    # [S] the policy's pi_s (float64, not differentiable)
    seq_tokens: torch.Tensor      # [S] counted tokens per sequence (int64)


class PolicyGradientResult(NamedTuple):
    """``loss`` is differentiable; means are over this rank's counted tokens."""
    loss: torch.Tensor
    pg_loss: torch.Tensor
    kl_loss: torch.Tensor
    entropy_loss: torch.Tensor
    tokens: torch.Tensor          # int64
    clip_frac_low: torch.Tensor
    clip_frac_high: torch.Tensor
    dual_clip_frac: torch.Tensor
    approx_kl: torch.Tensor
    ref_kl: torch.Tensor
    mean_entropy: torch.Tensor
    mean_ratio: torch.Tensor
    normaliser: torch.Tensor


class DistillResult(NamedTuple):
    """``loss`` is differentiable (w.r.t. the student's log-probs); the rest are tensors
    (float64, counts int64). Masses are sums over counted tokens: divide by ``tokens``."""
    loss: torch.Tensor            # this rank's share of the (global) mean KL
    kl_sum: torch.Tensor          # sum_i w_i KL_i over this rank's counted tokens
    teacher_mass: torch.Tensor    # sum_i of the teacher's top-K probability mass
    student_mass: torch.Tensor    # sum_i of the student's probability mass on those ids
    tokens: torch.Tensor          # counted tokens here (with at least one id)
    normaliser: torch.Tensor      # the divisor used (global count with a group)
    seq_kl: torch.Tensor          # [S] sum of w_i KL_i per sequence (float64)
    seq_tokens: torch.Tensor      # [S] counted tokens per sequence (int64)


def _sequence_count(cu_seqlens):
    # lce reads an absent or empty cu_seqlens as one sequence.
    if cu_seqlens is None:
        return 1
    n = cu_seqlens.numel()
    return n - 1 if n != 0 else 1


# ---- fake kernels (shapes depend only on input shapes: torch.compile) -----------


@torch.library.register_fake("lce::next_token_targets")
def _next_token_targets_fake(token_ids, cu_seqlens=None, *, ignore_index=-100):
    return torch.empty_like(token_ids, memory_format=torch.contiguous_format)


@torch.library.register_fake("lce::sequence_logprobs")
def _sequence_logprobs_fake(logprobs, targets=None, cu_seqlens=None, weights=None, *, ignore_index=-100,
                            length_average=False):
    s = _sequence_count(cu_seqlens)
    return logprobs.new_empty((s,), dtype=torch.float64), logprobs.new_empty((s,), dtype=torch.int64)


@torch.library.register_fake("lce::sft_loss")
def _sft_loss_fake(logprobs, targets=None, cu_seqlens=None, weights=None, lse=None, mean_logit=None, *,
                   label_smoothing=0.0, **options):
    n = logprobs.numel()
    m = n if label_smoothing != 0.0 else 0
    return (logprobs.new_empty(()), logprobs.new_empty((n,)), logprobs.new_empty((m,)), logprobs.new_empty((m,)),
            logprobs.new_empty((4,), dtype=torch.float64))


@torch.library.register_fake("lce::dpo_loss")
def _dpo_loss_fake(logprobs, ref_seq_logprobs, targets=None, cu_seqlens=None, weights=None, pairs=None, **options):
    s = _sequence_count(cu_seqlens)
    return (logprobs.new_empty(()), logprobs.new_empty((logprobs.numel(),)),
            logprobs.new_empty((s,), dtype=torch.float64), logprobs.new_empty((s,), dtype=torch.float64),
            logprobs.new_empty((s,), dtype=torch.int64), logprobs.new_empty((8,), dtype=torch.float64))


@torch.library.register_fake("lce::policy_gradient_loss")
def _policy_gradient_loss_fake(logprobs, advantages, old_logprobs=None, ref_logprobs=None, generation_logprobs=None,
                               entropy=None, targets=None, cu_seqlens=None, weights=None, **options):
    n = logprobs.numel()
    return (logprobs.new_empty(()), logprobs.new_empty((n,)), logprobs.new_empty((n if entropy is not None else 0,)),
            logprobs.new_empty((_sequence_count(cu_seqlens),), dtype=torch.int64),
            logprobs.new_empty((12,), dtype=torch.float64))


@torch.library.register_fake("lce::distill_loss")
def _distill_loss_fake(student_logprobs, teacher_logprobs, ids, targets=None, cu_seqlens=None, weights=None,
                       **options):
    s = _sequence_count(cu_seqlens)
    return (student_logprobs.new_empty(()), student_logprobs.new_empty(student_logprobs.shape),
            student_logprobs.new_empty((s,), dtype=torch.float64), student_logprobs.new_empty((s,), dtype=torch.int64),
            student_logprobs.new_empty((5,), dtype=torch.float64))


# ---- autograd: the stored C++ gradients times the incoming scalar --------------


def _scaled(loss, grad_loss, grad):
    refuse_create_graph(f"lce_torch.{loss}: its gradient is computed in its forward and is not differentiable "
                        f"itself (no double backward, create_graph=True)")
    return grad_loss.to(grad.dtype) * grad


def _needs(ctx, i):
    # The dispatcher drops trailing arguments left at their default (None), so
    # needs_input_grad can be shorter than the schema; a dropped one needs nothing.
    return i < len(ctx.needs_input_grad) and ctx.needs_input_grad[i]


def _sft_setup_context(ctx, inputs, keyword_only_inputs, output):
    _, grad_logprobs, grad_lse, grad_mean_logit, metrics = output
    ctx.save_for_backward(grad_logprobs, grad_lse, grad_mean_logit)
    ctx.smoothing = keyword_only_inputs.get("label_smoothing", 0.0) != 0.0
    ctx.mark_non_differentiable(grad_logprobs, grad_lse, grad_mean_logit, metrics)


def _sft_backward(ctx, grad_loss, *unused):
    grad_logprobs, grad_lse, grad_mean_logit = ctx.saved_tensors
    return (
        _scaled("sft_loss", grad_loss, grad_logprobs) if _needs(ctx, 0) else None,
        None, None, None,
        # Without label smoothing the loss does not depend on lse or the mean logit.
        _scaled("sft_loss", grad_loss, grad_lse) if _needs(ctx, 4) and ctx.smoothing else None,
        _scaled("sft_loss", grad_loss, grad_mean_logit) if _needs(ctx, 5) and ctx.smoothing else None,
    )


torch.library.register_autograd("lce::sft_loss", _sft_backward, setup_context=_sft_setup_context)


def _dpo_setup_context(ctx, inputs, keyword_only_inputs, output):
    _, grad_logprobs, seq_logprobs, seq_grad, seq_tokens, metrics = output
    ctx.save_for_backward(grad_logprobs)
    ctx.mark_non_differentiable(grad_logprobs, seq_logprobs, seq_grad, seq_tokens, metrics)


def _dpo_backward(ctx, grad_loss, *unused):
    (grad_logprobs,) = ctx.saved_tensors
    # The reference's log-probs are constants of the loss (no gradient to ref_seq_logprobs).
    grad = _scaled("dpo_loss", grad_loss, grad_logprobs) if _needs(ctx, 0) else None
    return (grad, None, None, None, None, None)


torch.library.register_autograd("lce::dpo_loss", _dpo_backward, setup_context=_dpo_setup_context)


def _pg_setup_context(ctx, inputs, keyword_only_inputs, output):
    _, grad_logprobs, grad_entropy, seq_tokens, metrics = output
    ctx.save_for_backward(grad_logprobs, grad_entropy)
    ctx.has_entropy = len(inputs) > 5 and inputs[5] is not None
    ctx.mark_non_differentiable(grad_logprobs, grad_entropy, seq_tokens, metrics)


def _pg_backward(ctx, grad_loss, *unused):
    grad_logprobs, grad_entropy = ctx.saved_tensors
    # advantages, old / reference / generation log-probs are constants of the loss.
    return (
        _scaled("policy_gradient_loss", grad_loss, grad_logprobs) if _needs(ctx, 0) else None,
        None, None, None, None,
        _scaled("policy_gradient_loss", grad_loss, grad_entropy) if _needs(ctx, 5) and ctx.has_entropy else None,
        None, None, None,
    )


torch.library.register_autograd("lce::policy_gradient_loss", _pg_backward, setup_context=_pg_setup_context)


def _distill_setup_context(ctx, inputs, keyword_only_inputs, output):
    _, grad_logprobs, seq_kl, seq_tokens, metrics = output
    ctx.save_for_backward(grad_logprobs)
    ctx.mark_non_differentiable(grad_logprobs, seq_kl, seq_tokens, metrics)


def _distill_backward(ctx, grad_loss, *unused):
    (grad_logprobs,) = ctx.saved_tensors
    # The teacher's log-probs are constants of the loss (no gradient to them).
    grad = _scaled("distill_loss", grad_loss, grad_logprobs) if _needs(ctx, 0) else None
    return (grad, None, None, None, None, None)


torch.library.register_autograd("lce::distill_loss", _distill_backward, setup_context=_distill_setup_context)


# ---- Python API -------------------------------------------------------------------


class _Layout:
    """Packed [N] tensors with cu_seqlens, or a [B, T] batch (B sequences of T tokens)
    flattened to the packed form; per-token inputs follow logprobs' layout."""

    def __init__(self, fn, logprobs, cu_seqlens):
        refuse_forward_ad(fn, logprobs)
        self.fn = fn
        self.shape = tuple(logprobs.shape)
        if logprobs.dim() == 2:
            if cu_seqlens is not None:
                raise ValueError(f"lce_torch.{fn}: a [B, T] logprobs ({shape_tuple(logprobs.shape)}) takes no cu_seqlens "
                                 f"(its rows are the sequences); pass packed [N] tensors with cu_seqlens instead")
            b, t = logprobs.shape
            self.cu_seqlens = torch.arange(b + 1, dtype=torch.int64, device=logprobs.device) * t
        elif logprobs.dim() == 1:
            self.cu_seqlens = cu_seqlens
        else:
            raise ValueError(f"lce_torch.{fn}: logprobs must be packed [N] (with cu_seqlens) or [B, T], got shape "
                             f"{shape_tuple(logprobs.shape)}")

    def tokens(self, t, name, dtype=None):
        """A per-token tensor as [N] (in dtype); None stays None."""
        if t is None:
            return None
        refuse_forward_ad(self.fn, t)
        if len(self.shape) == 2:
            if tuple(t.shape) != self.shape:
                raise ValueError(f"lce_torch.{self.fn}: {name} has shape {shape_tuple(t.shape)}, logprobs {shape_tuple(self.shape)}")
            t = t.reshape(-1)
        return t if dtype is None else t.to(dtype)


def _weights(layout, weights):
    # lce's per-token weights are float32 (a bool / 0-1 mask is exact).
    return layout.tokens(weights, "weights", torch.float32)


def _refused_layout(per_token, cu_seqlens, batched_dim=2):
    """(sequences, loss dtype) of a refused loss's stand-ins, where its arguments tell them,
    as the op reads them: cu_seqlens [S + 1] (an empty one: one sequence), or the rows of a
    batched [B, T] (``batched_dim`` dimensions) input, or one sequence of a packed one; None
    where they do not."""
    sequences = None
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() == 1:
            sequences = _sequence_count(cu_seqlens)
    elif isinstance(per_token, torch.Tensor) and cu_seqlens is None:
        if per_token.dim() == batched_dim:
            sequences = per_token.shape[0]
        elif per_token.dim() == batched_dim - 1:
            sequences = 1
    dtype = per_token.dtype if isinstance(per_token, torch.Tensor) and per_token.is_floating_point() else None
    return dict(sequences=sequences, loss_dtype=dtype)


def _normaliser(fn, normaliser):
    return None if normaliser is None else number(fn, "normaliser", normaliser)


def _text(fn, name, value):
    if not isinstance(value, str):
        raise TypeError(f"lce_torch.{fn}: {name} must be a str, got {type(value).__name__}")
    return value


def next_token_targets(token_ids, cu_seqlens=None, *, ignore_index=-100):
    """Targets for next-token prediction over packed sequences: ``targets[i] = token_ids[i + 1]``
    inside a sequence, ``ignore_index`` at the last token of each, so no target crosses a
    sequence boundary (lce::shift_targets_packed).

    token_ids [N] (int32 / int64) with cu_seqlens [S + 1] (None: one sequence), or [B, T]
    without cu_seqlens (each row a sequence). Returns the targets in token_ids' dtype and shape.
    """
    if token_ids.dim() == 2 and cu_seqlens is None:
        b, t = token_ids.shape
        cu = torch.arange(b + 1, dtype=torch.int64, device=token_ids.device) * t
        return _ops.next_token_targets(token_ids.reshape(-1), cu, ignore_index=int(ignore_index)).reshape(b, t)
    return _ops.next_token_targets(token_ids, cu_seqlens, ignore_index=int(ignore_index))


def sequence_logprobs(logprobs, cu_seqlens=None, *, targets=None, weights=None, ignore_index=-100,
                      length_average=False):
    """Per-sequence sums pi_s = sum_{i in s} w_i logp_i (means with ``length_average``) and
    counted tokens n_s (lce::sequence_logprobs): ``(seq_logprobs [S] float64, seq_tokens [S]
    int64)``. Not differentiable: it serves the reference model's log-probs (DPO's
    ``ref_seq_logprobs``); call it on detached log-probs."""
    layout = _Layout("sequence_logprobs", logprobs, cu_seqlens)
    return _ops.sequence_logprobs(layout.tokens(logprobs, "logprobs"), layout.tokens(targets, "targets"),
                                  layout.cu_seqlens, _weights(layout, weights), ignore_index=int(ignore_index),
                                  length_average=bool(length_average))


def sft_loss(logprobs, targets=None, cu_seqlens=None, *, weights=None, ignore_index=-100, reduction="token_mean",
             label_smoothing=0.0, lse=None, mean_logit=None, normaliser=None, group=None) -> SFTResult:
    """SFT / NLL over packed sequences (lce::sft_loss): ``-(1/normaliser) sum_i w_i logp_i``
    (``reduction="token_mean"``) or each sequence's token mean averaged over sequences
    (``"sequence_mean"``).

    logprobs: from ``linear_logprobs`` (float32 / float64), differentiable. targets: the same
    targets (a token counts when its target is not ``ignore_index`` and its weight is not 0;
    None: every token counts). weights: per-token weights / mask (None: 1).
    label_smoothing: PyTorch's eps; needs ``lse`` and ``mean_logit`` from
    ``linear_logprobs(..., return_lse=True, return_mean_logit=True)`` (both differentiable).
    normaliser: a constant divisor instead of the count; group: a torch.distributed group
    whose ranks each hold a share of the batch: the normaliser is then the global count and
    each rank's loss its share of the global loss (their sum is the one-process loss).
    """
    def prepare():
        require_tensors("sft_loss", logprobs=logprobs, targets=targets, cu_seqlens=cu_seqlens, weights=weights,
                        lse=lse, mean_logit=mean_logit)
        layout = _Layout("sft_loss", logprobs, cu_seqlens)
        dtype = logprobs.dtype
        return (layout.tokens(logprobs, "logprobs"), layout.tokens(targets, "targets"), layout.cu_seqlens,
                _weights(layout, weights), layout.tokens(lse, "lse", dtype),
                layout.tokens(mean_logit, "mean_logit", dtype)), dict(
                    ignore_index=number("sft_loss", "ignore_index", ignore_index, int),
                    reduction=_text("sft_loss", "reduction", reduction),
                    label_smoothing=number("sft_loss", "label_smoothing", label_smoothing),
                    normaliser=_normaliser("sft_loss", normaliser),
                    group_name=group_name_of(group))

    prepared = checked_on_group(group, _EXCHANGE_DEVICE, prepare)
    if isinstance(prepared, Refused):
        return prepared.filled(SFTResult, **_refused_layout(logprobs, cu_seqlens))
    args, kwargs = prepared
    out = _ops.sft_loss(*args, **kwargs)
    loss, metrics = out[0], out[4]
    return SFTResult(loss, metrics[0], metrics[1].to(torch.int64), metrics[2].to(torch.int64), metrics[3])


def dpo_loss(logprobs, cu_seqlens=None, *, ref_seq_logprobs=None, ref_logprobs=None, targets=None, weights=None,
             pairs=None, ignore_index=-100, beta=0.1, sft_coef=0.0, length_average=False, normaliser=None,
             group=None) -> DPOResult:
    """DPO over packed sequences (lce::dpo_loss), with an optional SFT term on the chosen
    sequences (``sft_coef``) and length-averaged log-probs (``length_average``).

    pairs: (chosen, rejected) sequence indices, [P, 2] or flat [c0, r0, c1, r1, ...]
    (None: consecutive sequences (0, 1), (2, 3), ...). With ``length_average`` a sequence
    with no counted token has pi_s = 0. The reference: ``ref_seq_logprobs``
    [S] (its pi_s, same ``length_average``) or ``ref_logprobs`` [N] (its per-token log-probs,
    summed here by ``sequence_logprobs``); exactly one. The normaliser is the number of pairs
    (the global number with ``group``).
    """
    def prepare():
        nonlocal ref_seq_logprobs
        require_tensors("dpo_loss", logprobs=logprobs, cu_seqlens=cu_seqlens, ref_seq_logprobs=ref_seq_logprobs,
                        ref_logprobs=ref_logprobs, targets=targets, weights=weights)
        if (ref_seq_logprobs is None) == (ref_logprobs is None):
            raise ValueError("lce_torch.dpo_loss: pass exactly one of ref_seq_logprobs (per sequence) and "
                             "ref_logprobs (per token)")
        layout = _Layout("dpo_loss", logprobs, cu_seqlens)
        flat_targets = layout.tokens(targets, "targets")
        flat_weights = _weights(layout, weights)
        if ref_logprobs is not None:
            # The reference's per-token log-probs are summed against the policy's targets:
            # checked here, so that a short one is named rather than the targets.
            if tuple(ref_logprobs.shape) != tuple(logprobs.shape):
                raise ValueError(f"lce_torch.dpo_loss: ref_logprobs has shape {shape_tuple(ref_logprobs.shape)}, logprobs "
                                 f"{shape_tuple(logprobs.shape)}")
            ref_seq_logprobs, _ = _ops.sequence_logprobs(
                layout.tokens(ref_logprobs, "ref_logprobs", logprobs.dtype).detach(), flat_targets,
                layout.cu_seqlens, flat_weights, ignore_index=number("dpo_loss", "ignore_index", ignore_index, int),
                length_average=number("dpo_loss", "length_average", length_average, bool))
        pair_list = pairs
        if pair_list is not None:
            # A list (empty included: a rank may hold no pair) is of sequence indices.
            pair_list = pair_list if isinstance(pair_list, torch.Tensor) else torch.as_tensor(pair_list,
                                                                                             dtype=torch.int64)
            if pair_list.numel() != 0 and pair_list.dim() != 1 and (pair_list.dim() != 2 or pair_list.shape[1] != 2):
                raise ValueError(f"lce_torch.dpo_loss: pairs must be [P, 2] (chosen, rejected) sequence indices or "
                                 f"flat [2 P], got shape {shape_tuple(pair_list.shape)}")
            pair_list = pair_list.reshape(-1)
        return (layout.tokens(logprobs, "logprobs"), ref_seq_logprobs.to(torch.float64), flat_targets,
                layout.cu_seqlens, flat_weights, pair_list), dict(
                    ignore_index=number("dpo_loss", "ignore_index", ignore_index, int),
                    beta=number("dpo_loss", "beta", beta), sft_coef=number("dpo_loss", "sft_coef", sft_coef),
                    length_average=number("dpo_loss", "length_average", length_average, bool),
                    normaliser=_normaliser("dpo_loss", normaliser),
                    group_name=group_name_of(group))

    prepared = checked_on_group(group, _EXCHANGE_DEVICE, prepare)
    if isinstance(prepared, Refused):
        return prepared.filled(DPOResult, **_refused_layout(logprobs, cu_seqlens))
    args, kwargs = prepared
    loss, _, seq_logprobs, _, seq_tokens, metrics = _ops.dpo_loss(*args, **kwargs)
    return DPOResult(loss, metrics[0], metrics[1], metrics[2].to(torch.int64), metrics[3], metrics[4], metrics[5],
                     metrics[6], metrics[7], seq_logprobs, seq_tokens)


def policy_gradient_loss(logprobs, advantages, cu_seqlens=None, *, old_logprobs=None, ref_logprobs=None,
                         generation_logprobs=None, entropy=None, targets=None, weights=None, ignore_index=-100,
                         reduction="token_mean", eps_low=0.2, eps_high=0.2, dual_clip=0.0, kl_coef=0.0, kl="k3",
                         tis_cap=0.0, entropy_coef=0.0, sequence_advantages=False, normaliser=None,
                         group=None) -> PolicyGradientResult:
    """Clipped policy gradient, PPO / GRPO / DAPO (lce::policy_gradient_loss).

    Per counted token: ratio r = exp(logp - old_logprobs) (None: on-policy, r = 1),
    ``max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``, the dual clip ``-A dual_clip`` for
    A < 0 (0: off), times the truncated importance weight
    ``min(exp(old - generation_logprobs), tis_cap)`` (0: off), plus ``kl_coef`` times the
    ``kl`` estimator ("k1" / "k3") to ``ref_logprobs``, minus ``entropy_coef`` times
    ``entropy`` (from ``linear_logprobs(..., with_entropy=True)``, differentiable).
    advantages: per token, or per sequence [S] with ``sequence_advantages``. reduction:
    "token_mean" (DAPO) or "sequence_mean" (GRPO); normaliser / group as in ``sft_loss``.
    Gradients flow to logprobs and entropy only.
    """
    def prepare():
        fn = "policy_gradient_loss"
        require_tensors(fn, logprobs=logprobs, advantages=advantages, cu_seqlens=cu_seqlens,
                        old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
                        generation_logprobs=generation_logprobs, entropy=entropy, targets=targets, weights=weights)
        per_sequence = number(fn, "sequence_advantages", sequence_advantages, bool)
        layout = _Layout(fn, logprobs, cu_seqlens)
        dtype = logprobs.dtype
        adv = advantages.to(dtype) if per_sequence else layout.tokens(advantages, "advantages", dtype)
        return (layout.tokens(logprobs, "logprobs"), adv, layout.tokens(old_logprobs, "old_logprobs", dtype),
                layout.tokens(ref_logprobs, "ref_logprobs", dtype),
                layout.tokens(generation_logprobs, "generation_logprobs", dtype),
                layout.tokens(entropy, "entropy", dtype), layout.tokens(targets, "targets"), layout.cu_seqlens,
                _weights(layout, weights)), dict(
                    ignore_index=number(fn, "ignore_index", ignore_index, int),
                    reduction=_text(fn, "reduction", reduction), eps_low=number(fn, "eps_low", eps_low),
                    eps_high=number(fn, "eps_high", eps_high), dual_clip=number(fn, "dual_clip", dual_clip),
                    kl_coef=number(fn, "kl_coef", kl_coef), kl=_text(fn, "kl", kl),
                    tis_cap=number(fn, "tis_cap", tis_cap), entropy_coef=number(fn, "entropy_coef", entropy_coef),
                    sequence_advantages=per_sequence,
                    normaliser=_normaliser(fn, normaliser), group_name=group_name_of(group))

    prepared = checked_on_group(group, _EXCHANGE_DEVICE, prepare)
    if isinstance(prepared, Refused):
        return prepared.filled(PolicyGradientResult, **_refused_layout(logprobs, cu_seqlens))
    args, kwargs = prepared
    loss, _, _, _, m = _ops.policy_gradient_loss(*args, **kwargs)
    return PolicyGradientResult(loss, m[0], m[1], m[2], m[3].to(torch.int64), m[4], m[5], m[6], m[7], m[8], m[9],
                                m[10], m[11])


def distill_loss(student_logprobs, teacher_logprobs, ids, cu_seqlens=None, *, targets=None, weights=None,
                 ignore_index=-100, reduction="token_mean", tail="bucket", normaliser=None,
                 group=None) -> DistillResult:
    """Distillation from a teacher's top-K (lce::distill_loss): the forward
    KL(teacher || student) per token over the teacher's K ids, reduced as ``sft_loss``.

    student_logprobs: the student's log-probs of ``ids`` from
    ``linear_target_set_logprobs(hidden, weight, ids)`` (float32 / float64),
    differentiable; teacher_logprobs: the teacher's log-probs of the same ids (a
    normalised distribution over the whole vocabulary; converted to the student's
    dtype; a constant); ids: the teacher's top-K (int32 / int64, distinct per token: a repeat raises,
    ``ignore_index`` for absent ones). Packed [N, K] with ``cu_seqlens`` [S + 1] (None:
    one sequence), or [B, T, K] without cu_seqlens (each row a sequence).

    tail: "bucket" (the teacher's remaining mass 1 - sum_k p_k against the student's,
    as one more outcome) or "renormalise" (the teacher renormalised over its top-K,
    against the student's full distribution). A token counts when its ``targets`` entry
    (optional, [N] / [B, T]) is not ``ignore_index``, its weight is not 0 and at least one
    of its ids is not ``ignore_index``. reduction ("token_mean" / "sequence_mean"),
    normaliser and group as in ``sft_loss``.
    """
    def prepare():
        nonlocal cu_seqlens
        fn = "distill_loss"
        require_tensors(fn, student_logprobs=student_logprobs, teacher_logprobs=teacher_logprobs, ids=ids,
                        cu_seqlens=cu_seqlens, targets=targets, weights=weights)
        if student_logprobs.dim() == 3:
            if cu_seqlens is not None:
                raise ValueError(f"lce_torch.{fn}: a [B, T, K] student_logprobs ({shape_tuple(student_logprobs.shape)}) takes "
                                 f"no cu_seqlens (its rows are the sequences); pass packed [N, K] tensors instead")
            b, t, k = student_logprobs.shape
            cu_seqlens = torch.arange(b + 1, dtype=torch.int64, device=student_logprobs.device) * t
            per_set = (b * t, k)
            per_token = (b, t)
        elif student_logprobs.dim() == 2:
            per_set = tuple(student_logprobs.shape)
            per_token = None
        else:
            raise ValueError(f"lce_torch.{fn}: student_logprobs must be packed [N, K] (with cu_seqlens) or [B, T, K], "
                             f"got shape {shape_tuple(student_logprobs.shape)}")

        def sets(x, name, dtype=None):
            if per_token is not None:
                if x.dim() != 3 or tuple(x.shape[:2]) != per_token:
                    raise ValueError(f"lce_torch.{fn}: {name} has shape {shape_tuple(x.shape)}, student_logprobs "
                                     f"{shape_tuple(student_logprobs.shape)}")
                x = x.reshape(per_set)
            return x if dtype is None else x.to(dtype)

        def tokens(x, name, dtype=None):
            if x is None:
                return None
            if per_token is not None:
                if tuple(x.shape) != per_token:
                    raise ValueError(f"lce_torch.{fn}: {name} has shape {shape_tuple(x.shape)}, expected {shape_tuple(per_token)}")
                x = x.reshape(-1)
            return x if dtype is None else x.to(dtype)

        id_sets = sets(ids, "ids")
        return (sets(student_logprobs, "student_logprobs"),
                sets(teacher_logprobs, "teacher_logprobs", student_logprobs.dtype), id_sets,
                tokens(targets, "targets"), cu_seqlens, tokens(weights, "weights", torch.float32)), dict(
                    ignore_index=number(fn, "ignore_index", ignore_index, int),
                    reduction=_text(fn, "reduction", reduction), tail=_text(fn, "tail", tail),
                    normaliser=_normaliser(fn, normaliser), group_name=group_name_of(group))

    prepared = checked_on_group(group, _EXCHANGE_DEVICE, prepare)
    if isinstance(prepared, Refused):
        return prepared.filled(DistillResult, **_refused_layout(student_logprobs, cu_seqlens, 3))
    args, kwargs = prepared
    loss, _, seq_kl, seq_tokens, m = _ops.distill_loss(*args, **kwargs)
    return DistillResult(loss, m[0], m[1], m[2], m[3].to(torch.int64), m[4], seq_kl, seq_tokens)
