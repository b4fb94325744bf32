"""Weight transfer by gather + broadcast (the `broadcast` twin of `p2p`): the anchor of every bytes
and time figure, as vLLM's nccl weight sync, checkpoint-engine and verl's nccl engine do it.

For every HF tensor, in the senders' order: the first trainer rank assembles the full tensor from
every trainer rank's shards (its own, then each other rank's, point to point), broadcasts it over
the link's group, and each rollout rank hands it to the engine's `load_weights`, which slices what
it keeps. Every rollout rank receives the whole model; nothing is staged, so a failure partway
leaves the engine with a mix of versions. Sync only.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from bumblebee.common.weight_transfer import Link, TransferError, TransferInFlight
from bumblebee.registry import register


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


class _End:
    def __init__(self, link: Link):
        self.link, self.rank = link, dist.get_rank()
        self.root = link.trainer_ranks[0]
        self.layout = None  # [(name, shape, dtype name, [(rank, offsets, local shape)])]
        self.version = None
        self.busy = False
        self.stats = {"bytes_sent": 0, "bytes_received": 0, "staged_bytes": 0}

    def _run(self, shards, version):
        if self.busy:
            raise TransferInFlight("an update is already in flight on this endpoint")
        self.busy = True
        try:
            return self._update(shards, version)
        finally:
            self.busy = False

    def _update(self, shards, version):
        g = self.link.group
        mine = [(s.name, tuple(s.shape), str(s.tensor.dtype).removeprefix("torch."), tuple(s.offsets),
                 tuple(s.tensor.shape), bool(s.replicated)) for s in shards] if shards is not None else None
        if self.layout is None:  # who holds what: once, from every rank of the link
            everyone = [None] * dist.get_world_size(g)
            dist.all_gather_object(everyone, (self.rank, mine), group=g)
            layout: dict = {}
            for rank, held in everyone:
                for name, shape, dt, offsets, local, replicated in held or ():
                    entry = layout.setdefault(name, (shape, dt, []))
                    if (shape, dt) != entry[:2]:
                        raise TransferError(f"senders disagree on {name!r}: {entry[:2]} vs {(shape, dt)}")
                    entry[2].append((rank, offsets, local))
            self.layout = []
            for name, (shape, dt, held) in layout.items():  # one holder per box: the root if it has it
                chosen: dict = {}
                for rank, offsets, local in sorted(held, key=lambda h: (h[0] != self.root, h[0])):
                    chosen.setdefault((offsets, local), rank)
                self.layout.append((name, shape, dt, [(r, o, n) for (o, n), r in chosen.items()]))
        box = [version]
        dist.broadcast_object_list(box, src=self.root, group=g)
        local = {(s.name, tuple(s.offsets)): s.tensor for s in shards} if shards is not None else {}
        self.device = next(iter(local.values())).device if local else self._device()
        for name, shape, dt, holders in self.layout:
            full = torch.empty(shape, dtype=_dtype(dt), device=self.device)
            for rank, offsets, size in holders:  # gather on the root
                region = full[tuple(slice(o, o + n) for o, n in zip(offsets, size))]
                if rank == self.root == self.rank:
                    region.copy_(local[(name, offsets)])
                elif rank == self.rank:
                    dist.send(local[(name, offsets)].contiguous(), self.root, group=g)
                elif self.rank == self.root:
                    buf = torch.empty(size, dtype=full.dtype, device=full.device)
                    dist.recv(buf, rank, group=g)
                    region.copy_(buf)
            dist.broadcast(full, src=self.root, group=g)
            self._got(name, full)
        self.version = box[0]
        return self.version

    def _device(self):
        return torch.device("cpu")

    def _got(self, name, full):
        pass


class BroadcastSender(_End):
    def update(self, shards, version: int, timeout_s: float | None = None) -> int:
        shards = list(shards)  # timeout_s: p2p's; collectives here wait the process group's timeout
        out = self._run(shards, version)
        if self.rank == self.root:
            self.stats["bytes_sent"] = sum(_dtype(d).itemsize * torch.Size(s).numel()
                                           for _, s, d, _ in self.layout) * len(self.link.rollout_ranks)
        return out

    def publish(self, shards, version: int):
        raise NotImplementedError("the broadcast twin is sync only: use update()")


class BroadcastReceiver(_End):
    def __init__(self, link, load_weights, targets):
        super().__init__(link)
        self.load_weights, self.targets = load_weights, dict(targets)

    def _device(self):
        return next(iter(self.targets.values())).device if self.targets else torch.device("cpu")

    @torch.no_grad()
    def _got(self, name, full):
        self.load_weights(iter([(name, full)]))
        self.stats["bytes_received"] += full.numel() * full.element_size()

    def update(self, timeout_s: float | None = None) -> int:
        self.stats["bytes_received"] = 0
        return self._run(None, None)

    def poll(self):
        raise NotImplementedError("the broadcast twin is sync only: use update()")


@register("weight_transfer", "broadcast", kind="baseline", twin="p2p")
def broadcast(link: Link, *, load_weights=None, targets=None, layout_key: str = "", cache=None, layout=None):
    """Gather each full tensor on the first trainer rank and broadcast it to every rollout rank,
    whose `load_weights` slices what it keeps (`layout_key`, `cache` and `layout` are p2p's, unused
    here)."""
    if dist.get_rank() in link.trainer_ranks:
        return BroadcastSender(link)
    if load_weights is None or targets is None:
        raise ValueError("a rollout rank's endpoint needs load_weights and targets")
    return BroadcastReceiver(link, load_weights, targets)
