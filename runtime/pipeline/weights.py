"""Weight distribution from the trainer to the producers, behind a small interface:
`attach(rank, engine)` once in each process (the trainer is rank 0, producer i rank i + 1),
`publish(version, runtime)` on the trainer after each step, `refresh(engine)` and
`wait_newer(engine, timeout_s)` on the producers.

- `ObjectStoreChannel` (the default, survives producer restarts): the trainer's gathered export
  (`Runtime.export_weights`: HF names, full tensors) goes into Ray's object store once per version,
  as byte arrays (`pack`: Ray keeps numpy arrays out of band, one copy into the store and none for
  pickling; CUDA tensors leave their device in one copy); a small store actor holds the newest
  reference; producers map the arrays from shared memory, move them to their engine's device
  (`unpack`) and call the engine's `load_weights`. Only the newest version is kept. With
  `background` (the default) the trainer only snapshots the export (one copy on its device, and on
  CUDA the copy to a pinned host buffer started on a side stream) and goes on training: a thread puts
  it into the store, one version in flight; the next publish (or `flush`) waits for it and raises
  its error.
- `P2PChannel` (in `weights_p2p.py`): the weight-transfer primitive, point to point over one
  group spanning the trainer and the producers (gloo; NCCL for the shards of actors on GPUs).
"""
from __future__ import annotations

import asyncio
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import numpy as np
import ray
import torch

from bumblebee.runtime.pipeline.config import PipelineTimeout


class WeightChannel(Protocol):
    def attach(self, rank: int, engine=None) -> None: ...

    def publish(self, version: int, runtime) -> None: ...

    def refresh(self, engine) -> bool: ...

    def wait_newer(self, engine, timeout_s: float) -> int: ...


