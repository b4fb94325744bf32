"""Weight distribution from the trainer to the producers, behind a small interface:
`attach(rank, engine)` once in each process (the trainer is rank 0, producer i rank i + 1),
`publish(version, runtime)` on the trainer after each step, `refresh(engine)` and
`wait_newer(engine, timeout_s)` on the producers.

- `ObjectStoreChannel` (the default, survives producer restarts): the trainer's gathered export
  (`Runtime.export_weights`: HF names, full tensors) goes into Ray's object store once per version;
  a small store actor holds the newest reference; producers read it and call the engine's
  `load_weights`. Only the newest version is kept.
- `P2PChannel` (in `weights_p2p.py`): the weight-transfer primitive, point to point over a gloo
  group spanning the trainer and the producers.
"""
from __future__ import annotations

import asyncio
import time
from typing import Protocol

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
    """A WeightChannel through Ray's object store (picklable: the trainer and every producer hold one)."""

    def __init__(self, store, call_timeout_s: float):
        self.store, self.call_timeout_s = store, call_timeout_s

    def attach(self, rank: int, engine=None) -> None:
        pass

    def publish(self, version: int, runtime, rank: int = 0) -> None:
        """Every rank of the trainer calls it (the export gathers the shards); rank 0 publishes."""
        weights = {name: t.detach().cpu().contiguous() for name, t in runtime.export_weights(dtype=torch.float32)}
        if rank:
            return
        ref = ray.put(weights)
        get(self.store.publish.remote(version, [ref]), self.call_timeout_s, f"publishing weights version {version}")

    def refresh(self, engine) -> bool:
        """Load the newest weights into `engine` if they are newer than its own."""
        version, refs = get(self.store.latest.remote(), self.call_timeout_s, "asking the weight store")
        if version <= engine.version:
            return False
        weights = get(refs[0], self.call_timeout_s, f"fetching weights version {version}")
        engine.load_weights(weights.items(), version)
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


def get(ref, timeout_s: float, what: str):
    """ray.get with a limit: PipelineTimeout naming what stalled."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise PipelineTimeout(f"{what}: no answer within {timeout_s:g} s") from None
