"""What autograd cannot do through lce_torch raises instead of giving wrong numbers, and
inputs at the edges of their ranges give PyTorch's results: a second derivative through a
loss whose gradient lce makes in its forward (it would be 0), forward-mode AD (PyTorch
drops the tangent of a custom op without a forward rule: a Jacobian of 0), int32 targets
beside an ignore_index beyond int32 (compared as int32 it would wrap onto a real id), a
mean over no tokens (NaN, not 0) and a target without a class weight under torch.compile
(lce's message, not an out-of-bounds gather)."""
import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F

import lce_torch
from conftest import make


def _packed_logprobs(n=6, requires_grad=True):
    g = torch.Generator().manual_seed(1)
    logp = (-torch.rand(n, generator=g, dtype=torch.float64) * 3).requires_grad_(requires_grad)
    targets = torch.randint(0, 10, (n,), generator=g)
    cu = torch.tensor([0, 3, n])
    return logp, targets, cu


def _losses(logp, targets, cu):
    ref = torch.tensor([-2.0, -1.0], dtype=torch.float64)
    adv = torch.tensor([1.0, -0.5], dtype=torch.float64)
    return {
        "sft_loss": lambda lp: lce_torch.sft_loss(lp, targets, cu).loss,
        "dpo_loss": lambda lp: lce_torch.dpo_loss(lp, cu, ref_seq_logprobs=ref, targets=targets).loss,
        "policy_gradient_loss": lambda lp: lce_torch.policy_gradient_loss(
            lp, adv, cu, sequence_advantages=True, old_logprobs=lp.detach() - 0.1).loss,
    }


@pytest.mark.parametrize("name", ["sft_loss", "dpo_loss", "policy_gradient_loss"])
def test_losses_refuse_a_second_derivative(name):
    logp, targets, cu = _packed_logprobs()
    loss_of = _losses(logp, targets, cu)[name]
    with pytest.raises(NotImplementedError, match=rf"lce_torch.{name}: .*no double backward"):
        torch.autograd.grad(loss_of(logp), logp, create_graph=True)
    with pytest.raises(NotImplementedError, match="no double backward"):
        torch.autograd.functional.hessian(loss_of, logp)
    (first,) = torch.autograd.grad(loss_of(logp), logp)  # the first derivative as before
    assert torch.isfinite(first).all() and first.abs().sum() > 0


def test_distill_loss_refuses_a_second_derivative():
    g = torch.Generator().manual_seed(2)
    student = torch.log_softmax(torch.randn(4, 3, generator=g, dtype=torch.float64), 1).requires_grad_()
    teacher = torch.log_softmax(torch.randn(4, 3, generator=g, dtype=torch.float64), 1)
    ids = torch.tensor([[0, 1, 2]] * 4)
    loss = lce_torch.distill_loss(student * 1.0 - 0.5, teacher, ids, torch.tensor([0, 4])).loss
    with pytest.raises(NotImplementedError, match=r"lce_torch.distill_loss: .*no double backward"):
        torch.autograd.grad(loss, student, create_graph=True)


def test_forward_mode_ad_raises():
    h, w, y = make(5, 8, 30, torch.float64)
    tangent = torch.randn_like(h)
    match = r"no forward-mode AD"
    with pytest.raises(NotImplementedError, match=match):
        torch.func.jvp(lambda x: lce_torch.linear_logprobs(x, w, y), (h,), (tangent,))
    with pytest.raises(NotImplementedError, match=match):
        torch.func.jacfwd(lambda x: lce_torch.linear_logprobs(h, x, y))(w)
    with pytest.raises(NotImplementedError, match=match):
        torch.func.jvp(lambda x: lce_torch.linear_target_set_logprobs(x, w, y[:, None]), (h,), (tangent,))
    with fwAD.dual_level():
        with pytest.raises(NotImplementedError, match=match):
            lce_torch.linear_cross_entropy(fwAD.make_dual(h, tangent), w, y)
        logp, targets, cu = _packed_logprobs(requires_grad=False)
        with pytest.raises(NotImplementedError, match=match):
            lce_torch.sft_loss(fwAD.make_dual(logp, torch.ones_like(logp)), targets, cu)
    # The ops called directly refuse a dual tensor too (torch.func.jvp unwraps its tensors
    # before the kernel: only the Python functions above can refuse it).
    n = h.shape[0]
    with fwAD.dual_level():
        dual = fwAD.make_dual(h, tangent)
        for call in (lambda: torch.ops.lce.logprobs(dual, w, y),
                     lambda: torch.ops.lce.logprobs(h, fwAD.make_dual(w, torch.ones_like(w)), y),
                     lambda: torch.ops.lce.target_set_logprobs(dual, w, y[:, None]),
                     lambda: torch.ops.lce.logprobs_forward_backward(dual, w, y, torch.ones(n, dtype=h.dtype)),
                     lambda: torch.ops.lce.logprobs_forward_backward(
                         h, w, y, fwAD.make_dual(torch.ones(n, dtype=h.dtype), torch.ones(n, dtype=h.dtype)))):
            with pytest.raises(NotImplementedError, match=match):
                call()
        # A view that takes its base's tangent lazily (made before the base got one).
        base = torch.zeros_like(h)
        view = base[:]
        base.copy_(dual)
        with pytest.raises(NotImplementedError, match=match):
            torch.ops.lce.logprobs(view, w, y)
        torch.ops.lce.logprobs(dual.detach(), w, y)  # detached: no tangent, no error
        lse = torch.ops.lce.logprobs(h, w, y)[1]
        with pytest.raises(NotImplementedError, match=match):
            torch.ops.lce.logprobs_backward(fwAD.make_dual(torch.ones(n, dtype=h.dtype), torch.ones(n, dtype=h.dtype)),
                                            None, h, w, y, lse)
        logp, targets, cu = _packed_logprobs(requires_grad=False)
        dual_logp = fwAD.make_dual(logp, torch.ones_like(logp))
        with pytest.raises(NotImplementedError, match=match):
            torch.ops.lce.sft_loss(dual_logp, targets, cu)
        with pytest.raises(NotImplementedError, match=match):
            torch.ops.lce.sequence_logprobs(dual_logp, targets, cu)
        with pytest.raises(NotImplementedError, match=match):
            torch.ops.lce.policy_gradient_loss(logp, fwAD.make_dual(torch.ones_like(logp), torch.ones_like(logp)),
                                               targets=targets, cu_seqlens=cu)
    # Reverse mode, and vmap, as before.
    jac = torch.autograd.functional.jacobian(lambda x: lce_torch.linear_logprobs(x, w, y), h)
    want = torch.autograd.functional.jacobian(
        lambda x: torch.log_softmax(x @ w.T, -1).gather(-1, y[:, None]).squeeze(-1), h)
    torch.testing.assert_close(jac, want)


