"""Ranks agree or fail together beyond lce's own exchange (gloo, CPU, 2 and 3 processes):
a check that lce_torch's Python wrappers make on one rank only (class weights, label
smoothing, a loss's layout, a DPO reference) raises on every rank instead of leaving the
others waiting in a collective; settings that shape a loss (its reduction, smoothing,
class weights, a loss's options and dtype) must be the same on every rank, or every rank
raises naming its own; so do an argument that fails a Python-side conversion on one rank
and ranks in different calls. The group stays usable after each failure."""

import pytest
import torch

from conftest import init_group, spawn_ranks

N, H, V = 8, 4, 10
SPLITS = {2: [0, 6, 10], 3: [0, 3, 6, 10]}


def _expect(rank, fn, match):
    """fn() raises on this rank with `match` (a string, or a dict rank -> string, default the rest)."""
    want = match if isinstance(match, str) else match.get(rank, match.get("others"))
    try:
        fn()
    except (RuntimeError, TypeError, ValueError, NotImplementedError) as e:
        assert want in str(e), f"rank {rank}: expected {want!r} in: {e}"
    else:
        raise AssertionError(f"rank {rank}: no error, expected {want!r}")


def _head(rank, world):
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g)
    y = torch.tensor([1, 9, 3, 7, 0, 2, 8, 5])
    a, b = SPLITS[world][rank], SPLITS[world][rank + 1]
    return h, w, y, a, b


