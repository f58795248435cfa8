"""lce_torch: lce's chunked hidden -> log-probabilities operator in PyTorch.

    import lce_torch
    logp = lce_torch.linear_logprobs(hidden, weight, targets)           # [...], differentiable
    loss = lce_torch.linear_cross_entropy(hidden, weight, targets)      # = F.cross_entropy(F.linear(h, w), y)
    logp_k = lce_torch.linear_target_set_logprobs(hidden, weight, ids)  # ids [..., K] -> [..., K]

Neither materialises the [tokens, vocab] logits: lce computes them a chunk of
tokens at a time (at most ``workspace_limit_bytes`` of scratch, 256 MiB by
default, and on the CPU at most 512 tokens a chunk, which run as fast as more; a
call longer than that takes at most an eighth of its tokens a chunk, down to 192).
Tensor parallel (vocabulary-sharded weight): pass ``group=`` (a
torch.distributed ProcessGroup: gloo on the CPU, NCCL or gloo on CUDA) and this rank's
``vocab_start``, or a weight that is a DTensor sharded by rows (``Shard(0)``, as
PyTorch's ``ColwiseParallel`` holds an LM head), which carries both.

Training losses over packed sequences (lce's include/lce/loss, one call each, on the
log-probs above; autograd continues into lce's backward):

    targets = lce_torch.next_token_targets(token_ids, cu_seqlens)
    out = lce_torch.sft_loss(logp, targets, cu_seqlens)                 # .loss, .tokens, ...
    out = lce_torch.dpo_loss(logp, cu_seqlens, ref_logprobs=ref_logp, targets=targets, beta=0.1)
    out = lce_torch.policy_gradient_loss(logp, adv, cu_seqlens, old_logprobs=old, targets=targets)
    out = lce_torch.distill_loss(logp_k, teacher_logp_k, ids, cu_seqlens)  # KL(teacher || student), top-K

The operators are ``torch.ops.lce.logprobs``, ``torch.ops.lce.logprobs_backward``,
``torch.ops.lce.logprobs_forward_backward``, ``torch.ops.lce.target_set_logprobs`` and
``torch.ops.lce.target_set_logprobs_backward`` (CPU kernels, and CUDA kernels where
``built_with_cuda()``; fake kernels and autograd registered, so
torch.compile(fullgraph=True) traces them).
"""
import zlib

import torch

from . import _ops  # noqa: F401  (registers fake kernels and autograd)
from ._dtensor import local_head, local_replicated
from ._ops import (Refused, check_shapes, checked_on_group, device_of, group_name_of, number, refuse_create_graph,
                   refuse_forward_ad, require_tensors, result_dtype, shape_list)
from ._losses import (
    DistillResult,
    DPOResult,
    PolicyGradientResult,
    SFTResult,
    distill_loss,
    dpo_loss,
    next_token_targets,
    policy_gradient_loss,
    sequence_logprobs,
    sft_loss,
)

__all__ = [
    "linear_logprobs",
    "linear_target_set_logprobs",
    "linear_cross_entropy",
    "shard_vocab_start",
    "blas_info",
    "set_keep_workspace",
    "set_bf16_gemm",
    "built_with_cuda",
    "next_token_targets",
    "sequence_logprobs",
    "sft_loss",
    "dpo_loss",
    "policy_gradient_loss",
    "distill_loss",
    "SFTResult",
    "DPOResult",
    "PolicyGradientResult",
    "DistillResult",
]

_DEFAULT_WORKSPACE = 256 << 20
_DEFAULT_LOGITS_SHARE = 0.1  # lce::options::max_logits_share


def _options(fn, vocab_start, ignore_index, temperature, softcap, sequence_parallel, chunk_tokens,
             workspace_limit_bytes, group, max_logits_share=_DEFAULT_LOGITS_SHARE):
    return dict(
        vocab_start=number(fn, "vocab_start", vocab_start, int),
        ignore_index=number(fn, "ignore_index", ignore_index, int),
        temperature=number(fn, "temperature", temperature),
        softcap=number(fn, "softcap", softcap),
        sequence_parallel=number(fn, "sequence_parallel", sequence_parallel, bool),
        chunk_tokens=number(fn, "chunk_tokens", chunk_tokens, int),
        workspace_limit_bytes=number(fn, "workspace_limit_bytes", workspace_limit_bytes, int),
        max_logits_share=number(fn, "max_logits_share", max_logits_share),
        group_name=group_name_of(group),
    )


