"""Peak-memory and step-time probes: the CUDA allocator on a GPU, a tensor tracker on the CPU."""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch


@contextmanager
def peak_memory(device: torch.device, *track):
    """Yields a dict whose "peak_bytes" is set on exit: allocated bytes at the peak of the block.

    CUDA: the caching allocator's max_memory_allocated. CPU: torch's MemTracker, which counts live
    tensor storages (parameters, gradients, optimizer states, activations), never process RSS.
    """
    result = {"peak_bytes": 0}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield result
        torch.cuda.synchronize(device)
        result["peak_bytes"] = torch.cuda.max_memory_allocated(device)
        return
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(*track)
    with tracker:
        yield result
    peak = tracker.get_tracker_snapshot("peak")
    result["peak_bytes"] = int(sum(v.get("Total", 0) for v in peak.values()))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def wall_ms(device: torch.device):
    """Yields a dict whose "ms" is the block's wall time, the device synchronized on both ends."""
    result = {}
    sync(device)
    start = time.perf_counter()
    yield result
    sync(device)
    result["ms"] = (time.perf_counter() - start) * 1e3
