"""bumblebee: swap-in training primitives beside plain baseline twins.

    import bumblebee as bb
    model = bb.models.from_pretrained(hf_dir, impl={"cross_entropy": "linear_ce"})
    report = bb.pair(model="qwen3-tiny", slot="attention", a="sdpa", b="eager", steps=5)

Importing the package loads the core only: `bb.models` and `bb.pair` import on first use, and the
shipped implementations register on the registry's first registration or look-up. So importing a
kernel (`bumblebee.kernels.router_aux_free`) loads no primitive or model code.
"""
import importlib

from bumblebee import registry
from bumblebee.model_registry import register_model  # noqa: F401
from bumblebee.registry import build, get, register, resolve, slots  # noqa: F401

__version__ = "0.1.0"


def _register_shipped() -> None:
    """Import the shipped implementations, which register themselves: baselines first, so that a slot
    with no explicit default falls back to its twin's reference (the registry's `load_with`)."""
    from bumblebee import baselines, primitives  # noqa: F401


registry.load_with(_register_shipped)


def __getattr__(name):  # what sits above the core (bb.models, bb.pair, bb.baselines, ...), imported on first use
    if name == "pair":
        from bumblebee.tools.pairing import pair
        return pair
    if not name.startswith("_"):
        try:
            return importlib.import_module(f"bumblebee.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"bumblebee.{name}":
                raise
    raise AttributeError(f"module 'bumblebee' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | {"models", "pair"})
