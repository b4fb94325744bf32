"""Reshardable DCP checkpoints: each save in a fresh data folder, made current by one atomic rename.

    save(state_dict, path, meta=..., group=...)   # every rank calls it
    load(state_dict, path, meta=...)              # in place; DCP reshards DTensors as needed

Layout: `path/bumblebee_checkpoint.json` says who wrote the checkpoint (parameter names and full
shapes, world size, twin, and under `impl_configs` the model's resolved slot configs: a record, not
checked on load, since either twin loads the other's checkpoint) and, under `data`, which sub-folder
`dcp-<id>/` holds DCP's `.metadata` and `__*_*.distcp` files. A save writes a new data folder, then
replaces the json (write aside, fsync, rename: the commit), then removes the data folder the
previous json named. A crash before the commit leaves the previous checkpoint current; a crash after
it leaves the new one current and the old data folder listed under `stale` for the next save to
remove. Nothing else in `path` is touched, so a checkpoint may share its folder with other files. A
folder without the json is refused with a ValueError, as is a checkpoint of another model.
Checkpoints of the earlier layout (DCP files directly in `path`) still load; a save over one removes
exactly the files its `.metadata` names.

A save holds the folder's writer lock on rank 0 from before its data folder is made until after the
commit (a second save into the folder is refused on every rank; a killed writer's lock goes with
it), and first removes what killed saves left there: `dcp-*` folders the json does not name (holding
only DCP's files and ours) and temporary copies of the json. The data folder holds
`integrity.MANIFEST`, the sha256 of every tensor chunk's bytes; a load checks it (every rank a share)
before DCP reads a byte, and `check_finite=True` refuses NaN or inf in what was loaded.
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
from contextlib import ExitStack
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from bumblebee import files, integrity
from bumblebee.distributed import on_rank0

MARKER = "bumblebee_checkpoint.json"
DATA = re.compile(r"dcp-[0-9a-f]{12}")
OLD_LAYOUT = re.compile(r"\.metadata|__\d+_\d+\.distcp")  # DCP's files directly in `path` (earlier saves)
# what a data folder may hold (DCP's files, their temporary names, our manifest): a dcp-* folder
# holding anything else is not removed as a leftover
DATA_FILES = re.compile(r"(__\d+)?\.metadata(\.tmp)?|__\d+_\d+\.distcp|" + re.escape(integrity.MANIFEST)
                        + "|" + files.aside_pattern(re.escape(integrity.MANIFEST)))


def _aside(path: Path, what: str) -> Path:
    return path.parent / f".{path.name}.{what}"


def _rank(group) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def _new_data_folder(path: Path, lock: ExitStack) -> str:
    """(rank 0) The writer lock, entered into `lock`; leftovers of killed saves removed; a fresh data folder."""
    files.prepare_folder(path, "checkpoint path")
    lock.enter_context(files.writer_lock(path, "checkpoint path"))
    remove_leftovers(path)
    name = f"dcp-{secrets.token_hex(6)}"
    (path / name).mkdir()
    return name


def remove_leftovers(path: Path) -> list[str]:
    """Remove from `path` what killed saves left: `dcp-*` folders that the checkpoint json does not
    name and that hold only DCP's files and ours, and temporary copies of the json. Call it holding
    the writer lock. Returns the names removed; nothing when the json is unreadable (its data unknown)."""
    marker = path / MARKER
    meta = files.read_json(marker)
    if marker.exists() and not isinstance(meta, dict):
        return []
    current = meta.get("data") if isinstance(meta, dict) else None
    gone = []
    for entry in sorted(path.iterdir()):
        if (DATA.fullmatch(entry.name) and entry.name != current and entry.is_dir() and not entry.is_symlink()
                and all(DATA_FILES.fullmatch(f.name) and f.is_file() for f in entry.iterdir())):
            shutil.rmtree(entry, ignore_errors=True)
            gone.append(entry.name)
    return gone + files.remove_leftovers(path, files.aside_pattern(re.escape(MARKER)))


def save(state_dict: dict, path, *, meta: dict, group=None) -> None:
    path = Path(path).absolute()
    with ExitStack() as lock:  # rank 0's writer lock, held until the commit is done
        name = on_rank0(lambda: _new_data_folder(path, lock), group)
        try:
            dcp.save(state_dict, checkpoint_id=str(path / name), process_group=group)
            if dist.is_initialized():
                dist.barrier(group=group)  # every rank's files are on disk
            manifest = integrity.dcp_manifest(path / name, group)
        except BaseException:
            if _rank(group) == 0:
                shutil.rmtree(path / name, ignore_errors=True)  # ours, created above, named by no json yet
            raise
        on_rank0(lambda: _commit(path, name, meta, manifest), group)


def _commit(path: Path, name: str, meta: dict, manifest: dict) -> None:
    """Make `path/name` current (rank 0), then remove the data of the checkpoint it replaces."""
    try:
        os.replace(files.write_json_aside(path / name, integrity.MANIFEST, manifest), path / name / integrity.MANIFEST)
        stale = _stale(path) - {name}
        tmp = files.write_json_aside(path, MARKER, {**meta, "data": name, "stale": sorted(stale)})
    except BaseException:
        shutil.rmtree(path / name, ignore_errors=True)
        raise
    os.replace(tmp, path / MARKER)  # the commit
    files.fsync_dir(path)
    for entry in sorted(stale):
        if (path / entry).is_dir():
            shutil.rmtree(path / entry, ignore_errors=True)
        else:
            (path / entry).unlink(missing_ok=True)


def _stale(path: Path) -> set[str]:
    """Entries of `path` that the current checkpoint's json names as its own (its data folder, or its
    DCP files in the earlier layout) and that a new save replaces, plus the leftovers it lists."""
    meta = files.read_json(path / MARKER)
    if not isinstance(meta, dict):
        return set()
    names = set(n for n in meta.get("stale", []) if isinstance(n, str))
    if isinstance(meta.get("data"), str):
        names.add(meta["data"])
    elif (path / ".metadata").is_file():  # the earlier layout: exactly the files DCP's metadata names
        try:
            md = FileSystemReader(str(path)).read_metadata()
            names |= {".metadata"} | {info.relative_path for info in md.storage_data.values()}
        except Exception:  # noqa: BLE001  (unreadable: remove nothing)
            pass
    return {n for n in names if (DATA.fullmatch(n) or OLD_LAYOUT.fullmatch(n)) and (path / n).exists()}


def resolve(path) -> Path:
    """The folder holding a complete checkpoint's json for `path`, or a ValueError saying why none does."""
    path = Path(path).absolute()
    if (path / MARKER).is_file():
        return path
    old = _aside(path, "old")
    if not path.exists() and (old / MARKER).is_file():
        return old  # an earlier version's save was interrupted between its two renames
    if path.exists():
        raise ValueError(f"checkpoint {path} is incomplete: it has no {MARKER} (a save was interrupted "
                         f"or the folder was not written by bumblebee.checkpoint)")
    raise FileNotFoundError(f"no checkpoint at {path}")


