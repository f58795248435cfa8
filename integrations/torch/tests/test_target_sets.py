"""Target sets (ids [..., K]: K log-probs per token, e.g. a teacher's top-K) and the
distillation loss from a teacher's top-K, against references materialised in float64:
values and gradients, every dtype, opcheck / gradcheck, bad input, torch.compile, and
2-process gloo tensor parallelism equal to one process."""

import pytest
import torch
import torch.distributed as dist

import lce_torch
from conftest import GRAD_TOL, TOL, init_group, spawn_ranks

IGNORE = -100
F64 = dict(atol=1e-10, rtol=1e-10)


def set_data(lead, h, v, k, dtype=torch.float64, seed=0, scale=1.0, id_dtype=torch.int64):
    """hidden [*lead, H], weight [V, H], ids [*lead, K]: K distinct ids per token, some
    entries ignore_index (id 0 of token 1, ids 1 and 3 of token 4) and token 2 with
    all of its ids ignored (needs N >= 5, K >= 4)."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for d in lead:
        n *= d
    hidden = (torch.randn(n, h, generator=g, dtype=torch.float64) * scale).to(dtype)
    weight = (torch.randn(v, h, generator=g, dtype=torch.float64) / h**0.5).to(dtype)
    ids = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(n)])
    ids[1, 0] = IGNORE
    ids[2, :] = IGNORE
    ids[4, 1] = IGNORE
    ids[4, 3] = IGNORE
    return hidden.reshape(*lead, h), weight, ids.reshape(*lead, k).to(id_dtype)


def logits(hidden, weight, temperature=1.0, softcap=0.0):
    # lce's options hold temperature and softcap as float32.
    temperature = float(torch.tensor(temperature, dtype=torch.float32))
    softcap = float(torch.tensor(softcap, dtype=torch.float32))
    z = hidden.double() @ weight.double().T
    if softcap > 0:
        z = softcap * torch.tanh(z / softcap)
    return z / temperature


def reference(hidden, weight, ids, **kw):
    """log_softmax(F.linear(h, w)).gather(-1, ids), 0 at ignored ids; lse; entropy and
    mean logit (0 for a token whose ids are all ignored). Differentiable."""
    z = logits(hidden, weight, **kw)
    logsm = torch.log_softmax(z, dim=-1)
    valid = ids != IGNORE
    safe = torch.where(valid, ids, torch.zeros_like(ids)).long()
    logp = torch.where(valid, logsm.gather(-1, safe), torch.zeros((), dtype=z.dtype))
    counted = valid.any(-1)
    zero = torch.zeros((), dtype=z.dtype)
    ent = torch.where(counted, -(logsm.exp() * logsm).sum(-1), zero)
    mean = torch.where(counted, z.mean(-1), zero)
    return logp, torch.logsumexp(z, dim=-1), ent, mean


def upstream(shape, k, seed=1):
    """Gradients of a loss with respect to log-probs [*shape, K] and the row terms [*shape]."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, k, generator=g, dtype=torch.float64),
            *(torch.randn(*shape, generator=g, dtype=torch.float64) for _ in range(3)))


def loss_of(outs, grads):
    return sum((o.double() * g).sum() for o, g in zip(outs, grads))


# ---- log-probs of K ids per token ---------------------------------------------------


@pytest.mark.parametrize("lead", [(13,), (3, 5)], ids=["packed", "batched"])
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("options", [{}, dict(temperature=0.7, softcap=4.0, chunk_tokens=4)],
                         ids=["plain", "temperature-softcap-chunks"])
