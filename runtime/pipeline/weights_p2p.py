"""The weight-transfer primitive as the pipeline's channel (`PipelineConfig.weights = "p2p"`): one
group spans the trainer's T ranks (ranks 0..T-1) and the producers (ranks T..T+P-1), gloo on CPU
actors, "cpu:gloo,cuda:nccl" on GPU actors (`device_type`: the store and object collectives on gloo,
the CUDA shards over NCCL, from the trainer's GPU into the engine's parameters on the producer's); each
producer has its own `Link` (the trainer's ranks and it) and every trainer rank a sender per link,
in the primitive's async mode: `publish` snapshots the rank's own shards (`export_weight_shards`,
no gather) and returns, a producer's `poll` fetches the newest version all trainer ranks hold into
its engine's parameters, each slice from the rank holding it, in place, as one transaction. The
trainer's FSDP2/ZeRO-1 mesh is a group of its own over its ranks (the primitive's service thread
uses the link's); with `expert_parallel` > 1 its (efsdp, ep) mesh is made of subgroups too, by
every rank of the channel (`trainer.trainer_expert_mesh`), and each rank's shards hold its own experts. A
rank that dies breaks the group: this channel does not survive a producer restart (the
object-store channel does)."""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch

from bumblebee.runtime.pipeline.config import PipelineTimeout


@dataclass
class P2PChannel:
    producers: int
    address: str  # "host:port" of the trainer's rendezvous
    timeout_s: float
    trainers: int = 1  # the trainer's ranks (each sends its own shards)
    trainer_timeout_s: float | None = None  # the trainer ranks' own subgroups' limit (default timeout_s)
    expert_parallel: int = 1  # the trainer's experts split over this many of its ranks (an (efsdp, ep) mesh)
    device_type: str = "cpu"  # "cuda": every rank's runtime or engine is on its actor's current GPU

    def __post_init__(self):
        if self.device_type not in ("cpu", "cuda"):
            raise ValueError(f"device_type must be 'cpu' or 'cuda', got {self.device_type!r}")

    def attach(self, rank: int, engine=None) -> None:
        """Join the group (every rank at once: the driver starts all attaches before waiting): trainer
        rank `rank` without an engine, producer `rank` - 1 (rank >= 1) with its engine."""
        import torch.distributed as dist

        from bumblebee import registry
        from bumblebee.primitives.weight_transfer import Link, P2PTransfer
        t = self.trainers
        trainer_ranks = tuple(range(t))
        if engine is not None and not 1 <= rank <= self.producers:
            raise ValueError(f"a producer attaches as rank 1..{self.producers}, got {rank}")
        if engine is None and not 0 <= rank < t:
            raise ValueError(f"a trainer rank attaches as 0..{t - 1}, got {rank}")
        me = rank if engine is None else t + rank - 1
        backend, device = "gloo", None
        if self.device_type == "cuda":
            # the actor's GPU (Ray narrows CUDA_VISIBLE_DEVICES: cuda:0 there); bound to the group, its
            # NCCL communicators start eagerly, so a link's first p2p round needs no all-rank call
            backend, device = "cpu:gloo,cuda:nccl", torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=f"tcp://{self.address}", rank=me, device_id=device,
                                world_size=t + self.producers, timeout=datetime.timedelta(seconds=self.timeout_s))
        limit = datetime.timedelta(seconds=self.trainer_timeout_s or self.timeout_s)
        # every rank makes every group, in one order; new_group without a backend takes the default's
        self.trainer_group = dist.new_group(list(trainer_ranks), timeout=limit)
        self.ep_mesh = None  # the trainer ranks' (efsdp, ep) mesh; None on producers and without EP
        if self.expert_parallel > 1:
            from bumblebee.runtime.pipeline.trainer import trainer_expert_mesh
            self.ep_mesh = trainer_expert_mesh(t, self.expert_parallel, timeout=limit, device_type=self.device_type)
        # the links' groups wait as long as the transfer does (new_group's default is 30 minutes)
        groups = {i: dist.new_group([*trainer_ranks, t + i - 1], timeout=datetime.timedelta(seconds=self.timeout_s))
                  for i in range(1, self.producers + 1)}
        transfer = registry.resolve("weight_transfer", P2PTransfer(mode="async", timeout_s=self.timeout_s))
        links = {i: Link(trainer_ranks, (t + i - 1,), group=g, name=f"producer{i}") for i, g in groups.items()}
        if engine is None:
            self.senders = [transfer(link) for link in links.values()]
        else:
            load, targets = engine.weight_targets()
            self.receiver = transfer(links[rank], load_weights=load, targets=targets)

    def publish(self, version: int, runtime, rank: int = 0) -> None:
        """Every trainer rank calls it with its own shards (no collective), on the runtime's device."""
        shards = list(runtime.export_weight_shards(dtype=torch.float32))
        for sender in self.senders:
            sender.publish(shards, version)

    def refresh(self, engine) -> bool:
        version = self.receiver.poll()
        if version is None:
            return False
        engine.version = version
        return True

    def wait_newer(self, engine, timeout_s: float) -> int:
        """The receiver's poll waits in the store, woken by the trainer's next publish: no poll interval."""
        start = engine.version
        version = self.receiver.poll(wait_s=timeout_s)
        if version is None:
            raise PipelineTimeout(f"no weights newer than version {start} within {timeout_s:g} s "
                                  f"(weight_timeout_s): the trainer stalled or died")
        engine.version = version
        return version
