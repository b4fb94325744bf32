"""What both weight-transfer twins take and raise: the `Link` between trainer and rollout ranks,
and the errors of an update that did not commit."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    """Who takes part: global ranks of the trainer and of the rollout engine, the process group
    spanning them (None: the default group), the key-value store for control messages (None: the
    default group's), a name that keeps several links apart in that store, and `vote_group`: a group
    over the same ranks with a CPU backend (gloo) for `P2PTransfer(agreement="group")`'s host-side
    votes (None: `group`, which then needs one, as `init_process_group("cpu:gloo,cuda:nccl")` gives)."""
    trainer_ranks: tuple
    rollout_ranks: tuple
    group: object = None
    store: object = None
    name: str = "weights"
    vote_group: object = None

    def __post_init__(self):
        t, r = tuple(self.trainer_ranks), tuple(self.rollout_ranks)
        if not t or not r or set(t) & set(r) or len(set(t)) != len(t) or len(set(r)) != len(r):
            raise ValueError(f"Link needs disjoint, non-empty trainer_ranks and rollout_ranks; got {t} and {r}")
        object.__setattr__(self, "trainer_ranks", t)
        object.__setattr__(self, "rollout_ranks", r)


class TransferError(RuntimeError):
    """An update that did not commit: every receiver kept its previous weights (p2p)."""


class TransferInFlight(TransferError):
    """An update started on an endpoint while another one is in flight."""
