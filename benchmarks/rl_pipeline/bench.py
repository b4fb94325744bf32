"""RL pipeline: wall time to a reward threshold, synchronous (eta = 0) against eta = 1 and 2, with the
producers' and the trainer's idle fractions; a small Qwen3 learning to copy digits (rule reward).

    python benchmarks/rl_pipeline/bench.py --gpus 1 --out $OUT   # trainer and producer share cuda:0
    python benchmarks/rl_pipeline/bench.py --gpus 2 --out $OUT   # producer on cuda:0, trainer on cuda:1
    python benchmarks/rl_pipeline/bench.py --cpu-smoke --out DIR # the tiny model on the CPU, a few steps

The pipeline runs in its local mode (`runtime/pipeline/local.py`: the same admission, rollout and
GRPO step as the Ray actors, as threads of this process), because the GPU machine has no Ray and
Ray's wheel (79 MB) is over what a run carries. Each eta trains from the same seed until the mean
reward of the last `--window` steps reaches `--threshold` (or `--max-steps`); the clock starts
after the first weights are published (model build, CUDA start-up and the first generation call's
warm-up excluded alike: one untimed warm-up run of two steps goes first). Reported per eta: wall
seconds and steps to the threshold (None if not reached), median seconds a step, the trainer's
mean idle fraction, the producers' final (cumulative) idle fraction, mean staleness and behave_kl,
the reward curve; and the speedup of eta = 1, 2 over eta = 0 in wall time to the threshold.
Writes <out>/rl_pipeline_<device>_x<gpus>.json (stamped: commit, versions, device, date).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/: stamp

from stamp import stamp  # noqa: E402
from timing import Stopwatch  # noqa: E402

from bumblebee import models  # noqa: E402
from bumblebee.runtime.pipeline import CopyDigits, Objective, PipelineConfig, Sampling  # noqa: E402
from bumblebee.runtime.pipeline.local import LocalPipeline  # noqa: E402

# the small Qwen3: 4 layers of width 256 over the task's 16 tokens (digits, BOS, SEP, PAD)
SMALL = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 64}


def model_config(task: CopyDigits, small: bool) -> dict:
    return {**models.NAMED["qwen3-tiny"], **(SMALL if small else {}), "vocab_size": 16, "bos_token_id": task.bos_id,
            "pad_token_id": task.pad_id, "eos_token_id": None}


def run_eta(eta, args, task, model, devices, quiet) -> dict:
    cfg = PipelineConfig(steps=args.max_steps, eta=eta, groups_per_step=args.groups, group_size=args.group_size,
                         groups_per_call=args.groups_per_call, lr=args.lr, seed=args.seed,
                         impl={"cross_entropy": "linear_ce"}, sampling=Sampling(max_new_tokens=task.length),
                         objective=Objective(entropy_coef=1e-3), take_timeout_s=300.0, weight_timeout_s=300.0,
                         call_timeout_s=300.0)

    def reached(log):
        return len(log) >= args.window and statistics.mean(m["reward"] for m in log[-args.window:]) >= args.threshold

    p = LocalPipeline(cfg, model, task, trainer_device=devices["trainer"], producer_devices=[devices["producer"]])
    log = p.run(on_step=None if quiet else (lambda line: print(f"eta {eta} {line}", flush=True)), until=reached)
    hit = reached(log)
    return {"eta": eta, "reached": hit, "steps": len(log), "wall_s": log[-1]["wall_s"],
            "wall_s_to_threshold": log[-1]["wall_s"] if hit else None,
            "steps_to_threshold": len(log) if hit else None,
            "s_per_step_median": statistics.median(b["wall_s"] - a["wall_s"] for a, b in zip(log, log[1:]))
            if len(log) > 1 else None,
            "trainer_idle_mean": statistics.mean(m["trainer_idle"] for m in log),
            "producer_idle_final": log[-1]["producer_idle"],
            "staleness_mean": statistics.mean(m["staleness_mean"] for m in log),
            "behave_kl_mean": statistics.mean(m["behave_kl"] for m in log),
            "tokens_per_s_median": statistics.median(m["tokens_per_s"] for m in log),
            "reward": [round(m["reward"], 4) for m in log]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=1, choices=(1, 2), help="1: shared; 2: producer and trainer apart")
    ap.add_argument("--cpu-smoke", action="store_true", help="the tiny model on the CPU, a few steps")
    ap.add_argument("--etas", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--threshold", type=float, default=0.25, help="mean reward over the last --window steps")
    ap.add_argument("--window", type=int, default=5)
    ap.add_argument("--max-steps", type=int, default=200)
    ap.add_argument("--groups", type=int, default=32, help="groups (prompts) a step")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--groups-per-call", type=int, default=8, help="groups a producer generates in one call")
    ap.add_argument("--digits", type=int, default=3)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="folder of the result file (default: results/ beside this script)")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        args.max_steps, args.groups, args.group_size, args.groups_per_call, args.window = 4, 4, 4, 2, 2
        args.digits, args.lr = 2, 5e-3
        devices = {"trainer": "cpu", "producer": "cpu"}
    else:
        if torch.cuda.device_count() < args.gpus:
            raise SystemExit(f"--gpus {args.gpus}: this machine has {torch.cuda.device_count()} CUDA devices")
        devices = {"trainer": f"cuda:{args.gpus - 1}", "producer": "cuda:0"}
    task = CopyDigits(length=args.digits)
    model = model_config(task, small=not args.cpu_smoke)
    warm = argparse.Namespace(**{**vars(args), "max_steps": 2})
    run_eta(1, warm, task, model, devices, quiet=True)  # CUDA context, kernels' first calls, allocator
    rows = []
    for eta in args.etas:
        watch = Stopwatch()  # the whole run, set-up included; the rows' own times come from the pipeline's log
        row = run_eta(eta, args, task, model, devices, args.quiet)
        row["run_s"] = watch.seconds()
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "reward"}), flush=True)
    base = next((r for r in rows if r["eta"] == 0), None)
    for r in rows:
        ok = base is not None and base["reached"] and r["reached"]
        r["speedup_to_threshold_vs_eta0"] = base["wall_s_to_threshold"] / r["wall_s_to_threshold"] if ok else None
        r["speedup_per_step_vs_eta0"] = (base["s_per_step_median"] / r["s_per_step_median"]
                                         if base is not None and base["s_per_step_median"] and r["s_per_step_median"]
                                         else None)
    device = devices["trainer"]
    result = {**stamp(device), "benchmark": "rl_pipeline", "mode": "local (threads)", "gpus": 0 if args.cpu_smoke
              else args.gpus, "devices": devices, "model": model, "task": {"name": "copy_digits", "length": args.digits},
              "config": {k: v for k, v in vars(args).items() if k not in ("out", "quiet")}, "rows": rows}
    out = Path(args.out) if args.out else HERE / "results"
    out.mkdir(parents=True, exist_ok=True)
    name = "cpu" if args.cpu_smoke else result["device"].lower().replace("nvidia ", "").replace(" ", "_")
    path = out / f"rl_pipeline_{name}_x{result['gpus']}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
    for r in rows:
        print(f"eta {r['eta']}: to threshold {r['wall_s_to_threshold']} s in {r['steps_to_threshold']} steps, "
              f"{r['s_per_step_median'] or float('nan'):.3f} s/step, idle trainer {r['trainer_idle_mean']:.2f} producers "
              f"{r['producer_idle_final']:.2f}, speedup {r['speedup_to_threshold_vs_eta0']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
