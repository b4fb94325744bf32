"""Weight transfer over NCCL, one GPU a rank (2 GPUs): a trainer's Qwen3-MoE weights on cuda:1 reach
a vLLM-style engine on cuda:0 bit for bit, twice (the second through the cached copy programs), and
a trainer killed in the middle of an update makes the rollout raise within the endpoint's timeout
with its weights intact, then refuse further updates; with the update staged and with its rounds
landed in place behind a backup (`commit="undo"`: the dead trainer's partial update is put back; `"undo_ahead"`: from
the backup taken after update 2); each agreed through the store and, for stage and undo_ahead, on the
host (`agreement="group"` on a gloo group: the dead trainer never joins the rollout's all-gather). The rollout is rank 0, the host of the control
store, so the dead trainer takes no store with it (as a rollout engine's own process would not)."""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from bumblebee import models, registry
from bumblebee.primitives.weight_transfer import Link, P2PTransfer
from tests.limits import SUBPROCESS_TIMEOUT_S as LIMIT
from tests.primitives import weight_transfer_ranks as R
from tests.primitives.weight_transfer_engines import VllmStyleEngine

pytestmark = pytest.mark.gpu
MOE = "qwen3-moe-tiny"
DEAD_TIMEOUT_S = 5.0


def nccl2(ctx):
    commit, agreement = ctx.params.get("commit", "stage"), ctx.params.get("agreement", "store")
    p2p = registry.resolve("weight_transfer", P2PTransfer(budget_bytes=64 << 10, timeout_s=LIMIT, commit=commit,
                                                          agreement=agreement))
    short = registry.resolve("weight_transfer", P2PTransfer(budget_bytes=16 << 10, timeout_s=DEAD_TIMEOUT_S,
                                                            commit=commit, agreement=agreement))
    # the group vote runs on the host: a gloo group over the link's ranks (every rank makes it, in one order)
    votes = dist.new_group(list(ctx.trainers + ctx.rollouts), backend="gloo") if agreement == "group" else None
    link = Link(ctx.trainers, ctx.rollouts, name="nccl", vote_group=votes)
    dying = Link(ctx.trainers, ctx.rollouts, name="dying", vote_group=votes)
    manifest, res = R.manifest_of_model(MOE), {}
    device = "cuda" if ctx.params.get("cuda") else "cpu"  # cpu: the same scenario over gloo
    if ctx.is_trainer:
        model = models.build(MOE, seed=0).to(device)
        shards = R.shards(model, None)
        end = p2p(link)
        for version in (1, 2):
            if version == 2:
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(1.0)
            end.update(shards, version, timeout_s=LIMIT)
            res[version] = {s.name: s.tensor.detach().cpu().clone() for s in shards}
        end = short(dying)
        end.update(shards, 3, timeout_s=LIMIT)  # the layout is inferred and the plan made: nothing to wait on
        end.ctl.post("sending", ctx.rank, True)
        end.on_round = lambda r: os._exit(0) if r == 2 else None  # round 0 landed on the rollout
        with torch.no_grad():  # new values, so that rounds landed in place show unless put back
            for p in model.parameters():
                p.add_(1.0)
        end.update(shards, 4)
        return res  # not reached: the trainer dies in round 2
    eng = VllmStyleEngine(manifest, models.NAMED[MOE], device=device)
    end = p2p(link, load_weights=eng.load_weights, targets=eng.params, layout_key="nccl")
    for version in (1, 2):
        res[version] = end.update(timeout_s=LIMIT), {k: t.cpu().clone() for k, t in eng.params.items()}
    end = short(dying, load_weights=eng.load_weights, targets=eng.params, layout_key="nccl")
    end.update(timeout_s=LIMIT)
    before = {k: t.cpu().clone() for k, t in eng.params.items()}
    end.ctl.collect("sending", ctx.trainers, timeout_s=LIMIT)
    t0 = time.perf_counter()
    res["error"] = R.transfer_error(end.update)
    res["took"] = time.perf_counter() - t0
    res["intact"] = all(torch.equal(before[k], t.cpu()) for k, t in eng.params.items())
    res["after"] = R.transfer_error(end.update)
    return res


@pytest.fixture(scope="module", params=[("stage", "store"), ("undo", "store"), ("undo_ahead", "store"),
                                        ("stage", "group"), ("undo_ahead", "group")], ids="-".join)
def nccl(request, tmp_path_factory):
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    commit, agreement = request.param
    return R.spawn(1, 1, __name__, "nccl2", tmp_path_factory.mktemp("nccl"), timeout_s=LIMIT, cuda=True,
                   rollout_first=True, commit=commit, agreement=agreement)


def test_updates_over_nccl_equal_the_engines_own_load_weights(nccl):
    rollout, trainer = nccl
    assert trainer == {"dead": True}  # it wrote nothing: killed mid-update, by design
    manifest = R.manifest_of_model(MOE)
    # the trainer's weights of each version, rebuilt on the host: version 1 is seed 0, version 2 adds 1
    model = models.build(MOE, seed=0)
    full = {s.name: s.tensor.detach().clone() for s in R.shards(model, None)}
    for version, add in ((1, 0.0), (2, 1.0)):
        got_version, params = rollout[version]
        ref = VllmStyleEngine(manifest, models.NAMED[MOE])
        ref.load_weights((n, t + add) for n, t in full.items())
        assert got_version == version
        assert all(torch.equal(params[k], ref.params[k]) for k in ref.params), version


def test_a_trainer_killed_mid_update_makes_the_rollout_raise_in_time_intact(nccl):
    rollout = nccl[0]
    assert rollout["error"] is not None and rollout["took"] < 3 * DEAD_TIMEOUT_S, (rollout["error"], rollout["took"])
    assert rollout["intact"] and "unusable" in rollout["after"], rollout["after"]
