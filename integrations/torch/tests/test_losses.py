"""lce's training losses (lce_torch.sft_loss, dpo_loss, policy_gradient_loss,
next_token_targets) against independent float64 references written here in plain
PyTorch (loops over the sequences, autograd for the gradients), packed batches
against one call per sequence, the [B, T] layout against the packed one, and the
whole path hidden -> linear_logprobs -> loss -> hidden / weight gradients against a
materialised F.log_softmax(F.linear(...)) and torch.autograd.gradcheck."""
import itertools

import pytest
import torch
import torch.nn.functional as F

import lce_torch
from conftest import make

IGNORE = -100
TIGHT = dict(atol=1e-10, rtol=1e-10)
# float32 log-probs: lce sums in double, the inputs and gradients are float32.
LOOSE = dict(atol=2e-6, rtol=2e-6)


# ---- data -------------------------------------------------------------------------


def cu_of(lengths):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int64)


# Sequences of every kind: long, empty, one token, one whose every token is ignored.
LENGTHS = (5, 0, 1, 7, 3, 4, 2, 6)


def packed(seed=0, lengths=LENGTHS, dtype=torch.float64, weighted=True, vocab=50):
    """Random per-token inputs of a packed batch: log-probs < 0, next-token targets (the
    last token of each sequence ignored, plus a few more), weights in {0, 0.5, 1, 2}
    (exact in float32, which lce's weights are)."""
    g = torch.Generator().manual_seed(seed)
    cu = cu_of(lengths)
    n = int(cu[-1])
    tokens = torch.randint(0, vocab, (n,), generator=g)
    targets = lce_torch.next_token_targets(tokens, cu)
    if len(lengths) > 4:  # sequence 4 then has no counted token at all
        targets[int(cu[4]):int(cu[5])] = IGNORE
    targets[torch.rand(n, generator=g) < 0.15] = IGNORE
    weights = None
    if weighted:
        weights = torch.tensor([0.0, 0.5, 1.0, 2.0])[torch.randint(0, 4, (n,), generator=g)]
        weights[torch.rand(n, generator=g) < 0.6] = 1.0
    logp = (-3.0 * torch.rand(n, generator=g, dtype=torch.float64) - 0.01).to(dtype)
    return dict(cu=cu, targets=targets, weights=weights, logp=logp, n=n, g=g)


def counted_weights(targets, weights):
    w = torch.ones(targets.shape, dtype=torch.float64) if weights is None else weights.double()
    return torch.where(targets != IGNORE, w, torch.zeros((), dtype=torch.float64))


def spans(cu):
    return [(int(cu[s]), int(cu[s + 1])) for s in range(len(cu) - 1)]


def reduce_terms(terms, w, cu, reduction, normaliser=None):
    """The token_mean / sequence_mean reduction of per-token terms (weights applied), by loops."""
    if reduction == "token_mean":
        norm = (w != 0).sum().double() if normaliser is None else normaliser
        return (w * terms).sum() / norm if norm != 0 else (w * terms).sum() * 0
    total, sequences = torch.zeros((), dtype=torch.float64), 0
    for a, b in spans(cu):
        n_s = int((w[a:b] != 0).sum())
        if n_s:
            total = total + (w[a:b] * terms[a:b]).sum() / n_s
            sequences += 1
    norm = sequences if normaliser is None else normaliser
    return total / norm if norm != 0 else total * 0


def leaf(t):
    return t.detach().double().clone().requires_grad_(True)


# ---- next-token targets -------------------------------------------------------------


