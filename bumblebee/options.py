"""Typed implementation options: a frozen dataclass per configurable implementation.

An implementation's knobs live in its config class (defaults, a doc per field, validation in
`__post_init__`), never in module globals: what runs is then named by the model's `impl` alone and
can be recorded. The registry parses `"name:field=value,..."` strings with the field types and binds
the chosen config to the implementation (`Bound`).
"""
from __future__ import annotations

import dataclasses
import inspect
import re
import types
import typing
from typing import Any

_SIZE = re.compile(r"(\d+)\s*(KiB|MiB|GiB|TiB)?")
_UNITS = {None: 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
_TRUE, _FALSE = ("true", "1", "on"), ("false", "0", "off")


def option(default: Any, doc: str) -> Any:
    """A config field with its documentation (printed by `bumblebee list`)."""
    return dataclasses.field(default=default, metadata={"doc": doc})


def check_config_class(cls: type, name: str) -> None:
    """A config class is a frozen dataclass naming its implementation, every field defaulted and documented."""
    if not (dataclasses.is_dataclass(cls) and isinstance(cls, type) and cls.__dataclass_params__.frozen):
        raise TypeError(f"the config of {name!r} must be a frozen dataclass, got {cls!r}")
    if getattr(cls, "impl_name", None) != name:
        raise TypeError(f"{cls.__name__}.impl_name must be {name!r} (the implementation it configures)")
    for f in dataclasses.fields(cls):
        if f.default is dataclasses.MISSING or not f.metadata.get("doc"):
            raise TypeError(f"{cls.__name__}.{f.name} needs a default and a doc (declare it with option())")


def check_choice(config, name: str, accepted: tuple) -> None:
    value = getattr(config, name)
    if value not in accepted:
        raise ValueError(f"{type(config).__name__}.{name} must be one of {', '.join(map(repr, accepted))}; "
                         f"got {value!r}")


def check_bool(config, name: str) -> None:
    value = getattr(config, name)
    if not isinstance(value, bool):  # "off" is truthy: a string here would silently mean True
        raise ValueError(f"{type(config).__name__}.{name} must be True or False; got {value!r}")


def check_int(config, name: str, minimum: int, *, optional: bool = False) -> None:
    value = getattr(config, name)
    if optional and value is None:
        return
    # bool is an int to Python, but True bytes is a mistake, not a size
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = f"None or an int >= {minimum}" if optional else f"an int >= {minimum}"
        raise ValueError(f"{type(config).__name__}.{name} must be {what}; got {value!r}")


def _value(cls: type, name: str, hint, text: str):
    """`text` as the field's type: ints take a KiB/MiB/GiB/TiB suffix, bools on/off too, optional
    fields take 'none'."""
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    if type(None) in options and text.lower() == "none":
        return None
    base = next(t for t in options if t is not type(None))
    if base is bool:
        if text.lower() not in _TRUE + _FALSE:
            raise ValueError(f"{cls.__name__}.{name} takes true or false (or on/off), got {text!r}")
        return text.lower() in _TRUE
    if base is int:
        m = _SIZE.fullmatch(text.strip())
        if not m:
            raise ValueError(f"{cls.__name__}.{name} takes an integer (optionally with KiB/MiB/GiB/TiB), got {text!r}")
        return int(m.group(1)) * _UNITS[m.group(2)]
    if base is float:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{cls.__name__}.{name} takes a number, got {text!r}") from None
    return text


def parse(cls: type, text: str):
    """`"path=lean,budget_bytes=2GiB"` -> cls(path="lean", budget_bytes=2 << 30), validated."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, eq, value = (s.strip() for s in item.partition("="))
        if not eq:
            raise ValueError(f"{cls.impl_name} options are field=value, got {item!r}")
        if key not in names:
            raise ValueError(f"{cls.impl_name} has no option {key!r}; accepted: {', '.join(names)}")
        kwargs[key] = _value(cls, key, hints[key], value)
    return cls(**kwargs)


def fields(cls: type) -> list[tuple[str, Any, str]]:
    """(name, default, doc) of every field of a config class."""
    return [(f.name, f.default, f.metadata["doc"]) for f in dataclasses.fields(cls)]


def record(config) -> dict:
    """{"impl": name, **fields}: what a report or a result records of a chosen config."""
    return {"impl": config.impl_name, **dataclasses.asdict(config)}


class Bound:
    """`fn` with its config as first argument: `Bound(fn, cfg)(*a, **k)` runs `fn(cfg, *a, **k)`.

    Its signature is fn's without that argument, so a configured primitive keeps its twin's (the twin
    contract), and a caller cannot tell a bound implementation from a plain function."""

    def __init__(self, fn, config):
        self.func, self.config = fn, config
        sig = inspect.signature(fn)
        self.__signature__ = sig.replace(parameters=list(sig.parameters.values())[1:])
        self.__name__, self.__qualname__ = fn.__name__, fn.__qualname__
        self.__module__, self.__doc__ = fn.__module__, fn.__doc__

    def __call__(self, *args, **kwargs):
        return self.func(self.config, *args, **kwargs)

    def __eq__(self, other):
        return isinstance(other, Bound) and (self.func, self.config) == (other.func, other.config)

    def __hash__(self):
        return hash((self.func, self.config))

    def __repr__(self):
        return f"<{self.__name__} bound to {self.config!r}>"
