"""`benchmarks/training_step/bench.py --merge`: runs of one commit, model, device and GPU count split over
several calls become one result file, their rows together and the comparison recomputed over all of them;
runs that differ in any of those, or that were measured on a dirty tree, are refused."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "training_step" / "bench.py"


@pytest.fixture(scope="module")
def bench():
    """bench.py under its own name; the paths and sibling modules it adds at import are taken back after."""
    path, modules = list(sys.path), set(sys.modules)
    spec = importlib.util.spec_from_file_location("training_step_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    yield mod
    sys.path[:] = path
    for name in set(sys.modules) - modules:
        del sys.modules[name]


def _row(stack, seq_len, round_, ms):
    return {"stack": stack, "seq_len": seq_len, "round": round_, "fits": True, "median_ms": ms,
            "tokens_per_s": seq_len / ms * 1e3, "peak_bytes": 10 << 30, "static_bytes": 6 << 30,
            "losses": [2.0, 1.9], "grad_norms": [1.0, 0.9], "attention_kernel": "fa4", "optimizer": "fused"}


def _run(tmp_path, name, seq_len, note, **header):
    rows = [_row(st, seq_len, r, ms) for r in range(2) for st, ms in (("transformers+liger", 600.0 + r),
                                                                       ("bumblebee", 500.0 - r))]
    run = {"commit": "abc", "dirty": None, "torch": "2.11", "device": "h200", "date": f"d-{seq_len}",
           "benchmark": "training_step", "model": "qwen3-30b-a3b", "layers": 4, "gpus": 1, "rows": rows,
           "note": note, "comparison": [], **header}
    path = tmp_path / name
    path.write_text(json.dumps(run))
    return path


def test_merge_joins_rows_and_recomputes_the_comparison(tmp_path, bench):
    a = _run(tmp_path, "a.json", 32768, "beside others")
    b = _run(tmp_path, "b.json", 65536, "alone")
    report = bench.merge([a, b], tmp_path / "out", 1.3)
    assert len(report["rows"]) == 8
    assert [c["seq_len"] for c in report["comparison"]] == [32768, 65536]
    c = report["comparison"][0]
    assert c["speed_ratio"] == pytest.approx(600.5 / 499.5)
    assert c["speed_ratio_low"] == pytest.approx(600.0 / 500.0)
    assert c["speed_ratio_high"] == pytest.approx(601.0 / 499.0)
    assert report["merged_dates"] == ["d-32768", "d-65536"]
    assert report["merged_notes"] == ["beside others", "alone"]
    written = json.loads((tmp_path / "out" / "training_step_qwen3-30b-a3b_h200_x1.json").read_text())
    assert written["comparison"] == report["comparison"]


@pytest.mark.parametrize("header", [{"commit": "def"}, {"gpus": 2}, {"device": "h100"}, {"dirty": True}])
def test_merge_refuses_runs_that_differ(tmp_path, header, bench):
    a = _run(tmp_path, "a.json", 32768, "")
    b = _run(tmp_path, "b.json", 65536, "", **header)
    with pytest.raises(ValueError, match="--merge"):
        bench.merge([a, b], tmp_path / "out", 1.3)
