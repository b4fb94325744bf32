"""Strided boxes: the unit every spec and plan entry is made of.

A box is a tuple of (start, step, count) per dimension of a full HF tensor: the elements
start + i * step, i < count, on every dimension at once. A source shard is a box with step 1; a
receiver's piece may have steps (an interleaved fused layout taken apart by a loader). A
destination is the same box shape laid over a target tensor's storage: `as_strided(shape, strides,
target.storage_offset() + offset)`.
"""
from __future__ import annotations

import math

import torch

Box = tuple  # ((start, step, count), ...)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(c for _, _, c in box)


def box_numel(box: Box) -> int:
    return math.prod(c for _, _, c in box)


def full_box(shape) -> Box:
    return tuple((0, 1, int(n)) for n in shape)


def range_box(offsets, sizes) -> Box:
    return tuple((int(o), 1, int(n)) for o, n in zip(offsets, sizes))


def intersect_dim(a: tuple, lo: int, hi: int) -> tuple[int, tuple] | None:
    """(index of the first kept element, the kept (start, step, count)) of the progression `a`
    within [lo, hi), or None when nothing is kept."""
    start, step, count = a
    first = max(0, -(-(lo - start) // step))
    last = min(count, -(-(hi - start) // step))  # exclusive
    if last <= first:
        return None
    return first, (start + first * step, step, last - first)


def intersect(box: Box, lo: tuple, hi: tuple) -> tuple[tuple, Box] | None:
    """(first kept index per dim, the sub-box) of `box` within the unit-step range [lo, hi)."""
    firsts, out = [], []
    for a, l, h in zip(box, lo, hi):
        got = intersect_dim(a, l, h)
        if got is None:
            return None
        firsts.append(got[0])
        out.append(got[1])
    return tuple(firsts), tuple(out)


def view(tensor: torch.Tensor, box: Box, offsets=None) -> torch.Tensor:
    """The elements of `box` in `tensor`, which holds the full tensor's range starting at `offsets`."""
    offsets = offsets or (0,) * len(box)
    return tensor[tuple(slice(s - o, s - o + (c - 1) * st + 1, st) for (s, st, c), o in zip(box, offsets))]


def split(box: Box, max_numel: int) -> list[tuple[tuple, Box]]:
    """`box` cut into sub-boxes of at most `max_numel` elements (along the first dimension that must
    be cut, whole rows of the rest kept together): [(first index per dim, sub-box)]."""
    if box_numel(box) <= max_numel or not box:
        return [((0,) * len(box), box)]
    inner = box_numel(box[1:])
    start, step, count = box[0]
    if inner <= max_numel:
        rows = max(1, max_numel // inner)
        return [((i,) + (0,) * (len(box) - 1), ((start + i * step, step, min(rows, count - i)),) + box[1:])
                for i in range(0, count, rows)]
    out = []
    for i in range(count):
        for first, sub in split(box[1:], max_numel):
            out.append(((i,) + first, ((start + i * step, step, 1),) + sub))
    return out


def shift_dst(offset: int, strides: tuple, first: tuple) -> int:
    """The destination offset of a sub-box that starts `first` elements into its parent box."""
    return offset + sum(f * s for f, s in zip(first, strides))