def _head_call(fn, op, hidden, weight, ids_name, ids, bias, group, option_values, with_entropy, return_lse,
               return_mean_logit, head_checks):
    # The option conversions and type checks run inside the checks the group's ranks share.
    def prepare():
        refuse_forward_ad(fn, hidden, weight, bias)
        head_checks.check_shard()
        require_tensors(fn, hidden=hidden, weight=weight, **{ids_name: ids}, bias=bias)
        opts = _options(fn, *option_values, group)
        flags = tuple(number(fn, name, value, bool) for name, value in (
            ("with_entropy", with_entropy), ("return_lse", return_lse), ("return_mean_logit", return_mean_logit)))
        if group is not None:
            opts["caller_settings"] = fn  # so that a rank in another wrapper of the same op says so
            if torch.compiler.is_compiling():  # (eager: the kernel's own checks, in its exchange)
                check_shapes(hidden, weight, ids, bias, opts["sequence_parallel"], sets=ids_name == "ids")
        return opts, flags

    prepared = checked_on_group(group, device_of(hidden, weight), prepare, anchor=hidden)
    if isinstance(prepared, Refused):
        # Shaped and typed as the op's results, so that the caller's code after it traces
        # (as many as the flags ask for; a flag that is a tensor, itself refused, as False).
        dtype = result_dtype(hidden.dtype) if isinstance(hidden, torch.Tensor) else torch.float32
        logp = prepared.like(ids, dtype)
        sets = ids_name == "ids" and isinstance(ids, torch.Tensor) and ids.dim() >= 1
        per_token = prepared.like(ids[..., 0], dtype) if sets else logp
        flags = [not isinstance(flag, torch.Tensor) and bool(flag) for flag in (with_entropy, return_lse,
                                                                               return_mean_logit)]
        out = (logp,) + (per_token,) * sum(flags)
        return out[0] if len(out) == 1 else out
    opts, (with_entropy, return_lse, return_mean_logit) = prepared
    ids = head_checks.agreed_ids(ids, opts)
    logp, lse, ent, mean = op(hidden, weight, ids, bias, with_entropy=with_entropy,
                              with_mean_logit=return_mean_logit, **opts)
    out = (logp,)
    if with_entropy:
        out += (ent,)
    if return_lse:
        out += (lse,)
    if return_mean_logit:
        out += (mean,)
    return out[0] if len(out) == 1 else out


def linear_logprobs(hidden, weight, targets, *, bias=None, vocab_start=0, ignore_index=-100, temperature=1.0,
                    softcap=0.0, with_entropy=False, return_lse=False, return_mean_logit=False, group=None,
                    sequence_parallel=False, chunk_tokens=0, workspace_limit_bytes=_DEFAULT_WORKSPACE):
    """Per-token log p(targets | hidden) under the LM head ``weight``, without the logits.

    hidden [..., H] (float32, bfloat16, float16, float64), weight [V_local, H] (same
    dtype), targets [...] (int32 / int64 global ids, or ``ignore_index``: log-prob 0).
    Logits are ``softcap * tanh(s / softcap) / temperature`` (softcap 0: none) of the raw
    logits ``s = hidden @ weight.T + bias`` (``F.linear(hidden, weight, bias)``; ``bias``
    [V_local], weight's dtype, optional and differentiable; a bias of ``-inf`` masks its
    column: probability 0, no gradient, the entropy that of the other columns).

    Returns ``logprobs`` [...] (float32; float64 for float64 inputs), or the tuple
    ``(logprobs, entropy)`` with ``with_entropy``, with ``lse`` appended when
    ``return_lse`` and the mean logit over the vocabulary when ``return_mean_logit``
    (label smoothing: ``sft_loss(..., lse=, mean_logit=)``). All are differentiable with
    respect to hidden and weight (a z-loss ``lam * (lse**2).mean()`` backpropagates
    through lce's backward, ignored tokens included: their log-prob and entropy are 0,
    their lse is real).

    group: a torch.distributed ProcessGroup (or its name) holding the other vocabulary
    shards; this rank's shard covers ids [vocab_start, vocab_start + V_local) (see
    ``shard_vocab_start``). Every rank passes the same hidden and targets (unless
    ``sequence_parallel``: its own rows of hidden, all targets); the hidden gradient
    is summed over the group (the same on every rank).
    """
    hidden, weight, bias, group, vocab_start, sequence_parallel, head_checks = local_head(
        "linear_logprobs", hidden, weight, bias, group, vocab_start, sequence_parallel)
    targets = local_replicated("linear_logprobs", "targets", targets)
    return _head_call("linear_logprobs", torch.ops.lce.logprobs, hidden, weight, "targets", targets, bias, group,
                      (vocab_start, ignore_index, temperature, softcap, sequence_parallel, chunk_tokens,
                       workspace_limit_bytes), with_entropy, return_lse, return_mean_logit, head_checks)


