"""RL pipeline: wall time to a reward threshold, synchronous (eta = 0) against eta = 1 and 2, with the
producers' and the trainer's idle fractions; a Qwen3 learning to copy digits (rule reward).

    python benchmarks/rl_pipeline/bench.py --gpus 1 --out $OUT   # trainer and producer share cuda:0
    python benchmarks/rl_pipeline/bench.py --gpus 2 --out $OUT   # producer on cuda:0, trainer on cuda:1
    python benchmarks/rl_pipeline/bench.py --mode ray --workload medium --gpus 2 --etas 0 2 --out $OUT
    python benchmarks/rl_pipeline/bench.py --mode ray --workload medium --gpus 2 --etas 0 2 --weights p2p --out $OUT
    python benchmarks/rl_pipeline/bench.py --cpu-smoke [--mode ray] --out DIR  # the tiny model on the CPU
    python benchmarks/rl_pipeline/bench.py --merge a/x.json,b/x.json --out DIR  # runs of other seeds, one result

Modes. `local` (the default): `runtime/pipeline/local.py`, the trainer and the producer as threads
of this process (no Ray needed); they share the GIL, so a host-bound step barely overlaps. `ray`:
`runtime/pipeline/run.py`'s Pipeline, the trainer and the producer as Ray actors, one process each,
asking Ray for 1 GPU each (`--gpus 2`) or 0.5 each (`--gpus 1`: both on one GPU; the CPU smoke: 0);
a local Ray is started for each run and shut down after it. Weights go through Ray's object store.

Workloads (`--workload`; each flag below overrides its value):
- `small`: 4 layers of width 256 (3.2M parameters), 3 digits, 32 groups x 8 a step, 8 groups an
  engine call, lr 2e-3, threshold 0.25 over 5 steps. Host-bound: 0.13-0.15 s a step on H200s,
  mostly kernel launches (2 GPUs were slower than 1).
- `medium`: 8 layers of width 1024 (16 heads / 4 KV heads of 64, MLP 3072): P = 96.5M parameters,
  386 MB in fp32; 6 digits (8 prompt + 6 answer tokens), 64 groups x 8 = 512 sequences a step, 16
  groups an engine call, threshold 0.2 over 5 steps (a policy that ignores the prompt expects 0.1;
  level 0.15 reported on the way), at most 60 steps or 30 s an eta. The reward then plateaus at
  0.3-0.37 (45 s runs: NOTES.md), where steps to a level are many and noisy. lr 3e-5: at this
  width one Adam step of 1e-4 triples the logits' spread (std 0.59 -> 1.6; the small model's at
  2e-3: 0.34 -> 0.82), and 1e-3, 3e-4, 1e-4 collapsed the policy's entropy (2.6 -> < 0.4) in 2-4
  steps. At 3e-5 on the CPU (`lagged_run`, 16 groups x 8, seed 0) the 5-step mean passed 0.15
  after 8 steps at eta = 0, after 11 at eta = 2.
  Floors. fp32 throughout (the pipeline has no dtype option: the trainer's policy and the exported
  weights the engine samples with are fp32), so GEMMs are bound by 67 TFLOP/s (H100/H200 fp32, no
  TF32). Train: 2P FLOPs a token (pi_prox's forward) + 6P (forward and backward) over 512 x 14 =
  7168 tokens = 5.5 TFLOP, >= 83 ms against ~10 ms of launches: GPU-bound. Generate: 2P over
  512 x 8 prefill + 512 x 5 decode tokens = 1.3 TFLOP, >= 19 ms, but 24 forwards of transformers'
  eager generate (~5 ms of launches each; a forward of 128 rows is ~0.4 ms of GEMM) and a host sync
  per row and token: ~0.15-0.2 s, launch-bound at any size this time budget affords. Weights: 386 MB
  a version to the host, through the object store, back to the GPU: ~0.3-0.5 s each side (a publish
  took 0.5-0.8 s on 2 loaded CPU cores). So ~0.4-0.7 s a step on each side: serial at eta = 0,
  overlapped at eta >= 1 in separate processes (ray mode; at most sum / max, ~1.8x a step), less
  what eta = 2 loses in learning per step.

Each eta trains from the same seed until the mean reward of the last `--window` steps reaches
`--threshold` (or `--max-steps`, or `--max-seconds` of the eta's own clock); the wall times to the
lower `--levels` are read off the same run, and so is each level's time by the policy that sampled the
rewards (`policy_to_level`: a reward counts for the weights version that sampled it, a version's time
is its publish; the trained rewards lag it by up to eta steps). The clock starts after the first weights are published
and the pipeline's warm-up (`PipelineConfig.warmup`: each trainer rank runs a step's calls training
nothing, each producer one throwaway engine call), so model build, process start-up and the fresh
processes' first CUDA calls are outside it and the first step is a step like the others
(`first_step_s`; `speedup_after_first_step_vs_eta0` leaves it out of both times). On GPUs one
untimed warm-up run of two steps goes first (Triton's on-disk kernel cache, which every fresh
process reads; CUDA context and allocator in the local mode).
With `--seeds`, every seed runs every eta (a seed's etas back to back) and `summary` gives per eta
the median and range over seeds, the median's distribution-free 95% interval from 6 seeds on
(order statistics: [min, max] at 6, the 2nd and 9th of 10), and for eta > 0 whether `--target` (1.5x
less wall time to the threshold) is shown: "shown" when the interval's low end reaches it (the range's
below 6 seeds), "missed" when its high end stays under it, else "not shown". Seeds run side by side
(two pipelines on one host's GPU pairs, `CUDA_VISIBLE_DEVICES`, each its own local Ray) join with
`--merge` (same commit and settings, disjoint seeds; summaries recomputed). Reported per eta and seed:
wall seconds and steps to the threshold (None if not reached) and to each level, median seconds a step,
the trainer's mean idle fraction, the producers' final (cumulative) idle fraction, mean staleness and
behave_kl, the reward curve and each step's seconds (`step_s`); and the speedup of each eta over eta = 0 in wall time to the
threshold and per step, and (`levels`) to each level over the seeds. `--weights p2p` (ray mode; a
whole GPU per actor or none) publishes
through the weight-transfer primitive (NCCL between the actors' GPUs) instead of Ray's object store.
`--colocated` adds, per seed, the colocated synchronous loop on the same GPUs (`runtime/pipeline/colocated.py`:
every GPU generates its share of a step, then all train data-parallel; its own processes, `colocated_loop.py`),
the loop a user runs instead of a pipeline: rows `"loop": "colocated"`, the summary's `colocated`, and each
pipeline row's `speedup_to_threshold_vs_colocated`.
Writes <out>/rl_pipeline_<device>_x<gpus>[_ray][_medium][_p2p].json (stamped: commit, versions, device, date).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/: stamp
sys.path.insert(0, str(HERE))  # the colocated anchor's driver beside this script

from colocated_loop import reached, run_colocated  # noqa: E402
from stamp import stamp  # noqa: E402
from timing import Stopwatch  # noqa: E402

from bumblebee import models  # noqa: E402
from bumblebee.runtime.pipeline import CopyDigits, Objective, PipelineConfig, Sampling  # noqa: E402
from bumblebee.runtime.pipeline.local import LocalPipeline  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Workload:
    """A preset: the Qwen3's sizes over the task's 16 tokens (digits, BOS, SEP, PAD) and the run's."""
    model: dict
    digits: int
    groups: int
    group_size: int
    groups_per_call: int
    lr: float
    threshold: float
    window: int
    max_steps: int
    max_seconds: float | None = None
    levels: tuple = ()  # reward levels reported below the threshold (their wall times read off the same run)


