"""lce's row terms through lce_torch: label smoothing in linear_cross_entropy (against
F.cross_entropy(F.linear(...), label_smoothing=eps)) and gradients through lse (a z-loss,
against autograd through F.linear and torch.logsumexp), gradcheck, torch.compile."""
import pytest
import torch
import torch.nn.functional as F

import lce_torch
from conftest import make

TOLS = {torch.float64: (1e-10, 1e-10), torch.float32: (1e-4, 1e-5)}  # (loss, gradients)


def _weighted_backward(loss):
    """A backward with an uneven upstream gradient (per token for "none")."""
    up = torch.linspace(0.5, 1.5, loss.numel(), dtype=torch.float64).reshape(loss.shape)
    (loss.double() * up).sum().backward()


# ---- label smoothing -----------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("eps", [0.1, 0.3])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("ignore_index", [-100, 5])
def test_label_smoothing_against_torch(dtype, eps, reduction, fused, ignore_index):
    h, w, y = make(48, 32, 211, dtype, ignore=(1, 2, 30), scale=2.0)
    y[y == -100] = ignore_index
    y[7] = ignore_index
    runs = []
    for ours in (True, False):
        hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        if ours:
            loss = lce_torch.linear_cross_entropy(hh, ww, y, reduction=reduction, ignore_index=ignore_index,
                                                  label_smoothing=eps, fused=fused, chunk_tokens=7)
        else:
            loss = F.cross_entropy(F.linear(hh, ww), y, reduction=reduction, ignore_index=ignore_index,
                                   label_smoothing=eps)
        assert loss.dtype == dtype
        _weighted_backward(loss)
        runs.append((loss.detach(), hh.grad, ww.grad))
    tol, gtol = TOLS[dtype]
    torch.testing.assert_close(runs[0][0], runs[1][0], atol=tol, rtol=tol)
    torch.testing.assert_close(runs[0][1], runs[1][1], atol=gtol, rtol=gtol)
    torch.testing.assert_close(runs[0][2], runs[1][2], atol=gtol, rtol=gtol)
    if reduction == "none":
        assert torch.all(runs[0][0][y == ignore_index] == 0)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_label_smoothing_no_grad_and_bfloat16(reduction):
    """Without gradients (the forward op alone), and bfloat16 inputs."""
    h, w, y = make(32, 32, 150, torch.float32, ignore=(4,), scale=2.0)
    with torch.no_grad():
        ours = lce_torch.linear_cross_entropy(h, w, y, reduction=reduction, label_smoothing=0.2)
    ref = F.cross_entropy(F.linear(h, w), y, reduction=reduction, label_smoothing=0.2)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-5)
    hb, wb = h.bfloat16().requires_grad_(True), w.bfloat16().requires_grad_(True)
    loss = lce_torch.linear_cross_entropy(hb, wb, y, reduction=reduction, label_smoothing=0.2)
    # lce keeps the logits in fp32: compare with the float32 reference of the rounded inputs.
    hr, wr = hb.detach().float().requires_grad_(True), wb.detach().float().requires_grad_(True)
    ref = F.cross_entropy(F.linear(hr, wr), y, reduction=reduction, label_smoothing=0.2)
    torch.testing.assert_close(loss.float(), ref, atol=2e-2, rtol=1e-2)
    _weighted_backward(loss)
    _weighted_backward(ref)
    torch.testing.assert_close(hb.grad.float(), hr.grad, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(wb.grad.float(), wr.grad, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("fused", [True, False])
def test_label_smoothing_temperature_softcap(fused):
    """Smoothing applies to the final logits, softcap * tanh(z / softcap) / temperature."""
    h, w, y = make(20, 16, 97, torch.float64, ignore=(3,), scale=3.0)
    t, cap, eps = 0.75, 4.0, 0.3
    hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    loss = lce_torch.linear_cross_entropy(hh, ww, y, label_smoothing=eps, temperature=t, softcap=cap, fused=fused)
    loss.backward()
    hr, wr = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    ref = F.cross_entropy(cap * torch.tanh(F.linear(hr, wr) / cap) / t, y, label_smoothing=eps)
    ref.backward()
    torch.testing.assert_close(loss, ref, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(hh.grad, hr.grad, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(ww.grad, wr.grad, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("fused", [True, False])
def test_gradcheck_float64_label_smoothing(reduction, fused):
    h, w, y = make(6, 5, 9, torch.float64, ignore=(1,))
    h.requires_grad_(True)
    w.requires_grad_(True)

    def f(h, w):
        return lce_torch.linear_cross_entropy(h, w, y, reduction=reduction, label_smoothing=0.3, fused=fused,
                                              chunk_tokens=4)

    assert torch.autograd.gradcheck(f, (h, w), eps=1e-6, atol=1e-8, rtol=1e-6)


def test_label_smoothing_with_class_weights_not_implemented():
    h, w, y = make(4, 8, 11)
    with pytest.raises(NotImplementedError, match="label_smoothing together with weight"):
        lce_torch.linear_cross_entropy(h, w, y, weight=torch.rand(11), label_smoothing=0.1)
    # Class weights without smoothing, and smoothing 0 with class weights, still work.
    lce_torch.linear_cross_entropy(h, w, y, weight=torch.rand(11), label_smoothing=0.0)


# ---- gradients through lse (z-loss) --------------------------------------------


def _reference_lse(h, w, y, ignore_index=-100):
    z = F.linear(h, w)
    lse = torch.logsumexp(z, dim=-1)
    logsm = z - lse.unsqueeze(-1)
    valid = y != ignore_index
    safe = torch.where(valid, y, torch.zeros_like(y))
    logp = torch.where(valid, logsm.gather(-1, safe.unsqueeze(-1)).squeeze(-1), torch.zeros((), dtype=z.dtype))
    ent = torch.where(valid, -(logsm.exp() * logsm).sum(-1), torch.zeros((), dtype=z.dtype))
    return logp, lse, ent


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("ignore_index", [-100, 0])
def test_z_loss_against_materialised(dtype, with_entropy, ignore_index):
    """-mean log p + lam * mean(lse^2) over every token, ignored ones included (their lse
    is real, so its gradient reaches hidden and weight)."""
    h, w, y = make(40, 24, 173, dtype, ignore=(0, 9, 33), scale=2.0)
    y[y == -100] = ignore_index
    lam = 1e-2
    grads = []
    for ours in (True, False):
        hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        if ours:
            out = lce_torch.linear_logprobs(hh, ww, y, with_entropy=with_entropy, return_lse=True,
                                            ignore_index=ignore_index, chunk_tokens=6)
            logp, lse = out[0], out[-1]
            ent = out[1] if with_entropy else None
        else:
            logp, lse, ent = _reference_lse(hh, ww, y, ignore_index)
        loss = -logp.sum() / (y != ignore_index).sum() + lam * (lse**2).mean()
        if with_entropy:
            loss = loss - 0.05 * ent.mean()
        loss.backward()
        grads.append((loss.detach(), lse.detach(), hh.grad, ww.grad))
    tol, gtol = TOLS[dtype]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b.to(a.dtype), atol=gtol if a.dim() == 2 else tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lse_alone(dtype):
    """A loss of lse only (no log-prob term): dL/dlogp comes in as None."""
    h, w, y = make(16, 8, 50, dtype, ignore=(2,))
    hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    _, lse = lce_torch.linear_logprobs(hh, ww, y, return_lse=True)
    (lse.double() * torch.linspace(-1, 2, 16, dtype=torch.float64)).sum().backward()
    hr, wr = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    (torch.logsumexp(F.linear(hr, wr), -1).double() * torch.linspace(-1, 2, 16, dtype=torch.float64)).sum().backward()
    _, gtol = TOLS[dtype]
    torch.testing.assert_close(hh.grad, hr.grad, atol=gtol, rtol=gtol)
    torch.testing.assert_close(ww.grad, wr.grad, atol=gtol, rtol=gtol)


@pytest.mark.parametrize("with_entropy", [False, True])
def test_gradcheck_float64_lse(with_entropy):
    h, w, y = make(6, 5, 9, torch.float64, ignore=(2,), scale=1.5)
    h.requires_grad_(True)
    w.requires_grad_(True)

    def f(h, w):
        return lce_torch.linear_logprobs(h, w, y, with_entropy=with_entropy, return_lse=True, temperature=0.8,
                                         softcap=4.0, chunk_tokens=4)

    assert torch.autograd.gradcheck(f, (h, w), eps=1e-6, atol=1e-8, rtol=1e-6)


def test_backward_op_grad_lse_on_ignored_tokens():
    """logprobs_backward with grad_lse: ignored tokens get dL/dlse (their lse is real) and
    nothing of dL/dlogp, dL/dentropy; the caller's targets are left as they were."""
    h, w, y = make(8, 6, 20, torch.float64, ignore=(1, 5))
    _, lse, _, _ = torch.ops.lce.logprobs(h, w, y)
    g, ge, gq = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    y_before = y.clone()
    dx, dw, _ = torch.ops.lce.logprobs_backward(g, ge, h, w, y, lse, gq)
    assert torch.equal(y, y_before)
    hr, wr = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    logp, rlse, ent = _reference_lse(hr, wr, y)
    ((logp * g).sum() + (ent * ge).sum() + (rlse * gq).sum()).backward()
    torch.testing.assert_close(dx, hr.grad, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(dw, wr.grad, atol=1e-12, rtol=1e-10)


# ---- torch.compile -----------------------------------------------------------------


def _smoothed(h, w, y):
    return lce_torch.linear_cross_entropy(torch.tanh(h), w, y, label_smoothing=0.1)


def _smoothed_none(h, w, y):
    return lce_torch.linear_cross_entropy(h, w, y, label_smoothing=0.3, reduction="none").mean()


def _z_loss(h, w, y):
    logp, lse = lce_torch.linear_logprobs(h, w, y, return_lse=True)
    return -logp.mean() + 1e-2 * (lse**2).mean()


@pytest.mark.parametrize("fn", [_smoothed, _smoothed_none, _z_loss], ids=["smoothed", "smoothed_none", "z_loss"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_row_terms(fn, backend):
    torch._dynamo.reset()
    h, w, y = make(32, 16, 101, torch.float32, ignore=(3,))
    counts = torch._dynamo.utils.counters
    counts.clear()
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    results = []
    for f in (fn, compiled):
        hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        loss = f(hh, ww, y)
        loss.backward()
        results.append((loss.detach(), hh.grad, ww.grad))
    assert not counts["graph_break"], dict(counts["graph_break"])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # ... and equal to PyTorch's own.
    hr, wr = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    if fn is _smoothed:
        ref = F.cross_entropy(F.linear(torch.tanh(hr), wr), y, label_smoothing=0.1)
    elif fn is _smoothed_none:
        ref = F.cross_entropy(F.linear(hr, wr), y, label_smoothing=0.3, reduction="none").mean()
    else:
        logp, lse, _ = _reference_lse(hr, wr, y)
        ref = -logp.mean() + 1e-2 * (lse**2).mean()
    ref.backward()
    torch.testing.assert_close(results[1][0], ref.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(results[1][1], hr.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(results[1][2], wr.grad, atol=1e-5, rtol=1e-5)
