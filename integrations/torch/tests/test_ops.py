"""torch.library.opcheck on every lce:: op: schema, fake kernel, autograd registration,
AOT dispatch (torch.compile's path)."""
import pytest
import torch

from conftest import make

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
OPTS = dict(vocab_start=0, ignore_index=-100, temperature=0.9, softcap=0.0, sequence_parallel=False,
            chunk_tokens=3, workspace_limit_bytes=1 << 20, group_name=None)


def tensors(dtype, requires_grad, shape=None, target_dtype=torch.int64):
    h, w, y = make(10, 16, 37, dtype, ignore=(4,), shape=shape, target_dtype=target_dtype)
    return h.requires_grad_(requires_grad), w.requires_grad_(requires_grad), y


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck_logprobs(dtype, with_entropy, requires_grad):
    h, w, y = tensors(dtype, requires_grad)
    torch.library.opcheck(torch.ops.lce.logprobs.default, (h, w, y), dict(with_entropy=with_entropy, **OPTS))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_opcheck_logprobs_mean_logit(dtype, with_entropy):
    """The mean-logit output (label smoothing) and the differentiable lse."""
    h, w, y = tensors(dtype, True)
    torch.library.opcheck(torch.ops.lce.logprobs.default, (h, w, y),
                          dict(with_entropy=with_entropy, with_mean_logit=True, **OPTS))


def test_opcheck_logprobs_batched_int32_softcap():
    h, w, y = tensors(torch.float32, True, shape=(2, 5), target_dtype=torch.int32)
    opts = dict(OPTS, softcap=3.0, chunk_tokens=0)
    torch.library.opcheck(torch.ops.lce.logprobs.default, (h, w, y), dict(with_entropy=True, **opts))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("row_terms", ["none", "lse", "lse+mean_logit"])
def test_opcheck_logprobs_backward(dtype, with_entropy, row_terms):
    h, w, y = tensors(dtype, False)
    _, lse, _, _ = torch.ops.lce.logprobs(h, w, y, **OPTS)
    rdt = lse.dtype
    g = torch.randn(10, dtype=rdt)
    ge = torch.randn(10, dtype=rdt) if with_entropy else None
    args = (g, ge, h, w, y, lse)
    if row_terms != "none":
        args += (torch.randn(10, dtype=rdt),)  # grad_lse (the ignored token's too)
    if row_terms == "lse+mean_logit":
        args += (torch.randn(10, dtype=rdt),)  # grad_mean_logit
    torch.library.opcheck(torch.ops.lce.logprobs_backward.default, args, OPTS)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("label_smoothing", [False, True])
def test_opcheck_logprobs_forward_backward(dtype, label_smoothing):
    h, w, y = tensors(dtype, False)
    rdt = torch.float64 if dtype == torch.float64 else torch.float32
    g = torch.randn(10, dtype=rdt)
    if not label_smoothing:
        torch.library.opcheck(torch.ops.lce.logprobs_forward_backward.default, (h, w, y, g), OPTS)
    else:
        c = torch.rand(10, dtype=rdt)
        torch.library.opcheck(torch.ops.lce.logprobs_forward_backward.default, (h, w, y, -0.9 * c, 0.1 * c, -0.1 * c),
                              dict(with_mean_logit=True, **OPTS))


def test_gradient_ops_refuse_double_backward():
    h, w, y = tensors(torch.float64, True)
    g = torch.randn(10, dtype=torch.float64)
    _, dx, dw, _, _, _ = torch.ops.lce.logprobs_forward_backward(h, w, y, g)
    with pytest.raises(NotImplementedError, match="no double backward"):
        (dx.sum() + dw.sum()).backward()


@pytest.mark.parametrize("share", [0.0, 0.1, 1.0])
def test_max_logits_share_keeps_the_values(share):
    # At this shape (bf16, N 1,024, H 16, V 8,000) a share of 1 takes the token order with
    # the whole dW sum, 0.1 and 0 the vocabulary order (the C++ suite counts their logits):
    # the loss and both gradients stay F.cross_entropy's in float64.
    import lce_torch

    h, w, y = make(1024, 16, 8000, torch.bfloat16, seed=3, scale=2.0)
    h.requires_grad_(True)
    w.requires_grad_(True)
    loss = lce_torch.linear_cross_entropy(h, w, y, max_logits_share=share)
    loss.backward()
    hd, wd = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    want = torch.nn.functional.cross_entropy(hd @ wd.T, y)
    want.backward()
    torch.testing.assert_close(loss.double(), want.detach(), atol=0, rtol=1e-2)
    for got, ref in ((h.grad, hd.grad), (w.grad, wd.grad)):
        assert (got.double() - ref).abs().max() <= 2e-2 * ref.abs().max()
