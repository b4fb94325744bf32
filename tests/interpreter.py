"""Run a test module's own `--interpret` entry point in a subprocess under TRITON_INTERPRET=1.

The interpreter must be switched on before Triton is imported, hence the fresh process. The entry
point prints a JSON line with "ok" last. A test module takes the result as a fixture:
`interpreted = interpreted_fixture(__file__)`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.limits import SUBPROCESS_TIMEOUT_S


def run_under_interpreter(test_file: str, timeout: int = SUBPROCESS_TIMEOUT_S) -> dict:
    root = Path(__file__).resolve().parents[1]
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))  # `tests` importable
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, test_file, "--interpret"], env=env, cwd=root, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"], result
    return result


def interpreted_fixture(test_file: str):
    """A module-scoped fixture: the JSON result of `test_file --interpret` (skipped without Triton)."""
    @pytest.fixture(scope="module")
    def interpreted():
        pytest.importorskip("triton")
        return run_under_interpreter(test_file)
    return interpreted
