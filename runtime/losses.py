"""Per-token policy losses on token-aligned [B, T] tensors, a KL term to a reference policy, and the
aggregation of per-token terms into the loss.

- cross_entropy:        -logp                                       (SFT, distillation on samples)
- importance_sampling:  -ratio * A,  ratio = exp(logp - sampler_logp)   (REINFORCE off the sampler)
- ppo:                  -min(ratio * A, clip(ratio, 1 - lo, 1 + hi) * A)  (lo = hi: PPO; lo < hi: DAPO's clip-higher)

Aggregation (verl's loss_agg_mode names; w = weights on trained tokens, x = the per-token term):
- "sum":                 sum(w * x); the normalization is the caller's, through `weights`
- "token-mean":          sum(w * x) / global trained tokens
- "seq-mean-token-sum":  sum over sequences of sum(w * x) / global sequences
- "seq-mean-token-mean": sum over sequences of sum(w * x) / (the sequence's trained tokens) / global sequences
"Global" counts run over every micro-batch on every data-parallel rank (`Norm`), so the sum of the
micro-batches' losses over the ranks is the batch's loss however it is split. Sequences count when
at least one of their tokens is trained.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

LOSSES = ("cross_entropy", "importance_sampling", "ppo")
AGG_MODES = ("sum", "token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
# verl's kl_penalty names and the estimators they mean (Schulman's k1, k2, k3)
KL_ESTIMATORS = {"kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}


@dataclass(frozen=True)
class Norm:
    """The denominators of an aggregation: trained tokens and sequences over the whole batch on every
    data-parallel rank, and the sequence of every token of this micro-batch ([B, T] long, 0-based)."""
    tokens: int
    seqs: int
    seq_ids: torch.Tensor | None = None


def check_agg_mode(mode: str) -> str:
    if mode not in AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {AGG_MODES}, got {mode!r}")
    return mode


def check_kl_penalty(name: str) -> str:
    if name not in KL_ESTIMATORS:
        raise ValueError(f"kl_penalty must be one of {sorted(KL_ESTIMATORS)}, got {name!r}")
    return KL_ESTIMATORS[name]


def check_coef(name: str, value) -> float:
    """A loss coefficient: a finite number (a NaN would turn every gradient into NaN)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, name: str = "low_var_kl") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' log-probs, as verl's
    kl_penalty: k1 = logp - ref; k2 = (logp - ref)^2 / 2; k3 = exp(ref - logp) - (ref - logp) - 1,
    its log-ratio clamped to [-20, 20] and the value to [-10, 10] (verl's guards)."""
    kind = check_kl_penalty(name)
    log_ratio = logprobs - ref_logprobs.to(logprobs.dtype)
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    kl = torch.clamp(-log_ratio, min=-20, max=20)
    return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)


def aggregate(term: torch.Tensor, weights: torch.Tensor, trained: torch.Tensor, mode: str = "sum",
              norm: Norm | None = None) -> torch.Tensor:
    """The loss of per-token `term` [B, T] under `mode` (see the module docstring): `weights` [B, T]
    scale tokens, `trained` (bool [B, T]) says which count; `norm` holds the global counts."""
    check_agg_mode(mode)
    wx = torch.where(trained, weights.to(term.dtype) * term, 0)  # no 0 * inf from untrained tokens
    if mode == "sum":
        return wx.sum()
    if norm is None:
        raise ValueError(f"loss_agg_mode {mode!r} needs the global counts (a Norm)")
    if mode == "token-mean":
        return wx.sum() / max(norm.tokens, 1)
    if mode == "seq-mean-token-sum":
        return wx.sum() / max(norm.seqs, 1)
    seq = norm.seq_ids.reshape(-1)
    n_seq = int(seq.max()) + 1
    per_seq = wx.new_zeros(n_seq).index_add(0, seq, wx.reshape(-1))
    count = torch.zeros(n_seq, dtype=term.dtype, device=term.device).index_add(
        0, seq, trained.reshape(-1).to(term.dtype))
    return (per_seq / count.clamp_min(1)).sum() / max(norm.seqs, 1)


