"""Which pass of a full-recompute region runs now, for layers that keep less when they know it.

The models' recompute wrapper runs every checkpointed layer as
`torch.utils.checkpoint(layer, ..., use_reentrant=False, context_fn=recompute.contexts)`, so inside
the layer `phase()` is "forward" during its first forward, "recompute" while autograd recomputes it
for the backward, and None outside any such region. A layer may then save other tensors in both
passes (they must match: checkpoint compares them) and skip, in the recompute, work whose result
nothing saved depends on; its output there is discarded, so it must feed nothing that saves
tensors. The chunked expert-parallel dispatch uses this to skip fc2 and the combine; MLA's lean
backward to cache its attention outputs in the recompute instead of the first forward.
"""
from __future__ import annotations

import contextlib
import threading

_STATE = threading.local()  # the recompute runs in autograd's thread: the phase is per thread


def phase() -> str | None:
    return getattr(_STATE, "phase", None)


@contextlib.contextmanager
def _running(name: str):
    prev = phase()
    _STATE.phase = name
    try:
        yield
    finally:
        _STATE.phase = prev


def contexts():
    """checkpoint's `context_fn`: (the first forward's context, the recompute's context)."""
    return _running("forward"), _running("recompute")
