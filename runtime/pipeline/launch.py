"""Launch a pipeline run from a TOML or JSON config file: `bumblebee rl --config run.toml`. Prints a progress line per step,
appends the JSONL log, and plots reward and idle fractions (matplotlib, the `plot` extra; without
it the run says so and writes no plot). The file (TOML; JSON has the same keys):

    model = "qwen3-tiny"                 # a named model or a table of HF config fields
    mode = "ray"                         # "ray": Ray actors; "local": threads of this process, no Ray;
                                         # "colocated": the synchronous loop on every rank's device (eta 0;
                                         # under torchrun each rank generates its share, then all train)
    log = "run.jsonl"
    plot = "run.png"                     # default: the log's name with .png
    [model_overrides]
    vocab_size = 16
    bos_token_id = 10
    pad_token_id = 12
    [task]
    name = "copy_digits"
    length = 2
    [pipeline]                           # PipelineConfig's fields
    steps = 40
    eta = 1
    lr = 0.005
    groups_per_step = 16
    group_size = 8
    impl = {cross_entropy = "linear_ce"}
    sampling = {max_new_tokens = 2}      # Sampling's fields
    objective = {entropy_coef = 0.001}   # Objective's fields
    [ray]                                # ray.init's arguments (mode "ray")
    num_cpus = 2
    [devices]                            # mode "local": where the trainer and each producer run
    trainer = "cuda:1"
    producers = ["cuda:0"]

Unknown keys are errors naming the key (a typo never silently falls back to a default)."""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from bumblebee.runtime.pipeline.config import Objective, PipelineConfig, Sampling
from bumblebee.runtime.pipeline.tasks import CopyDigits

TASKS = {"copy_digits": CopyDigits}
TOP_KEYS = ("model", "model_overrides", "task", "pipeline", "mode", "ray", "devices", "log", "plot")
MODES = ("ray", "local", "colocated")


@dataclass(frozen=True)
class LaunchConfig:
    pipeline: PipelineConfig
    model: dict  # the HF config dict of the policy
    task: object
    ray: dict
    log: str | None = None
    plot: str | None = None
    mode: str = "ray"
    devices: dict = field(default_factory=dict)  # mode "local": {"trainer": str, "producers": [str]}


def _build(cls, raw: dict, where: str, nested: dict | None = None):
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; accepted: {sorted(names)}")
    kw = dict(raw)
    for key, sub in (nested or {}).items():
        if key in kw:
            kw[key] = _build(sub, kw[key], f"{where}.{key}")
    return cls(**kw)


def read(path) -> dict:
    """The file's table: TOML (.toml) or JSON (.json)."""
    path = Path(path)
    if path.suffix == ".toml":
        with open(path, "rb") as f:
            return tomllib.load(f)
    if path.suffix == ".json":
        return json.loads(path.read_text())
    raise ValueError(f"config {path}: expected a .toml or .json file")


def load_config(path) -> LaunchConfig:
    from bumblebee import models
    raw = read(path)
    unknown = sorted(set(raw) - set(TOP_KEYS))
    if unknown:
        raise ValueError(f"{path}: unknown keys {unknown}; accepted: {list(TOP_KEYS)}")
    if "pipeline" not in raw or "model" not in raw:
        raise ValueError(f"{path}: 'model' and 'pipeline' are required")
    model = raw["model"]
    model = dict(models.NAMED[model]) if isinstance(model, str) and model in models.NAMED else model
    if not isinstance(model, dict):
        raise ValueError(f"model must be one of {sorted(models.NAMED)} or an HF config dict, got {raw['model']!r}")
    model = {**model, **raw.get("model_overrides", {})}
    task = dict(raw.get("task", {"name": "copy_digits"}))
    name = task.pop("name", "copy_digits")
    if name not in TASKS:
        raise ValueError(f"task.name must be one of {sorted(TASKS)}, got {name!r}")
    pipeline = _build(PipelineConfig, raw["pipeline"], "pipeline", {"sampling": Sampling, "objective": Objective})
    mode = raw.get("mode", "ray")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    devices = dict(raw.get("devices", {}))
    unknown = sorted(set(devices) - {"trainer", "producers"})
    if unknown:
        raise ValueError(f"devices: unknown keys {unknown}; accepted: ['producers', 'trainer']")
    if devices and mode != "local":
        raise ValueError("devices is for mode 'local' (with Ray, actors ask for GPUs through ray's scheduling; "
                         "colocated, each rank takes its own: cuda:LOCAL_RANK where CUDA is, else the CPU)")
    if mode == "colocated" and pipeline.eta != 0:
        raise ValueError(f"mode 'colocated' is the synchronous loop: pipeline.eta must be 0, got {pipeline.eta}")
    log = raw.get("log")
    plot_path = raw.get("plot", str(Path(log).with_suffix(".png")) if log else None)
    return LaunchConfig(pipeline, model, _build(TASKS[name], task, "task"), dict(raw.get("ray", {})), log, plot_path,
                        mode, devices)


