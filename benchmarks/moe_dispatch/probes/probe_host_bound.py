"""Probe: where a small MoE layer step (4K-8K tokens per rank) leaves the GPU idle. For the twin,
C = 1 and the default, one profiled step per size (`--stack`: with Python stacks, which slow the
host several-fold and so distort the gaps; off for the committed run): busy time per stream, the
compute stream's idle gaps, each split into "host late" (the next kernel was launched after the
previous one ended: the host is the bottleneck) and "waiting" (launched in time, held by an event or
a sync), what launched the kernels after the largest gaps (innermost ops, or Python lines), and the
number of launches. Steps are also timed
alternately (medians). One JSON line per (size, implementation) on rank 0; traces under --out.

    torchrun --nproc_per_node 2 benchmarks/moe_dispatch/probes/probe_host_bound.py --out DIR
"""
from __future__ import annotations

import sys
import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.distributed as dist
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/: stamp, timing, siblings
from stamp import print_stamp  # noqa: E402
from siblings import load
moe_dispatch_bench = load("moe_dispatch")
inputs, layer_step, step_times = moe_dispatch_bench.inputs, moe_dispatch_bench.layer_step, moe_dispatch_bench.step_times
from probe_auto_chunks import setup

CONFIGS = (("twin", "all_to_all", None), ("c1", "chunked", 1), ("auto", "chunked", "auto"))
OURS = ("moe_dispatch",)  # primitives/, kernels/ and common/moe_dispatch*, the bench


def profiled_step(step, path, stack):
    step_times(step, None, 3, 0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA], with_stack=stack) as prof:
        for _ in range(2):
            torch.cuda.synchronize()
            with torch.profiler.record_function("probe_step"):
                step()
            torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))
    return json.loads(Path(path).read_text())["traceEvents"]


def _end(e):
    return e["ts"] + e.get("dur", 0)


def launcher(ev_by_tid, rt):
    """The innermost lines of our files on the Python stack around a runtime call (with --stack), else
    the innermost ops."""
    frames = [e for e in ev_by_tid.get(rt["tid"], []) if e["ts"] <= rt["ts"] <= _end(e)
              and (e.get("cat") == "cpu_op" or any(s in e["name"] for s in OURS))]
    frames.sort(key=lambda e: -e["ts"])  # innermost first
    return [f["name"].split("/")[-1][:80] for f in frames[:3]]


def analyse(ev):
    """Last profiled step: busy ms per stream, the compute stream's gaps and what launched after them."""
    step = [e for e in ev if e.get("name") == "probe_step" and e.get("cat") == "user_annotation"][-1]
    t0, t1 = step["ts"], _end(step)
    runtime = {e["args"]["correlation"]: e for e in ev
               if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    gpu = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
           and e.get("args", {}).get("correlation") in runtime and t0 <= runtime[e["args"]["correlation"]]["ts"] <= t1]
    busy = {}
    for e in gpu:
        busy[e["args"]["stream"]] = busy.get(e["args"]["stream"], 0) + e["dur"]
    compute = max(busy, key=lambda s: sum(e["dur"] for e in gpu if e["args"]["stream"] == s and "nccl" not in e["name"]))
    ks = sorted((e for e in gpu if e["args"]["stream"] == compute), key=lambda e: e["ts"])
    py = {}
    for e in ev:
        if e.get("cat") in ("python_function", "cpu_op"):
            py.setdefault(e["tid"], []).append(e)
    gaps, late, waiting = [], 0.0, 0.0
    for prev, nxt in zip(ks, ks[1:]):
        gap = nxt["ts"] - _end(prev)
        if gap <= 2:
            continue
        rt = runtime[nxt["args"]["correlation"]]
        host_late = max(0.0, min(gap, _end(rt) - _end(prev)))  # idle time before the launch returned
        late += host_late
        waiting += gap - host_late
        gaps.append((gap, host_late, prev["name"][:50], nxt["name"][:50], rt["name"], launcher(py, rt)))
    gaps.sort(key=lambda g: -g[0])
    syncs = [e for e in ev if e.get("cat") == "cuda_runtime" and t0 <= e["ts"] <= t1
             and e["name"] in ("cudaMemcpyAsync", "cudaStreamSynchronize", "cudaDeviceSynchronize")]
    return {"step_wall_ms": round((t1 - t0) / 1e3, 3),
            "busy_ms_by_stream": {str(s): round(b / 1e3, 3) for s, b in busy.items()},
            "compute_stream": str(compute),
            "compute_first_kernel_after_step_start_ms": round((ks[0]["ts"] - t0) / 1e3, 3) if ks else None,
            "compute_idle_host_late_ms": round(late / 1e3, 3), "compute_idle_waiting_ms": round(waiting / 1e3, 3),
            "host_sync_ms": round(sum(e["dur"] for e in syncs) / 1e3, 3),
            "launches": sum(1 for e in ev if e.get("cat") == "cuda_runtime" and t0 <= e["ts"] <= t1
                            and "Launch" in e["name"]),
            "largest_gaps (us, host-late us, before, after, runtime call, launched from)":
                [[round(g[0], 1), round(g[1], 1), *g[2:]] for g in gaps[:12]]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--stack", action="store_true", help="record Python stacks (slows the host several-fold)")
    args = ap.parse_args()
    rank, group, device, experts = setup()
    args.out.mkdir(parents=True, exist_ok=True)
    for N in args.tokens:
        x, w, idx = inputs(N, rank, device)
        steps = {name: layer_step(impl, x, w, idx, experts, chunks=chunks) for name, impl, chunks in CONFIGS}
        ms = {k: [] for k in steps}
        for _ in range(5):
            for k, s in steps.items():
                ms[k] += step_times(s, group, 2, 4)
        for name, s in steps.items():
            trace = args.out / f"trace_{name}_{N // 1024}k_rank{rank}.json"
            ev = profiled_step(s, trace, args.stack)
            if rank == 0:
                print(json.dumps({"tokens_per_rank": N, "ep": dist.get_world_size(), "impl": name,
                                  "median_ms": round(statistics.median(ms[name]), 3), **analyse(ev)}), flush=True)
            if rank != 0 or N != args.tokens[0]:
                trace.unlink()
    dist.destroy_process_group()


if __name__ == "__main__":
    print_stamp(probe=Path(__file__).stem)
    main()
