"""Fake (meta) kernels and autograd of the lce:: torch operators.

The operators themselves are defined in C++ (csrc/register.cpp, TORCH_LIBRARY
namespace ``lce``); importing ``lce_torch._C`` registers them with their CPU
kernels. This module adds what torch.compile and autograd need:

* ``torch.library.register_fake``: shapes and dtypes of every output, so that
  ``torch.compile(fullgraph=True)`` traces through the ops without graph breaks;
* ``torch.library.register_autograd`` for ``lce::logprobs``: the gradient of
  ``logprobs``, ``lse``, ``entropy`` and ``mean_logit`` with respect to ``hidden``,
  ``weight`` and the optional ``bias`` is the ``lce::logprobs_backward`` op (lce's row-term backward:
  dL/dlse serves a z-loss, dL/dmean_logit label smoothing); the two gradient
  ops raise a clear error if differentiated again. ``lce::target_set_logprobs``
  (ids [..., K], log-probs [..., K]) likewise, through
  ``lce::target_set_logprobs_backward``.
"""
import torch

from . import _C  # noqa: F401  (loads the library: registers torch.ops.lce.*)

_ops = torch.ops.lce

OPTION_NAMES = (
    "vocab_start",
    "ignore_index",
    "temperature",
    "softcap",
    "sequence_parallel",
    "chunk_tokens",
    "workspace_limit_bytes",
    "max_logits_share",
    "group_name",
    "caller_settings",
)


def refuse_forward_ad(fn, *tensors):
    """Raises where a tensor carries a forward-mode tangent (torch.func.jvp, jacfwd,
    torch.autograd.forward_ad): lce's ops have no forward-mode rule, and PyTorch would drop
    the tangent of a custom op without one silently (a Jacobian of zeros)."""
    if torch.compiler.is_compiling():
        return
    for t in tensors:
        if isinstance(t, torch.Tensor) and torch.autograd.forward_ad.unpack_dual(t).tangent is not None:
            raise NotImplementedError(
                f"lce_torch.{fn}: no forward-mode AD (torch.func.jvp, jacfwd, torch.autograd.forward_ad); use "
                f"reverse mode (backward(), torch.autograd.grad, torch.autograd.functional.jacobian)")


def refuse_create_graph(message):
    """Raises NotImplementedError(message) in a backward asked to build its own graph
    (create_graph=True) whose gradients lce made in the forward: to autograd they are
    constants, so a second derivative through them would come out as 0."""
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        raise NotImplementedError(message)


def group_name_of(group):
    """The name lce's ops take for ``group``: a ProcessGroup's ``group_name``, a name as it is,
    None for no group."""
    if group is None:
        return None
    if isinstance(group, str):
        return group
    name = getattr(group, "group_name", None)
    if isinstance(name, str):
        return name
    outside = ""
    if torch.distributed.is_available() and group == torch.distributed.GroupMember.NON_GROUP_MEMBER:
        outside = (" (what torch.distributed.new_group returns to a rank outside the group: only the group's "
                   "ranks call lce with it)")
    raise TypeError(f"lce_torch: group must be a torch.distributed ProcessGroup or its name, got {group!r}{outside}")


def device_of(*candidates):
    """The device of the first tensor among ``candidates`` (the CPU where there is none): the
    one whose process-group backend carries an exchange of verdicts."""
    for t in candidates:
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


def require_tensors(fn, **arguments):
    """Raises TypeError naming an argument that is neither a tensor nor None: here, inside a
    rank's checks, rather than in the dispatcher's schema check after the ranks' exchange."""
    for name, value in arguments.items():
        if value is not None and not isinstance(value, torch.Tensor):
            raise TypeError(f"lce_torch.{fn}: {name} must be a torch.Tensor, got {type(value).__name__}")


