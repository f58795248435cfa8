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
    ("rows_mismatch", r"lce: .*targets"),
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
    h.requires_grad_(True)
    before = snapshot(h, w, y)
    exc = (TypeError, RuntimeError, ValueError)
    with pytest.raises(exc, match=match):
        lce_torch.linear_logprobs(h, w, y, **kw)
    with pytest.raises(exc, match=match):
        lce_torch.linear_cross_entropy(h, w, y, **kw)
    assert unchanged(before, h, w, y)
    assert h.grad is None


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
