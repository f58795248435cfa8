"""Bad input to the losses raises RuntimeError with lce's message (ValueError / TypeError
for what lce_torch checks first) and leaves every tensor untouched, gradients included."""
import math

import pytest
import torch

import lce_torch

IGNORE = -100


def batch():
    """Three sequences (3, 2, 1 tokens); float64 log-probs that require grad."""
    cu = torch.tensor([0, 3, 5, 6])
    logp = -torch.linspace(0.1, 2.0, 6, dtype=torch.float64)
    targets = torch.tensor([4, 7, IGNORE, 2, IGNORE, IGNORE])
    weights = torch.tensor([1.0, 0.5, 1.0, 1.0, 1.0, 1.0])
    return dict(logp=logp.requires_grad_(True), cu=cu, targets=targets, weights=weights)


def sft(d, **kw):
    return lce_torch.sft_loss(d["logp"], d["targets"], d["cu"], weights=d["weights"], **kw)


def dpo(d, **kw):
    cu = kw.pop("cu", torch.tensor([0, 2, 3, 5, 6]))
    ref = kw.pop("ref_seq_logprobs", torch.tensor([-1.0, -2.0, -3.0, -4.0], dtype=torch.float64))
    return lce_torch.dpo_loss(d["logp"], cu, ref_seq_logprobs=ref, targets=d["targets"], **kw)


def pg(d, **kw):
    adv = kw.pop("advantages", torch.tensor([1.0, -1.0, 0.5, 2.0, -0.5, 1.5], dtype=torch.float64))
    return lce_torch.policy_gradient_loss(d["logp"], adv, d["cu"], targets=d["targets"], **kw)


def with_(name, value):
    def change(d):
        d[name] = value
    return change


def nan_at(name, i):
    def change(d):
        t = d[name].detach().clone()
        t[i] = math.nan
        d[name] = t.requires_grad_(d[name].requires_grad)
    return change


