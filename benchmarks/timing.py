"""Wall time of callables, the one place the benchmarks read a clock: CUDA events on a GPU,
perf_counter elsewhere (smoke runs) or where a benchmark times on the host clock.

median_ms              kernels and layers in one process: warm-ups untimed, peak memory on request
step_times_ms          steps and collectives: every call timed alike (warm-ups dropped), a barrier
step_median_ms         or bookkeeping around each call outside the timed region, memory stats left
                       alone; the per-call list, or its median
interleaved_median_ms  several callables in rounds, so run order weighs on all alike
do_bench_ms            triton's do_bench (budgets in ms, L2 flushed before each call)
matmul_tflops          the bf16 matmul rate that floors are read against
sync, synced           a device synchronize (none on the CPU); fn then one: for pytest-benchmark and
                       the host clock
Stopwatch              seconds since a start on the host clock: a run's time budget and total wall
                       time (bookkeeping, not a measurement)
check_measured         what a pytest-benchmark case asserts: its timings and the record's measured
                       numbers are finite and in range
"""
from __future__ import annotations

import math
import statistics
import time

import torch


def _call_ms(fn, cuda):
    """ms of one call: between CUDA events (then a device synchronize), or perf_counter around the
    call alone (a caller timing device work on the host clock syncs inside `fn`: see `synced`)."""
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


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
    times = [_call_ms(fn, cuda) for _ in range(iters)]
    if peak is not None:
        peak["peak_MB"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20 if cuda else None
    return statistics.median(times)


def step_times_ms(fn, iters, warmup, before=None, after=None, cuda=None) -> list:
    """ms of each of `iters` calls of `fn` after `warmup` calls, all timed alike (warm-ups dropped), so
    that every rank makes the same calls and collectives. `before()` and `after(i)` (i counts the
    warm-ups too) run around each call outside the timed region: a barrier, zero_grad, a memory
    reading. Memory statistics are left alone: a caller's peak spans these calls. `cuda`: as in
    `median_ms`; False times on the host clock."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    times = []
    for i in range(warmup + iters):
        if before is not None:
            before()
        ms = _call_ms(fn, cuda)
        if after is not None:
            after(i)
        if i >= warmup:
            times.append(ms)
    return times


def step_median_ms(fn, iters, warmup, before=None, after=None, cuda=None):
    """Median of `step_times_ms` (same arguments)."""
    return statistics.median(step_times_ms(fn, iters, warmup, before=before, after=after, cuda=cuda))


def interleaved_median_ms(fns: dict, iters, warmup, rounds=1, before=None, cuda=None) -> dict:
    """{name: median ms} of several callables timed in `rounds` rounds, each once per round in the
    same order, `iters` spread over the rounds (`warmup` calls in the first round, one in each later
    one), so that run order and allocator state weigh on all alike; rounds=1: one after the other.
    `before` and `cuda` as in `step_times_ms`."""
    times = {name: [] for name in fns}
    per_round = -(-iters // rounds)
    for r in range(rounds):
        for name, fn in fns.items():
            times[name] += step_times_ms(fn, per_round, warmup if r == 0 else 1, before=before, cuda=cuda)
    return {name: statistics.median(t) for name, t in times.items()}


def do_bench_ms(fn, warmup_ms=100, rep_ms=500):
    """Median ms by triton.testing.do_bench: call counts set by time budgets (ms, after a 5-call
    estimate), L2 cache flushed before each timed call."""
    import triton
    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def matmul_tflops(n=8192, device="cuda", timer=None):
    """bf16 n^3 matmul rate (TFLOP/s), the reference the benchmarks' floors and rates are read against.
    `timer(fn) -> ms`: default `median_ms` over 20 calls."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = (timer or (lambda f: median_ms(f, iters=20)))(lambda: a @ b)
    return 2 * n ** 3 / ms / 1e9


def sync(device=None):
    """Wait for `device` (default: the current CUDA device; a CPU device: nothing to wait for)."""
    if device is None or torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def synced(fn, device=None):
    """fn followed by `sync(device)`: what pytest-benchmark's wall clock, or a host-clock timing, should time."""
    def run():
        fn()
        sync(device)
    return run


class Stopwatch:
    """Seconds since it was made (or last `restart`), on the host clock: a run's time budget and its total
    wall time. Bookkeeping, not a measurement: time work with the functions above."""

    def __init__(self):
        self.restart()

    def restart(self) -> None:
        self._t0 = time.perf_counter()

    def seconds(self) -> float:
        return time.perf_counter() - self._t0


def host_seconds(fn):
    """(fn's result, wall seconds, this process's CPU seconds) of one call, on the host clocks: work that runs
    only on the host (layout inference, planning), where the CPU time says how much of the wall was this
    process's own."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def check_measured(benchmark=None, record=None, positive=("median_ms",), nonnegative=()) -> None:
    """Assert that a benchmark case measured what it reports: pytest-benchmark's timings (when
    `benchmark` ran) are finite and > 0; in `record`, each `positive` field is a finite number > 0
    and each `nonnegative` field one >= 0 or None (a figure only a GPU measures). A case whose
    timing came back NaN, zero or missing fails instead of landing in the table."""
    if benchmark is not None and getattr(benchmark, "stats", None) is not None:
        stats = benchmark.stats.stats
        for name in ("min", "median", "max"):
            value = getattr(stats, name)
            assert math.isfinite(value) and value > 0, f"benchmark {name} time {value}"
    record = record or {}
    for key in positive:
        value = record.get(key)
        assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, f"{key} = {value!r}"
    for key in nonnegative:
        value = record.get(key)
        assert value is None or isinstance(value, (int, float)) and math.isfinite(value) and value >= 0, \
            f"{key} = {value!r}"