def linear_target_set_logprobs(hidden, weight, ids, *, bias=None, vocab_start=0, ignore_index=-100,
                               temperature=1.0, softcap=0.0, with_entropy=False, return_lse=False,
                               return_mean_logit=False, group=None, sequence_parallel=False, chunk_tokens=0,
                               workspace_limit_bytes=_DEFAULT_WORKSPACE):
    """Log-probs of K ids per token (a target set: e.g. a teacher's top-K), without the logits.

    hidden [..., H], weight [V_local, H], bias as in ``linear_logprobs``; ``ids`` [..., K]
    (int32 / int64 global ids; the last dimension is the set, the leading ones the
    tokens). Returns ``logprobs`` [..., K] =
    ``log_softmax(logits).gather(-1, ids)`` (float32; float64 for float64 inputs), 0 where
    an id is ``ignore_index``; a token whose K ids are all ignored is an ignored token
    (entropy and mean logit 0 there, its lse real). ``with_entropy`` / ``return_lse`` /
    ``return_mean_logit`` append the per-token [...] row terms as ``linear_logprobs`` does.
    Differentiable with respect to hidden, weight and bias (lce's target-set backward: one
    sweep, any gradient over the K log-probs). The ids of a token should be distinct
    (``distill_loss`` requires it).

    group / vocab_start / sequence_parallel: tensor parallel as in ``linear_logprobs``
    (each rank its shard of the vocabulary; every rank the same ids).
    Contiguous ids and hidden are used in place (no copy).
    """
    hidden, weight, bias, group, vocab_start, sequence_parallel, head_checks = local_head(
        "linear_target_set_logprobs", hidden, weight, bias, group, vocab_start, sequence_parallel)
    ids = local_replicated("linear_target_set_logprobs", "ids", ids)
    return _head_call("linear_target_set_logprobs", torch.ops.lce.target_set_logprobs, hidden, weight, "ids", ids,
                      bias, group, (vocab_start, ignore_index, temperature, softcap, sequence_parallel,
                                    chunk_tokens, workspace_limit_bytes), with_entropy, return_lse, return_mean_logit,
                      head_checks)


def _check_class_weight(class_weight, linear_weight, vocab_start, group):
    # PyTorch's rule, one weight per class: [V]. With a group every rank scores every token,
    # so it too needs the whole vocabulary's weights: at least up to this shard's end here,
    # and the same weights on every rank (their fingerprints are compared) and a weight for
    # every target (_check_targets_weighted).
    shard_end = int(vocab_start) + linear_weight.shape[0]
    if group is None:
        ok, want = class_weight.dim() == 1 and class_weight.shape[0] == shard_end, f"[V] = [{int(shard_end)}]"
    else:
        ok, want = class_weight.dim() == 1 and class_weight.shape[0] >= shard_end, \
            f"[V] (the whole vocabulary, the same on every rank: at least {int(shard_end)} here)"
    if not ok:
        raise ValueError(f"lce_torch.linear_cross_entropy: weight (class weights) must be {want}, one per class, "
                         f"got {shape_list(class_weight.shape)}")
    if not class_weight.is_floating_point():
        raise TypeError(f"lce_torch.linear_cross_entropy: weight (class weights) must be floating point, got "
                        f"{class_weight.dtype}")
    if class_weight.device != linear_weight.device:
        raise ValueError(f"lce_torch.linear_cross_entropy: weight (class weights) must be on {linear_weight.device} "
                         f"with linear_weight, got {class_weight.device}")


