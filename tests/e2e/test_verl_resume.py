"""RL smoke level 1: save, resume, and a next step bitwise equal to an uninterrupted run.

One rank: BumblebeeEngine trains qwen3-tiny for STEPS verl actor updates (cosine LR schedule with
warmup) and saves a checkpoint after SAVE_AFTER; a second engine, built from other weights, loads it
and repeats the remaining steps: losses, grad norms, LRs and every exported tensor equal bitwise.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("verl")

from tests.e2e import verl_cases as vc  # noqa: E402
from tests.primitives.test_state_sharding import spawn  # noqa: E402


def resume_one_rank(mesh, out):
    return vc.train_resume(out, "qwen3-tiny")


def check_resume(res: dict) -> None:
    """The resumed steps and weights equal the uninterrupted run's, bitwise."""
    assert res["ckpt_kept"]  # a local checkpoint is never deleted by the load
    assert res["resumed"] == res["steps"][vc.SAVE_AFTER:]
    assert set(res["resumed_weights"]) == set(res["weights"])
    for k, v in res["weights"].items():
        assert torch.equal(res["resumed_weights"][k], v), k
    assert any(not torch.equal(res["fresh"][k], v) for k, v in res["weights"].items())
    lrs = [s["lr"] for s in res["steps"]]
    assert lrs == sorted(lrs, reverse=True) and lrs[0] > lrs[-1] > 0  # the schedule moved and was restored
    for s in res["steps"]:
        assert all(map(lambda x: x == x, s.values()))  # no NaN


def test_resume_is_bitwise(tmp_path):
    check_resume(spawn(1, "resume_one_rank", tmp_path, module=__name__)[0])
