"""The async mode's pick race, on 2 gloo ranks (a trainer rank, a rollout rank): the rollout picks the
newest version every sender holds, and before the sender serves it the trainer publishes more versions, so
the picked one is dropped. The rollout's first poll must then pick again and land the newest
version, bit for bit. It must not fail in the plan's setup with a sender manifest of None, and must
not leave the endpoint unusable. The rollout pauses between its pick and its request (a wrapper around
`_newest`) until the trainer has published past it; that makes the race deterministic."""
from __future__ import annotations

import pytest

from bumblebee import models, registry
from bumblebee.primitives.weight_transfer import Link, P2PTransfer
from tests.limits import SUBPROCESS_TIMEOUT_S as LIMIT
from tests.primitives import weight_transfer_ranks as R
from tests.primitives.weight_transfer_engines import VllmStyleEngine

MOD = __name__
NAME = "qwen3-tiny"
WAIT_S = 120.0  # every wait here is a hand-off between two live ranks: seconds, not minutes


def race(ctx):
    async_ = registry.resolve("weight_transfer", P2PTransfer(mode="async", budget_bytes=32 << 10, timeout_s=WAIT_S))
    link = Link(ctx.trainers, ctx.rollouts, name="race")
    res = {}
    if ctx.is_trainer:
        model, state, _ = R.trainer_state(ctx, NAME)
        a = async_(link)
        R.train_step(model, state, 1)
        a.publish(R.shards(model, state), 1)
        a.ctl.collect("picked", ctx.rollouts, timeout_s=WAIT_S)  # the rollout picked version 1
        for v in (2, 3, 4):  # the sender keeps the two newest: version 1 is dropped
            R.train_step(model, state, v)
            a.publish(R.shards(model, state), v)
        res["full"] = R.hf_full(model, state)
        res["held"] = [s[0] for s in a._slots]
        a.ctl.post("dropped", ctx.rank, True)
        a.ctl.collect("done", ctx.rollouts, timeout_s=WAIT_S)
        a.close()
        return res
    R.other_meshes(ctx, ep=False)
    load_weights, targets, key = R.engine(ctx, NAME, R.manifest_of_model(NAME))
    a = async_(link, load_weights=load_weights, targets=targets, layout_key=key)
    picks, newest = [], a._newest

    def paused_newest():  # the first pick waits until the trainer has dropped it
        v = newest()
        if v is not None and not picks:
            picks.append(v)
            a.ctl.post("picked", ctx.rank, v)
            a.ctl.collect("dropped", ctx.trainers, timeout_s=WAIT_S)
        return v
    a._newest = paused_newest
    res["got"] = a.poll(wait_s=WAIT_S)
    res["picks"] = picks
    res["params"] = {k: t.clone() for k, t in targets.items()}
    res["again"] = a.poll()  # the endpoint still works: nothing newer than 4
    a.ctl.post("done", ctx.rank, True)
    return res


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return R.spawn(1, 1, MOD, "race", tmp_path_factory.mktemp("race"), timeout_s=LIMIT)


def test_a_dropped_pick_is_picked_again_and_lands_the_newest_version(ranks):
    trainer, rollout = ranks
    assert 1 not in trainer["held"] and 4 in trainer["held"], "the premise: the sender dropped version 1"
    assert rollout["picks"] == [1]
    assert rollout["got"] == 4
    assert rollout["again"] is None
    want = VllmStyleEngine(R.manifest_of_model(NAME), models.NAMED[NAME], tp_rank=0, tp_size=1)
    want.load_weights(iter(trainer["full"].items()))
    for k, t in want.params.items():
        assert rollout["params"][k].equal(t), k
