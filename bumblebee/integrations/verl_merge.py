"""Merge a bumblebee engine checkpoint into HF safetensors: verl's `model_merger` for this engine.

verl's `python -m verl.model_merger merge --backend fsdp|megatron` reads verl's own shard files; the
bumblebee engine writes one reshardable DCP state (model, optimizer, router biases: `checkpoint.py`)
plus `huggingface/config.json`, from any number of ranks. This reads the model part on one CPU
process (the whole model in memory, as verl's merger does) and writes what `save_pretrained` writes:

    python -m bumblebee.integrations.verl_merge --local_dir CKPT/global_step_N/actor --target_dir OUT

A critic's checkpoint (a value head `score`) becomes a transformers token-classification folder.
To get the HF weights at save time instead, add "hf_model" to the checkpoint's `save_contents`
(written to `<checkpoint>/huggingface`).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bumblebee import checkpoint, hf_io, models
from bumblebee.common.state_sharding import persistent_buffers
from bumblebee.integrations.verl_hf import HF_DIR, add_value_head, write_hf_config

def load_model(local_dir):
    """The bumblebee model (fp32 masters, on the CPU) of the engine checkpoint at `local_dir`."""
    local = Path(local_dir)
    if not (local / HF_DIR / "config.json").is_file():
        raise ValueError(f"local_dir {local} holds no {HF_DIR}/config.json: not a checkpoint of the bumblebee "
                         f"engine (it writes one with every save)")
    meta = checkpoint.read_meta(local)
    hf = hf_io.read_config(local / HF_DIR)
    cls = models._model_class(hf)
    with torch.device("meta"):  # no initialization: every tensor comes from the checkpoint
        model = cls(models._parse_config(cls, hf, f"{local / HF_DIR}/config.json"), None)
        if "score.weight" in meta["params"]:
            add_value_head(model)
    model.to_empty(device="cpu")
    model.tie_weights()
    models.init_buffers(model)
    model.hf_source = models._source(cls, hf, hf_io.read_generation_config(local / HF_DIR))
    state = {"model": {n: torch.empty(s, dtype=torch.float32) for n, s in meta["params"].items()},
             "step": torch.zeros((), dtype=torch.int64)}
    buffers = persistent_buffers(model)
    if "buffers" in meta:
        state["buffers"] = buffers
    checkpoint.load(state, local, meta=meta)  # checksums verified; DCP reshards to one process
    ours = dict(model.named_parameters())
    with torch.no_grad():
        for name, t in state["model"].items():
            ours[name].data = t
    return model


def merge(local_dir, target_dir) -> None:
    """HF safetensors + config of the checkpoint at `local_dir` into `target_dir`, in the config's
    dtype (buffers in their own), as the engine's `hf_model` export writes them."""
    model = load_model(local_dir)
    dtype = model.config.dtype
    for p in model.parameters():
        p.data = p.data.to(dtype)
    model.save_pretrained(target_dir)
    write_hf_config(model, target_dir)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--local_dir", required=True, help="the engine's checkpoint folder (verl's .../actor or .../critic)")
    ap.add_argument("--target_dir", required=True, help="where the HF folder is written")
    args = ap.parse_args(argv)
    merge(args.local_dir, args.target_dir)


if __name__ == "__main__":
    main()
