"""Thin model files and their Hugging Face checkpoint mapping.

    model = bb.models.from_pretrained(hf_dir, impl={"cross_entropy": "linear_ce"})
    model = bb.models.build("qwen3-tiny", impl={"attention": "eager"}, seed=0)
    model.save_pretrained(out_dir)
"""
from __future__ import annotations

import copy
import time

import torch

from bumblebee import registry
from bumblebee.model_registry import families, family_of, model_types, register_model
from bumblebee import hf_io
from bumblebee.models.configs import NAMED
from bumblebee.models.deepseek_v3 import DeepseekV3ForCausalLM
from bumblebee.models.qwen3 import Qwen3ForCausalLM
from bumblebee.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
from bumblebee.models.qwen3_moe import Qwen3MoeForCausalLM

for _name, _cls, _types in (("qwen3", Qwen3ForCausalLM, ("qwen3",)),
                             ("qwen3_moe", Qwen3MoeForCausalLM, ("qwen3_moe",)),
                             ("deepseek_v3", DeepseekV3ForCausalLM, ("deepseek_v3",)),
                             # Qwen3.5: the hub's multimodal configs (text under text_config) and
                             # transformers' text ones
                             ("qwen3_5", Qwen3_5ForCausalLM, ("qwen3_5", "qwen3_5_text")),
                             ("qwen3_5_moe", Qwen3_5MoeForCausalLM, ("qwen3_5_moe", "qwen3_5_moe_text"))):
    register_model(_name, _cls, _cls.config_class, hf_model_types=_types)


def __getattr__(name):
    if name == "MODEL_TYPES":  # {model_type: class} of every family registered so far, read live
        return model_types()
    raise AttributeError(f"module 'bumblebee.models' has no attribute {name!r}")


def _model_class(hf: dict):
    return family_of(hf.get("model_type")).model_class


def _hf_config(name_or_config) -> dict:
    if isinstance(name_or_config, dict):
        return copy.deepcopy(name_or_config)
    if name_or_config not in NAMED:
        raise ValueError(f"unknown model {name_or_config!r}; accepted: {sorted(NAMED)}")
    return copy.deepcopy(NAMED[name_or_config])


def _source(cls, hf: dict, generation_config: dict | None = None) -> dict:
    """What an export carries through from the config the model came from: the fields of the text
    model (a multimodal hub config nests them under text_config), with the top level's token ids."""
    fields = cls.config_class.text_fields(hf) if hasattr(cls.config_class, "text_fields") else dict(hf)
    for k in hf_io.TOKEN_IDS:
        if k in hf and k not in fields:
            fields[k] = hf[k]
    return {"config": copy.deepcopy(fields), "generation_config": copy.deepcopy(generation_config)}


def init_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Normal(0, initializer_range) for matrices, ones for norms (transformers' init)."""
    g = torch.Generator().manual_seed(seed)
    std = model.config.initializer_range
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0) if name.endswith("norm.weight") else p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)


def init_buffers(model: torch.nn.Module) -> None:
    """Initial buffer values after `to_empty` (meta-device construction leaves them unset)."""
    for module in model.modules():
        if hasattr(module, "init_buffers"):
            module.init_buffers()


def _parse_config(cls, hf: dict, source: str):
    """The model's config from an HF config dict; a missing field named with where it was read."""
    try:
        return cls.config_class.from_hf(hf)
    except KeyError as e:
        raise ValueError(f"{source} lacks the field {e.args[0]!r}, which {hf.get('model_type')} needs") from e


