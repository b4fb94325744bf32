"""Differentiable collectives of the cp group.

`gather(x, batch, dim)`: every rank's x concatenated in rank order (the layout order). Every rank
uses the whole result, so the gradient of rank r's piece is the sum over ranks of the gradient of
that slice: a reduce-scatter (NCCL), or an all-reduce and a slice where the backend has no
reduce-scatter (gloo). `ring_shift(tensors, group)` sends to the next rank and receives from the
previous one, all pairs at once.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        n = dist.get_world_size(group)
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        group, dim = ctx.group, ctx.dim
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        grad = grad.contiguous()
        if dist.get_backend(group) == "nccl":
            pieces = list(grad.chunk(n, dim=dim))
            out = torch.empty_like(pieces[rank]).contiguous()
            dist.reduce_scatter(out, [p.contiguous() for p in pieces], group=group)
            return out, None, None
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad.chunk(n, dim=dim)[rank].contiguous(), None, None


def gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """All-gather along `dim` in rank order, with the reduce-scatter backward."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _Gather.apply(x, group, dim)


def ring_shift(tensors: list[torch.Tensor], group, reverse: bool = False, tag: int = 0) -> tuple[list, list]:
    """Start sending every tensor to the next rank (previous one with `reverse`) and receiving the
    previous rank's: (received buffers, requests to wait on). Overlaps with compute until waited;
    shifts in flight at once carry different tags."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    step = -1 if reverse else 1
    dst = dist.get_global_rank(group, (rank + step) % n)
    src = dist.get_global_rank(group, (rank - step) % n)
    tensors = [t.contiguous() for t in tensors]
    bufs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, dst, group, tag) for t in tensors]
    ops += [dist.P2POp(dist.irecv, b, src, group, tag) for b in bufs]
    return bufs, dist.batch_isend_irecv(ops)
