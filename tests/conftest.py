import inspect
import re

import pytest
import torch

# `slow`: the CPU cases that start other processes (gloo ranks, a Triton-interpreter subprocess, a
# Python child, a Ray cluster, a benchmark's CPU smoke, an RL run): each costs tens of seconds to
# minutes on 2 shared cores.
# `pytest -m "not slow"` is the first check the README names; the full suite runs them all.
# A case is slow when its own code or one of its fixtures' code starts such a process, or when its
# file is listed in SLOW_FILES (processes started further down, through helpers).
STARTS_PROCESSES = re.compile(r"\bspawn(_within)?\(|run_under_interpreter\(|TRITON_INTERPRET|sys\.executable|ray\.init\(")
SLOW_FILES = (
    "tests/core/test_bench_smokes.py",  # torchrun of the composed step, the state-sharding smoke
    "tests/models/test_training_step_vs_transformers.py",  # the training-step benchmark, 1 and 2 ranks
    "tests/e2e/",  # RL runs: GRPO learning, verl's engine on gloo ranks
    "tests/runtime/test_pipeline_ray.py",  # a Ray cluster and its actors
    "tests/core/test_save_lock.py",  # writers in child processes, killed mid-save
    "tests/core/test_bench_stamp.py",  # a Python child per case
)


def _source(fn) -> str:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return ""


def _starts_processes(item) -> bool:
    if STARTS_PROCESSES.search(_source(getattr(item, "function", None))):
        return True
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    return any(STARTS_PROCESSES.search(_source(d.func)) for fixturedefs in defs.values() for d in fixturedefs)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith(SLOW_FILES) or _starts_processes(item):
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
