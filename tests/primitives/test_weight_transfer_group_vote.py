"""`P2PTransfer(agreement="group")` over gloo (1 trainer -> 1 rollout rank, Qwen3-MoE tiny): the prepare
and the vote as one all-gather on the transfer group. Updates equal the engine's own load_weights bit
for bit and leave no agreement keys in the store; a receiver that raises mid-update and a sender's
dtype change raise the same message on both ranks (the store carries the messages of a failed vote
only) with the previous weights intact, and the endpoint goes on; async mode (the sender's service
thread runs the all-gathers) lands the newest published version bit for bit; a trainer killed
mid-update (the NCCL test's scenario, here over gloo) makes the rollout raise within the timeout,
intact, then refuse."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from bumblebee import models, registry
from bumblebee.primitives.weight_transfer import Link, P2PTransfer
from tests.limits import SUBPROCESS_TIMEOUT_S as LIMIT
from tests.primitives import weight_transfer_ranks as R
from tests.primitives.test_weight_transfer_nccl import DEAD_TIMEOUT_S
from tests.primitives.weight_transfer_engines import VllmStyleEngine

MOE = "qwen3-moe-tiny"


def _agreement_keys(end, n):
    return [k for k in (f"{n}/prep/{end.rank}", f"{n}/vote/{end.rank}") if end.ctl._has(k)]


def flags2(ctx):
    """1 trainer -> 1 rollout: sync updates 1-2, a receiver failing mid-update, a dtype change, update 5, then
    async versions 6-7, all agreed on the group."""
    make = registry.resolve("weight_transfer", P2PTransfer(budget_bytes=32 << 10, timeout_s=LIMIT, agreement="group"))
    published = registry.resolve("weight_transfer", P2PTransfer(mode="async", budget_bytes=32 << 10, timeout_s=LIMIT,
                                                                agreement="group"))
    link, manifest = Link(ctx.trainers, ctx.rollouts, name="group"), R.manifest_of_model(MOE)
    res = {"errors": {}, "rank": ctx.rank}
    link_async = Link(ctx.trainers, ctx.rollouts, name="group-async")
    alone = dist.new_group([ctx.trainers[0]])  # every rank makes it, in one order
    try:  # a vote group that leaves out a rank of the link is refused before any update
        eng = None if ctx.is_trainer else VllmStyleEngine(manifest, models.NAMED[MOE])
        kw = {} if eng is None else {"load_weights": eng.load_weights, "targets": eng.params}
        make(Link(ctx.trainers, ctx.rollouts, name="alone", vote_group=alone), **kw)
        res["alone"] = None
    except ValueError as e:
        res["alone"] = str(e)
    if ctx.is_trainer:
        model = models.build(MOE, seed=0)
        shards = R.shards(model, None)
        end = make(link)
        for version in (1, 2):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
            end.update(shards, version, timeout_s=LIMIT)
            res[version] = {s.name: s.tensor.detach().clone() for s in shards}
        res["keys"] = _agreement_keys(end, 1)
        res["errors"]["raises"] = R.transfer_error(lambda: end.update(shards, 3))
        res["failed_keys"] = _agreement_keys(end, 2)  # the failed vote's messages went through the store
        bad = [SimpleNamespace(**{**vars(shards[0]), "tensor": shards[0].tensor.to(torch.bfloat16)})] + shards[1:]
        res["errors"]["dtype"] = R.transfer_error(lambda: end.update(bad, 4))
        res["after"] = end.update(shards, 5)
        res["left_keys"] = _agreement_keys(end, 2) + _agreement_keys(end, 3)  # forgotten by the next updates
        a = published(link_async)
        for version in (6, 7):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
            a.publish(shards, version)
            res[version] = {s.name: s.tensor.detach().clone() for s in shards}
        a.ctl.post("published", ctx.rank, True)
        a.ctl.collect("polled", ctx.rollouts, timeout_s=LIMIT)
        a.close()
        return res
    eng = VllmStyleEngine(manifest, models.NAMED[MOE])
    end = make(link, load_weights=eng.load_weights, targets=eng.params, layout_key="group")
    for version in (1, 2):
        res[version] = end.update(timeout_s=LIMIT), {k: t.clone() for k, t in eng.params.items()}
    res["keys"] = _agreement_keys(end, 1)
    end.on_round = lambda r: (_ for _ in ()).throw(RuntimeError("receiver failed mid-update")) if r == 0 else None
    res["errors"]["raises"] = R.transfer_error(end.update)
    res["failed_keys"] = _agreement_keys(end, 2)
    end.on_round = None
    res["intact_raises"] = all(torch.equal(res[2][1][k], t) for k, t in eng.params.items())
    res["errors"]["dtype"] = R.transfer_error(end.update)
    res["intact_dtype"] = all(torch.equal(res[2][1][k], t) for k, t in eng.params.items())
    res["after"] = end.update()
    res["left_keys"] = _agreement_keys(end, 2) + _agreement_keys(end, 3)
    a = published(link_async, load_weights=eng.load_weights, targets=eng.params, layout_key="group")
    a.ctl.collect("published", ctx.trainers, timeout_s=LIMIT)
    res["async"] = a.poll(wait_s=LIMIT), {k: t.clone() for k, t in eng.params.items()}
    a.ctl.post("polled", ctx.rank, True)
    return res


@pytest.fixture(scope="module")
def flags(tmp_path_factory):
    return R.spawn(1, 1, __name__, "flags2", tmp_path_factory.mktemp("group"), timeout_s=LIMIT)


def test_group_agreement_updates_bitwise_with_no_store_votes(flags):
    trainer, rollout = flags
    manifest = R.manifest_of_model(MOE)
    for version in (1, 2):
        got_version, params = rollout[version]
        ref = VllmStyleEngine(manifest, models.NAMED[MOE])
        ref.load_weights(iter(trainer[version].items()))
        assert got_version == version and all(torch.equal(params[k], ref.params[k]) for k in ref.params), version
    assert trainer["keys"] == [] and rollout["keys"] == []  # prepare and vote went over the group
    for side in (trainer, rollout):
        assert side["alone"] and "vote_group must span exactly the link's ranks" in side["alone"], side["alone"]
    got_version, params = rollout["async"]  # async: the newest published version, served by the sender's thread
    ref = VllmStyleEngine(manifest, models.NAMED[MOE])
    ref.load_weights(iter(trainer[7].items()))
    assert got_version == 7 and all(torch.equal(params[k], ref.params[k]) for k in ref.params)


def test_group_agreement_failures_raise_the_same_message_everywhere_intact(flags):
    trainer, rollout = flags
    for case, words in (("raises", "receiver failed mid-update"), ("dtype", "changed since the plan")):
        assert trainer["errors"][case] is not None and words in trainer["errors"][case], trainer["errors"][case]
        assert trainer["errors"][case] == rollout["errors"][case]
        assert rollout[f"intact_{case}"], case
    assert trainer["after"] == rollout["after"] == 5  # a flagged failure leaves the endpoints usable
    for side in (trainer, rollout):  # a failure's messages go through the store, and are forgotten after
        assert side["failed_keys"] == [f"2/vote/{side['rank']}"] and side["left_keys"] == [], side


@pytest.fixture(scope="module")
def dying(tmp_path_factory):
    return R.spawn(1, 1, "tests.primitives.test_weight_transfer_nccl", "nccl2", tmp_path_factory.mktemp("dying"),
                   timeout_s=LIMIT, rollout_first=True, commit="undo_ahead", agreement="group")


def test_group_agreement_with_a_killed_trainer_raises_in_time_intact(dying):
    rollout, trainer = dying
    assert trainer == {"dead": True}
    assert rollout["error"] is not None and rollout["took"] < 3 * DEAD_TIMEOUT_S, (rollout["error"], rollout["took"])
    assert rollout["intact"] and "unusable" in rollout["after"], rollout["after"]


class _GpuOnlyGroup:
    """A group whose only backend is a device one (as `init_process_group("nccl")` makes)."""

    def _get_backend(self, device):
        raise RuntimeError(f"No backend type associated with device type {device.type}")


def test_group_agreement_refuses_a_group_without_a_cpu_backend():
    from bumblebee.primitives.weight_transfer.control import vote_group_of
    with pytest.raises(ValueError, match=r"votes on the host: Link.vote_group .* backend='gloo'"):
        vote_group_of(Link((0,), (1,), vote_group=_GpuOnlyGroup()))
    with pytest.raises(ValueError, match="got group without one"):
        vote_group_of(Link((0,), (1,), group=_GpuOnlyGroup()))