@pytest.mark.parametrize("fused", [True, False])
def test_int32_targets_beside_an_ignore_index_beyond_int32(fused):
    h, w, y = make(12, 8, 30, torch.float64)
    y[::3] = 5  # the id 2**32 + 5 would wrap onto in int32
    h.requires_grad_(True)
    far = 2**32 + 5  # no target equals it: every token counts
    loss = lce_torch.linear_cross_entropy(h, w, y.to(torch.int32), ignore_index=far, fused=fused)
    (got,) = torch.autograd.grad(loss, h)
    want_loss = F.cross_entropy(F.linear(h, w), y)
    (want,) = torch.autograd.grad(want_loss, h)
    torch.testing.assert_close(loss, want_loss)
    torch.testing.assert_close(got, want)
    # The z-loss's gradient reaches the ignored-token path of the backward op.
    logp, lse = lce_torch.linear_logprobs(h, w, y.to(torch.int32), ignore_index=far, return_lse=True)
    (got,) = torch.autograd.grad((lse**2).sum() - logp.sum(), h)
    z = F.linear(h, w)
    (want,) = torch.autograd.grad((torch.logsumexp(z, -1)**2).sum() - torch.log_softmax(z, -1).gather(
        -1, y[:, None]).sum(), h)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("fused", [True, False])
def test_mean_over_no_tokens_is_nan(fused):
    h = torch.zeros(0, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(30, 8, dtype=torch.float64, requires_grad=True)
    y = torch.zeros(0, dtype=torch.int64)
    want = F.cross_entropy(F.linear(h, w), y)
    assert torch.isnan(want)
    loss = lce_torch.linear_cross_entropy(h, w, y, fused=fused)
    assert torch.isnan(loss)
    loss.backward()
    assert torch.equal(w.grad, torch.zeros_like(w))
    with torch.no_grad():
        assert torch.isnan(lce_torch.linear_cross_entropy(h, w, y))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_target_without_class_weight_under_compile_raises_lces_message(backend):
    h, w, y = make(6, 8, 40, torch.float32)
    h.requires_grad_()  # the one-sweep path: the class weights are gathered before lce's call
    y[2] = 43
    torch._dynamo.reset()
    fn = torch.compile(lambda h, w, y, c: lce_torch.linear_cross_entropy(h, w, y, weight=c), fullgraph=True,
                       backend=backend)
    with pytest.raises(Exception, match=r"lce: .*43"):
        fn(h, w, y, torch.rand(40))


def test_fused_gradient_changed_in_place_before_a_second_backward_names_the_cause():
    h, w, y = make(6, 8, 30, torch.float64)
    h.requires_grad_(True)
    loss = lce_torch.linear_cross_entropy(h, w, y)
    (g,) = torch.autograd.grad(loss, h, retain_graph=True)
    g.mul_(2)
    with pytest.raises(RuntimeError, match=r"linear_cross_entropy: a gradient that an earlier backward .* in place"):
        torch.autograd.grad(loss, h)
    # Cloned first, the second backward is as the first.
    loss = lce_torch.linear_cross_entropy(h, w, y)
    (g,) = torch.autograd.grad(loss, h, retain_graph=True)
    first = g.clone()
    g.clone().mul_(2)
    (again,) = torch.autograd.grad(loss, h)
    torch.testing.assert_close(again, first)


def test_class_weights_that_require_grad():
    h, w, y = make(6, 8, 30, torch.float64)
    c = torch.rand(30, dtype=torch.float64, requires_grad=True)
    with pytest.raises(NotImplementedError, match=r"no gradient for weight \(the class weights\)"):
        lce_torch.linear_cross_entropy(h.requires_grad_(), w, y, weight=c).backward()
    h.requires_grad_(False)
    # Unfused (or with only the class weights requiring grad), the loss is made from the log-probs
    # in torch: the class weights' gradient is PyTorch's math.
    loss = lce_torch.linear_cross_entropy(h, w, y, weight=c, fused=False)
    (got,) = torch.autograd.grad(loss, c)
    z = F.linear(h, w)
    cw = c[y]
    want_loss = -(cw * torch.log_softmax(z, -1).gather(-1, y[:, None]).squeeze(-1)).sum() / cw.sum()
    (want,) = torch.autograd.grad(want_loss, c)
    torch.testing.assert_close(loss, want_loss)
    torch.testing.assert_close(got, want)