def _counted(targets, ignore_index):
    # targets != ignore_index. A tensor compared with an int wraps the int to the tensor's dtype
    # (int32 targets and 2**32 + 5 would match id 5); one outside the targets' range matches none.
    # (Targets of another dtype reach lce's own check, which names the dtypes it takes.)
    if targets.dtype in (torch.int32, torch.int64):
        info = torch.iinfo(targets.dtype)
        if not info.min <= ignore_index <= info.max:
            return torch.ones_like(targets, dtype=torch.bool)
    return targets != ignore_index


def _check_targets_weighted(targets, class_weight, ignore_index):
    if class_weight is None or torch.compiler.is_compiling():
        return
    valid = _counted(targets, ignore_index)
    outside = valid & ((targets < 0) | (targets >= class_weight.shape[0]))
    if bool(outside.any()):
        bad = targets[outside][0].item()
        raise ValueError(f"lce_torch.linear_cross_entropy: target {bad} has no class weight: weight has "
                         f"{class_weight.shape[0]} classes (and ignore_index is {ignore_index})")


def _class_weight_fingerprint(class_weight):
    # Its bytes' CRC: equal weights give equal text on every rank, whatever its threads.
    # (Traced by torch.compile, its dtype and shape alone: a trace cannot read the values,
    # which _class_weights_agreed compares when the graph runs.)
    if class_weight is None:
        return "none"
    described = f"{class_weight.dtype} {shape_list(class_weight.shape)}"
    if torch.compiler.is_compiling():
        return described
    data = class_weight.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
    return f"{described} crc32 {zlib.crc32(data):08x}"


def _class_weights_agreed(class_weight, input, opts):
    """Inside torch.compile with a group: lce.agree_on_values compares the class weights'
    bytes across the ranks when the graph runs (every rank raises where they differ) and
    returns a zero, which the caller adds to the token weights so that the graph keeps the
    op. None elsewhere (eager mode compares their CRC in the op's caller_settings)."""
    if opts.get("group_name") is None or not torch.compiler.is_compiling():
        return None
    if class_weight is None:
        values, what = input.new_empty((0,)).detach(), "linear_cross_entropy's class weights (none)"
    else:
        values = class_weight.detach()
        what = f"linear_cross_entropy's class weights ({class_weight.dtype} {shape_list(class_weight.shape)})"
    return torch.ops.lce.agree_on_values(values, opts["group_name"], what)


def _token_weights(targets, class_weight, ignore_index, dtype, agreed=None):
    valid = _counted(targets, ignore_index)
    if class_weight is None:
        w = valid.to(dtype)
    else:
        # Clamped, so that a target without a class weight reaches lce's own check (which names
        # it) where _check_targets_weighted cannot run (torch.compile), not an out-of-bounds gather.
        safe = torch.where(valid, targets, torch.zeros_like(targets)).long().clamp(0, class_weight.shape[0] - 1)
        w = torch.where(valid, class_weight.to(dtype)[safe], torch.zeros((), dtype=dtype, device=targets.device))
    # agreed: _class_weights_agreed's zero, added so that its op stays in the graph.
    return w if agreed is None else w + agreed.to(dtype)


_NO_CLASS_WEIGHT_GRADIENT = (
    "lce_torch.linear_cross_entropy: no gradient for weight (the class weights) in the one-sweep path, as in "
    "F.cross_entropy: pass them detached, or fused=False to differentiate them")


