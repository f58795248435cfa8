"""An LM head with a bias (lce's with_bias): ``bias=`` of linear_logprobs and
linear_target_set_logprobs, ``linear_bias=`` of linear_cross_entropy. Against a float64
materialised reference (F.linear(h, w, b)), PyTorch's own losses, gradcheck, opcheck,
torch.compile, a bias of -inf (masked columns), bad input, and tensor parallel over gloo."""
import pytest
import torch
import torch.nn.functional as F

import lce_torch
from conftest import GRAD_TOL, TOL, init_group, make, spawn_ranks

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def make_bias(v, dtype, seed=3, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(v, generator=g, dtype=torch.float64) * scale).to(dtype)


def reference(hidden, weight, bias, targets, *, ignore_index=-100, temperature=1.0, softcap=0.0):
    """float64 logprobs, lse, entropy (0 where ignored) of F.linear(hidden, weight, bias), differentiable."""
    temperature = float(torch.tensor(temperature, dtype=torch.float32))  # lce holds both as float32
    softcap = float(torch.tensor(softcap, dtype=torch.float32))
    z = F.linear(hidden.double(), weight.double(), bias.double())
    if softcap > 0:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    logsm = torch.log_softmax(z, dim=-1)
    valid = targets != ignore_index
    safe = torch.where(valid, targets, torch.zeros_like(targets)).long()
    logp = torch.where(valid, logsm.gather(-1, safe.unsqueeze(-1)).squeeze(-1), torch.zeros((), dtype=z.dtype))
    ent = torch.where(valid, -(torch.special.xlogy(logsm.exp(), logsm.exp())).sum(-1), torch.zeros((), dtype=z.dtype))
    return logp, torch.logsumexp(z, dim=-1), ent


def leaves(*ts):
    return [t.detach().clone().requires_grad_(True) for t in ts]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk_tokens", [0, 5])
@pytest.mark.parametrize("temperature,softcap", [(1.0, 0.0), (0.8, 4.0)])
def test_logprobs_with_bias_against_float64_reference(dtype, chunk_tokens, temperature, softcap):
    h, w, y = make(23, 40, 203, dtype, ignore=(2, 19), scale=2.0)
    b = make_bias(203, dtype)
    h1, w1, b1 = leaves(h, w, b)
    logp, ent, lse = lce_torch.linear_logprobs(h1, w1, y, bias=b1, with_entropy=True, return_lse=True,
                                               chunk_tokens=chunk_tokens, temperature=temperature, softcap=softcap)
    hr, wr, br = leaves(h.double(), w.double(), b.double())
    rl, rlse, rent = reference(hr, wr, br, y, temperature=temperature, softcap=softcap)
    torch.testing.assert_close(logp.double(), rl, **TOL[dtype])
    torch.testing.assert_close(lse.double(), rlse, **TOL[dtype])
    torch.testing.assert_close(ent.double(), rent, **TOL[dtype])
    # Without the bias the log-probs differ: it is not ignored.
    assert (lce_torch.linear_logprobs(h, w, y).double() - rl).abs().max() > 0.1
    gl = torch.linspace(-1, 1, 23, dtype=torch.float64)
    ge = torch.linspace(0.5, -0.3, 23, dtype=torch.float64)
    gq = torch.linspace(-0.2, 0.4, 23, dtype=torch.float64)  # a z-loss's dL/dlse, ignored tokens included
    ((logp.double() * gl).sum() + (ent.double() * ge).sum() + (lse.double() * gq).sum()).backward()
    ((rl * gl).sum() + (rent * ge).sum() + (rlse * gq).sum()).backward()
    assert b1.grad.dtype == dtype and b1.grad.shape == b.shape
    torch.testing.assert_close(h1.grad.double(), hr.grad, **GRAD_TOL[dtype])
    torch.testing.assert_close(w1.grad.double(), wr.grad, **GRAD_TOL[dtype])
    torch.testing.assert_close(b1.grad.double(), br.grad, **GRAD_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.15])
