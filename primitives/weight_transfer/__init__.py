"""Weight transfer from trainer ranks to rollout ranks across different shardings (slot
`weight_transfer`, primitive `p2p`, twin `broadcast`).

The receiver's layout is inferred from the engine's own `load_weights` (`infer.py`), the sender's
comes from `export_weight_shards` without a gather (`spec.py`), the planner moves only the slices
each receiver keeps, each from one sender (`plan.py`), and every update is a transaction over
point-to-point rounds (`execute.py`, agreed through the store by `control.py`; `endpoints.py`). Usage: skills/weight-transfer/SKILL.md.

    transfer = registry.resolve("weight_transfer", "p2p")        # or P2PTransfer(mode="async")
    end = transfer(link)                                         # a trainer rank: a WeightSender
    end = transfer(link, load_weights=engine.load_weights, targets=dict(engine.named_parameters()))
"""
from __future__ import annotations

from dataclasses import dataclass

from bumblebee.common.weight_transfer import Link, TransferError, TransferInFlight
from bumblebee.options import check_bool, check_choice, check_int, option
from bumblebee.primitives.weight_transfer.endpoints import WeightReceiver, WeightSender
from bumblebee.primitives.weight_transfer.execute import COMMITS
from bumblebee.primitives.weight_transfer.infer import LayoutCache, LayoutError, check, infer_layout
from bumblebee.primitives.weight_transfer.plan import HEADER_BYTES, Plan, make_plan
from bumblebee.registry import register

__all__ = ["P2PTransfer", "Link", "WeightSender", "WeightReceiver", "TransferError", "TransferInFlight",
           "LayoutCache", "LayoutError", "infer_layout", "check", "make_plan", "Plan", "HEADER_BYTES", "p2p"]


@dataclass(frozen=True)
class P2PTransfer:
    """Options of p2p: `registry.resolve("weight_transfer", P2PTransfer(mode="async"))`, or the
    string "p2p:mode=async,budget_bytes=64MiB"."""

    impl_name = "p2p"
    mode: str = option("sync", "sync: sender.update / receiver.update meet like a collective; async: "
                       "sender.publish snapshots and returns, the rollout polls for the newest version")
    budget_bytes: int = option(256 << 20, "the most bytes one rank sends plus receives in one round "
                               "(transient buffers; the transactional staging is apart)")
    send_buffers: int = option(2, "round buffers a sender packs into, in turn: 2 packs round r + 1 while round r "
                               "is on the wire (one more budget of sender memory); 1 packs and sends in turn")
    timeout_s: float = option(60.0, "how long any rank waits for a peer's bytes or vote before raising")
    transactional: bool = option(True, "an update that fails leaves every receiver on its previous version "
                                 "(costs the receiver's update bytes, see commit); False writes each round as it lands")
    commit: str = option("stage", "how a transactional receiver keeps its guarantee: stage receives the whole "
                         "update apart and copies it in after the vote (a copy after the wire); undo backs up "
                         "what the update writes (on a side stream while round 0 is on the wire), writes each "
                         "round in place as it lands, and copies the backup back if the vote fails; undo_ahead "
                         "is undo with the backup taken right after the previous update, off the update's path "
                         "(the targets must change only through this transfer in between: one swapped or "
                         "written through a torch op is backed up in the window again; a write through .data "
                         "or outside torch is not seen)")
    agreement: str = option("store", "how the ranks agree before and after an update's bytes: store (the process "
                            "group's key-value store, round trips) or group (one all-gather on the host over "
                            "Link.vote_group, a gloo group over the link's ranks, or the link's group where it has a CPU "
                            "backend; the store only carries a failure's messages, so no keys on a good update; no faster; "
                            "async: no other collective may run on the vote group while an update does); both raise on "
                            "every rank within timeout_s")
    verify: bool = option(True, "check an inferred layout against a real load_weights call on random "
                          "tensors (one extra call; a cached layout is always checked)")
    poll_s: float = option(0.005, "the longest pause between store checks, only where the store cannot be "
                           "cloned per thread; otherwise every wait is the store's own, woken by the key")

    def __post_init__(self):
        check_choice(self, "mode", ("sync", "async"))
        check_int(self, "budget_bytes", 16)
        if isinstance(self.send_buffers, bool) or self.send_buffers not in (1, 2):
            raise ValueError(f"P2PTransfer.send_buffers must be 1 or 2; got {self.send_buffers!r}")
        check_bool(self, "transactional")
        check_choice(self, "commit", COMMITS)
        check_choice(self, "agreement", ("store", "group"))
        check_bool(self, "verify")
        for name in ("timeout_s", "poll_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"P2PTransfer.{name} must be a number > 0; got {value!r}")


@register("weight_transfer", "p2p", kind="primitive", twin="broadcast", default=True, config=P2PTransfer)
def p2p(config: P2PTransfer, link: Link, *, load_weights=None, targets=None, layout_key: str = "", cache=None,
        layout=None):
    """Point-to-point weight transfer: only the slices each rollout rank keeps, each sent once.

    This rank's end of `link`: a `WeightSender` on a trainer rank, a `WeightReceiver` (which needs
    the engine's `load_weights` and the `targets` it writes) on a rollout rank. `layout_key` names
    what decides the receiver's layout beyond its tensors' shapes (its TP/EP rank): the cache key;
    `cache`: a `LayoutCache` that outlives this endpoint (a reconnect then costs one check call);
    `layout`: manifest -> ReceiverSpec, a layout known in advance, checked by one real load_weights
    call instead of probed (what a 30B-scale engine wants: probing is minutes of host work)."""
    import torch.distributed as dist
    if dist.get_rank() in link.trainer_ranks:
        return WeightSender(config, link)
    if load_weights is None or targets is None:
        raise ValueError("a rollout rank's endpoint needs load_weights and targets")
    return WeightReceiver(config, link, load_weights, targets, layout_key=layout_key, cache=cache, layout=layout)