def number(fn, name, value, kind=float):
    """``kind(value)`` for an option that is a number (float, int or bool). Inside
    torch.compile a tensor there cannot be read while tracing: the trace would fail on this
    rank alone (and with a group leave the others waiting), so it raises TypeError here,
    which ``checked_on_group`` puts in the graph."""
    if isinstance(value, torch.Tensor) and torch.compiler.is_compiling():
        raise TypeError(f"lce_torch.{fn}: {name} must be a Python {kind.__name__} inside torch.compile, got a "
                        f"Tensor (a trace cannot read its value)")
    return kind(value)


class Refused:
    """What ``checked_on_group`` returns in place of ``prepare()``'s value where, inside
    torch.compile, this rank's checks raised: ``token`` is the output of lce.refuse_on_group,
    which, when the compiled graph runs, meets the other ranks' exchange and raises this
    rank's error (the others raise "rank r rejected its arguments"). A wrapper returns
    ``token``, or ``like(...)`` of it, in place of its results, so that the graph keeps it."""

    def __init__(self, token):
        self.token = token

    def like(self, tensor, dtype=None):
        """``token`` shaped like ``tensor`` (where it is one), in ``dtype``."""
        shaped = self.token.expand(tensor.shape) if isinstance(tensor, torch.Tensor) else self.token
        return shaped if dtype is None else shaped.to(dtype)

    _COUNT_FIELDS = frozenset({"tokens", "sequences", "pairs", "seq_tokens"})

    def filled(self, result_type, sequences=None, loss_dtype=None):
        """A loss's NamedTuple result of ``token``s typed as the loss's fields: ``loss`` in
        ``loss_dtype``, counts int64, the rest float64; the per-sequence fields (``seq_*``)
        of ``sequences`` elements where the refused call's layout tells how many."""
        def field(name):
            # Each a tensor of its own (the caller may write into one), none a view.
            if name == "loss":
                dtype = self.token.dtype if loss_dtype is None else loss_dtype
            else:
                dtype = torch.int64 if name in self._COUNT_FIELDS else torch.float64
            value = self.token.to(dtype, copy=True)
            return value.expand(sequences).contiguous() if name.startswith("seq_") and sequences is not None else value

        return result_type(*(field(name) for name in result_type._fields))


def checked_on_group(group, device, prepare, anchor=None):
    """Runs ``prepare()``, this rank's Python-side checks and conversions (no collective), and
    returns what it returns. With a group, every rank must learn of a check that raises
    here, or the others would wait in the op's exchange: outside torch.compile
    lce.agree_on_group takes this rank's part in it (ok False), then its own error raises;
    inside, where nothing can be exchanged while tracing, the error is put in the graph
    (lce.refuse_on_group, on ``anchor``'s device: a tensor argument) and a ``Refused`` is
    returned, so that every rank raises when the compiled graph runs. So every conversion
    of an argument (int(), float(), a tensor's attributes) belongs in ``prepare``.
    (Settings the ranks must share beyond lce's own call go to the op as its
    ``caller_settings``, compared in the op's exchange, inside torch.compile too.)"""
    if group is None:
        return prepare()
    name = group_name_of(group)
    if torch.compiler.is_compiling():
        # One except clause per type: the op raises the same Python type when the graph runs.
        try:
            return prepare()
        except ValueError as e:
            error, kind = str(e), "ValueError"
        except TypeError as e:
            error, kind = str(e), "TypeError"
        except NotImplementedError as e:
            error, kind = str(e), "NotImplementedError"
        except Exception as e:  # noqa: BLE001  (RuntimeError, and any other: raised as RuntimeError)
            error, kind = str(e), "RuntimeError"
        if not isinstance(anchor, torch.Tensor):
            anchor = torch.empty((0,), device=device)
        return Refused(torch.ops.lce.refuse_on_group(anchor.detach(), name, error, kind))
    try:
        return prepare()
    except Exception:
        try:
            torch.ops.lce.agree_on_group(name, device, False)
        except Exception:  # the group itself failing: this rank's own error says more
            pass
        raise


