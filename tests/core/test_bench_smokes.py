"""Benchmarks whose full runs need GPUs still run end to end on the CPU (their smoke modes), so a change
to a shared helper (timing.py, a sibling benchmark) cannot break them unseen."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.limits import SUBPROCESS_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"


def _run(args, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(args, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S, cwd=tmp_path, env=env)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-3000:])
    return p.stdout


def test_composed_step_smoke_trains_on_two_gloo_ranks(tmp_path):
    out = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                str(BENCH / "composed_step" / "bench.py"), "--cpu-smoke", "--out", str(tmp_path)], tmp_path)
    rows = [json.loads(line) for line in out.splitlines() if line.startswith('{"seq_len"')]
    assert rows and all(r["last_step_ok"] and r["median_ms"] > 0 and len(r["step_times_ms"]) > 0 for r in rows)
    # the estimator's peak beside the measured one (none measured on the CPU), growing with the length
    assert all(r["estimate_peak_GiB"] > r["estimate_optimizer_GiB"] > 0 for r in rows)
    assert rows[-1]["estimate_peak_GiB"] > rows[0]["estimate_peak_GiB"]


def test_composed_step_says_when_its_peak_lacks_the_optimizer_state(tmp_path):
    """One step in all (warmup 0): its backward ran before AdamW's moments existed, and the row says so."""
    out = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                str(BENCH / "composed_step" / "bench.py"), "--cpu-smoke", "--warmup", "0", "--steps", "1",
                "--out", str(tmp_path)], tmp_path)
    rows = [json.loads(line) for line in out.splitlines() if line.startswith('{"seq_len"')]
    assert rows and all(r["last_step_ok"] and r["optimizer_state_at_peak"] is False for r in rows)


def test_composed_step_smoke_trains_one_sequence_over_two_cp_ranks(tmp_path):
    out = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                str(BENCH / "composed_step" / "bench.py"), "--cpu-smoke", "--cp", "2", "--warmup", "1", "--steps", "1",
                "--out", str(tmp_path)], tmp_path)
    rows = [json.loads(line) for line in out.splitlines() if line.startswith('{"seq_len"')]
    assert rows and all(r["last_step_ok"] and math.isfinite(r["last_loss"]) for r in rows)
    assert all(r["optimizer_state_at_peak"] for r in rows)  # warmup 1 + 1 step: the second has the moments
    # one sequence a step over both ranks: the tokens of one sequence, not of two
    assert all(r["tokens_per_s"] == pytest.approx(r["seq_len"] / (r["median_ms"] / 1e3)) for r in rows)


def test_linear_attention_smoke_writes_its_results(tmp_path):
    _run([sys.executable, str(BENCH / "linear_attention" / "bench.py"), "--smoke", "--out", str(tmp_path)], tmp_path)
    report = json.loads((tmp_path / "linear_attention.json").read_text())
    assert report["wall_s"] > 0 and report["layer"] and all(r.get("median_ms", 0) > 0 for r in report["layer"])


def test_context_parallel_smoke_checks_and_times_on_two_gloo_ranks(tmp_path):
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
          str(BENCH / "context_parallel" / "bench.py"), "--cpu-smoke", "--out", str(tmp_path)], tmp_path)
    report = json.loads((tmp_path / "context_parallel_cp2.json").read_text())
    assert {(r["check"], r["rank"]) for r in report["checks"]} == {(c, r) for c in ("attention", "gated_deltanet")
                                                                   for r in (0, 1)}
    for check in report["checks"]:  # fp32 on both sides: the cp forms agree with one rank to rounding
        parts = [v for v in check.values() if isinstance(v, dict)]
        assert parts and all(p["cp_err"] < 1e-4 for p in parts), check
    assert {r["impl"] for r in report["rows"]} == {"single", "single_flash", "allgather", "ring", "cp"}
    assert all(r["median_ms"] > 0 for r in report["rows"]), report["rows"]
