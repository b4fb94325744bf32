"""The RL pipeline benchmark's CPU smoke: the tiny model, a few steps at eta = 0, 1, 2 in the local
mode over two seeds (per-eta summaries over them), and at eta = 0, 2 on Ray (actors in processes of
their own, weights through the transfer primitive); a stamped result file with every row's timings,
idle fractions and reward curve, named after the mode and the weight channel."""
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.limits import SUBPROCESS_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[2]


def _smoke(tmp_path, *flags) -> dict:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "rl_pipeline" / "bench.py"), "--cpu-smoke",
                           "--quiet", "--out", str(tmp_path), *flags], cwd=tmp_path, capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    suffix = ("_ray" if "ray" in flags else "") + ("_p2p" if "p2p" in flags else "")
    assert [p.name for p in tmp_path.glob("*.json")] == [f"rl_pipeline_cpu_x0{suffix}.json"]
    result = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert {"commit", "dirty", "torch", "device", "date"} <= set(result) and result["device"] == "cpu"
    for r in result["rows"]:
        assert r["steps"] == len(r["reward"]) == 4 and r["s_per_step_median"] > 0
        assert 0 <= r["trainer_idle_mean"] <= 1 and 0 <= r["producer_idle_final"] <= 1
        assert r["staleness_mean"] <= r["eta"]
        if r["eta"] == 0:  # synchronous: on-policy, the sampler's log-probs the trainer's up to rounding
            assert r["staleness_mean"] == 0 and abs(r["behave_kl_mean"]) <= 8 * torch.finfo(torch.float32).eps
        assert len(r["step_s"]) == r["steps"] and abs(sum(r["step_s"]) - r["wall_s"]) <= 1e-4 * r["steps"]
        window, levels = result["config"]["window"], result["config"]["levels"]
        assert set(r["to_level"]) == {f"{x:g}" for x in levels} and result["config"]["threshold"] in levels
        for level, hit in r["to_level"].items():  # the first step whose window mean reaches the level
            means = [statistics.mean(r["reward"][i - window + 1:i + 1]) for i in range(window - 1, r["steps"])]
            first = next((i + window for i, m in enumerate(means) if m >= float(level)), None)
            assert (hit and hit[0]) == first and (hit is None or hit[1] <= r["wall_s"]), (level, hit, means)
        for level, hit in r["policy_to_level"].items():  # version v's time: its publish, the end of step v - 1
            if hit is not None:
                assert window - 1 <= hit[0] < r["steps"] and abs(hit[1] - sum(r["step_s"][:hit[0]])) <= 1e-3, hit
            trained = r["to_level"][level]
            if r["eta"] == 0 and hit and trained:  # on-policy: version v's samples are step v's, one step sooner
                assert hit[0] == trained[0] - 1, (level, hit, trained)
    assert len(result["levels"]) == len(result["policy_levels"]) == len(result["summary"]) * len(result["config"]["levels"])
    for summary in result["summary"]:  # per eta over the seeds
        mine = [r for r in result["rows"] if r["eta"] == summary["eta"] and r.get("loop", "pipeline") == "pipeline"]
        assert summary["seeds"] == len(mine) and summary["reached"] == sum(r["reached"] for r in mine)
        per_step = [r["speedup_per_step_vs_eta0"] for r in mine]
        assert summary["speedup_per_step_vs_eta0"]["min"] == min(per_step)
        assert summary["speedup_per_step_vs_eta0"]["max"] == max(per_step)
    return result


def test_rl_pipeline_bench_smoke_writes_a_stamped_result(tmp_path):
    result = _smoke(tmp_path, "--seeds", "0", "1")
    assert result["mode"] == "local (threads)"
    assert sorted((r["seed"], r["eta"]) for r in result["rows"]) == [(s, e) for s in (0, 1) for e in (0, 1, 2)]
    assert [r["eta"] for r in result["summary"]] == [0, 1, 2] and result["summary"][0]["seeds"] == 2
    assert result["config"]["weights"] == "object_store"


def test_rl_pipeline_bench_smoke_on_ray(tmp_path):
    pytest.importorskip("ray", reason="the RL pipeline needs Ray: pip install -e '.[rl]'")
    result = _smoke(tmp_path, "--mode", "ray", "--etas", "0", "2", "--weights", "p2p")
    assert result["mode"].startswith("ray") and sorted(r["eta"] for r in result["rows"]) == [0, 2]
    assert result["config"]["weights"] == "p2p"


def test_rl_pipeline_bench_smoke_with_the_colocated_anchor(tmp_path):
    """Per seed, the colocated synchronous loop on two CPU ranks beside the pipeline's etas: its own
    row (on-policy, the same fields), its summary, and each pipeline row's speed-up over it where both
    reach the threshold (the smoke's few steps reach none: the field is there, empty)."""
    result = _smoke(tmp_path, "--etas", "0", "2", "--colocated")
    anchor = [r for r in result["rows"] if r.get("loop") == "colocated"]
    assert [(r["seed"], r["eta"]) for r in anchor] == [(0, 0)] and anchor[0]["staleness_mean"] == 0
    assert all("speedup_to_threshold_vs_colocated" in r for r in result["rows"] if r not in anchor)
    assert result["colocated"]["seeds"] == 1 and result["colocated"]["s_per_step_median"]["median"] > 0
    assert [s["seeds"] for s in result["summary"]] == [1, 1]  # the anchor is not an eta's row
    eta2 = result["summary"][1]  # nothing reached: no ratio, so no verdict either way
    assert eta2["speedup_to_threshold_vs_colocated"] is None and eta2["target_verdict_vs_colocated"] is None


@pytest.mark.parametrize("flags", [[], ["--mode", "ray", "--gpus", "1"]])
def test_rl_pipeline_bench_refuses_p2p_weights_without_ray_or_with_a_shared_gpu(tmp_path, flags):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "rl_pipeline" / "bench.py"), "--weights", "p2p",
                           "--out", str(tmp_path), *flags], cwd=tmp_path, capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT_S)
    assert proc.returncode == 2 and "--weights p2p needs --mode ray" in proc.stderr, proc.stderr[-2000:]
    assert not list(tmp_path.glob("*.json"))