def _sizes_text(shape):
    # Sizes as int() joined by f-strings: under dynamic shapes Dynamo cannot make text of
    # symbolic sizes with list(), join or %, and a message it cannot make fails the trace
    # (on that rank alone) instead of becoming a refusal.
    text = ""
    for size in shape:
        text = f"{text}, {int(size)}" if text else f"{int(size)}"
    return text


def shape_list(shape):
    """``shape`` as ``list(shape)`` prints it ("[6, 8]"), also for symbolic sizes."""
    return f"[{_sizes_text(shape)}]"


def shape_tuple(shape):
    """``shape`` as ``tuple(shape)`` prints it ("(5,)", "(2, 3)"), also for symbolic sizes."""
    text = _sizes_text(shape)
    return f"({text},)" if len(shape) == 1 else f"({text})"


def result_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _shape_rules(hidden, weight, targets, bias, sequence_parallel, sets=False):
    """The checks of the C++ kernels (csrc/register.cpp) that the shapes, dtypes and devices
    alone decide, as (condition, message) pairs: the fake kernels assert them (so that
    torch.compile and meta tensors raise where eager does), and a wrapper called with a
    group checks them among its own (``check_shapes``), so that inside torch.compile a rank
    whose shapes are wrong refuses on the group instead of raising alone while tracing."""
    name = "ids" if sets else "targets"
    yield weight.dim() == 2, lambda: f"lce_torch: weight must be [V_local, H], got {shape_tuple(weight.shape)}"
    yield hidden.dim() >= 1, lambda: "lce_torch: hidden must be [..., H], got a scalar"
    if sets:
        yield targets.dim() >= 1, lambda: "lce_torch: ids must be [..., K] (K ids per token), got a scalar"
    devices = [t.device for t in (hidden, weight, targets, bias) if t is not None]
    yield (all(d == devices[0] for d in devices),
           lambda: f"lce_torch: hidden, weight, {name} (and bias) must be on one device, got {devices}")
    if not sequence_parallel:
        tokens = tuple(hidden.shape[:-1])
        if sets:
            yield (tuple(targets.shape[:-1]) == tokens,
                   lambda: f"lce_torch: ids must be [..., K] with hidden's leading shape {shape_list(tokens)} "
                   f"(hidden {shape_list(hidden.shape)}), got {shape_list(targets.shape)}")
        else:
            yield (tuple(targets.shape) == tokens,
                   lambda: f"lce_torch: targets must have hidden's leading shape {shape_list(tokens)} "
                   f"(hidden {shape_list(hidden.shape)}), got {shape_list(targets.shape)}")
    yield (hidden.dtype == weight.dtype,
           lambda: f"lce_torch: hidden ({hidden.dtype}) and weight ({weight.dtype}) must have the same dtype")
    yield (targets.dtype in (torch.int32, torch.int64),
           lambda: f"lce_torch: targets must be int32 or int64, got {targets.dtype}")
    if bias is not None:
        yield (bias.dim() == 1 and bias.shape[0] == weight.shape[0],
               lambda: f"lce_torch: bias must be [V_local] = [{int(weight.shape[0])}] (one entry per row of weight), "
               f"got {shape_tuple(bias.shape)}")
        yield (bias.dtype == weight.dtype,
               lambda: f"lce_torch: bias ({bias.dtype}) must have the dtype of weight ({weight.dtype})")


def _check_fake(hidden, weight, targets, bias, options, sets=False):
    for holds, message in _shape_rules(hidden, weight, targets, bias, options.get("sequence_parallel", False), sets):
        torch._check(holds, message)


def check_shapes(hidden, weight, targets, bias, sequence_parallel, sets=False):
    """``_shape_rules`` as a wrapper's check: the first broken one raises RuntimeError, as the
    fake kernels' ``torch._check`` and the C++ kernels do."""
    for holds, message in _shape_rules(hidden, weight, targets, bias, sequence_parallel, sets):
        if not holds:
            raise RuntimeError(message())


