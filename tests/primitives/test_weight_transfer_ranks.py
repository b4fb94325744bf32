"""Weight transfer across gloo ranks: trainer ranks (FSDP2 over 1, 2 and 4 ranks, with and
without EP = 2) to rollout ranks (a vLLM-style engine at TP 1, 2 and 4, experts over EP 2,
transformers' own model; Qwen3, Qwen3-MoE, Qwen3.5-MoE, DeepSeek-V3), sync and async, p2p against
its broadcast twin; after every transfer each rollout parameter equals, bit for bit, what its own
load_weights makes of the HF checkpoint of that version, whether the receiver stages the update
or lands it in place behind a backup (`commit="undo"`; `"undo_ahead"`: the backup taken after the previous
update, again in the update's window where a target was written since). Failures (a receiver that raises
mid-update, in either commit mode, a dtype mismatch, a missing and an extra tensor, an update started while one is in
flight, a sender killed mid-update) raise on every rank with the previous weights intact; 100
updates run with flat memory; an async poll is woken by the publish, never by a poll interval."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from bumblebee import models, registry
from bumblebee.primitives.weight_transfer import Link, P2PTransfer, TransferError, TransferInFlight
from tests.limits import SUBPROCESS_TIMEOUT_S as LIMIT
from tests.primitives import weight_transfer_ranks as R
from tests.primitives.weight_transfer_engines import VllmStyleEngine

MOD = __name__
MOE = "qwen3-moe-tiny"


def _clone(targets):
    return {k: t.detach().clone() for k, t in targets.items()}


def _same(a, b):
    return all(torch.equal(a[k], b[k]) for k in b)


_error = R.transfer_error


def _raise_at(r0):
    def hook(r):
        if r == r0:
            raise RuntimeError("receiver failed mid-update")
    return hook


def main4(ctx):
    """2 trainer ranks (FSDP2, EP 2) -> 2 rollout ranks holding three engines: TP 2, EP 2, and TP 2
    again for the twin."""
    p2p = registry.resolve("weight_transfer", P2PTransfer(budget_bytes=32 << 10, timeout_s=LIMIT))
    # the EP engine's link packs and sends in turn (one send buffer), the others double-buffered
    single = registry.resolve("weight_transfer", P2PTransfer(budget_bytes=32 << 10, timeout_s=LIMIT, send_buffers=1))
    async_ = registry.resolve("weight_transfer", P2PTransfer(mode="async", budget_bytes=32 << 10, timeout_s=LIMIT))
    # rounds land in place, the update kept a transaction by a backup
    undo = registry.resolve("weight_transfer", P2PTransfer(budget_bytes=32 << 10, timeout_s=LIMIT, commit="undo"))
    ahead = registry.resolve("weight_transfer", P2PTransfer(budget_bytes=32 << 10, timeout_s=LIMIT, commit="undo_ahead"))
    twin = registry.resolve("weight_transfer", "broadcast")
    link = {k: Link(ctx.trainers, ctx.rollouts, name=k)
            for k in ("tp", "ep", "bc", "missing", "extra", "async", "undo", "ahead")}
    res = {"errors": {}, "snaps": {}, "full": {}}
    if ctx.is_trainer:
        model, state, _ = R.trainer_state(ctx, MOE, ep=True)
        end = {"tp": p2p(link["tp"]), "ep": single(link["ep"]), "undo": undo(link["undo"]), "ahead": ahead(link["ahead"])}

        def step(v, links=("tp", "ep", "undo", "ahead")):
            R.train_step(model, state, v)
            sh = R.shards(model, state)
            for k in links:
                end[k].update(sh, v)
            full = R.hf_full(model, state)
            if ctx.rank == 0:
                res["full"][v] = full
        step(1)
        step(2)
        b = twin(link["bc"])
        b.update(R.shards(model, state), 2)
        res["bytes"] = {"p2p": end["tp"].stats["bytes_sent"], "broadcast": b.stats["bytes_sent"]}
        res["send_buffers"] = {k: (len(e.mover.send_bufs), e.plan.rounds) for k, e in end.items() if k in ("tp", "ep")}
        res["prepacked"] = end["tp"].mover.last_prepacked  # round 0 packed while the agreement was out
        R.train_step(model, state, 3)  # new values, so that the rollout's in-place writes show
        res["errors"]["undo"] = _error(lambda: end["undo"].update(R.shards(model, state), 3))
        res["errors"]["ahead"] = _error(lambda: end["ahead"].update(R.shards(model, state), 3))
        res["errors"]["raises"] = _error(lambda: end["tp"].update(R.shards(model, state), 3))
        sh = R.shards(model, state)
        if ctx.rank == 1:
            sh[0] = SimpleNamespace(**{**vars(sh[0]), "tensor": sh[0].tensor.to(torch.bfloat16)})
        res["errors"]["dtype"] = _error(lambda: end["tp"].update(sh, 4))
        step(5, ("tp", "ahead"))
        end["tp"].ctl.collect("in-flight-tried", ctx.rollouts)  # the rollout's second update was refused
        step(6, ("tp",))
        sh = R.shards(model, state)
        res["errors"]["missing"] = _error(lambda: p2p(link["missing"]).update(
            [s for s in sh if s.name != "lm_head.weight"], 7))
        extra = SimpleNamespace(name="model.extra.weight", tensor=torch.ones(3), shape=(3,), offsets=(0,), replicated=True)
        res["errors"]["extra"] = _error(lambda: p2p(link["extra"]).update(sh + [extra], 8))
        a = async_(link["async"])
        for v in range(10, 10 if ctx.params.get("skip_async") else 14):
            R.train_step(model, state, v)
            a.publish(R.shards(model, state), v)
            if v == 11:  # the rollout starts polling only now: a publish that waited on it would time out
                a.ctl.post("two-published", ctx.rank, True)
            full = R.hf_full(model, state)
            if ctx.rank == 0:
                res["full"][v] = full
            time.sleep(0.1)
        a.ctl.collect("async-done", [ctx.rollouts[0]])
        a.close()
        return res
    R.other_meshes(ctx, ep=True)
    man = R.manifest_of_model(MOE)
    eng = {"tp": R.engine(ctx, MOE, man), "ep": R.engine(ctx, MOE, man, ep=True), "bc": R.engine(ctx, MOE, man),
           "undo": R.engine(ctx, MOE, man), "ahead": R.engine(ctx, MOE, man)}
    end = {k: {"ep": single, "undo": undo, "ahead": ahead}.get(k, p2p)(link[k], load_weights=e[0], targets=e[1],
                                                                      layout_key=e[2])
           for k, e in eng.items() if k != "bc"}
    snap = res["snaps"]
    for _ in (1, 2):
        for k in ("tp", "ep", "undo", "ahead"):
            v = end[k].update()
            snap[(k, v)] = _clone(eng[k][1])  # (a[f()] = g() runs g first: update before the clone)
    twin(link["bc"], load_weights=eng["bc"][0], targets=eng["bc"][1]).update()
    snap[("bc", 2)] = _clone(eng["bc"][1])
    ut, seen = eng["undo"][1], {}

    def midway(r):  # before the last round: the earlier rounds are in place; then the last rank fails
        if r == end["undo"].plan.rounds - 1:
            seen["mid"] = _clone(ut)
            if ctx.rank == ctx.rollouts[-1]:
                raise RuntimeError("receiver failed mid-update")
    end["undo"].on_round = midway
    res["errors"]["undo"] = _error(end["undo"].update)
    res["undo_wrote"] = not _same(seen["mid"], snap[("undo", 2)])
    res["intact"] = {"undo": _same(ut, snap[("undo", 2)])}
    # undo_ahead: update 1 backed up in its window, update 2 behind the backup taken after update 1
    mover, at = end["ahead"].mover, eng["ahead"][1]
    res["ahead_windows"] = [mover.window_backups]

    def midway_ahead(r):
        if r == end["ahead"].plan.rounds - 1:
            seen["mid_ahead"] = _clone(at)
            if ctx.rank == ctx.rollouts[-1]:
                raise RuntimeError("receiver failed mid-update")
    end["ahead"].on_round = midway_ahead
    res["errors"]["ahead"] = _error(end["ahead"].update)  # restored from the backup taken after update 2
    end["ahead"].on_round = None
    res["ahead_wrote"] = not _same(seen["mid_ahead"], snap[("ahead", 2)])
    res["intact"]["ahead"] = _same(at, snap[("ahead", 2)])
    res["ahead_windows"].append(mover.window_backups)
    tp = eng["tp"][1]
    if ctx.rank == ctx.rollouts[-1]:
        end["tp"].on_round = _raise_at(0)
    res["errors"]["raises"] = _error(end["tp"].update)
    end["tp"].on_round = None
    res["intact"]["raises"] = _same(tp, snap[("tp", 2)])
    res["errors"]["dtype"] = _error(end["tp"].update)
    res["intact"]["dtype"] = _same(tp, snap[("tp", 2)])
    v = end["tp"].update()
    snap[("tp", v)] = _clone(tp)
    next(iter(at.values())).add_(1.0)  # a write since the backup taken ahead: this update backs up in its window
    v = end["ahead"].update()
    snap[("ahead", v)] = _clone(at)
    res["ahead_windows"].append(mover.window_backups)
    th = threading.Thread(target=lambda: snap.__setitem__(("tp", 6), (end["tp"].update(), _clone(tp))))
    th.start()  # waits for update 6, which the trainer sends once every rank tried a second one
    while not end["tp"]._busy.locked():  # the thread's update has begun
        time.sleep(0.01)
    res["errors"]["in_flight"] = _error(end["tp"].update)
    end["tp"].ctl.post("in-flight-tried", ctx.rank, True)
    th.join()
    res["v6"], snap[("tp", 6)] = snap[("tp", 6)]
    for k in ("missing", "extra"):
        lw, targets, key = eng["tp"]
        res["errors"][k] = _error(lambda: p2p(link[k], load_weights=lw, targets=targets, layout_key=key).update())
        res["intact"][k] = _same(tp, snap[("tp", 6)])
    a = async_(link["async"], load_weights=eng["tp"][0], targets=tp, layout_key=eng["tp"][2])
    got, deadline = [], time.time() + LIMIT
    if not ctx.params.get("skip_async"):
        a.ctl.collect("two-published", ctx.trainers)
    while not ctx.params.get("skip_async") and a.version != 13 and time.time() < deadline:
        v = a.poll()
        if v is not None:
            got.append(v)
            snap[("async", v)] = _clone(tp)
        time.sleep(0.25)  # a slow rollout (slower than the trainer's 0.1 s steps): some versions are skipped
    if ctx.rank == ctx.rollouts[0]:
        a.ctl.post("async-done", ctx.rank, True)
    res["async"] = got
    return res


@pytest.fixture(scope="module")
def main(tmp_path_factory):
    return R.spawn(2, 2, MOD, "main4", tmp_path_factory.mktemp("wt"), timeout_s=LIMIT)


def _want(full, rollout_index, **kw):
    e = VllmStyleEngine(R.manifest_of_model(MOE), models.NAMED[MOE], tp_rank=rollout_index, tp_size=2, **kw)
    e.load_weights(iter(full.items()))
    return e.params


def test_fsdp2_ep_trainer_to_tp_and_ep_engines_bitwise(main):
    full = main[0]["full"]
    for i, rank in enumerate((2, 3)):
        for v in (1, 2):
            assert _same(main[rank]["snaps"][("tp", v)], _want(full[v], i)), (rank, v)
            assert _same(main[rank]["snaps"][("ep", v)], _want(full[v], i, ep_rank=i, ep_size=2)), (rank, v)
            assert _same(main[rank]["snaps"][("undo", v)], _want(full[v], i)), (rank, v)  # landed in place
        assert _same(main[rank]["snaps"][("tp", 5)], _want(full[5], i))
        for v in (1, 2, 5):  # landed in place behind a backup taken ahead, or in the window
            assert _same(main[rank]["snaps"][("ahead", v)], _want(full[v], i)), (rank, v)
        assert _same(main[rank]["snaps"][("tp", 6)], _want(full[6], i))
    for rank in (0, 1):  # both send paths ran, over several rounds: tp double-buffered, ep one buffer
        (tp_bufs, tp_rounds), (ep_bufs, ep_rounds) = main[rank]["send_buffers"]["tp"], main[rank]["send_buffers"]["ep"]
        assert (tp_bufs, ep_bufs) == (2, 1) and tp_rounds > 2 and ep_rounds > 2, main[rank]["send_buffers"]
        assert main[rank]["prepacked"] > 0


def test_twin_gives_the_same_weights_for_more_bytes(main):
    for rank in (2, 3):
        assert _same(main[rank]["snaps"][("bc", 2)], main[rank]["snaps"][("tp", 2)])
    sent = [main[r]["bytes"] for r in (0, 1)]
    p2p, bc = sum(s["p2p"] for s in sent), sum(s["broadcast"] for s in sent)
    assert p2p * 1.9 < bc, (p2p, bc)  # TP 2: each rank keeps about half of what the twin sends it


def test_failures_raise_everywhere_and_keep_the_previous_weights(main):
    for case, words in (("raises", "receiver failed mid-update"), ("undo", "receiver failed mid-update"),
                        ("ahead", "receiver failed mid-update"),
                        ("dtype", "changed since the plan"),
                        ("missing", "['lm_head.weight'] receive nothing"), ("extra", "KeyError: 'model.extra.weight'")):
        for rank, r in enumerate(main):
            assert r["errors"][case] is not None and words in r["errors"][case], (case, rank, r["errors"][case])
        for rank in (2, 3):
            assert main[rank]["intact"][case], (case, rank)
    for rank in (2, 3):
        assert main[rank]["errors"]["in_flight"].startswith("TransferInFlight"), main[rank]["errors"]["in_flight"]
        assert main[rank]["undo_wrote"], rank  # the undo update had written rounds in place, then put them back
        assert main[rank]["ahead_wrote"], rank
        # update 1 in its window; 2 and the failed 3 behind backups taken ahead; 5 (a target written since) in its window
        assert main[rank]["ahead_windows"] == [1, 1, 2], main[rank]["ahead_windows"]


def test_async_rollout_polls_the_newest_version(main):
    full = main[0]["full"]
    for i, rank in enumerate((2, 3)):
        got = main[rank]["async"]
        assert got and got[-1] == 13 and got == sorted(set(got)), got
        for v in got:
            assert _same(main[rank]["snaps"][("async", v)], _want(full[v], i)), (rank, v)
    assert main[2]["async"] == main[3]["async"]  # the rollout ranks move together
    # the trainers published 10 and 11 before any rollout rank polled (a publish that waited on the
    # rollout would have timed out the rollout's wait): its first poll gets 11 or newer
    assert main[2]["async"][0] >= 11, main[2]["async"]


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def one3(ctx):
    """1 trainer rank (FSDP2 on one rank) -> 2 rollout ranks, each with a TP 2 vLLM-style engine (the
    non-transactional mode) and a whole transformers model (replicas); then 100 updates into the
    transformers models."""
    name = "qwen3-tiny"
    cfg = {"tp": P2PTransfer(budget_bytes=64 << 10, timeout_s=LIMIT, transactional=False),  # rounds land at once
           "hf": P2PTransfer(budget_bytes=1 << 20, timeout_s=LIMIT),
           # a poll interval as long as the whole test: an update that waited on one would time out
           "wake": P2PTransfer(mode="async", timeout_s=LIMIT, poll_s=LIMIT)}
    p2p = {k: registry.resolve("weight_transfer", c) for k, c in cfg.items()}
    link = {k: Link(ctx.trainers, ctx.rollouts, name=k) for k in ("tp", "hf")}
    wake = Link(ctx.trainers, ctx.rollouts, name="wake")
    res = {"full": {}, "snaps": {}, "rss": []}
    if ctx.is_trainer:
        model, state, _ = R.trainer_state(ctx, name)
        end = {k: p2p[k](link[k]) for k in link}
        R.train_step(model, state, 1)
        for k in link:
            end[k].update(R.shards(model, state), 1)
        res["full"][1] = R.hf_full(model, state)
        params = [p for p in state.masters().values()]
        sh = R.shards(model, state)  # fp32 shards are views of the masters: one export serves every update
        for v in range(2, 102):
            with torch.no_grad():  # a cheap stand-in for a step: every weight moves
                for p in params:
                    p.to_local().add_(1e-3)
            end["hf"].update(sh, v)
            if v in (21, 101):
                res["rss"].append(_rss_mib())
        res["full"][101] = R.hf_full(model, state)
        a = p2p["wake"](wake)
        a.ctl.collect("waiting", [ctx.rollouts[0]])  # the rollout is (about to be) waiting in poll
        a.publish(sh, 200)
        a.ctl.collect("woke", ctx.rollouts)
        a.close()
        res["polls"] = a.ctl.polls
        return res
    R.other_meshes(ctx, ep=False)
    man = R.manifest_of_model(name)
    eng = {"tp": R.engine(ctx, name, man), "hf": R.engine(ctx, name, man, kind="hf")}
    end = {k: p2p[k](link[k], load_weights=e[0], targets=e[1], layout_key=e[2]) for k, e in eng.items()}
    for k in link:
        v = end[k].update()
        res["snaps"][(k, v)] = _clone(eng[k][1])
    for v in range(2, 102):
        assert end["hf"].update() == v
        if v in (21, 101):
            res["rss"].append(_rss_mib())
    res["snaps"][("hf", 101)] = _clone(eng["hf"][1])
    res["staged"] = end["hf"].stats["staged_bytes"]
    lw, targets, key = R.engine(ctx, name, man)
    b = p2p["wake"](wake, load_weights=lw, targets=targets, layout_key=key)
    if ctx.rank == ctx.rollouts[0]:
        b.ctl.post("waiting", ctx.rank, True)
    res["woken"] = b.poll(wait_s=LIMIT)  # returns on the publish (event-driven), not on a poll tick
    res["snaps"][("wake", res["woken"])] = _clone(targets)
    b.ctl.post("woke", ctx.rank, True)
    res["polls"] = b.ctl.polls
    return res


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    return R.spawn(1, 2, MOD, "one3", tmp_path_factory.mktemp("wt1"), timeout_s=LIMIT)


def test_one_trainer_to_tp2_engine_and_transformers_replicas(one):
    full = one[0]["full"]
    man = R.manifest_of_model("qwen3-tiny")
    for i, rank in enumerate((1, 2)):
        e = VllmStyleEngine(man, models.NAMED["qwen3-tiny"], tp_rank=i, tp_size=2)
        e.load_weights(iter(full[1].items()))
        assert _same(one[rank]["snaps"][("tp", 1)], e.params)
        for v in (1, 101):  # transformers' own model: its load_state_dict of the checkpoint
            assert set(one[rank]["snaps"][("hf", v)]) == set(full[v])
            assert all(torch.equal(one[rank]["snaps"][("hf", v)][k], full[v][k]) for k in full[v]), v


def test_async_poll_is_woken_by_the_publish_not_a_poll_interval(one):
    """poll_s is as long as the test's own limit: a wait bounded below by it would never finish."""
    man = R.manifest_of_model("qwen3-tiny")
    for i, rank in enumerate((1, 2)):
        assert one[rank]["woken"] == 200
        e = VllmStyleEngine(man, models.NAMED["qwen3-tiny"], tp_rank=i, tp_size=2)
        e.load_weights(iter(one[0]["full"][101].items()))
        assert _same(one[rank]["snaps"][("wake", 200)], e.params)
    assert [r["polls"] for r in one] == [0, 0, 0]  # no rank paused to poll the store


