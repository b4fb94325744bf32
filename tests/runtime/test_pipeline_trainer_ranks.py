"""The GRPO step over two data-parallel gloo ranks (FSDP2) makes the one-rank update: each rank
trains every other kept group, the token mean divides by the count over both ranks; a rank left
without a group (one informative group of four) runs one with nothing trained; the reported loss,
entropy, KL and clip fraction are the whole batch's. The same holds for a tiny Qwen3-MoE with its
experts split over the two ranks (expert_parallel = 2, all_to_all dispatch), whose exported weights
after the steps also match the one-rank run's."""
from __future__ import annotations

import random

import pytest
import torch

from bumblebee import models
from bumblebee.runtime.pipeline import Completion, Group, Objective, PipelineConfig
from tests.primitives.test_state_sharding import spawn

CONFIG = {**models.NAMED["qwen3-tiny"], "vocab_size": 16, "eos_token_id": None}
# no load-balancing term: it is each rank's own tokens' (as under any data parallelism), not the batch's
MOE = {**models.NAMED["qwen3-moe-tiny"], "vocab_size": 16, "eos_token_id": None, "router_aux_loss_coef": 0.0}
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
    cfg = PipelineConfig(steps=2, lr=1e-2, objective=Objective(entropy_coef=1e-3, behave_cap=1.5),
                         trainer_ranks=mesh.size())
    rt, ref = build_runtime(CONFIG, cfg, group=mesh.get_group())
    world, rank = mesh.size(), mesh.get_local_rank()
    return [grpo_step(rt, _groups(step, informative), cfg.objective, version=step, pad_id=12, ref=ref, rank=rank,
                      world=world, group=mesh.get_group())
            for step, informative in ((0, 1), (1, 3))]  # step 0: rank 1 holds no kept group


def moe_steps(mesh, out):
    """Two steps of the MoE model, experts over every rank; then its export (every rank gathers)."""
    import torch.distributed as dist
    from bumblebee.runtime.pipeline.trainer import build_runtime, grpo_step
    cfg = PipelineConfig(steps=3, lr=1e-2, objective=Objective(entropy_coef=1e-3, behave_cap=1.5),
                         trainer_ranks=mesh.size(), expert_parallel=mesh.size())
    rt, ref = build_runtime(MOE, cfg, group=dist.group.WORLD)
    split = [m.num_local_experts for m in rt.model.modules() if hasattr(m, "num_local_experts")]
    start = {n: t.clone() for n, t in rt.export_weights(dtype=torch.float32)}
    world, rank = mesh.size(), mesh.get_local_rank()
    log = [grpo_step(rt, _groups(step, informative), cfg.objective, version=step, pad_id=12, ref=ref, rank=rank,
                     world=world, group=dist.group.WORLD)
           for step, informative in ((0, 1), (1, 3), (2, 4))]
    return log, split, start, {n: t.clone() for n, t in rt.export_weights(dtype=torch.float32)}


def test_two_ranks_make_the_one_rank_update(tmp_path):
    one, = spawn(1, "two_steps", tmp_path, module=__name__)
    two = spawn(2, "two_steps", tmp_path, module=__name__)
    assert [m["groups_kept"] for m in one] == [1, 3]
    for rank_log in two:
        for a, b in zip(rank_log, one):
            for key in KEYS:
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-8), (a["version"], key)
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in one)


def test_expert_parallel_over_two_ranks_makes_the_one_rank_update(tmp_path):
    (one, split1, w0, w1), = spawn(1, "moe_steps", tmp_path, module=__name__)
    two = spawn(2, "moe_steps", tmp_path, module=__name__)
    assert [m["groups_kept"] for m in one] == [1, 3, 4] and split1 == [8, 8]
    for rank_log, split2, start, w2 in two:
        assert split2 == [4, 4]  # each rank holds half of each layer's experts
        for a, b in zip(rank_log, one):
            for key in KEYS:
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-8), (a["version"], key)
        assert w2.keys() == w1.keys() and any(".experts." in n for n in w1)
        for name in w1:  # the same start; then the same update up to rounding. Adam can move an element
            # whose gradient is rounding noise by up to lr either way, so compare the update's norm, not elements
            assert torch.equal(start[name], w0[name]), name
            update = (w1[name] - w0[name]).norm()
            assert (w2[name] - w1[name]).norm() <= 1e-3 * update + 1e-7, (name, float(update))
