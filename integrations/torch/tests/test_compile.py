"""torch.compile(fullgraph=True) traces through the lce ops (fake kernels + autograd):
no graph breaks, same values and gradients as eager."""
import pytest
import torch

import lce_torch
from conftest import make


def loss_fn(h, w, y):
    logp, ent = lce_torch.linear_logprobs(h, w, y, with_entropy=True, temperature=0.9)
    return -(logp.sum() / (y != -100).sum()) - 0.01 * ent.mean()


def ce_fn(h, w, y):
    return lce_torch.linear_cross_entropy(torch.tanh(h), w, y)


@pytest.mark.parametrize("fn", [loss_fn, ce_fn], ids=["logprobs+entropy", "cross_entropy"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph(fn, backend):
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


def test_compile_dynamic_shapes():
    torch._dynamo.reset()
    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager", dynamic=True)
    for n in (8, 13, 21):
        h, w, y = make(n, 16, 50, torch.float32)
        hh = h.clone().requires_grad_(True)
        compiled(hh, w, y).backward()
        hr = h.clone().requires_grad_(True)
        loss_fn(hr, w, y).backward()
        torch.testing.assert_close(hh.grad, hr.grad, atol=1e-6, rtol=1e-5)
