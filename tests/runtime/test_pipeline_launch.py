"""`bumblebee rl --config FILE` end to end on CPU: a TOML file mapped to the typed configs (unknown
keys refused, naming the key), a progress line per step, the JSONL log and the plot; once in the
local mode (threads, no Ray), once in the colocated mode (the synchronous loop, one rank here) and once
on a local Ray (slow: Ray's and the actors' start-up)."""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest

from bumblebee.tools.cli import main
from tests.limits import SUBPROCESS_TIMEOUT_S

TOML = """
model = "qwen3-tiny"
mode = "{mode}"
log = "{log}"
[model_overrides]
vocab_size = 16
bos_token_id = 10
pad_token_id = 12
[task]
name = "copy_digits"
length = 2
[pipeline]
steps = 3
eta = 1
lr = 0.005
groups_per_step = 4
group_size = 4
groups_per_call = 2
impl = {{cross_entropy = "linear_ce"}}
sampling = {{max_new_tokens = 2}}
objective = {{entropy_coef = 0.001, behave_mode = "mask"}}
{extra}
"""
PROGRESS = re.compile(r"^step (\d) v(\d) reward [\d.]+ behave_kl [\d.]+ staleness [\d.]+/\d tokens/s \d+ "
                      r"idle producers [\d.]+ trainer [\d.]+$")
KEYS = {"step", "version", "reward", "loss", "grad_norm", "behave_kl", "kl", "entropy", "staleness_max",
        "staleness_mean", "tokens_per_s", "producer_idle", "trainer_idle", "group_ids", "lengths", "wall_s"}


def _run(tmp_path, capsys, mode, extra="", edit=lambda s: s):
    log = tmp_path / "run.jsonl"
    path = tmp_path / "run.toml"
    path.write_text(edit(TOML.format(mode=mode, log=log, extra=extra)))
    assert main(["rl", "--config", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    steps = [PROGRESS.match(line) for line in lines if line.startswith("step ")]
    assert all(steps) and [(m[1], m[2]) for m in steps] == [("0", "0"), ("1", "1"), ("2", "2")], lines
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(rows) == 3 and all(KEYS <= set(r) for r in rows)
    assert sorted(g for r in rows for g in r["group_ids"]) == list(range(12))  # every prompt trained once
    assert max(r["staleness_max"] for r in rows) <= 1
    for r in rows:
        assert all(math.isfinite(r[k]) for k in ("loss", "grad_norm", "behave_kl", "entropy")), r
        assert 0 <= r["trainer_idle"] <= 1 and 0 <= r["producer_idle"] <= 1
    png = tmp_path / "run.png"  # the log's name with .png
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert f"no plot written to {png}: matplotlib is not installed" in lines[-1]
    else:
        assert lines[-1] == f"wrote {png}" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rl_command_runs_a_toml_config_locally(tmp_path, capsys):
    _run(tmp_path, capsys, "local", '[devices]\ntrainer = "cpu"\nproducers = ["cpu"]')


def test_rl_command_runs_a_toml_config_colocated(tmp_path, capsys, one_process):
    """Mode "colocated" outside torchrun: one rank, the synchronous loop on this process's device."""
    _run(tmp_path, capsys, "colocated", "", edit=lambda s: s.replace("eta = 1", "eta = 0"))


def test_rl_command_runs_colocated_under_torchrun_on_two_ranks(tmp_path):
    """Two gloo ranks from torchrun: each generates its share, both train; rank 0 alone prints and logs."""
    log, path = tmp_path / "run.jsonl", tmp_path / "run.toml"
    path.write_text(TOML.format(mode="colocated", log=log, extra="").replace("eta = 1", "eta = 0"))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "bumblebee.tools.cli", "rl", "--config", str(path)], capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT_S, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert [PROGRESS.match(line)[1] for line in steps] == ["0", "1", "2"]  # one line a step: rank 0's
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and all(r["staleness_max"] == 0 for r in rows)
    assert sorted(g for r in rows for g in r["group_ids"]) == list(range(12))


@pytest.mark.slow
def test_rl_command_runs_a_toml_config_on_ray(tmp_path, capsys):
    pytest.importorskip("ray", reason="mode 'ray' needs the rl extra")
    _run(tmp_path, capsys, "ray", "[ray]\nnum_cpus = 2\ninclude_dashboard = false\nlog_to_driver = false")


@pytest.mark.parametrize("edit, named", [
    (lambda s: s.replace("[task]", "[tsak]"), "tsak"),
    (lambda s: s.replace("steps = 3", "step = 3"), "pipeline: unknown keys ['step']"),
    (lambda s: s.replace("max_new_tokens", "max_tokens"), "pipeline.sampling: unknown keys ['max_tokens']"),
    (lambda s: s.replace('mode = "local"', 'mode = "threads"'), "mode must be one of"),
    (lambda s: s + '[devices]\ntrainer = "cpu"\ngpus = 2\n', "devices: unknown keys ['gpus']"),
    (lambda s: s.replace("eta = 1", "eta = -1"), "eta must be an int >= 0"),
    (lambda s: s.replace('mode = "local"', 'mode = "colocated"'), "pipeline.eta must be 0, got 1"),
    (lambda s: s.replace('mode = "local"', 'mode = "colocated"').replace("eta = 1", "eta = 0")
     + '[devices]\ntrainer = "cpu"\n', "devices is for mode 'local'"),
])
def test_rl_command_refuses_a_bad_config_naming_the_key(tmp_path, capsys, edit, named):
    path = tmp_path / "run.toml"
    path.write_text(edit(TOML.format(mode="local", log=tmp_path / "run.jsonl", extra="")))
    assert main(["rl", "--config", str(path)]) == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "run.jsonl").exists()  # refused before running


def test_rl_command_refuses_other_file_kinds(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("model: qwen3-tiny\n")
    assert main(["rl", "--config", str(path)]) == 2
    assert "expected a .toml or .json file" in capsys.readouterr().err