def _cross_entropy_checks(rank, world, group):
    import lce_torch

    h, w, y, a, b = _head(rank, world)
    rejected = "lce_torch: rank 0 rejected its arguments"

    def ce(reduction="mean", **kw):
        hh, ww = h.clone().requires_grad_(), w[a:b].clone().requires_grad_()
        loss = lce_torch.linear_cross_entropy(hh, ww, y, reduction=reduction, group=group, vocab_start=a, **kw)
        (loss.sum() if reduction == "none" else loss).backward()
        return loss

    # Class weights up to each shard's end: target 9 has none on every rank but the last.
    for reduction in ("mean", "none"):
        _expect(rank, lambda: ce(reduction, weight=torch.ones(b)),
                {world - 1: rejected, "others": "target 9 has no class weight"})
    # A check in Python on rank 0 only.
    _expect(rank, lambda: ce(label_smoothing=1.5 if rank == 0 else 0.1),
            {0: "label_smoothing must be between 0.0 and 1.0", "others": rejected})
    # Settings that differ: every rank raises, naming its own.
    settings = "the call's settings differ across the ranks"
    _expect(rank, lambda: ce("mean" if rank == 0 else "sum"), settings)
    _expect(rank, lambda: ce(label_smoothing=0.1 if rank == 0 else 0.2), settings)
    _expect(rank, lambda: ce(weight=torch.ones(V) + (rank == world - 1)), settings)
    _expect(rank, lambda: ce("none" if rank == 0 else "mean"), "reduction='none'" if rank == 0 else "reduction='mean'")
    # Inside torch.compile (no Python-side exchange) the op's own exchange compares them.
    for mine, fused in ((dict(reduction="mean" if rank == 0 else "sum"), True),
                        (dict(label_smoothing=0.1 if rank == 0 else 0.2), False),
                        (dict(weight=torch.ones(V) if rank == 0 else None), True)):
        step = torch.compile(lambda hh, ww, kw=mine, fused=fused: lce_torch.linear_cross_entropy(
            hh, ww, y, group=group, vocab_start=a, fused=fused, **kw), fullgraph=True, backend="aot_eager")
        _expect(rank, lambda: step(h.clone().requires_grad_(), w[a:b].clone().requires_grad_()).backward(), settings)
    torch._dynamo.reset()
    # Class weights of one shape but other values on the last rank: a trace cannot read
    # them, so the compiled graph compares their bytes when it runs (lce.agree_on_values).
    from lce_torch._ops import group_name_of

    torch.library.opcheck(torch.ops.lce.agree_on_values.default,
                          (torch.linspace(0.5, 1.5, V), group_name_of(group), "the test's values"))
    differ = "linear_cross_entropy's class weights (torch.float32 [10]) differ across the ranks of group"
    for fused, reduction in ((True, "mean"), (False, "mean"), (True, "sum"), (False, "none")):
        step = torch.compile(lambda hh, ww, cw, fused=fused, reduction=reduction: lce_torch.linear_cross_entropy(
            hh, ww, y, group=group, vocab_start=a, weight=cw, fused=fused, reduction=reduction).sum(),
            fullgraph=True, backend="aot_eager")
        _expect(rank, lambda: step(h.clone().requires_grad_(), w[a:b].clone().requires_grad_(),
                                   torch.linspace(0.5, 1.5, V) + (rank == world - 1)).backward(), differ)
        # The same values on every rank: one process's loss and gradients.
        cw = torch.linspace(0.5, 1.5, V)
        hh, ww = h.clone().requires_grad_(), w[a:b].clone().requires_grad_()
        mine = step(hh, ww, cw)
        mine.backward()
        h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
        one = torch.nn.functional.cross_entropy(h1 @ w1.T, y, weight=cw, reduction=reduction).sum()
        one.backward()
        torch.testing.assert_close(mine, one, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(hh.grad, h1.grad, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(ww.grad, w1.grad[a:b], atol=2e-5, rtol=2e-5)
        torch._dynamo.reset()
    # A check that fails on rank 0 alone while it traces: put in the graph, so that every
    # rank raises when it runs (rank 0 its own error, of its own type), none waits.
    short = y[:-1] if rank == 0 else y
    for target, mine, want in (
            (y, dict(reduction="bogus" if rank == 0 else "mean"), "reduction must be 'mean', 'sum' or"),
            (y, dict(label_smoothing=1.5 if rank == 0 else 0.0), "label_smoothing must be between"),
            (short, {}, "targets must have hidden's leading shape"),
            (y, dict(linear_bias=torch.zeros(b - a + (rank == 0))), "bias must be [V_local]"),
            # A tensor where a number goes: a trace cannot read it.
            (y, dict(temperature=torch.tensor(2.0) if rank == 0 else 2.0),
             "temperature must be a Python float inside torch.compile, got a Tensor"),
            (y, dict(fused=torch.tensor(True) if rank == 0 else True), "fused must be a Python bool inside")):
        step = torch.compile(lambda hh, ww, yy=target, kw=mine: lce_torch.linear_cross_entropy(
            hh, ww, yy, group=group, vocab_start=a, **kw), fullgraph=True, backend="aot_eager")
        _expect(rank, lambda: step(h.clone().requires_grad_(), w[a:b].clone().requires_grad_()).backward(),
                {0: want, "others": rejected})
        torch._dynamo.reset()
    step = torch.compile(lambda hh, ww: lce_torch.linear_logprobs(
        hh, ww.double() if rank == 0 else ww, y, group=group, vocab_start=a, with_entropy=True),
        fullgraph=True, backend="aot_eager")
    _expect(rank, lambda: step(h, w[a:b]), {0: "must have the same dtype", "others": rejected})
    step = torch.compile(lambda hh, ww, flag: lce_torch.linear_logprobs(
        hh, ww, y, group=group, vocab_start=a, with_entropy=flag), fullgraph=True, backend="aot_eager")
    _expect(rank, lambda: step(h, w[a:b], torch.tensor(True) if rank == 0 else True),
            {0: "with_entropy must be a Python bool inside", "others": rejected})
    torch._dynamo.reset()
    # Dynamic shapes (symbolic sizes in the message), and a refused call's results used after it.
    step = torch.compile(lambda hh, ww, yy: lce_torch.linear_logprobs(hh, ww, yy, group=group, vocab_start=a),
                         fullgraph=True, backend="aot_eager", dynamic=True)
    _expect(rank, lambda: step(h, w[a:b], short), {0: "got [7]", "others": rejected})
    ids = torch.stack([y, (y + 1) % V], -1)

    def sets_step(hh, ww, bb):
        lp, ent, lse = lce_torch.linear_target_set_logprobs(hh, ww, ids, bias=bb, group=group, vocab_start=a,
                                                             with_entropy=True, return_lse=True)
        return (lp.sum(-1) + ent - lse).sum()

    step = torch.compile(sets_step, fullgraph=True, backend="aot_eager")
    _expect(rank, lambda: step(h, w[a:b], torch.zeros(b - a + (rank == 0))),
            {0: "bias must be [V_local]", "others": rejected})
    try:
        step = torch.compile(lambda hh, ww: lce_torch.linear_cross_entropy(
            hh, ww, y, group=group, vocab_start=a, reduction="bogus" if rank == 0 else "mean"),
            fullgraph=True, backend="aot_eager")
        step(h, w[a:b])
    except ValueError as e:  # the check's own type on the rank that made it
        assert rank == 0 and "reduction must be" in str(e), (rank, e)
    except RuntimeError as e:
        assert rank != 0 and rejected in str(e), (rank, e)
    else:
        raise AssertionError(f"rank {rank}: no error for a reduction of 'bogus' on rank 0")
    torch._dynamo.reset()

    # Still usable, and right: one process's loss and gradient.
    cw = torch.linspace(0.5, 1.5, V)
    for reduction, eps, weight in (("mean", 0.0, cw), ("sum", 0.1, None), ("none", 0.0, cw)):
        h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
        one = torch.nn.functional.cross_entropy(h1 @ w1.T, y, weight=weight, reduction=reduction,
                                                label_smoothing=eps)
        (one.sum() if reduction == "none" else one).backward()
        hh, ww = h.clone().requires_grad_(), w[a:b].clone().requires_grad_()
        mine = lce_torch.linear_cross_entropy(hh, ww, y, reduction=reduction, group=group, vocab_start=a,
                                              label_smoothing=eps, weight=weight)
        (mine.sum() if reduction == "none" else mine).backward()
        torch.testing.assert_close(mine, one, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(hh.grad, h1.grad, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(ww.grad, w1.grad[a:b], atol=2e-5, rtol=2e-5)


def _loss_checks(rank, world, group):
    import lce_torch

    cu = torch.tensor([0, 3, 7, 8, 12])
    lp = -torch.linspace(0.1, 2.0, 12, dtype=torch.float64) * (1 + rank)
    rejected = "lce_torch: rank 0 rejected its arguments"
    settings = "the call's settings differ across the ranks"

    def sft(**kw):
        args = dict(cu_seqlens=cu, group=group)
        args.update(kw)
        return lce_torch.sft_loss(args.pop("logprobs", lp), None, **args)

    # Python-side checks on rank 0 only.
    _expect(rank, lambda: sft(logprobs=lp.view(3, 4, 1) if rank == 0 else lp),
            {0: "logprobs must be packed [N] (with cu_seqlens) or [B, T]", "others": rejected})
    _expect(rank, lambda: sft(normaliser=10.0 if rank == 0 else None),
            {0: "pass normaliser (a constant divisor) or group", "others": rejected})
    bad_cu = torch.tensor([0, 7, 3, 8, 12]) if rank == 0 else cu
    _expect(rank, lambda: lce_torch.dpo_loss(lp, bad_cu, ref_logprobs=lp - 0.1, group=group),
            {0: "cu_seqlens", "others": rejected})
    sets = torch.full((12, 2), -1.0, dtype=torch.float64)
    ids = torch.tensor([[0, 1]] * 12)
    kd_cu = cu if rank == 0 else None
    _expect(rank, lambda: lce_torch.distill_loss(sets.view(3, 4, 2), sets.view(3, 4, 2), ids.view(3, 4, 2), kd_cu,
                                                 group=group),
            {0: "takes no cu_seqlens", "others": rejected})
    # Options or dtypes that differ: every rank raises.
    _expect(rank, lambda: sft(reduction="token_mean" if rank == 0 else "sequence_mean"), settings)
    _expect(rank, lambda: sft(logprobs=lp.float() if rank == 0 else lp), settings)
    _expect(rank, lambda: lce_torch.dpo_loss(lp, cu, ref_logprobs=lp - 0.1, beta=0.1 + rank, group=group), settings)
    _expect(rank, lambda: lce_torch.policy_gradient_loss(lp, torch.ones(12, dtype=torch.float64), cu,
                                                         kl="k1" if rank == 0 else "k3", group=group), settings)
    # Inside torch.compile a Python-side check that fails on rank 0 alone raises on every rank.
    step = torch.compile(lambda x: lce_torch.sft_loss(x.view(3, 4, 1) if rank == 0 else x, None, cu_seqlens=cu,
                                                      group=group).loss, fullgraph=True, backend="aot_eager")
    _expect(rank, lambda: step(lp), {0: "logprobs must be packed [N] (with cu_seqlens) or [B, T]", "others": rejected})
    torch._dynamo.reset()
    # A refused loss's per-sequence fields have the layout's sequences, so code using them traces.
    def dpo_step(x):
        ref = x[:-1] if rank == 0 else x
        r = lce_torch.dpo_loss(x, cu, ref_logprobs=ref - 0.1, group=group)
        return r.loss + r.seq_logprobs[3] + r.seq_tokens.sum() + r.pairs

    step = torch.compile(dpo_step, fullgraph=True, backend="aot_eager")
    _expect(rank, lambda: step(lp), {0: "ref_logprobs has shape (11,), logprobs (12,)", "others": rejected})
    torch._dynamo.reset()
    # Written into, and with an empty cu_seqlens (one sequence, as lce reads it).
    def kd_step(x, cu_kd):
        r = lce_torch.distill_loss(x, x, ids, cu_kd, tail=None if rank == 0 else "bucket", group=group)
        return r.loss + r.seq_kl.copy_(x[: r.seq_kl.shape[0], 0]).sum() + r.seq_kl[0] + r.seq_tokens[0]

    for cu_kd in (cu, torch.zeros(0, dtype=torch.int64)):
        step = torch.compile(kd_step, fullgraph=True, backend="aot_eager")
        _expect(rank, lambda: step(sets.clone(), cu_kd), {0: "tail must be a str", "others": rejected})
        torch._dynamo.reset()
    step = torch.compile(lambda x, per_sequence: lce_torch.policy_gradient_loss(
        x, torch.ones(12, dtype=x.dtype), cu, sequence_advantages=per_sequence, group=group).loss,
        fullgraph=True, backend="aot_eager")
    _expect(rank, lambda: step(lp, torch.tensor(False) if rank == 0 else False),
            {0: "sequence_advantages must be a Python bool inside", "others": rejected})
    torch._dynamo.reset()
    step = torch.compile(lambda x, beta: lce_torch.dpo_loss(x, cu, ref_logprobs=x - 0.1, beta=beta, group=group).loss,
                         fullgraph=True, backend="aot_eager")
    _expect(rank, lambda: step(lp, torch.tensor(0.1) if rank == 0 else 0.1),
            {0: "beta must be a Python float inside torch.compile, got a Tensor", "others": rejected})
    torch._dynamo.reset()

    # Still usable, and right: the ranks' losses sum to the loss over every rank's tokens.
    mine = sft().loss
    total = mine.detach().clone()
    torch.distributed.all_reduce(total, group=group)
    every = torch.cat([-torch.linspace(0.1, 2.0, 12, dtype=torch.float64) * (1 + r) for r in range(world)])
    assert torch.allclose(total, -every.mean()), (total, -every.mean())


def _argument_checks(rank, world, group):
    """Arguments that fail a Python-side conversion or type check on one rank (a None
    vocab_start, a list for targets or cu_seqlens, a non-number beta, a non-text
    reduction): every rank raises, the failing one first with its own message; and ranks
    in different calls say so rather than reading one call's record as the other's."""
    import lce_torch

    h, w, y, a, b = _head(rank, world)
    rejected = "lce_torch: rank 0 rejected its arguments"
    odd = rank == 0
    _expect(rank, lambda: lce_torch.linear_logprobs(h, w[a:b], y, vocab_start=None if odd else a, group=group),
            {0: "int() argument must be", "others": rejected})
    _expect(rank, lambda: lce_torch.linear_logprobs(h, w[a:b], y.tolist() if odd else y, vocab_start=a, group=group),
            {0: "targets must be a torch.Tensor, got list", "others": rejected})
    _expect(rank, lambda: lce_torch.linear_target_set_logprobs(h, w[a:b], y[:, None].tolist() if odd else y[:, None],
                                                               vocab_start=a, group=group),
            {0: "ids must be a torch.Tensor, got list", "others": rejected})
    for fused in (True, False):
        _expect(rank, lambda: lce_torch.linear_cross_entropy(h.clone().requires_grad_(), w[a:b], y.tolist() if odd
                                                             else y, vocab_start=a, group=group, fused=fused),
                {0: "target must be a torch.Tensor, got list", "others": rejected})
        _expect(rank, lambda: lce_torch.linear_cross_entropy(h, w[a:b], y, vocab_start=a, group=group, fused=fused,
                                                             temperature="hot" if odd else 1.0),
                {0: "could not convert string to float", "others": rejected})

    cu = torch.tensor([0, 3, 7, 8, 12])
    lp = -torch.linspace(0.1, 2.0, 12, dtype=torch.float64)
    _expect(rank, lambda: lce_torch.sft_loss(lp, None, cu.tolist() if odd else cu, group=group),
            {0: "cu_seqlens must be a torch.Tensor, got list", "others": rejected})
    _expect(rank, lambda: lce_torch.sft_loss(lp, None, cu, reduction=None if odd else "token_mean", group=group),
            {0: "reduction must be a str, got NoneType", "others": rejected})
    _expect(rank, lambda: lce_torch.dpo_loss(lp, cu, ref_logprobs=lp - 0.1, beta=None if odd else 0.1, group=group),
            {0: "float() argument must be", "others": rejected})
    _expect(rank, lambda: lce_torch.policy_gradient_loss(lp, torch.ones(12, dtype=torch.float64), cu,
                                                         kl=3 if odd else "k3", group=group),
            {0: "kl must be a str, got int", "others": rejected})
    sets = torch.full((12, 2), -1.0, dtype=torch.float64)
    ids = torch.tensor([[0, 1]] * 12)
    _expect(rank, lambda: lce_torch.distill_loss(sets, sets, ids, cu, tail=None if odd else "bucket", group=group),
            {0: "tail must be a str, got NoneType", "others": rejected})

    # Ranks in different calls (a loop out of step): each names both calls.
    crossed = "are in different calls"
    _expect(rank, lambda: lce_torch.linear_logprobs(h, w[a:b], y, vocab_start=a, group=group) if odd
            else lce_torch.sft_loss(lp, None, cu, group=group), crossed)
    # Two wrappers of one op: each names its own call.
    _expect(rank, lambda: lce_torch.linear_cross_entropy(h, w[a:b], y, vocab_start=a, group=group) if odd
            else lce_torch.linear_logprobs(h, w[a:b], y, vocab_start=a, group=group),
            {0: "rank 0 has linear_cross_entropy(reduction='mean'", "others": f"rank {rank} has linear_logprobs, "})

    # A rank outside a group passes what new_group gave it: lce's message, not an AttributeError.
    _expect(rank, lambda: lce_torch.linear_logprobs(h, w, y, group=torch.distributed.GroupMember.NON_GROUP_MEMBER),
            "what torch.distributed.new_group returns to a rank outside the group")
    # shard_vocab_start takes the group's name, as every group= does.
    assert lce_torch.shard_vocab_start(group.group_name, b - a) == a

    # Still usable, and right.
    one = torch.log_softmax(h.double() @ w.double().T, -1).gather(1, y[:, None])[:, 0]
    mine = lce_torch.linear_logprobs(h.double(), w[a:b].double(), y, vocab_start=a, group=group)
    torch.testing.assert_close(mine, one)


def _ranks(rank, world, init_file):
    torch.set_num_threads(1)
    group = init_group(rank, world, init_file)
    _cross_entropy_checks(rank, world, group)
    _loss_checks(rank, world, group)
    _argument_checks(rank, world, group)


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_agree_or_fail_together(world):
    spawn_ranks(_ranks, world)


def test_dpo_takes_an_empty_pair_list():
    import lce_torch

    # A data-parallel rank with no pair passes []: accepted (the pairs are sequence indices).
    none = torch.zeros(0, dtype=torch.float64)
    r = lce_torch.dpo_loss(none, torch.tensor([0]), ref_seq_logprobs=none, pairs=[], normaliser=1.0)
    assert float(r.loss) == 0.0
