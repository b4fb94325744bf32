"""bumblebee: swap-in training primitives beside plain baseline twins.

    import bumblebee as bb
    model = bb.models.from_pretrained(hf_dir, impl={"cross_entropy": "linear_ce"})
    report = bb.pair(model="qwen3-tiny", slot="attention", a="sdpa", b="eager", steps=5)
"""
from bumblebee.registry import build, get, register, resolve, slots  # noqa: F401
from bumblebee.model_registry import register_model  # noqa: F401
from bumblebee import models  # noqa: E402,F401
from bumblebee.tools.pairing import pair  # noqa: E402,F401

__version__ = "0.1.0"
