"""The RL pipeline benchmark's CPU smoke: the tiny model, a few steps at eta = 0, 1, 2 in the local
mode, a stamped result file with every row's timings, idle fractions and reward curve."""
import json
import subprocess
import sys
from pathlib import Path

from tests.limits import SUBPROCESS_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[2]


def test_rl_pipeline_bench_smoke_writes_a_stamped_result(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "rl_pipeline" / "bench.py"), "--cpu-smoke",
                           "--quiet", "--out", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads((tmp_path / "rl_pipeline_cpu_x0.json").read_text())
    assert {"commit", "dirty", "torch", "device", "date"} <= set(result) and result["device"] == "cpu"
    rows = {r["eta"]: r for r in result["rows"]}
    assert sorted(rows) == [0, 1, 2]
    for eta, r in rows.items():
        assert r["steps"] == len(r["reward"]) == 4 and r["s_per_step_median"] > 0
        assert 0 <= r["trainer_idle_mean"] <= 1 and 0 <= r["producer_idle_final"] <= 1
        assert r["staleness_mean"] <= eta
    assert rows[0]["staleness_mean"] == 0 and rows[0]["behave_kl_mean"] == 0  # synchronous: on-policy
