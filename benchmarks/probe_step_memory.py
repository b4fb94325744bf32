"""Probe: what is alive at the peak of one training step, per stack, grouped by the code that allocated it.

    python benchmarks/probe_step_memory.py --stack bumblebee --seq-len 32768 [--model qwen3-30b-a3b --layers 4]

Builds the stack as `bench_training_step.py` does (same slice, same initial weights), runs two steps,
then records the CUDA allocator's history over a third, replays its alloc/free events to the moment
of the highest allocated total, and groups the blocks alive there by the innermost frame of the
allocating stack that lies in the stack's own code (bumblebee, transformers, liger, torch's autograd /
checkpoint). Writes results/probe_step_memory_<stack>_<seq_len>.json and prints the groups above 64 MiB.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
OWN = ("bumblebee", "primitives/", "kernels/", "models/", "transformers/", "liger_kernel/")


def where(frames: list) -> str:
    """The innermost frame in a stack's own code (else the innermost Python frame)."""
    py = [f for f in frames if f.get("filename", "").endswith(".py")]
    for f in py:
        name = f["filename"]
        if any(k in name for k in OWN) and "site-packages/torch" not in name:
            return f"{name.split('site-packages/')[-1].split('/work/')[-1]}:{f['line']} {f['name']}"
    f = py[0] if py else (frames[0] if frames else {"filename": "?", "line": 0, "name": "?"})
    return f"{f['filename'].split('site-packages/')[-1]}:{f['line']} {f['name']}"


def alive_at_peak(snapshot: dict, base: dict) -> tuple[int, dict]:
    """(peak bytes above the blocks alive at the start, {site: bytes alive at that moment})."""
    alive, now, best, best_alive = {}, 0, -1, {}
    for ev in snapshot["device_traces"][0]:
        if ev["action"] == "alloc":
            alive[ev["addr"]] = (ev["size"], where(ev.get("frames", [])))
            now += ev["size"]
            if now > best:
                best, best_alive = now, dict(alive)
        elif ev["action"] == "free_completed" and ev["addr"] in alive:
            now -= alive.pop(ev["addr"])[0]
    groups = defaultdict(int)
    for size, site in best_alive.values():
        groups[site] += size
    return best, dict(sorted(groups.items(), key=lambda kv: -kv[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stack", default="bumblebee")
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=32768)
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    import step_stacks
    from bench_training_step import batch, commit, hf_slice
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    device = torch.device("cuda", 0)
    mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("dp",))
    hf = hf_slice(args.model, args.layers, False)
    with tempfile.TemporaryDirectory(prefix="probe_mem_") as tmp:
        step_stacks.make_init_checkpoint(hf, Path(tmp) / "init", "cuda")
        stack = step_stacks.build(args.stack, Path(tmp) / "init", device, mesh)
    for i in range(2):
        stack.step(batch(i, args.seq_len, hf["vocab_size"], device))
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000)
    stack.step(batch(2, args.seq_len, hf["vocab_size"], device))
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    above, groups = alive_at_peak(snap, {})
    row = {"stack": stack.name, "model": args.model, "layers": args.layers, "seq_len": args.seq_len,
           "static_bytes": base, "peak_bytes": torch.cuda.max_memory_allocated(), "peak_above_static": above,
           "alive_at_peak": {k: v for k, v in groups.items() if v >= 1 << 20}, **commit()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"probe_step_memory_{stack.name.replace('+', '_')}_{args.seq_len}.json"
    (out / name).write_text(json.dumps(row, indent=1))
    print(f"{stack.name} {args.seq_len}: static {base / 2**30:.1f} GiB, peak {row['peak_bytes'] / 2**30:.1f} GiB, "
          f"allocated during the step at its peak {above / 2**30:.2f} GiB")
    for site, size in groups.items():
        if size >= 64 << 20:
            print(f"  {size / 2**30:7.2f} GiB  {site}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
