"""Probe: where `chunks="auto"` below its threshold (one chunk after the count exchange) loses time
against explicit C = 1 with the same kernels. Steps timed alternately, then one profiled window of
each: per op, calls, host (self CPU) and device time per step, the largest differences first.
One JSON line per size on rank 0 (moe_dispatch/bench.py's layer, EP = the world size).

    torchrun --nproc_per_node 2 benchmarks/moe_dispatch/probes/probe_auto_overhead.py
"""
from __future__ import annotations

import sys
from pathlib import Path
import json
import statistics

import torch
import torch.distributed as dist
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/: stamp, timing, siblings
from stamp import print_stamp  # noqa: E402
from siblings import load
moe_dispatch_bench = load("moe_dispatch")
inputs, layer_step, step_times = moe_dispatch_bench.inputs, moe_dispatch_bench.layer_step, moe_dispatch_bench.step_times
from probe_auto_chunks import setup

STEPS = 5


def profile(step, group):
    """{op: (calls, self CPU us, self device us)} per step over STEPS profiled steps."""
    step_times(step, group, 3, 0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            step()
        torch.cuda.synchronize()
    return {e.key[:90]: (e.count / STEPS, e.self_cpu_time_total / STEPS, e.self_device_time_total / STEPS)
            for e in prof.key_averages()}


def main():
    rank, group, device, experts = setup()
    for N in (4096, 8192):
        x, w, idx = inputs(N, rank, device)
        steps = {"c1": layer_step("chunked", x, w, idx, experts, chunks=1),
                 "auto": layer_step("chunked", x, w, idx, experts, chunks="auto")}
        ms = {k: [] for k in steps}
        for _ in range(5):
            for k, s in steps.items():
                ms[k] += step_times(s, group, 2, 4)
        prof = {k: profile(s, group) for k, s in steps.items()}
        keys = set(prof["c1"]) | set(prof["auto"])
        zero = (0.0, 0.0, 0.0)
        diff = [(k, *(round(a - c, 1) for a, c in zip(prof["auto"].get(k, zero), prof["c1"].get(k, zero))))
                for k in keys]
        if rank == 0:
            print(json.dumps({
                "tokens_per_rank": N, "ep": dist.get_world_size(),
                "median_ms": {k: round(statistics.median(v), 3) for k, v in ms.items()},
                "host_us_per_step": {k: round(sum(v[1] for v in p.values()), 1) for k, p in prof.items()},
                "largest_cpu_diff (op, calls, self cpu us, self device us; auto - c1)":
                    sorted(diff, key=lambda d: -abs(d[2]))[:15],
                "largest_device_diff": sorted(diff, key=lambda d: -abs(d[3]))[:10]}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    print_stamp(probe=Path(__file__).stem)
    main()
