"""The GRPO step over two data-parallel gloo ranks (FSDP2) makes the one-rank update: each rank
trains every other kept group, the token mean divides by the count over both ranks; a rank left
without a group (one informative group of four) runs one with nothing trained; the reported loss,
entropy, KL and clip fraction are the whole batch's."""
from __future__ import annotations

import random

import pytest
import torch

from bumblebee import models
from bumblebee.runtime.pipeline import Completion, Group, Objective, PipelineConfig
from tests.primitives.test_state_sharding import spawn

CONFIG = {**models.NAMED["qwen3-tiny"], "vocab_size": 16, "eos_token_id": None}
KEYS = ("loss", "grad_norm", "behave_kl", "entropy", "clip_fraction", "behave_weight_max", "reward", "groups_kept")


def _groups(step: int, informative: int) -> list[Group]:
    """Four groups of three completions of odd lengths; the first `informative` have unequal rewards."""
    rng = random.Random(step)
    groups = []
    for g in range(4):
        comps = []
        for j in range(3):
            n = 1 + (g + j) % 3
            comps.append(Completion([rng.randrange(10) for _ in range(n)], [-2.0 - rng.random() for _ in range(n)],
                                    [step] * n))
        rewards = [rng.random() for _ in range(3)] if g < informative else [0.5] * 3
        groups.append(Group(4 * step + g, step, [10, rng.randrange(10), 11], comps, rewards))
    return groups


def two_steps(mesh, out):
    from bumblebee.runtime.pipeline.trainer import build_runtime, grpo_step
    cfg = PipelineConfig(steps=2, lr=1e-2, objective=Objective(entropy_coef=1e-3, behave_cap=1.5))
    rt, ref = build_runtime(CONFIG, cfg, group=mesh.get_group())
    world, rank = mesh.size(), mesh.get_local_rank()
    return [grpo_step(rt, _groups(step, informative), cfg.objective, version=step, pad_id=12, ref=ref, rank=rank,
                      world=world, group=mesh.get_group())
            for step, informative in ((0, 1), (1, 3))]  # step 0: rank 1 holds no kept group


def test_two_ranks_make_the_one_rank_update(tmp_path):
    one, = spawn(1, "two_steps", tmp_path, module=__name__)
    two = spawn(2, "two_steps", tmp_path, module=__name__)
    assert [m["groups_kept"] for m in one] == [1, 3]
    for rank_log in two:
        for a, b in zip(rank_log, one):
            for key in KEYS:
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-8), (a["version"], key)
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in one)
