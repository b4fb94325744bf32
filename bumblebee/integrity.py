"""Checksums of checkpoint bytes, checked on load, and the optional finite-weights check.

- HF safetensors written by `save_pretrained` carry the sha256 of every tensor's bytes in their own
  header metadata (key CHECKSUMS: a JSON {tensor name: hex}), so the checksums switch with the file
  in the same rename and a crash can never pair a file with another save's checksums. transformers
  ignores the key. Files without it (written by transformers or others) load unverified.
- A DCP checkpoint's data folder holds MANIFEST: the sha256 and size of `.metadata`, and the size and
  per-tensor-chunk sha256 of every `.distcp` file (the byte ranges DCP's metadata names). The data
  folder is fresh per save and made current by the checkpoint json's rename, so it is atomic too.

Hashing is hashlib over the bytes (it releases the GIL, so tensors are hashed on worker threads);
a mismatch raises a ValueError naming the file and the tensor.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist

CHECKSUMS = "bumblebee_sha256"  # safetensors metadata key
MANIFEST = "bumblebee_checksums.json"  # in a DCP data folder
WORKERS = max(1, min(8, os.cpu_count() or 1))
IN_FLIGHT_BYTES = 2**30  # tensors read and awaiting their hash: bounds the memory a load holds extra
CHUNK = 64 * 2**20
CORRUPT = "the file is corrupt, or was changed after the save (the checksums recorded then no longer hold)"


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of the tensor's bytes in memory (C order), the bytes safetensors stores."""
    t = t.detach()
    t = t.cpu() if t.device.type != "cpu" else t
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()


def tensor_checksums(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    with ThreadPoolExecutor(WORKERS) as pool:
        return dict(zip(tensors, pool.map(tensor_sha256, tensors.values())))


def recorded_checksums(metadata: dict | None, file: Path) -> dict[str, str] | None:
    """The {tensor: sha256} a safetensors header records, or None when it records none."""
    raw = (metadata or {}).get(CHECKSUMS)
    if raw is None:
        return None
    try:
        sums = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"{file}: its header's {CHECKSUMS} is not valid JSON ({e}): {CORRUPT}") from e
    if not isinstance(sums, dict):
        raise ValueError(f"{file}: its header's {CHECKSUMS} is not a {{tensor: sha256}} object: {CORRUPT}")
    return sums


def _check_tensor(t: torch.Tensor, want: str | None, check_finite: bool) -> tuple[bool, bool]:
    """(checksum matches or nothing to check, finite or not checked)."""
    ok = want is None or tensor_sha256(t) == want
    finite = not check_finite or not t.is_floating_point() or bool(torch.isfinite(t).all())
    return ok, finite


class TensorChecks:
    """Checks tensors as a load reads them, on worker threads, with at most IN_FLIGHT_BYTES awaiting:

        with TensorChecks(check_finite=True) as checks:
            checks.add(tensor, name, file, recorded_sha256_or_None)
        # leaving the block raises a ValueError for the first tensor that failed
    """

    def __init__(self, *, check_finite: bool = False):
        self.check_finite = check_finite
        self.pending: deque = deque()
        self.bytes = 0

    def __enter__(self):
        self.pool = ThreadPoolExecutor(WORKERS)
        return self

    def add(self, t: torch.Tensor, name: str, file: Path, want: str | None) -> None:
        if want is None and not self.check_finite:
            return
        nbytes = t.numel() * t.element_size()
        self.pending.append((name, file, want, nbytes, self.pool.submit(_check_tensor, t, want, self.check_finite)))
        self.bytes += nbytes
        while self.bytes > IN_FLIGHT_BYTES:
            self._settle()

    def _settle(self) -> None:
        name, file, want, nbytes, fut = self.pending.popleft()
        self.bytes -= nbytes
        ok, finite = fut.result()
        if not ok:
            raise ValueError(f"{file}: tensor {name} does not match the sha256 recorded when it was saved "
                             f"({want[:12]}...): {CORRUPT}")
        if not finite:
            raise ValueError(f"{file}: tensor {name} holds NaN or inf values (check_finite=True)")

    def __exit__(self, typ, *exc):
        try:
            while self.pending and typ is None:
                self._settle()
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)
        return False


# ---- DCP data folders ----------------------------------------------------------------------------

def _range_sha256(file: Path, offset: int, length: int) -> str:
    h = hashlib.sha256()
    with open(file, "rb", buffering=0) as f:
        f.seek(offset)
        while length > 0:
            block = f.read(min(CHUNK, length))
            if not block:  # truncated: a digest no full range has
                h.update(b"<truncated>")
                break
            h.update(block)
            length -= len(block)
    return h.hexdigest()


