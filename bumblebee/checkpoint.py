"""Reshardable DCP checkpoints written aside, then renamed into place.

    save(state_dict, path, meta=..., group=...)   # every rank calls it
    load(state_dict, path, meta=...)              # in place; DCP reshards DTensors as needed

Layout: `path/` holds DCP's `.metadata` and `__*_*.distcp` files plus `bumblebee_checkpoint.json`
(who wrote it: parameter names and full shapes, world size, twin). The json is written last, after
every rank's DCP files, into `.<name>.partial/`; rank 0 then swaps that folder into `path`. A crash
before the swap leaves the previous checkpoint at `path` untouched; a crash between the two renames
of the swap leaves it at `.<name>.old/`, which `load` falls back to. A folder without the json is a
half-written checkpoint and is refused with a ValueError, as is a checkpoint of another model.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

MARKER = "bumblebee_checkpoint.json"


def _aside(path: Path, what: str) -> Path:
    return path.parent / f".{path.name}.{what}"


def _barrier(group) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def _rank(group) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def _commit(tmp: Path, path: Path) -> None:
    """Swap the finished folder `tmp` into `path` (rank 0 only)."""
    old = _aside(path, "old")
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        os.rename(path, old)  # until the next rename, the previous checkpoint sits at `old`
    os.rename(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def save(state_dict: dict, path, *, meta: dict, group=None) -> None:
    path = Path(path).absolute()
    tmp = _aside(path, "partial")
    if _rank(group) == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # debris of an earlier interrupted save
        tmp.mkdir(parents=True)
    _barrier(group)
    dcp.save(state_dict, checkpoint_id=str(tmp), process_group=group)
    _barrier(group)  # every rank's files are on disk
    error = None
    if _rank(group) == 0:
        try:
            with open(tmp / MARKER, "w") as f:
                json.dump(meta, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            _commit(tmp, path)
        except Exception as e:  # noqa: BLE001  (re-raised below on every rank, after the barrier)
            error = e
    _barrier(group)
    if error is not None:
        raise error


def resolve(path) -> Path:
    """The folder holding a complete checkpoint for `path`, or a ValueError saying why none does."""
    path = Path(path).absolute()
    if (path / MARKER).is_file():
        return path
    old = _aside(path, "old")
    if not path.exists() and (old / MARKER).is_file():
        return old  # a save was interrupted between its two renames
    if path.exists():
        raise ValueError(f"checkpoint {path} is incomplete: it has no {MARKER} (a save was interrupted "
                         f"or the folder was not written by bumblebee.checkpoint)")
    raise FileNotFoundError(f"no checkpoint at {path}")


def read_meta(path) -> dict:
    with open(resolve(path) / MARKER) as f:
        return json.load(f)


def check_compatible(saved: dict, ours: dict, path) -> None:
    """ValueError naming both sides when the checkpoint's parameters differ from ours."""
    a, b = saved.get("params", {}), ours.get("params", {})
    if a == b:
        return
    only_saved = sorted(set(a) - set(b))
    only_ours = sorted(set(b) - set(a))
    shapes = [f"{k}: checkpoint {a[k]} vs model {b[k]}" for k in sorted(set(a) & set(b)) if a[k] != b[k]]
    raise ValueError(
        f"checkpoint {path} (model_type {saved.get('model_type')!r}, {len(a)} parameters) does not match "
        f"this model (model_type {ours.get('model_type')!r}, {len(b)} parameters): "
        f"only in the checkpoint {only_saved[:3]}, only in the model {only_ours[:3]}, shapes differ {shapes[:3]}")


def load(state_dict: dict, path, *, meta: dict, group=None) -> dict:
    """Load `path` into `state_dict` in place (after checking it belongs to this model)."""
    where = resolve(path)
    saved = read_meta(where)
    check_compatible(saved, meta, where)
    dcp.load(state_dict, checkpoint_id=str(where), process_group=group)
    return saved
