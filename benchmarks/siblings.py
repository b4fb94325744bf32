"""Another benchmark folder's script as a module: every folder's script is `bench.py`, so a plain
`import bench` would find the caller's own folder first.

    from siblings import load
    moe = load("moe_dispatch")          # benchmarks/moe_dispatch/bench.py
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def load(slot: str, name: str = "bench"):
    """benchmarks/<slot>/<name>.py, imported once under the module name `<slot>_<name>`."""
    key = f"{slot}_{name}"
    if key not in sys.modules:
        path = HERE / slot / f"{name}.py"
        if not path.is_file():
            raise FileNotFoundError(f"load: no benchmark script {path} (slot={slot!r}, name={name!r})")
        spec = importlib.util.spec_from_file_location(key, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]
