"""The asynchronous pipeline on a local Ray (2 CPUs): a tiny Qwen3 learns to copy two digits at
eta = 1 while a producer is killed mid-run (every prompt trained exactly once) and stalled waits
raise PipelineTimeout; eta = 0 makes the plain synchronous loop's updates with weights sent by the
transfer primitive, with the trainer over two ranks (FSDP2 inside its actors), with both, and for an
MoE model with its experts split over the trainer's ranks (with either weight channel); a run
stops where its `until` first holds. Skipped without Ray (the `rl` extra)."""
from __future__ import annotations

import dataclasses
import math
import statistics
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

ray = pytest.importorskip("ray", reason="the RL pipeline needs Ray: pip install -e '.[rl]'")

from bumblebee import models  # noqa: E402
from bumblebee.runtime.pipeline import (CopyDigits, Objective, Pipeline, PipelineConfig, PipelineTimeout,  # noqa: E402
                                        Sampling)
from tests.limits import SUBPROCESS_TIMEOUT_S  # noqa: E402

TASK = CopyDigits(length=2)
CONFIG = {**models.NAMED["qwen3-tiny"], "vocab_size": 16, "bos_token_id": TASK.bos_id, "pad_token_id": TASK.pad_id,
          "eos_token_id": None}
STEPS, WINDOW, MARGIN = 40, 8, 0.15
STALL_S = 2.0  # these waits are meant to stall: the limit is how long the test takes, not a speed bet


def _cfg(**kw):
    base = dict(steps=STEPS, groups_per_step=16, group_size=8, groups_per_call=8, eta=1, lr=5e-3, seed=0,
                impl={"cross_entropy": "linear_ce"}, sampling=Sampling(max_new_tokens=TASK.length),
                objective=Objective(entropy_coef=1e-3))
    return PipelineConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _stalled_waits_raise(p):
    """On the run's own actors (no extra start-up), waits that cannot end raise PipelineTimeout
    within their limits, leaving the run intact."""
    from bumblebee.runtime.pipeline.weights import ObjectStoreChannel, get
    t0 = time.monotonic()
    with pytest.raises(PipelineTimeout, match=f"step {STEPS - 1}: 0 of 16 groups.*take_timeout_s"):
        ray.get(p.scheduler.take.remote(STEPS - 1, STALL_S))  # its prompts are not even admitted yet
    with pytest.raises(PipelineTimeout, match="no weights newer than version 99.*weight_timeout_s"):
        ObjectStoreChannel(p.store, STALL_S).wait_newer(SimpleNamespace(version=99), STALL_S)  # never published
    with pytest.raises(PipelineTimeout, match="a weight sync: no answer"):
        get(p.store.wait_newer.remote(99, 10 * STALL_S), STALL_S, "a weight sync")  # a remote call that hangs
    assert time.monotonic() - t0 < 10 * STALL_S  # three waits of STALL_S each, with room for a loaded machine


def test_learns_asynchronously_with_a_producer_killed(local_ray, tmp_path):
    """Seeded, but the interleaving is the machine's, so the run is not reproducible bit for bit: the
    margin is over 10 standard errors of the difference of two window means under the initial
    policy (a step's mean reward 0.07 +- 0.02), and half the rise measured at eta = 1 (0.27 from
    0.07; eta = 2 rose 0.20 and plateaus lower, eta = 0 0.28: skills/rl-pipeline/SKILL.md)."""
    def kill(pipeline, step):
        if step == 12:
            pipeline.kill_producer(0)

    with Pipeline(_cfg(producers=1, restarts=1), CONFIG, TASK) as p:
        _stalled_waits_raise(p)
        log = p.run(log_path=tmp_path / "run.jsonl", on_step=None, before_step=kill)
        stats = p.stats()
        assert p.restarts == 1
    trained = sorted(g for m in log for g in m["group_ids"])
    assert trained == list(range(STEPS * 16))  # every prompt trained once: none lost, none twice
    assert sorted(n for m in log for n in m["lengths"]) == sorted(stats["generated_lengths"])
    assert max(m["staleness_max"] for m in log) <= 1
    assert max(m["staleness_max"] for m in log[4:]) == 1  # the producer ran ahead as far as allowed
    for m in log:
        for key in ("loss", "grad_norm", "behave_kl", "kl", "entropy"):
            assert math.isfinite(m[key]), (m["step"], key, m[key])
    first = statistics.mean(m["reward"] for m in log[:WINDOW])
    last = statistics.mean(m["reward"] for m in log[-WINDOW:])
    assert last > first + MARGIN, (first, last, [round(m["reward"], 3) for m in log])
    assert len((tmp_path / "run.jsonl").read_text().splitlines()) == STEPS