def test_control_waits_in_the_store_and_times_out_naming_the_late_rank():
    import torch.distributed as dist
    from bumblebee.primitives.weight_transfer.control import Control
    store = dist.HashStore()
    for cloneable in (True, False):  # False: a store without clone(), polled with a backoff
        ctl = Control(store, f"c{cloneable}/", (0, 1, 2), timeout_s=LIMIT, poll_s=0.001)
        ctl._cloneable = cloneable
        go = threading.Event()
        th = threading.Thread(target=lambda: (go.wait(), ctl.post("k", 1, "one"), ctl.post("k", 2, [2])))
        th.start()
        go.set()
        assert ctl.collect("k", (1, 2)) == {1: "one", 2: [2]}
        th.join()
        with pytest.raises(TransferError, match=r"k: ranks \[0\] did not answer within 0.2 s"):
            ctl.collect("k", (0, 1), timeout_s=0.2)
        if cloneable:
            assert ctl.polls == 0


def test_hundred_updates_keep_memory_flat(one):
    for r in one:
        early, late = r["rss"]
        assert late - early < 16, r["rss"]  # MiB over 80 updates of ~0.9 MB each: no buffer per update
    assert one[1]["staged"] == sum(t.numel() * 4 for t in one[0]["full"][1].values())


def contract2(ctx):
    """Both twins, 1 trainer rank -> 1 rollout rank (a vLLM-style engine), one update each, for Qwen3
    and DeepSeek-V3 (fused_qkv_a_proj, replicated router biases)."""
    impls = ctx.params["impls"]
    from bumblebee.runtime import export
    out = {}
    for name in CONTRACT_MODELS:
        if ctx.is_trainer:
            model = models.build(name, seed=0)
            for i, impl in enumerate(impls):
                registry.resolve("weight_transfer", impl)(Link(ctx.trainers, ctx.rollouts, name=f"{name}{i}")).update(
                    list(export.export_weight_shards(model, None)), 1)
            out[name] = {k: v.clone() for k, v in export.export_weights(model, None, bucket_bytes=1 << 30)}
            continue
        man = R.manifest_of_model(name)
        for i, impl in enumerate(impls):
            lw, targets, key = R.engine(ctx, name, man)
            registry.resolve("weight_transfer", impl)(Link(ctx.trainers, ctx.rollouts, name=f"{name}{i}"),
                                                      load_weights=lw, targets=targets, layout_key=key).update()
            out[(name, impl)] = _clone(targets)
    return out


