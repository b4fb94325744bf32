"""Context parallelism: a layer's forward + backward over CP ranks against one rank on the whole sequence.

    torchrun --standalone --nproc_per_node=4 benchmarks/context_parallel/bench.py --out DIR
    torchrun --standalone --nproc_per_node=2 benchmarks/context_parallel/bench.py --cpu-smoke --out DIR

At each total length: rank 0 alone runs the single-rank layer on the whole sequence (the attention
slot's default `sdpa`, or the gated DeltaNet layer's own forward), then every rank runs its shard
(2 x T / (2 CP) tokens) of the cp forms: attention by `allgather` and by `ring`, gated DeltaNet.
Each case is the median ms of forward + backward (a barrier closes every call, so the slowest rank
counts); speed-up = single / cp and efficiency = speed-up / CP (1.0 is ideal). CUDA: bf16 with
Qwen3.5-35B-A3B's attention (16 query / 2 key-value heads of 256) and DeltaNet (16 key / 32 value heads
of 128) shapes; gloo/CPU (--cpu-smoke): fp32, tiny shapes, to check the script runs. Writes
DIR/context_parallel.json on rank 0 (stamped).

The cp layers' math runs in torch (masked SDPA per chunk, the chunked delta rule): the GPU kernels
for them (FlashAttention with log-sum-exp per block, fla's state-passing kernels) are not wired yet,
so GPU numbers measure that path, not the ideal one.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: stamp, timing
from stamp import stamp  # noqa: E402
from timing import check_measured, median_ms  # noqa: E402

from bumblebee import registry  # noqa: E402
from bumblebee.primitives.context_parallel import layout  # noqa: E402
from bumblebee.primitives.context_parallel.attention import EXCHANGES  # noqa: E402
from bumblebee.primitives.context_parallel.gdn import gdn_forward  # noqa: E402

GPU = dict(tokens=(65536, 131072, 262144), heads=16, kv_heads=2, head_dim=256, hidden=2048,
           gdn=(16, 32, 128, 128), dtype=torch.bfloat16)
SMOKE = dict(tokens=(256,), heads=4, kv_heads=2, head_dim=16, hidden=64, gdn=(2, 4, 16, 16), dtype=torch.float32)


def _time(fn, device, iters, group=None):
    def call():
        fn()
        if group is not None:
            dist.barrier(group=group)
    return median_ms(call, iters=iters, warmup=1, cuda=device.type == "cuda")


def _attention_cases(T, s, device, cp, rank, iters):
    H, K, D, dtype = s["heads"], s["kv_heads"], s["head_dim"], s["dtype"]
    attend = registry.resolve("attention", None)
    g = torch.Generator(device=device).manual_seed(0)

    def inputs(n):
        return [torch.randn(1, h, n, D, device=device, dtype=dtype, generator=g).requires_grad_() for h in (H, K, K)]

    def fwd_bwd(run, tensors):
        return lambda: run(*tensors).sum().backward()

    rows = {}
    if rank == 0:
        rows["single"] = _time(fwd_bwd(lambda q, k, v: attend(q, k, v, scale=D ** -0.5), inputs(T)), device, iters)
    dist.barrier()
    batch = layout.make_batch(dist.group.WORLD, T, None, device)
    for name, exchange in EXCHANGES.items():
        rows[name] = _time(fwd_bwd(lambda q, k, v: exchange(q, k, v, scale=D ** -0.5, batch=batch), inputs(T // cp)),
                           device, iters, dist.group.WORLD)
    return rows


def _gdn_cases(T, s, device, cp, rank, iters):
    hk, hv, dk, dv = s["gdn"]
    layer = registry.resolve("linear_attention", None)(s["hidden"], hk, hv, dk, dv).to(device, s["dtype"])
    g = torch.Generator(device=device).manual_seed(0)
    rows = {}
    if rank == 0:
        x = torch.randn(1, T, s["hidden"], device=device, dtype=s["dtype"], generator=g).requires_grad_()
        rows["single"] = _time(lambda: layer(x).sum().backward(), device, iters)
    dist.barrier()
    batch = layout.make_batch(dist.group.WORLD, T, None, device)
    x = torch.randn(1, T // cp, s["hidden"], device=device, dtype=s["dtype"], generator=g).requires_grad_()
    rows["cp"] = _time(lambda: gdn_forward(layer, x, batch).sum().backward(), device, iters, dist.group.WORLD)
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--cpu-smoke", action="store_true")
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args()
    cuda = torch.cuda.is_available() and not args.cpu_smoke
    dist.init_process_group("nccl" if cuda else "gloo")
    cp, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    s = GPU if cuda else SMOKE
    out = []
    for T in s["tokens"]:
        for layer_name, cases in (("attention", _attention_cases), ("gated_deltanet", _gdn_cases)):
            rows = cases(T, s, device, cp, rank, 2 if args.cpu_smoke else args.iters)
            if rank == 0:
                for name, ms in rows.items():
                    if name == "single":
                        continue
                    row = {"layer": layer_name, "impl": name, "tokens": T, "cp": cp, "median_ms": ms,
                           "single_ms": rows["single"], "speedup": rows["single"] / ms,
                           "efficiency": rows["single"] / ms / cp}
                    check_measured(record=row, positive=("median_ms", "single_ms"))
                    print(json.dumps(row), flush=True)
                    out.append(row)
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "context_parallel.json").write_text(json.dumps({**stamp(device), "slot": "context_parallel",
                                                                     "rows": out}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
