"""Probe: where `core_primitive_fused` spends its time above `core_cudnn` (mla/core_sweep.py's core
variants at DeepSeek-V3 head sizes, 16K tokens, bf16): one profiled forward + backward of each after
warm-up, the CUDA kernels with the most time. Prints one JSON line per variant.

    python benchmarks/mla/probes/probe_mla_assembly.py
"""
from __future__ import annotations

import sys
from pathlib import Path
import json

import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/: stamp, timing, siblings
from stamp import print_stamp  # noqa: E402
from siblings import load
core_fn = load("mla", "core_sweep").core_fn


def top_kernels(fn, n=12):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = e.name[:90]
            ms, calls = rows.get(k, (0.0, 0))
            rows[k] = (ms + e.device_time_total / 1e3, calls + 1)
    top = sorted(rows.items(), key=lambda kv: -kv[1][0])[:n]
    return round(sum(ms for ms, _ in rows.values()), 3), [[k, round(ms, 3), c] for k, (ms, c) in top]


def main():
    for variant in ("core_cudnn", "core_primitive", "core_primitive_fused"):
        total, top = top_kernels(core_fn(variant, 16384))
        print(json.dumps({"variant": variant, "tokens": 16384, "kernel_ms": total, "top": top}), flush=True)


if __name__ == "__main__":
    print_stamp(probe=Path(__file__).stem)
    main()
