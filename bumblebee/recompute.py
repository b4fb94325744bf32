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
"""
from __future__ import annotations

import threading

_STATE = threading.local()  # the recompute runs in autograd's thread: the phase is per thread


def phase() -> str | None:
    return getattr(_STATE, "phase", None)


def region() -> "Handover | None":
    return getattr(_STATE, "region", None)


class Handover:
    """What one checkpointed region's first forward hands to its recompute: `keep` in call order there,
    `take` in the same order in the recompute. A taken value is dropped here (its consumer holds it),
    so a second recompute of the same region (a backward through a retained graph) finds nothing."""

    def __init__(self):
        self._kept, self._next = [], 0

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


def contexts():
    """checkpoint's `context_fn`: (the first forward's context, the recompute's context), sharing
    one `Handover`."""
    handover = Handover()
    return _Pass("forward", handover), _Pass("recompute", handover)
