"""Tensor parallel on CUDA tensors through torch.distributed, where a GPU and a CUDA build
of lce_torch are: lce's collectives run on the group with device tensors, ordered with
the current stream. Two processes, the vocabulary split (and, under sequence parallelism,
the rows) as in test_distributed.py, equal one process:

* gloo, both processes on one GPU (any CUDA machine): gloo takes CUDA tensors, so this
  runs the same device-memory communicator as NCCL does;
* NCCL, one GPU per process (a machine with two GPUs or more).

Bad input on one rank raises on both, a rank passing CPU tensors beside CUDA ones
included, and a loss with the group takes CUDA log-probs. Elsewhere skipped, saying why."""

import pytest
import torch
import torch.distributed as dist

import lce_torch
from conftest import init_group, spawn_ranks
from test_distributed import _check_errors, _check_tp, _data

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here"),
    pytest.mark.skipif(not lce_torch.built_with_cuda(), reason="this lce_torch was built without CUDA"),
]

WORLD = 2


def _check_mixed_devices(rank, group, backend, device):
    """The last rank passes CPU tensors: it would run the CPU kernel with other collectives."""
    h, w, y = _data(torch.float32, device)
    a, b = (0, 60) if rank == 0 else (60, 101)
    cpu = rank == WORLD - 1
    if cpu:
        h, w, y = h.cpu(), w.cpu(), y.cpu()
    if backend == "gloo":
        match = "the tensors' devices differ across ranks: rank 0 has cuda, rank 1 has cpu"
    else:  # an NCCL group has no backend for CPU tensors: that rank refuses, the others hear it
        match = "has no backend for cpu tensors" if cpu else f"lce_torch: rank {WORLD - 1} rejected its arguments"
    with pytest.raises(RuntimeError, match=match):
        lce_torch.linear_logprobs(h, w[a:b], y, vocab_start=a, group=group)


def _check_loss(rank, group, device):
    """SFT over packed sequences, half of them on each rank: the ranks' losses sum to the
    one-process loss, the normaliser being the global count exchanged through the group."""
    g = torch.Generator().manual_seed(3)
    cu = torch.tensor([0, 3, 8, 10, 14])
    targets = torch.randint(0, 40, (14,), generator=g)
    targets[[1, 9]] = -100
    logp = -3.0 * torch.rand(14, generator=g, dtype=torch.float64)
    whole = lce_torch.sft_loss(logp, targets, cu).loss
    s0, s1 = 2 * rank, 2 * rank + 2
    a, b = int(cu[s0]), int(cu[s1])
    part = lce_torch.sft_loss(logp[a:b].to(device), targets[a:b].to(device), (cu[s0:s1 + 1] - a).to(device),
                              group=group)
    assert part.loss.device == torch.device(device)
    total = part.loss.detach().clone()
    dist.all_reduce(total, group=group)
    torch.testing.assert_close(total.cpu(), whole, atol=1e-12, rtol=1e-12)


def _ranks(rank, world, init_file, backend):
    device = f"cuda:{rank if backend == 'nccl' else 0}"
    torch.cuda.set_device(device)
    group = init_group(rank, world, init_file, backend)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        _check_tp(rank, world, group, dtype, sequence_parallel=False, device=device)
    _check_tp(rank, world, group, torch.float32, sequence_parallel=True, device=device)
    _check_tp(rank, world, group, torch.bfloat16, sequence_parallel=True, device=device)
    _check_errors(rank, world, group, device)
    _check_mixed_devices(rank, group, backend, device)
    _check_loss(rank, group, device)
    torch.cuda.synchronize()


def test_tensor_parallel_gloo_on_one_gpu():
    spawn_ranks(_ranks, WORLD, "gloo")


@pytest.mark.skipif(torch.cuda.device_count() < WORLD or not dist.is_nccl_available(),
                    reason=f"NCCL needs {WORLD} CUDA devices (one per process)")
def test_tensor_parallel_nccl():
    spawn_ranks(_ranks, WORLD, "nccl")
