"""Eager causal GQA attention: repeat K/V per query head, explicit scores, fp32 softmax.

The twin of `bumblebee.primitives.attention.sdpa_attention`; the math of transformers' eager path.
"""
from __future__ import annotations

import torch

from bumblebee import packing
from bumblebee.checks import check_attention_inputs, check_cu_seqlens
from bumblebee.registry import register


@register("attention", "eager", kind="baseline", twin="sdpa")
def eager_attention(q, k, v, *, scale=None, cu_seqlens=None):
    """Explicit causal scores and fp32 softmax over repeated K/V heads. cu_seqlens: the B*T tokens are
    one packed stream; a token attends to earlier tokens of its own sequence only (block-diagonal mask)."""
    check_attention_inputs(q, k, v)
    B, T = q.shape[0], q.shape[2]
    if cu_seqlens is not None:
        seq = packing.sequence_ids(check_cu_seqlens(cu_seqlens, B * T), q.device)
        o = _eager(*(packing.to_stream(t) for t in (q, k, v)), scale, seq[:, None] == seq[None, :])
        return packing.from_stream(o, B, T)
    return _eager(q, k, v, scale)


def _eager(q, k, v, scale, allowed=None):
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale
    T = q.shape[2]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    if allowed is not None:
        causal = causal & allowed
    scores = scores.masked_fill(~causal, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return probs @ v
