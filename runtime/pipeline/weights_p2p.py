"""The weight-transfer primitive as the pipeline's channel (`PipelineConfig.weights = "p2p"`): one
gloo group spans the trainer (rank 0) and the producers (ranks 1..P); each producer has its own
`Link` (its own two-rank group) and the trainer a sender per link, in the primitive's async mode:
`publish` snapshots the trainer's shards (`export_weight_shards`, no gather) and returns, a
producer's `poll` fetches the newest version into its engine's parameters, in place, as one
transaction. The trainer's FSDP2/ZeRO-1 mesh is a group of its own (the primitive's service thread
uses the link's). A rank that dies breaks the group: this channel does not survive a producer
restart (the object-store channel does)."""
from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import torch

from bumblebee.runtime.pipeline.config import PipelineTimeout


@dataclass
class P2PChannel:
    producers: int
    address: str  # "host:port" of the trainer's rendezvous
    timeout_s: float
    poll_s: float = 0.02  # the producers' poll interval while they wait for a newer version

    def attach(self, rank: int, engine=None) -> None:
        """Join the group (every rank at once: the driver starts all attaches before waiting)."""
        import torch.distributed as dist

        from bumblebee import registry
        from bumblebee.primitives.weight_transfer import Link, P2PTransfer
        dist.init_process_group("gloo", init_method=f"tcp://{self.address}", rank=rank,
                                world_size=self.producers + 1, timeout=datetime.timedelta(seconds=self.timeout_s))
        self.trainer_group = dist.new_group([0])  # every rank creates every group, in one order
        groups = {i: dist.new_group([0, i]) for i in range(1, self.producers + 1)}
        transfer = registry.resolve("weight_transfer", P2PTransfer(mode="async", timeout_s=self.timeout_s))
        links = {i: Link((0,), (i,), group=g, name=f"producer{i}") for i, g in groups.items()}
        if rank == 0:
            self.senders = [transfer(link) for link in links.values()]
        else:
            load, targets = engine.weight_targets()
            self.receiver = transfer(links[rank], load_weights=load, targets=targets)

    def publish(self, version: int, runtime) -> None:
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
        start, deadline = engine.version, time.monotonic() + timeout_s
        while not self.refresh(engine):
            if time.monotonic() > deadline:
                raise PipelineTimeout(f"no weights newer than version {start} within {timeout_s:g} s "
                                      f"(weight_timeout_s): the trainer stalled or died")
            time.sleep(self.poll_s)
        return engine.version
