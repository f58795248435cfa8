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


def test_every_tensor_op_is_left_out_of_cuda_graphs():
    # On CUDA a call synchronises its stream (the targets' check) and a first call creates a
    # cuBLAS handle: inductor's CUDA graphs (mode="reduce-overhead") must leave the ops out,
    # which they do only for ops tagged cudagraph_unsafe.
    import torch._C

    host_only = {"blas_info", "set_keep_workspace", "set_bf16_gemm", "built_with_cuda", "agree_on_group"}
    names = sorted({s.name.split("::", 1)[1] for s in torch._C._jit_get_all_schemas() if s.name.startswith("lce::")})
    tensor_ops = [n for n in names if n not in host_only]
    assert len(tensor_ops) == 13, tensor_ops
    untagged = [n for n in tensor_ops if torch.Tag.cudagraph_unsafe not in getattr(torch.ops.lce, n).default.tags]
    assert untagged == []
