"""`tests.ranks.spawn_within`: spawned ranks that finish pass, one that raises fails as under
`mp.spawn`, and one that outlives the deadline fails with TimeoutError after writing its stack."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
from torch.multiprocessing import ProcessRaisedException

from tests.ranks import spawn_within


def _writes(rank, out):
    (Path(out) / f"{rank}.txt").write_text(str(rank * 10))


def _raises_on_one(rank):
    if rank == 1:
        raise RuntimeError("rank one failed on purpose")


def _one_rank_stuck(rank):
    if rank == 1:
        time.sleep(600)  # far past the deadline below


def _stuck_without_its_watchdog(rank):
    import faulthandler
    faulthandler.cancel_dump_traceback_later()  # as if the rank could not write its stack
    time.sleep(600)


def test_ranks_that_finish_pass(tmp_path):
    spawn_within(_writes, (str(tmp_path),), nprocs=2, timeout_s=120)
    assert [(tmp_path / f"{r}.txt").read_text() for r in range(2)] == ["0", "10"]


def test_a_rank_that_raises_fails_the_call():
    with pytest.raises(ProcessRaisedException, match="rank one failed on purpose"):
        spawn_within(_raises_on_one, (), nprocs=2, timeout_s=120)


def test_a_stuck_rank_fails_within_the_deadline_with_its_stack(capfd):
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank 1 of 2 still running 4 s"):
        spawn_within(_one_rank_stuck, (), nprocs=2, timeout_s=4, grace_s=120)
    took = time.monotonic() - t0
    err = capfd.readouterr().err
    assert "_one_rank_stuck" in err, err  # the stuck rank's stack names the function it is stuck in
    assert took < 300, took  # the 600 s sleep was cut short (spawning on a loaded host can take a while)


def test_a_rank_that_cannot_report_is_killed_after_the_grace():
    # the rank cancels its watchdog at once; 10 s keeps a loaded host from firing it before the cancel
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[0\] of 1 still running 13 s after the start, killed"):
        spawn_within(_stuck_without_its_watchdog, (), nprocs=1, timeout_s=10, grace_s=3)
    assert time.monotonic() - t0 < 300


def test_bad_limits_are_named():
    with pytest.raises(ValueError, match="timeout_s"):
        spawn_within(_writes, ("x",), nprocs=2, timeout_s=0)
