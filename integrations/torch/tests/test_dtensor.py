"""DTensor arguments (gloo, CPU, 2 and 3 processes): an LM-head weight sharded by rows as
PyTorch's tensor parallelism holds it (Shard(0), torch.chunk's uneven split), with a
replicated hidden or one sharded by rows (sequence parallel), equals the materialised
reference in float64 (F.linear, F.log_softmax, F.cross_entropy), eager and compiled; the
gradients come back as DTensors with the inputs' placements; layouts lce does not take
raise, naming them; hidden states or targets that differ across the ranks beside a Shard(0)
weight (FSDP's, from outside its module's forward) raise on every rank."""

import pytest
import torch
import torch.nn.functional as F

from conftest import spawn_ranks

N, H, V = 6, 4, 10  # 3 ranks: vocabulary blocks of 4, 4 and 2 rows


def _data():
    g = torch.Generator().manual_seed(3)
    h = torch.randn(N, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64)
    b = torch.randn(V, generator=g, dtype=torch.float64)
    y = torch.tensor([1, 9, -100, 7, 0, 2])
    return h, w, b, y


def _close(a, b, what, rank):
    torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10, msg=lambda m: f"rank {rank}, {what}: {m}")


def _expect(rank, fn, error, match):
    with pytest.raises(error, match=match):
        fn()