CONTRACT_MODELS = ("qwen3-tiny", "deepseek-v3-tiny")


def contract(name: str, twin: str, out_dir) -> None:
    """The twin contract of weight_transfer: both give the rollout, bit for bit, what its own
    load_weights makes of the checkpoint."""
    r = R.spawn(1, 1, MOD, "contract2", out_dir, impls=(name, twin))
    for model in CONTRACT_MODELS:
        e = VllmStyleEngine(R.manifest_of_model(model), models.NAMED[model])
        e.load_weights(iter(r[0][model].items()))
        if model.startswith("deepseek"):  # the router biases travel too
            assert any(k.endswith("e_score_correction_bias") for k in e.params)
        for impl in (name, twin):
            assert _same(r[1][(model, impl)], e.params), (model, impl)


FOUR_JOBS = ((MOE, True, ((1, 0), (4, 0), (4, 1), (4, 2), (4, 3))),  # FSDP2 x 4 with EP 2 -> TP 1 and TP 4
             ("deepseek-v3-tiny", False, ((2, 0), (2, 1))),  # FSDP2 x 4 without EP -> TP 2
             ("qwen3.5-moe-tiny", False, ((2, 1), (1, 0))))  # in_proj_qkvz, conv, A_log; TP 1: then a rank dies
DEAD_TIMEOUT_S = 5.0