WORKLOADS = {
    "small": Workload({"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 4,
                       "num_key_value_heads": 2, "head_dim": 64}, digits=3, groups=32, group_size=8,
                      groups_per_call=8, lr=2e-3, threshold=0.25, window=5, max_steps=200),
    "medium": Workload({"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 8,
                        "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64}, digits=6, groups=64,
                       group_size=8, groups_per_call=16, lr=3e-5, threshold=0.2, window=5, max_steps=60,
                       max_seconds=30.0, levels=(0.15,)),
}
# qwen3-tiny itself, a few steps of a few groups
CPU_SMOKE = {"digits": 2, "groups": 4, "group_size": 4, "groups_per_call": 2, "lr": 5e-3, "window": 2, "max_steps": 4}
RUN_FIELDS = [f.name for f in dataclasses.fields(Workload) if f.name != "model"]
TARGET = 1.5  # less wall time to the threshold at eta = 2 than at eta = 0, on two GPUs (the target)


def model_config(task: CopyDigits, sizes: dict) -> dict:
    return {**models.NAMED["qwen3-tiny"], **sizes, "vocab_size": 16, "bos_token_id": task.bos_id,
            "pad_token_id": task.pad_id, "eos_token_id": None}


def pipeline_config(eta, args, gpus_each: float = 0.0) -> PipelineConfig:
    return PipelineConfig(steps=args.max_steps, eta=eta, groups_per_step=args.groups, group_size=args.group_size,
                          groups_per_call=args.groups_per_call, lr=args.lr, seed=args.seed, weights=args.weights,
                          restarts=0 if args.weights == "p2p" else 1,  # p2p's group does not survive a restart
                          impl={"cross_entropy": "linear_ce"}, sampling=Sampling(max_new_tokens=args.digits),
                          objective=Objective(entropy_coef=1e-3), take_timeout_s=300.0, weight_timeout_s=300.0,
                          call_timeout_s=300.0, producer_gpus=gpus_each, trainer_gpus=gpus_each, warmup=True)


def _train_local(cfg, args, task, model, devices, on_step, until):
    p = LocalPipeline(cfg, model, task, trainer_device=devices["trainer"], producer_devices=[devices["producer"]])
    return p.run(on_step=on_step, until=until)


def _train_ray(cfg, args, task, model, devices, on_step, until):
    import ray

    from bumblebee.runtime.pipeline import Pipeline
    # the trainer's and the producer's CPU (1 each: PipelineConfig's defaults) and the GPUs they split
    ray.init(num_cpus=2, num_gpus=0 if args.cpu_smoke else args.gpus, include_dashboard=False,
             log_to_driver=not args.quiet)
    try:
        with Pipeline(cfg, model, task) as p:
            return p.run(on_step=on_step, until=until)
    finally:
        ray.shutdown()


def run_eta(eta, args, task, model, devices, quiet) -> dict:
    def until(log):
        return reached(log, args.window, args.threshold) or (args.max_seconds is not None and log[-1]["wall_s"] >= args.max_seconds)

    on_step = None if quiet else (lambda line: print(f"eta {eta} {line}", flush=True))
    gpus_each = 0.0 if args.mode == "local" or args.cpu_smoke else {1: 0.5, 2: 1.0}[args.gpus]  # Ray's share
    train = _train_ray if args.mode == "ray" else _train_local
    log = train(pipeline_config(eta, args, gpus_each), args, task, model, devices, on_step, until)
    return row_of(log, eta, args, reached(log, args.window, args.threshold))


def run_colocated_anchor(args, task, model) -> dict:
    """The colocated synchronous loop on the bench's GPUs (`--gpus` ranks, one GPU each; the CPU smoke:
    two CPU ranks), at the pipeline's settings, stopped as the pipeline runs stop."""
    log = run_colocated(pipeline_config(0, args), model, task, ranks=2 if args.cpu_smoke else args.gpus,
                        device_type="cpu" if args.cpu_smoke else "cuda", window=args.window,
                        threshold=args.threshold, max_seconds=args.max_seconds)
    return {"loop": "colocated", **row_of(log, 0, args, reached(log, args.window, args.threshold))}


def row_of(log, eta, args, hit: bool) -> dict:
    """A row of the result from a run's per-step log (`hit`: it reached the threshold)."""
    return {"eta": eta, "reached": hit, "steps": len(log), "wall_s": log[-1]["wall_s"],
            "to_level": to_levels(log, args.levels, args.window),
            "policy_to_level": policy_levels(log, args.levels, args.window),
            "wall_s_to_threshold": log[-1]["wall_s"] if hit else None,
            "steps_to_threshold": len(log) if hit else None,
            "first_step_s": log[0]["wall_s"],
            "s_per_step_median": statistics.median(b["wall_s"] - a["wall_s"] for a, b in zip(log, log[1:]))
            if len(log) > 1 else None,
            "trainer_idle_mean": statistics.mean(m["trainer_idle"] for m in log),
            "producer_idle_final": log[-1]["producer_idle"],
            "staleness_mean": statistics.mean(m["staleness_mean"] for m in log),
            "behave_kl_mean": statistics.mean(m["behave_kl"] for m in log),
            "tokens_per_s_median": statistics.median(m["tokens_per_s"] for m in log),
            "train_s_median": statistics.median(m["train_s"] for m in log),
            "publish_s_median": statistics.median(m["publish_s"] for m in log),
            "reward": [round(m["reward"], 4) for m in log],
            "step_s": [round(b["wall_s"] - a, 4) for a, b in zip([0.0] + [m["wall_s"] for m in log], log)]}


def to_levels(log, levels, window) -> dict:
    """{level: [steps, wall seconds]} to the first step where the mean reward of the last `window`
    steps reaches `level` (None where the run never did): the levels below the stopping threshold,
    read off the same run."""
    out = {}
    for level in levels:
        hit = next((i for i in range(window - 1, len(log))
                    if statistics.mean(m["reward"] for m in log[i - window + 1:i + 1]) >= level), None)
        out[f"{level:g}"] = None if hit is None else [hit + 1, log[hit]["wall_s"]]
    return out


def policy_levels(log, levels, window) -> dict:
    """{level: [version, wall seconds at its publish]} for the first weights version v whose samples,
    pooled with those of the `window` - 1 versions before it, reach the level's mean reward: the
    policy's own time to the level. The trained rewards above lag it by the samples' staleness (up
    to eta steps); here each reward counts for the version that sampled it (`reward_by_version`),
    and version v's time is the end of step v - 1, when the trainer published it."""
    sums: dict[int, list] = {}
    for m in log:
        for v, (total, n) in m["reward_by_version"].items():
            s = sums.setdefault(int(v), [0.0, 0])
            s[0] += total
            s[1] += n
    out = {}
    for level in levels:
        hit = None
        for v in sorted(sums):
            pooled = [sums[u] for u in range(v - window + 1, v + 1) if u in sums]
            if v >= window - 1 and sum(n for _, n in pooled) and \
                    sum(t for t, _ in pooled) / sum(n for _, n in pooled) >= level:
                hit = v
                break
        out[f"{level:g}"] = None if hit is None else [hit, log[hit - 1]["wall_s"] if hit else 0.0]
    return out


def median_ci95(values) -> list[float] | None:
    """A distribution-free 95% interval for the median of `values` (seeds' ratios): the order statistics
    x_(k), x_(n+1-k) with the largest k whose coverage 1 - 2 P(Binomial(n, 1/2) < k) is still >= 0.95.
    None under 6 values, where even [min, max] covers less (5 values: 0.94)."""
    xs, n = sorted(values), len(values)
    below = lambda k: sum(math.comb(n, i) for i in range(k)) / 2 ** n  # noqa: E731  P(Bin(n, 1/2) < k)
    ks = [k for k in range(1, n // 2 + 1) if 1 - 2 * below(k) >= 0.95]
    return [xs[ks[-1] - 1], xs[n - ks[-1]]] if ks else None


def spread(values) -> dict | None:
    """Median, range and the median's 95% interval (`median_ci95`) over seeds; None without values."""
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "median_ci95": median_ci95(values)}


def target_verdict(ratios: dict | None, target: float) -> str | None:
    """Whether a speed-up over seeds shows `target`: judged on the median's 95% interval where there
    are 6 seeds or more, else on the range (fewer seeds cannot bound the median tighter). "shown":
    the low end reaches it; "missed": the high end stays under it; else "not shown"."""
    if ratios is None:
        return None
    low, high = ratios["median_ci95"] or [ratios["min"], ratios["max"]]
    return "shown" if low >= target else "missed" if high < target else "not shown"


def piped(row: dict) -> bool:
    """A pipeline run's row (not the colocated anchor's)."""
    return row.get("loop", "pipeline") == "pipeline"


def level_speedups(rows, field: str = "to_level") -> list[dict]:
    """Per eta and level over the seeds: each seed's eta = 0 wall time to the level over this eta's
    (`spread`; seeds where either run missed the level are left out, and counted), from the
    rows' `field` ("to_level": trained rewards, `steps` the steps; "policy_to_level": `steps` the versions)."""
    out, rows = [], [r for r in rows if piped(r)]
    for eta in sorted({r["eta"] for r in rows}):
        for level in rows[0][field]:
            ratios, steps = [], []
            for r in rows:
                base = next((b for b in rows if b["eta"] == 0 and b["seed"] == r["seed"]), None)
                if r["eta"] != eta or base is None:
                    continue
                a, b = base[field][level], r[field][level]
                if a and b and b[1] > 0:
                    ratios.append(a[1] / b[1])
                    steps.append(b[0])
            out.append({"eta": eta, "level": float(level), "seeds": len(ratios), "steps": steps,
                        "speedup": spread(ratios)})
    return out


def summarize(rows, target: float = TARGET) -> list[dict]:
    """Per eta over the seeds: how many reached the threshold, the `spread` of the wall time to it and
    of each seed's speed-up over its own eta = 0 run (in full, and without the first steps) and over
    the colocated loop's run, and for eta > 0 whether the speed-up to the threshold shows `target`
    over eta = 0 (`target_verdict`) and over the colocated loop (`target_verdict_vs_colocated`)."""
    out, rows = [], [r for r in rows if piped(r)]
    for eta in sorted({r["eta"] for r in rows}):
        mine = [r for r in rows if r["eta"] == eta]
        row = {"eta": eta, "seeds": len(mine), "reached": sum(r["reached"] for r in mine)}
        for field in ("wall_s_to_threshold", "speedup_to_threshold_vs_eta0", "speedup_after_first_step_vs_eta0",
                      "speedup_per_step_vs_eta0", "speedup_to_threshold_vs_colocated"):
            row[field] = spread([r[field] for r in mine if r.get(field) is not None])
        if eta > 0:
            row["target"] = target
            row["target_verdict"] = target_verdict(row["speedup_to_threshold_vs_eta0"], target)
            # the same target read against the colocated loop (--colocated): the loop a user runs instead
            row["target_verdict_vs_colocated"] = target_verdict(row["speedup_to_threshold_vs_colocated"], target)
        out.append(row)
    return out


def colocated_summary(rows) -> dict | None:
    """The colocated anchor over the seeds (`--colocated`): how many reached the threshold, the
    `spread` of its wall time to it and of its median step; None without anchor rows."""
    mine = [r for r in rows if not piped(r)]
    if not mine:
        return None
    return {"seeds": len(mine), "reached": sum(r["reached"] for r in mine),
            "wall_s_to_threshold": spread([r["wall_s_to_threshold"] for r in mine if r["reached"]]),
            "s_per_step_median": spread([r["s_per_step_median"] for r in mine if r["s_per_step_median"]])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=1, choices=(1, 2), help="1: shared; 2: producer and trainer apart")
    ap.add_argument("--mode", default="local", choices=("local", "ray"), help="threads of this process, or Ray actors")
    ap.add_argument("--weights", default="object_store", choices=("object_store", "p2p"),
                    help="--mode ray's weight channel: Ray's object store, or the weight-transfer primitive")
    ap.add_argument("--workload", default="small", choices=sorted(WORKLOADS), help="model and run sizes")
    ap.add_argument("--cpu-smoke", action="store_true", help="the tiny model on the CPU, a few steps (any workload)")
    ap.add_argument("--etas", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--threshold", type=float, help="mean reward over the last --window steps")
    ap.add_argument("--levels", type=float, nargs="+", help="reward levels whose wall times are also reported "
                    "(default: the workload's, and the threshold)")
    ap.add_argument("--window", type=int)
    ap.add_argument("--max-steps", type=int)
    ap.add_argument("--max-seconds", type=float, help="stop an eta's run past this many seconds of its clock")
    ap.add_argument("--groups", type=int, help="groups (prompts) a step")
    ap.add_argument("--group-size", type=int)
    ap.add_argument("--groups-per-call", type=int, help="groups a producer generates in one call")
    ap.add_argument("--digits", type=int)
    ap.add_argument("--lr", type=float)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", type=int, nargs="+", help="several seeds (overrides --seed): per-eta medians and spread")
    ap.add_argument("--colocated", action="store_true", help="per seed, also the colocated synchronous loop on the "
                    "same GPUs (each GPU generates its share, then all train data-parallel): the anchor a user runs")
    ap.add_argument("--target", type=float, default=TARGET, help="the speed-up to the threshold judged per eta > 0")
    ap.add_argument("--note", default="", help="how the run was made: kept in the result")
    ap.add_argument("--merge", default="", help="a.json,b.json: one result from runs of other seeds (same commit and "
                    "settings), summaries recomputed over all rows; written to --out")
    ap.add_argument("--out", default=None, help="folder of the result file (default: results/ beside this script)")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    if args.merge:
        print(f"wrote {merge([Path(p) for p in args.merge.split(',') if p], Path(args.out or HERE / 'results'))}")
        return 0
    if args.weights == "p2p" and (args.mode != "ray" or (args.gpus == 1 and not args.cpu_smoke)):
        ap.error("--weights p2p needs --mode ray and, on GPUs, --gpus 2 (a whole GPU per actor: two NCCL ranks "
                 "cannot share one)")
    workload = WORKLOADS[args.workload]
    preset = {**{k: getattr(workload, k) for k in RUN_FIELDS}, **(CPU_SMOKE if args.cpu_smoke else {})}
    for k, v in preset.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.levels = sorted({*args.levels, args.threshold})
    if args.cpu_smoke:
        devices = {"trainer": "cpu", "producer": "cpu"}
    else:
        if torch.cuda.device_count() < args.gpus:
            raise SystemExit(f"--gpus {args.gpus}: this machine has {torch.cuda.device_count()} CUDA devices")
        devices = {"trainer": f"cuda:{args.gpus - 1}", "producer": "cuda:0"}
        if args.mode == "ray":  # Ray picks the GPUs: ask for the share, record it
            devices = {k: f"a Ray actor with {1.0 if args.gpus == 2 else 0.5:g} GPU" for k in devices}
    task = CopyDigits(length=args.digits)
    model = model_config(task, {} if args.cpu_smoke else workload.model)
    if not args.cpu_smoke:  # CUDA context, kernels' first calls, allocator; Triton's kernel cache
        run_eta(1, argparse.Namespace(**{**vars(args), "max_steps": 2}), task, model, devices, quiet=True)
    rows, path = [], None
    for seed in args.seeds or [args.seed]:  # a seed's etas back to back: drift weighs on them alike
        for eta in args.etas:
            watch = Stopwatch()  # the whole run, set-up included; the rows' own times come from the pipeline's log
            row = {"seed": seed, **run_eta(eta, argparse.Namespace(**{**vars(args), "seed": seed}), task, model,
                                           devices, args.quiet)}
            row["run_s"] = watch.seconds()
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "reward"}), flush=True)
            path = write(rows, args, devices, model)  # after every row: a run cut short keeps what it measured
        if args.colocated:
            watch = Stopwatch()
            seeded = argparse.Namespace(**{**vars(args), "seed": seed})
            row = {"seed": seed, **run_colocated_anchor(seeded, task, model)}
            row["run_s"] = watch.seconds()
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "reward"}), flush=True)
            path = write(rows, args, devices, model)
    print(f"wrote {path}")
    result = json.loads(path.read_text())
    for r in result["summary"] + result["levels"] + [result["colocated"]] * bool(result["colocated"]):
        print(json.dumps(r))
    for r in rows:
        what = f"eta {r['eta']}" if piped(r) else "colocated"
        print(f"seed {r['seed']} {what}: to threshold {r['wall_s_to_threshold']} s in {r['steps_to_threshold']} "
              f"steps, {r['s_per_step_median'] or float('nan'):.3f} s/step, idle trainer {r['trainer_idle_mean']:.2f} "
              f"producers {r['producer_idle_final']:.2f}, speedup {r.get('speedup_to_threshold_vs_eta0')}")
    return 0


