"""Weights for an inference engine, in the names and layout of the HF checkpoint `save_pretrained`
writes: gathered in buckets (`export_weights`), or each rank's own slices with their place in the
full HF tensors, without any collective (`export_weight_shards`, for transfers between shardings).

The map from our tensors to HF tensors is the model's own `ours_to_hf_state`, traced once on meta
tensors that carry their source's name: every HF tensor is a strided view (or a copy) of one of our
tensors, so a gathered tensor, or a rank's rows of it, gives its HF tensors directly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten

from bumblebee.common.state_sharding import persistent_buffers


@dataclass
class WeightShard:
    """This rank's slice `tensor` of the HF tensor `name` (full `shape`), starting at `offsets`.
    `replicated`: every rank holds the same slice (the whole tensor: router biases), so one rank
    suffices to send it."""
    name: str
    tensor: torch.Tensor
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    replicated: bool = False

    @property
    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.tensor.shape))


class _Named(torch.Tensor):
    """A meta tensor that hands its source's name to every tensor computed from it."""
    source: str

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        names = [a.source for a in tree_flatten((args, kwargs))[0] if isinstance(a, _Named) and hasattr(a, "source")]
        for o in tree_flatten(out)[0]:
            if isinstance(o, _Named) and names:
                o.source = names[0]
        return out


def hf_layout(model, shapes: dict[str, torch.Size]) -> dict[str, list[tuple]]:
    """{our name: [(hf name, size, stride, storage offset)]}: each HF tensor as a view of our full,
    contiguous tensor (a copy in the HF layout reads as the whole tensor)."""
    named = {}
    for name, shape in shapes.items():
        t = torch.empty(shape, device="meta").as_subclass(_Named)
        t.source = name
        named[name] = t
    hf = model.ours_to_hf_state(named) if hasattr(model, "ours_to_hf_state") else named
    out = {name: [] for name in shapes}
    for hf_name, v in hf.items():
        out[v.source].append((hf_name, tuple(v.shape), tuple(v.stride()), v.storage_offset()))
    return out


def sources(model, state) -> dict[str, tuple]:
    """{our name: (this rank's tensor, DTensor view or None, full shape)}: the state's fp32 masters
    (ZeRO-1 and FSDP2 alike) or, without a state, the model's own tensors; then the buffers."""
    out = {}
    if state is not None:
        for name, m in state.masters().items():
            dt = state._as_dtensor(name, m)
            out[name] = (dt.to_local(), dt, tuple(dt.shape))
    else:
        sd = dict(model.state_dict())
        if getattr(model.config, "tie_word_embeddings", False):
            sd.pop("lm_head.weight", None)  # transformers stores a tied head once
        buffers = persistent_buffers(model)
        out = {n: (t, None, tuple(t.shape)) for n, t in sd.items() if n not in buffers}
    for name, b in persistent_buffers(model).items():
        out[name] = (b, None, tuple(b.shape))
    return out


def _dtype(model, dtype) -> torch.dtype:
    """The export's dtype: `dtype`, a floating one (an integer cast would truncate the weights), or
    the model config's."""
    if dtype is None:
        return getattr(model.config, "dtype", torch.float32)
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating torch.dtype (torch.bfloat16, torch.float16, torch.float32, "
                         f"...) or None (the model's), got {dtype!r}")
    return dtype


def export_weights(model, state, *, bucket_bytes: int, dtype=None):
    """(hf name, full tensor) pairs, all-gathered a bucket of about `bucket_bytes` at a time (a larger
    tensor is a bucket alone). Every rank takes part in every gather: iterate to the end on all.
    The arguments are checked at the call, before the first tensor is asked for."""
    if not (isinstance(bucket_bytes, int) and bucket_bytes > 0):
        raise ValueError(f"bucket_bytes must be an int > 0, got {bucket_bytes!r}")
    return _export_weights(model, state, bucket_bytes, _dtype(model, dtype))


@torch.no_grad()
def _export_weights(model, state, bucket_bytes, dtype):
    src = sources(model, state)
    layout = hf_layout(model, {n: s[2] for n, s in src.items()})
    buffers = persistent_buffers(model)
    bucket, size = [], 0
    for name, (_, _, shape) in src.items():
        bucket.append(name)
        size += math.prod(shape) * (buffers[name].element_size() if name in buffers else dtype.itemsize)
        if size >= bucket_bytes:
            yield from _flush(bucket, src, layout, buffers, dtype)
            bucket, size = [], 0
    yield from _flush(bucket, src, layout, buffers, dtype)


def _flush(bucket, src, layout, buffers, dtype):
    full = {}
    for name in bucket:  # one all-gather per sharded tensor, in the same order on every rank
        local, dt, _ = src[name]
        if name in buffers:
            full[name] = local.detach()
        elif dt is not None:
            full[name] = dt.to(dtype).full_tensor()
        else:
            full[name] = local.detach().to(dtype)
    for name in bucket:
        t = full[name].contiguous()
        for hf_name, size, stride, offset in layout[name]:
            yield hf_name, t.as_strided(size, stride, t.storage_offset() + offset)


def export_weight_shards(model, state, *, dtype=None):
    """WeightShard per HF tensor slice this rank holds (no collective). Sharded tensors are split on
    dim 0 (FSDP2 and ZeRO-1 alike; experts over ep, then efsdp): an HF tensor that is our whole
    tensor gets this rank's rows; one inside a single row of ours (an expert's projection) comes
    whole from the rank holding that row."""
    return _export_weight_shards(model, state, _dtype(model, dtype))


@torch.no_grad()
def _export_weight_shards(model, state, dtype):
    src = sources(model, state)
    layout = hf_layout(model, {n: s[2] for n, s in src.items()})
    buffers = persistent_buffers(model)
    for name, (local, dt, shape) in src.items():
        r0 = _row_offset(dt)
        rows = local.shape[0] if local.dim() else 0
        if local.numel() == 0:
            continue
        local = local.detach() if name in buffers else local.detach().to(dtype)
        row_numel = math.prod(shape[1:])
        for hf_name, size, stride, offset in layout[name]:
            if math.prod(size) == math.prod(shape) and offset == 0:  # the whole tensor (or a copy of it)
                view = local.reshape(rows, *size[1:]) if size[0] == shape[0] else None
                if view is None:
                    raise NotImplementedError(f"{hf_name}: a reshape of {name} across dim 0 is not supported")
                yield WeightShard(hf_name, view, size, (r0,) + (0,) * (len(size) - 1), replicated=dt is None)
                continue
            row, within = divmod(offset, row_numel)
            extent = sum((n - 1) * s for n, s in zip(size, stride)) + 1
            if within + extent > row_numel:
                raise NotImplementedError(f"{hf_name} spans several rows of {name}: not a row-sharded layout")
            if r0 <= row < r0 + rows:
                flat = local[row - r0].contiguous().view(-1)
                yield WeightShard(hf_name, flat.as_strided(size, stride, flat.storage_offset() + within), size,
                                  (0,) * len(size), replicated=dt is None)


def _row_offset(dt) -> int:
    """Where this rank's rows start in the full tensor (0 when not sharded)."""
    if dt is None:
        return 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    _, offset = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
    return offset[0] if len(offset) else 0