def four5(ctx):
    """4 trainer ranks -> 1 rollout rank, which plays every rank of each rollout layout in turn (one
    link per TP rank: the plan and the bytes of a rollout rank depend on its own layout only). Last,
    trainer rank 3 dies in the middle of a Qwen3.5-MoE update: the survivors raise within the timeout."""
    p2p = registry.resolve("weight_transfer", P2PTransfer(budget_bytes=32 << 10, timeout_s=LIMIT))
    short = registry.resolve("weight_transfer", P2PTransfer(budget_bytes=16 << 10, timeout_s=DEAD_TIMEOUT_S))
    res = {}
    for name, ep, layouts in FOUR_JOBS:
        links = {(tp, r): Link(ctx.trainers, ctx.rollouts, name=f"{name}-tp{tp}-{r}") for tp, r in layouts}
        last = name == FOUR_JOBS[-1][0]
        if ctx.is_trainer:
            model, state, _ = R.trainer_state(ctx, name, ep=ep)
            sh = R.shards(model, state)
            ends = [(short if last and tp == 1 else p2p)(link) for (tp, _), link in links.items()]
            for end in ends:
                end.update(sh, 1, timeout_s=LIMIT)  # waits on the rollout's layout inference
            full = R.hf_full(model, state)
            res[name] = full if ctx.rank == 0 else None
            if not last:
                continue
            end = ends[-1]
            if ctx.rank == 3:
                import os
                end.on_round = lambda r: os._exit(0) if r == 1 else None
            end.ctl.post("sending", ctx.rank, True)  # the rollout starts its clock with ours
            t0 = time.perf_counter()
            res["error"] = _error(lambda: end.update(sh, 2))
            res["took"] = time.perf_counter() - t0
            return res
        R.other_meshes(ctx, ep=ep)
        man = R.manifest_of_model(name)
        for (tp, r), link in links.items():
            eng = VllmStyleEngine(man, models.NAMED[name], tp_rank=r, tp_size=tp)
            end = (short if last and tp == 1 else p2p)(link, load_weights=eng.load_weights, targets=eng.params,
                                                       layout_key=f"tp{r}/{tp}")
            end.update(timeout_s=LIMIT)  # waits on the trainer's FSDP2 set-up
            res[(name, tp, r)] = _clone(eng.params)
    end.ctl.collect("sending", ctx.trainers, timeout_s=LIMIT)
    t0 = time.perf_counter()
    res["error"] = _error(end.update)
    res["took"] = time.perf_counter() - t0
    res["intact"] = _same(eng.params, res[(name, tp, r)])
    res["after"] = _error(end.update)  # the endpoint knows it is unusable
    return res


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return R.spawn(4, 1, MOD, "four5", tmp_path_factory.mktemp("wt4"), timeout_s=LIMIT)


