"""The pipeline's Ray actors: the scheduler (admission, the bounded buffer of generated groups),
rollout producers (an engine adapter, rule rewards) and the trainer (the runtime, weight export)."""
from __future__ import annotations

import asyncio
import time

import ray
import torch

from bumblebee.runtime.pipeline.admission import Ledger
from bumblebee.runtime.pipeline.config import PipelineConfig, PipelineTimeout
from bumblebee.runtime.pipeline.engine import rollout, warm_engine
from bumblebee.runtime.pipeline.samples import Group
from bumblebee.runtime.pipeline.weights import get


def actor_device(gpus: float, option: str) -> torch.device:
    """The device of an actor that asked Ray for `gpus` GPUs (the `option` naming them): the CPU for
    0, else the first GPU Ray assigned (Ray narrows CUDA_VISIBLE_DEVICES to its ids, so that id's
    index among the visible ones), made the current device. A GPU asked of a process whose torch
    sees no CUDA raises."""
    import os
    if not gpus:
        return torch.device("cpu")
    ids = [str(i) for i in ray.get_gpu_ids()]
    if not torch.cuda.is_available() or not ids:
        raise RuntimeError(f"{option}={gpus} asks for a GPU, but torch in this actor sees no CUDA device "
                           f"(Ray assigned GPU ids {ids}, torch.cuda.is_available() = {torch.cuda.is_available()}); "
                           f"set {option}=0 to run on the CPU, or install a CUDA build of torch on the workers")
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    device = torch.device("cuda", visible.index(ids[0]) if ids[0] in visible else int(ids[0]))
    torch.cuda.set_device(device)
    return device


@ray.remote(num_cpus=0)
class Scheduler:
    """Leases prompts to producers under `Admission` and hands each training step its groups."""

    def __init__(self, task, cfg: PipelineConfig):
        self.ledger = Ledger(task, cfg)
        self.changed = asyncio.Event()

    async def admit(self, producer: str, version: int, most: int):
        """`Ledger.admit`."""
        return self.ledger.admit(producer, version, most)

    async def submit(self, producer: str, groups: list[Group], busy_s: float, idle_s: float) -> None:
        self.ledger.submit(producer, groups, busy_s, idle_s)
        self.changed.set()
        self.changed = asyncio.Event()

    async def take(self, ticket: int, timeout_s: float) -> tuple[list[Group], float]:
        """Step `ticket`'s groups, waiting at most `timeout_s`; and the producers' idle fraction."""
        deadline = time.monotonic() + timeout_s
        adm = self.ledger.adm
        while not adm.ready(ticket):
            left = deadline - time.monotonic()
            try:
                await asyncio.wait_for(self.changed.wait(), max(left, 0))
            except asyncio.TimeoutError:
                held = sorted({h for h, lease in adm.leases.values() if lease.ticket == ticket})
                raise PipelineTimeout(
                    f"step {ticket}: {len(adm.done.get(ticket, ()))} of {adm.groups_per_step} groups "
                    f"within {timeout_s:g} s (take_timeout_s); producers holding its prompts: {held}") from None
        return self.ledger.consume(ticket)

    async def release(self, producer: str) -> list[int]:
        return self.ledger.adm.release(producer)

    async def stats(self) -> dict:
        return self.ledger.stats()


@ray.remote
class Producer:
    """Generates groups: asks the scheduler for a lease on the weights it holds, waits for newer
    weights when refused, samples `group_size` completions, scores them, submits the group."""

    def __init__(self, holder: str, engine_factory, task, scheduler, cfg: PipelineConfig):
        torch.set_num_threads(cfg.threads)
        self.holder, self.task, self.scheduler, self.cfg = holder, task, scheduler, cfg
        self.device = actor_device(cfg.producer_gpus, "producer_gpus")
        # on a GPU the factory is told which (transformers' engine takes `device`); on the CPU called bare
        self.engine = engine_factory(device=str(self.device)) if cfg.producer_gpus else engine_factory()
        self.busy_s = self.idle_s = 0.0

    def attach(self, rank: int, channel) -> None:
        """Join the weight channel as `rank` (before `run`)."""
        self.channel = channel
        channel.attach(rank, self.engine)

    def warmup(self) -> None:
        """`PipelineConfig.warmup`: take the first weights, then one throwaway engine call of
        `groups_per_call` prompts (nothing leased, scored or submitted; the engine seeds its own sampler)."""
        cfg = self.cfg
        if not self.channel.refresh(self.engine) and self.engine.version < 0:
            self.channel.wait_newer(self.engine, cfg.weight_timeout_s)
        warm_engine(self.engine, self.task, cfg)

    def _refresh(self) -> None:
        """Load the newest weights if they are newer than the engine's (between chunks, or on wait)."""
        self.channel.refresh(self.engine)

    def run(self) -> dict:
        cfg, call = self.cfg, self.cfg.call_timeout_s
        if not self.channel.refresh(self.engine) and self.engine.version < 0:
            self.channel.wait_newer(self.engine, cfg.weight_timeout_s)
        groups = 0
        while True:
            leases, status = get(self.scheduler.admit.remote(self.holder, self.engine.version, cfg.groups_per_call),
                                 call, "admission")
            if not leases and status == "done":
                return {"groups": groups, "busy_s": self.busy_s, "idle_s": self.idle_s}
            t0 = time.monotonic()
            if not leases:  # the next prompt would be too stale on these weights
                self.channel.wait_newer(self.engine, cfg.weight_timeout_s)
                self.idle_s += time.monotonic() - t0
                continue
            out = rollout(self.engine, self.task, leases, cfg, holder=self.holder,
                          refresh=self._refresh if cfg.sampling.chunk_tokens else None)
            self.busy_s += time.monotonic() - t0
            get(self.scheduler.submit.remote(self.holder, out, self.busy_s, self.idle_s), call, "submitting groups")
            groups += len(out)


