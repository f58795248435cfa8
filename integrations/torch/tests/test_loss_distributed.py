"""The losses with a torch.distributed group (gloo, 2 processes): each rank holds half of
the sequences, the normaliser is the global count, and the ranks' losses sum to the
one-process loss over the whole batch, with each rank's gradient the matching slice of
the one-process gradient; bad input on one rank raises on both (no hang)."""
import math

import pytest
import torch
import torch.distributed as dist

from conftest import init_group, spawn_ranks

WORLD = 2
LENGTHS = (5, 0, 1, 7, 3, 4, 2, 6)  # sequences 0-3 on rank 0, 4-7 on rank 1
TIGHT = dict(atol=1e-12, rtol=1e-12)


def _data():
    import lce_torch

    g = torch.Generator().manual_seed(21)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    n = int(cu[-1])
    targets = lce_torch.next_token_targets(torch.randint(0, 40, (n,), generator=g), cu)
    targets[torch.rand(n, generator=g) < 0.2] = -100
    weights = torch.tensor([0.5, 1.0, 2.0])[torch.randint(0, 3, (n,), generator=g)]
    logp = -3.0 * torch.rand(n, generator=g, dtype=torch.float64) - 0.01
    old = logp + 0.4 * torch.randn(n, generator=g, dtype=torch.float64)
    adv = torch.randn(len(LENGTHS), generator=g, dtype=torch.float64)
    ref_seq = -10.0 * torch.rand(len(LENGTHS), generator=g, dtype=torch.float64)
    return dict(cu=cu, targets=targets, weights=weights, logp=logp, old=old, adv=adv, ref_seq=ref_seq)


def _losses():
    import lce_torch

    # name: loss(logp, batch, **normalisation) -> result; per-sequence inputs sliced by _shard
    return {
        "sft token_mean": lambda lp, b, **kw: lce_torch.sft_loss(lp, b["targets"], b["cu"], weights=b["weights"], **kw),
        "sft sequence_mean": lambda lp, b, **kw: lce_torch.sft_loss(lp, b["targets"], b["cu"], weights=b["weights"],
                                                                    reduction="sequence_mean", **kw),
        "grpo": lambda lp, b, **kw: lce_torch.policy_gradient_loss(
            lp, b["adv"], b["cu"], old_logprobs=b["old"], targets=b["targets"], weights=b["weights"],
            sequence_advantages=True, reduction="sequence_mean", kl_coef=0.05, ref_logprobs=b["old"] - 0.1, **kw),
        "dapo": lambda lp, b, **kw: lce_torch.policy_gradient_loss(
            lp, b["adv"], b["cu"], old_logprobs=b["old"], targets=b["targets"], sequence_advantages=True,
            eps_high=0.28, **kw),
        "dpo": lambda lp, b, **kw: lce_torch.dpo_loss(lp, b["cu"], ref_seq_logprobs=b["ref_seq"], targets=b["targets"],
                                                      weights=b["weights"], beta=0.3, sft_coef=0.1, **kw),
    }


def _shard(d, rank):
    s0, s1 = 4 * rank, 4 * rank + 4
    a, b = int(d["cu"][s0]), int(d["cu"][s1])
    per_token = {k: d[k][a:b] for k in ("targets", "weights", "logp", "old")}
    per_seq = {k: d[k][s0:s1] for k in ("adv", "ref_seq")}
    return dict(cu=d["cu"][s0:s1 + 1] - a, **per_token, **per_seq), slice(a, b)


def _check_global_normalisation(rank, group):
    d = _data()
    mine, rows = _shard(d, rank)
    for name, loss in _losses().items():
        whole_logp = d["logp"].clone().requires_grad_(True)
        whole = loss(whole_logp, d)
        whole.loss.backward()
        logp = mine["logp"].clone().requires_grad_(True)
        part = loss(logp, mine, group=group)
        part.loss.backward()
        total = part.loss.detach().clone()
        dist.all_reduce(total, group=group)
        torch.testing.assert_close(total, whole.loss.detach(), **TIGHT, msg=lambda m: f"rank {rank} {name}: {m}")
        torch.testing.assert_close(part.normaliser, whole.normaliser, **TIGHT)
        torch.testing.assert_close(logp.grad, whole_logp.grad[rows], **TIGHT,
                                   msg=lambda m: f"rank {rank} {name} grad: {m}")


def _check_data_parallel_end_to_end(rank, group):
    """hidden -> linear_logprobs -> sft_loss(group=) on each rank's rows: the summed weight
    gradient is the one-process gradient."""
    import lce_torch
    from conftest import make

    d = _data()
    n = int(d["cu"][-1])
    h, w, _ = make(n, 8, 40, torch.float64, seed=3)
    mine, rows = _shard(d, rank)
    w1 = w.clone().requires_grad_(True)
    lce_torch.sft_loss(lce_torch.linear_logprobs(h, w1, d["targets"]), d["targets"], d["cu"]).loss.backward()
    w2 = w.clone().requires_grad_(True)
    logp = lce_torch.linear_logprobs(h[rows], w2, mine["targets"])
    lce_torch.sft_loss(logp, mine["targets"], mine["cu"], group=group).loss.backward()
    grad = w2.grad.clone()
    dist.all_reduce(grad, group=group)
    torch.testing.assert_close(grad, w1.grad, **TIGHT)


def _check_errors(rank, group):
    import lce_torch

    d = _data()
    mine, _ = _shard(d, rank)
    logp = mine["logp"].clone()
    if rank == 0:
        logp[0] = math.nan
        mine["targets"][0] = 1
        want = "lce: logprobs[0] = nan is not finite"
    else:
        want = "lce_torch: rank 0 rejected its arguments"
    try:
        lce_torch.sft_loss(logp, mine["targets"], mine["cu"], group=group)
    except RuntimeError as e:
        assert want in str(e), f"rank {rank}: expected '{want}' in: {e}"
    else:
        raise AssertionError(f"rank {rank}: no error, expected '{want}'")
    # The group still works.
    lce_torch.sft_loss(mine["logp"], mine["targets"], mine["cu"], group=group)


def _ranks(rank, world, init_file):
    torch.set_num_threads(1)
    group = init_group(rank, world, init_file)
    _check_global_normalisation(rank, group)
    _check_data_parallel_end_to_end(rank, group)
    _check_errors(rank, group)


def test_losses_globally_normalised_over_gloo():
    spawn_ranks(_ranks, WORLD)
