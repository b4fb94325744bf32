"""Hugging Face checkpoint I/O with our own code: config.json + *.safetensors (single or sharded).

Saving writes only its own files into the target folder (a tokenizer or README beside them stays),
each under a temporary name first, so a crash mid-save leaves the previous checkpoint loadable. A save
holds the folder's writer lock (a second save into it is refused) and first removes the temporary
files of saves that were killed there. Each safetensors file records the sha256 of its tensors in its
header (bumblebee.integrity); a load checks every tensor it reads against them.
"""
from __future__ import annotations

import copy
import json
import logging
import os
import re
import shutil
import warnings
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from bumblebee import files as fs
from bumblebee import integrity

log = logging.getLogger(__name__)
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# weight files of the HF layout, and their temporary names while a save is under way
OWN_WEIGHTS = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|\.model(-\d{5}-of-\d{5})?\.safetensors\.tmp-[0-9a-f]+")
# the temporary names of every file a save writes: what a killed save leaves behind
LEFTOVERS = fs.aside_pattern(r"config\.json|generation_config\.json|bumblebee_impl\.json|model\.safetensors\.index\.json"
                             r"|model(-\d{5}-of-\d{5})?\.safetensors")


# beside config.json: the implementation configs the saved model ran with ({slot: {"impl": name, **options}},
# `model.impl_configs()`); a record only (loading takes the `impl` it is given); transformers ignores it
IMPL_RECORD = "bumblebee_impl.json"
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
# the export holds plain weights, whatever the source held, and no code files for auto_map to name
NOT_CARRIED = ("quantization_config", "auto_map")


def read_config(path) -> dict:
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json")
    return fs.read_json_object(path / "config.json")


def _safe_open(file: Path):
    """safe_open with the file named in its errors: which shard of many is corrupt."""
    try:
        return safe_open(file, "pt")
    except Exception as e:  # safetensors' own SafetensorError derives from Exception only
        raise ValueError(f"{file} is not a readable safetensors file: {e}") from e


def read_generation_config(path) -> dict | None:
    """generation_config.json of the folder `path` (sampling defaults, stop tokens), or None."""
    gen = Path(path) / "generation_config.json"
    return fs.read_json_object(gen) if gen.is_file() else None


def export_configs(model) -> tuple[dict, dict]:
    """(config.json, generation_config.json) of `model`'s export. The fields the model uses come from
    its config; every other field of the config it was loaded or built from (`model.hf_source`) is
    carried through as it was (token ids, `_name_or_path`, fields of other tools). The generation
    config is the source folder's, unchanged, else the token ids of the config (as transformers'
    `GenerationConfig.from_model_config` derives it)."""
    source = getattr(model, "hf_source", None) or {}
    ours = model.config.to_hf()
    carried = {k: v for k, v in (source.get("config") or {}).items() if k not in ours and k not in NOT_CARRIED}
    config = {**ours, **carried}
    if "torch_dtype" in config and "dtype" in ours:  # the older name of `dtype`: both must say the same
        config["torch_dtype"] = ours["dtype"]
    gen = source.get("generation_config")
    if gen is None:
        gen = {"_from_model_config": True, **{k: config[k] for k in TOKEN_IDS if config.get(k) is not None}}
    return config, copy.deepcopy(gen)


def _weight_files(path: Path) -> dict[str, Path]:
    """tensor name -> file holding it. model.safetensors is taken before an index, as transformers does."""
    single = path / SINGLE
    if single.is_file():
        with _safe_open(single) as f:
            return {name: single for name in f.keys()}
    if not (path / INDEX).is_file():
        raise FileNotFoundError(f"{path} has neither {SINGLE} nor {INDEX}")
    weight_map = fs.read_json_object(path / INDEX).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ValueError(f"{path / INDEX} lacks its weight_map {{tensor name: file}}")
    files = {name: path / file for name, file in weight_map.items()}
    for file in set(files.values()):
        if not file.is_file():
            raise FileNotFoundError(f"{INDEX} in {path} names {file.name}, which does not exist")
    return files


def checkpoint_names(path) -> list[str]:
    """Names of every tensor in the checkpoint folder `path` (single file or sharded)."""
    return list(_weight_files(Path(path)))


