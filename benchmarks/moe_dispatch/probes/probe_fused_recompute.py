"""Probe: one MoE layer (moe_dispatch/bench.py's) forward+backward under full recompute, the chunked
primitive's fused recompute (`bumblebee.recompute` contexts: the recompute skips fc2, the combine
and the un-permute) against the plain torch checkpoint, the layer without recompute, and the twin
under checkpoint; default chunking, rows timed alternately. `fused_recompute_torch_swiglu`: the
fused recompute with the SwiGLU and the expert-side weighting (w du, rowsum(du a), w a) as torch ops
(`fused_swiglu=false`) instead of the fused SwiGLU kernels. Also the bf16 relative difference of the fused recompute's
output and gradients against the plain checkpoint's. One JSON line per size.

    torchrun --nproc_per_node 2 benchmarks/moe_dispatch/probes/probe_fused_recompute.py
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
E, inputs, step_times = moe_dispatch_bench.E, moe_dispatch_bench.inputs, moe_dispatch_bench.step_times
from probe_auto_chunks import setup
from torch.utils.checkpoint import checkpoint

from bumblebee import options, recompute, registry

ROWS = {"no_recompute": ("chunked", None), "checkpoint": ("chunked", {}),
        "fused_recompute": ("chunked", {"context_fn": recompute.contexts}),
        "fused_recompute_torch_swiglu": ("chunked:fused_swiglu=false", {"context_fn": recompute.contexts}),
        "twin_checkpoint": ("all_to_all", {})}


def step(name, x, w, idx, experts, g_out):
    impl, ckpt = ROWS[name]
    fn = registry.resolve("moe_dispatch", impl)

    def run():
        xs, ws = x.detach().requires_grad_(), w.detach().requires_grad_()
        f = lambda a, b: fn(a, b, idx, experts, E)  # noqa: E731
        y = f(xs, ws) if ckpt is None else checkpoint(f, xs, ws, use_reentrant=False, **ckpt)
        y.backward(g_out)
        out = [y.detach(), xs.grad, ws.grad, experts.gate_up_proj.grad, experts.down_proj.grad]
        experts.gate_up_proj.grad = experts.down_proj.grad = None
        return out
    return run


def main():
    rank, group, device, experts = setup()
    for N in (16384, 65536):
        x, w, idx = inputs(N, rank, device)
        g_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(5)).to(device, x.dtype)
        steps = {name: step(name, x, w, idx, experts, g_out) for name in ROWS}
        ms = {name: [] for name in ROWS}
        for _ in range(3):
            for name, s in steps.items():
                ms[name] += step_times(s, group, 2, 4)
        ref, got = steps["checkpoint"](), steps["fused_recompute"]()
        err = max(((a.double() - b.double()).norm() / (b.double().norm() + 1e-30)).item() for a, b in zip(got, ref))
        if rank == 0:
            print(json.dumps({"tokens_per_rank": N, "ep": dist.get_world_size(),
                              "median_ms": {k: round(statistics.median(v), 3) for k, v in ms.items()},
                              "fused_vs_checkpoint_rel_err_bf16": err,
                              "config": options.record(registry.choose("moe_dispatch", "chunked")[1])}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    print_stamp(probe=Path(__file__).stem)
    main()
