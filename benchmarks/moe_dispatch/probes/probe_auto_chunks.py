"""Probe: the chunked primitive's default ("auto": one chunk below AUTO_MIN_TOKENS, else AUTO_CHUNKS)
against explicit C = 1 and (1, 2) and the twin, timed alternately on the same inputs (so order and
allocator state cannot favour any), at EP = 2 with moe_dispatch/bench.py's layer, around the
threshold. Prints one JSON line per size on rank 0.

    torchrun --nproc_per_node 2 benchmarks/moe_dispatch/probes/probe_auto_chunks.py
"""
from __future__ import annotations

import sys
from pathlib import Path
import datetime
import json
import statistics

import torch
import torch.distributed as dist
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/: stamp, timing, siblings
from stamp import print_stamp  # noqa: E402
from siblings import load
moe_dispatch_bench = load("moe_dispatch")
inputs, layer_step = moe_dispatch_bench.inputs, moe_dispatch_bench.layer_step
make_experts, timed = moe_dispatch_bench.make_experts, moe_dispatch_bench.timed


def setup():
    """NCCL over the world, this rank's GPU, and moe_dispatch/bench.py's experts: (rank, group, device, experts)."""
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5))
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    group, device = dist.group.WORLD, torch.device("cuda", rank)
    return rank, group, device, make_experts(group, device)


def main():
    rank, group, device, experts = setup()
    configs = (("c1", 1), ("1-2", (1, 2)), ("auto", "auto"), ("twin", None))
    for N in (8192, 16384, 32768, 49152, 65536):
        x, w, idx = inputs(N, rank, device)
        runs = {name: [] for name, _ in configs}
        for _ in range(4):
            for name, chunks in configs:
                impl = "all_to_all" if name == "twin" else "chunked"
                runs[name].append(timed(layer_step(impl, x, w, idx, experts, chunks=chunks), group))
        if rank == 0:
            print(json.dumps({"tokens_per_rank": N, **{k: [round(t, 3) for t in v] for k, v in runs.items()},
                              **{f"{k}_median": round(statistics.median(v), 3) for k, v in runs.items()}}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    print_stamp(probe=Path(__file__).stem)
    main()
