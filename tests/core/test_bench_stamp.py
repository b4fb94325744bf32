"""benchmarks/stamp.py: every result file's stamp, run as the benchmarks run it (a script beside it)."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIELDS = {"commit", "dirty", "torch", "triton", "cuda", "device", "date"}


def run_stamp(**env_changes) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "BENCH_COMMIT"} | env_changes
    code = "import json, sys; sys.path.insert(0, 'benchmarks'); from stamp import stamp; print(json.dumps(stamp()))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_the_stamp_has_every_field_and_the_running_versions():
    import torch
    s = run_stamp()
    assert set(s) == FIELDS
    assert s["torch"] == torch.__version__ and s["cuda"] == torch.version.cuda
    assert s["device"] == (torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    assert s["date"][:2] == "20" and "T" in s["date"]  # an ISO timestamp
    assert s["dirty"] in (True, False, None)


def test_bench_commit_wins_over_git_and_leaves_dirty_unknown():
    s = run_stamp(BENCH_COMMIT="0123abc")
    assert s["commit"] == "0123abc" and s["dirty"] is None


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout")
def test_without_bench_commit_the_commit_is_git_head():
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    s = run_stamp()
    assert s["commit"] == head and s["dirty"] is bool(status)


def test_a_probe_prints_its_stamp_first_on_rank_zero_only():
    code = ("import sys; sys.path.insert(0, 'benchmarks'); from stamp import print_stamp; "
            "print_stamp(probe='probe_x'); print('{\"case\": 1}')")
    outs = {}
    for rank in ("0", "1"):
        env = {k: v for k, v in os.environ.items() if k != "BENCH_COMMIT"} | {"RANK": rank}
        outs[rank] = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                                    check=True).stdout.splitlines()
    first = json.loads(outs["0"][0])
    assert FIELDS <= set(first) and first["probe"] == "probe_x" and outs["0"][1] == '{"case": 1}'
    assert outs["1"] == ['{"case": 1}']  # the other ranks print no stamp