def test_four_trainer_ranks_to_tp1_tp2_tp4_layouts_bitwise(four):
    for name, _, layouts in FOUR_JOBS:
        man = R.manifest_of_model(name)
        for tp, rank in layouts:
            e = VllmStyleEngine(man, models.NAMED[name], tp_rank=rank, tp_size=tp)
            e.load_weights(iter(four[0][name].items()))
            assert _same(four[4][(name, tp, rank)], e.params), (name, tp, rank)


def test_dead_sender_raises_everywhere_within_the_timeout(four):
    assert four[3] == {"dead": True}
    for rank in (0, 1, 2, 4):
        r = four[rank]
        assert r["error"] is not None and r["took"] < 3 * DEAD_TIMEOUT_S, (rank, r["error"], r["took"])
    assert four[4]["intact"] and "unusable" in four[4]["after"]


def close3(ctx):
    """2 trainer ranks -> 1 rollout rank, async. The trainers' services wait on one shared request key;
    trainer 0 closes first (its store deletes stubbed out, so nothing it posts goes away) and trainer
    1's service must start no transfer before trainer 1 closes."""
    name = "qwen3-tiny"
    make = registry.resolve("weight_transfer", P2PTransfer(mode="async", timeout_s=LIMIT))
    link = Link(ctx.trainers, ctx.rollouts, name="close")
    res = {}
    if ctx.is_trainer:
        model, state, _ = R.trainer_state(ctx, name)
        a = make(link)
        a.publish(R.shards(model, state), 1)
        a.ctl.collect("got", ctx.rollouts)
        n = a.n  # the service's transfer count: it moves when the service starts a transfer
        if ctx.rank == ctx.trainers[0]:
            a.ctl.forget = lambda *args: None
            a.close()
            a.ctl.post("closed", ctx.rank, True)
            a.ctl.collect("done", [ctx.trainers[1]])  # rank 0 hosts the store: it leaves last
            return res
        a.ctl.collect("closed", [ctx.trainers[0]])
        time.sleep(0.5)  # the service wakes on a store key within milliseconds
        res["entered"] = a.n - n
        if res["entered"] == 0:  # else its service waits in a transfer no rank joins: close() would hang
            a.close()
        res["error"] = None if a.error is None else str(a.error)
        a.ctl.post("done", ctx.rank, True)
        return res
    R.other_meshes(ctx, ep=False)
    lw, targets, key = R.engine(ctx, name, R.manifest_of_model(name))
    b = make(link, load_weights=lw, targets=targets, layout_key=key)
    res["got"] = b.poll(wait_s=LIMIT)
    b.ctl.post("got", ctx.rank, True)
    return res


def test_a_senders_close_does_not_start_another_senders_transfer(tmp_path):
    res = R.spawn(2, 1, MOD, "close3", tmp_path, timeout_s=LIMIT)
    assert res[2]["got"] == 1
    assert res[1] == {"entered": 0, "error": None}
