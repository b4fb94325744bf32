"""Eager causal GQA attention: repeat K/V per query head, explicit scores, fp32 softmax.

The twin of `bumblebee.primitives.attention.sdpa_attention`; the math of transformers' eager path.
"""
from __future__ import annotations

import torch

from bumblebee.checks import check_attention_inputs
from bumblebee.registry import register


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
