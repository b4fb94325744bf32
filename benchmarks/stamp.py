"""What every result file records about the run that wrote it: code, tree state, versions, device, date.

    from stamp import stamp
    result = {**stamp(), "rows": rows}   # read back by `bumblebee results`
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def _git(*args: str) -> str | None:
    try:
        proc = subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def commit() -> dict:
    """{"commit", "dirty"}: BENCH_COMMIT when the launcher sets it (a copy of the tree sent to another
    machine may carry stale git metadata, so its git state says nothing: dirty is None), else git's
    HEAD and whether tracked files differ from it (None when git cannot tell)."""
    if os.environ.get("BENCH_COMMIT"):
        return {"commit": os.environ["BENCH_COMMIT"], "dirty": None}
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": _git("rev-parse", "HEAD"), "dirty": None if status is None else bool(status)}


def _triton() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def device_name(device=None) -> str:
    """The accelerator's name ("NVIDIA H200"), or "cpu"."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def stamp(device=None) -> dict:
    """{"commit", "dirty", "torch", "triton", "cuda", "device", "date"} of this run."""
    return {**commit(), "torch": torch.__version__, "triton": _triton(), "cuda": torch.version.cuda,
            "device": device_name(device),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def print_stamp(**extra) -> None:
    """A probe's first output line: this run's stamp (on rank 0 of a torchrun launch), so the JSON lines
    it prints into a results file carry the commit that ran them (`bumblebee results` reads a .jsonl
    file's stamp from its first line)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({**stamp(), **extra}), flush=True)
