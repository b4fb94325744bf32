"""What a receiver holds (`ReceiverSpec`: pieces of HF tensors inside its own tensors) and what a
sender holds (`SenderSpec`: boxes of HF tensors it can read), and the manifest both agree on.

A `Piece` says: the elements `box` of HF tensor `hf_name` land in target tensor `target` at
`as_strided(box_shape, strides, target.storage_offset() + offset)`. Applying a spec is plain
strided copies (a cast where the target's dtype differs from the HF tensor's), so what the
receiver's own loader does is replayed exactly, from any slice of the HF tensor that covers the
piece.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

from bumblebee.primitives.weight_transfer.boxes import Box, box_numel, box_shape, range_box, view


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


# manifest: ((hf name, shape, dtype name), ...) in the senders' export order
Manifest = tuple


def manifest_of(entries) -> Manifest:
    return tuple((str(n), tuple(int(s) for s in shape), dtype_name(dt) if isinstance(dt, torch.dtype) else dt)
                 for n, shape, dt in entries)


@dataclass(frozen=True)
class Piece:
    hf_name: str
    box: Box
    target: str
    strides: tuple
    offset: int

    def dest(self, target: torch.Tensor) -> torch.Tensor:
        return target.as_strided(box_shape(self.box), self.strides, target.storage_offset() + self.offset)


@dataclass(frozen=True)
class ReceiverSpec:
    """Every piece of every HF tensor this receiver keeps. `targets`: ((name, shape, stride, dtype
    name), ...) of the tensors written; `manifest`: the HF tensors it was inferred against."""
    manifest: Manifest
    targets: tuple
    pieces: tuple

    @property
    def digest(self) -> str:
        return digest([self.manifest, self.targets, [(p.hf_name, p.box, p.target, p.strides, p.offset)
                                                     for p in self.pieces]])

    def need_numel(self) -> int:
        """Elements this receiver must get (a box sent to several places of its targets counts once)."""
        return sum(box_numel(b) for _, b in {(p.hf_name, p.box) for p in self.pieces})

    @torch.no_grad()
    def apply(self, full: dict, targets: dict) -> None:
        """Write the pieces of the full HF tensors `full` ({name: tensor}) into `targets`."""
        for p in self.pieces:
            if p.hf_name in full:
                p.dest(targets[p.target]).copy_(view(full[p.hf_name], p.box))

    def check_targets(self, targets: dict) -> None:
        """ValueError naming the first target whose name, shape, stride or dtype moved since inference."""
        have = {n: (tuple(t.shape), tuple(t.stride()), dtype_name(t.dtype)) for n, t in targets.items()}
        for name, shape, stride, dt in self.targets:
            if have.get(name) != (tuple(shape), tuple(stride), dt):
                raise ValueError(f"target {name!r}: the spec expects shape {tuple(shape)} stride {tuple(stride)} "
                                 f"{dt}, the receiver holds {have.get(name, 'nothing')}")


@dataclass(frozen=True)
class SenderSpec:
    """Boxes of HF tensors one sender rank holds: ((hf name, box, replicated), ...)."""
    rank: int
    boxes: tuple

    @property
    def digest(self) -> str:
        return digest([self.rank, self.boxes])


def sender_spec(rank: int, shards) -> tuple[SenderSpec, Manifest, dict]:
    """(spec, manifest, {(hf name, box): local tensor}) of this rank's shards: objects with `name`,
    `tensor`, `shape`, `offsets` and `replicated` (runtime.export.WeightShard). No collective."""
    boxes, manifest, local = [], [], {}
    for s in shards:
        box = range_box(s.offsets, s.tensor.shape)
        if len(box) != len(s.shape) or any(st + c > n for (st, _, c), n in zip(box, s.shape)):
            raise ValueError(f"shard {s.name!r}: offsets {tuple(s.offsets)} + {tuple(s.tensor.shape)} fall outside "
                             f"the full shape {tuple(s.shape)}")
        boxes.append((s.name, box, bool(s.replicated)))
        manifest.append((s.name, tuple(s.shape), s.tensor.dtype))
        local[(s.name, box)] = s.tensor
    return SenderSpec(rank, tuple(boxes)), manifest_of(manifest), local


class SenderSpecs:
    """`sender_spec` over successive updates of one rank: the last spec and manifest are reused when
    every shard's name, full shape, offsets, local shape, dtype and replication (all that `sender_spec`
    reads but the tensors) equal the last call's. Building them costs several microseconds of Python
    per shard (~800 shards for a 2-layer Qwen3-30B-A3B slice: milliseconds of every update's host
    time); the per-shard comparison a fraction of that. Holds no tensor between calls."""

    def __init__(self):
        self._key, self._last = None, None

    def __call__(self, rank: int, shards) -> tuple[SenderSpec, Manifest, dict]:
        shards = list(shards)
        key = (rank, [(s.name, tuple(s.shape), tuple(s.offsets), s.tensor.shape, s.tensor.dtype, bool(s.replicated))
                      for s in shards])
        if key != self._key:
            spec, manifest, local = sender_spec(rank, shards)
            self._key, self._last = key, (spec, manifest)
            return spec, manifest, local
        spec, manifest = self._last
        return spec, manifest, {(name, box): s.tensor for (name, box, _), s in zip(spec.boxes, shards)}
