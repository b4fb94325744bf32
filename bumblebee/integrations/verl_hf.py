"""What the bumblebee engine's checkpoints share with HF tools: the folder verl names `huggingface`,
the config.json written into it with every save (what merging the sharded state needs), and the
critic's value head, which is transformers' token-classification head (`score`, one label)."""
from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn as nn

from bumblebee import files, hf_io

HF_DIR = "huggingface"  # verl's name for the HF folder inside a checkpoint


def write_hf_config(model, folder) -> None:
    """config.json (and generation_config.json) of `model` into `folder`, as `save_pretrained` writes
    them; a value model's (the critic's) names transformers' token-classification class with one label."""
    config, generation = hf_io.export_configs(model)
    if getattr(model, "score", None) is not None:
        arch = [a.replace("ForCausalLM", "ForTokenClassification") for a in config.get("architectures", [])]
        config.update(architectures=arch, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, obj in (("config.json", config), ("generation_config.json", generation)):
        if obj is not None:
            os.replace(files.write_json_aside(folder, name, obj), folder / name)


VALUE_HEAD = "score"  # transformers' name of the head in *ForTokenClassification
HEAD_SEED = 0


def add_value_head(model, seed: int = HEAD_SEED):
    """`model.score` = nn.Linear(hidden, 1, bias=False) in the model's dtype and device, drawn from
    normal(0, config.initializer_range) with a generator seeded by `seed` (equal on every rank)."""
    w = model.lm_head.weight
    head = nn.Linear(model.config.hidden_size, 1, bias=False, dtype=w.dtype, device=w.device)
    g = torch.Generator().manual_seed(seed)
    std = getattr(model.config, "initializer_range", 0.02)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=g, dtype=torch.float64) * std)
    model.score = head
    return model
