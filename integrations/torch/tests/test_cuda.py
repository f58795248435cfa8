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


def leaf_on(device, t):
    """A fresh leaf copy of t on device (t.to("cpu") would be t itself: its .grad would
    gather both runs', and the CUDA copy of it would be no leaf, its .grad None)."""
    return t.detach().to(device, copy=True).requires_grad_(True)


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
        hd, wd = leaf_on(device, h), leaf_on(device, w)
        loss = lce_torch.linear_cross_entropy(hd, wd, y.to(device))
        loss.backward()
        results.append((loss.double().cpu(), hd.grad.double().cpu(), wd.grad.double().cpu()))
    (l0, gh0, gw0), (l1, gh1, gw1) = results
    # The loss comes back in the input's dtype: two devices' sums may round one
    # step of a 2-byte dtype apart.
    loss_tol = TOL[dtype] if dtype.itemsize > 2 else dict(atol=0.0, rtol=torch.finfo(dtype).eps)
    torch.testing.assert_close(l1, l0, **loss_tol)
    torch.testing.assert_close(gh1, gh0, **GRAD_TOL[dtype])
    torch.testing.assert_close(gw1, gw0, **GRAD_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_with_masked_columns_matches_the_cpu_op(dtype):
    """A head with a bias (some of it -inf: masked columns) on CUDA against the CPU op:
    log-probs, entropy and the gradients of hidden, weight and bias, fused loss included."""
    h, w, y = make(40, 32, 3001, dtype, ignore=(5,), scale=2.0)
    b = (torch.randn(3001, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * 2).to(dtype)
    b[2800:] = float("-inf")
    y = torch.where(y >= 2800, y - 2800, y)
    results = []
    for device in ("cpu", "cuda"):
        hd, wd, bd = (leaf_on(device, t) for t in (h, w, b))
        logp, ent = lce_torch.linear_logprobs(hd, wd, y.to(device), bias=bd, with_entropy=True)
        (logp.double().sum() - 0.3 * ent.double().sum()
         + lce_torch.linear_cross_entropy(hd, wd, y.to(device), linear_bias=bd).double()).backward()
        results.append([t.detach().double().cpu() for t in (logp, ent, hd.grad, wd.grad, bd.grad)])
    cpu, gpu = results
    for k, what in enumerate(("logprobs", "entropy", "dX", "dW", "db")):
        tol = TOL[dtype] if k < 2 else GRAD_TOL[dtype]
        assert torch.isfinite(gpu[k]).all(), what
        torch.testing.assert_close(gpu[k], cpu[k], **tol, msg=lambda m: f"{what}: {m}")
    assert torch.equal(gpu[4][2800:], torch.zeros(201, dtype=torch.float64))


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
        hd = leaf_on(device, h)
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
    # Work out of order would give garbage; the side stream has its own operator and cuBLAS
    # handle, which need not pick the same GEMM kernels (so not bit for bit).
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_refused_on_cuda():
    h, w, y = on_cuda(*make(4, 8, 11, torch.float64))
    with pytest.raises(TypeError, match="float64 runs on the CPU only"):
        lce_torch.linear_logprobs(h, w, y)
    h, w, y = on_cuda(*make(4, 8, 11))
    with pytest.raises(RuntimeError, match="must all be on one CUDA device"):
        lce_torch.linear_logprobs(h, w.cpu(), y)
    with pytest.raises(RuntimeError, match="group 'no_such_group' is not a registered torch.distributed"):
        torch.ops.lce.logprobs(h, w, y, **dict(OPTS, group_name="no_such_group"))