def load_weights(model: torch.nn.Module, path, *, optional: tuple[str, ...] = (),
                 ignore_prefixes: tuple[str, ...] = (), verify: bool = True, check_finite: bool = False,
                 started: float | None = None) -> None:
    """Copy every parameter (and persistent buffer) of `model` from the safetensors files in `path`,
    checking names/shapes.

    verify: check each tensor read against the sha256 its file records (files written by
    `save_pretrained`; a file without checksums, e.g. transformers', has nothing to check);
    check_finite: refuse NaN or inf in a floating tensor. Either failure is a ValueError naming the
    file and the tensor; the model's weights are then partly loaded. started: when the whole load
    began (`time.monotonic()`), from which the progress bar's delay counts.

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
    todo = [n for names in by_file.values() for n in names] + list(sources)
    total = sum(params[n].numel() * params[n].element_size() for n in todo)
    with torch.no_grad(), fs.progress(total, f"loading {path.name}", started=started) as bar, \
            integrity.TensorChecks(check_finite=check_finite) as checks:
        handles: dict[Path, tuple] = {}  # open files: (handle, their recorded checksums or None)
        unverified: set[str] = set()

        def read(name: str, file: Path, stack: ExitStack) -> torch.Tensor:
            if file not in handles:
                f = stack.enter_context(_safe_open(file))
                handles[file] = (f, integrity.recorded_checksums(f.metadata(), file) if verify else None)
                if verify and handles[file][1] is None:
                    unverified.add(file.name)
            f, sums = handles[file]
            t = f.get_tensor(name)
            if sums is not None and name not in sums:
                raise ValueError(f"{file}: tensor {name} has no checksum in its header: {integrity.CORRUPT}")
            checks.add(t, name, file, None if sums is None else sums[name])
            return t

        for file, names in by_file.items():
            with ExitStack() as stack:  # one file open at a time
                for name in names:
                    _copy(params[name], read(name, file, stack), name, file.name)
                    bar.update(params[name].numel() * params[name].element_size())
            handles.pop(file)
        with ExitStack() as stack:  # a fused tensor's sources may lie in several files
            for name, (srcs, combine) in sources.items():
                tensors = [read(src, files[src], stack) for src in srcs]
                _copy(params[name], combine(tensors), name, files[srcs[0]].name)
                bar.update(params[name].numel() * params[name].element_size())
    if unverified:
        log.info("%s: %s record no checksums (not written by save_pretrained): nothing to verify", path,
                 ", ".join(sorted(unverified)))


def load_pretrained(model: torch.nn.Module, path, *, optional: tuple[str, ...] = (),
                    ignore_prefixes: tuple[str, ...] = (), verify: bool = True, check_finite: bool = False,
                    started: float | None = None) -> None:
    """`load_weights` into a causal LM, with transformers' rule for a tied head: when the config ties
    the head to the embedding (tie_word_embeddings) and the checkpoint holds its own lm_head.weight,
    the two are tied only if equal; a different head is kept, untied, with a warning (the model's
    config then says tie_word_embeddings=False, so training and `save_pretrained` keep both)."""
    path = Path(path)
    own_head = model.config.tie_word_embeddings and "lm_head.weight" in checkpoint_names(path)
    if own_head:  # read it into a tensor of its own, then decide
        model.lm_head.weight = torch.nn.Parameter(torch.empty_like(model.lm_head.weight))
    load_weights(model, path, optional=optional, ignore_prefixes=ignore_prefixes, verify=verify,
                 check_finite=check_finite, started=started)
    if not own_head:
        return
    if torch.equal(model.lm_head.weight, model.model.embed_tokens.weight):
        model.tie_weights()
        return
    warnings.warn(f"{path}/config.json ties lm_head.weight to model.embed_tokens.weight (tie_word_embeddings: "
                  f"true), but the checkpoint holds both with different values, so they are NOT tied (as "
                  f"transformers does); the model's config now says tie_word_embeddings=False. Set it so in "
                  f"config.json to silence this warning", stacklevel=3)
    model.config.tie_word_embeddings = False


def _copy(dst: torch.Tensor, t: torch.Tensor, name: str, file: str) -> None:
    if t.shape != dst.shape:
        raise ValueError(f"{file}: tensor {name} has shape {tuple(t.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(t)


def save_weights(state: dict[str, torch.Tensor], config: dict, path, *, generation_config: dict | None = None,
                 impl_configs: dict | None = None, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write config.json, generation_config.json and IMPL_RECORD (when given) and safetensors shards
    (with an index when more than one) into the folder `path`, leaving every other file there alone.

    Every file is written under a hidden temporary name first (fsync'd): a failure while writing
    leaves the previous checkpoint untouched. The renames then switch the weights in one step (see
    `_commit_weights`), config.json and generation_config.json follow. Weight files of the previous
    checkpoint that the new one does not use are removed afterwards: only names of the HF pattern
    (`model.safetensors`, `model-XXXXX-of-YYYYY.safetensors`) that its index listed, or its single
    `model.safetensors` (which readers would otherwise take before the new index)."""
    folder = fs.prepare_folder(path, "save_pretrained path")
    with fs.writer_lock(folder, "save_pretrained path"):
        # temporary files of saves killed here (those an interim index names are the checkpoint's)
        fs.remove_leftovers(folder, LEFTOVERS, keep=_listed_weight_files(folder))
        _save_weights(folder, state, config, generation_config, impl_configs, max_shard_bytes)