def test_values_and_gradients_float64(lead, id_dtype, options):
    h, w, ids = set_data(lead, 16, 37, 5, scale=2.0, id_dtype=id_dtype)
    ref_kw = {k: v for k, v in options.items() if k != "chunk_tokens"}
    hr, wr = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    want = reference(hr, wr, ids.long(), **ref_kw)
    hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    logp, ent, lse, mean = lce_torch.linear_target_set_logprobs(hh, ww, ids, with_entropy=True, return_lse=True,
                                                                return_mean_logit=True, **options)
    got = (logp, lse, ent, mean)
    assert logp.shape == ids.shape and logp.dtype == torch.float64 and lse.shape == ids.shape[:-1]
    for name, a, b in zip(("logprobs", "lse", "entropy", "mean_logit"), got, want):
        torch.testing.assert_close(a, b.detach(), **F64, msg=lambda m: f"{name}: {m}")
    # Ignored ids give exactly 0; the token whose ids are all ignored has entropy 0 and a real lse.
    flat = logp.reshape(-1, 5)
    assert flat[1, 0].item() == 0.0 and flat[2].abs().sum().item() == 0.0 and flat[4, 1].item() == 0.0
    assert ent.reshape(-1)[2].item() == 0.0 and lse.reshape(-1)[2].item() != 0.0
    # Every output's gradient at once (the lse of the all-ignored token included: a z-loss).
    grads = upstream(lead, 5)
    loss_of(want, grads).backward()
    loss_of(got, grads).backward()
    torch.testing.assert_close(hh.grad, hr.grad, **F64)
    torch.testing.assert_close(ww.grad, wr.grad, **F64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtypes(dtype):
    h, w, ids = set_data((11,), 24, 53, 6, dtype=dtype, scale=1.5)
    hr, wr = h.double().requires_grad_(True), w.double().requires_grad_(True)
    want = reference(hr, wr, ids)
    hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    logp, ent, lse = lce_torch.linear_target_set_logprobs(hh, ww, ids, with_entropy=True, return_lse=True)
    assert logp.dtype == torch.float32
    for a, b in zip((logp, lse, ent), want[:3]):
        torch.testing.assert_close(a.double(), b.detach(), **TOL[dtype])
    grads = upstream((11,), 6)
    loss_of(want[:3], grads[:3]).backward()
    loss_of((logp, lse, ent), grads[:3]).backward()
    assert hh.grad.dtype == dtype and ww.grad.dtype == dtype
    torch.testing.assert_close(hh.grad.double(), hr.grad, **GRAD_TOL[dtype])
    torch.testing.assert_close(ww.grad.double(), wr.grad, **GRAD_TOL[dtype])


def test_one_id_per_token_is_linear_logprobs():
    # K = 1 is the plain per-token operator: the same log-probs and gradients.
    h, w, ids = set_data((9,), 16, 31, 4, dtype=torch.float32)
    y = ids[:, :1]
    h1, w1 = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    a = lce_torch.linear_target_set_logprobs(h1, w1, y)
    (a.squeeze(-1) * torch.linspace(-1, 1, 9)).sum().backward()
    h2, w2 = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    b = lce_torch.linear_logprobs(h2, w2, y.squeeze(-1))
    (b * torch.linspace(-1, 1, 9)).sum().backward()
    torch.testing.assert_close(a.squeeze(-1), b, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(h1.grad, h2.grad, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(w1.grad, w2.grad, atol=1e-6, rtol=1e-6)


def test_strided_inputs():
    # Non-contiguous hidden and ids (copied to lce's dense layout) give the contiguous results.
    h, w, ids = set_data((10,), 16, 29, 4)
    ids_t = ids.T.contiguous().T  # same values, column-major
    h_t = h.T.contiguous().T
    assert not ids_t.is_contiguous() and not h_t.is_contiguous()
    torch.testing.assert_close(lce_torch.linear_target_set_logprobs(h_t, w, ids_t),
                               lce_torch.linear_target_set_logprobs(h, w, ids), atol=0, rtol=0)


def test_gradcheck_float64():
    h, w, ids = set_data((6,), 5, 11, 4)
    h.requires_grad_(True)
    w.requires_grad_(True)

    def fn(hh, ww):
        logp, ent, lse = lce_torch.linear_target_set_logprobs(hh, ww, ids, with_entropy=True, return_lse=True,
                                                              temperature=0.8)
        return logp, ent, lse

    assert torch.autograd.gradcheck(fn, (h, w), eps=1e-6, atol=1e-8, rtol=1e-6)


OPTS = dict(vocab_start=0, ignore_index=IGNORE, temperature=0.9, softcap=0.0, sequence_parallel=False,
            chunk_tokens=3, workspace_limit_bytes=1 << 20, group_name=None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck_target_set_ops(dtype, requires_grad):
    h, w, ids = set_data((7,), 8, 19, 4, dtype=dtype)
    h.requires_grad_(requires_grad)
    w.requires_grad_(requires_grad)
    torch.library.opcheck(torch.ops.lce.target_set_logprobs.default, (h, w, ids),
                          dict(with_entropy=True, with_mean_logit=True, **OPTS))
    _, lse, _, _ = torch.ops.lce.target_set_logprobs(h.detach(), w.detach(), ids, **OPTS)
    g = torch.randn(7, 4, dtype=lse.dtype)
    torch.library.opcheck(torch.ops.lce.target_set_logprobs_backward.default,
                          (g, None, h.detach(), w.detach(), ids, lse, torch.ones_like(lse)), OPTS)


# ---- distillation --------------------------------------------------------------------

LENGTHS = (4, 0, 6, 3)


def distill_data(k=5, v=41, h=12, seed=3, dtype=torch.float64):
    """A student (hidden, weight), a teacher's full distribution and its top-K ids and
    log-probs over packed sequences; some ids ignored (teacher entries there NaN: lce must
    not read them), token 2's ids all ignored; targets and weights mask tokens."""
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    n = int(cu[-1])
    hidden = (torch.randn(n, h, generator=g, dtype=torch.float64) * 1.5).to(dtype)
    weight = (torch.randn(v, h, generator=g, dtype=torch.float64) / h**0.5).to(dtype)
    teacher_full = torch.log_softmax(2.0 * torch.randn(n, v, generator=g, dtype=torch.float64), -1)
    teacher, ids = teacher_full.topk(k, dim=-1)
    ids = ids.clone()
    teacher = teacher.clone()
    ids[1, 0] = IGNORE
    ids[2, :] = IGNORE
    ids[5, 2] = IGNORE
    teacher[ids == IGNORE] = float("nan")
    targets = torch.zeros(n, dtype=torch.int64)
    targets[7] = IGNORE
    weights = torch.tensor([0.5, 1.0, 2.0])[torch.randint(0, 3, (n,), generator=g)]
    weights[9] = 0.0
    return dict(hidden=hidden, weight=weight, teacher=teacher, ids=ids, cu=cu, targets=targets, weights=weights, n=n)


def reference_distill(student_logsm, d, tail, reduction, use_batch=True):
    """The distillation loss written out: per token, KL over the teacher's valid top-K ids
    from the student's full softmax (bucket: plus the tails as one outcome;
    renormalise: the teacher renormalised), reduced over counted tokens."""
    ids, teacher, cu = d["ids"], d["teacher"], d["cu"]
    n = ids.shape[0]
    valid = ids != IGNORE
    safe = torch.where(valid, ids, torch.zeros_like(ids))
    q = student_logsm.gather(-1, safe)
    p = torch.where(valid, teacher, torch.full_like(teacher, -torch.inf)).exp()
    logp_t = torch.where(valid, teacher, torch.zeros_like(teacher))
    # A token without ids has no mass (1 in its place keeps NaN out of the reference's gradient).
    p_mass = torch.where(valid.any(-1), p.sum(-1), torch.ones((), dtype=p.dtype))
    if tail == "bucket":
        kl = (p * (logp_t - q)).sum(-1)
        r_t = 1 - p_mass
        r_s = 1 - torch.where(valid, q.exp(), torch.zeros_like(q)).sum(-1)
        kl = kl + r_t * (torch.log(r_t) - torch.log(r_s))
    else:
        ph = p / p_mass.unsqueeze(-1)
        kl = (ph * (logp_t - torch.log(p_mass).unsqueeze(-1) - q)).sum(-1)
    w = d["weights"].double() if use_batch else torch.ones(n, dtype=torch.float64)
    counted = valid.any(-1) & (w != 0)
    if use_batch:
        counted &= d["targets"] != IGNORE
    wk = torch.where(counted, w * kl, torch.zeros((), dtype=torch.float64))
    if reduction == "token_mean":
        return wk.sum() / counted.sum()
    total, seqs = 0.0, 0
    for s in range(len(cu) - 1):
        a, b = int(cu[s]), int(cu[s + 1])
        ns = int(counted[a:b].sum())
        if ns:
            total = total + wk[a:b].sum() / ns
            seqs += 1
    return total / seqs


@pytest.mark.parametrize("tail", ["bucket", "renormalise"])
@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean"])
def test_distill_loss_against_materialised_kl(tail, reduction):
    d = distill_data()
    hr, wr = d["hidden"].clone().requires_grad_(True), d["weight"].clone().requires_grad_(True)
    want = reference_distill(torch.log_softmax(logits(hr, wr), -1), d, tail, reduction)
    want.backward()
    hh, ww = d["hidden"].clone().requires_grad_(True), d["weight"].clone().requires_grad_(True)
    logq = lce_torch.linear_target_set_logprobs(hh, ww, d["ids"])
    out = lce_torch.distill_loss(logq, d["teacher"], d["ids"], d["cu"], targets=d["targets"], weights=d["weights"],
                                 reduction=reduction, tail=tail)
    out.loss.backward()
    torch.testing.assert_close(out.loss, want.detach(), **F64)
    torch.testing.assert_close(hh.grad, hr.grad, **F64)
    torch.testing.assert_close(ww.grad, wr.grad, **F64)
    # Metrics: counted tokens are those with a target, a weight and an id (not 2, 7, 9).
    counted = [i for i in range(d["n"]) if i not in (2, 7, 9)]
    assert out.tokens.item() == len(counted)
    valid = d["ids"] != IGNORE
    p = torch.where(valid, d["teacher"], torch.full_like(d["teacher"], -torch.inf)).exp().sum(-1)
    q = torch.where(valid, logq.detach(), torch.full_like(logq, -torch.inf)).exp().sum(-1)
    torch.testing.assert_close(out.teacher_mass, p[counted].sum(), **F64)
    torch.testing.assert_close(out.student_mass, q[counted].sum(), **F64)
    assert out.seq_tokens.tolist() == [3, 0, 4, 3]
    if reduction == "token_mean":
        torch.testing.assert_close(out.kl_sum, want.detach() * len(counted), **F64)
        assert out.normaliser.item() == len(counted)
    torch.testing.assert_close(out.seq_kl.sum(), out.kl_sum, **F64)


def test_distill_all_tokens_and_batched_layout():
    # No targets / weights: every token with an id counts; [B, T, K] equals packed [N, K] with cu_seqlens.
    d = distill_data()
    d["cu"] = torch.tensor([0, 4, 8, 13])
    logsm = torch.log_softmax(logits(d["hidden"], d["weight"]), -1)
    want = reference_distill(logsm, dict(d, cu=torch.tensor([0, d["n"]])), "bucket", "token_mean", use_batch=False)
    logq = lce_torch.linear_target_set_logprobs(d["hidden"], d["weight"], d["ids"])
    out = lce_torch.distill_loss(logq, d["teacher"], d["ids"])
    torch.testing.assert_close(out.loss, want, **F64)
    assert out.tokens.item() == d["n"] - 1
    # 12 tokens as 3 sequences of 4, sequence_mean.
    sl = slice(0, 12)
    packed = lce_torch.distill_loss(logq[sl], d["teacher"][sl], d["ids"][sl], torch.tensor([0, 4, 8, 12]),
                                    reduction="sequence_mean")
    batched = lce_torch.distill_loss(logq[sl].reshape(3, 4, -1), d["teacher"][sl].reshape(3, 4, -1),
                                     d["ids"][sl].reshape(3, 4, -1), reduction="sequence_mean")
    assert torch.equal(packed.loss, batched.loss) and torch.equal(packed.seq_kl, batched.seq_kl)
    # int32 ids and cu_seqlens read as the int64 ones, bit for bit.
    narrow = lce_torch.distill_loss(logq[sl], d["teacher"][sl], d["ids"][sl].int(), torch.tensor([0, 4, 8, 12]).int(),
                                    reduction="sequence_mean")
    assert torch.equal(packed.loss, narrow.loss) and torch.equal(packed.seq_kl, narrow.seq_kl)


@pytest.mark.parametrize("tail", ["bucket", "renormalise"])
def test_distill_gradcheck_student_logprobs(tail):
    # dL/dlog q from lce against finite differences, the student log-probs free (mass < 1).
    d = distill_data(k=4)
    logq = lce_torch.linear_target_set_logprobs(d["hidden"], d["weight"], d["ids"]).detach().requires_grad_(True)

    def fn(lq):
        return lce_torch.distill_loss(lq, d["teacher"], d["ids"], d["cu"], weights=d["weights"], tail=tail).loss

    assert torch.autograd.gradcheck(fn, (logq,), eps=1e-7, atol=1e-8, rtol=1e-6)


def test_distill_float32_and_scaled_gradient():
    d = distill_data(dtype=torch.float32)
    hr, wr = d["hidden"].double().requires_grad_(True), d["weight"].double().requires_grad_(True)
    want = reference_distill(torch.log_softmax(logits(hr, wr), -1), d, "bucket", "token_mean")
    (3.0 * want).backward()
    hh, ww = d["hidden"].clone().requires_grad_(True), d["weight"].clone().requires_grad_(True)
    logq = lce_torch.linear_target_set_logprobs(hh, ww, d["ids"])
    out = lce_torch.distill_loss(logq, d["teacher"], d["ids"], d["cu"], targets=d["targets"], weights=d["weights"])
    assert out.loss.dtype == torch.float32
    (3.0 * out.loss).backward()  # the incoming gradient scales lce's stored one
    torch.testing.assert_close(out.loss.double(), want.detach(), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(hh.grad.double(), hr.grad, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(ww.grad.double(), wr.grad, atol=2e-5, rtol=2e-5)


def test_opcheck_distill_loss():
    d = distill_data()
    logq = lce_torch.linear_target_set_logprobs(d["hidden"], d["weight"], d["ids"]).detach().requires_grad_(True)
    for kw in (dict(tail="bucket"), dict(tail="renormalise", reduction="sequence_mean"), dict(normaliser=7.0)):
        torch.library.opcheck(torch.ops.lce.distill_loss.default,
                              (logq, d["teacher"], d["ids"], d["targets"], d["cu"], d["weights"]), kw)


# ---- bad input -------------------------------------------------------------------------


def snapshot(*ts):
    return [t.detach().clone() for t in ts]


def unchanged(before, *ts):
    # equal_nan: the teacher holds NaN at ignored ids.
    return all(torch.allclose(a, b.detach(), atol=0, rtol=0, equal_nan=True) if a.is_floating_point()
               else torch.equal(a, b) for a, b in zip(before, ts))


@pytest.mark.parametrize("case, match", [
    ("id_out_of_range", r"lce: targets\[3, 2\] = 19 is outside the vocabulary \[0, 19\)"),
    ("ids_float", r"lce_torch: ids must be int32 or int64"),
    ("rows_mismatch", r"lce_torch: ids must be \[\.\.\., K\] with hidden.s leading shape \[\d+\]"),
    ("scalar_ids", r"lce_torch: ids must be \[\.\.\., K\]"),
])
def test_target_set_bad_input(case, match):
    h, w, ids = set_data((7,), 8, 19, 4, dtype=torch.float32)
    if case == "id_out_of_range":
        ids[3, 2] = 19
    elif case == "ids_float":
        ids = ids.float()
    elif case == "rows_mismatch":
        ids = ids[:6]
    elif case == "scalar_ids":
        ids = torch.tensor(3)
    h.requires_grad_(True)
    before = snapshot(h, w, ids)
    with pytest.raises((RuntimeError, TypeError), match=match):
        lce_torch.linear_target_set_logprobs(h, w, ids)
    assert unchanged(before, h, w, ids) and h.grad is None


def test_target_set_backward_bad_grad():
    h, w, ids = set_data((7,), 8, 19, 4, dtype=torch.float32)
    _, lse, _, _ = torch.ops.lce.target_set_logprobs(h, w, ids)
    g = torch.ones(7, 3)
    before = snapshot(h, w, ids, lse, g)
    with pytest.raises(RuntimeError, match=r"lce_torch: grad_logprobs has 21 elements, the ids \[7, 4\]"):
        torch.ops.lce.target_set_logprobs_backward(g, None, h, w, ids, lse)
    assert unchanged(before, h, w, ids, lse, g)


@pytest.mark.parametrize("case, exc, match", [
    ("teacher_positive", RuntimeError, r"lce: teacher_logprobs\[3, 1\] = 0.5 is not a log-probability"),
    ("teacher_mass", RuntimeError, r"lce: teacher_logprobs: the top-K of token 0 hold probability"),
    ("student_inf", RuntimeError, r"lce: student_logprobs\[4, 0\] = -inf is not a finite log-probability"),
    ("shape", RuntimeError, r"lce: teacher_logprobs: \[13, 4\] does not match ids' \[13, 5\]"),
    ("tail", ValueError, r"lce_torch: tail must be 'bucket' or 'renormalise', got 'top'"),
    ("reduction", ValueError, r"lce_torch: reduction must be 'token_mean' or 'sequence_mean'"),
    ("cu_seqlens", RuntimeError, r"lce: cu_seqlens"),
    ("student_dim", ValueError, r"lce_torch.distill_loss: student_logprobs must be packed \[N, K\]"),
])
def test_distill_bad_input(case, exc, match):
    d = distill_data()
    logq = lce_torch.linear_target_set_logprobs(d["hidden"], d["weight"], d["ids"]).detach().requires_grad_(True)
    teacher, ids, cu, kw = d["teacher"].clone(), d["ids"], d["cu"].clone(), {}
    if case == "teacher_positive":
        teacher[3, 1] = 0.5
    elif case == "teacher_mass":
        teacher[0] = -0.1
    elif case == "student_inf":
        logq = logq.detach().clone()
        logq[4, 0] = -torch.inf
        logq.requires_grad_(True)
    elif case == "shape":
        teacher = teacher[:, :4]
    elif case == "tail":
        kw["tail"] = "top"
    elif case == "reduction":
        kw["reduction"] = "mean"
    elif case == "cu_seqlens":
        cu[-1] += 1
    elif case == "student_dim":
        logq = logq.detach()[0].requires_grad_(True)
    before = snapshot(logq, teacher, ids, cu)
    with pytest.raises(exc, match=match):
        lce_torch.distill_loss(logq, teacher, ids, cu, **kw)
    assert unchanged(before, logq, teacher, ids, cu) and logq.grad is None


# ---- torch.compile --------------------------------------------------------------------


def distill_step(hidden, weight, ids, teacher, cu, weights):
    logq, ent = lce_torch.linear_target_set_logprobs(hidden, weight, ids, with_entropy=True)
    out = lce_torch.distill_loss(logq, teacher, ids, cu, weights=weights, tail="renormalise")
    return out.loss - 0.01 * ent.mean(), out.kl_sum


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph(backend):
    torch._dynamo.reset()
    d = distill_data(dtype=torch.float32)
    args = (d["ids"], d["teacher"].float(), d["cu"], d["weights"])
    counts = torch._dynamo.utils.counters
    counts.clear()
    compiled = torch.compile(distill_step, fullgraph=True, backend=backend)
    results = []
    for f in (distill_step, compiled):
        hh, ww = d["hidden"].clone().requires_grad_(True), d["weight"].clone().requires_grad_(True)
        loss, kl_sum = f(hh, ww, *args)
        loss.backward()
        results.append((loss.detach(), kl_sum, hh.grad, ww.grad))
    assert not counts["graph_break"], dict(counts["graph_break"])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_compile_dynamic_shapes():
    torch._dynamo.reset()
    compiled = torch.compile(distill_step, fullgraph=True, backend="aot_eager", dynamic=True)
    for n in (6, 9, 13):
        d = distill_data(dtype=torch.float32)
        cu = torch.tensor([0, 2, n])
        args = (d["ids"][:n], d["teacher"][:n].float(), cu, d["weights"][:n])
        grads = []
        for f in (compiled, distill_step):
            hh = d["hidden"][:n].clone().requires_grad_(True)
            f(hh, d["weight"], *args)[0].backward()
            grads.append(hh.grad)
        torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-5)


# ---- tensor parallel (gloo, 2 processes) -------------------------------------------------

SPLIT = [0, 23, 41]  # vocabulary rows of rank 0 and rank 1 (uneven)


def _check_tp(rank, group, dtype, sequence_parallel=False):
    d = distill_data(dtype=dtype)
    if sequence_parallel:
        # lce's sequence parallelism: every rank holds an equal share of the tokens (12 of 13).
        d = dict(d, n=12, cu=d["cu"].clamp(max=12),
                 **{k: d[k][:12] for k in ("hidden", "teacher", "ids", "targets", "weights")})
    h, w, ids = d["hidden"], d["weight"], d["ids"]
    a, b = SPLIT[rank], SPLIT[rank + 1]
    tol = {torch.float64: 1e-10, torch.float32: 2e-5}[dtype]

    def close(x, y, what):
        torch.testing.assert_close(x, y, atol=tol, rtol=tol, msg=lambda m: f"rank {rank} {dtype}, {what}: {m}")

    def step(hh, ww, **kw):
        # The log-probs and every row term (a z-loss on lse reaches the all-ignored token), then the loss.
        logq, ent, lse = lce_torch.linear_target_set_logprobs(hh, ww, ids, with_entropy=True, return_lse=True, **kw)
        out = lce_torch.distill_loss(logq, d["teacher"].to(logq.dtype), ids, d["cu"], targets=d["targets"],
                                     weights=d["weights"])
        (out.loss + 0.1 * ent.mean() + 0.01 * (lse.double() ** 2).mean()).backward()
        return logq, ent, lse, out

    h1, w1 = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    one = step(h1, w1)
    # This rank's shard (and, under sequence parallelism, its rows of hidden; all the ids).
    n = h.shape[0]
    rows = slice(rank * n // 2, (rank + 1) * n // 2) if sequence_parallel else slice(0, n)
    h2, w2 = h[rows].clone().requires_grad_(True), w[a:b].clone().requires_grad_(True)
    tp = step(h2, w2, vocab_start=a, group=group, sequence_parallel=sequence_parallel)
    for what, x, y in zip(("logprobs", "entropy", "lse"), tp[:3], one[:3]):
        close(x, y, what)
    close(tp[3].loss, one[3].loss, "loss")
    close(h2.grad, h1.grad[rows], "grad_hidden")
    close(w2.grad, w1.grad[a:b], "grad_weight shard")
    if sequence_parallel:
        return

    # Data parallel distillation: each rank its half of the sequences, the normaliser the
    # global count over the group; the ranks' losses sum to the one-process loss.
    logq = one[0].detach()
    s0, s1 = 2 * rank, 2 * rank + 2
    t0, t1 = int(d["cu"][s0]), int(d["cu"][s1])
    mine = lce_torch.distill_loss(logq[t0:t1], d["teacher"][t0:t1].to(logq.dtype), ids[t0:t1],
                                  d["cu"][s0:s1 + 1] - t0, targets=d["targets"][t0:t1],
                                  weights=d["weights"][t0:t1], group=group)
    total = mine.loss.detach().double().clone()
    dist.all_reduce(total, group=group)
    close(total, one[3].loss.detach().double(), "data-parallel loss sum")
    close(mine.normaliser, one[3].normaliser, "data-parallel normaliser")

    # An id outside every shard raises lce's message on both ranks (no hang), nothing touched.
    bad = ids.clone()
    bad[6, 1] = SPLIT[-1] + 2
    before = bad.clone()
    try:
        lce_torch.linear_target_set_logprobs(h, w[a:b], bad, vocab_start=a, group=group)
    except RuntimeError as e:
        assert f"targets[6, 1] = {SPLIT[-1] + 2} is outside the vocabulary" in str(e), f"rank {rank}: {e}"
    else:
        raise AssertionError(f"rank {rank}: no error for an id outside the vocabulary")
    assert torch.equal(bad, before)


def _ranks(rank, world, init_file):
    torch.set_num_threads(1)
    group = init_group(rank, world, init_file)
    for dtype in (torch.float64, torch.float32):
        _check_tp(rank, group, dtype)
    _check_tp(rank, group, torch.float64, sequence_parallel=True)


def test_tensor_parallel_gloo():
    spawn_ranks(_ranks, 2)