def _file_sha256(file: Path) -> str:
    return _range_sha256(file, 0, file.stat().st_size)


def _item_key(index) -> str:
    offset = getattr(index, "offset", None)
    return f"{index.fqn}[{','.join(map(str, offset))}]" if offset else index.fqn


def _items(folder: Path) -> list[tuple[str, str, int, int]]:
    """(file, tensor key, offset, length) of every item DCP's metadata places in a file, sorted."""
    from torch.distributed.checkpoint import FileSystemReader
    md = FileSystemReader(str(folder)).read_metadata()
    return sorted((info.relative_path, _item_key(idx), info.offset, info.length)
                  for idx, info in md.storage_data.items())


def _share(n: int, group) -> range:
    """This rank's part of n work items (all of them without torch.distributed)."""
    if not dist.is_initialized():
        return range(n)
    return range(dist.get_rank(group), n, dist.get_world_size(group))


def gather(local, group=None) -> list:
    """Every rank's `local` on every rank (a one-element list without torch.distributed)."""
    if not dist.is_initialized():
        return [local]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, local, group=group)
    return out


def _hash_share(folder: Path, items) -> dict:
    """{(file, key): sha256} of this rank's share of `items`."""
    with ThreadPoolExecutor(WORKERS) as pool:
        return dict(pool.map(lambda it: ((it[0], it[1]), _range_sha256(folder / it[0], it[2], it[3])), items))


def _gathered(work, group) -> list:
    """`work()` on every rank, every rank's result (or error text) on every rank: an error is never
    raised before the gather, so no rank is left waiting in it."""
    try:
        local = (work(), None)
    except Exception as e:  # noqa: BLE001  (reported on every rank after the gather)
        local = (None, f"{type(e).__name__}: {e}")
    return gather(local, group)


def dcp_manifest(folder: Path, group=None) -> dict:
    """MANIFEST's content for the DCP files in `folder` (every rank calls it; each hashes a share)."""
    items = []

    def work():
        items.extend(_items(folder))
        return _hash_share(folder, [items[i] for i in _share(len(items), group)])

    parts = _gathered(work, group)
    errors = [err for _, err in parts if err]
    if errors:
        raise RuntimeError(f"hashing the checkpoint files in {folder} failed: {errors[0]}")
    sums = {k: v for part, _ in parts for k, v in part.items()}
    files: dict[str, dict] = {".metadata": {"bytes": (folder / ".metadata").stat().st_size,
                                            "sha256": _file_sha256(folder / ".metadata")}}
    for file, key, _, _ in items:
        entry = files.setdefault(file, {"bytes": (folder / file).stat().st_size, "tensors": {}})
        entry["tensors"][key] = sums[(file, key)]
    return {"algorithm": "sha256", "files": files}


def verify_dcp(folder: Path, manifest: dict, group=None) -> None:
    """Check the DCP files in `folder` against `manifest` (every rank calls it and raises the same
    ValueError, naming the file and the tensors, on a mismatch). Sizes first, then `.metadata`'s hash
    (rank 0), then each rank hashes a share of the tensor chunks."""
    recorded = manifest.get("files", {})

    def work() -> list[str]:
        problems = []
        for file, entry in recorded.items():
            where = folder / file
            size = where.stat().st_size if where.is_file() else None
            if size != entry.get("bytes"):
                problems.append(f"{where}: {'missing' if size is None else f'{size} bytes'}, "
                                f"{entry.get('bytes')} when saved")
        meta = recorded.get(".metadata", {})
        if not problems and "sha256" in meta and _file_sha256(folder / ".metadata") != meta["sha256"]:
            problems.append(f"{folder / '.metadata'}: does not match its sha256")
        if problems:
            return problems
        items = [it for it in _items(folder) if it[1] in recorded.get(it[0], {}).get("tensors", {})]
        sums = _hash_share(folder, [items[i] for i in _share(len(items), group)])
        return [f"{folder / f}: tensor {k} does not match its sha256" for (f, k), s in sums.items()
                if recorded[f]["tensors"][k] != s]

    problems = sorted({p for part, err in _gathered(work, group) for p in (part if err is None else [f"{folder}: {err}"])})
    if problems:
        raise ValueError(f"checkpoint data {folder} failed its checksums ({len(problems)} problems): "
                         f"{'; '.join(problems[:3])}: {CORRUPT}")
