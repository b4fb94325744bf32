"""Where one profiled update's time went, read from the torch profiler's events (`bench.py --profile`).

`breakdown(events, window, wall_ms)`: within the window (a `record_function` range around the update
and its device synchronize) the device time by kernel category (nccl send/recv, copies: memcpy, the
elementwise and multi-tensor copy kernels, cat, index; other), the device's busy time (the union of
kernel intervals: NCCL and copies run on different streams) and idle time (the window less that
union), the host time before the first kernel and after the last, the device activity as a short
timeline of same-category runs, the endpoint's phases (`weight_transfer.*` ranges) and the top CPU
ops by self time on the window's thread.
"""
from __future__ import annotations

import torch

CATEGORIES = (  # first match wins; kernel names lower-cased
    ("nccl", ("nccl",)),
    ("copy", ("memcpy", "copy", "catarray", "cat_", "index", "gather", "scatter")),
)
PHASE_PREFIX = "weight_transfer."
# device-side records that are no kernel: a record_function range mirrored on the GPU timeline, syncs
_NOT_KERNELS = ("gpu_user_annotation", "cuda_sync", "cuda_profiler_range")


def classify(name: str) -> str:
    low = name.lower()
    return next((cat for cat, keys in CATEGORIES if any(k in low for k in keys)), "other")


def union_us(intervals) -> float:
    """Total length of the union of [start, end) intervals."""
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total, end = total + e - s, e
        elif e > end:
            total, end = total + e - end, e
    return total


def _is_device(e) -> bool:
    return e.device_type != torch.autograd.DeviceType.CPU


def _is_kernel(e, window: str) -> bool:
    """A device kernel, memcpy or memset: no mirrored range (flagged, or by its name where a torch
    does not flag it)."""
    return _is_device(e) and not getattr(e, "is_user_annotation", False) and \
        getattr(e, "activity_type", None) not in _NOT_KERNELS and e.name != window and \
        not e.name.startswith(PHASE_PREFIX)


def timeline(kernels, lo: float, gap_us: float = 20.0, most: int = 40) -> list:
    """[category, start ms, end ms] from `lo`: kernels (category, start, end) in start order, a run
    of one category joined across gaps up to `gap_us`."""
    runs: list = []
    for cat, s, e in sorted(kernels, key=lambda k: k[1]):
        if runs and runs[-1][0] == cat and s - runs[-1][2] <= gap_us:
            runs[-1][2] = max(runs[-1][2], e)
        else:
            runs.append([cat, s, e])
    return [[c, round((s - lo) / 1e3, 3), round((e - lo) / 1e3, 3)] for c, s, e in runs[:most]]


def breakdown(events, window: str, wall_ms: float, device: bool, top: int = 10) -> dict:
    """The profile of the update run inside the range named `window` (see the module docstring).
    `events`: `prof.events()`; `wall_ms`: the update's host-clock time; `device`: whether device
    activity was traced (else the device fields are None)."""
    span = next(e for e in events if e.name == window and not _is_device(e))
    lo, hi = span.time_range.start, span.time_range.end
    kernels = [(classify(e.name), max(lo, e.time_range.start), min(hi, e.time_range.end))
               for e in events if _is_kernel(e, window) and e.time_range.end > lo and e.time_range.start < hi]
    ops: dict = {}
    for e in events:  # host work of the update's own thread
        if not _is_device(e) and e.thread == span.thread and lo <= e.time_range.start < hi:
            got = ops.setdefault(e.name, [0.0, 0])
            got[0] += e.self_cpu_time_total / 1e3
            got[1] += 1
    phases = [[e.name.removeprefix(PHASE_PREFIX), round((e.time_range.start - lo) / 1e3, 3),
               round((e.time_range.end - e.time_range.start) / 1e3, 3)]
              for e in sorted(events, key=lambda e: e.time_range.start)
              if not _is_device(e) and e.name.startswith(PHASE_PREFIX) and lo <= e.time_range.start < hi]
    out = {"wall_ms": wall_ms, "window_ms": (hi - lo) / 1e3, "phases": phases,
           "top_cpu_ops": [{"name": n[:120], "self_ms": round(ms, 3), "count": c}
                           for n, (ms, c) in sorted(ops.items(), key=lambda kv: -kv[1][0])[:top]]}
    if not device:
        return {**out, "gpu_ms": None, "gpu_busy_ms": None, "gpu_idle_ms": None, "lead_ms": None,
                "tail_ms": None, "timeline": None}
    gpu = {cat: 0.0 for cat, _ in CATEGORIES} | {"other": 0.0}
    for cat, s, e in kernels:
        gpu[cat] += (e - s) / 1e3
    busy = union_us([(s, e) for _, s, e in kernels]) / 1e3
    return {**out, "gpu_ms": gpu, "kernels": len(kernels), "gpu_busy_ms": busy,
            "gpu_idle_ms": (hi - lo) / 1e3 - busy,
            "lead_ms": (min((s for _, s, _ in kernels), default=hi) - lo) / 1e3,
            "tail_ms": (hi - max((e for _, _, e in kernels), default=lo)) / 1e3,
            "timeline": timeline(kernels, lo)}


def profile_update(fn, device, window: str = "bench.update", before=None) -> dict:
    """Run `fn` once under the profiler (CPU, and CUDA on a GPU) inside the range `window`, then a
    device synchronize; `before()` (a barrier) runs first, inside the profile, outside the window.
    Its breakdown, wall time on the host clock (benchmarks/timing.py)."""
    from torch.profiler import ProfilerActivity, profile, record_function
    from timing import step_times_ms, sync
    cuda = torch.device(device).type == "cuda"

    def once():
        with record_function(window):
            fn()
            sync(device)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        if before is not None:
            before()
        wall = step_times_ms(once, 1, 0, cuda=False)[0]
    return breakdown(prof.events(), window, wall, cuda)