@pytest.mark.parametrize("token_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
def test_next_token_targets_stay_inside_sequences(token_dtype, cu_dtype):
    lengths = (3, 0, 1, 4, 2)
    cu = cu_of(lengths).to(cu_dtype)
    tokens = torch.arange(100, 100 + sum(lengths), dtype=token_dtype)
    got = lce_torch.next_token_targets(tokens, cu, ignore_index=-7)
    want = []
    for a, b in spans(cu):
        want += [int(tokens[i + 1]) if i + 1 < b else -7 for i in range(a, b)]
    assert got.dtype == token_dtype
    assert got.tolist() == want
    # No cu_seqlens: one sequence; [B, T]: each row a sequence.
    assert lce_torch.next_token_targets(tokens).tolist() == tokens[1:].tolist() + [IGNORE]
    rows = tokens[:10].reshape(2, 5)
    assert lce_torch.next_token_targets(rows).tolist() == [r[1:].tolist() + [IGNORE] for r in rows]


# ---- SFT ----------------------------------------------------------------------------


def reference_sft(logp, targets, cu, weights, reduction, eps=0.0, lse=None, mean_logit=None, normaliser=None):
    w = counted_weights(targets, weights)
    safe = lambda t: torch.where(w != 0, t, torch.zeros((), dtype=t.dtype))  # noqa: E731
    terms = -safe(logp)
    if eps:
        terms = (1 - eps) * terms + eps * (safe(lse) - safe(mean_logit))
    return reduce_terms(terms, w, cu, reduction, normaliser)


@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean"])
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_sft_against_reference(reduction, eps, weighted, dtype):
    d = packed(1, dtype=dtype, weighted=weighted)
    g = d["g"]
    lse = (torch.rand(d["n"], generator=g, dtype=torch.float64) * 2 + 3).to(dtype)
    mean = (torch.rand(d["n"], generator=g, dtype=torch.float64) - 0.5).to(dtype)
    logp, lse, mean = leaf(d["logp"]).to(dtype), leaf(lse).to(dtype), leaf(mean).to(dtype)
    logp.retain_grad(), lse.retain_grad(), mean.retain_grad()
    kw = dict(lse=lse, mean_logit=mean) if eps else {}
    out = lce_torch.sft_loss(logp, d["targets"], d["cu"], weights=d["weights"], reduction=reduction,
                             label_smoothing=eps, **kw)
    assert out.loss.dtype == dtype
    out.loss.backward()
    r = [leaf(t) for t in (logp, lse, mean)]
    ref = reference_sft(r[0], d["targets"], d["cu"], d["weights"], reduction, eps, r[1], r[2])
    ref.backward()
    tol = TIGHT if dtype == torch.float64 else LOOSE
    torch.testing.assert_close(out.loss.double(), ref, **tol)
    torch.testing.assert_close(logp.grad.double(), r[0].grad, **tol)
    if eps:
        torch.testing.assert_close(lse.grad.double(), r[1].grad, **tol)
        torch.testing.assert_close(mean.grad.double(), r[2].grad, **tol)
    w = counted_weights(d["targets"], d["weights"])
    assert int(out.tokens) == int((w != 0).sum())
    assert int(out.sequences) == sum(int((w[a:b] != 0).sum()) > 0 for a, b in spans(d["cu"]))
    torch.testing.assert_close(out.nll_sum, -(w * r[0].detach()).sum(), **tol)
    assert float(out.normaliser) == (int(out.tokens) if reduction == "token_mean" else int(out.sequences))


@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean"])
def test_sft_packed_equals_one_call_per_sequence(reduction):
    d = packed(2)
    logp = leaf(d["logp"])
    whole = lce_torch.sft_loss(logp, d["targets"], d["cu"], weights=d["weights"], reduction=reduction)
    whole.loss.backward()
    # Each sequence alone, divided by the whole batch's count: the shares sum to the loss.
    norm = float(whole.normaliser)
    total, grads = 0.0, []
    for a, b in spans(d["cu"]):
        part = leaf(d["logp"][a:b])
        out = lce_torch.sft_loss(part, d["targets"][a:b], None, weights=d["weights"][a:b], reduction=reduction,
                                 normaliser=norm)
        out.loss.backward()
        total += float(out.loss.detach())
        grads.append(part.grad)
    torch.testing.assert_close(whole.loss, torch.tensor(total, dtype=torch.float64), **TIGHT)
    torch.testing.assert_close(logp.grad, torch.cat(grads), **TIGHT)


def test_padded_layout_equals_packed():
    """[B, T] with a mask is B sequences of T tokens with the mask as weights."""
    d = packed(3, lengths=(6, 6, 6), weighted=False)
    mask = (torch.arange(6) < torch.tensor([[6], [2], [4]])).float()
    logp_bt = leaf(d["logp"].reshape(3, 6))
    logp_packed = leaf(d["logp"])
    for reduction in ("token_mean", "sequence_mean"):
        a = lce_torch.sft_loss(logp_bt, d["targets"].reshape(3, 6), weights=mask, reduction=reduction)
        b = lce_torch.sft_loss(logp_packed, d["targets"], d["cu"], weights=mask.reshape(-1), reduction=reduction)
        torch.testing.assert_close(a.loss, b.loss, **TIGHT)
        a.loss.backward()
        b.loss.backward()
        torch.testing.assert_close(logp_bt.grad.reshape(-1), logp_packed.grad, **TIGHT)
        logp_bt.grad, logp_packed.grad = None, None
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    a = lce_torch.policy_gradient_loss(logp_bt, adv, sequence_advantages=True, weights=mask, reduction="sequence_mean")
    b = lce_torch.policy_gradient_loss(logp_packed, adv, d["cu"], sequence_advantages=True, weights=mask.reshape(-1),
                                       reduction="sequence_mean")
    torch.testing.assert_close(a.loss, b.loss, **TIGHT)
    assert int(a.tokens) == int(mask.sum())


def test_empty_batch_and_no_counted_token():
    empty = torch.zeros(0, dtype=torch.float64, requires_grad=True)
    out = lce_torch.sft_loss(empty, torch.zeros(0, dtype=torch.int64), torch.tensor([0, 0]))
    assert float(out.loss.detach()) == 0.0 and int(out.tokens) == 0
    out.loss.backward()
    assert empty.grad.shape == (0,)
    # Every token ignored: loss 0, gradient 0 (not NaN).
    logp = leaf(-torch.rand(4, dtype=torch.float64))
    out = lce_torch.sft_loss(logp, torch.full((4,), IGNORE), torch.tensor([0, 1, 4]))
    out.loss.backward()
    assert float(out.loss.detach()) == 0.0 and torch.equal(logp.grad, torch.zeros(4, dtype=torch.float64))
    # A batch of one-token sequences: each target is ignored (nothing follows it).
    y = lce_torch.next_token_targets(torch.tensor([3, 4, 5]), torch.tensor([0, 1, 2, 3]))
    assert y.tolist() == [IGNORE] * 3


# ---- DPO ----------------------------------------------------------------------------


def reference_dpo(logp, ref_seq, targets, cu, weights, pairs, beta, sft_coef, length_average):
    w = counted_weights(targets, weights)
    pi, n = [], []
    for a, b in spans(cu):
        n_s = int((w[a:b] != 0).sum())
        s = (w[a:b] * torch.where(w[a:b] != 0, logp[a:b], torch.zeros((), dtype=logp.dtype))).sum()
        pi.append(s / n_s if length_average and n_s else (s if n_s else s * 0))
        n.append(n_s)
    losses, chosen, rejected = [], [], []
    for c, r in pairs:
        rc, rr = beta * (pi[c] - ref_seq[c]), beta * (pi[r] - ref_seq[r])
        nll = 0.0
        if n[c]:
            nll = -pi[c] if length_average else -pi[c] / n[c]
        losses.append(-F.logsigmoid(rc - rr) + sft_coef * nll)
        chosen.append(rc.detach())
        rejected.append(rr.detach())
    loss = torch.stack(losses).sum() / len(pairs)
    chosen, rejected = torch.stack(chosen), torch.stack(rejected)
    metrics = dict(reward_accuracy=(chosen > rejected).double().mean(), mean_margin=(chosen - rejected).mean(),
                   chosen_reward=chosen.mean(), rejected_reward=rejected.mean())
    return loss, metrics


@pytest.mark.parametrize("length_average", [False, True])
@pytest.mark.parametrize("sft_coef", [0.0, 0.5])
@pytest.mark.parametrize("explicit_pairs", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_dpo_against_reference(length_average, sft_coef, explicit_pairs, dtype):
    d = packed(4, dtype=dtype)
    s = len(LENGTHS)
    pairs = [(3, 0), (6, 1), (2, 7), (5, 4)] if explicit_pairs else [(2 * p, 2 * p + 1) for p in range(s // 2)]
    ref_seq = -torch.rand(s, generator=d["g"], dtype=torch.float64) * 10
    logp = leaf(d["logp"]).to(dtype)
    logp.retain_grad()
    out = lce_torch.dpo_loss(logp, d["cu"], ref_seq_logprobs=ref_seq, targets=d["targets"], weights=d["weights"],
                             pairs=torch.tensor(pairs) if explicit_pairs else None, beta=0.7, sft_coef=sft_coef,
                             length_average=length_average)
    out.loss.backward()
    r = leaf(logp)
    ref, metrics = reference_dpo(r, ref_seq, d["targets"], d["cu"], d["weights"], pairs, 0.7, sft_coef,
                                 length_average)
    ref.backward()
    tol = TIGHT if dtype == torch.float64 else LOOSE
    torch.testing.assert_close(out.loss.double(), ref, **tol)
    torch.testing.assert_close(logp.grad.double(), r.grad, **tol)
    for k, v in metrics.items():
        torch.testing.assert_close(getattr(out, k), v, **tol, msg=lambda m, k=k: f"{k}: {m}")
    assert int(out.pairs) == len(pairs) and float(out.normaliser) == len(pairs)
    torch.testing.assert_close(out.dpo_loss + out.sft_loss, out.loss.double(), **tol)


def test_dpo_per_token_reference_equals_per_sequence():
    d = packed(5)
    ref_logp = d["logp"] - 0.3 * torch.rand(d["n"], generator=d["g"], dtype=torch.float64)
    for length_average in (False, True):
        seq, tokens = lce_torch.sequence_logprobs(ref_logp, d["cu"], targets=d["targets"], weights=d["weights"],
                                                  length_average=length_average)
        kw = dict(targets=d["targets"], weights=d["weights"], length_average=length_average, beta=0.2)
        a = lce_torch.dpo_loss(d["logp"], d["cu"], ref_seq_logprobs=seq, **kw)
        b = lce_torch.dpo_loss(d["logp"], d["cu"], ref_logprobs=ref_logp, **kw)
        torch.testing.assert_close(a.loss, b.loss, **TIGHT)
        assert torch.equal(tokens, a.seq_tokens)


def test_dpo_packed_equals_one_call_per_pair():
    d = packed(6)
    s = len(LENGTHS)
    ref_seq = -torch.rand(s, generator=d["g"], dtype=torch.float64) * 10
    logp = leaf(d["logp"])
    kw = dict(weights=d["weights"], beta=0.3, sft_coef=0.2)
    whole = lce_torch.dpo_loss(logp, d["cu"], ref_seq_logprobs=ref_seq, targets=d["targets"], **kw)
    whole.loss.backward()
    total, grads = 0.0, []
    for p in range(s // 2):
        a, b = int(d["cu"][2 * p]), int(d["cu"][2 * p + 2])
        part = leaf(d["logp"][a:b])
        out = lce_torch.dpo_loss(part, d["cu"][2 * p:2 * p + 3] - a, ref_seq_logprobs=ref_seq[2 * p:2 * p + 2],
                                 targets=d["targets"][a:b], normaliser=s // 2, weights=d["weights"][a:b],
                                 beta=0.3, sft_coef=0.2)
        out.loss.backward()
        total += float(out.loss.detach())
        grads.append(part.grad)
    torch.testing.assert_close(whole.loss, torch.tensor(total, dtype=torch.float64), **TIGHT)
    torch.testing.assert_close(logp.grad, torch.cat(grads), **TIGHT)


# ---- policy gradient ------------------------------------------------------------------


def reference_pg(logp, adv, cu, targets, weights, *, old=None, ref=None, gen=None, entropy=None, reduction,
                 eps_low=0.2, eps_high=0.2, dual_clip=0.0, kl_coef=0.0, kl="k3", tis_cap=0.0, entropy_coef=0.0,
                 sequence_advantages=False):
    w = counted_weights(targets, weights)
    if sequence_advantages:
        adv = torch.cat([adv[s].expand(b - a) for s, (a, b) in enumerate(spans(cu))])
    old_ = logp.detach() if old is None else old
    ratio = torch.exp(logp - old_)
    unclipped, clipped = -adv * ratio, -adv * ratio.clamp(1 - eps_low, 1 + eps_high)
    pg = torch.where(unclipped >= clipped, unclipped, clipped)
    dual = torch.zeros_like(pg, dtype=torch.bool)
    if dual_clip:
        dual = (adv < 0) & (-adv * dual_clip < pg)
        pg = torch.where(dual, -adv * dual_clip, pg)
    if tis_cap:
        pg = pg * torch.exp(old_ - gen).clamp(max=tis_cap)
    kl_term = torch.zeros_like(logp)
    if ref is not None:
        delta = ref - logp
        kl_term = torch.exp(delta) - delta - 1 if kl == "k3" else -delta
    ent = torch.zeros_like(logp) if entropy is None else entropy
    terms = pg + kl_coef * kl_term - entropy_coef * ent
    zero = torch.zeros((), dtype=torch.float64)
    terms = torch.where(w != 0, terms, zero)
    loss = reduce_terms(terms, w, cu, reduction)
    c = w != 0
    k = c.sum().double()
    fraction = lambda flags: (flags & c).sum().double() / k  # noqa: E731
    metrics = dict(
        tokens=k,
        clip_frac_low=fraction((adv < 0) & (ratio < 1 - eps_low)),
        clip_frac_high=fraction((adv > 0) & (ratio > 1 + eps_high)),
        dual_clip_frac=fraction(dual),
        approx_kl=torch.where(c, old_ - logp, zero).sum() / k,
        ref_kl=torch.where(c, kl_term, zero).sum() / k,
        mean_entropy=torch.where(c, ent, zero).sum() / k,
        mean_ratio=torch.where(c, ratio, zero).sum() / k,
    )
    return loss, {k_: v.detach() for k_, v in metrics.items()}


PG_CASES = {
    "ppo": dict(),
    "dapo_clip_higher_token_mean": dict(eps_low=0.2, eps_high=0.28),
    "grpo_sequence_adv_k3": dict(reduction="sequence_mean", sequence_advantages=True, kl_coef=0.05),
    "k1_entropy": dict(kl_coef=0.1, kl="k1", entropy_coef=0.01),
    "dual_clip_tis": dict(dual_clip=1.3, tis_cap=1.5, eps_low=0.1, eps_high=0.1),
    "on_policy": dict(on_policy=True, entropy_coef=0.02),
}


@pytest.mark.parametrize("case", list(PG_CASES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_policy_gradient_against_reference(case, dtype):
    opts = dict(PG_CASES[case])
    on_policy = opts.pop("on_policy", False)
    reduction = opts.pop("reduction", "token_mean")
    # Enough tokens that every clip (low, high, dual) is taken somewhere.
    lengths = LENGTHS * 3
    d = packed(7, lengths=lengths, dtype=dtype)
    g, n = d["g"], d["n"]
    seq_adv = opts.get("sequence_advantages", False)
    adv = torch.randn(len(lengths) if seq_adv else n, generator=g, dtype=torch.float64).to(dtype)
    # Ratios spread over both sides of the clip range (and past the dual clip).
    old = None if on_policy else (d["logp"].double() + 0.6 * torch.randn(n, generator=g, dtype=torch.float64)).to(dtype)
    ref = (d["logp"].double() + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)).to(dtype)
    gen = (d["logp"].double() + 0.4 * torch.randn(n, generator=g, dtype=torch.float64)).to(dtype)
    entropy = (torch.rand(n, generator=g, dtype=torch.float64) * 3).to(dtype)
    inputs = dict(old_logprobs=old, entropy=entropy)
    if opts.get("kl_coef"):
        inputs["ref_logprobs"] = ref
    if opts.get("tis_cap"):
        inputs["generation_logprobs"] = gen
    logp, ent = leaf(d["logp"]).to(dtype), leaf(entropy).to(dtype)
    logp.retain_grad(), ent.retain_grad()
    out = lce_torch.policy_gradient_loss(logp, adv, d["cu"], targets=d["targets"], weights=d["weights"],
                                         reduction=reduction, **{**inputs, "entropy": ent}, **opts)
    out.loss.backward()
    r, re = leaf(logp), leaf(ent)
    ref_loss, metrics = reference_pg(
        r, adv.double(), d["cu"], d["targets"], d["weights"], old=None if old is None else old.double(),
        ref=ref.double() if "ref_logprobs" in inputs else None,
        gen=gen.double() if "generation_logprobs" in inputs else None, entropy=re, reduction=reduction, **opts)
    ref_loss.backward()
    tol = TIGHT if dtype == torch.float64 else dict(atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out.loss.double(), ref_loss, **tol)
    torch.testing.assert_close(logp.grad.double(), r.grad, **tol)
    torch.testing.assert_close(ent.grad.double(), re.grad, **tol)
    for k, v in metrics.items():
        torch.testing.assert_close(getattr(out, k).double(), v.double(), **tol, msg=lambda m, k=k: f"{k}: {m}")
    torch.testing.assert_close(out.pg_loss + out.kl_loss + out.entropy_loss, out.loss.double(), **tol)
    if case == "dual_clip_tis":
        assert float(out.dual_clip_frac) > 0 and float(out.clip_frac_low) > 0 and float(out.clip_frac_high) > 0


def test_policy_gradient_packed_equals_one_call_per_sequence():
    d = packed(8)
    g, n = d["g"], d["n"]
    adv = torch.randn(len(LENGTHS), generator=g, dtype=torch.float64)
    old = d["logp"] + 0.5 * torch.randn(n, generator=g, dtype=torch.float64)
    logp = leaf(d["logp"])
    kw = dict(reduction="sequence_mean", sequence_advantages=True, eps_high=0.28)
    whole = lce_torch.policy_gradient_loss(logp, adv, d["cu"], old_logprobs=old, targets=d["targets"],
                                           weights=d["weights"], **kw)
    whole.loss.backward()
    total, grads = 0.0, []
    for s, (a, b) in enumerate(spans(d["cu"])):
        part = leaf(d["logp"][a:b])
        out = lce_torch.policy_gradient_loss(part, adv[s:s + 1], old_logprobs=old[a:b], targets=d["targets"][a:b],
                                             weights=d["weights"][a:b], normaliser=float(whole.normaliser), **kw)
        out.loss.backward()
        total += float(out.loss.detach())
        grads.append(part.grad)
    torch.testing.assert_close(whole.loss, torch.tensor(total, dtype=torch.float64), **TIGHT)
    torch.testing.assert_close(logp.grad, torch.cat(grads), **TIGHT)


# ---- hidden -> linear_logprobs -> loss: the whole path ---------------------------------


def materialised_logprobs(h, w, y):
    """log p(y) from the [N, V] logits (0 where ignored), lse and the mean logit."""
    logits = F.linear(h, w)
    lsm = F.log_softmax(logits, dim=-1)
    valid = y != IGNORE
    picked = lsm.gather(-1, torch.where(valid, y, torch.zeros_like(y)).unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, picked, torch.zeros((), dtype=h.dtype)), torch.logsumexp(logits, -1), logits.mean(-1)


def e2e_data(seed=9, lengths=(4, 1, 0, 5, 3, 3)):
    h, w, _ = make(sum(lengths), 12, 37, torch.float64, seed=seed, scale=1.5)
    g = torch.Generator().manual_seed(seed)
    cu = cu_of(lengths)
    y = lce_torch.next_token_targets(torch.randint(0, 37, (sum(lengths),), generator=g), cu)
    return h, w, y, cu


@pytest.mark.parametrize("eps", [0.0, 0.2])
def test_sft_end_to_end_against_torch_cross_entropy(eps):
    """Token-mean SFT through lce equals F.cross_entropy over materialised logits
    (PyTorch's own label smoothing), values and both gradients."""
    h, w, y, cu = e2e_data()
    h1, w1 = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    logp, lse, mean = lce_torch.linear_logprobs(h1, w1, y, return_lse=True, return_mean_logit=True)
    loss = lce_torch.sft_loss(logp, y, cu, label_smoothing=eps, lse=lse, mean_logit=mean).loss
    loss.backward()
    h2, w2 = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    ref = F.cross_entropy(F.linear(h2, w2), y, ignore_index=IGNORE, label_smoothing=eps)
    ref.backward()
    torch.testing.assert_close(loss, ref, **TIGHT)
    torch.testing.assert_close(h1.grad, h2.grad, **TIGHT)
    torch.testing.assert_close(w1.grad, w2.grad, **TIGHT)


def test_dpo_and_pg_end_to_end_against_materialised_reference():
    h, w, y, cu = e2e_data(lengths=(4, 3, 5, 2, 3, 3))
    ref_seq = -torch.rand(6, dtype=torch.float64) * 10
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0], dtype=torch.float64)
    old = materialised_logprobs(h, w, y)[0].detach() + 0.2 * torch.randn(h.shape[0], dtype=torch.float64)
    for which in ("dpo", "pg"):
        h1, w1 = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        h2, w2 = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        logp, ent = lce_torch.linear_logprobs(h1, w1, y, with_entropy=True)
        rl = materialised_logprobs(h2, w2, y)[0]
        lsm = F.log_softmax(F.linear(h2, w2), -1)
        rent = torch.where(y != IGNORE, -(lsm.exp() * lsm).sum(-1), torch.zeros((), dtype=torch.float64))
        if which == "dpo":
            loss = lce_torch.dpo_loss(logp, cu, ref_seq_logprobs=ref_seq, targets=y, beta=0.5, sft_coef=0.1).loss
            ref = reference_dpo(rl, ref_seq, y, cu, None, [(0, 1), (2, 3), (4, 5)], 0.5, 0.1, False)[0]
        else:
            opts = dict(reduction="sequence_mean", sequence_advantages=True, entropy_coef=0.03)
            loss = lce_torch.policy_gradient_loss(logp, adv, cu, old_logprobs=old, entropy=ent, targets=y,
                                                  **opts).loss
            ref = reference_pg(rl, adv, cu, y, None, old=old, entropy=rent, **opts)[0]
        loss.backward()
        ref.backward()
        torch.testing.assert_close(loss, ref, **TIGHT, msg=which)
        torch.testing.assert_close(h1.grad, h2.grad, **TIGHT, msg=which)
        torch.testing.assert_close(w1.grad, w2.grad, **TIGHT, msg=which)


@pytest.mark.parametrize("loss_name", ["sft", "sft_smoothed", "dpo", "pg"])
def test_gradcheck_hidden_to_loss(loss_name):
    h, w, y, cu = e2e_data(seed=10, lengths=(3, 2, 0, 4, 1, 2))
    h, w = h[:12].clone(), w[:9].clone()
    y = torch.where(y[:12] >= 9, y[:12] % 9, y[:12])
    ref_seq = torch.tensor([-3.0, -2.0, -1.0, -4.0, -1.5, -2.5], dtype=torch.float64)
    # Off-policy: without old log-probs the ratio is exp(logp - logp) = 1 with dr/dlogp = 1
    # (the on-policy gradient), which finite differences cannot see.
    old = lce_torch.linear_logprobs(h, w, y).detach() + 0.05

    def f(hidden, weight):
        if loss_name == "sft":
            return lce_torch.sft_loss(lce_torch.linear_logprobs(hidden, weight, y), y, cu).loss
        if loss_name == "sft_smoothed":
            logp, lse, mean = lce_torch.linear_logprobs(hidden, weight, y, return_lse=True, return_mean_logit=True)
            return lce_torch.sft_loss(logp, y, cu, label_smoothing=0.3, lse=lse, mean_logit=mean,
                                      reduction="sequence_mean").loss
        if loss_name == "dpo":
            logp = lce_torch.linear_logprobs(hidden, weight, y)
            return lce_torch.dpo_loss(logp, cu, ref_seq_logprobs=ref_seq, targets=y, beta=0.8, sft_coef=0.3).loss
        logp, ent = lce_torch.linear_logprobs(hidden, weight, y, with_entropy=True)
        return lce_torch.policy_gradient_loss(logp, torch.linspace(-1, 1, 12, dtype=torch.float64), cu, targets=y,
                                              old_logprobs=old, entropy=ent, entropy_coef=0.05, kl_coef=0.1,
                                              ref_logprobs=torch.full((12,), -2.0, dtype=torch.float64)).loss

    assert torch.autograd.gradcheck(f, (h.requires_grad_(True), w.requires_grad_(True)))


# ---- torch.compile and opcheck --------------------------------------------------------


def test_opcheck_loss_ops():
    d = packed(11)
    adv = torch.randn(d["n"], generator=d["g"], dtype=torch.float64)
    logp = d["logp"].clone().requires_grad_(True)
    ent = torch.rand(d["n"], dtype=torch.float64).requires_grad_(True)
    ref_seq = -torch.rand(len(LENGTHS), dtype=torch.float64)
    batch = (d["targets"], d["cu"], d["weights"])
    torch.library.opcheck(torch.ops.lce.next_token_targets.default, (d["targets"].clamp(min=0), d["cu"]))
    torch.library.opcheck(torch.ops.lce.sequence_logprobs.default, (d["logp"], *batch))
    torch.library.opcheck(torch.ops.lce.sft_loss.default, (logp, *batch), dict(reduction="sequence_mean"))
    torch.library.opcheck(torch.ops.lce.dpo_loss.default, (logp, ref_seq, *batch), dict(beta=0.4))
    torch.library.opcheck(torch.ops.lce.policy_gradient_loss.default,
                          (logp, adv, None, None, None, ent, *batch), dict(entropy_coef=0.1))


def compiled_step(y, cu):
    """SFT + DPO + policy gradient on one forward's log-probs and entropy."""
    s = cu.numel() - 1
    adv = torch.linspace(-1, 1, y.numel(), dtype=torch.float64)
    ref_seq = -torch.linspace(1, 3, s, dtype=torch.float64)

    def fn(hidden, weight):
        logp, ent = lce_torch.linear_logprobs(hidden, weight, y, with_entropy=True)
        sft = lce_torch.sft_loss(logp, y, cu, reduction="sequence_mean")
        dpo = lce_torch.dpo_loss(logp, cu, ref_seq_logprobs=ref_seq, targets=y, beta=0.5)
        pg = lce_torch.policy_gradient_loss(logp, adv, cu, targets=y, entropy=ent, entropy_coef=0.01)
        return sft.loss + dpo.loss + pg.loss + 0.0 * (sft.tokens + dpo.reward_accuracy + pg.clip_frac_low)

    return fn


@pytest.mark.parametrize("backend, dynamic", [("aot_eager", False), ("aot_eager", True), ("inductor", False)])
def test_compile_fullgraph_losses(backend, dynamic):
    torch._dynamo.reset()
    counts = torch._dynamo.utils.counters
    counts.clear()
    for lengths in ((4, 1, 0, 5, 3, 3), (2, 6, 3, 1, 4, 4, 2, 2)) if dynamic else ((4, 1, 0, 5, 3, 3),):
        h, w, y, cu = e2e_data(lengths=lengths)
        fn = compiled_step(y, cu)
        compiled = torch.compile(fn, fullgraph=True, backend=backend, dynamic=dynamic)
        results = []
        for f in (fn, compiled):
            hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
            loss = f(hh, ww)
            loss.backward()
            results.append((loss.detach(), hh.grad, ww.grad))
        for a, b in zip(*results):
            torch.testing.assert_close(a, b, **TIGHT)
    assert not counts["graph_break"], dict(counts["graph_break"])


def test_int32_indices_equal_int64():
    d = packed(12)
    s = len(LENGTHS)
    ref_seq = -torch.rand(s, generator=d["g"], dtype=torch.float64)
    adv = torch.randn(d["n"], generator=d["g"], dtype=torch.float64)
    for wide in (True, False):
        cast = (lambda t: t) if wide else (lambda t: t.to(torch.int32))  # noqa: E731
        cu, y = cast(d["cu"]), cast(d["targets"])
        pairs = cast(torch.tensor([[1, 0], [2, 3], [5, 4], [7, 6]]))
        logp = leaf(d["logp"])
        losses = (
            lce_torch.sft_loss(logp, y, cu, weights=d["weights"], reduction="sequence_mean").loss,
            lce_torch.dpo_loss(logp, cu, ref_seq_logprobs=ref_seq, targets=y, pairs=pairs).loss,
            lce_torch.policy_gradient_loss(logp, adv, cu, targets=y, weights=d["weights"]).loss,
        )
        torch.stack(losses).sum().backward()
        if wide:
            want = (torch.stack(losses).detach(), logp.grad)
        else:
            assert torch.equal(torch.stack(losses).detach(), want[0]) and torch.equal(logp.grad, want[1])