@ray.remote
class Trainer:
    """The policy under the runtime (FSDP2 or ZeRO-1 as configured, on the channel's trainer group, a
    one-rank gloo group of the actor's own, or with `cfg.trainer_ranks` > 1 a gloo group over that
    many Trainer actors, this one rank `rank`), one GRPO step per call on the step's groups, then its
    weights published. Rank 0 takes the step's groups and hands them to the others."""

    def __init__(self, model_config: dict, cfg: PipelineConfig, scheduler, pad_id: int, rank: int = 0):
        torch.set_num_threads(cfg.threads)
        self.model_config, self.cfg, self.scheduler, self.pad_id = model_config, cfg, scheduler, pad_id
        self.rank, self.world, self.group = rank, cfg.trainer_ranks, None
        self.device = actor_device(cfg.trainer_gpus, "trainer_gpus")
        self.version = 0

    def address(self) -> str:
        """host:port for the channel's (or the trainer ranks') group: this node's address and a free port."""
        import socket
        with socket.socket() as s:
            s.bind(("", 0))
            return f"{ray.util.get_node_ip_address()}:{s.getsockname()[1]}"

    def attach(self, channel, address: str | None = None) -> None:
        """Join the weight channel (rank 0), or first the trainer ranks' group at `address` (every rank
        at once), then build the policy on the trainer's own group."""
        import torch.distributed as dist

        from bumblebee.runtime.pipeline.trainer import build_runtime, join_trainer_ranks
        self.channel = channel
        if self.world > 1 and self.cfg.weights != "p2p":  # a step's ranks wait on rank 0's take: the limit covers it
            join_trainer_ranks(self.cfg, address, self.rank, self.device)
            self.group = dist.group.WORLD
        else:  # p2p: the channel's group holds the trainer's ranks (a subgroup of their own) and the producers
            channel.attach(self.rank)
            self.group = getattr(self.channel, "trainer_group", None)
        self.rt, self.ref = build_runtime(self.model_config, self.cfg, group=self.group, device=self.device,
                                          ep_mesh=getattr(self.channel, "ep_mesh", None))

    def warmup(self, prompt: list[int]) -> None:
        """`PipelineConfig.warmup`: `trainer.warmup_step` on this rank (every rank at once)."""
        from bumblebee.runtime.pipeline.trainer import collective_limit, warmup_step
        with collective_limit(self.cfg, f"trainer rank {self.rank}, warm-up"):
            warmup_step(self.rt, self.cfg, prompt=prompt, vocab=self.model_config["vocab_size"], pad_id=self.pad_id,
                        ref=self.ref, world=self.world)

    def publish(self, flush: bool = False) -> int:
        """Publish this version (`flush`: and wait until it is in the channel)."""
        if self.world > 1:
            self.channel.publish(self.version, self.rt, rank=self.rank)
        else:
            self.channel.publish(self.version, self.rt)
        return self.flush() if flush else self.version

    def flush(self) -> int:
        """Wait for a publish still in flight (the object store's background put); its error raises here."""
        getattr(self.channel, "flush", lambda: None)()
        return self.version

    def _take(self, ticket: int):
        """The step's groups and the producers' idle fraction: rank 0 asks the scheduler, then hands
        both to the other ranks."""
        import torch.distributed as dist
        cfg, got = self.cfg, [None, None]
        if self.rank == 0:
            got = list(get(self.scheduler.take.remote(ticket, cfg.take_timeout_s),
                           cfg.take_timeout_s + cfg.call_timeout_s, f"step {ticket}'s groups"))
        if self.world > 1:
            dist.broadcast_object_list(got, src=0, group=self.group)
        return got

    def step(self, ticket: int) -> dict:
        from bumblebee.runtime.pipeline.trainer import collective_limit, grpo_step
        if ticket != self.version:
            raise ValueError(f"step {ticket} asked of the trainer at version {self.version}: steps run in order")
        with collective_limit(self.cfg, f"trainer rank {self.rank}, step {ticket}"):
            t0 = time.monotonic()
            groups, producer_idle = self._take(ticket)
            t1 = time.monotonic()
            m = grpo_step(self.rt, groups, self.cfg.objective, version=self.version, pad_id=self.pad_id,
                          ref=self.ref, rank=self.rank, world=self.world, group=self.group)
            self.version += 1
            t2 = time.monotonic()
            self.publish()
            t3 = time.monotonic()
        return {**m, "wait_s": t1 - t0, "train_s": t2 - t1, "publish_s": t3 - t2,
                "tokens_per_s": m["tokens"] / max(t3 - t0, 1e-9), "producer_idle": producer_idle,
                "trainer_idle": (t1 - t0) / max(t3 - t0, 1e-9), "group_ids": [g.group for g in groups]}
