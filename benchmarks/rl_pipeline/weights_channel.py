"""The object-store weight channel's cost a version: the trainer's put and a producer's read of one
workload's weights through Ray's object store, packed (`runtime/pipeline/weights.py:pack`, what the
channel does) against the tensors pickled as they are (`ray.put(state_dict)`, what a user writes first
and what the channel did before).

    python benchmarks/rl_pipeline/weights_channel.py --device cuda --out $OUT   # one GPU
    python benchmarks/rl_pipeline/weights_channel.py --device cpu --workload small --out DIR

The weights: the bench's Qwen3 of `--workload` (medium: 96.5M fp32 parameters, 386 MB), on
`--device`. put: host clock around `ray.put` of the export (tensors leave the device inside it);
read: around a remote task (its own process, the same device) that gets the version and moves every
tensor onto its device (synchronized): what a producer does before its engine's load. Medians of
`--iters` calls after one warm-up each; the floor beside them: the bytes over the host's copy rate
(`torch` copy of the same bytes, CPU to CPU, measured in the run). Writes
<out>/weights_channel_<device>_<workload>.json (stamped).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/: stamp, timing
sys.path.insert(0, str(HERE))  # the bench's workloads

from bench import WORKLOADS, model_config  # noqa: E402
from stamp import stamp  # noqa: E402
from timing import median_ms, synced  # noqa: E402

from bumblebee.runtime.pipeline import CopyDigits  # noqa: E402
from bumblebee.runtime.pipeline.weights import pack, unpack  # noqa: E402


def weights(workload: str, device: str) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM
    w = WORKLOADS[workload]
    cfg = model_config(CopyDigits(length=w.digits), w.model)
    config = AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k not in ("model_type", "dtype")})
    torch.manual_seed(0)
    return {n: t.detach() for n, t in AutoModelForCausalLM.from_config(config).to(device).state_dict().items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="medium")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args(argv)
    import ray
    cuda = args.device.startswith("cuda")
    ray.init(num_cpus=2, num_gpus=1 if cuda else 0, include_dashboard=False, log_to_driver=False)
    try:
        ws = weights(args.workload, args.device)
        nbytes = sum(t.numel() * t.element_size() for t in ws.values())
        forms = {"pickled_tensors": lambda: {n: t.cpu() for n, t in ws.items()},  # the channel before
                 "packed": lambda: pack(ws.items())}

        @ray.remote(num_gpus=1 if cuda else 0)
        def read(ref_list, form, device):
            got = ray.get(ref_list[0])
            items = got.items() if form == "pickled_tensors" else unpack(got, device)
            moved = [t.to(device) for _, t in items]
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            return len(moved)

        rows = []
        for form, make in forms.items():
            put_ms = median_ms(lambda: ray.put(make()), iters=args.iters, warmup=1, cuda=False)
            ref = ray.put(make())
            device = "cuda:0" if cuda else "cpu"  # inside the task: the one GPU Ray gives it
            read_ms = median_ms(lambda: ray.get(read.remote([ref], form, device)), iters=args.iters, warmup=1,
                                cuda=False)
            del ref
            rows.append({"form": form, "put_ms": put_ms, "read_ms": read_ms,
                         "put_GB_s": nbytes / put_ms / 1e6, "read_GB_s": nbytes / read_ms / 1e6})
            print(json.dumps(rows[-1]), flush=True)
        src = torch.empty(nbytes, dtype=torch.uint8)
        dst = torch.empty_like(src)
        copy_ms = median_ms(synced(lambda: dst.copy_(src), "cpu"), iters=args.iters, warmup=1, cuda=False)
    finally:
        ray.shutdown()
    result = {**stamp(args.device), "benchmark": "rl_pipeline weights channel", "workload": args.workload,
              "bytes": nbytes, "tensors": len(ws), "host_copy_ms": copy_ms, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"weights_channel_{'cuda' if cuda else 'cpu'}_{args.workload}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}; {nbytes / 1e6:.0f} MB, a host copy {copy_ms:.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
