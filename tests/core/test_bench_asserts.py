"""Every `test_*` function of a benchmark asserts what it measures: pytest collects benchmarks/*/bench.py
(pyproject's python_files), so a case that only times would pass with a NaN, zero or missing timing."""
import ast
import importlib.util
import math
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHES = sorted((ROOT / "benchmarks").glob("*/bench.py"))


def _asserts(fn: ast.FunctionDef) -> bool:
    """An assert statement, or a call of timing.check_measured, in the function's own body."""
    return any(isinstance(n, ast.Assert) or isinstance(n, ast.Call) and getattr(n.func, "id", None) == "check_measured"
               for n in ast.walk(fn))


def test_benchmarks_are_found():
    assert len(BENCHES) >= 6, BENCHES


@pytest.mark.parametrize("path", BENCHES, ids=lambda p: p.parent.name)
def test_every_benchmark_case_asserts(path):
    tree = ast.parse(path.read_text())
    silent = [f.name for f in tree.body if isinstance(f, ast.FunctionDef) and f.name.startswith("test")
              and not _asserts(f)]
    assert not silent, f"{path.relative_to(ROOT)}: {silent} assert nothing (call timing.check_measured)"


@pytest.fixture(scope="module")
def timing():
    spec = importlib.util.spec_from_file_location("bench_timing_checked", ROOT / "benchmarks" / "timing.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _bench(median, low=None, high=None):
    stats = types.SimpleNamespace(min=low if low is not None else median, median=median,
                                  max=high if high is not None else median)
    return types.SimpleNamespace(stats=types.SimpleNamespace(stats=stats))


def test_check_measured_passes_real_measurements(timing):
    timing.check_measured(_bench(0.012), {"median_ms": 11.5, "rate": 3.0, "peak_MB": 0.0, "gpu_only": None},
                          positive=("median_ms", "rate"), nonnegative=("peak_MB", "gpu_only"))
    timing.check_measured(None, {"median_ms": 1.0})  # a case that timed without pytest-benchmark


@pytest.mark.parametrize("bench,record", [
    (_bench(math.nan), {"median_ms": 1.0}),
    (_bench(0.01, low=0.0), {"median_ms": 1.0}),
    (_bench(0.01, high=math.inf), {"median_ms": 1.0}),
    (None, {"median_ms": math.nan}),
    (None, {"median_ms": 0.0}),
    (None, {}),
    (None, {"median_ms": "12"}),
])
def test_check_measured_refuses_what_is_not_a_measurement(timing, bench, record):
    with pytest.raises(AssertionError):
        timing.check_measured(bench, record)


def test_check_measured_refuses_a_negative_or_nan_memory(timing):
    for bad in (-1.0, math.nan):
        with pytest.raises(AssertionError, match="peak_MB"):
            timing.check_measured(None, {"median_ms": 1.0, "peak_MB": bad}, nonnegative=("peak_MB",))