def _bias_gradient_fake(bias, weight):
    return torch.empty_like(bias, memory_format=torch.contiguous_format) if bias is not None else weight.new_empty((0,))


# ---- fake kernels -----------------------------------------------------------


@torch.library.register_fake("lce::refuse_on_group")
def _refuse_on_group_fake(anchor, group_name, message, error_type):
    return anchor.new_empty(())


@torch.library.register_fake("lce::agree_on_values")
def _agree_on_values_fake(values, group_name, what):
    return values.new_empty(())


@torch.library.register_fake("lce::logprobs")
def _logprobs_fake(hidden, weight, targets, bias=None, *, with_entropy=False, with_mean_logit=False, **options):
    _check_fake(hidden, weight, targets, bias, options)
    rdt = result_dtype(hidden.dtype)
    logp = targets.new_empty(targets.shape, dtype=rdt)
    lse = targets.new_empty(targets.shape, dtype=rdt)
    ent = targets.new_empty(targets.shape if with_entropy else (0,), dtype=rdt)
    mean = targets.new_empty(targets.shape if with_mean_logit else (0,), dtype=rdt)
    return logp, lse, ent, mean


@torch.library.register_fake("lce::logprobs_backward")
def _logprobs_backward_fake(grad_logprobs, grad_entropy, hidden, weight, targets, lse, grad_lse=None,
                            grad_mean_logit=None, bias=None, **options):
    _check_fake(hidden, weight, targets, bias, options)
    return (
        torch.empty_like(hidden, memory_format=torch.contiguous_format),
        torch.empty_like(weight, memory_format=torch.contiguous_format),
        _bias_gradient_fake(bias, weight),
    )


@torch.library.register_fake("lce::logprobs_forward_backward")
def _logprobs_forward_backward_fake(hidden, weight, targets, grad_logprobs, grad_lse=None, grad_mean_logit=None,
                                    bias=None, *, with_mean_logit=False, **options):
    _check_fake(hidden, weight, targets, bias, options)
    rdt = result_dtype(hidden.dtype)
    return (
        targets.new_empty(targets.shape, dtype=rdt),
        torch.empty_like(hidden, memory_format=torch.contiguous_format),
        torch.empty_like(weight, memory_format=torch.contiguous_format),
        targets.new_empty(targets.shape, dtype=rdt),
        targets.new_empty(targets.shape if with_mean_logit else (0,), dtype=rdt),
        _bias_gradient_fake(bias, weight),
    )


@torch.library.register_fake("lce::target_set_logprobs")
def _target_set_logprobs_fake(hidden, weight, ids, bias=None, *, with_entropy=False, with_mean_logit=False,
                              **options):
    _check_fake(hidden, weight, ids, bias, options, sets=True)
    rdt = result_dtype(hidden.dtype)
    rows = ids.shape[:-1]
    logp = ids.new_empty(ids.shape, dtype=rdt)
    lse = ids.new_empty(rows, dtype=rdt)
    ent = ids.new_empty(rows if with_entropy else (0,), dtype=rdt)
    mean = ids.new_empty(rows if with_mean_logit else (0,), dtype=rdt)
    return logp, lse, ent, mean


@torch.library.register_fake("lce::target_set_logprobs_backward")
def _target_set_logprobs_backward_fake(grad_logprobs, grad_entropy, hidden, weight, ids, lse, grad_lse=None,
                                       grad_mean_logit=None, bias=None, **options):
    _check_fake(hidden, weight, ids, bias, options, sets=True)
    return (
        torch.empty_like(hidden, memory_format=torch.contiguous_format),
        torch.empty_like(weight, memory_format=torch.contiguous_format),
        _bias_gradient_fake(bias, weight),
    )


# ---- autograd -----------------------------------------------------------------


