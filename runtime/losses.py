"""Per-token policy losses on token-aligned [B, T] tensors. Every loss is a weighted *sum* over
tokens: normalization (per token, per sequence, by a global token count across micro-batches and
ranks) is the caller's, through `weights`.

- cross_entropy:        -logp                                       (SFT, distillation on samples)
- importance_sampling:  -ratio * A,  ratio = exp(logp - sampler_logp)   (REINFORCE off the sampler)
- ppo:                  -min(ratio * A, clip(ratio, 1 - lo, 1 + hi) * A)  (lo = hi: PPO; lo < hi: DAPO's clip-higher)
"""
from __future__ import annotations

import torch

LOSSES = ("cross_entropy", "importance_sampling", "ppo")


def policy_loss(name, logprobs, weights, *, advantages=None, sampler_logprobs=None, clip=(0.2, 0.2),
                entropy=None, entropy_coef=0.0):
    """(loss, metrics) for per-token `logprobs` [B, T] (differentiable) and `weights` [B, T] (zero
    where no token is trained). `entropy` [B, T] with `entropy_coef` subtracts coef * sum(w * H)."""
    if name not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {name!r}")
    w = weights.to(logprobs.dtype)
    tokens = (w != 0).sum()
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
            metrics["clip_fraction"] = float(((clipped > term) & (w != 0)).sum() / tokens.clamp_min(1))
            term = torch.maximum(term, clipped)  # -min(a, b) = max(-a, -b)
        with torch.no_grad():  # k1 estimate of KL(sampler || policy) over trained tokens
            metrics["sampler_kl"] = float((-(log_ratio) * (w != 0)).sum() / tokens.clamp_min(1))
            metrics["ratio_max"] = float(torch.where(w != 0, ratio, 0).max()) if int(tokens) else 1.0
    loss = (w * term).sum()
    if entropy is not None and entropy_coef:
        loss = loss - entropy_coef * (w * entropy.to(logprobs.dtype)).sum()
    return loss, metrics
