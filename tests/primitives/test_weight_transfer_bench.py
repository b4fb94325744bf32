"""The weight-transfer benchmark's torchrun mode end to end on 4 gloo ranks at tiny size, on the path
its GPU runs take (trainer FSDP2 + EP 2 -> rollout TP 2, the layout given and checked, two p2p
budgets each staged and landed in place (`commit` stage, undo and undo_ahead), each agreed through the
store and on the group (`agreement`), the twin, the link's
batch_isend_irecv rate): a change cannot break the GPU command unseen."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.limits import SUBPROCESS_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[2]


def test_bench_measures_p2p_twin_and_link_on_four_gloo_ranks(tmp_path):
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
            str(ROOT / "benchmarks" / "weight_transfer" / "bench.py"), "--device", "cpu", "--trainers", "2", "--ep",
            "--layout", "given", "--iters", "1", "--budget-bytes", "65536", "1048576",
            "--agreement", "store", "group", "--profile", "--out", str(tmp_path)]
    p = subprocess.run(args, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S, cwd=tmp_path,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-3000:])
    r = json.loads((tmp_path / "cpu-ranks4.json").read_text())
    assert r["slot"] == "weight_transfer" and r["commit"] and r["device"] == "cpu" and r["layout"] == "given"
    assert r["device_type"] == "cpu"
    for g in r["ranks"]:  # each p2p rank's copy programs: fewer calls than entries
        assert 0 < g["p2p@1048576"]["copies"]["copy_calls"] < g["p2p@1048576"]["copies"]["entries"], g
    per = r["per_impl"]
    assert set(per) == {f"p2p{c}{a}@{b}" for c in ("", "-undo", "-undo_ahead") for a in ("", "-group")
                        for b in (65536, 1048576)} | {"broadcast"}
    for k, v in per.items():
        assert v["median_ms"] > 0 and v["first_update_s"] > 0 and v["GBps"] > 0, (k, v)
    # TP 2: each rollout rank takes about half of the model from p2p, all of it from the twin
    assert per["p2p@65536"]["wire_bytes"] == per["p2p@1048576"]["wire_bytes"]
    assert 1.9 * per["p2p@65536"]["wire_bytes"] < per["broadcast"]["wire_bytes"]
    assert all(s > 0 for s in per["p2p@65536"]["staging_bytes_per_rollout_rank"])  # the transaction's staging
    assert all(c > 0 for c in per["p2p@65536"]["commit_ms_per_rollout_rank"])
    undo = per["p2p-undo@65536"]  # the same bytes, landed in place behind a backup of what they overwrite
    assert undo["wire_bytes"] == per["p2p@65536"]["wire_bytes"]
    assert all(s > 0 for s in undo["staging_bytes_per_rollout_rank"]) and all(b > 0 for b in undo["backup_ms_per_rollout_rank"])
    # the first update, the warm-up, the device-synced one and the back-to-back one
    assert undo["window_backups_per_rollout_rank"] == [4, 4]
    ahead = per["p2p-undo_ahead@65536"]  # the first update backed up in its window, the next two behind backups taken ahead
    assert ahead["wire_bytes"] == undo["wire_bytes"] and ahead["window_backups_per_rollout_rank"] == [1, 1]
    for k in ("p2p@65536", "p2p-undo_ahead@1048576"):  # agreed on the group: the same bytes
        group = per[k.replace("@", "-group@")]
        assert group["wire_bytes"] == per[k]["wire_bytes"] and group["median_ms"] > 0
    link = r["link"]
    assert link["pairs"] == 2 and link["GBps"] > 0
    assert 0 < link["message_bytes"] < per["p2p@65536"]["wire_bytes"]  # one rollout rank's update
    assert r["p2p_over_link_rate"] > 0 and r["target_over_link_rate"] == 0.7
    lo, hi = per[r["p2p_best"]]["of_link_rate_spread"]  # quartiles of updates against the link's rounds
    assert 0 < lo <= hi and r["target_shown"] == (lo >= 0.7) and len(link["times_ms"]) == 1
    for k, v in per.items():  # the updates in a row: each until the caller's stream is done, and the period
        assert v["back_to_back_ms"] > 0 and v["period_ms"] > 0 and v["of_link_rate_back_to_back"] > 0, (k, v)
        assert v["of_link_rate_period"] == pytest.approx(v["of_link_rate_back_to_back"] * v["back_to_back_ms"] / v["period_ms"])
    best = per[r["p2p_best_back_to_back"]]
    assert best["back_to_back_ms"] == min(v["back_to_back_ms"] for k, v in per.items() if k.startswith("p2p"))
    lo, hi = best["of_link_rate_back_to_back_spread"]
    assert 0 < lo <= hi and r["target_shown_back_to_back"] == (lo >= 0.7)
    # --profile: one more update of the first budget traced on every rank, its phases in order
    assert r["profiled"] == "p2p@65536"
    for i, g in enumerate(r["ranks"]):
        p = g["p2p@65536"]["profile"]
        assert p["wall_ms"] > 0 and p["window_ms"] > 0 and p["top_cpu_ops"] and p["gpu_ms"] is None, p
        phases = [name for name, _, _ in p["phases"]]
        assert phases == (["spec"] if i < 2 else []) + ["prepare", "move", "vote"] + ([] if i < 2 else ["commit"]) \
            + ["forget"]


def test_bench_refuses_high_priority_streams_on_the_cpu(tmp_path):
    """Stream priorities are NCCL's: asked on gloo ranks, the bench says so before any rank starts."""
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "weight_transfer" / "bench.py"), "--device", "cpu",
                        "--nccl-streams", "high", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S, cwd=tmp_path)
    assert p.returncode != 0 and "--nccl-streams high needs --device cuda" in p.stderr, p.stderr[-2000:]
    assert not list(tmp_path.glob("*.json"))
