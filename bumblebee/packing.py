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


def contiguous_grad(t: torch.Tensor) -> torch.Tensor:
    """t itself; its gradient arrives contiguous. For the output of one SDPA call per sequence of a
    stream: torch's cuDNN attention caches its backward graph by the q/k/v shapes and strides only, and
    the gradient of a slice of the concatenated stream has strides that depend on the stream's length.
    Two packings sharing a sequence length then reuse a graph built for other strides: non-finite
    gradients (torch 2.11, cuDNN 9.19; tests/primitives/test_attention_packed.py). A contiguous
    gradient has strides fixed by the sequence's own shape."""
    return _ContiguousGrad.apply(t)


def segments(cu_seqlens, n_tokens: int) -> list[tuple[int, int]]:
    """[(start, end)] of every sequence; ValueError (naming cu_seqlens) unless it covers 0..n_tokens
    strictly increasing. One host sync."""
    cu = check_cu_seqlens(cu_seqlens, n_tokens)
    return list(zip(cu, cu[1:]))


def sequence_ids(cu: list[int], device) -> torch.Tensor:
    """[cu[-1]] the sequence index of every token, from validated host boundaries (`check_cu_seqlens`)."""
    lengths = torch.tensor([b - a for a, b in zip(cu, cu[1:])], device=device)
    return torch.repeat_interleave(torch.arange(len(cu) - 1, device=device), lengths)
