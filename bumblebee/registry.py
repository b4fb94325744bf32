"""Slot registry: every swappable capability is a slot with named implementations.

A primitive and its baseline twin register under the same slot; a model picks one by name, so a
swap is one string in the model config (or `--swap slot=impl` on the CLI), never an edit of the
model file.
"""
from __future__ import annotations

import importlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Impl:
    slot: str
    name: str
    obj: Any  # a function or an nn.Module class
    kind: str  # "primitive" or "baseline"
    twin: str | None  # the other implementation this one is checked against
    skill: str  # path of the SKILL.md, relative to the repository root
    summary: str = ""
    # falls_back(device, dtype) -> why a training step there runs the twin's code instead of this
    # implementation's own, or None; set by the primitives whose kernels need a device
    falls_back: Callable | None = None


_SLOTS: dict[str, dict[str, Impl]] = {}
_DEFAULTS: dict[str, str] = {}
_loaded = False


def register(slot: str, name: str, *, kind: str, twin: str | None = None, default: bool = False,
             falls_back: Callable | None = None) -> Callable:
    """Decorator: `@register("attention", "sdpa", kind="primitive", twin="eager")`. A primitive that
    runs its twin's code on some devices says so through `falls_back(device, dtype) -> reason | None`
    (see `code_on`)."""
    if kind not in ("primitive", "baseline"):
        raise ValueError(f"kind must be 'primitive' or 'baseline', got {kind!r}")

    def deco(obj):
        impls = _SLOTS.setdefault(slot, {})
        if name in impls and impls[name].obj is not obj:
            raise ValueError(f"implementation {name!r} of slot {slot!r} is registered twice")
        skill = f"skills/{slot.replace('_', '-')}/SKILL.md"
        impls[name] = Impl(slot, name, obj, kind, twin, skill, summary(obj.__doc__), falls_back)
        if default or slot not in _DEFAULTS:
            _DEFAULTS[slot] = name
        return obj

    return deco


def summary(doc: str | None) -> str:
    """The first sentence of a docstring, whole: its first line may stop mid-sentence."""
    paragraph = " ".join((doc or "").strip().split("\n\n")[0].split())
    m = re.match(r"(.+?[.!?])(?:\s|$)", paragraph)
    return m.group(1) if m else paragraph


def _load_all() -> None:
    # Implementations register themselves on import; import them lazily to avoid cycles.
    global _loaded
    if not _loaded:
        _loaded = True
        importlib.import_module("bumblebee.baselines")
        importlib.import_module("bumblebee.primitives")


def slots() -> dict[str, dict[str, Impl]]:
    _load_all()
    return {s: dict(v) for s, v in sorted(_SLOTS.items())}


def get(slot: str, name: str | None = None) -> Impl:
    """The implementation `name` of `slot` (its default when name is None)."""
    _load_all()
    if slot not in _SLOTS:
        raise ValueError(f"unknown slot {slot!r}; accepted: {sorted(_SLOTS)}")
    name = _DEFAULTS[slot] if name is None else name
    if name not in _SLOTS[slot]:
        raise ValueError(f"unknown implementation {name!r} for slot {slot!r}; accepted: {sorted(_SLOTS[slot])}")
    return _SLOTS[slot][name]


def code_on(slot: str, name: str, device, dtype) -> tuple[str, str | None]:
    """(the implementation whose code a training step of `name` runs on `device` in `dtype`, why
    when that is not `name`'s own: a primitive whose kernels cannot run there runs its twin's code)."""
    impl = get(slot, name)
    why = impl.falls_back(torch.device(device), dtype) if impl.falls_back is not None else None
    return (impl.twin, why) if why else (impl.name, None)


def resolve(slot: str, name: str | None = None) -> Any:
    """The registered object itself (a function for functional slots, a class for module slots)."""
    return get(slot, name).obj


def build(slot: str, name: str | None = None, *args, **kwargs) -> Any:
    """Instantiate a module slot's implementation (or return a functional slot's function)."""
    obj = resolve(slot, name)
    return obj(*args, **kwargs) if isinstance(obj, type) else obj


class SlotChoices(dict):
    """A model's {slot: implementation}, recording in `asked` every slot the model looks up while it
    is built (looked up even when unset: the model then takes the default). A slot never looked up
    is one the model does not use: choosing an implementation for it would change nothing, and a
    pairing of it would report agreement that was never tested."""

    def __init__(self, impl=()):
        super().__init__(impl)
        self.asked: set[str] = set()

    def get(self, slot, default=None):
        self.asked.add(slot)
        return super().get(slot, default)


def check_impl(impl: Mapping[str, str] | None) -> SlotChoices:
    """Validate a {slot: implementation} mapping; raises TypeError / ValueError naming what is accepted."""
    if impl is None:
        return SlotChoices()
    if not isinstance(impl, Mapping):
        raise TypeError(f"impl must be a dict {{slot: implementation}}, e.g. {{'cross_entropy': 'linear_ce'}}; "
                        f"got {type(impl).__name__} {impl!r}")
    for slot, name in impl.items():
        if not isinstance(slot, str) or not isinstance(name, str):
            raise TypeError(f"impl maps slot names to implementation names (strings), got {slot!r}: {name!r}")
        get(slot, name)
    return SlotChoices(impl)


def check_used(impl: SlotChoices, model: str) -> None:
    """ValueError when `impl` names a slot that `model` (a label for messages) never looked up."""
    unused = sorted(set(impl) - impl.asked)
    if unused:
        what = f"slot {unused[0]}" if len(unused) == 1 else f"slots {', '.join(unused)}"
        verb = "is" if len(unused) == 1 else "are"
        raise ValueError(f"{what} {verb} not used by model {model}; it uses: {', '.join(sorted(impl.asked))}")


def describe() -> str:
    """Human-readable table of every slot, its implementations and SKILL.md."""
    lines = []
    for slot, impls in slots().items():
        lines.append(f"{slot}  (default: {_DEFAULTS[slot]})")
        for impl in impls.values():
            twin = f", twin of {impl.twin}" if impl.twin else ""
            lines.append(f"  {impl.name:<18} {impl.kind}{twin}: {impl.summary}")
        lines.append(f"  skill: {next(iter(impls.values())).skill}")
    return "\n".join(lines)
