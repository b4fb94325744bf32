"""The pipeline without Ray, in one process: the trainer and each producer are threads of the caller's
process, sharing one `Admission` behind a condition variable; weights go from the trainer to the
producers as tensors in memory. Same admission, rollout, GRPO step and report as the Ray pipeline.

It exists for machines where Ray is not installed and for quick runs: no actor start-up. Threads share the GIL, so overlap comes
from GPU work and from the GIL released in torch ops; a CPU run of it measures little. Producers and
the trainer may sit on different devices (`trainer_device`, `producer_devices`: one GPU shared, or
producers on one and the trainer on another); each thread sets its own current CUDA device (a
per-thread setting), so the caller's is left as it was. No producer restarts here (a thread that
raises ends the run with its error)."""
from __future__ import annotations

import functools
import threading
import time

import torch

from bumblebee.runtime.pipeline.admission import Ledger
from bumblebee.runtime.pipeline.config import PipelineConfig, PipelineTimeout
from bumblebee.runtime.pipeline.engine import TransformersEngine, rollout, warm_engine, warmup_prompt
from bumblebee.runtime.pipeline.report import emit
from bumblebee.runtime.pipeline.trainer import build_runtime, grpo_step, own_default_group, warmup_step


def _use(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)  # this thread's current device only


class LocalPipeline:
    """`cfg.producers` producer threads and a trainer thread; `run()` (once) trains `cfg.steps` steps
    and returns (and logs, and prints) the same per-step metrics as `Pipeline.run`. `engine(device)`: a
    factory of a producer's EngineAdapter (default: transformers' generate on that device)."""

    def __init__(self, cfg: PipelineConfig, model_config: dict, task, *, engine=None, trainer_device="cpu",
                 producer_devices=None):
        if cfg.trainer_ranks != 1:
            raise ValueError(f"trainer_ranks must be 1 in the local mode (one trainer thread), got {cfg.trainer_ranks}; "
                             f"the Ray pipeline runs a trainer over several ranks")
        for name in ("producer_gpus", "trainer_gpus"):  # Ray's options: here devices are named instead
            if getattr(cfg, name):
                raise ValueError(f"{name} asks Ray for GPUs: the local mode takes trainer_device and "
                                 f"producer_devices instead (the launch config's [devices]); set {name}=0")
        self.cfg, self.model_config, self.task = cfg, model_config, task
        self.trainer_device = torch.device(trainer_device)
        devices = list(producer_devices) if producer_devices is not None else [trainer_device] * cfg.producers
        if len(devices) != cfg.producers:
            raise ValueError(f"producer_devices needs one device per producer ({cfg.producers}), got {devices}")
        self.producer_devices = [torch.device(d) for d in devices]
        self.engine = engine or (lambda device: TransformersEngine(model_config, device=str(device),
                                                                    eos_token_id=task.eos_id,
                                                                    pad_token_id=task.pad_id))
        self.ledger = Ledger(task, cfg)  # guarded by self.cond
        self.cond = threading.Condition()
        self.weights, self.version = None, -1  # the newest published weights and their version
        self.errors: list[BaseException] = []
        self.stopping = False
        # cfg.warmup: the trainer's clock starts once it and every producer have warmed up
        self.warmed = threading.Barrier(cfg.producers + 1, timeout=cfg.call_timeout_s) if cfg.warmup else None

    # -- producers -----------------------------------------------------------------------------
    def _newest(self, engine) -> bool:
        with self.cond:
            weights, version = self.weights, self.version
        if version <= engine.version:
            return False
        engine.load_weights(weights.items(), version)
        return True

    def _producer(self, i: int) -> None:
        cfg, device = self.cfg, self.producer_devices[i]
        try:
            _use(device)
            engine = self.engine(device)
            busy = idle = 0.0
            newer = lambda: self.version > engine.version or self.stopping  # noqa: E731
            if self.warmed is not None:
                self._warm_producer(engine, newer)
            while True:
                t0 = time.monotonic()
                with self.cond:
                    if engine.version < 0 and not self.cond.wait_for(newer, cfg.weight_timeout_s):
                        raise PipelineTimeout(f"producer {i}: no weights within {cfg.weight_timeout_s:g} s "
                                              f"(weight_timeout_s)")
                self._newest(engine)  # outside the lock: loading takes time
                with self.cond:
                    if self.stopping:
                        return
                    leases, status = self.ledger.admit(i, engine.version, cfg.groups_per_call)
                    if not leases and status == "done":
                        return
                    if not leases:  # the next prompt would be too stale on these weights
                        if not self.cond.wait_for(newer, cfg.weight_timeout_s):
                            raise PipelineTimeout(f"producer {i}: no weights newer than version {engine.version} "
                                                  f"within {cfg.weight_timeout_s:g} s (weight_timeout_s)")
                        idle += time.monotonic() - t0
                        continue
                out = rollout(engine, self.task, leases, cfg, holder=i,
                              refresh=functools.partial(self._newest, engine) if cfg.sampling.chunk_tokens else None)
                busy += time.monotonic() - t0
                with self.cond:
                    self.ledger.submit(i, out, busy, idle)
                    self.cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - handed to the trainer, which raises it
            if self.warmed is not None:
                self.warmed.abort()  # a trainer waiting for the warm-up raises instead of waiting it out
            with self.cond:
                self.errors.append(e)
                self.cond.notify_all()

    def _warm_producer(self, engine, newer) -> None:
        """`PipelineConfig.warmup`: the first weights, one throwaway engine call, then the barrier."""
        cfg = self.cfg
        with self.cond:
            if not self.cond.wait_for(newer, cfg.weight_timeout_s):
                raise PipelineTimeout(f"no first weights within {cfg.weight_timeout_s:g} s (weight_timeout_s)")
            if self.stopping:
                return
        self._newest(engine)
        warm_engine(engine, self.task, cfg)
        self.warmed.wait()

    # -- trainer -------------------------------------------------------------------------------
    def _publish(self, rt, version: int) -> None:
        weights = {n: t.detach().clone() for n, t in rt.export_weights(dtype=torch.float32)}
        if self.trainer_device.type == "cuda":
            torch.cuda.synchronize(self.trainer_device)  # the copies are done before another device reads them
        with self.cond:
            self.weights, self.version = weights, version
            self.cond.notify_all()

    def _take(self, step: int):
        cfg = self.cfg
        adm = self.ledger.adm
        with self.cond:
            if not self.cond.wait_for(lambda: adm.ready(step) or self.errors, cfg.take_timeout_s):
                raise PipelineTimeout(f"step {step}: {len(adm.done.get(step, ()))} of {cfg.groups_per_step} "
                                      f"groups within {cfg.take_timeout_s:g} s (take_timeout_s)")
            if self.errors:
                raise RuntimeError("a producer failed") from self.errors[0]
            return self.ledger.consume(step)

    def run(self, *, log_path=None, on_step=print, until=None) -> list[dict]:
        """`until(log) -> bool`: stop after the step where it first holds (e.g. a reward threshold;
        the producers' work beyond it is dropped)."""
        if self.ledger.adm.issued:
            raise RuntimeError("a LocalPipeline runs once: build another for another run")
        cfg, log = self.cfg, []
        result: dict = {}

        def train():
            with own_default_group():
                train_steps()

        def train_steps():
            try:
                _use(self.trainer_device)
                rt, ref = build_runtime(self.model_config, cfg, device=self.trainer_device)
                if self.warmed is not None:
                    warmup_step(rt, cfg, prompt=warmup_prompt(self.task, cfg),
                                vocab=self.model_config["vocab_size"], pad_id=self.task.pad_id, ref=ref)
                self._publish(rt, 0)
                if self.warmed is not None:
                    self.warmed.wait()
                t_start = time.monotonic()
                for step in range(cfg.steps):
                    t0 = time.monotonic()
                    groups, producer_idle = self._take(step)
                    t1 = time.monotonic()
                    m = grpo_step(rt, groups, cfg.objective, version=step, pad_id=self.task.pad_id, ref=ref)
                    if self.trainer_device.type == "cuda":
                        torch.cuda.synchronize(self.trainer_device)
                    t2 = time.monotonic()
                    self._publish(rt, step + 1)
                    t3 = time.monotonic()
                    m.update(wait_s=t1 - t0, train_s=t2 - t1, publish_s=t3 - t2,
                             tokens_per_s=m["tokens"] / max(t3 - t0, 1e-9), producer_idle=producer_idle,
                             trainer_idle=(t1 - t0) / max(t3 - t0, 1e-9), group_ids=[g.group for g in groups],
                             step=step, wall_s=t3 - t_start)
                    log.append(m)
                    emit(m, out, on_step)
                    if until is not None and until(log):
                        return
            except BaseException as e:  # noqa: BLE001 - raised in the caller's thread below
                result["error"] = e

        out = open(log_path, "a") if log_path else None
        producers = [threading.Thread(target=self._producer, args=(i,), name=f"producer{i}", daemon=True)
                     for i in range(cfg.producers)]
        trainer = threading.Thread(target=train, name="trainer", daemon=True)
        try:
            for t in (trainer, *producers):
                t.start()
            trainer.join()
        finally:
            with self.cond:
                self.stopping = True
                self.cond.notify_all()
            if self.warmed is not None:  # a producer still at the barrier (the trainer failed first) ends
                self.warmed.abort()
            for t in producers:
                t.join(cfg.call_timeout_s)
            if out:
                out.close()
        if "error" in result:
            raise result["error"]
        return log

    def stats(self) -> dict:
        with self.cond:
            return self.ledger.stats()