def read_meta(path) -> dict:
    """The checkpoint json; a corrupt one is a ValueError naming the file and the JSON error."""
    return files.read_json_object(resolve(path) / MARKER)


def data_folder(path) -> Path:
    """Where the DCP files of the checkpoint at `path` are."""
    where = resolve(path)
    meta = read_meta(where)
    if "data" not in meta:
        return where  # the earlier layout
    if not (isinstance(meta["data"], str) and DATA.fullmatch(meta["data"]) and (where / meta["data"]).is_dir()):
        raise ValueError(f"checkpoint {where} is incomplete: its {MARKER} names data {meta['data']!r}, "
                         f"which is not a dcp-* folder there")
    return where / meta["data"]


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


def load(state_dict: dict, path, *, meta: dict, group=None, check_finite: bool = False) -> dict:
    """Load `path` into `state_dict` in place, after checking it belongs to this model and that its
    bytes match their checksums (checkpoints saved before checksums have none to check). Every rank
    calls it. check_finite: then refuse NaN or inf in any floating tensor loaded (a ValueError on
    every rank naming them)."""
    where = resolve(path)
    saved = read_meta(where)
    check_compatible(saved, meta, where)
    data = data_folder(where)
    if (data / integrity.MANIFEST).is_file():
        integrity.verify_dcp(data, files.read_json_object(data / integrity.MANIFEST), group)
    dcp.load(state_dict, checkpoint_id=str(data), process_group=group)
    if check_finite:
        bad = sorted({k for part in integrity.gather(_non_finite(state_dict), group) for k in part})
        if bad:
            raise ValueError(f"checkpoint {where}: {len(bad)} tensors hold NaN or inf (check_finite=True): {bad[:5]}")
    return saved


def _non_finite(tree, prefix: str = "") -> list[str]:
    """Names (dotted paths) of the floating tensors of a nested state dict holding NaN or inf here."""
    if isinstance(tree, dict):
        return [n for k, v in tree.items() for n in _non_finite(v, f"{prefix}{k}.")]
    t = tree.to_local() if hasattr(tree, "to_local") else tree
    if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
        return [prefix[:-1]]
    return []
