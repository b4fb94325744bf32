"""On/off switches of the primitives' optional kernels: a module constant, read once from the
environment at import, checked where it is used (so a typo fails loudly, never silently off)."""
from __future__ import annotations

import os


def from_env(var: str, default: str = "on") -> str:
    """The switch's value from environment variable `var` ("on"/"off", any case and spacing)."""
    return os.environ.get(var, default).strip().lower()


def is_on(name: str, value: str) -> bool:
    """value == "on"; ValueError naming the switch for anything but "on"/"off"."""
    if value not in ("off", "on"):
        raise ValueError(f"{name} must be 'off' or 'on', got {value!r}")
    return value == "on"