def _logprobs_setup_context(ctx, inputs, keyword_only_inputs, output):
    hidden, weight, targets = inputs[:3]
    bias = inputs[3] if len(inputs) > 3 else None
    _, lse, entropy, mean_logit = output
    ctx.save_for_backward(hidden, weight, targets, lse, bias)
    ctx.with_entropy = bool(keyword_only_inputs.get("with_entropy", False))
    ctx.with_mean_logit = bool(keyword_only_inputs.get("with_mean_logit", False))
    ctx.options = {k: v for k, v in keyword_only_inputs.items() if k in OPTION_NAMES}
    if not ctx.with_entropy:
        ctx.mark_non_differentiable(entropy)
    if not ctx.with_mean_logit:
        ctx.mark_non_differentiable(mean_logit)
    # Outputs the loss does not use get None (not zeros): no dL/dlse, dL/dentropy
    # row term is handed to lce when nothing depends on it.
    ctx.set_materialize_grads(False)


def _input_gradients(ctx, grad_hidden, grad_weight, grad_bias):
    # One per input of the op: hidden, weight, targets (none) and, where passed, bias.
    wanted = ctx.needs_input_grad
    out = (grad_hidden if wanted[0] else None, grad_weight if wanted[1] else None, None)
    if len(wanted) > 3:
        out += (grad_bias if wanted[3] else None,)
    return out


def _wants_gradients(ctx):
    return ctx.needs_input_grad[0] or ctx.needs_input_grad[1] or (len(ctx.needs_input_grad) > 3 and
                                                                  ctx.needs_input_grad[3])


def _logprobs_backward(ctx, grad_logprobs, grad_lse, grad_entropy, grad_mean_logit):
    hidden, weight, targets, lse, bias = ctx.saved_tensors
    if not _wants_gradients(ctx):
        return (None,) * len(ctx.needs_input_grad)
    if grad_logprobs is None:
        grad_logprobs = torch.zeros_like(lse)
    if not ctx.with_entropy:
        grad_entropy = None
    if not ctx.with_mean_logit:
        grad_mean_logit = None
    grads = _ops.logprobs_backward(
        grad_logprobs, grad_entropy, hidden, weight, targets, lse, grad_lse, grad_mean_logit, bias, **ctx.options
    )
    return _input_gradients(ctx, *grads)


torch.library.register_autograd("lce::logprobs", _logprobs_backward, setup_context=_logprobs_setup_context)


def _target_set_logprobs_backward(ctx, grad_logprobs, grad_lse, grad_entropy, grad_mean_logit):
    # As _logprobs_backward, with the target-set backward (grad_logprobs [..., K]).
    hidden, weight, ids, lse, bias = ctx.saved_tensors
    if not _wants_gradients(ctx):
        return (None,) * len(ctx.needs_input_grad)
    if grad_logprobs is None:
        grad_logprobs = lse.new_zeros(ids.shape)
    if not ctx.with_entropy:
        grad_entropy = None
    if not ctx.with_mean_logit:
        grad_mean_logit = None
    grads = _ops.target_set_logprobs_backward(
        grad_logprobs, grad_entropy, hidden, weight, ids, lse, grad_lse, grad_mean_logit, bias, **ctx.options
    )
    return _input_gradients(ctx, *grads)


# The context is the same as lce::logprobs's (inputs hidden, weight, ids, bias?; output lse).
torch.library.register_autograd("lce::target_set_logprobs", _target_set_logprobs_backward,
                                setup_context=_logprobs_setup_context)


def _no_double_backward(name):
    def setup_context(ctx, inputs, keyword_only_inputs, output):
        pass

    def backward(ctx, *grads):
        raise NotImplementedError(
            f"lce_torch: {name} computes gradients and is not differentiable itself (no double backward)"
        )

    torch.library.register_autograd(name, backward, setup_context=setup_context)


_no_double_backward("lce::logprobs_backward")
_no_double_backward("lce::logprobs_forward_backward")
_no_double_backward("lce::target_set_logprobs_backward")
