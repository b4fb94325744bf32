"""Probe: a copy-engine exchange (symmetric memory, peer pulls with cudaMemcpyAsync) against NCCL's
all_to_all_single, alone and next to GEMMs on the compute stream. The MoE layer's exchange at
Qwen3.5-35B-A3B sizes (D 2048, top-8), half of each rank's copies going to the other rank.
Prints one JSON line per case on rank 0.

    torchrun --nproc_per_node 2 benchmarks/moe_dispatch/probes/probe_copy_engine_exchange.py
"""
from __future__ import annotations

import sys
from pathlib import Path
import json
import os

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/: stamp, timing, siblings
from stamp import print_stamp  # noqa: E402
from timing import median_ms

D, K = 2048, 8


def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda")
    group = dist.group.WORLD
    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        symm_mem.enable_symm_mem_for_group(group.group_name)
    side = torch.cuda.Stream(priority=-1)
    rows_max = 16384 * K
    buf = symm_mem.empty(rows_max * D, dtype=torch.bfloat16, device=dev)
    hdl = symm_mem.rendezvous(buf, group)
    a = torch.randn(65536, D, device=dev, dtype=torch.bfloat16)
    b = torch.randn(D, 3072, device=dev, dtype=torch.bfloat16)
    results = []

    for tokens in (4096, 16384):
        M = tokens * K
        x = torch.randn(M, D, device=dev, dtype=torch.bfloat16)
        splits = [M // world] * world
        out = torch.empty_like(x)

        def nccl():
            dist.all_to_all_single(out, x, splits, splits, group=group)

        def ce(copy_in=True):
            mine = hdl.get_buffer(rank, (M, D), torch.bfloat16)
            if copy_in:
                mine.copy_(x)
            hdl.barrier(channel=0)
            seg = M // world
            for step in range(world):
                src = (rank + step) % world
                peer = hdl.get_buffer(src, (M, D), torch.bfloat16)
                out[src * seg:(src + 1) * seg].copy_(peer[rank * seg:(rank + 1) * seg])
            hdl.barrier(channel=1)

        def gemms():
            for _ in range(4 if tokens == 4096 else 12):
                a @ b

        def together(fn):
            def run():
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    fn()
                gemms()
                torch.cuda.current_stream().wait_stream(side)
            return run

        for name, fn in [("nccl", nccl), ("ce_copy_in", ce), ("ce_in_place", lambda: ce(False)),
                         ("barrier", lambda: hdl.barrier(channel=0)), ("gemms", gemms),
                         ("gemms+nccl", together(nccl)), ("gemms+ce_copy_in", together(ce)),
                         ("gemms+ce_in_place", together(lambda: ce(False)))]:
            dist.barrier()
            ms = median_ms(fn, iters=20, warmup=5)
            peer_bytes = M // world * (world - 1) * D * 2
            results.append({"tokens_per_rank": tokens, "case": name, "median_ms": round(ms, 3),
                            "peer_GBps": round(peer_bytes / ms / 1e6, 1)})
        if tokens == 16384:
            ref = torch.empty_like(out)
            nccl()
            ref.copy_(out)
            out.zero_()
            ce()
            torch.cuda.synchronize()
            results.append({"tokens_per_rank": tokens, "case": "ce_equals_nccl", "ok": bool(torch.equal(out, ref))})
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            ce()
            torch.cuda.synchronize()
        kinds = sorted({e.name[:40] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})
        results.append({"tokens_per_rank": tokens, "case": "ce_gpu_activity", "names": kinds})
    if rank == 0:
        for r in results:
            print(json.dumps(r), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    print_stamp(probe=Path(__file__).stem)
    main()
