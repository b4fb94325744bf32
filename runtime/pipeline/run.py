"""The driver: starts the actors, runs the steps in order, restarts a producer that dies (its
leased prompts go back to the scheduler, admitted again first), and shuts everything down."""
from __future__ import annotations

import functools
import time

import ray

from bumblebee.runtime.pipeline.actors import Producer, Scheduler, Trainer
from bumblebee.runtime.pipeline.config import PipelineConfig, PipelineTimeout
from bumblebee.runtime.pipeline.engine import TransformersEngine, warmup_prompt
from bumblebee.runtime.pipeline.report import emit
from bumblebee.runtime.pipeline.weights import ObjectStoreChannel, WeightStore, get



class Pipeline:
    """An asynchronous GRPO run of `model_config` (an HF config dict, e.g. `bumblebee.models.NAMED`'s)
    on `task`. `engine`: a picklable factory of the producers' EngineAdapter (default: transformers'
    generate on CPU). Ray must be initialized by the caller (`ray.init(num_cpus=...)`)."""

    def __init__(self, cfg: PipelineConfig, model_config: dict, task, *, engine=None):
        if not ray.is_initialized():
            raise RuntimeError("Pipeline needs Ray: call ray.init(...) first")
        gpus = ray.cluster_resources().get("GPU", 0)
        for name in ("producer_gpus", "trainer_gpus"):  # an actor Ray cannot place would only time out
            if getattr(cfg, name) > gpus:
                raise ValueError(f"{name}={getattr(cfg, name)} per actor, but the Ray cluster has {gpus:g} GPUs")
        self.cfg, self.task = cfg, task
        self.engine = engine or functools.partial(TransformersEngine, model_config, eos_token_id=task.eos_id,
                                                  pad_token_id=task.pad_id)
        self.producers, self.holders, self.incarnations, self.runs, self.restarts = {}, {}, {}, {}, 0
        self.trainer = self.scheduler = None
        self.trainers = []  # the trainer's ranks (one actor each); self.trainer is rank 0
        self.store = WeightStore.remote()
        try:
            self._start(cfg, model_config, task)
        except BaseException:  # no actor outlives a failed start
            self.shutdown()
            raise

    def _start(self, cfg, model_config, task) -> None:
        self.scheduler = Scheduler.remote(task, cfg)
        self.trainers = [Trainer.options(num_cpus=cfg.trainer_cpus, num_gpus=cfg.trainer_gpus).remote(
                             model_config, cfg, self.scheduler, task.pad_id, rank)
                         for rank in range(cfg.trainer_ranks)]
        self.trainer = self.trainers[0]
        for i in range(cfg.producers):  # their processes start beside the trainer's
            self._create(i)
        self.channel = ObjectStoreChannel(self.store, cfg.call_timeout_s, background=cfg.publish_in_background)
        if cfg.weights == "p2p":  # one group over all of them, joined at once
            from bumblebee.runtime.pipeline.weights_p2p import P2PChannel
            address = get(self.trainer.address.remote(), cfg.call_timeout_s, "the trainer's address")
            self.channel = P2PChannel(cfg.producers, address, cfg.weight_timeout_s, trainers=cfg.trainer_ranks,
                                      trainer_timeout_s=cfg.trainer_timeout_s,
                                      expert_parallel=cfg.expert_parallel,
                                      device_type="cuda" if cfg.trainer_gpus else "cpu")  # the config: both or neither
        address = None
        if cfg.trainer_ranks > 1 and cfg.weights != "p2p":  # the trainer's ranks' own group, at rank 0's address
            address = get(self.trainer.address.remote(), cfg.call_timeout_s, "the trainer's address")
        joins = [t.attach.remote(self.channel, address) for t in self.trainers]
        joins += [p.attach.remote(i + 1, self.channel) for i, p in self.producers.items()]
        get(joins, cfg.call_timeout_s, "the trainer's and producers' start")
        get([t.publish.remote(flush=True) for t in self.trainers], cfg.call_timeout_s, "the first weights")
        if cfg.warmup:
            prompt = warmup_prompt(task, cfg)
            get([t.warmup.remote(prompt) for t in self.trainers] + [p.warmup.remote() for p in self.producers.values()],
                cfg.call_timeout_s, "the warm-up")
        for i, p in self.producers.items():
            self.runs[p.run.remote()] = i

    def _create(self, i: int):
        """Producer `i`'s actor. Each incarnation leases under its own name ("i.n"), so that a late
        answer of a dead one can never pass for its successor's."""
        holder = f"{i}.{self.incarnations.get(i, 0)}"
        self.incarnations[i] = self.incarnations.get(i, 0) + 1
        p = Producer.options(num_cpus=self.cfg.producer_cpus, num_gpus=self.cfg.producer_gpus).remote(
            holder, self.engine, self.task, self.scheduler, self.cfg)
        self.producers[i], self.holders[i] = p, holder
        return p

    def _restart(self, i: int) -> None:
        p = self._create(i)
        p.attach.remote(i + 1, self.channel)
        self.runs[p.run.remote()] = i

    def kill_producer(self, i: int) -> None:
        """Kill producer `i` (a fault, for tests): the driver restarts it and its prompts are re-leased."""
        ray.kill(self.producers[i], no_restart=True)

    def run(self, *, log_path=None, on_step=print, before_step=None, until=None) -> list[dict]:
        """Train `cfg.steps` steps; each step's metrics (printed by `on_step` as a progress line,
        appended to the JSONL `log_path`). `before_step(pipeline, step)`: a hook (tests inject faults).
        `until(log) -> bool`: stop after the step where it first holds (e.g. a reward threshold; the
        producers' work beyond it is dropped when the actors end)."""
        cfg, log = self.cfg, []
        out = open(log_path, "a") if log_path else None
        t_start = time.monotonic()
        try:
            for step in range(cfg.steps):
                if before_step is not None:
                    before_step(self, step)
                refs = [t.step.remote(step) for t in self.trainers]  # every rank; rank 0 reports
                ref = refs[0]
                while True:  # wait for the step, handling producers that end meanwhile
                    ready, _ = ray.wait([ref, *self.runs], num_returns=1,
                                        timeout=cfg.trainer_timeout_s)
                    if not ready:
                        raise PipelineTimeout(f"step {step}: no answer from the trainer or producers")
                    if ready[0] == ref:
                        break
                    self._ended(ready[0])
                m, *_ = get(refs, cfg.call_timeout_s, f"step {step}")
                m.update(step=step, wall_s=time.monotonic() - t_start)
                log.append(m)
                emit(m, out, on_step)
                if until is not None and until(log):
                    break
            # the last version in the store (a background put may still be in flight)
            get([t.flush.remote() for t in self.trainers], cfg.call_timeout_s, "the last weights")
        finally:
            if out:
                out.close()
        return log

    def _ended(self, run_ref) -> None:
        i = self.runs.pop(run_ref)
        try:
            ray.get(run_ref, timeout=self.cfg.call_timeout_s)  # finished: every prompt admitted
        except ray.exceptions.RayActorError:
            if self.restarts >= self.cfg.restarts:
                raise
            self.restarts += 1
            get(self.scheduler.release.remote(self.holders[i]), self.cfg.call_timeout_s,
                f"releasing producer {i}'s prompts")
            self._restart(i)

    def stats(self) -> dict:
        return get(self.scheduler.stats.remote(), self.cfg.call_timeout_s, "scheduler stats")

    def shutdown(self) -> None:
        """Stop every actor of the run (their processes end; Ray itself stays up)."""
        for actor in [*self.producers.values(), *self.trainers, self.scheduler, self.store]:
            if actor is not None:
                ray.kill(actor, no_restart=True)
        self.producers, self.runs = {}, {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
