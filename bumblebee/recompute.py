"""Which pass of a full-recompute region runs now, for layers that keep less when they know it.

The models' recompute wrapper runs every checkpointed layer as
`torch.utils.checkpoint(layer, ..., use_reentrant=False, context_fn=recompute.contexts)`, so inside
the layer `phase()` is "forward" during its first forward, "recompute" while autograd recomputes it
for the backward, and None outside any such region. A layer may then save other tensors in both
passes (they must match: checkpoint compares them) and skip, in the recompute, work whose result
nothing saved depends on; its output there is discarded, so it must feed nothing that saves
tensors. The chunked expert-parallel dispatch uses this to skip fc2 and the combine; MLA's lean
backward to cache its attention outputs in the recompute instead of the first forward.

`region()` is the running region's `Handover`: values its first forward keeps for its recompute, taken
back in the same order (the attention slot keeps its output there, so the recompute skips attention).
`keep_through` is that decision, shared by the slots that keep an output (attention, DeltaNet's rule).

The bytes kept at once are counted per model and slot: a model owns one `Kept` (its decoder stack's
`kept`) and hands it to each of its regions (`contexts(kept)`), so two models in one process (a
policy and its reference, the two sides of a pairing) never spend each other's budget; the limits
are each slot's typed options (`recompute_keep_bytes`).
"""
from __future__ import annotations

import threading

_STATE = threading.local()  # the recompute runs in autograd's thread: the phase is per thread


def phase() -> str | None:
    return getattr(_STATE, "phase", None)


def region() -> "Handover | None":
    return getattr(_STATE, "region", None)


class KeptBudget:
    """Bytes one model keeps through its recompute for one slot, not yet released by their backward."""

    def __init__(self):
        self.live = 0

    def reserve(self, nbytes: int, limit: int) -> bool:
        if self.live + nbytes > limit:
            return False
        self.live += nbytes
        return True

    def release(self, nbytes: int) -> None:
        self.live -= nbytes


class Kept:
    """A model's budgets of bytes kept through its full recompute, one per slot (`budget(slot)`)."""

    def __init__(self):
        self.slots: dict[str, KeptBudget] = {}

    def budget(self, slot: str) -> KeptBudget:
        return self.slots.setdefault(slot, KeptBudget())

    def live(self) -> int:
        return sum(b.live for b in self.slots.values())


class Handover:
    """What one checkpointed region's first forward hands to its recompute: `keep` in call order there,
    `take` in the same order in the recompute. A taken value is dropped here (its consumer holds it),
    so a second recompute of the same region (a backward through a retained graph) finds nothing.
    `kept`: the budgets of the model the region belongs to (a region of no model counts its own)."""

    def __init__(self, kept: Kept | None = None):
        self._kept, self._next = [], 0
        self.kept = Kept() if kept is None else kept

    def keep(self, value) -> None:
        self._kept.append(value)

    def take(self):
        if self._next >= len(self._kept):
            raise RuntimeError("a recomputed layer asked for a value its first forward did not keep, or asked "
                               "twice: a backward through a retained graph of a full-recompute layer that keeps "
                               "attention outputs is not supported (turn the attention option off for it)")
        value, self._kept[self._next] = self._kept[self._next], None
        self._next += 1
        return value


class _Pass:
    """One pass's context: sets the phase and the region's handover, restores both on exit. A class,
    not a generator, so a second backward through a retained graph can enter it again."""

    def __init__(self, name: str, handover: "Handover | None" = None):
        self.name, self.handover, self._prev = name, handover, []

    def __enter__(self):
        self._prev.append((phase(), region()))
        _STATE.phase, _STATE.region = self.name, self.handover
        return self

    def __exit__(self, *exc):
        _STATE.phase, _STATE.region = self._prev.pop()
        return False


def keep_through(plain, choose, first, again):
    """Inside a region: the first forward keeps an output for the recompute when `choose()` gives a kernel
    (it has reserved the bytes), and the recompute takes it instead of running the work again; else both
    passes run `plain()` (they must save the same tensors: the recompute follows what its first forward
    handed over). first(kernel) -> the kept output; again(kernel, out) -> the recompute's output."""
    handover = region()
    if phase() == "recompute":
        plan = handover.take()
        return plain() if plan is None else again(plan["kernel"], plan["out"])
    kernel = choose()
    if kernel is None:
        handover.keep(None)
        return plain()
    out = first(kernel)
    handover.keep({"kernel": kernel, "out": out.detach()})  # no grad_fn: no cycle through the graph
    return out


def budget(slot: str) -> KeptBudget:
    """The running region's model's budget of kept bytes for `slot` (inside a region only)."""
    return region().kept.budget(slot)


def contexts(kept: Kept | None = None):
    """checkpoint's `context_fn` (with a model's budgets: `functools.partial(contexts, model_kept)`):
    (the first forward's context, the recompute's context), sharing one `Handover`."""
    handover = Handover(kept)
    return _Pass("forward", handover), _Pass("recompute", handover)
