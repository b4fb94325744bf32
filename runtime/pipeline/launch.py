"""Launch a pipeline run from a JSON config file: `python -m bumblebee.runtime.pipeline.launch
--config run.json`. Prints a progress line per step, appends the JSONL log, and plots reward and
idle fractions when `plot` is set (matplotlib: the `plot` extra). The file:

    {"model": "qwen3-tiny", "model_overrides": {"vocab_size": 16, "bos_token_id": 10, "pad_token_id": 12},
     "task": {"name": "copy_digits", "length": 2},
     "pipeline": {"steps": 40, "eta": 1, "lr": 0.005, "groups_per_step": 16, "group_size": 8,
                  "impl": {"cross_entropy": "linear_ce"}, "sampling": {"max_new_tokens": 2},
                  "objective": {"entropy_coef": 0.001}},
     "ray": {"num_cpus": 2}, "log": "run.jsonl", "plot": "run.png"}

Unknown keys are errors naming the key (a typo never silently falls back to a default)."""
from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from bumblebee.runtime.pipeline.config import Objective, PipelineConfig, Sampling
from bumblebee.runtime.pipeline.tasks import CopyDigits

TASKS = {"copy_digits": CopyDigits}
TOP_KEYS = ("model", "model_overrides", "task", "pipeline", "ray", "log", "plot")


@dataclass(frozen=True)
class LaunchConfig:
    pipeline: PipelineConfig
    model: dict  # the HF config dict of the policy
    task: object
    ray: dict
    log: str | None = None
    plot: str | None = None


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


def load_config(path) -> LaunchConfig:
    from bumblebee import models
    raw = json.loads(Path(path).read_text())
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
    return LaunchConfig(pipeline, model, _build(TASKS[name], task, "task"), dict(raw.get("ray", {})),
                        raw.get("log"), raw.get("plot"))


def plot(log: list[dict], path) -> None:
    """Reward, and the trainer's and producers' idle fractions, per step."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("plotting needs matplotlib: pip install -e '.[plot]'") from None
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the run's JSON file")
    cfg = load_config(parser.parse_args(argv).config)
    import ray

    from bumblebee.runtime.pipeline.run import Pipeline
    ray.init(**cfg.ray)
    try:
        with Pipeline(cfg.pipeline, cfg.model, cfg.task) as p:
            log = p.run(log_path=cfg.log)
    finally:
        ray.shutdown()
    if cfg.plot:
        plot(log, cfg.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
