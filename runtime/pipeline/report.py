"""The per-step report of both drivers (Ray's and the local one): the progress line and the JSONL row."""
from __future__ import annotations

import json

PROGRESS = ("step {step} v{version} reward {reward:.3f} behave_kl {behave_kl:.4f} staleness {staleness_mean:.2f}"
            "/{staleness_max} tokens/s {tokens_per_s:.0f} idle producers {producer_idle:.2f} "
            "trainer {trainer_idle:.2f}")


def emit(m: dict, out, on_step) -> None:
    """Append step metrics `m` to the open JSONL file `out` (or None) and pass the progress line to
    `on_step` (or None)."""
    if out:
        out.write(json.dumps(m) + "\n")
        out.flush()
    if on_step:
        on_step(PROGRESS.format(**m))
