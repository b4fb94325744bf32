"""Probe: where a training step's copies and casts come from, per stack: kernel ms by the operator that
launched them and its input shapes.

The profiled 32K step of the Qwen3-30B-A3B slice spent ~85 ms in copies, casts and device-to-device
memcpys against the peer's ~39 (benchmarks/training_step/NOTES.md); the category totals do not say which
tensors they move. One profiled step; each copy-like operator's own kernel time is charged to its name
and input shapes (a [V, H] shape is the embedding or head, [rows, D] a MoE group). One JSON object: the
top entries.

    python benchmarks/training_step/probes/probe_copies_by_op.py --stack bumblebee --seq-len 32768
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # training_step/: step_stacks, bench
sys.path.insert(0, str(HERE.parents[1]))  # benchmarks/: stamp, timing
from stamp import print_stamp  # noqa: E402

COPY_WORDS = ("copy", "cast", "cat", "memcpy", "fill", "gather", "index", "scatter", "comms", "all_gather",
              "reduce_scatter", "_to")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stack", default="bumblebee")
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=32768)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.profiler import ProfilerActivity, profile
    import bench
    import step_stacks
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29611", RANK="0", WORLD_SIZE="1")
    dist.init_process_group("nccl")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("dp",))
    hf = bench.hf_slice(args.model, args.layers, False)
    with tempfile.TemporaryDirectory() as tmp:
        step_stacks.make_init_checkpoint(hf, tmp, "cuda")
        stack = step_stacks.build(args.stack, tmp, device, mesh, ep=1, mixed_precision="bf16")
    for i in range(2):
        stack.step(bench.batch(i, args.seq_len, hf["vocab_size"], device))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        stack.step(bench.batch(2, args.seq_len, hf["vocab_size"], device))
        torch.cuda.synchronize()
    by_op = {}
    for e in prof.events():
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CPU:
            ms = getattr(e, "self_device_time_total", 0) / 1e3  # its own kernels, not its children's
            if ms <= 0 or not any(w in e.name.lower() for w in COPY_WORDS):
                continue
            key = f"{e.name} {str(e.input_shapes)[:80]}"
            by_op[key] = by_op.get(key, 0.0) + ms
    top = sorted(by_op.items(), key=lambda kv: -kv[1])[:40]
    report = {"stack": args.stack, "seq_len": args.seq_len, "copy_like_ms": sum(by_op.values()),
              "top": [{"ms": round(ms, 3), "op_shapes": k} for k, ms in top]}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    dist.destroy_process_group()


if __name__ == "__main__":
    print_stamp(probe=Path(__file__).stem)
    main()
