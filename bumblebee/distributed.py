"""Autograd-aware collectives for vocabulary/tensor parallelism (Megatron's region pattern), and
`on_rank0`, a file-system change made by one rank whose outcome every rank shares.

A loss that is *replicated* on every rank after its all-reduces must not have its gradient summed
again in the backward: `reduce_from_group` all-reduces forward and passes the gradient through,
`copy_to_group` is the identity forward and all-reduces the gradient of a replicated input.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

_MAGIC = 0x6D6F65  # leads every agreement vector, so a rank in another collective shows up


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def reduce_from_group(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _ReduceFromGroup.apply(x, group)


def copy_to_group(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _CopyToGroup.apply(x, group)


def all_reduce_max(x: torch.Tensor, group) -> torch.Tensor:
    """Max over ranks, without gradient (used only for numerical stability)."""
    x = x.detach().clone()
    if group is not None:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    return x


def vocab_range(local_vocab: int, group, device) -> tuple[int, int]:
    """(offset of this rank's shard, total vocabulary) for a V-sharded weight; shards may differ."""
    if group is None:
        return 0, local_vocab
    sizes = torch.zeros(dist.get_world_size(group), dtype=torch.int64, device=device)
    sizes[dist.get_rank(group)] = local_vocab
    dist.all_reduce(sizes, group=group)
    rank = dist.get_rank(group)
    return int(sizes[:rank].sum()), int(sizes.sum())


def agree_once(obj, group, device, fields: dict, seen) -> None:
    """First call for `obj` (e.g. an experts module): every rank all_gathers one fixed-size vector of
    `fields` (name -> int) and raises the same ValueError when any field differs, so a disagreement
    fails on every rank instead of hanging in a mismatched collective. `seen` (the caller's
    WeakKeyDictionary) remembers objects already checked: later calls add no collective and no host
    sync. Objects that cannot be weakly referenced are checked on every call."""
    try:
        if group is None or obj in seen:
            return
    except TypeError:
        pass
    words = torch.tensor([_MAGIC, *fields.values()], dtype=torch.int64, device=device)
    got = [torch.empty_like(words) for _ in range(dist.get_world_size(group))]
    dist.all_gather(got, words, group=group)
    rows = torch.stack(got).tolist()
    for i, name in enumerate(["implementation marker", *fields]):
        col = [r[i] for r in rows]
        if len(set(col)) > 1:
            raise ValueError(f"ranks of the ep group disagree on {name}: {col} (by rank)")
    try:
        seen[obj] = True
    except TypeError:
        pass


def on_rank0(fn, group=None):
    """fn() on rank 0 of `group` (a file-system change that one rank makes for all); its result on
    every rank, or its exception raised on every rank (the others get one of the same type and
    message), so that no rank goes on believing a failed save succeeded. Without torch.distributed
    initialized: fn()."""
    if not dist.is_initialized():
        return fn()
    result = error = None
    if dist.get_rank(group) == 0:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001  (raised below on every rank: no rank is left waiting)
            error = e
    box = [(result, None if error is None else (type(error), str(error)))]
    dist.broadcast_object_list(box, group=group, group_src=0)
    result, what = box[0]
    if error is not None:
        raise error
    if what is not None:
        typ, msg = what
        try:
            exc = typ(msg)
        except Exception:  # noqa: BLE001  (a type that takes other arguments)
            exc = RuntimeError(f"on rank 0: {typ.__name__}: {msg}")
        raise exc
    return result
