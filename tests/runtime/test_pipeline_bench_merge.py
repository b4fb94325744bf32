"""`benchmarks/rl_pipeline/bench.py`'s statistics over seeds and `--merge`: the median's distribution-free
95% interval (the standard order-statistic ranks), the target's verdict judged on it, and runs of disjoint
seeds at one commit with the same settings joined into one result with its summaries recomputed; runs that
differ, share a seed or were measured on a dirty tree are refused."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "rl_pipeline" / "bench.py"


@pytest.fixture(scope="module")
def bench():
    """bench.py under its own name; the paths and the benchmark modules it adds at import are taken back
    after (the package's own modules stay: their registrations hold for the whole session)."""
    path, modules = list(sys.path), set(sys.modules)
    spec = importlib.util.spec_from_file_location("rl_pipeline_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    yield mod
    sys.path[:] = path
    benchmarks = str(BENCH.parents[1])
    for name in set(sys.modules) - modules:
        if name == spec.name or str(getattr(sys.modules[name], "__file__", "") or "").startswith(benchmarks):
            del sys.modules[name]


@pytest.mark.parametrize("n, ranks", [(5, None), (6, (1, 6)), (10, (2, 9)), (20, (6, 15)), (30, (10, 21))])
def test_median_interval_takes_the_tabulated_order_statistics(bench, n, ranks):
    values = [float(i) for i in range(n, 0, -1)]  # any order: x_(k) is the k-th smallest
    got = bench.median_ci95(values)
    assert got == (None if ranks is None else [float(ranks[0]), float(ranks[1])])


def test_verdict_reads_the_interval_from_six_seeds_and_the_range_below(bench):
    three = bench.spread([0.99, 1.43, 2.29])
    assert three["median_ci95"] is None and bench.target_verdict(three, 1.5) == "not shown"
    six = bench.spread([1.2, 1.6, 1.65, 1.7, 1.8, 2.5])  # [min, max] is the 6-value interval
    assert bench.target_verdict(six, 1.5) == "not shown" and bench.target_verdict(six, 1.1) == "shown"
    ten = bench.spread([1.2, 1.55, 1.6, 1.62, 1.65, 1.7, 1.75, 1.8, 1.9, 2.6])  # [x2, x9]: 1.55-1.9
    assert bench.target_verdict(ten, 1.5) == "shown" and bench.target_verdict(ten, 2.0) == "missed"
    assert bench.target_verdict(None, 1.5) is None


def _row(seed, eta, wall):
    level = {"0.2": [5, wall]}
    return {"seed": seed, "eta": eta, "reached": True, "wall_s_to_threshold": wall, "first_step_s": 0.5,
            "steps_to_threshold": 5, "s_per_step_median": wall / 5, "to_level": level, "policy_to_level": level}


def _run(tmp_path, name, seeds, **header):
    rows = [_row(s, eta, wall) for s in seeds for eta, wall in ((0, 6.0 + s), (2, 4.0))]
    for r in rows:  # as write() records them
        base = next(b for b in rows if b["eta"] == 0 and b["seed"] == r["seed"])
        r["speedup_to_threshold_vs_eta0"] = base["wall_s_to_threshold"] / r["wall_s_to_threshold"]
        r["speedup_after_first_step_vs_eta0"] = None
        r["speedup_per_step_vs_eta0"] = base["s_per_step_median"] / r["s_per_step_median"]
    run = {"commit": "abc", "dirty": False, "device": "h200", "date": f"d-{name}", "benchmark": "rl_pipeline",
           "mode": "ray (actors, a process each)", "workload": "medium", "gpus": 2, "model": {"layers": 8},
           "config": {"etas": [0, 2], "seeds": seeds, "seed": seeds[0], "threshold": 0.2, "target": 1.5},
           "note": name, "rows": rows, **header}
    path = tmp_path / "parts" / name / "rl_pipeline_h200_x2_ray_medium_p2p.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(run))
    return path


def test_merge_joins_disjoint_seeds_and_recomputes_the_summaries(bench, tmp_path):
    a, b = _run(tmp_path, "a", [0, 1, 2]), _run(tmp_path, "b", [3, 4, 5])
    out = bench.merge([a, b], tmp_path / "out")
    got = json.loads(out.read_text())
    assert out.name == a.name and len(got["rows"]) == 12 and got["config"]["seeds"] == [0, 1, 2, 3, 4, 5]
    assert got["merged_notes"] == ["a", "b"] and got["merged_dates"] == ["d-a", "d-b"]
    eta2 = next(s for s in got["summary"] if s["eta"] == 2)
    ratios = sorted((6.0 + s) / 4.0 for s in range(6))
    assert eta2["seeds"] == 6 and eta2["speedup_to_threshold_vs_eta0"]["median_ci95"] == [ratios[0], ratios[-1]]
    assert eta2["target_verdict"] == "shown"  # 1.5-2.75 over six seeds
    assert next(s for s in got["summary"] if s["eta"] == 0).get("target_verdict") is None
    assert [lv["seeds"] for lv in got["levels"]] == [6, 6]


@pytest.mark.parametrize("change, message", [
    ({"commit": "def"}, r"in \['commit'\]"), ({"dirty": True}, "dirty tree"),
    ({"workload": "small"}, r"in \['workload'\]"),
    ({"config": {"etas": [0, 2], "seeds": [3], "seed": 3, "threshold": 0.3, "target": 1.5}}, r"in \['threshold'\]"),
])
def test_merge_refuses_runs_that_differ(bench, tmp_path, change, message):
    a, b = _run(tmp_path, "a", [0, 1]), _run(tmp_path, "b", [3], **change)
    with pytest.raises(ValueError, match=message):
        bench.merge([a, b], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_merge_refuses_a_seed_run_twice(bench, tmp_path):
    a, b = _run(tmp_path, "a", [0, 1]), _run(tmp_path, "b", [1, 2])
    with pytest.raises(ValueError, match="more than one part"):
        bench.merge([a, b], tmp_path / "out")