# settings that may differ between the parts of a merge (which seeds ran, and how the run was made)
MERGE_FREE = ("seed", "seeds")


def merge(paths: list[Path], out: Path) -> Path:
    """One result from runs of disjoint seeds at one commit with the same settings (e.g. two pipelines
    side by side on one host's GPU pairs): rows joined, summaries and level speed-ups recomputed."""
    if len(paths) < 2:
        raise ValueError(f"--merge needs two or more result files, got {len(paths)}")
    runs = [json.loads(p.read_text()) for p in paths]
    first = runs[0]
    for p, r in zip(paths, runs):
        config = {k: v for k, v in r["config"].items() if k not in MERGE_FREE}
        base = {k: v for k, v in first["config"].items() if k not in MERGE_FREE}
        differs = [k for k in ("commit", "benchmark", "mode", "workload", "gpus", "device", "model")
                   if r.get(k) != first.get(k)]
        settings = sorted(k for k in {*config, *base} if config.get(k) != base.get(k))
        if r.get("dirty"):
            raise ValueError(f"--merge: {p} was measured on a dirty tree")
        if differs or settings:
            raise ValueError(f"--merge: {p} differs from {paths[0]} in {differs + settings}")
    seeds = [row["seed"] for r in runs for row in r["rows"] if row["eta"] == 0 and piped(row)]
    if len(seeds) != len(set(seeds)):
        raise ValueError(f"--merge: a seed ran in more than one part ({sorted(seeds)}): its rows would count twice")
    rows = [row for r in runs for row in r["rows"]]
    target = first["config"].get("target", TARGET)
    result = {**first, "config": {**first["config"], "seeds": sorted(seeds)}, "rows": rows,
              "summary": summarize(rows, target), "levels": level_speedups(rows),
              "policy_levels": level_speedups(rows, "policy_to_level"), "colocated": colocated_summary(rows),
              "merged_dates": [r["date"] for r in runs], "merged_notes": [r.get("note", "") for r in runs]}
    out.mkdir(parents=True, exist_ok=True)
    path = out / paths[0].name
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(path)
    return path