def policy_loss(name, logprobs, weights, *, advantages=None, sampler_logprobs=None, clip=(0.2, 0.2),
                entropy=None, entropy_coef=0.0, ref_logprobs=None, kl_coef=0.0, kl_penalty_name="low_var_kl",
                loss_agg_mode="sum", norm: Norm | None = None, trained=None):
    """(loss, metrics) for per-token `logprobs` [B, T] (differentiable) and `weights` [B, T] (zero
    where no token is trained): the loss's term, plus kl_coef * KL(policy || reference) on
    `ref_logprobs`, minus entropy_coef * `entropy`, aggregated by `loss_agg_mode`."""
    if name not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {name!r}")
    check_agg_mode(loss_agg_mode)
    check_kl_penalty(kl_penalty_name)
    check_coef("kl_coef", kl_coef)
    check_coef("entropy_coef", entropy_coef)
    w = weights.to(logprobs.dtype)
    trained = (w != 0) if trained is None else trained
    on = trained & (w != 0)
    tokens = on.sum()
    metrics = {"tokens": int(tokens)}
    if name == "cross_entropy":
        term = -logprobs
    else:
        for arg, value in (("advantages", advantages), ("sampler_logprobs", sampler_logprobs)):
            if value is None:
                raise ValueError(f"loss {name!r} needs batch.{arg} [B, T]")
        adv = advantages.to(logprobs.dtype)
        log_ratio = logprobs - sampler_logprobs.to(logprobs.dtype)
        ratio = torch.exp(log_ratio)
        term = -ratio * adv
        if name == "ppo":
            lo, hi = clip
            clipped = -torch.clamp(ratio, 1 - lo, 1 + hi) * adv
            metrics["clip_fraction"] = float(((clipped > term) & on).sum() / tokens.clamp_min(1))
            term = torch.maximum(term, clipped)  # -min(a, b) = max(-a, -b)
        with torch.no_grad():  # k1 estimate of KL(sampler || policy) over trained tokens
            metrics["sampler_kl"] = float((-(log_ratio) * on).sum() / tokens.clamp_min(1))
            metrics["ratio_max"] = float(torch.where(on, ratio, 0).max()) if int(tokens) else 1.0
    if kl_coef:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs batch.ref_logprobs [B, T] (the reference policy's log-probs)")
        kl = kl_penalty(logprobs, ref_logprobs, kl_penalty_name)
        metrics["kl"] = float((kl.detach() * on).sum() / tokens.clamp_min(1))
        term = term + kl_coef * kl
    if entropy is not None and entropy_coef:
        term = term - entropy_coef * entropy.to(logprobs.dtype)
    return aggregate(term, w, trained, loss_agg_mode, norm), metrics


def combine_metrics(parts: list[dict]) -> dict:
    """The named losses' metrics of several micro-batches as one: token counts add, `ratio_max` is the
    maximum, the rest are token-weighted means."""
    if len(parts) == 1:
        return dict(parts[0])
    tokens = sum(p.get("tokens", 0) for p in parts)
    out = {"tokens": tokens}
    for key in {k for p in parts for k in p} - {"tokens"}:
        if key == "ratio_max":
            out[key] = max(p[key] for p in parts if key in p)
        else:
            out[key] = sum(p[key] * p.get("tokens", 0) for p in parts if key in p) / max(tokens, 1)
    return out


BEHAVE_MODES = ("clamp", "mask")


def behaviour_weights(prox_logprobs: torch.Tensor, behave_logprobs: torch.Tensor, *, cap: float,
                      mode: str = "clamp") -> torch.Tensor:
    """The decoupled objective's behaviour weight pi_prox / pi_behave per token (AReaL), no graph:
    "clamp" caps it at `cap` (truncated importance sampling), "mask" sets tokens above `cap` to 0
    (they keep counting in the token-mean's denominator, as AReaL's loss does)."""
    if mode not in BEHAVE_MODES:
        raise ValueError(f"mode must be one of {BEHAVE_MODES}, got {mode!r}")
    if not cap >= 1:
        raise ValueError(f"cap must be >= 1 (a weight of 1 is on-policy), got {cap}")
    with torch.no_grad():
        # the log-ratio is clamped before exp: a far-off-policy token must not overflow to inf
        w = torch.exp(torch.clamp(prox_logprobs - behave_logprobs.to(prox_logprobs.dtype), max=20))
        return w.clamp(max=cap) if mode == "clamp" else torch.where(w <= cap, w, 0)


def decoupled_ppo_loss(logprobs, prox_logprobs, behave_logprobs, advantages, trained, *, clip=(0.2, 0.28),
                       cap: float = 2.0, mode: str = "clamp", loss_agg_mode="token-mean", norm: Norm | None = None,
                       **kw):
    """AReaL's decoupled PPO objective: sum over tokens of w * -min(r * A, clip(r, 1 - lo, 1 + hi) * A)
    with r = pi / pi_prox (the trust region around the policy before this update) and the fixed
    behaviour weight w = pi_prox / pi_behave (the sampler's policy), capped by `mode`. It is `ppo`
    with the proximal policy as its anchor and w as its weights: with pi_prox = pi_behave, w = 1 and
    it is PPO. `kw` go to `policy_loss` (entropy, KL)."""
    w = behaviour_weights(prox_logprobs, behave_logprobs, cap=cap, mode=mode) * trained.to(prox_logprobs.dtype)
    return policy_loss("ppo", logprobs, w, advantages=advantages, sampler_logprobs=prox_logprobs, clip=clip,
                       loss_agg_mode=loss_agg_mode, norm=norm, trained=trained, **kw)
