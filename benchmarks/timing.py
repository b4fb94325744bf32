"""Median wall time of a callable: CUDA events on a GPU, perf_counter elsewhere (smoke runs)."""
from __future__ import annotations

import statistics
import time

import torch


def median_ms(fn, iters=10, warmup=3, peak=None, cuda=None):
    """Median ms of `fn` over `iters` calls after `warmup`. With `peak` (a dict) on CUDA, also the peak
    memory those calls allocate above what was allocated before them, in MB, as peak["peak_MB"].
    `cuda`: time with CUDA events (default: whenever CUDA is available)."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    if peak is not None:
        peak["peak_MB"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20 if cuda else None
    return statistics.median(times)


def matmul_tflops(n=8192, device="cuda"):
    """bf16 n^3 matmul rate (TFLOP/s), the reference the benchmarks' floors and rates are read against."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    return 2 * n ** 3 / median_ms(lambda: a @ b, iters=20) / 1e9


def synced(fn):
    """fn followed by a device synchronize: what pytest-benchmark's wall clock should time."""
    def run():
        fn()
        torch.cuda.synchronize()
    return run
