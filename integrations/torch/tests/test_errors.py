"""Bad input raises a Python exception carrying lce's message (or lce_torch's, for what
torch checks first) and leaves every tensor untouched."""
import pytest
import torch

import lce_torch
from conftest import make


def snapshot(*ts):
    return [t.detach().clone() for t in ts]


def unchanged(before, *ts):
    return all(torch.equal(a, b.detach()) for a, b in zip(before, ts))


@pytest.mark.parametrize("case, match", [
    ("target_out_of_range", r"lce: targets\[3\] = 50 is outside the vocabulary \[0, 50\)"),
    ("hidden_width", r"lce: .*weight.*"),
    ("temperature", r"lce: .*temperature"),
    ("softcap", r"lce: .*softcap"),
    ("dtype_mismatch", r"lce_torch: hidden \(Float\) and weight \(BFloat16\) must have the same dtype"),
    ("targets_float", r"lce_torch: targets must be int32 or int64"),
    ("rows_mismatch", r"lce_torch: targets must have hidden's leading shape \[6\] \(hidden \[6, 8\]\), got \[5\]"),
    ("targets_reshaped", r"lce_torch: targets must have hidden's leading shape \[6\] \(hidden \[6, 8\]\), got \[2, 3\]"),
    # Values that float32, which lce holds them in, would make 0 (the soft-cap silently off),
    # a subnormal (NaN logits) or inf: named as passed.
    ("temperature_subnormal", r"lce: options.temperature = 1e-40 does not fit a normal float32"),
    ("softcap_under_float", r"lce: options.softcap = 1e-50 does not fit a normal float32"),
    ("weight_on_meta", r"lce_torch: hidden, weight, targets \(and bias\) must be on one device"),
])
def test_bad_input_raises_and_changes_nothing(case, match):
    h, w, y = make(6, 8, 50, torch.float32)
    kw = {}
    if case == "target_out_of_range":
        y[3] = 50
    elif case == "hidden_width":
        h = torch.randn(6, 9)
    elif case == "temperature":
        kw["temperature"] = 0.0
    elif case == "softcap":
        kw["softcap"] = -1.0
    elif case == "dtype_mismatch":
        w = w.bfloat16()
    elif case == "targets_float":
        y = y.float()
    elif case == "rows_mismatch":
        y = y[:5]
    elif case == "targets_reshaped":
        y = y.reshape(2, 3)
    elif case == "temperature_subnormal":
        kw["temperature"] = 1e-40
    elif case == "softcap_under_float":
        kw["softcap"] = 1e-50
    elif case == "weight_on_meta":
        w = w.to("meta")
    h.requires_grad_(True)
    before = snapshot(h, w if w.device.type != "meta" else torch.empty(0), y)
    exc = (TypeError, RuntimeError, ValueError)
    with pytest.raises(exc, match=match):
        lce_torch.linear_logprobs(h, w, y, **kw)
    with pytest.raises(exc, match=match):
        lce_torch.linear_cross_entropy(h, w, y, **kw)
    assert unchanged(before, h, w if w.device.type != "meta" else torch.empty(0), y)
    assert h.grad is None


def test_targets_pair_with_hidden_token_for_token():
    # Same count, other shape: each token would be scored against another's target.
    h, w, y = make(6, 8, 50, torch.float32)
    h3, y3 = h.reshape(2, 3, 8), y.reshape(2, 3)
    ids = torch.stack([y3, (y3 + 1) % 50], dim=-1)  # [2, 3, 2]
    with pytest.raises(RuntimeError, match=r"lce_torch: targets must have hidden's leading shape \[2, 3\]"):
        lce_torch.linear_logprobs(h3, w, y3.t())
    with pytest.raises(RuntimeError, match=r"lce_torch: ids must be \[..., K\] with hidden's leading shape \[2, 3\]"):
        lce_torch.linear_target_set_logprobs(h3, w, ids.transpose(0, 1))
    # The fake kernels say the same under torch.compile and on meta tensors.
    with pytest.raises(RuntimeError, match=r"targets must have hidden's leading shape"):
        lce_torch.linear_logprobs(h3.to("meta"), w.to("meta"), y3.t().to("meta"))
    torch.testing.assert_close(lce_torch.linear_logprobs(h3, w, y3), lce_torch.linear_logprobs(h, w, y).reshape(2, 3))