CASES = {
    # name: (loss, change to the batch, keyword arguments, exception, lce's message)
    "cu_decreasing": (sft, with_("cu", torch.tensor([0, 4, 3, 6])), {}, RuntimeError,
                      r"lce: cu_seqlens must be non-decreasing: cu_seqlens\[1\] = 4 > cu_seqlens\[2\] = 3"),
    "cu_first": (sft, with_("cu", torch.tensor([1, 3, 5, 6])), {}, RuntimeError,
                 r"lce: cu_seqlens\[0\] = 1: the first offset must be 0"),
    "cu_last": (pg, with_("cu", torch.tensor([0, 3, 5])), {}, RuntimeError,
                r"lce: cu_seqlens\[2\] = 5: the last offset must be the number of tokens \(6\)"),
    "cu_int32_last": (dpo, lambda d: None, dict(cu=torch.tensor([0, 2, 3, 5, 7], dtype=torch.int32)), RuntimeError,
                      r"lce: cu_seqlens\[4\] = 7: the last offset must be the number of tokens \(6\)"),
    "targets_length": (sft, with_("targets", torch.tensor([4, 7, IGNORE, 2, IGNORE])), {}, RuntimeError,
                       r"lce: targets: size 5 does not match the number of tokens \(6\)"),
    "weights_length": (sft, with_("weights", torch.ones(7)), {}, RuntimeError,
                       r"lce: weights: size 7 does not match the number of tokens \(6\)"),
    "weights_nan": (sft, nan_at("weights", 2), {}, RuntimeError, r"lce: weights\[2\] = nan is not finite"),
    "logprobs_nan": (sft, nan_at("logp", 1), {}, RuntimeError,
                     r"lce: logprobs\[1\] = nan is not finite \(token 1 counts"),
    "smoothing_without_lse": (sft, lambda d: None, dict(label_smoothing=0.1), RuntimeError,
                              r"lce: lse: absent \(size 0\), but label_smoothing or z_loss != 0 needs it: size 6 \(logprobs\)"),
    "smoothing_range": (sft, lambda d: None, dict(label_smoothing=1.5), RuntimeError,
                        r"lce: options.label_smoothing = 1.5 is outside \[0, 1\]"),
    "normaliser_zero": (sft, lambda d: None, dict(normaliser=0.0), RuntimeError,
                        r"lce: normaliser is 0 but this rank has 3 counted tokens"),
    "reduction": (sft, lambda d: None, dict(reduction="mean"), ValueError,
                  r"lce_torch: reduction must be 'token_mean' or 'sequence_mean', got 'mean'"),
    "beta_nan": (dpo, lambda d: None, dict(beta=math.nan), RuntimeError,
                 r"lce: dpo_options.beta must be finite and > 0, got nan"),
    "sft_coef": (dpo, lambda d: None, dict(sft_coef=-1.0), RuntimeError,
                 r"lce: dpo_options.sft_coef must be finite and >= 0, got -1"),
    "pair_same": (dpo, lambda d: None, dict(pairs=[(0, 1), (2, 2)]), RuntimeError,
                  r"lce: pairs\[1\] = \(2, 2\): chosen and rejected must be different sequences in \[0, 4\)"),
    "pair_twice": (dpo, lambda d: None, dict(pairs=[(0, 1), (1, 2)]), RuntimeError,
                   r"lce: pairs\[\d\] = \(\d, \d\): sequence 1 is also in pairs\[\d\]"),
    "odd_sequences": (dpo, lambda d: None, dict(cu=torch.tensor([0, 3, 5, 6]),
                                                ref_seq_logprobs=torch.zeros(3, dtype=torch.float64)),
                      RuntimeError, r"lce: pairs: empty .* needs an even number of sequences, got 3"),
    "ref_length": (dpo, lambda d: None, dict(ref_seq_logprobs=torch.zeros(3, dtype=torch.float64)), RuntimeError,
                   r"lce: ref_seq_logprobs: size 3 does not match the number of sequences \(4\)"),
    "ref_nan": (dpo, lambda d: None, dict(ref_seq_logprobs=torch.tensor([0.0, math.nan, 0.0, 0.0],
                                                                         dtype=torch.float64)),
                RuntimeError, r"lce: ref_seq_logprobs\[1\] = nan is not finite \(sequence 1 is in pairs\[0\]\)"),
    "eps_low": (pg, lambda d: None, dict(eps_low=1.0), RuntimeError, r"lce: pg_options.eps_low must be in \[0, 1\)"),
    "dual_clip": (pg, lambda d: None, dict(dual_clip=0.5), RuntimeError,
                  r"lce: pg_options.dual_clip must be 0 \(off\) or a finite c > 1, got 0.5"),
    "kl_without_ref": (pg, lambda d: None, dict(kl_coef=0.1), RuntimeError,
                       r"lce: ref_logprobs: absent \(size 0\), but kl_coef > 0 needs it: size 6 \(logprobs\)"),
    "kl_name": (pg, lambda d: None, dict(kl="k2"), ValueError, r"lce_torch: kl must be 'k1' or 'k3', got 'k2'"),
    "advantage_nan": (pg, lambda d: None, dict(advantages=torch.tensor([1.0, math.nan, 0.0, 0, 0, 0],
                                                                        dtype=torch.float64)),
                      RuntimeError, r"lce: advantages\[1\] = nan is not finite"),
    "sequence_advantages_length": (pg, lambda d: None, dict(sequence_advantages=True,
                                                            advantages=torch.ones(2, dtype=torch.float64)),
                                   RuntimeError, r"lce: advantages: size 2 does not match the number of sequences"),
    "logprobs_half": (sft, with_("logp", torch.zeros(6, dtype=torch.float16, requires_grad=True)), {}, TypeError,
                      r"lce_torch: logprobs must be float32 or float64"),
    "targets_float": (sft, with_("targets", torch.zeros(6)), {}, TypeError,
                      r"lce_torch: targets must be int32 or int64, got Float"),
    "normaliser_and_group": (sft, lambda d: None, dict(normaliser=2.0, group="g"), ValueError,
                             r"lce_torch: pass normaliser .* or group .*, not both"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_raises_and_changes_nothing(case):
    loss, change, kw, exc, match = CASES[case]
    d = batch()
    change(d)
    kw = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    tensors = [t for t in (*d.values(), *kw.values()) if isinstance(t, torch.Tensor)]
    before = [t.detach().clone() for t in tensors]
    with pytest.raises(exc, match=match):
        loss(d, **kw)
    for t0, t in zip(before, tensors):
        torch.testing.assert_close(t.detach(), t0, rtol=0, atol=0, equal_nan=True)
    assert d["logp"].grad is None


def test_distill_ids_must_be_distinct():
    ids = torch.tensor([[3, 1, 3], [0, 2, 1]])
    student = torch.full((2, 3), -2.0, dtype=torch.float64, requires_grad=True)
    teacher = torch.full((2, 3), -1.5, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"lce: ids\[0, 2\] = 3 repeats an earlier id of token 0: a token's K ids must be "
                                         r"distinct"):
        lce_torch.distill_loss(student, teacher, ids, torch.tensor([0, 2]))
    # ignore_index marks absent ids and may repeat.
    ids = torch.tensor([[3, IGNORE, IGNORE], [0, 2, 1]])
    assert torch.isfinite(lce_torch.distill_loss(student, teacher, ids, torch.tensor([0, 2])).loss)


def test_layout_and_reference_arguments():
    d = batch()
    with pytest.raises(ValueError, match=r"lce_torch.dpo_loss: ref_logprobs has shape \(5,\), logprobs \(6,\)"):
        lce_torch.dpo_loss(d["logp"], torch.tensor([0, 2, 3, 5, 6]), ref_logprobs=torch.zeros(5, dtype=torch.float64),
                           targets=d["targets"])
    for bad in ([[0, 1, 2], [3, 2, 1]], [[0, 1, 2, 3]]):
        with pytest.raises(ValueError, match=r"lce_torch.dpo_loss: pairs must be \[P, 2\] \(chosen, rejected\)"):
            dpo(d, pairs=bad)
    # [P, 2] and flat [2 P] are the same pairs.
    torch.testing.assert_close(dpo(batch(), pairs=[[0, 1], [2, 3]]).loss, dpo(batch(), pairs=[0, 1, 2, 3]).loss)
    with pytest.raises(ValueError, match=r"lce_torch.sft_loss: a \[B, T\] logprobs \(\(2, 3\)\) takes no cu_seqlens"):
        lce_torch.sft_loss(d["logp"].reshape(2, 3), d["targets"].reshape(2, 3), d["cu"])
    with pytest.raises(ValueError, match=r"lce_torch.sft_loss: targets has shape \(3, 2\), logprobs \(2, 3\)"):
        lce_torch.sft_loss(d["logp"].reshape(2, 3), d["targets"].reshape(3, 2))
    with pytest.raises(ValueError, match=r"lce_torch.dpo_loss: pass exactly one of ref_seq_logprobs"):
        lce_torch.dpo_loss(d["logp"], d["cu"])
    with pytest.raises(RuntimeError, match=r"lce: cu_seqlens\[0\] = 2: the first offset must be 0"):
        lce_torch.next_token_targets(torch.arange(6), torch.tensor([2, 6]))
    with pytest.raises(RuntimeError, match=r"lce: group 'no-such-group' is not a registered"):
        sft(d, group="no-such-group")