@pytest.mark.parametrize("fused", [True, False])
def test_linear_cross_entropy_with_bias_against_torch(dtype, reduction, label_smoothing, fused):
    """linear_bias= against PyTorch's F.linear_cross_entropy(linear_bias=) and
    F.cross_entropy(F.linear(h, w, b)) in the same dtype, and against the latter in float64
    from the same inputs: the loss and the gradients of h, w and b."""
    h, w, y = make(48, 32, 157, dtype, ignore=(1, 30), scale=2.0)
    b = make_bias(157, dtype)
    runs = {}
    for name in ("lce", "plain", "torch_lce", "float64"):
        hh, ww, bb = leaves(h, w, b) if name != "float64" else leaves(h.double(), w.double(), b.double())
        if name == "lce":
            loss = lce_torch.linear_cross_entropy(hh, ww, y, linear_bias=bb, reduction=reduction,
                                                  label_smoothing=label_smoothing, fused=fused)
            assert loss.dtype == dtype
        elif name == "torch_lce":
            loss = F.linear_cross_entropy(hh, ww, y, linear_bias=bb, reduction=reduction,
                                          label_smoothing=label_smoothing)
        else:
            loss = F.cross_entropy(F.linear(hh, ww, bb), y, reduction=reduction, label_smoothing=label_smoothing)
        scale = torch.linspace(0.5, 1.5, loss.numel(), dtype=torch.float64).reshape(loss.shape)
        (loss.double() * scale).sum().backward()
        runs[name] = [t.double() for t in (loss.detach(), hh.grad, ww.grad, bb.grad)]
    # PyTorch rounds bfloat16 logits to bfloat16, lce keeps them in fp32: its gradients are
    # held to the float64 run's, and to PyTorch's own only in float32 and float64.
    tol = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 5e-2}[dtype]
    gtol = {torch.float64: 1e-9, torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    for name in ("plain", "torch_lce", "float64"):
        loss, gh, gw, gb = runs[name]
        torch.testing.assert_close(runs["lce"][0], loss, atol=tol, rtol=tol, msg=lambda m: f"{name}: {m}")
        if dtype == torch.bfloat16 and name != "float64":
            continue
        for k, what in ((1, "dX"), (2, "dW"), (3, "db")):
            # A bf16 GEMM (AMX, MKL) takes dz rounded to bf16: an element's error then follows
            # the size of its terms, not its own (a dW entry whose terms cancel was 0.011 off
            # at 0.088), so that path is held to the largest gradient's scale. The widened
            # path (dz in fp32) keeps the element-wise bound.
            scale = 1.0
            if dtype == torch.bfloat16 and "dz rounded to bf16" in lce_torch.blas_info():
                scale = max(1.0, float(runs[name][k].abs().max()))
            torch.testing.assert_close(runs["lce"][k], runs[name][k], atol=gtol * scale, rtol=gtol,
                                       msg=lambda m: f"{name} {what}: {m}")


@pytest.mark.parametrize("with_entropy", [False, True])
def test_gradcheck_float64_with_bias(with_entropy):
    h, w, y = make(6, 5, 9, torch.float64, ignore=(2,), scale=1.5)
    b = make_bias(9, torch.float64, scale=1.0)

    def f(hh, ww, bb):
        return lce_torch.linear_logprobs(hh, ww, y, bias=bb, with_entropy=with_entropy, return_lse=True,
                                         softcap=3.0, chunk_tokens=4)

    assert torch.autograd.gradcheck(f, tuple(leaves(h, w, b)))
    for reduction in ("mean", "sum"):
        assert torch.autograd.gradcheck(
            lambda hh, ww, bb: lce_torch.linear_cross_entropy(hh, ww, y, linear_bias=bb, reduction=reduction,
                                                              label_smoothing=0.1),
            tuple(leaves(h, w, b)))


def test_gradient_of_the_bias_alone():
    """Only the bias requires grad (a frozen head's bias being tuned): it gets it."""
    h, w, y = make(7, 6, 15, torch.float64, ignore=(3,))
    b = make_bias(15, torch.float64).requires_grad_(True)
    lce_torch.linear_logprobs(h, w, y, bias=b).sum().backward()
    br = b.detach().clone().requires_grad_(True)
    reference(h, w, br, y)[0].sum().backward()
    torch.testing.assert_close(b.grad, br.grad, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_bias_of_minus_inf_masks_its_columns(dtype):
    """Masked columns (padded vocabulary slots): results are the head without them, entropy
    and its gradient included; the masked rows of dW and entries of db get exactly 0."""
    v = 61
    h, w, y = make(17, 24, v, dtype, ignore=(4,), scale=2.0)
    b = make_bias(v, dtype)
    masked = torch.zeros(v, dtype=torch.bool)
    masked[40:] = True
    masked[7] = True
    b[masked] = float("-inf")
    kept = (~masked).nonzero().squeeze(1)
    remap = torch.full((v,), -1, dtype=torch.int64)
    remap[kept] = torch.arange(kept.numel())
    y = torch.where(y == -100, y, kept[y % kept.numel()])  # targets among the kept columns
    yk = torch.where(y == -100, y, remap[y.clamp(min=0)])
    for fused_loss in (False, True):
        h1, w1, b1 = leaves(h, w, b)
        if fused_loss:
            loss = lce_torch.linear_cross_entropy(h1, w1, y, linear_bias=b1, reduction="sum")
            hr, wr, br = leaves(h.double(), w.double()[kept], b.double()[kept])
            ref = F.cross_entropy(F.linear(hr, wr, br), yk, reduction="sum")
            loss.backward()
            ref.backward()
            torch.testing.assert_close(loss.double(), ref, **{k: 100 * t for k, t in TOL[dtype].items()})
        else:
            logp, ent = lce_torch.linear_logprobs(h1, w1, y, bias=b1, with_entropy=True)
            hr, wr, br = leaves(h.double(), w.double()[kept], b.double()[kept])
            rl, _, rent = reference(hr, wr, br, yk)
            torch.testing.assert_close(logp.double(), rl, **TOL[dtype])
            torch.testing.assert_close(ent.double(), rent, **TOL[dtype])
            (logp.double().sum() - 0.5 * ent.double().sum()).backward()
            (rl.sum() - 0.5 * rent.sum()).backward()
        what = "linear_cross_entropy" if fused_loss else "linear_logprobs"
        for t in (h1.grad, w1.grad, b1.grad):
            assert torch.isfinite(t).all(), what
        torch.testing.assert_close(h1.grad.double(), hr.grad, **GRAD_TOL[dtype])
        torch.testing.assert_close(w1.grad.double()[kept], wr.grad, **GRAD_TOL[dtype])
        torch.testing.assert_close(b1.grad.double()[kept], br.grad, **GRAD_TOL[dtype])
        assert torch.equal(w1.grad[masked], torch.zeros_like(w1.grad[masked])), what
        assert torch.equal(b1.grad[masked], torch.zeros_like(b1.grad[masked])), what


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_target_sets_with_bias(dtype):
    h, w, _ = make(11, 16, 53, dtype, scale=2.0)
    b = make_bias(53, dtype)
    ids = torch.randint(0, 53, (11, 4), generator=torch.Generator().manual_seed(9))
    ids[5] = -100
    h1, w1, b1 = leaves(h, w, b)
    logp, lse = lce_torch.linear_target_set_logprobs(h1, w1, ids, bias=b1, return_lse=True)
    hr, wr, br = leaves(h.double(), w.double(), b.double())
    z = F.linear(hr, wr, br)
    rl = torch.log_softmax(z, -1).gather(-1, ids.clamp(min=0)) * (ids != -100)
    torch.testing.assert_close(logp.double(), rl, **TOL[dtype])
    torch.testing.assert_close(lse.double(), torch.logsumexp(z, -1), **TOL[dtype])
    g = torch.linspace(-1, 1, 44, dtype=torch.float64).reshape(11, 4)
    (logp.double() * g).sum().backward()
    (rl * g).sum().backward()
    for got, want in ((h1.grad, hr.grad), (w1.grad, wr.grad), (b1.grad, br.grad)):
        torch.testing.assert_close(got.double(), want, **GRAD_TOL[dtype])


OPTS = dict(vocab_start=0, ignore_index=-100, temperature=0.9, softcap=0.0, sequence_parallel=False,
            chunk_tokens=3, workspace_limit_bytes=1 << 20, group_name=None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_opcheck_with_bias(dtype):
    h, w, y = make(10, 16, 37, dtype, ignore=(4,))
    b = make_bias(37, dtype)
    rdt = torch.float64 if dtype == torch.float64 else torch.float32
    g = torch.randn(10, dtype=rdt)
    ops = torch.ops.lce
    torch.library.opcheck(ops.logprobs.default, (h.requires_grad_(True), w.requires_grad_(True), y,
                                                 b.requires_grad_(True)), dict(with_entropy=True, **OPTS))
    h, w, b = h.detach(), w.detach(), b.detach()
    _, lse, _, _ = ops.logprobs(h, w, y, b, **OPTS)
    torch.library.opcheck(ops.logprobs_backward.default, (g, g.flip(0), h, w, y, lse, g * 0.5, None, b), OPTS)
    torch.library.opcheck(ops.logprobs_forward_backward.default, (h, w, y, g, None, None, b), OPTS)
    ids = torch.randint(0, 37, (10, 3), generator=torch.Generator().manual_seed(2))
    torch.library.opcheck(ops.target_set_logprobs.default, (h, w, ids, b), OPTS)
    _, slse, _, _ = ops.target_set_logprobs(h, w, ids, b, **OPTS)
    torch.library.opcheck(ops.target_set_logprobs_backward.default,
                          (torch.randn(10, 3, dtype=rdt), None, h, w, ids, slse, None, None, b), OPTS)
    # Without a bias grad_bias is [0].
    assert ops.logprobs_backward(g, None, h, w, y, lse, **OPTS)[2].shape == (0,)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_with_bias(backend):
    h, w, y = make(12, 16, 41, torch.float32, ignore=(3,))
    b = make_bias(41, torch.float32)

    def step(hh, ww, bb):
        logp, ent = lce_torch.linear_logprobs(hh, ww, y, bias=bb, with_entropy=True)
        return -logp.mean() - 0.01 * ent.mean() + lce_torch.linear_cross_entropy(hh, ww, y, linear_bias=bb)

    eager = leaves(h, w, b)
    step(*eager).backward()
    compiled = leaves(h, w, b)
    torch.compile(step, fullgraph=True, backend=backend)(*compiled).backward()
    for a, c in zip(eager, compiled):
        torch.testing.assert_close(c.grad, a.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("case, match", [
    ("long", r"lce_torch: bias must be \[V_local\] = \[50\] \(one entry per row of weight\), got \[51\]"),
    ("matrix", r"lce_torch: bias must be \[V_local\] = \[50\] \(one entry per row of weight\), got \[1, 50\]"),
    ("dtype", r"lce_torch: bias \(BFloat16\) must have the dtype of weight \(Float\)"),
])
def test_bad_bias_raises_and_changes_nothing(case, match):
    h, w, y = make(6, 8, 50, torch.float32)
    b = {"long": torch.zeros(51), "matrix": torch.zeros(1, 50), "dtype": torch.zeros(50, dtype=torch.bfloat16)}[case]
    h.requires_grad_(True)
    b.requires_grad_(True)
    before = [t.detach().clone() for t in (h, w, y, b)]
    with pytest.raises((TypeError, RuntimeError), match=match):
        lce_torch.linear_logprobs(h, w, y, bias=b)
    with pytest.raises((TypeError, RuntimeError), match=match):
        lce_torch.linear_cross_entropy(h, w, y, linear_bias=b)
    with pytest.raises((TypeError, RuntimeError), match=match):
        lce_torch.linear_target_set_logprobs(h, w, y.unsqueeze(-1), bias=b)
    assert all(torch.equal(a, t.detach()) for a, t in zip(before, (h, w, y, b)))
    assert h.grad is None and b.grad is None


# ---- tensor parallel (gloo) -----------------------------------------------------

SPLIT = [0, 45, 101]
N, H, V = 20, 16, 101


def _tp_ranks(rank, world, init_file):
    torch.set_num_threads(1)
    group = init_group(rank, world, init_file)
    a, z = SPLIT[rank], SPLIT[rank + 1]
    for dtype in (torch.float32, torch.float64):
        h, w, y = make(N, H, V, dtype, seed=5, ignore=(2, 11), scale=2.0)
        b = make_bias(V, dtype)
        b[90:] = float("-inf")  # masked slots at the end of the last shard
        gl = torch.linspace(-1, 1, N, dtype=torch.float64)
        ge = torch.linspace(0.3, -0.6, N, dtype=torch.float64)
        tol = dict(atol=1e-10, rtol=1e-10) if dtype == torch.float64 else dict(atol=2e-5, rtol=2e-5)
        for sequence_parallel in (False, True):
            h1, w1, b1 = leaves(h, w, b)
            logp1, ent1 = lce_torch.linear_logprobs(h1, w1, y, bias=b1, with_entropy=True)
            ((logp1.double() * gl).sum() + (ent1.double() * ge).sum()).backward()
            rows = slice(rank * N // world, (rank + 1) * N // world) if sequence_parallel else slice(0, N)
            h2, w2, b2 = leaves(h[rows], w[a:z], b[a:z])
            logp2, ent2 = lce_torch.linear_logprobs(h2, w2, y, bias=b2, with_entropy=True, vocab_start=a, group=group,
                                                    sequence_parallel=sequence_parallel)
            ((logp2.double() * gl).sum() + (ent2.double() * ge).sum()).backward()
            what = f"rank {rank}, {dtype}, sequence_parallel {sequence_parallel}"
            torch.testing.assert_close(logp2, logp1, **tol, msg=lambda m: f"{what} logprobs: {m}")
            torch.testing.assert_close(ent2, ent1, **tol, msg=lambda m: f"{what} entropy: {m}")
            torch.testing.assert_close(h2.grad, h1.grad[rows], **tol, msg=lambda m: f"{what} dX: {m}")
            torch.testing.assert_close(w2.grad, w1.grad[a:z], **tol, msg=lambda m: f"{what} dW: {m}")
            torch.testing.assert_close(b2.grad, b1.grad[a:z], **tol, msg=lambda m: f"{what} db: {m}")
        # The fused cross-entropy with the group.
        h3, w3, b3 = leaves(h, w, b)
        lce_torch.linear_cross_entropy(h3, w3, y, linear_bias=b3).backward()
        h4, w4, b4 = leaves(h, w[a:z], b[a:z])
        lce_torch.linear_cross_entropy(h4, w4, y, linear_bias=b4, group=group, vocab_start=a).backward()
        torch.testing.assert_close(b4.grad, b3.grad[a:z], **tol)
        torch.testing.assert_close(h4.grad, h3.grad, **tol)

    # A bias on one rank only: every rank raises, naming both calls; nothing is written.
    h, w, y = make(N, H, V, torch.float32, seed=5)
    bias = make_bias(V, torch.float32)[a:z] if rank == 1 else None
    with pytest.raises(RuntimeError, match=r"the call differs across ranks: rank 0 makes forward\(logprobs, lse\), "
                                           r"rank 1 makes forward\(logprobs, lse, bias\)"):
        lce_torch.linear_logprobs(h, w[a:z], y, bias=bias, vocab_start=a, group=group)
    # A bad bias on rank 0 only: rank 0 gets its own message, rank 1 lce_torch's agreement.
    bad = torch.zeros(z - a + 1) if rank == 0 else torch.zeros(z - a)
    match = "lce_torch: bias must be" if rank == 0 else "lce_torch: rank 0 rejected its arguments"
    with pytest.raises(RuntimeError, match=match):
        lce_torch.linear_logprobs(h, w[a:z], y, bias=bad, vocab_start=a, group=group)
    lce_torch.linear_logprobs(h, w[a:z], y, bias=torch.zeros(z - a), vocab_start=a, group=group)  # the group still works


def test_tensor_parallel_gloo_with_bias():
    spawn_ranks(_tp_ranks, 2)