def _check_dtype(dtype) -> None:
    """A floating torch.dtype or None; a string ("bfloat16") would reach `Module.to` and be reported
    as a bad device."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating torch.dtype (torch.bfloat16, torch.float32, ...) or None "
                         f"(the config's), got {dtype!r}")


def slots_used(name_or_config, impl: dict | None = None) -> tuple[str, ...]:
    """The slots the model looks up when built with `impl`, from a construction on the meta device
    (no weights): what a pairing may swap, known before any weight is made."""
    hf = _hf_config(name_or_config)
    cls = _model_class(hf)
    config = _parse_config(cls, hf, f"config {name_or_config!r}" if isinstance(name_or_config, str) else "the config")
    with torch.device("meta"):
        return cls(config, impl).slots_used()


def build(name_or_config, impl: dict | None = None, *, seed: int = 0, dtype=None, device="cpu"):
    """A freshly initialized model from a named config (`qwen3-tiny`, ...) or an HF config dict."""
    _check_dtype(dtype)
    hf = _hf_config(name_or_config)
    cls = _model_class(hf)
    config = _parse_config(cls, hf, f"config {name_or_config!r}" if isinstance(name_or_config, str) else "the config")
    with torch.device("meta"):
        model = cls(config, impl)
    registry.check_used(model.impl, name_or_config if isinstance(name_or_config, str) else hf.get("model_type"))
    model.to_empty(device="cpu")
    model.tie_weights()
    init_buffers(model)
    init_weights(model, seed)
    if hasattr(model, "init_extra_weights"):  # a model's own init where the generic one differs
        model.init_extra_weights(seed)
    model.hf_source = _source(cls, hf)
    return model.to(device=device, dtype=dtype or config.dtype)


def from_pretrained(path, impl: dict | None = None, *, dtype=None, device="cpu", check_finite: bool = False):
    """Load config.json and *.safetensors written by transformers (or by `save_pretrained`). The model
    comes back in eval mode, as transformers returns it; call `.train()` where a framework checks the
    flag (bumblebee's modules compute the same in both modes: no dropout). A bar on stderr shows the
    loading's progress once it takes more than a few seconds. Tensors are checked against the sha256
    their files record (written by `save_pretrained`; transformers' files record none) and, with
    check_finite, refused when they hold NaN or inf (`hf_io.load_pretrained`)."""
    _check_dtype(dtype)
    started = time.monotonic()  # the progress bar's delay counts from here: building the model takes time too
    hf = hf_io.read_config(path)
    cls = _model_class(hf)
    config = _parse_config(cls, hf, f"{path}/config.json")
    dtype = dtype or config.dtype
    with torch.device("meta"):
        model = cls(config, impl)
    registry.check_used(model.impl, f"{hf.get('model_type')} ({path})")
    model.to_empty(device=device)
    model.tie_weights()
    init_buffers(model)
    model.to(dtype)
    optional = ("lm_head.weight",) if config.tie_word_embeddings else ()
    ignore = ()
    if hasattr(model, "checkpoint_extras"):  # tensors a checkpoint may lack, or hold beyond the model's
        more, ignore = model.checkpoint_extras(path)
        optional += more
    hf_io.load_pretrained(model, path, optional=optional, ignore_prefixes=ignore, check_finite=check_finite,
                          started=started)
    model.hf_source = _source(cls, hf, hf_io.read_generation_config(path))
    return model.eval()  # as transformers' from_pretrained; no module here behaves differently in train()


__all__ = ["build", "from_pretrained", "init_weights", "slots_used", "NAMED", "MODEL_TYPES"]


def slots_of(model_type: str) -> tuple[str, ...]:
    """The slots a model family looks up, read off a meta-device build of a named config of its type."""
    family = family_of(model_type)
    hf = next((c for c in NAMED.values() if c.get("model_type") in family.hf_model_types), None)
    if hf is None:
        return ()
    with torch.device("meta"):
        model = family.model_class(_parse_config(family.model_class, copy.deepcopy(hf), "its named config"), None)
    return model.slots_used() if hasattr(model, "slots_used") else ()


def describe() -> str:
    """Every registered model family, the HF model_types it serves, its slots and named configs."""
    lines = ["models:"]
    for f in families().values():
        named = sorted(n for n, c in NAMED.items() if c.get("model_type") in f.hf_model_types)
        lines.append(f"  {f.name} ({f.model_class.__name__}; model_type {', '.join(f.hf_model_types)})")
        lines.append(f"    slots: {', '.join(slots_of(f.hf_model_types[0])) or '-'}")
        lines.append(f"    named configs: {', '.join(named) or '-'}")
    return "\n".join(lines)