def write(rows, args, devices, model) -> Path:
    """The result file of the rows so far, each with its speed-ups over its seed's eta = 0 run."""
    for r in rows:
        if not piped(r):
            continue
        anchor = next((b for b in rows if not piped(b) and b["seed"] == r["seed"]), None)
        r["speedup_to_threshold_vs_colocated"] = (anchor["wall_s_to_threshold"] / r["wall_s_to_threshold"]
                                                  if anchor is not None and anchor["reached"] and r["reached"]
                                                  else None)
        base = next((b for b in rows if piped(b) and b["eta"] == 0 and b["seed"] == r["seed"]), None)
        ok = base is not None and base["reached"] and r["reached"]
        r["speedup_to_threshold_vs_eta0"] = base["wall_s_to_threshold"] / r["wall_s_to_threshold"] if ok else None
        # the same without each run's first step (alike for every eta)
        warm = ok and r["steps_to_threshold"] > 1 and base["steps_to_threshold"] > 1
        r["speedup_after_first_step_vs_eta0"] = ((base["wall_s_to_threshold"] - base["first_step_s"])
                                                 / (r["wall_s_to_threshold"] - r["first_step_s"]) if warm else None)
        r["speedup_per_step_vs_eta0"] = (base["s_per_step_median"] / r["s_per_step_median"]
                                         if base is not None and base["s_per_step_median"] and r["s_per_step_median"]
                                         else None)
    gpus = 0 if args.cpu_smoke else args.gpus
    result = {**stamp("cpu" if args.cpu_smoke else "cuda:0"), "benchmark": "rl_pipeline",
              "mode": {"local": "local (threads)", "ray": "ray (actors, a process each)"}[args.mode],
              "workload": args.workload, "gpus": gpus, "devices": devices, "model": model,
              "task": {"name": "copy_digits", "length": args.digits},
              "config": {k: v for k, v in vars(args).items() if k not in ("out", "quiet", "note", "merge")},
              "note": args.note, "rows": rows, "summary": summarize(rows, args.target), "levels": level_speedups(rows),
              "colocated": colocated_summary(rows),
              "policy_levels": level_speedups(rows, "policy_to_level")}
    out = Path(args.out) if args.out else HERE / "results"
    out.mkdir(parents=True, exist_ok=True)
    name = "cpu" if args.cpu_smoke else result["device"].lower().replace("nvidia ", "").replace(" ", "_")
    suffix = ("_ray" if args.mode == "ray" else "") + ("" if args.workload == "small" else f"_{args.workload}") + \
        ("_p2p" if args.weights == "p2p" else "")
    path = out / f"rl_pipeline_{name}_x{gpus}{suffix}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(path)
    return path


if __name__ == "__main__":
    raise SystemExit(main())
