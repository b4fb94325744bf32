"""Registered model families: `register_model(name, model_class, config_class, hf_model_types=...)`.

A model family maps the `model_type` values of Hugging Face config.json files to one causal-LM
class and its config dataclass; `bb.models.from_pretrained` and `bb.models.build` look the class up
here, so a family registered from outside the package loads, trains and pairs like a shipped one.
This module holds names only: it imports no model file.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelFamily:
    name: str
    model_class: type
    config_class: type
    hf_model_types: tuple[str, ...]


_FAMILIES: dict[str, ModelFamily] = {}
_BY_TYPE: dict[str, ModelFamily] = {}


def register_model(name: str, model_class: type, config_class: type, *, hf_model_types=()) -> ModelFamily:
    """Register a causal-LM family under `name` for the HF `model_type`s it serves (default: name).
    The config class needs `from_hf(hf_config_dict)`; the model class is built as
    `model_class(config, impl)` and names its config class in `config_class`."""
    types = tuple(hf_model_types) or (name,)
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    if not (isinstance(model_class, type) and isinstance(config_class, type)):
        raise TypeError(f"model_class and config_class must be classes, got {model_class!r}, {config_class!r}")
    if not callable(getattr(config_class, "from_hf", None)):
        raise TypeError(f"config_class {config_class.__name__} needs a from_hf(hf_config: dict) classmethod")
    if getattr(model_class, "config_class", config_class) is not config_class:
        raise ValueError(f"{model_class.__name__}.config_class is {model_class.config_class.__name__}, "
                         f"not {config_class.__name__}")
    for t in types:
        if t in _BY_TYPE and _BY_TYPE[t].name != name:
            raise ValueError(f"model_type {t!r} is already served by the registered model {_BY_TYPE[t].name!r}")
    family = ModelFamily(name, model_class, config_class, types)
    _FAMILIES[name] = family
    _BY_TYPE.update(dict.fromkeys(types, family))
    return family


def families() -> dict[str, ModelFamily]:
    return dict(_FAMILIES)


def model_types() -> dict[str, type]:
    """{HF model_type: model class} of every registered family."""
    return {t: f.model_class for t, f in _BY_TYPE.items()}


def family_of(model_type) -> ModelFamily:
    if model_type not in _BY_TYPE:
        listed = "; ".join(f"{f.name} ({', '.join(f.hf_model_types)})" for f in _FAMILIES.values())
        raise ValueError(f"unknown model_type {model_type!r}; registered models: {listed}. "
                         f"Register another with bumblebee.register_model(name, model_class, config_class, "
                         f"hf_model_types=[...])")
    return _BY_TYPE[model_type]