class _FusedCrossEntropy(torch.autograd.Function):
    """Mean / sum cross-entropy in one lce sweep (forward_backward: 3 GEMMs per chunk
    instead of 4): dL/dlogp (and, with label smoothing, dL/dlse and dL/dmean_logit) is
    known before the forward, so the gradients are computed in the forward and scaled by
    the incoming (scalar) gradient in the backward.

    Per counted token i with weight c_i = w_i / denom, the loss is
    c_i ((1 - eps) (-logp_i) + eps (lse_i - mean_logit_i)) (PyTorch's label smoothing:
    eps / V times -sum_v log p_v = eps (lse - mean logit))."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, class_weight, reduction, label_smoothing, opts, agreed):
        rdt = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        w = _token_weights(targets, class_weight, opts["ignore_index"], rdt, agreed)
        denom = w.sum() if reduction == "mean" else torch.ones((), dtype=rdt)
        c = w / denom
        if label_smoothing == 0.0:
            grad = -c
            logp, grad_hidden, grad_weight, _, _, grad_bias = torch.ops.lce.logprobs_forward_backward(
                hidden, weight, targets, grad, bias=bias, **opts)
            loss = (grad * logp).sum()
        else:
            eps = float(label_smoothing)
            grad, grad_lse, grad_mean = -(1.0 - eps) * c, eps * c, -eps * c
            logp, grad_hidden, grad_weight, lse, mean, grad_bias = torch.ops.lce.logprobs_forward_backward(
                hidden, weight, targets, grad, grad_lse, grad_mean, bias, with_mean_logit=True, **opts)
            loss = (grad * logp + grad_lse * lse + grad_mean * mean).sum()
        if reduction == "mean":
            # No tokens at all: the sum above is 0, where the mean over none is 0 / 0 (PyTorch's NaN).
            loss = torch.where(denom == 0, torch.full_like(loss, float("nan")), loss)
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        return loss.to(hidden.dtype)

    @staticmethod
    def backward(ctx, grad_loss):
        # The gradients were made in the forward, outside autograd: a backward that would
        # differentiate them again (create_graph=True) raises rather than handing out
        # gradients whose own gradient is silently 0.
        refuse_create_graph("lce_torch: linear_cross_entropy's one-sweep gradients are not differentiable themselves "
                            "(no double backward, create_graph=True)")
        if ctx.needs_input_grad[4]:
            raise NotImplementedError(_NO_CLASS_WEIGHT_GRADIENT)
        try:
            grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        except RuntimeError as e:
            if "modified by an inplace operation" not in str(e):
                raise
            raise RuntimeError(
                "lce_torch.linear_cross_entropy: a gradient that an earlier backward of this loss returned "
                "(retain_graph=True) was modified in place: the one-sweep path hands out its stored gradients "
                "as they are (no copy of [V, H]); clone a gradient before changing it in place, or pass "
                "fused=False") from e
        g = grad_loss.to(torch.float64 if grad_hidden.dtype == torch.float64 else torch.float32)
        if not torch.compiler.is_compiling() and bool(g == 1):
            # loss.backward(): the stored gradients as they are, no second [V, H] buffer
            # (autograd takes them over as .grad once the graph is freed).
            dx, dw, db = grad_hidden, grad_weight, grad_bias
        else:
            dx = (grad_hidden * g).to(grad_hidden.dtype)
            dw = (grad_weight * g).to(grad_weight.dtype)
            db = (grad_bias * g).to(grad_bias.dtype)
        return (dx if ctx.needs_input_grad[0] else None, dw if ctx.needs_input_grad[1] else None,
                db if ctx.needs_input_grad[2] else None, None, None, None, None, None, None)


def linear_cross_entropy(input, linear_weight, target, *, linear_bias=None, weight=None, reduction="mean",
                         ignore_index=-100, label_smoothing=0.0, temperature=1.0, softcap=0.0, group=None,
                         vocab_start=0, sequence_parallel=False, chunk_tokens=0,
                         workspace_limit_bytes=_DEFAULT_WORKSPACE, max_logits_share=_DEFAULT_LOGITS_SHARE,
                         fused=True):
    """``F.cross_entropy(F.linear(input, linear_weight), target, ...)`` without the logits.

    The arguments follow ``torch.nn.functional.linear_cross_entropy``: ``weight`` is the
    optional per-class rescaling weight [V] (the full vocabulary), ``reduction`` is
    "mean" (weighted by ``weight``, over targets other than ``ignore_index``), "sum" or
    "none" (per token, 0 where ignored), in the dtype of ``input``.
    ``label_smoothing`` (eps in [0, 1]) is PyTorch's: each counted token's loss is
    (1 - eps) (-log p_y) + eps (lse - mean logit), from lce's mean logit over the whole
    vocabulary (of the logits after ``softcap`` and ``temperature``), still one sweep.
    ``label_smoothing`` together with ``weight`` raises NotImplementedError (PyTorch then
    weights the smoothing term by class, sum_v w_v log p_v, which lce does not compute).
    ``linear_bias`` [V_local] is the head's bias (``F.linear(input, linear_weight,
    linear_bias)``, differentiable; a bias of ``-inf`` masks its column).

    "mean" and "sum" with gradients enabled run lce's one-sweep forward_backward
    (``fused=True``): the gradients are computed in the forward and scaled in the
    backward. Otherwise the forward alone runs, and the backward (if any) is a second
    sweep. ``group`` / ``vocab_start``: tensor parallel, as in ``linear_logprobs``.
    ``max_logits_share`` (0 to 1, default 0.1): the most memory the one-sweep path may hold
    to compute each logit once (three GEMMs) where its budget alone would compute most of
    them twice, as a share of the call's fp32 [N, V] logits (within
    ``workspace_limit_bytes``; one process, bf16 or fp16: lce's dW sum in fp32). A larger
    share trades memory for speed: e.g. 0.35 at H 1,024, V 32,000, N 3,072–4,096.
    """
    if ignore_index is None:
        ignore_index = -100
    input, linear_weight, linear_bias, group, vocab_start, sequence_parallel, head_checks = local_head(
        "linear_cross_entropy", input, linear_weight, linear_bias, group, vocab_start, sequence_parallel)
    weight = local_replicated("linear_cross_entropy", "weight (class weights)", weight)
    target = local_replicated("linear_cross_entropy", "target", target)

    def check():
        refuse_forward_ad("linear_cross_entropy", input, linear_weight, linear_bias)
        head_checks.check_shard()
        require_tensors("linear_cross_entropy", input=input, linear_weight=linear_weight, target=target,
                        linear_bias=linear_bias, weight=weight)
        opts = _options("linear_cross_entropy", vocab_start, ignore_index, temperature, softcap, sequence_parallel,
                        chunk_tokens, workspace_limit_bytes, group, max_logits_share)
        smoothing = number("linear_cross_entropy", "label_smoothing", label_smoothing)
        one_sweep = number("linear_cross_entropy", "fused", fused, bool)
        if not 0.0 <= smoothing <= 1.0:
            raise ValueError(f"lce_torch.linear_cross_entropy: label_smoothing must be between 0.0 and 1.0, got "
                             f"{smoothing}")
        if smoothing != 0.0 and weight is not None:
            raise NotImplementedError(
                "lce_torch.linear_cross_entropy: label_smoothing together with weight (class weights) is not "
                "supported: PyTorch weights the smoothing term by class (sum_v weight[v] log p_v), which lce does "
                "not compute")
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"lce_torch.linear_cross_entropy: reduction must be 'mean', 'sum' or 'none', got "
                             f"{reduction!r}")
        if weight is not None:
            _check_class_weight(weight, linear_weight, vocab_start, group)
            _check_targets_weighted(target, weight, opts["ignore_index"])
        if group is not None and torch.compiler.is_compiling():
            check_shapes(input, linear_weight, target, linear_bias, opts["sequence_parallel"])
            # torch.compile traces the backward too, whose refusal would be this rank's alone.
            if (weight is not None and weight.requires_grad and one_sweep and reduction != "none" and
                    torch.is_grad_enabled()):
                raise NotImplementedError(_NO_CLASS_WEIGHT_GRADIENT)
        if group is not None:
            # What the ranks' shares of one loss must agree on beyond lce's own call (which
            # compares the shapes, options and targets): how the loss is made from the
            # log-probs. The op's exchange compares it, inside torch.compile too.
            opts["caller_settings"] = (f"linear_cross_entropy(reduction={reduction!r}, label_smoothing={smoothing!r}, "
                                       f"fused={one_sweep}, weight {_class_weight_fingerprint(weight)})")
        return smoothing, opts, one_sweep

    prepared = checked_on_group(group, device_of(input, linear_weight), check, anchor=input)
    if isinstance(prepared, Refused):
        dtype = input.dtype if isinstance(input, torch.Tensor) else None
        return prepared.like(target, dtype) if reduction == "none" else prepared.like(None, dtype)
    label_smoothing, opts, fused = prepared
    target = head_checks.agreed_ids(target, opts)
    agreed = _class_weights_agreed(weight, input, opts)
    needs_grad = torch.is_grad_enabled() and (input.requires_grad or linear_weight.requires_grad or
                                              (linear_bias is not None and linear_bias.requires_grad))
    if reduction != "none" and fused and needs_grad:
        return _FusedCrossEntropy.apply(input, linear_weight, linear_bias, target, weight, reduction, label_smoothing,
                                        opts, agreed)
    smoothing = label_smoothing != 0.0
    logp, lse, _, mean = torch.ops.lce.logprobs(input, linear_weight, target, linear_bias, with_entropy=False,
                                                with_mean_logit=smoothing, **opts)
    w = _token_weights(target, weight, opts["ignore_index"], logp.dtype, agreed)
    if smoothing:
        nll = w * ((label_smoothing - 1.0) * logp + label_smoothing * (lse - mean))
    else:
        nll = -(logp * w)
    if reduction == "none":
        return nll.to(input.dtype)
    if reduction == "sum":
        return nll.sum().to(input.dtype)
    return (nll.sum() / w.sum()).to(input.dtype)


def shard_vocab_start(group, vocab_local):
    """The first global id of this rank's shard when every rank of ``group`` holds
    ``vocab_local`` rows (any sizes), in rank order: one all-gather; call it once.
    ``group``: a ProcessGroup or its name, as lce's ``group=``; None is torch.distributed's
    default group (the world), as in torch.distributed's own calls."""
    import torch.distributed as dist

    if isinstance(group, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        group = _resolve_process_group(group)
    elif group is not None:
        group_name_of(group)  # a rank outside the group (new_group's NON_GROUP_MEMBER) gets lce's message
    sizes = [None] * dist.get_world_size(group)
    dist.all_gather_object(sizes, int(vocab_local), group=group)
    return sum(sizes[: dist.get_rank(group)])


def blas_info():
    """One line on the BLAS lce runs on: library, version, kernels, threads, CPU (lce::blas_info)."""
    return torch.ops.lce.blas_info()


def built_with_cuda():
    """Whether this lce_torch has CUDA kernels (lce's CUDA backend): built where a CUDA build
    of torch met the CUDA toolkit (see setup.py). Without them, CUDA tensors raise
    NotImplementedError saying so."""
    return bool(torch.ops.lce.built_with_cuda())


def set_bf16_gemm(kernel):
    """Choose the bf16 x bf16 -> fp32 GEMM of bfloat16 operators on the CPU, between calls:
    "amx" (lce's own kernel on AMX tiles, the default on CPUs with AMX), "avx512bf16" (lce's
    own kernel on AVX512-BF16, the default on other CPUs with it: AMD Zen 4 and later, Intel
    Cooper Lake), "mkl" (MKL's cblas_gemm_bf16bf16f32 from libtorch_cpu), "widen" (the weight widened to fp32 for the BLAS, dz kept in
    fp32: the default on CPUs without bf16 instructions, where MKL's emulation is slower) or "auto" (the default). Returns the
    one that now runs: a choice this machine cannot run falls to the default. Other names
    raise ValueError. LCE_TORCH_BF16_GEMM sets the first choice."""
    return torch.ops.lce.set_bf16_gemm(kernel)


def set_keep_workspace(keep):
    """Keep each cached operator's scratch between calls (lce's own default) instead of
    returning it after every call (this package's default)."""
    torch.ops.lce.set_keep_workspace(bool(keep))
