"""Eager causal GQA attention: repeat K/V per query head, explicit scores, fp32 softmax.

The twin of `bumblebee.primitives.attention.sdpa_attention`; the math of transformers' eager path.
"""
from __future__ import annotations

import torch

from bumblebee.registry import register


def check_attention_inputs(q, k, v):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be [B, heads, T, D], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape[:3] + (k.shape[3],) or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"k/v must be [B={q.shape[0]}, Hkv, T={q.shape[2]}, D], got {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k head dims differ: {q.shape[3]} vs {k.shape[3]}")


@register("attention", "eager", kind="baseline", twin="sdpa")
def eager_attention(q, k, v, *, scale=None):
    """Explicit causal scores and fp32 softmax over repeated K/V heads."""
    check_attention_inputs(q, k, v)
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale
    T = q.shape[2]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return probs @ v