@ray.remote(num_cpus=0)
class WeightStore:
    """The newest (version, [object ref]) published; waits for a newer one without polling."""

    def __init__(self):
        self.version, self.refs = -1, None
        self.changed = asyncio.Event()

    async def publish(self, version: int, refs: list) -> None:
        if version <= self.version:
            raise ValueError(f"version must increase: {version} after {self.version}")
        self.version, self.refs = version, refs
        self.changed.set()
        self.changed = asyncio.Event()

    async def latest(self) -> tuple[int, list | None]:
        return self.version, self.refs

    async def wait_newer(self, version: int, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while self.version <= version:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                await asyncio.wait_for(self.changed.wait(), left)
            except asyncio.TimeoutError:
                break
        return self.version


class ObjectStoreChannel:
    """A WeightChannel through Ray's object store (picklable: the trainer and every producer hold one).
    background: the trainer's publish returns once the export is snapshotted; a thread puts it."""

    def __init__(self, store, call_timeout_s: float, background: bool = True):
        self.store, self.call_timeout_s, self.background = store, call_timeout_s, background
        self._pending = self._pool = self._pinned = None

    def __getstate__(self):  # the trainer's thread, future and host buffer stay in its process
        return {**self.__dict__, "_pending": None, "_pool": None, "_pinned": None}

    def attach(self, rank: int, engine=None) -> None:
        pass

    def publish(self, version: int, runtime, rank: int = 0) -> None:
        """Every rank of the trainer calls it (the export gathers the shards); rank 0 publishes (in the
        background where the channel says so): the previous version's put ends first."""
        items = runtime.export_weights(dtype=torch.float32)  # lazy: gathers as it is read, on every rank
        if rank:
            for _ in items:  # this rank's part of each gather
                pass
            return
        self.flush()
        if not self.background:
            return self._put(version, pack(items))
        snap = self._snapshot(items)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="publish-weights")
        self._pending = self._pool.submit(lambda: self._put(version, snap()))

    def flush(self) -> None:
        """Wait for the version in flight to be in the store; raises what its put raised."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _put(self, version: int, packed) -> None:
        ref = ray.put(packed)
        get(self.store.publish.remote(version, [ref]), self.call_timeout_s, f"publishing weights version {version}")

    def _snapshot(self, items):
        """A copy of the export that later steps cannot change; returns what gives its `pack` form (on
        CUDA after the side stream's copy to the pinned host buffer, reused: one version in flight)."""
        meta, views = _byte_views(items)
        sizes = [v.numel() for v in views]
        flat = torch.cat(views) if views else torch.empty(0, dtype=torch.uint8)
        del views  # the snapshot holds only its own copy
        done = None
        if flat.device.type == "cuda":
            if self._pinned is None or self._pinned.numel() != flat.numel():
                self._pinned = torch.empty(flat.numel(), dtype=torch.uint8, pin_memory=True)
            host, stream = self._pinned, torch.cuda.Stream(flat.device)
            stream.wait_stream(torch.cuda.current_stream(flat.device))
            with torch.cuda.stream(stream):
                host.copy_(flat, non_blocking=True)
            flat.record_stream(stream)  # the allocator keeps the device copy until the side stream is done
            done, flat = stream.record_event(), host

        def packed():
            if done is not None:
                done.synchronize()
            return [(*m, v.numpy()) for m, v in zip(meta, flat.split(sizes))]
        return packed

    def refresh(self, engine) -> bool:
        """Load the newest weights into `engine` if they are newer than its own."""
        version, refs = get(self.store.latest.remote(), self.call_timeout_s, "asking the weight store")
        if version <= engine.version:
            return False
        packed = get(refs[0], self.call_timeout_s, f"fetching weights version {version}")
        engine.load_weights(unpack(packed, getattr(engine, "device", "cpu")), version)
        return True

    def wait_newer(self, engine, timeout_s: float) -> int:
        version = engine.version
        got = get(self.store.wait_newer.remote(version, timeout_s), timeout_s + self.call_timeout_s,
                  f"waiting for weights newer than version {version}")
        if got <= version:
            raise PipelineTimeout(f"no weights newer than version {version} within {timeout_s:g} s "
                                  f"(weight_timeout_s): the trainer stalled or died")
        self.refresh(engine)
        return engine.version


def pack(items) -> list[tuple[str, str, tuple, np.ndarray]]:
    """[(name, dtype, shape, its bytes as a uint8 numpy array)]: Ray keeps numpy arrays out of band (one
    copy into the store, no pickling of tensors) and readers map them from shared memory. CPU tensors
    are viewed, not copied; CUDA tensors are concatenated on their device and leave it in one copy."""
    meta, views = _byte_views(items)
    if any(v.device.type != "cpu" for v in views):
        views = torch.cat(views).cpu().split([v.numel() for v in views])
    return [(*m, v.numpy()) for m, v in zip(meta, views)]


def _byte_views(items) -> tuple[list, list]:
    """[(name, dtype, shape)] and each tensor's bytes as a flat uint8 view (contiguous first)."""
    tensors = [(name, t.detach().contiguous()) for name, t in items]
    meta = [(name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in tensors]
    return meta, [t.reshape(-1).view(torch.uint8) for _, t in tensors]


def unpack(packed, device) -> list[tuple[str, torch.Tensor]]:
    """`pack`'s tensors on `device` (on the CPU: views of the store's read-only memory, which the
    engine's load only reads)."""
    out = []
    with warnings.catch_warnings():  # torch warns that the store's buffer is read-only; nothing writes it
        warnings.simplefilter("ignore", UserWarning)
        for name, dtype, shape, data in packed:
            dt = getattr(torch, dtype)
            t = torch.from_numpy(data).to(device).view(dt) if data.size else torch.empty(0, dtype=dt, device=device)
            out.append((name, t.reshape(shape)))
    return out


def get(ref, timeout_s: float, what: str):
    """ray.get with a limit: PipelineTimeout naming what stalled."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise PipelineTimeout(f"{what}: no answer within {timeout_s:g} s") from None