def plot(log: list[dict], path) -> str:
    """Reward, and the trainer's and producers' idle fractions, per step, into `path`; what was done
    (a line to print: without matplotlib, that no plot was written and how to get one)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"no plot written to {path}: matplotlib is not installed (pip install -e '.[plot]')"
    steps = [m["step"] for m in log]
    fig, (a, b) = plt.subplots(2, 1, sharex=True, figsize=(6, 5))
    a.plot(steps, [m["reward"] for m in log])
    a.set_ylabel("mean reward")
    b.plot(steps, [m["trainer_idle"] for m in log], label="trainer")
    b.plot(steps, [m["producer_idle"] for m in log], label="producers (cumulative)")
    b.set_ylabel("idle fraction")
    b.set_xlabel("step")
    b.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return f"wrote {path}"


def run(cfg: LaunchConfig, *, on_step=print) -> list[dict]:
    """Train `cfg` (Ray started and stopped here in mode "ray"); the per-step log."""
    if cfg.mode == "colocated":
        return _run_colocated(cfg, on_step)
    if cfg.mode == "local":
        from bumblebee.runtime.pipeline.local import LocalPipeline
        trainer = cfg.devices.get("trainer", "cpu")
        p = LocalPipeline(cfg.pipeline, cfg.model, cfg.task, trainer_device=trainer,
                          producer_devices=cfg.devices.get("producers", [trainer] * cfg.pipeline.producers))
        return p.run(log_path=cfg.log, on_step=on_step)
    try:
        import ray
    except ImportError:
        raise RuntimeError("mode 'ray' needs Ray: pip install -e '.[rl]' (or mode = \"local\")") from None
    from bumblebee.runtime.pipeline.run import Pipeline
    ray.init(**cfg.ray)
    try:
        with Pipeline(cfg.pipeline, cfg.model, cfg.task) as p:
            return p.run(log_path=cfg.log, on_step=on_step)
    finally:
        ray.shutdown()


def _run_colocated(cfg: LaunchConfig, on_step) -> list[dict]:
    """Mode "colocated": under torchrun (RANK in the environment) every rank joins the default group made
    here (NCCL beside gloo on CUDA) and takes cuda:LOCAL_RANK; alone, one rank on cuda:0 or the CPU. Rank 0
    prints and logs."""
    import torch
    import torch.distributed as dist

    from bumblebee.runtime.pipeline.colocated import colocated_run
    from bumblebee.runtime.pipeline.engine import TransformersEngine
    ranks = "RANK" in os.environ
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() \
        else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    engine = TransformersEngine(cfg.model, device=str(device), eos_token_id=cfg.task.eos_id,
                                pad_token_id=cfg.task.pad_id)
    if not ranks:
        return colocated_run(cfg.pipeline, cfg.model, cfg.task, engine, device=device, on_step=on_step,
                             log_path=cfg.log)
    dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=cfg.pipeline.trainer_timeout_s))
    try:
        return colocated_run(cfg.pipeline, cfg.model, cfg.task, engine, group=dist.group.WORLD, device=device,
                             on_step=on_step, log_path=cfg.log)
    finally:
        dist.destroy_process_group()


def launch(config, *, log=None, plot_path=None) -> int:
    """`bumblebee rl`: run the file `config` (`log`, `plot_path`: override the file's). Exit status 2
    for a config refused before running, 0 after the run."""
    try:
        cfg = load_config(config)
    except (ValueError, TypeError, OSError, tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        print(f"bumblebee rl: {e}", file=sys.stderr)
        return 2
    cfg = dataclasses.replace(cfg, log=log or cfg.log,
                              plot=plot_path or (str(Path(log).with_suffix(".png")) if log else cfg.plot))
    log = run(cfg, on_step=lambda line: print(line, flush=True))
    if cfg.plot and int(os.environ.get("RANK", 0)) == 0:  # mode colocated under torchrun: rank 0 plots
        print(plot(log, cfg.plot))
    return 0

