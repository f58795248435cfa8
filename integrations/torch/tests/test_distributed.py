"""Tensor parallel through torch.distributed (gloo, CPU): the vocabulary split over 2 and
3 processes, each calling lce with its weight shard and the group, equals one process
with the whole weight; bad input on one rank raises on every rank (no hang)."""

import pytest
import torch
import torch.distributed as dist

from conftest import init_group, spawn_ranks

# Vocabulary bounds per world size (uneven, one shard of a single row).
SPLITS = {2: [0, 60, 101], 3: [0, 40, 41, 101]}
N, H, V = 24, 16, 101


def _data(dtype, device="cpu"):
    from conftest import make

    return [t.to(device) for t in make(N, H, V, dtype, seed=5, ignore=(2, 11), scale=2.0)]


def _close(a, b, dtype, what, rank):
    tol = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=lambda m: f"rank {rank}, {what}: {m}")


def _check_tp(rank, world, group, dtype, sequence_parallel, device="cpu"):
    import lce_torch

    h, w, y = _data(dtype, device)
    a, b = SPLITS[world][rank], SPLITS[world][rank + 1]
    gl = torch.linspace(-1, 1, N, dtype=torch.float64, device=device)
    ge = torch.linspace(0.3, -0.6, N, dtype=torch.float64, device=device)
    gq = torch.linspace(-0.2, 0.4, N, dtype=torch.float64, device=device)  # dL/dlse (a z-loss), ignored included

    # One process, the whole weight.
    h1, w1 = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    logp1, ent1, lse1 = lce_torch.linear_logprobs(h1, w1, y, with_entropy=True, return_lse=True)
    ((logp1.double() * gl).sum() + (ent1.double() * ge).sum() + (lse1.double() * gq).sum()).backward()

    # This rank's shard (and, under sequence parallelism, its rows of hidden).
    rows = slice(rank * N // world, (rank + 1) * N // world) if sequence_parallel else slice(0, N)
    h2, w2 = h[rows].clone().requires_grad_(True), w[a:b].clone().requires_grad_(True)
    logp2, ent2, lse2 = lce_torch.linear_logprobs(h2, w2, y, with_entropy=True, return_lse=True, vocab_start=a,
                                                  group=group, sequence_parallel=sequence_parallel)
    ((logp2.double() * gl).sum() + (ent2.double() * ge).sum() + (lse2.double() * gq).sum()).backward()
    _close(logp2, logp1, dtype, "logprobs", rank)
    _close(ent2, ent1, dtype, "entropy", rank)
    _close(lse2, lse1, dtype, "lse", rank)
    _close(h2.grad, h1.grad[rows], dtype, "grad_hidden", rank)
    _close(w2.grad, w1.grad[a:b], dtype, "grad_weight shard", rank)

    if not sequence_parallel:
        # The fused cross-entropy (forward_backward) with the group.
        # With label smoothing too: the mean logit is over the whole vocabulary.
        for reduction, eps in (("mean", 0.0), ("sum", 0.0), ("mean", 0.2), ("sum", 0.3)):
            h3, w3 = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
            loss1 = lce_torch.linear_cross_entropy(h3, w3, y, reduction=reduction, label_smoothing=eps)
            loss1.backward()
            h4, w4 = h.clone().requires_grad_(True), w[a:b].clone().requires_grad_(True)
            loss2 = lce_torch.linear_cross_entropy(h4, w4, y, reduction=reduction, group=group, vocab_start=a,
                                                   label_smoothing=eps)
            loss2.backward()
            what = f"{reduction} eps {eps}"
            _close(loss2, loss1, dtype, f"{what} loss", rank)
            _close(h4.grad, h3.grad, dtype, f"{what} grad_hidden", rank)
            _close(w4.grad, w3.grad[a:b], dtype, f"{what} grad_weight", rank)
        assert lce_torch.shard_vocab_start(group, b - a) == a


def _check_errors(rank, world, group, device="cpu"):
    import lce_torch

    h, w, y = _data(torch.float32, device)
    other = torch.float64 if device == "cpu" else torch.float16  # a dtype the device takes
    a, b = SPLITS[world][rank], SPLITS[world][rank + 1]
    ws = w[a:b].clone()
    before = [h.clone(), ws.clone(), y.clone()]

    def expect(match, **changes):
        hh, wws, yy = changes.get("h", h), changes.get("w", ws), changes.get("y", y)
        try:
            lce_torch.linear_logprobs(hh, wws, yy, vocab_start=a, group=group)
        except (RuntimeError, TypeError, ValueError) as e:
            assert match in str(e), f"rank {rank}: expected '{match}' in: {e}"
        else:
            raise AssertionError(f"rank {rank}: no error, expected '{match}'")

    # lce's own check on every rank: each gets lce's message.
    bad = y.clone()
    bad[4] = V + 3
    expect(f"lce: targets[4] = {V + 3} is outside the vocabulary", y=bad)
    # Targets that differ on the last rank only: lce's exchange compares their hashes.
    if rank == world - 1:
        expect("lce: targets: the hash of the target ids differs across ranks", y=bad)
    else:
        expect("lce: targets: the hash of the target ids differs across ranks")
    # A check torch-side (float targets) on rank 0 only: lce_torch's agreement.
    if rank == 0:
        expect("lce_torch: targets must be int32 or int64", y=y.float())
    else:
        expect("lce_torch: rank 0 rejected its arguments")
    # Dtypes that differ across ranks.
    if rank == 1:
        expect("dtypes differ across ranks", h=h.to(other), w=ws.to(other))
    else:
        expect("dtypes differ across ranks")
    # Options that differ across ranks (lce's exchange).
    try:
        lce_torch.linear_logprobs(h, ws, y, vocab_start=a, group=group, temperature=1.0 + rank)
    except RuntimeError as e:
        assert "temperature differs across ranks" in str(e), str(e)
    else:
        raise AssertionError("no error for different temperatures")
    # Nothing was touched, and the group still works.
    for t0, t1 in zip(before, (h, ws, y)):
        assert torch.equal(t0, t1)
    lce_torch.linear_logprobs(h, ws, y, vocab_start=a, group=group)


def _ranks(rank, world, init_file):
    torch.set_num_threads(1)
    group = init_group(rank, world, init_file)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        _check_tp(rank, world, group, dtype, sequence_parallel=False)
    for dtype in (torch.float32, torch.float64):
        _check_tp(rank, world, group, dtype, sequence_parallel=True)
    _check_tp(rank, world, dist.group.WORLD, torch.float32, sequence_parallel=False)
    _check_errors(rank, world, group)


@pytest.mark.parametrize("world", [2, 3])
def test_tensor_parallel_gloo(world):
    spawn_ranks(_ranks, world)