def _equals_the_synchronous_loop(cfg, model=CONFIG, abs_tol=1e-8, after=None):
    """The run's log (and `after(pipeline)`'s answer, asked before the actors end, when given)."""
    from bumblebee.runtime.pipeline.engine import TransformersEngine
    from bumblebee.runtime.pipeline.trainer import synchronous_run
    with Pipeline(cfg, model, TASK) as p:
        piped = p.run(on_step=None)
        extra = after(p) if after is not None else None
    threads, had_group = torch.get_num_threads(), dist.is_initialized()
    torch.set_num_threads(cfg.threads)  # as the actors run: one reduction order
    try:
        one_rank = dataclasses.replace(cfg, trainer_ranks=1, expert_parallel=1, weights="object_store")
        plain = synchronous_run(one_rank, model, TASK, TransformersEngine(model, pad_token_id=TASK.pad_id))
    finally:  # the loop's one-rank group and the thread count are this process's: put them back
        torch.set_num_threads(threads)
        if dist.is_initialized() and not had_group:
            dist.destroy_process_group()
    assert len(piped) == len(plain) == cfg.steps
    for a, b in zip(piped, plain):
        assert a["staleness_max"] == 0 and a["reward"] == b["reward"] and a["lengths"] == b["lengths"]
        for key in ("loss", "entropy", "behave_kl"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=abs_tol, nan_ok=True), key  # nan: nothing kept
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    return piped if after is None else (piped, extra)


def test_run_stops_after_the_step_where_until_first_holds(local_ray):
    """`until(log)` ends the run after the first step where it holds (the benchmark's reward
    threshold), though steps and a producer running ahead (eta = 2) remain; the actors then end."""
    seen = []

    def until(log):
        seen.append(len(log))
        return log[-1]["step"] == 2

    with Pipeline(_cfg(steps=12, eta=2, groups_per_step=2, group_size=2, groups_per_call=2), CONFIG, TASK) as p:
        log = p.run(on_step=None, until=until)
    assert [m["step"] for m in log] == [0, 1, 2] and seen == [1, 2, 3]


def test_eta_zero_through_the_transfer_primitive_equals_the_synchronous_loop(local_ray):
    """Weights reach the producer through the weight-transfer primitive (p2p, async mode) exactly:
    the samples, rewards and updates are the plain loop's, which loads the export directly."""
    _equals_the_synchronous_loop(_cfg(steps=2, eta=0, groups_per_step=4, group_size=4, groups_per_call=4,
                                      weights="p2p", restarts=0))


def test_a_trainer_over_two_ranks_makes_the_one_rank_updates(local_ray):
    """The trainer as two Ray actors, FSDP2 over their gloo group, each rank training half the
    step's groups: the updates (loss, entropy, behave_kl over both ranks, grad norm) and thus the
    next steps' samples are the one-rank loop's."""
    _equals_the_synchronous_loop(_cfg(steps=3, eta=0, groups_per_step=4, group_size=4, groups_per_call=4,
                                      trainer_ranks=2, trainer_cpus=0.5, producer_cpus=0.5))


def test_two_trainer_ranks_send_their_shards_through_the_transfer_primitive(local_ray):
    """Two trainer ranks (FSDP2 on a subgroup of the channel's group) each send their own shards to
    the producer through the weight-transfer primitive, which assembles every tensor from the rank
    holding it: the samples (equal rewards and lengths) and updates are the one-rank plain loop's,
    after the warm-up (each rank's step calls training nothing, the producer's throwaway call)."""
    _equals_the_synchronous_loop(_cfg(steps=3, eta=0, groups_per_step=4, group_size=4, groups_per_call=4,
                                      weights="p2p", restarts=0, trainer_ranks=2, trainer_cpus=0.5,
                                      producer_cpus=0.5, warmup=True))


def test_an_moe_trainer_with_experts_over_two_ranks_makes_the_one_rank_updates(local_ray):
    """A tiny Qwen3-MoE, its experts split over the trainer's two ranks (EP = 2, all_to_all), its
    gathered export loaded into the producer's transformers model: the one-rank plain loop's samples
    and updates (no load-balancing term: it is each rank's own tokens'). The all_to_all dispatch sums
    the experts' outputs in another order than the one-rank dispatch: the loss, a token mean of
    terms of size |advantage| ~ 1 that cancel to ~1e-3, then differs by a few float32 roundings of
    those terms (3e-8 seen), hence the absolute tolerance of 1e-6. With the warm-up: its routed
    forwards' counts are dropped with its skipped step."""
    moe = {**models.NAMED["qwen3-moe-tiny"], "vocab_size": 16, "bos_token_id": TASK.bos_id,
           "pad_token_id": TASK.pad_id, "eos_token_id": None, "router_aux_loss_coef": 0.0}
    log = _equals_the_synchronous_loop(_cfg(steps=3, eta=0, groups_per_step=8, group_size=8, groups_per_call=8,
                                            trainer_ranks=2, expert_parallel=2, trainer_cpus=0.5, producer_cpus=0.5,
                                            warmup=True), moe, abs_tol=1e-6)
    assert sum(m["groups_kept"] for m in log) >= 2, [m["groups_kept"] for m in log]  # steps that trained


