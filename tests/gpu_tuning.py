"""Triton autotuning results for the GPU shards, kept in `tests/gpu_tuning.json`.

fla's gated DeltaNet kernels and ours autotune on first use: on a fresh machine that is most of a
shard's time (shard 3 ran past 570 s at 91504d0 with nothing cached, 415 s with part of it cached).
Triton can cache each autotuning result on disk (`cache_results`, `TRITON_CACHE_AUTOTUNING`), under a
key of the Triton build, the GPU target, the kernel's source, the tuning key and the candidate configs:
a result is found only by the same kernel on the same software and target, else ignored. The shards
therefore run with their own Triton cache folder (`.triton-gpu-tests/` at the repository root, so a
user's own cache is neither read nor written by them), seeded from the JSON when this GPU is the one
the results were measured on. Each entry keeps only the winning config, which is all Triton reads
back. `python tests/gpu_shards.py --save-tuning` adds what the last shard runs tuned; `--cold` runs
without the seed (to time a fresh machine)."""
from __future__ import annotations

import json
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TUNING_FILE = Path(__file__).with_name("gpu_tuning.json")
CACHE_DIR = ROOT / ".triton-gpu-tests"
SUFFIX = ".autotune.json"


def collect(cache_dir: Path) -> dict[str, dict]:
    """{"<key dir>/<kernel>.autotune.json": {"key", "configs_timings": [the winner]}} from a Triton cache."""
    out = {}
    for f in sorted(Path(cache_dir).glob(f"*/*{SUFFIX}")):
        data = json.loads(f.read_text())
        timings = data.get("configs_timings") or []
        if not timings:
            continue
        best = min(timings, key=lambda ct: ct[1])  # Triton's own choice: the least timings list
        out[f"{f.parent.name}/{f.name}"] = {"key": data.get("key"), "configs_timings": [best]}
    return out


def save(cache_dir: Path, device: str, note: str, path: Path = TUNING_FILE) -> int:
    """Merge a Triton cache's results into the JSON for `device`; returns how many entries it holds."""
    old = json.loads(path.read_text()) if path.exists() else {}
    if old and old.get("device") != device:
        raise ValueError(f"{path} holds results for {old.get('device')!r}, not {device!r}: save elsewhere")
    entries = dict(old.get("entries", {})) | collect(cache_dir)
    lines = [f"{json.dumps(k)}: {json.dumps(v, sort_keys=True)}" for k, v in sorted(entries.items())]  # an entry a line
    path.write_text(f'{{"device": {json.dumps(device)}, "note": {json.dumps(note)}, "entries": {{\n'
                    + ",\n".join(lines) + "\n}}\n")
    return len(entries)


def seed(cache_dir: Path, device: str, path: Path = TUNING_FILE) -> int:
    """Write the JSON's results into `cache_dir` when `device` is the one they were measured on. Files
    already there are kept as they are. Returns how many were written."""
    if not path.exists():
        return 0
    data = json.loads(path.read_text())
    if data.get("device") != device:
        return 0
    written = 0
    for rel, entry in data["entries"].items():
        key_dir, name = rel.split("/")
        if not name.endswith(SUFFIX) or key_dir in ("", ".", ".."):
            raise ValueError(f"{path}: entry {rel!r} is not '<key dir>/<kernel>{SUFFIX}'")
        target = Path(cache_dir) / key_dir / name
        if target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entry))
        os.replace(tmp, target)  # a reader never sees half a file
        written += 1
    return written


def this_gpu() -> str | None:
    import torch
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
