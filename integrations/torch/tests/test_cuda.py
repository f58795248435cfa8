"""lce_torch's CUDA kernels (lce's CUDA backend on the current stream), where a GPU and
a CUDA build of lce_torch are: the float64 materialised reference (computed on the CPU),
the CPU op, the op checks, the losses on CUDA log-probs, a non-default stream, and the
arguments CUDA refuses. Elsewhere every test here is skipped, saying why."""
import pytest
import torch

import lce_torch
from conftest import GRAD_TOL, TOL, make, reference

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here"),
    pytest.mark.skipif(not lce_torch.built_with_cuda(), reason="this lce_torch was built without CUDA"),
]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
OPTS = dict(vocab_start=0, ignore_index=-100, temperature=0.9, softcap=0.0, sequence_parallel=False,
            chunk_tokens=3, workspace_limit_bytes=1 << 20, group_name=None)


def on_cuda(*tensors):
    return [t.cuda() for t in tensors]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk_tokens", [0, 7])
@pytest.mark.parametrize("temperature,softcap", [(1.0, 0.0), (0.8, 4.0)])
def test_against_float64_reference(dtype, chunk_tokens, temperature, softcap):
    h, w, y = make(29, 48, 5001, dtype, ignore=(3, 17), scale=2.0)
    hc, wc, yc = on_cuda(h, w, y)
    hc.requires_grad_(True)
    wc.requires_grad_(True)
    logp, ent, lse = lce_torch.linear_logprobs(hc, wc, yc, with_entropy=True, return_lse=True,
                                               chunk_tokens=chunk_tokens, temperature=temperature, softcap=softcap)
    assert logp.device == hc.device and logp.shape == y.shape
    hr = h.double().requires_grad_(True)
    wr = w.double().requires_grad_(True)
    rl, rlse, rent = reference(hr, wr, y, temperature=temperature, softcap=softcap)
    torch.testing.assert_close(logp.double().cpu(), rl, **TOL[dtype])
    torch.testing.assert_close(lse.double().cpu(), rlse, **TOL[dtype])
    torch.testing.assert_close(ent.double().cpu(), rent, **TOL[dtype])
    gl = torch.linspace(-1, 1, 29, dtype=torch.float64)
    ge = torch.linspace(0.5, -0.3, 29, dtype=torch.float64)
    ((logp.double() * gl.cuda()).sum() + (ent.double() * ge.cuda()).sum()).backward()
    ((rl * gl).sum() + (rent * ge).sum()).backward()
    assert hc.grad.dtype == dtype and wc.grad.dtype == dtype and hc.grad.device == hc.device
    torch.testing.assert_close(hc.grad.double().cpu(), hr.grad, **GRAD_TOL[dtype])
    torch.testing.assert_close(wc.grad.double().cpu(), wr.grad, **GRAD_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy_matches_the_cpu_op(dtype):
    """The fused forward_backward (linear_cross_entropy) on CUDA against the same call on the CPU."""
    h, w, y = make(64, 32, 3001, dtype, ignore=(5,))
    results = []
    for device in ("cpu", "cuda"):
        hd = h.to(device).requires_grad_(True)
        wd = w.to(device).requires_grad_(True)
        loss = lce_torch.linear_cross_entropy(hd, wd, y.to(device))
        loss.backward()
        results.append((loss.double().cpu(), hd.grad.double().cpu(), wd.grad.double().cpu()))
    (l0, gh0, gw0), (l1, gh1, gw1) = results
    torch.testing.assert_close(l1, l0, **TOL[dtype])
    torch.testing.assert_close(gh1, gh0, **GRAD_TOL[dtype])
    torch.testing.assert_close(gw1, gw0, **GRAD_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck(dtype):
    h, w, y = on_cuda(*make(10, 16, 37, dtype, ignore=(4,)))
    h.requires_grad_(True)
    w.requires_grad_(True)
    torch.library.opcheck(torch.ops.lce.logprobs.default, (h, w, y), dict(with_entropy=True, **OPTS))
    g = torch.randn(10, device="cuda")
    torch.library.opcheck(torch.ops.lce.logprobs_forward_backward.default, (h.detach(), w.detach(), y, g), OPTS)


def test_losses_of_cuda_logprobs_run_through_the_host():
    """The losses take CUDA log-probs (their per-token inputs go to the host and back):
    the loss and the hidden gradient through lce's CUDA backward equal the CPU run's."""
    h, w, y = make(40, 16, 301, torch.float32, ignore=(3,))
    results = []
    for device in ("cpu", "cuda"):
        hd = h.to(device).requires_grad_(True)
        logp = lce_torch.linear_logprobs(hd, w.to(device), y.to(device))
        out = lce_torch.sft_loss(logp, y.to(device), torch.tensor([0, 15, 40], device=device))
        assert out.loss.device == hd.device
        out.loss.backward()
        results.append((out.loss.double().cpu(), hd.grad.double().cpu()))
    torch.testing.assert_close(results[1][0], results[0][0], **TOL[torch.float32])
    torch.testing.assert_close(results[1][1], results[0][1], **GRAD_TOL[torch.float32])


def test_the_scratch_comes_from_pytorchs_caching_allocator():
    """torch.cuda's statistics see lce's scratch (cuda_backend_options::allocate), and it is
    given back after the call (set_keep_workspace(False), the default)."""
    n, v, chunk = 512, 32000, 256
    h, w, y = on_cuda(*make(n, 64, v, torch.float32))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    logp = lce_torch.linear_logprobs(h, w, y, chunk_tokens=chunk)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before >= chunk * v * 4  # one chunk's fp32 logit block
    assert torch.cuda.memory_allocated() - before < 1 << 20  # the outputs only
    del logp


def test_a_side_stream_orders_the_work_on_it():
    h, w, y = on_cuda(*make(300, 64, 4099, torch.bfloat16))
    want = lce_torch.linear_logprobs(h, w, y)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = lce_torch.linear_logprobs(h, w, y)
    torch.cuda.current_stream().wait_stream(side)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_refused_on_cuda():
    h, w, y = on_cuda(*make(4, 8, 11, torch.float64))
    with pytest.raises(TypeError, match="float64 runs on the CPU only"):
        lce_torch.linear_logprobs(h, w, y)
    h, w, y = on_cuda(*make(4, 8, 11))
    with pytest.raises(RuntimeError, match="must all be on one CUDA device"):
        lce_torch.linear_logprobs(h, w.cpu(), y)
    with pytest.raises(RuntimeError, match="group 'no_such_group' is not a registered torch.distributed"):
        torch.ops.lce.logprobs(h, w, y, **dict(OPTS, group_name="no_such_group"))
