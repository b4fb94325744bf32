"""Packed sequences: a batch [B, T] read as one stream of B*T tokens cut at `cu_seqlens` [S + 1].

Attention tensors are [B, heads, T, D]; these helpers view them as the stream [1, heads, B*T, D]
(row-major over B then T, the order `cu_seqlens` counts in) and back.
"""
from __future__ import annotations

import torch

from bumblebee.checks import check_cu_seqlens


def to_stream(t_BhTd: torch.Tensor) -> torch.Tensor:
    """[B, h, T, d] -> [1, h, B*T, d]."""
    B, h, T, d = t_BhTd.shape
    return t_BhTd.transpose(0, 1).reshape(1, h, B * T, d)


def from_stream(t_1hNd: torch.Tensor, B: int, T: int) -> torch.Tensor:
    """[1, h, B*T, d] -> [B, h, T, d]."""
    _, h, _, d = t_1hNd.shape
    return t_1hNd[0].reshape(h, B, T, d).transpose(0, 1)


class _ContiguousGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def per_sequence(attend, q, k, v, spans) -> torch.Tensor:
    """attend(q, k, v) on each packed sequence alone: [B, h, T, d] in and out, one call per span
    [(start, end)] of the stream. Each call's output gradient arrives contiguous: torch's cuDNN
    attention caches its backward graph by the q/k/v shapes and strides only, and the gradient of a
    slice of the concatenated stream has strides set by the stream's length, so two packings sharing a
    sequence length reused a graph built for other strides (non-finite MLA gradients on torch 2.11,
    cuDNN 9.19; tests/primitives/test_mla.py::test_per_sequence_gradients_across_packings)."""
    B, T = q.shape[0], q.shape[2]
    stream = [to_stream(t) for t in (q, k, v)]
    o = torch.cat([_ContiguousGrad.apply(attend(*(t[:, :, a:b] for t in stream))) for a, b in spans], dim=2)
    return from_stream(o, B, T)


def segments(cu_seqlens, n_tokens: int) -> list[tuple[int, int]]:
    """[(start, end)] of every sequence; ValueError (naming cu_seqlens) unless it covers 0..n_tokens
    strictly increasing. One host sync."""
    cu = check_cu_seqlens(cu_seqlens, n_tokens)
    return list(zip(cu, cu[1:]))


def sequence_ids(cu: list[int], device) -> torch.Tensor:
    """[cu[-1]] the sequence index of every token, from validated host boundaries (`check_cu_seqlens`)."""
    lengths = torch.tensor([b - a for a, b in zip(cu, cu[1:])], device=device)
    return torch.repeat_interleave(torch.arange(len(cu) - 1, device=device), lengths)
