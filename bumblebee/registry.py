"""Slot registry: every swappable capability is a slot with named implementations.

A primitive and its baseline twin register under the same slot; a model picks one by name, so a
swap is one string in the model config (or `--swap slot=impl` on the CLI), never an edit of the
model file. An implementation with options registers their config class (`bumblebee.options`); it
is then chosen by name (its defaults), by `"name:field=value,..."`, or by a config instance.

This module is a leaf: it imports nothing of ours but `options`. The implementations import
`register` from here; the package (`bumblebee/__init__.py`) names the loader that imports the
shipped ones (`load_with`), which runs once, before the first registration or look-up.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from bumblebee import options

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
    # falls_back(device, dtype) -> why a training step there runs the primitive's torch path of its
    # kernels' algorithm instead of the kernels, or None; set by the primitives whose kernels need a
    # device (a primitive never runs its twin's code: the contract would compare the twin with itself)
    falls_back: Callable | None = None
    config: type | None = None  # its options (a frozen dataclass), or None: it has none


_SLOTS: dict[str, dict[str, Impl]] = {}
_DEFAULTS: dict[str, str] = {}
_loader: Callable[[], None] | None = None  # imports the shipped implementations (set by the package)
_loaded = False


def register(slot: str, name: str, *, kind: str, twin: str | None = None, default: bool = False,
             falls_back: Callable | None = None, config: type | None = None) -> Callable:
    """Decorator: `@register("attention", "sdpa", kind="primitive", twin="eager")`. A primitive whose
    kernels do not run on some devices (its torch path of the same algorithm runs there) says so
    through `falls_back(device, dtype) -> reason | None` (see `code_on`). With `config=Cls`, the decorated function takes a Cls instance as its first
    argument, and `resolve` returns it bound to the chosen one (`options.Bound`)."""
    if kind not in ("primitive", "baseline"):
        raise ValueError(f"kind must be 'primitive' or 'baseline', got {kind!r}")
    if config is not None:
        options.check_config_class(config, name)
    _load_all()  # the shipped implementations first: one registered from outside never becomes a default by arriving early

    def deco(obj):
        impls = _SLOTS.setdefault(slot, {})
        if name in impls and impls[name].obj is not obj:
            raise ValueError(f"implementation {name!r} of slot {slot!r} is registered twice")
        skill = f"skills/{slot.replace('_', '-')}/SKILL.md"
        impls[name] = Impl(slot, name, obj, kind, twin, skill, summary(obj.__doc__), falls_back,
                            config)
        if default or slot not in _DEFAULTS:
            _DEFAULTS[slot] = name
        return obj

    return deco


def summary(doc: str | None) -> str:
    """The first sentence of a docstring, whole: its first line may stop mid-sentence."""
    paragraph = " ".join((doc or "").strip().split("\n\n")[0].split())
    m = re.match(r"(.+?[.!?])(?:\s|$)", paragraph)
    return m.group(1) if m else paragraph


def load_with(loader: Callable[[], None]) -> None:
    """Name the function that imports the shipped implementations (they register themselves on
    import); the registry calls it once, before its first registration or look-up, so that it never
    imports them itself (no import circle) and importing a kernel or the core imports none of them."""
    global _loader
    _loader = loader


def _load_all() -> None:
    global _loaded
    if not _loaded and _loader is not None:
        _loaded = True  # first: the loader's own imports register through here
        try:
            _loader()
        except BaseException:
            _loaded = False  # the next look-up tries again and raises the same error, not a half-filled table
            raise


def needs_triton(*kernels, then: Callable | None = None) -> Callable:
    """A `falls_back` for a primitive whose fast path launches the Triton kernels of the modules
    `kernels` (each binds `triton`: None where Triton is not installed). Without Triton it says so
    (the primitive then runs its torch path of the kernels' algorithm); with it, what `then(device,
    dtype)` says, or None."""
    for k in kernels:
        if not hasattr(k, "triton"):
            raise ValueError(f"{k.__name__} binds no `triton` (None when it is missing): not a Triton kernel module")
    missing = sorted(k.__name__.rsplit(".", 1)[-1] for k in kernels if k.triton is None)

    def falls_back(device, dtype):
        if missing:
            return f"Triton is not installed (kernels {', '.join(missing)}): their algorithm runs in torch"
        return then(device, dtype) if then is not None else None

    return falls_back


def slots() -> dict[str, dict[str, Impl]]:
    _load_all()
    return {s: dict(v) for s, v in sorted(_SLOTS.items())}


def get(slot: str, name=None) -> Impl:
    """The implementation `name` of `slot` (its default when name is None); `name` may also be any
    choice `choose` takes."""
    _load_all()
    if slot not in _SLOTS:
        raise ValueError(f"unknown slot {slot!r}; accepted: {sorted(_SLOTS)}")
    name = _DEFAULTS[slot] if name is None else name
    if not isinstance(name, str):
        return choose(slot, name)[0]
    name = name.split(":", 1)[0]
    if name not in _SLOTS[slot]:
        raise ValueError(f"unknown implementation {name!r} for slot {slot!r}; accepted: {sorted(_SLOTS[slot])}")
    return _SLOTS[slot][name]


def code_on(slot: str, name: str, device, dtype) -> tuple[str, str | None]:
    """(the implementation whose code a training step of `name` runs on `device` in `dtype`: always
    its own, why its kernels do not run there or None: a primitive then runs its torch path of the
    kernels' algorithm, never its twin's code)."""
    import torch  # here, not at the top: the CLI parses its arguments before torch is imported

    impl = get(slot, name)
    why = impl.falls_back(torch.device(device), dtype) if impl.falls_back is not None else None
    return impl.name, why


def choose(slot: str, choice=None) -> tuple[Impl, Any]:
    """(the implementation, its config or None) of a choice: None (the slot's default), a name (its
    default options), `"name:field=value,..."` (parsed with the config's field types), or a config
    instance (it names its implementation: `impl_name`). ValueError naming what is accepted."""
    if choice is None or isinstance(choice, str):
        name, colon, text = (choice or "").partition(":")
        impl = get(slot, name or None)
        if colon and impl.config is None:
            raise ValueError(f"implementation {impl.name!r} of slot {slot!r} takes no options, got {choice!r}")
        if impl.config is None:
            return impl, None
        return impl, options.parse(impl.config, text) if colon else impl.config()
    name = getattr(type(choice), "impl_name", None)
    impl = get(slot, name) if isinstance(name, str) else None
    if impl is None or type(choice) is not impl.config:
        raise TypeError(f"slot {slot!r} takes an implementation name or a config instance of one, got {choice!r}")
    return impl, choice


def resolve(slot: str, name=None) -> Any:
    """The registered object (a function for functional slots, a class for module slots); a
    configured one bound to its chosen config (the defaults when `name` is a plain name)."""
    impl, config = choose(slot, name)
    return impl.obj if config is None else options.Bound(impl.obj, config)


def spec(slot: str, choice=None) -> str:
    """The shortest string `choose` reads back as this choice: the name, plus the options that differ
    from the defaults (`"linear_ce:path=lean"`)."""
    impl, config = choose(slot, choice)
    if config is None:
        return impl.name
    changed = [f"{k}={v}" for k, v in options.record(config).items()
               if k != "impl" and v != getattr(impl.config, k)]
    return impl.name + (":" + ",".join(changed) if changed else "")


def record(slot: str, choice=None) -> dict:
    """{"impl": name, **config fields} of a choice, for reports and results."""
    impl, config = choose(slot, choice)
    return options.record(config) if config is not None else {"impl": impl.name}


def is_module(obj) -> bool:
    """Whether a resolved implementation builds a module (an nn.Module class, bound to its config or
    not) rather than being a function."""
    return isinstance(obj.func if isinstance(obj, options.Bound) else obj, type)


def build(slot: str, name=None, *args, **kwargs) -> Any:
    """Instantiate a module slot's implementation (or return a functional slot's function)."""
    obj = resolve(slot, name)
    return obj(*args, **kwargs) if is_module(obj) else obj


class SlotChoices(dict):
    """A model's {slot: implementation}, recording in `asked` every slot the model looks up while it
    is built (looked up even when unset: the model then takes the default). A slot never looked up
    is one the model does not use: choosing an implementation for it would change nothing, and a
    pairing of it would report agreement that was never tested. A configured implementation's value
    is its resolved config instance (parsed once, by `check_impl`), any other's its name."""

    def __init__(self, impl=()):
        super().__init__(impl)
        self.asked: set[str] = set()
        self.model_defaults: dict[str, str] = {}  # a default the model chose over the registry's

    def get(self, slot, default=None):
        self.asked.add(slot)
        if default is not None and slot not in self:
            self.model_defaults[slot] = default
        return super().get(slot, default)

    def configs(self) -> dict[str, dict]:
        """{slot: {"impl": name, **config fields}} of every slot looked up (defaults included: the
        model's own where it passed one to `get`, else the registry's)."""
        return {slot: record(slot, dict.get(self, slot, self.model_defaults.get(slot)))
                for slot in sorted(self.asked)}


def check_impl(impl: Mapping[str, Any] | None) -> SlotChoices:
    """Validate a {slot: choice} mapping (see `choose`); raises TypeError / ValueError naming what is
    accepted. Configured implementations are resolved to their config instances here, once."""
    if impl is None:
        return SlotChoices()
    if not isinstance(impl, Mapping):
        raise TypeError(f"impl must be a dict {{slot: implementation}}, e.g. {{'cross_entropy': 'linear_ce'}}; "
                        f"got {type(impl).__name__} {impl!r}")
    resolved = {}
    for slot, choice in impl.items():
        if not isinstance(slot, str) or choice is None:
            raise TypeError(f"impl maps slot names to implementation names or configs, got {slot!r}: {choice!r}")
        found, config = choose(slot, choice)
        resolved[slot] = found.name if config is None else config
    return SlotChoices(resolved)


def check_used(impl: SlotChoices, model: str) -> None:
    """ValueError when `impl` names a slot that `model` (a label for messages) never looked up."""
    unused = sorted(set(impl) - impl.asked)
    if unused:
        what = f"slot {unused[0]}" if len(unused) == 1 else f"slots {', '.join(unused)}"
        verb = "is" if len(unused) == 1 else "are"
        raise ValueError(f"{what} {verb} not used by model {model}; it uses: {', '.join(sorted(impl.asked))}")


def describe() -> str:
    """Human-readable table of every slot, its implementations and SKILL.md."""
    import torch

    lines = []
    for slot, impls in slots().items():
        lines.append(f"{slot}  (default: {_DEFAULTS[slot]})")
        for impl in impls.values():
            twin = f", twin of {impl.twin}" if impl.twin else ""
            lines.append(f"  {impl.name:<18} {impl.kind}{twin}: {impl.summary}")
            why = impl.falls_back(torch.device("cuda"), torch.bfloat16) if impl.falls_back else None
            if why:  # what this install lacks for the fast path even on a GPU
                lines.append(f"      fast path unavailable here: {why}")
            for field, default, doc in options.fields(impl.config) if impl.config else ():
                lines.append(f"      {field}={default!r}: {doc}")
        lines.append(f"  skill: {next(iter(impls.values())).skill}")
    return "\n".join(lines)
