"""Weight distribution from the trainer to the producers, behind a small interface (`publish` on the
trainer's side; `latest_version`, `wait_newer`, `fetch` on the producers'), so that a point-to-point
transfer primitive can replace the shipped channel. The shipped `ObjectStoreChannel` puts the
trainer's export (`Runtime.export_weights`: HF names, full tensors) into Ray's object store once per
version; a small store actor holds the newest reference, and producers read it (zero-copy on the
same node). Only the newest version is kept: an older one is freed once no producer holds it."""
from __future__ import annotations

import asyncio
import time
from typing import Iterable, Protocol

import ray
import torch

from bumblebee.runtime.pipeline.config import PipelineTimeout


class WeightChannel(Protocol):
    def publish(self, version: int, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def latest_version(self) -> int: ...

    def wait_newer(self, version: int, timeout_s: float) -> int: ...

    def fetch(self) -> tuple[int, list[tuple[str, torch.Tensor]]]: ...


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

    def publish(self, version, weights) -> None:
        ref = ray.put({name: t.detach().cpu().contiguous() for name, t in weights})
        get(self.store.publish.remote(version, [ref]), self.call_timeout_s, f"publishing weights version {version}")

    def latest_version(self) -> int:
        return get(self.store.latest.remote(), self.call_timeout_s, "asking the weight store its version")[0]

    def wait_newer(self, version: int, timeout_s: float) -> int:
        got = get(self.store.wait_newer.remote(version, timeout_s), timeout_s + self.call_timeout_s,
                  f"waiting for weights newer than version {version}")
        if got <= version:
            raise PipelineTimeout(f"no weights newer than version {version} within {timeout_s:g} s "
                                  f"(weight_timeout_s): the trainer stalled or died")
        return got

    def fetch(self):
        version, refs = get(self.store.latest.remote(), self.call_timeout_s, "asking the weight store")
        if refs is None:
            raise RuntimeError("no weights published yet")
        weights = get(refs[0], self.call_timeout_s, f"fetching weights version {version}")
        return version, list(weights.items())


def get(ref, timeout_s: float, what: str):
    """ray.get with a limit: PipelineTimeout naming what stalled."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise PipelineTimeout(f"{what}: no answer within {timeout_s:g} s") from None
