"""The asynchronous pipeline's objective in the runtime (no Ray): the decoupled PPO loss (ratio to
the proximal policy times the capped behaviour weight pi_prox / pi_behave, clip-higher, token mean)
against a float64 reference on the materialized logits, its reduction to PPO, clamping and masking,
and packed sequences."""
from __future__ import annotations

import math

import pytest
import torch

from bumblebee import models
from bumblebee.runtime import Batch, Runtime, policy_loss
from bumblebee.runtime.losses import Norm, behaviour_weights, decoupled_ppo_loss
from tests.runtime.test_runtime import _grads, _reference

CLIP = (0.2, 0.28)


def _decoupled_ref(lp, prox, behave, adv, trained, cap, mode):
    """AReaL's decoupled loss written out in float64: token mean of w * -min(r A, clip(r) A)."""
    w = torch.exp(prox - behave)
    w = w.clamp(max=cap) if mode == "clamp" else torch.where(w <= cap, w, torch.zeros_like(w))
    r = torch.exp(lp - prox)
    pg = -torch.minimum(r * adv, torch.clamp(r, 1 - CLIP[0], 1 + CLIP[1]) * adv)
    m = trained.to(lp.dtype)
    return (w * pg * m).sum() / m.sum()


def _case(model, b=5, t=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (b, t), generator=g)
    mask = torch.rand(b, t, generator=g) < 0.8
    adv = torch.randn(b, t, generator=g, dtype=torch.float64)
    with torch.no_grad():
        lp0, _ = _reference(model, ids)
    # proximal and behaviour policies near the current one; some weights pass the cap of 1.5
    prox = lp0 + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)
    behave = prox - 0.5 * torch.randn(b, t, generator=g, dtype=torch.float64)
    return ids, mask, adv, prox, behave


@pytest.mark.parametrize("mode", ["clamp", "mask"])
def test_decoupled_loss_against_logits(mode):
    model = models.build("qwen3-tiny", seed=0, dtype=torch.float64)
    ids, mask, adv, prox, behave = _case(model)
    trained = mask.clone()
    trained[:, 0] = False
    lp, _ = _reference(model, ids)
    want = _decoupled_ref(lp, prox, behave, adv, trained, 1.5, mode)
    want.backward()
    want_g = _grads(model)
    model.zero_grad()
    w = behaviour_weights(prox, behave, cap=1.5, mode=mode)
    assert 0 < int(((torch.exp(prox - behave) > 1.5) & trained).sum()) < int(trained.sum())  # the cap bites
    batch = Batch(ids, loss_mask=mask, weights=w, advantages=adv, sampler_logprobs=prox)
    out = Runtime(model).forward_backward(batch, "ppo", clip=CLIP, loss_agg_mode="token-mean")
    assert out.loss == pytest.approx(want.item(), rel=1e-9)
    for k, g in _grads(model).items():
        torch.testing.assert_close(g, want_g[k], rtol=1e-8, atol=1e-12, msg=k)


def test_decoupled_loss_function_and_its_reduction_to_ppo():
    g = torch.Generator().manual_seed(3)
    lp = (-torch.rand(4, 9, generator=g, dtype=torch.float64) * 3).requires_grad_()
    prox = lp.detach() + 0.2 * torch.randn(4, 9, generator=g, dtype=torch.float64)
    behave = prox + 0.4 * torch.randn(4, 9, generator=g, dtype=torch.float64)
    adv = torch.randn(4, 9, generator=g, dtype=torch.float64)
    trained = torch.rand(4, 9, generator=g) < 0.7
    norm = Norm(int(trained.sum()), 4)
    for mode in ("clamp", "mask"):
        got, _ = decoupled_ppo_loss(lp, prox, behave, adv, trained, clip=CLIP, cap=1.3, mode=mode, norm=norm)
        want = _decoupled_ref(lp, prox, behave, adv, trained, 1.3, mode)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
        ga, = torch.autograd.grad(got, lp)
        gb, = torch.autograd.grad(want, lp)
        torch.testing.assert_close(ga, gb, rtol=1e-12, atol=1e-14)
    # pi_prox = pi_behave: every weight is exactly 1, and the loss is PPO's around that policy, bitwise
    same, _ = decoupled_ppo_loss(lp, prox, prox, adv, trained, clip=CLIP, cap=1.3, norm=norm)
    ppo, _ = policy_loss("ppo", lp, trained.to(lp.dtype), advantages=adv, sampler_logprobs=prox, clip=CLIP,
                         loss_agg_mode="token-mean", norm=norm, trained=trained)
    assert torch.equal(same, ppo)


def test_behaviour_weights_clamp_and_mask():
    ratio = torch.tensor([0.5, 1.0, 1.5, 1.9, 3.0, math.exp(40)], dtype=torch.float64)
    behave = -torch.rand(6, dtype=torch.float64) - 50  # a far-off-policy token: log-ratio 40, no overflow
    prox = behave + ratio.log()
    clamp = behaviour_weights(prox, behave, cap=2.0, mode="clamp")
    mask = behaviour_weights(prox, behave, cap=2.0, mode="mask")
    torch.testing.assert_close(clamp, torch.tensor([0.5, 1.0, 1.5, 1.9, 2.0, 2.0], dtype=torch.float64))
    torch.testing.assert_close(mask, torch.tensor([0.5, 1.0, 1.5, 1.9, 0.0, 0.0], dtype=torch.float64))
    assert not clamp.requires_grad
    with pytest.raises(ValueError, match="mode"):
        behaviour_weights(prox, behave, cap=2.0, mode="truncate")
    with pytest.raises(ValueError, match="cap"):
        behaviour_weights(prox, behave, cap=0.5)


def test_decoupled_loss_on_packed_sequences():
    """Rows of different lengths, padded and packed into one stream: one loss, one gradient."""
    model = models.build("qwen3-tiny", seed=1, dtype=torch.float64)
    ids, mask, adv, prox, behave = _case(model, b=4, t=10, seed=1)
    lengths = [10, 4, 7, 9]
    for i, n in enumerate(lengths):
        mask[i, n:] = False
    w = behaviour_weights(prox, behave, cap=1.5, mode="mask")
    padded = Batch(ids, loss_mask=mask, weights=w, advantages=adv, sampler_logprobs=prox)
    keep = torch.arange(10)[None] < torch.tensor(lengths)[:, None]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    packed = Batch(*(getattr(padded, k)[keep][None] for k in ("input_ids", "loss_mask", "weights", "advantages",
                                                             "sampler_logprobs")), cu_seqlens=cu)
    got = {}
    for name, batch in (("padded", padded), ("packed", packed)):
        out = Runtime(model).forward_backward(batch, "ppo", clip=CLIP, loss_agg_mode="token-mean")
        got[name] = (out.loss, _grads(model))
        model.zero_grad()
    assert got["packed"][0] == pytest.approx(got["padded"][0], rel=1e-10)
    for k, g in got["padded"][1].items():
        torch.testing.assert_close(got["packed"][1][k], g, rtol=1e-9, atol=1e-12, msg=k)