def _checks(rank, world, init_file):
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import lce_torch

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    h, w, b, y = _data()
    counted = y != -100
    cw = torch.linspace(0.5, 1.5, V, dtype=torch.float64)

    def dtensors(rows_sharded, bias=True):
        wd = distribute_tensor(w.clone(), mesh, [Shard(0)]).requires_grad_()
        hd = distribute_tensor(h.clone(), mesh, [Shard(0) if rows_sharded else Replicate()]).requires_grad_()
        bd = distribute_tensor(b.clone(), mesh, [Shard(0)]).requires_grad_() if bias else None
        return hd, wd, bd

    def reference(bias=True):
        h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
        b1 = b.clone().requires_grad_() if bias else None
        return h1, w1, b1, F.linear(h1, w1, b1)

    def same_gradients(pairs, what):
        for mine, want, placement, name in pairs:
            assert mine.grad.placements == (placement,), (name, mine.grad.placements)
            _close(mine.grad.full_tensor(), want.grad, f"{what}: d{name}", rank)

    for compiled in (False, True):
        for rows_sharded in (False, True):
            kind = f"{'compiled' if compiled else 'eager'}, hidden {'Shard(0)' if rows_sharded else 'Replicate()'}"
            hidden_placement = Shard(0) if rows_sharded else Replicate()

            # linear_cross_entropy, every reduction, class weights (one a replicated DTensor).
            for reduction, class_weight in (("mean", None), ("sum", cw), ("none", cw), ("mean", "dtensor")):
                def step(hh, ww, bb, cwt, reduction=reduction):
                    out = lce_torch.linear_cross_entropy(hh, ww, y, linear_bias=bb, weight=cwt, reduction=reduction)
                    return out.sum() if reduction == "none" else out

                fn = torch.compile(step, fullgraph=True, backend="aot_eager") if compiled else step
                hd, wd, bd = dtensors(rows_sharded)
                weights = distribute_tensor(cw, mesh, [Replicate()]) if class_weight == "dtensor" else class_weight
                loss = fn(hd, wd, bd, weights)
                loss.backward()
                h1, w1, b1, logits = reference()
                want = F.cross_entropy(logits, y, weight=None if class_weight is None else cw, reduction=reduction)
                want = want.sum() if reduction == "none" else want
                want.backward()
                _close(loss, want, f"{kind}, cross-entropy {reduction}", rank)
                same_gradients(((hd, h1, hidden_placement, "hidden"), (wd, w1, Shard(0), "weight"),
                                (bd, b1, Shard(0), "bias")), f"{kind}, cross-entropy {reduction}")
            torch._dynamo.reset()

            # linear_logprobs with its row terms, and a target set.
            def logprobs_step(hh, ww, bb):
                lp, ent, lse = lce_torch.linear_logprobs(hh, ww, y, bias=bb, with_entropy=True, return_lse=True)
                ids = torch.stack([y.clamp(min=0), (y.clamp(min=0) + 3) % V], -1)
                sets = lce_torch.linear_target_set_logprobs(hh, ww, ids, bias=bb)
                return lp, ent, lse, sets

            fn = torch.compile(logprobs_step, fullgraph=True, backend="aot_eager") if compiled else logprobs_step
            hd, wd, bd = dtensors(rows_sharded)
            lp, ent, lse, sets = fn(hd, wd, bd)
            (lp.sum() + 0.5 * ent.sum() - 0.25 * lse.sum() + 0.75 * sets.sum()).backward()
            h1, w1, b1, logits = reference()
            logq = F.log_softmax(logits, -1)
            lp1 = torch.where(counted, logq.gather(-1, y.clamp(min=0)[:, None])[:, 0], torch.zeros(()).double())
            ent1 = torch.where(counted, -(logq.exp() * logq).sum(-1), torch.zeros(()).double())
            lse1 = torch.logsumexp(logits, -1)
            ids = torch.stack([y.clamp(min=0), (y.clamp(min=0) + 3) % V], -1)
            sets1 = logq.gather(-1, ids)
            (lp1.sum() + 0.5 * ent1.sum() - 0.25 * lse1.sum() + 0.75 * sets1.sum()).backward()
            for mine, want, what in ((lp, lp1, "logprobs"), (ent, ent1, "entropy"), (lse, lse1, "lse"),
                                     (sets, sets1, "target-set logprobs")):
                _close(mine, want, f"{kind}, {what}", rank)
            same_gradients(((hd, h1, hidden_placement, "hidden"), (wd, w1, Shard(0), "weight"),
                            (bd, b1, Shard(0), "bias")), f"{kind}, logprobs")
            torch._dynamo.reset()

    # Targets and ids as replicated DTensors (every rank needs all of them).
    hd, wd, bd = dtensors(False)
    y_replicated = distribute_tensor(y, mesh, [Replicate()])
    loss = lce_torch.linear_cross_entropy(hd, wd, y_replicated, linear_bias=bd)
    _close(loss, F.cross_entropy(F.linear(h, w, b), y), "replicated targets", rank)
    ids = distribute_tensor(torch.stack([y.clamp(min=0), (y.clamp(min=0) + 3) % V], -1), mesh, [Replicate()])
    _close(lce_torch.linear_target_set_logprobs(hd, wd, ids, bias=bd),
           F.log_softmax(F.linear(h, w, b), -1).gather(-1, ids.to_local()), "replicated ids", rank)
    _expect(rank, lambda: lce_torch.linear_logprobs(hd, wd, distribute_tensor(y, mesh, [Shard(0)])),
            NotImplementedError, "a DTensor targets must be replicated")
    # A replicated weight: one process's call on every rank, no group.
    wd = distribute_tensor(w.clone(), mesh, [Replicate()]).requires_grad_()
    loss = lce_torch.linear_cross_entropy(h, wd, y)
    loss.backward()
    h1, w1, _, logits = reference(bias=False)
    want = F.cross_entropy(logits, y)
    want.backward()
    _close(loss, want, "replicated weight", rank)
    _close(wd.grad.full_tensor(), w1.grad, "replicated weight: dweight", rank)

    # Layouts lce does not take, on every rank alike (a DTensor's placements are global).
    hd, wd, _ = dtensors(False, bias=False)
    _expect(rank, lambda: lce_torch.linear_cross_entropy(hd, wd, y, group=dist.group.WORLD), ValueError,
            "a DTensor weight carries its group")
    _expect(rank, lambda: lce_torch.linear_logprobs(h, wd, y, vocab_start=4), ValueError,
            "a DTensor weight carries its group")
    _expect(rank, lambda: lce_torch.linear_logprobs(hd, w, y), TypeError, "hidden or bias is a DTensor but weight")
    by_columns = distribute_tensor(w.clone(), mesh, [Shard(1)])
    _expect(rank, lambda: lce_torch.linear_logprobs(h, by_columns, y), NotImplementedError,
            r"weight's placement must be Shard\(0\)")
    batched = distribute_tensor(h.reshape(2, 3, H).clone(), mesh, [Shard(1)])
    _expect(rank, lambda: lce_torch.linear_logprobs(batched, wd, y.reshape(2, 3)), NotImplementedError,
            r"hidden's placement must be Replicate\(\)")
    bias_replicated = distribute_tensor(b.clone(), mesh, [Replicate()])
    _expect(rank, lambda: lce_torch.linear_logprobs(h, wd, y, bias=bias_replicated), ValueError,
            "bias must be placed as weight")
    by_columns_weights = distribute_tensor(cw.clone(), mesh, [Shard(0)])
    _expect(rank, lambda: lce_torch.linear_cross_entropy(h, wd, y, weight=by_columns_weights), NotImplementedError,
            "must be replicated")
    # A DTensor built by hand with blocks other than torch.chunk's: only the ranks whose
    # block differs can see it; every rank raises (the others: rank r rejected its arguments).
    sizes = {2: [6, 4], 3: [4, 3, 3]}[world]  # torch.chunk's: 5, 5 and 4, 4, 2
    start = sum(sizes[:rank])
    from torch.distributed.tensor import DTensor

    by_hand = DTensor.from_local(w[start:start + sizes[rank]].clone(), mesh, [Shard(0)], shape=torch.Size((V, H)),
                                 stride=(H, 1))
    block = -(-V // world)
    differs = [r for r in range(world) if sizes[r] != min(block, max(V - r * block, 0))]
    message = ("weight's local shard has" if rank in differs else
               f"rank {differs[0]} rejected its arguments")
    for call in (lambda: lce_torch.linear_logprobs(h, by_hand, y), lambda: lce_torch.linear_cross_entropy(h, by_hand, y)):
        _expect(rank, call, (ValueError, RuntimeError), message)
    # An empty block (V = 2 over 3 ranks: 1, 1, 0), refused alike on every rank.
    if world == 3:
        tiny = distribute_tensor(w[:2].clone(), mesh, [Shard(0)])
        _expect(rank, lambda: lce_torch.linear_logprobs(h, tiny, y.clamp(0, 1)), ValueError, "leaves rank 2 no rows")
    # Hidden states or targets that differ across the ranks beside a Shard(0) weight (what a
    # data-parallel weight sharded by FSDP looks like from outside its module's forward):
    # every rank raises, eager and compiled, where they would have mixed every rank's
    # tokens into one tensor-parallel loss. The last rank alone differs. (lce's own call
    # compares the targets; lce_torch the hidden states.)
    last = rank == world - 1
    h_mine = h + 1.0 if last else h
    y_mine = y.roll(1) if last else y
    differ = "hidden states beside a Shard\\(0\\) DTensor weight .* differ across the ranks"
    targets_differ = "the hash of the target ids differs across ranks"
    for compiled in (False, True):
        def wrap(f):
            return torch.compile(f, fullgraph=True, backend="aot_eager") if compiled else f

        _expect(rank, lambda: wrap(lambda: lce_torch.linear_cross_entropy(h_mine, wd, y))(), RuntimeError, differ)
        _expect(rank, lambda: wrap(lambda: lce_torch.linear_logprobs(h, wd, y_mine))(), RuntimeError, targets_differ)
        swapped = h.clone()
        if last:  # two values of one row swapped: the row's sum stays
            swapped[3, [0, 2]] = swapped[3, [2, 0]]
        _expect(rank, lambda: wrap(lambda: lce_torch.linear_logprobs(swapped, wd, y))(), RuntimeError, differ)
        doubled = 2 * h if last else h  # float64: only the exponents differ, in each value's high 32 bits
        _expect(rank, lambda: wrap(lambda: lce_torch.linear_logprobs(doubled, wd, y))(), RuntimeError, differ)
        one_bf16 = h.bfloat16()
        if last:  # one bf16 value one unit in the last place up
            one_bf16.view(torch.int16)[4, 1] += 1
        _expect(rank, lambda: wrap(lambda: lce_torch.linear_logprobs(one_bf16, wd.bfloat16(), y))(), RuntimeError,
                differ)
        sets = torch.stack([y.clamp(min=0), (y.clamp(min=0) + 3) % V], -1)
        _expect(rank, lambda: wrap(lambda: lce_torch.linear_target_set_logprobs(h_mine, wd, sets))(), RuntimeError,
                differ)
        # Sequence parallel: each rank its own rows of hidden, every rank all the targets.
        rows = distribute_tensor(h.clone(), mesh, [Shard(0)])
        _expect(rank, lambda: wrap(lambda: lce_torch.linear_cross_entropy(rows, wd, y_mine))(), RuntimeError,
                targets_differ)
        torch._dynamo.reset()
    # FSDP itself (fully_shard): its Shard(0) weight, from outside the module's forward, is
    # refused on every rank; inside it the weight is gathered and each rank's loss is its
    # own, the weight's gradient FSDP's mean over the ranks.
    from torch.distributed.fsdp import fully_shard

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = torch.nn.Linear(H, V, bias=False, dtype=torch.float64)

        def forward(self, hidden, targets):
            return lce_torch.linear_cross_entropy(hidden, self.lm.weight, targets)

    head = Head()
    with torch.no_grad():
        head.lm.weight.copy_(w)
    fully_shard(head, mesh=mesh)
    _expect(rank, lambda: lce_torch.linear_cross_entropy(h_mine, head.lm.weight, y), RuntimeError, differ)
    loss = head(h_mine, y_mine)
    loss.backward()
    w1 = w.clone().requires_grad_()
    want = F.cross_entropy(h_mine @ w1.T, y_mine)
    want.backward()
    _close(loss.detach(), want.detach(), "FSDP: each rank's own loss", rank)
    mean_grad = w1.grad.clone()
    dist.all_reduce(mean_grad)
    _close(head.lm.weight.grad.full_tensor(), mean_grad / world, "FSDP: dweight", rank)
    # The group is still usable.
    loss = lce_torch.linear_cross_entropy(h, wd, y)
    _close(loss, F.cross_entropy(h @ w.T, y), "after the refusals", rank)


@pytest.mark.parametrize("world", [2, 3])
def test_dtensor_weight_is_tensor_parallel(world):
    spawn_ranks(_checks, world)
