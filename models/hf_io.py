"""Hugging Face checkpoint I/O with our own code: config.json + *.safetensors (single or sharded).

Saving writes into a sibling temporary folder and renames it into place, so a crash mid-save leaves
the previous checkpoint intact.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX = "model.safetensors.index.json"


def read_config(path) -> dict:
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json")
    return _read_json(path / "config.json")


def _read_json(file: Path) -> dict:
    """A JSON object from `file`; a ValueError naming the file and the place where it is not one."""
    try:
        with open(file) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{file} must hold a JSON object, got a {type(data).__name__}")
    return data


def _safe_open(file: Path):
    """safe_open with the file named in its errors: which shard of many is corrupt."""
    try:
        return safe_open(file, "pt")
    except Exception as e:  # safetensors' own SafetensorError derives from Exception only
        raise ValueError(f"{file} is not a readable safetensors file: {e}") from e


def _weight_files(path: Path) -> dict[str, Path]:
    """tensor name -> file holding it."""
    if (path / INDEX).is_file():
        weight_map = _read_json(path / INDEX).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{path / INDEX} lacks its weight_map {{tensor name: file}}")
        files = {name: path / file for name, file in weight_map.items()}
        for file in set(files.values()):
            if not file.is_file():
                raise FileNotFoundError(f"{INDEX} in {path} names {file.name}, which does not exist")
        return files
    single = path / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"{path} has neither model.safetensors nor {INDEX}")
    with _safe_open(single) as f:
        return {name: single for name in f.keys()}


def checkpoint_names(path) -> list[str]:
    """Names of every tensor in the checkpoint folder `path` (single file or sharded)."""
    return list(_weight_files(Path(path)))


def load_weights(model: torch.nn.Module, path, *, optional: tuple[str, ...] = (),
                 ignore_prefixes: tuple[str, ...] = ()) -> None:
    """Copy every parameter (and persistent buffer) of `model` from the safetensors files in `path`,
    checking names/shapes.

    A tensor the model lacks is an error too (a silent partial load hides a wrong config), unless
    its name starts with one of `ignore_prefixes`. A model whose tensors are built from several
    checkpoint tensors (fused experts) names them in `model.hf_to_ours_sources(checkpoint_names)`:
    {our name: ([checkpoint names], combine(list of tensors) -> tensor)}.
    """
    path = Path(path)
    files = _weight_files(path)
    persistent = set(model.state_dict().keys())
    params = dict(model.named_parameters(remove_duplicate=True))
    params.update({n: b for n, b in model.named_buffers() if n in persistent and n not in params})
    sources = model.hf_to_ours_sources(list(files)) if hasattr(model, "hf_to_ours_sources") else {}
    sources = {n: src for n, src in sources.items() if n in params and n not in files}
    missing = [n for n in params if n not in files and n not in optional
               and not (n in sources and all(s in files for s in sources[n][0]))]
    if missing:
        raise KeyError(f"checkpoint {path} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    known = set(dict(model.named_parameters(remove_duplicate=False))) | persistent
    known |= {s for srcs, _ in sources.values() for s in srcs}
    extra = [n for n in files if n not in known and not n.startswith(ignore_prefixes)]
    if extra:
        raise KeyError(f"checkpoint {path} holds {len(extra)} tensors the model does not have, e.g. {extra[:3]}")
    by_file: dict[Path, list[str]] = {}
    for name in params:
        if name in files:
            by_file.setdefault(files[name], []).append(name)
    with torch.no_grad():
        for file, names in by_file.items():
            with _safe_open(file) as f:
                for name in names:
                    _copy(params[name], f.get_tensor(name), name, file.name)
        with ExitStack() as stack:
            handles: dict[Path, object] = {}
            for name, (srcs, combine) in sources.items():
                for src in srcs:
                    if files[src] not in handles:
                        handles[files[src]] = stack.enter_context(_safe_open(files[src]))
                tensors = [handles[files[src]].get_tensor(src) for src in srcs]
                _copy(params[name], combine(tensors), name, files[srcs[0]].name)


def _copy(dst: torch.Tensor, t: torch.Tensor, name: str, file: str) -> None:
    if t.shape != dst.shape:
        raise ValueError(f"{file}: tensor {name} has shape {tuple(t.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(t)


def save_weights(state: dict[str, torch.Tensor], config: dict, path, *, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write config.json and safetensors shards (with an index when more than one) atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        shards, size = [[]], 0
        for name, t in state.items():
            nbytes = t.numel() * t.element_size()
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(name)
            size += nbytes
        weight_map = {}
        for i, names in enumerate(shards):
            file = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file({n: state[n].detach().cpu().contiguous() for n in names}, tmp / file, metadata={"format": "pt"})
            weight_map.update({n: file for n in names})
        if len(shards) > 1:
            total = sum(t.numel() * t.element_size() for t in state.values())
            with open(tmp / INDEX, "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        with open(tmp / "config.json", "w") as f:
            json.dump(config, f, indent=2)
        _replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _replace_dir(new: Path, path: Path) -> None:
    if not path.exists():
        os.rename(new, path)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
    os.rmdir(old)
    os.rename(path, old)  # until the next rename completes, the previous checkpoint sits at `old`
    os.rename(new, path)
    shutil.rmtree(old, ignore_errors=True)


class HFCheckpointMixin:
    """`model.save_pretrained(dir)`: config.json + safetensors that transformers loads back."""

    def save_pretrained(self, path, *, max_shard_bytes: int = 5 * 2**30) -> None:
        state = dict(self.state_dict())
        if self.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # transformers stores a tied head once
        if hasattr(self, "ours_to_hf_state"):  # e.g. fused experts -> per-expert keys
            state = self.ours_to_hf_state(state)
        save_weights(state, self.config.to_hf(), Path(path), max_shard_bytes=max_shard_bytes)
