"""lce_torch against PyTorch itself: F.cross_entropy(F.linear(...)), PyTorch's own
F.linear_cross_entropy (reference and chunked paths), a float64 materialised reference,
and torch.autograd.gradcheck in float64."""
import pytest
import torch
import torch.nn.functional as F

import lce_torch
from conftest import GRAD_TOL, TOL, make, reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk_tokens", [0, 1, 7])
def test_logprobs_and_entropy_against_float64_reference(dtype, chunk_tokens):
    h, w, y = make(29, 48, 301, dtype, ignore=(3, 17), scale=2.0)
    h.requires_grad_(True)
    w.requires_grad_(True)
    logp, ent, lse = lce_torch.linear_logprobs(h, w, y, with_entropy=True, return_lse=True,
                                               chunk_tokens=chunk_tokens)
    rdt = torch.float64 if dtype == torch.float64 else torch.float32
    assert logp.dtype == ent.dtype == lse.dtype == rdt and logp.shape == y.shape
    hr = h.detach().double().requires_grad_(True)
    wr = w.detach().double().requires_grad_(True)
    rl, rlse, rent = reference(hr, wr, y)
    torch.testing.assert_close(logp.double(), rl, **TOL[dtype])
    torch.testing.assert_close(lse.double(), rlse, **TOL[dtype])
    torch.testing.assert_close(ent.double(), rent, **TOL[dtype])
    # A loss of both: d/dlogp and d/dentropy flow through lce's backward op.
    gl = torch.linspace(-1, 1, 29, dtype=torch.float64)
    ge = torch.linspace(0.5, -0.3, 29, dtype=torch.float64)
    ((logp.double() * gl).sum() + (ent.double() * ge).sum()).backward()
    ((rl * gl).sum() + (rent * ge).sum()).backward()
    assert h.grad.dtype == dtype and w.grad.dtype == dtype
    torch.testing.assert_close(h.grad.double(), hr.grad, **GRAD_TOL[dtype])
    torch.testing.assert_close(w.grad.double(), wr.grad, **GRAD_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("temperature,softcap", [(0.7, 0.0), (1.0, 5.0), (1.3, 2.0)])
def test_temperature_and_softcap(dtype, temperature, softcap):
    h, w, y = make(13, 32, 97, dtype, scale=3.0)
    h.requires_grad_(True)
    w.requires_grad_(True)
    logp, ent = lce_torch.linear_logprobs(h, w, y, with_entropy=True, temperature=temperature, softcap=softcap)
    hr = h.detach().double().requires_grad_(True)
    wr = w.detach().double().requires_grad_(True)
    rl, _, rent = reference(hr, wr, y, temperature=temperature, softcap=softcap)
    torch.testing.assert_close(logp.double(), rl, **TOL[dtype])
    torch.testing.assert_close(ent.double(), rent, **TOL[dtype])
    (logp.sum() - 0.5 * ent.sum()).backward()
    (rl.sum() - 0.5 * rent.sum()).backward()
    torch.testing.assert_close(h.grad.double(), hr.grad, **GRAD_TOL[dtype])
    torch.testing.assert_close(w.grad.double(), wr.grad, **GRAD_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_against_torch_cross_entropy_reduction_none(dtype):
    """lce vs F.cross_entropy(F.linear(h, w), y, reduction='none') in the same dtype."""
    h, w, y = make(40, 64, 500, dtype, ignore=(0, 5), scale=2.0)
    h1, w1 = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    h2, w2 = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    nll = -lce_torch.linear_logprobs(h1, w1, y)
    ref = F.cross_entropy(F.linear(h2, w2), y, reduction="none")
    # PyTorch rounds the logits to the 2-byte dtype; lce keeps them in fp32.
    tol = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 6e-2, torch.float16: 1e-2}[dtype]
    torch.testing.assert_close(nll.to(dtype), ref, atol=tol, rtol=tol)
    g = torch.rand(40, dtype=torch.float64)
    (nll.double() * g).sum().backward()
    (ref.double() * g).sum().backward()
    gtol = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}[dtype]
    torch.testing.assert_close(h1.grad, h2.grad, atol=gtol, rtol=gtol)
    torch.testing.assert_close(w1.grad, w2.grad, atol=gtol, rtol=gtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("class_weight", [False, True])
@pytest.mark.parametrize("fused", [True, False])
def test_linear_cross_entropy_against_torch(dtype, reduction, class_weight, fused):
    """lce_torch.linear_cross_entropy vs F.linear_cross_entropy (PyTorch's reference path and
    its chunked path) and F.cross_entropy(F.linear(...)): loss and both gradients."""
    h, w, y = make(64, 32, 211, dtype, ignore=(1, 2, 40), scale=2.0)
    # Seeded: the inputs are (make), and the class weights must be too, or a run's bf16
    # rounding of PyTorch's own plain path decides whether the test passes.
    cw = torch.rand(211, generator=torch.Generator().manual_seed(1), dtype=dtype) + 0.5 if class_weight else None
    runs = {}
    for name in ("lce", "plain", "torch_lce", "torch_lce_chunked"):
        hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        if name == "lce":
            loss = lce_torch.linear_cross_entropy(hh, ww, y, weight=cw, reduction=reduction, fused=fused)
        elif name == "plain":
            loss = F.cross_entropy(F.linear(hh, ww), y, weight=cw, reduction=reduction)
        elif name == "torch_lce":
            loss = F.linear_cross_entropy(hh, ww, y, weight=cw, reduction=reduction)
        else:
            if dtype != torch.float32 or class_weight or reduction == "none":
                continue  # the chunked path's supported subset (others fall back with a warning)
            loss = F.linear_cross_entropy(hh, ww, y, reduction=reduction,
                                          options=torch.nn.LinearCrossEntropyOptions(batch_chunk_size=16))
        assert loss.dtype == dtype
        (loss.double() * torch.linspace(0.5, 1.5, loss.numel(), dtype=torch.float64).reshape(loss.shape)).sum().backward()
        runs[name] = (loss.detach(), hh.grad, ww.grad)
    tol = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 5e-2}[dtype]
    gtol = {torch.float64: 1e-9, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    for name, (loss, gh, gw) in runs.items():
        if name == "lce":
            continue
        torch.testing.assert_close(runs["lce"][0], loss, atol=tol, rtol=tol, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(runs["lce"][1], gh, atol=gtol, rtol=gtol, msg=lambda m: f"{name} dX: {m}")
        torch.testing.assert_close(runs["lce"][2], gw, atol=gtol, rtol=gtol, msg=lambda m: f"{name} dW: {m}")


def test_linear_cross_entropy_unsupported_arguments():
    h, w, y = make(4, 8, 11)
    with pytest.raises(NotImplementedError, match="label_smoothing together with weight"):
        lce_torch.linear_cross_entropy(h, w, y, label_smoothing=0.1, weight=torch.ones(11))
    with pytest.raises(ValueError, match="label_smoothing must be between"):
        lce_torch.linear_cross_entropy(h, w, y, label_smoothing=1.5)
    with pytest.raises(ValueError, match="reduction"):
        lce_torch.linear_cross_entropy(h, w, y, reduction="avg")


@pytest.mark.parametrize("with_entropy", [False, True])
def test_gradcheck_float64(with_entropy):
    h, w, y = make(6, 5, 9, torch.float64, ignore=(2,), scale=1.5)
    h.requires_grad_(True)
    w.requires_grad_(True)

    def f(h, w):
        out = lce_torch.linear_logprobs(h, w, y, with_entropy=with_entropy, temperature=0.8, softcap=4.0,
                                        chunk_tokens=4)
        return out if with_entropy else (out,)

    assert torch.autograd.gradcheck(f, (h, w), eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_gradcheck_float64_cross_entropy(reduction):
    h, w, y = make(6, 5, 9, torch.float64, ignore=(1,))
    h.requires_grad_(True)
    w.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda h, w: lce_torch.linear_cross_entropy(h, w, y, reduction=reduction),
                                    (h, w), eps=1e-6, atol=1e-8, rtol=1e-6)


def test_batched_shapes_int32_targets_and_row_strided_inputs():
    """[B, T, H] hidden, int32 targets, and hidden / weight that are row-strided views
    of larger buffers (taken in place by lce: ld = the row stride) give the same results."""
    h, w, y = make(24, 16, 50, torch.float32, ignore=(7,))
    base = lce_torch.linear_logprobs(h, w, y, with_entropy=True)
    hb = torch.zeros(24, 40)
    hb[:, 3:19] = h
    wb = torch.zeros(50, 21)
    wb[:, :16] = w
    h_strided, w_strided = hb[:, 3:19], wb[:, :16]
    assert h_strided.stride() == (40, 1) and not h_strided.is_contiguous()
    out = lce_torch.linear_logprobs(h_strided.reshape(4, 6, 16), w_strided, y.reshape(4, 6).int(), with_entropy=True)
    assert out[0].shape == (4, 6)
    torch.testing.assert_close(out[0].reshape(-1), base[0], atol=0, rtol=0)
    torch.testing.assert_close(out[1].reshape(-1), base[1], atol=0, rtol=0)
    # Gradients through a strided view land in the base buffer's slice.
    hb.requires_grad_(True)
    lp = lce_torch.linear_logprobs(hb[:, 3:19], w, y)
    lp.sum().backward()
    hr = h.clone().requires_grad_(True)
    lce_torch.linear_logprobs(hr, w, y).sum().backward()
    torch.testing.assert_close(hb.grad[:, 3:19], hr.grad, atol=0, rtol=0)
    assert hb.grad[:, :3].abs().sum() == 0
    # A column-major weight (w.t() of a [H, V] tensor) is copied, and still right.
    wt = w.t().contiguous().t()
    torch.testing.assert_close(lce_torch.linear_logprobs(h, wt, y), base[0], atol=0, rtol=0)


def test_no_tokens_and_all_ignored():
    h, w, y = make(0, 8, 11)
    assert lce_torch.linear_logprobs(h, w, y).shape == (0,)
    h, w, y = make(5, 8, 11, ignore=range(5))
    h.requires_grad_(True)
    logp = lce_torch.linear_logprobs(h, w, y)
    assert torch.equal(logp, torch.zeros(5))
    logp.sum().backward()
    assert torch.equal(h.grad, torch.zeros_like(h))


def test_large_logits_finite():
    h, w, y = make(8, 16, 33, torch.float32, scale=1e4)
    logp, ent = lce_torch.linear_logprobs(h, w, y, with_entropy=True)
    rl, _, rent = reference(h, w, y)
    assert torch.isfinite(logp).all() and torch.isfinite(ent).all()
    torch.testing.assert_close(logp.double(), rl, atol=1e-2, rtol=1e-5)


def test_fused_cross_entropy_scaled_and_retain_graph():
    """The fused path scales its stored gradients by the incoming gradient (and hands them
    over as they are for a gradient of 1); backward twice through a retained graph works."""
    h, w, y = make(16, 8, 40, torch.float64)
    for scale in (3.5, 1.0):
        h1, w1 = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        loss = scale * lce_torch.linear_cross_entropy(h1, w1, y)
        loss.backward(retain_graph=True)
        loss.backward()
        h2, w2 = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        (2 * scale * F.cross_entropy(F.linear(h2, w2), y)).backward()
        torch.testing.assert_close(h1.grad, h2.grad, atol=1e-12, rtol=1e-10)
        torch.testing.assert_close(w1.grad, w2.grad, atol=1e-12, rtol=1e-10)