def _save_weights(folder: Path, state, config, generation_config, impl_configs, max_shard_bytes) -> None:
    shards = _plan_shards(state, max_shard_bytes)
    nbytes = {n: t.numel() * t.element_size() for n, t in state.items()}
    aside: dict[str, Path] = {}  # final name -> temporary path
    try:
        with fs.progress(sum(nbytes.values()), f"saving {folder.name}") as bar:
            for file, names in shards:
                tensors = {n: state[n].detach().cpu().contiguous() for n in names}
                metadata = {"format": "pt", integrity.CHECKSUMS: json.dumps(integrity.tensor_checksums(tensors))}
                aside[file] = fs.write_aside(folder, file, lambda p: save_file(tensors, p, metadata=metadata))
                del tensors
                bar.update(sum(nbytes[n] for n in names))
        index = {"metadata": {"total_size": sum(nbytes.values())},
                 "weight_map": {n: file for file, names in shards for n in names}}
        if len(shards) > 1:
            aside[INDEX] = fs.write_json_aside(folder, INDEX, index)
        aside["config.json"] = fs.write_json_aside(folder, "config.json", config)
        if generation_config is not None:
            aside["generation_config.json"] = fs.write_json_aside(folder, "generation_config.json",
                                                                     generation_config)
        if impl_configs is not None:
            aside[IMPL_RECORD] = fs.write_json_aside(folder, IMPL_RECORD, {"impl_configs": impl_configs})
        _commit_weights(folder, aside, index)
        for name in ("config.json", "generation_config.json", IMPL_RECORD):
            if name in aside:
                os.replace(aside.pop(name), folder / name)
        fs.fsync_dir(folder)
    finally:
        for tmp in aside.values():  # what was not renamed into place (a failure, or interim copies)
            tmp.unlink(missing_ok=True)


def _plan_shards(state: dict[str, torch.Tensor], max_shard_bytes: int) -> list[tuple[str, list[str]]]:
    shards, size = [[]], 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    if len(shards) == 1:
        return [(SINGLE, shards[0])]
    return [(f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors", names) for i, names in enumerate(shards)]


def _listed_weight_files(folder: Path) -> set[str]:
    """Weight files of the checkpoint now in `folder` (our naming pattern only, never a path elsewhere)."""
    index = fs.read_json(folder / INDEX)
    listed = set()
    if isinstance(index, dict) and isinstance(index.get("weight_map"), dict):
        listed = {f for f in index["weight_map"].values() if isinstance(f, str)}
    if (folder / SINGLE).is_file():
        listed.add(SINGLE)
    return {f for f in listed if OWN_WEIGHTS.fullmatch(f) and (folder / f).is_file()}


def _commit_weights(folder: Path, aside: dict[str, Path], index: dict) -> None:
    """Rename the new weight files (and index) from `aside` into place so that a reader sees the
    previous weights or the new ones, never a mix, at every instant (readers take model.safetensors
    before the index, as transformers does)."""
    old = _listed_weight_files(folder)
    new = set(index["weight_map"].values())
    if new == {SINGLE}:
        os.replace(aside.pop(SINGLE), folder / SINGLE)  # the switch: readers take this file first
        stale = old - new | ({INDEX} if (folder / INDEX).is_file() else set())
    else:
        clash = new & old  # names the current index uses: overwriting them one by one would mix
        for file in sorted(new - clash):
            os.replace(aside.pop(file), folder / file)
        if clash:  # first an interim index that names the clashing new files by their temporary names
            interim = {n: (aside[f].name if f in clash else f) for n, f in index["weight_map"].items()}
            os.replace(fs.write_json_aside(folder, INDEX, {**index, "weight_map": interim}), folder / INDEX)
            kept = {f: aside.pop(f) for f in sorted(clash)}  # named by that index from now on: not debris
        else:
            os.replace(aside.pop(INDEX), folder / INDEX)
        if SINGLE in old:
            (folder / SINGLE).unlink()  # the switch from a single file (taken first) to the new index
        if clash:
            for file, tmp in kept.items():
                _replace_keeping(tmp, folder / file)
            os.replace(aside.pop(INDEX), folder / INDEX)  # the final names
            for tmp in kept.values():
                tmp.unlink(missing_ok=True)
        stale = old - new
    fs.fsync_dir(folder)
    for file in sorted(stale):
        (folder / file).unlink(missing_ok=True)


def _replace_keeping(src: Path, dst: Path) -> None:
    """Put `src`'s content at `dst` while `src` stays readable (an interim index still names it): a
    hard link renamed over `dst`."""
    link = src.parent / fs.aside_name(dst.name)
    try:
        os.link(src, link)
    except OSError:  # no hard links on this file system: a copy (slower, the same guarantee)
        link = fs.write_aside(src.parent, dst.name, lambda p: shutil.copyfile(src, p))
    os.replace(link, dst)


class HFCheckpointMixin:
    """`model.save_pretrained(dir)`: config.json + safetensors that transformers loads back."""

    def save_pretrained(self, path, *, max_shard_bytes: int = 5 * 2**30) -> None:
        state = dict(self.state_dict())
        if self.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # transformers stores a tied head once
        if hasattr(self, "ours_to_hf_state"):  # e.g. fused experts -> per-expert keys
            state = self.ours_to_hf_state(state)
        config, generation_config = export_configs(self)
        save_weights(state, config, path, generation_config=generation_config, impl_configs=self.impl_configs(),
                     max_shard_bytes=max_shard_bytes)
