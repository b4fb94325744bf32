"""The GPU suite's shards (tests/gpu_shards.py): every file with a `gpu` mark runs in exactly one shard,
and every file a shard names exists and has a `gpu` mark."""
from collections import Counter

import pytest

from tests import gpu_shards
from tests.limits import SUBPROCESS_TIMEOUT_S


def test_every_gpu_file_in_exactly_one_shard():
    listed = Counter(f for _, files in gpu_shards.SHARDS.values() for f in files)
    assert not [f for f, n in listed.items() if n > 1], "a file in two shards runs twice"
    gpu = gpu_shards.gpu_files()
    assert gpu, "no gpu-marked test file found"
    assert not gpu - set(listed), f"gpu-marked files in no shard: {sorted(gpu - set(listed))}"
    assert not set(listed) - gpu, f"shards name files without a gpu mark: {sorted(set(listed) - gpu)}"


def test_command_and_bad_shard():
    cmd = gpu_shards.command(1, ["-x"])
    assert cmd[1:6] == ["-m", "pytest", "-m", "gpu", "-q"] and cmd[-1] == "-x"
    assert "-q" not in gpu_shards.command(1, ["-v"])  # a -v after -q would be cancelled
    assert set(gpu_shards.SHARDS[1][1]) <= set(cmd)
    with pytest.raises(ValueError, match="shard"):
        gpu_shards.command(99, [])


def test_lanes_take_the_longest_shards_first_and_see_every_gpu():
    from tests.gpu_lanes import FRESH_MINUTES, lanes
    got = lanes(list(gpu_shards.SHARDS), ["0", "1"])
    assert [v for v, _ in got] == ["0,1", "1,0"]  # each lane's own GPU first, the other visible
    assert sorted(n for _, order in got for n in order) == sorted(gpu_shards.SHARDS)
    loads = [sum(FRESH_MINUTES[n] for n in order) for _, order in got]
    assert max(loads) - min(loads) <= max(FRESH_MINUTES.values())  # the greedy split is within one shard
    assert set(FRESH_MINUTES) == set(gpu_shards.SHARDS)
    with pytest.raises(ValueError, match="gpus"):
        lanes([1], ["0", "0"])


def test_run_lanes_reports_every_shard_and_stops_what_outlives_the_limit(tmp_path):
    import sys
    import time

    from tests import gpu_lanes
    shards = [1, 2, 3, 7, 8]
    scripts = {7: "import time; time.sleep(600)", 3: "raise SystemExit(3)"}  # the rest pass at once
    t0 = time.monotonic()
    passes = "print('3 passed in 0.01s')"
    recs = gpu_lanes.run_lanes(shards, ["0", "1"], lambda n: [sys.executable, "-c", scripts.get(n, passes)],
                               limit_s=15, log_dir=tmp_path, cwd=tmp_path, min_start_s=3)
    assert time.monotonic() - t0 < 300  # the 600 s sleep was stopped at the limit
    by = {r["shard"]: r for r in recs}
    assert sorted(by) == shards  # a line for every shard
    order = dict(gpu_lanes.lanes(shards, ["0", "1"]))
    after_sleeper = next(o[o.index(7) + 1:] for o in order.values() if 7 in o)
    assert after_sleeper  # the case of a shard left no time is exercised
    for n in shards:
        want = {7: "out of time", 3: "rc 3"}.get(n, "not started" if n in after_sleeper else "passed")
        assert by[n]["status"] == want, (n, by[n], order)
    assert any(r["status"] == "passed" and r["summary"] == "3 passed in 0.01s" for r in recs)


def test_script_runs_a_shard_in_a_lane(tmp_path):
    """As a script (tests/ on the path, not the repository root); on a machine without CUDA the shard's
    cases are collected and skipped, and the lane reports the shard passed with pytest's summary."""
    import subprocess
    import sys

    import torch
    if torch.cuda.is_available():
        pytest.skip("with CUDA the shard would run its GPU cases (minutes); this checks the runner only")
    out = subprocess.run([sys.executable, str(gpu_shards.ROOT / "tests" / "gpu_shards.py"), "8", "--gpus", "0",
                          "--limit", "600", "--logs", str(tmp_path)], capture_output=True, text=True,
                         timeout=SUBPROCESS_TIMEOUT_S)
    assert out.returncode == 0, (out.stdout, out.stderr)
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("shard 8 (CUDA_VISIBLE_DEVICES=0): passed in ") and " skipped" in line, line
    assert " skipped" in (tmp_path / "shard8.log").read_text()
