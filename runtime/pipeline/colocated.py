"""The synchronous loop a user runs on the same GPUs instead of a pipeline (verl's hybrid engine):
every rank of the trainer's data-parallel group holds the policy and an engine on its own device. A
step: each rank generates its share of the step's groups (whole engine calls, call c on rank c % world,
each seeded as the one-process loop seeds it), the groups are gathered to every rank, `grpo_step`
trains them data-parallel over the ranks, and the new weights go into each rank's engine as a copy on
its device (`export_weights`, no host round trip). eta = 0 by construction: every sample is on-policy.
No Ray: every rank calls `colocated_run` (torchrun, or processes of one's own). What an asynchronous
pipeline on the same GPUs must beat, where both phases scale over all GPUs.

With one rank it makes the updates of `trainer.synchronous_run` (tested), which leases a step's
groups in the same calls."""
from __future__ import annotations

import time

import torch

from bumblebee.runtime.pipeline.admission import Admission, Lease
from bumblebee.runtime.pipeline.config import PipelineConfig
from bumblebee.runtime.pipeline.engine import rollout, warm_engine, warmup_prompt
from bumblebee.runtime.pipeline.report import emit
from bumblebee.runtime.pipeline.trainer import build_runtime, grpo_step, own_default_group, warmup_step


def _step_calls(adm: Admission, prompts, cfg: PipelineConfig, step: int) -> list[list]:
    """The step's engine calls, as the one-process loop makes them: [(Lease, prompt, meta)] of at most
    `groups_per_call` groups each. Every rank makes the same ones (the same admission, the same prompts)."""
    calls, n = [], 0
    while n < cfg.groups_per_step:
        leases = []
        while len(leases) < min(cfg.groups_per_call, cfg.groups_per_step - n):
            lease = adm.admit(0, step)
            if not isinstance(lease, Lease):  # ticket `step` on version `step`: always admitted at eta = 0
                raise RuntimeError(f"step {step}: admission answered {lease!r}")
            leases.append((lease, *next(prompts)))
        calls.append(leases)
        n += len(leases)
    return calls


def _sync(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.monotonic()


def colocated_run(cfg: PipelineConfig, model_config: dict, task, engine, *, group=None, device="cpu",
                  until=None, on_step=None, log_path=None) -> list[dict]:
    """Train `cfg.steps` steps (or until `until(log)` holds on rank 0: every rank stops with it) and
    return the per-step metrics, the same on every rank but for the clocks: the pipeline's fields, with
    `trainer_idle` the share of a step spent generating and `producer_idle` the share spent training
    and loading weights (each GPU does both in turn). `engine`: this rank's EngineAdapter on `device`.
    `group`: the data-parallel group of every rank that calls this (None: one rank, made here)."""
    if cfg.eta != 0:
        raise ValueError(f"the colocated loop is synchronous: eta must be 0, got {cfg.eta}")
    if group is None:  # the one-rank group made inside goes with the run
        with own_default_group():
            return _run(cfg, model_config, task, engine, None, torch.device(device), until, on_step, log_path)
    return _run(cfg, model_config, task, engine, group, torch.device(device), until, on_step, log_path)


def _run(cfg, model_config, task, engine, group, device, until, on_step, log_path) -> list[dict]:
    import torch.distributed as dist
    rt, ref = build_runtime(model_config, cfg, group=group, device=device)
    world, rank = (dist.get_world_size(group), dist.get_rank(group)) if group is not None else (1, 0)
    adm, prompts, log = Admission(cfg.groups_per_step, 0, cfg.steps), task.prompts(cfg.seed), []

    def load(version: int) -> None:
        engine.load_weights(rt.export_weights(dtype=torch.float32), version)  # every rank gathers, every rank loads

    if cfg.warmup:
        warmup_step(rt, cfg, prompt=warmup_prompt(task, cfg), vocab=model_config["vocab_size"], pad_id=task.pad_id,
                    ref=ref, world=world)
    load(0)
    if cfg.warmup:
        warm_engine(engine, task, cfg)
    if group is not None:
        dist.barrier(group=group)
    out = open(log_path, "a") if log_path and rank == 0 else None
    try:
        t_start = _sync(device)
        for step in range(cfg.steps):
            t0 = time.monotonic()
            calls = _step_calls(adm, prompts, cfg, step)
            mine = [rollout(engine, task, leases, cfg) for c, leases in enumerate(calls) if c % world == rank]
            t1 = _sync(device)
            every = [mine] if group is None else [None] * world
            if group is not None:
                dist.all_gather_object(every, mine, group=group)
            by_rank = [iter(calls_of) for calls_of in every]  # call c came from rank c % world, in order
            groups = [g for c in range(len(calls)) for g in next(by_rank[c % world])]
            m = grpo_step(rt, groups, cfg.objective, version=step, pad_id=task.pad_id, ref=ref, rank=rank,
                          world=world, group=group)
            t2 = _sync(device)
            load(step + 1)
            t3 = _sync(device)
            m.update(wait_s=t1 - t0, train_s=t2 - t1, publish_s=t3 - t2, tokens_per_s=m["tokens"] / max(t3 - t0, 1e-9),
                     trainer_idle=(t1 - t0) / max(t3 - t0, 1e-9), producer_idle=(t3 - t1) / max(t3 - t0, 1e-9),
                     group_ids=[g.group for g in groups], step=step, wall_s=t3 - t_start)
            log.append(m)
            if rank == 0:
                emit(m, out, on_step)
            if _stop(until is not None and rank == 0 and until(log), group, device):
                break
    finally:
        if out:
            out.close()
    return log


def _stop(mine: bool, group, device: torch.device) -> bool:
    """Rank 0's decision on every rank (the ranks' clocks differ, so a time limit read on each could split them)."""
    if group is None:
        return mine
    import torch.distributed as dist
    flag = torch.tensor([float(mine)], device=device if dist.get_backend(group) == "nccl" else "cpu")
    dist.broadcast(flag, src=dist.get_global_rank(group, 0), group=group)
    return bool(flag.item())