def test_an_moe_trainer_with_experts_over_two_ranks_sends_its_shards_through_the_transfer_primitive(local_ray):
    """EP = 2 over the p2p channel: the trainer's (efsdp, ep) mesh is made of subgroups of the
    channel's group (which holds the producer too), each rank sends its own experts' and FSDP2 rows'
    shards; the samples and updates are the one-rank plain loop's (the tolerance of the object-store
    case above), and after the run the producer's engine, on the last version, holds bitwise what
    the broadcast path (the trainer's gathered export into load_weights) gives a fresh engine."""
    from bumblebee.runtime.pipeline.engine import TransformersEngine
    moe = {**models.NAMED["qwen3-moe-tiny"], "vocab_size": 16, "bos_token_id": TASK.bos_id,
           "pad_token_id": TASK.pad_id, "eos_token_id": None, "router_aux_loss_coef": 0.0}
    cfg = _cfg(steps=3, eta=0, groups_per_step=8, group_size=8, groups_per_call=8, weights="p2p", restarts=0,
               trainer_ranks=2, expert_parallel=2, trainer_cpus=0.5, producer_cpus=0.5)

    def after(p):
        def last_version(producer):  # the run ends before the producer takes the last update
            version = producer.channel.wait_newer(producer.engine, float(SUBPROCESS_TIMEOUT_S))
            return version, {n: t.detach().clone() for n, t in producer.engine.model.named_parameters()}

        def gathered(trainer):  # every trainer rank takes part in the gathers
            return {n: t.clone() for n, t in trainer.rt.export_weights(dtype=torch.float32)}
        exports = ray.get([t.__ray_call__.remote(gathered) for t in p.trainers], timeout=SUBPROCESS_TIMEOUT_S)
        return ray.get(p.producers[0].__ray_call__.remote(last_version), timeout=SUBPROCESS_TIMEOUT_S), exports[0]

    log, ((version, got), export) = _equals_the_synchronous_loop(cfg, moe, abs_tol=1e-6, after=after)
    assert sum(m["groups_kept"] for m in log) >= 2, [m["groups_kept"] for m in log]  # steps that trained
    broadcast = TransformersEngine(moe, pad_token_id=TASK.pad_id)
    broadcast.load_weights(export.items(), version)
    want = dict(broadcast.model.named_parameters())
    assert version == cfg.steps and got.keys() == want.keys() and any("experts" in n for n in got)
    for name, t in want.items():
        assert torch.equal(got[name], t), name


def test_a_start_that_cannot_finish_raises(local_ray):
    """A producer asking for more CPUs than the cluster has never starts: the start raises within
    its limit (and kills what it started) instead of waiting forever."""
    cfg = _cfg(producer_cpus=3.0, call_timeout_s=STALL_S)
    t0 = time.monotonic()
    with pytest.raises(PipelineTimeout, match="producers' start: no answer"):
        Pipeline(cfg, CONFIG, TASK)
    assert time.monotonic() - t0 < 10 * STALL_S


def test_background_publish_stores_a_snapshot_and_raises_its_error(local_ray):
    """The object-store channel's background publish: what reaches the store is the export at the
    publish, not what the next step writes in place meanwhile; a failed put raises at the flush."""
    import pickle

    from bumblebee.runtime.pipeline.weights import ObjectStoreChannel, WeightStore, get, unpack
    w = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4), "empty": torch.zeros(0)}
    want = {k: v.clone() for k, v in w.items()}
    runtime = SimpleNamespace(export_weights=lambda dtype=None: list(w.items()))
    channel = ObjectStoreChannel(WeightStore.remote(), STALL_S * 10)
    channel.publish(1, runtime)
    w["a"].add_(100.0)  # the next step, while the put may still be in flight
    channel.flush()
    version, refs = get(channel.store.latest.remote(), STALL_S * 10, "the store")
    got = dict(unpack(ray.get(refs[0]), "cpu"))
    assert version == 1 and got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert pickle.loads(pickle.dumps(channel))._pool is None  # what producers get holds no thread

    def down(*_):
        raise RuntimeError("the store is down")
    broken = ObjectStoreChannel(SimpleNamespace(publish=SimpleNamespace(remote=down)), STALL_S)
    broken.publish(2, runtime)  # returns: the put runs in the background
    with pytest.raises(RuntimeError, match="the store is down"):
        broken.flush()
    broken.flush()  # raised once; nothing in flight any more