def test_class_weight_must_cover_the_vocabulary():
    h, w, y = make(6, 8, 50, torch.float32)
    for bad in (torch.ones(55), torch.ones(47), torch.ones(50, 1)):
        with pytest.raises(ValueError, match=r"weight \(class weights\) must be \[V\] = \[50\], one per class"):
            lce_torch.linear_cross_entropy(h, w, y, weight=bad)
    with pytest.raises(TypeError, match=r"weight \(class weights\) must be floating point"):
        lce_torch.linear_cross_entropy(h, w, y, weight=torch.ones(50, dtype=torch.int64))


def test_fused_cross_entropy_refuses_create_graph():
    # Its gradients are made in the forward: differentiated again they would be silently 0.
    h, w, y = make(6, 8, 50, torch.float32)
    h.requires_grad_(True)
    loss = lce_torch.linear_cross_entropy(h, w, y)
    with pytest.raises(NotImplementedError, match=r"not differentiable themselves \(no double backward"):
        torch.autograd.grad(loss, h, create_graph=True)
    loss = lce_torch.linear_cross_entropy(h, w, y)
    (g,) = torch.autograd.grad(loss, h)  # without create_graph: as before
    assert torch.isfinite(g).all()


def test_lse_gradient_of_ignored_tokens_with_one_id_vocabulary():
    # ignore_index 0 in a one-id vocabulary leaves no id to carry an ignored token's dL/dlse:
    # that raises instead of dropping the gradient.
    torch.manual_seed(0)
    h = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(1, 8, dtype=torch.float64)
    y = torch.zeros(4, dtype=torch.int64)
    _, lse = lce_torch.linear_logprobs(h, w, y, ignore_index=0, return_lse=True)
    with pytest.raises(RuntimeError, match=r"lce_torch: grad_lse reaches tokens whose target is ignore_index \(0\), "
                                           r"and a vocabulary of 1 id"):
        (lse ** 2).sum().backward()
    assert h.grad is None
    # With another ignore_index, the same z-loss reaches every token (lse = the one logit).
    _, lse = lce_torch.linear_logprobs(h, w, y, ignore_index=-100, return_lse=True)
    (lse ** 2).sum().backward()
    torch.testing.assert_close(h.grad, 2 * (h.detach() @ w.t()) * w)


def test_bad_lse_in_backward_changes_nothing():
    h, w, y = make(6, 8, 50, torch.float32)
    g = torch.ones(6)
    before = snapshot(h, w, y, g)
    with pytest.raises(RuntimeError, match=r"lce_torch: lse has 5 elements, the targets 6"):
        torch.ops.lce.logprobs_backward(g, None, h, w, y, torch.zeros(5))
    assert unchanged(before, h, w, y, g)


def test_vocab_start_without_group():
    h, w, y = make(6, 8, 50, torch.float32)
    with pytest.raises(RuntimeError, match=r"lce: .*vocab_start"):
        lce_torch.linear_logprobs(h, w, y, vocab_start=3)


def test_unknown_group_name():
    h, w, y = make(6, 8, 50, torch.float32)
    with pytest.raises(RuntimeError, match=r"lce: group 'no-such-group' is not a registered"):
        lce_torch.linear_logprobs(h, w, y, group="no-such-group")


def test_blas_info():
    assert lce_torch.blas_info().startswith("BLAS: ")


def test_max_logits_share_outside_zero_to_one_raises():
    h, w, y = make(6, 8, 50, torch.float32)
    h.requires_grad_(True)
    before = snapshot(h, w, y)
    for share in (1.5, -0.1, float("nan")):
        with pytest.raises(RuntimeError, match=r"lce: max_logits_share must be between 0 and 1 .*got"):
            lce_torch.linear_cross_entropy(h, w, y, max_logits_share=share)
    assert unchanged(before, h, w, y)
    assert h.grad is None
