"""Offload and onload of the runtime's parts on one GPU, on a layer-faithful slice of a real model.

    python benchmarks/offload/bench.py                       # Qwen3-30B-A3B cut to 2 layers
    python benchmarks/offload/bench.py --model qwen3-8b --layers 4 --out DIR

The slice keeps every size of the named model (hidden 2048, 128 experts of 768, vocabulary 151936)
and only `--layers` decoder layers, trained in bf16 compute with fp32 masters and Adam. Per
`state_sharding` twin (fsdp2, zero1) on a one-rank mesh: static memory (allocated after an optimizer
step and a further forward_backward: parameters, gradients, optimizer state), the bytes each part's
offload to the CPU frees (model, optimizer, grad, in that order), the time of the whole offload and
onload (median of --repeats, synchronized), and whether the round trip kept every tensor (a float64
checksum per part). Writes DIR/offload_<device>.json (default benchmarks/offload/results/), every row
carrying the commit (BENCH_COMMIT when set).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/: stamp, timing, siblings
from siblings import load  # noqa: E402
from stamp import stamp as run_stamp  # noqa: E402
from timing import median_ms, synced  # noqa: E402


def _checksums(rt) -> dict:
    return {p: sum(float(t.double().sum()) for t in ts) for p, ts in rt.placement.tensors().items()}


def _timed(fn) -> float:
    """Seconds of one call up to a device synchronize, on the host's clock: an offload is copies and
    frees that the host drives, timed as a caller waits for them. One call each: a second offload
    of what is already on the CPU would time nothing, so the medians are taken over --repeats."""
    return median_ms(synced(fn), iters=1, warmup=0, cuda=False) / 1e3


def run_one(impl: str, args, mesh, device) -> dict:
    state_sharding_bench = load("state_sharding")
    build_on_device = state_sharding_bench.build_on_device

    from bumblebee import registry
    from bumblebee.runtime import Batch, Runtime
    gc.collect()  # the previous twin's cycles: freed now, not by this twin's offload (which collects)
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(device)
    model, hf = build_on_device(args.model, args.layers, {"cross_entropy": "linear_ce"}, device)
    model.set_recompute(True)
    state = registry.resolve("state_sharding", impl)(model, mesh, lr=1e-5, grad_clip=1.0)
    rt = Runtime(model, state)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, hf["vocab_size"], (1, args.tokens), generator=g).to(device)
    batch = Batch(ids, advantages=torch.randn(ids.shape, generator=g).to(device),
                  sampler_logprobs=torch.full(ids.shape, -5.0, device=device))
    rt.forward_backward(batch, "ppo", loss_agg_mode="token-mean")
    rt.optim_step()
    rt.forward_backward(batch, "ppo", loss_agg_mode="token-mean")  # gradients present: every part holds memory
    torch.cuda.synchronize()
    static = torch.cuda.memory_allocated(device) - base
    sums = _checksums(rt)
    freed, offload_s, onload_s = {}, [], []
    for i in range(args.repeats):
        if i == 0:  # each part alone, to see what it holds
            t = 0.0
            for part in ("model", "optimizer", "grad"):
                now = torch.cuda.memory_allocated(device)
                t += _timed(lambda: rt.to("cpu", **{p: p == part for p in ("model", "optimizer", "grad")}))
                freed[part] = now - torch.cuda.memory_allocated(device)
            offload_s.append(t)
        else:
            offload_s.append(_timed(lambda: rt.to("cpu")))
        left = torch.cuda.memory_allocated(device) - base
        onload_s.append(_timed(lambda: rt.to(device)))
    same = _checksums(rt) == sums
    step = rt.optim_step()
    row = {"impl": impl, "model": args.model, "layers": args.layers, "tokens": args.tokens,
           "params": sum(t.numel() for t in rt.placement.tensors()["model"]),
           "static_bytes": static, "freed_bytes": freed, "freed_fraction": sum(freed.values()) / max(static, 1),
           "left_bytes": left, "offload_s": statistics.median(offload_s), "onload_s": statistics.median(onload_s),
           "offload_GBps": static / 1e9 / statistics.median(offload_s),
           "onload_GBps": static / 1e9 / statistics.median(onload_s),
           "round_trip_checksums_equal": same, "step_after_applied": step["applied"],
           "impl_configs": {**model.impl_configs(), "state_sharding": registry.record("state_sharding", impl)}}
    del rt, state, model
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--impl", nargs="+", default=["fsdp2", "zero1"])
    ap.add_argument("--out", type=Path, default=HERE / "results")
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("nccl", rank=int(os.environ.get("RANK", 0)), world_size=int(os.environ.get("WORLD_SIZE", 1)))
    try:
        from torch.distributed.device_mesh import init_device_mesh
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        mesh = init_device_mesh("cuda", (dist.get_world_size(),), mesh_dim_names=("dp",))
        stamp = {**run_stamp(device), "ranks": dist.get_world_size()}
        rows = [{**stamp, **run_one(impl, args, mesh, device)} for impl in args.impl]
        if dist.get_rank() == 0:
            name = stamp["device"].lower().replace("nvidia", "").strip().split()[0]
            args.out.mkdir(parents=True, exist_ok=True)
            path = args.out / f"offload_{name}.json"
            path.write_text(json.dumps({**stamp, "benchmark": "offload", "rows": rows}, indent=1) + "\n")
            for r in rows:
                print(f"{r['impl']}: static {r['static_bytes'] / 2**30:.2f} GiB, freed {r['freed_fraction']:.1%}, "
                      f"offload {r['offload_s']:.2f} s, onload {r['onload_s']:.2f} s, "
                      f"round trip {'kept' if r['round_trip_checksums_equal'] else 'CHANGED'} every tensor")
            print(f"wrote {path}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
