"""The pipeline's logic without Ray: admission control in a deterministic simulation with heavy-
tailed generation latencies (staleness bound, none lost or duplicated, trained lengths = generated
lengths, bounded buffer, idle time against eta), restarts, version spans, GRPO advantages against
float64, dynamic sampling and the trainer's batch layout."""
from __future__ import annotations

import bisect
import heapq
import math
import random
import statistics

import pytest
import torch

from bumblebee.runtime.pipeline import (Admission, Completion, Group, Lease, grpo_advantages, informative, to_batch,
                                        version_spans)


LATENCY = (-0.5, 1.0)  # log-normal mu, sigma of a group's generation time: heavy-tailed (mean 1.0, p99 6.2)


def simulate(eta, *, producers=8, groups_per_step=8, steps=30, train_s=1.5, seed=0, pacing="tickets"):
    """Event-driven run of the real Admission: each producer leases one group at a time on the newest
    weights; a group's generation takes a log-normal time (heavy-tailed, the slowest of a step several
    times its mean) and its length grows with it; the trainer trains step k for `train_s` once all its
    groups are in, then publishes k + 1. `pacing="drop"` is the contrast the tickets avoid (a buffer
    without tickets): the trainer takes the first `groups_per_step` groups to arrive, and a group
    that arrives more than eta versions stale is dropped and its prompt generated again."""
    rng = random.Random(seed)
    adm = Admission(groups_per_step, eta, steps)
    version, t = 0, 0.0
    events = [(0.0, 0, "ask", p) for p in range(producers)]  # (time, order, kind, who)
    order = producers
    waiting, lengths, lease_of, arrived, generated = {}, {}, {}, [], []
    trained, stale, idle, busy_until, max_pending, producer_idle = [], [], 0.0, None, 0, 0.0
    trainer_free_at = 0.0
    while events:
        t, _, kind, who = heapq.heappop(events)
        if kind == "ask":
            got = adm.admit(who, version)
            if got == "wait":
                waiting[who] = t
            elif isinstance(got, Lease):
                latency = rng.lognormvariate(*LATENCY)
                lengths[got.group] = 1 + int(20 * latency)
                lease_of[got.group] = got
                heapq.heappush(events, (t + latency, order, "submit", (who, got.group)))
                order += 1
        elif kind == "submit":
            p, group = who
            generated.append(lengths[group])
            if pacing == "drop" and version - lease_of[group].version > eta:
                adm.release(p)  # dropped: admitted again (first), generated anew
            else:
                adm.submit(p, group)
                arrived.append(group)
            heapq.heappush(events, (t, order, "ask", p))
            order += 1
        elif kind == "published":
            version += 1
            busy_until = None
            for p, since in waiting.items():
                producer_idle += t - since
                heapq.heappush(events, (t, order, "ask", p))
                order += 1
            waiting = {}
        max_pending = max(max_pending, adm.pending())
        if pacing == "tickets":
            ready = version < steps and adm.ready(version)
        else:
            ready = version < steps and len(arrived) >= groups_per_step
        if busy_until is None and ready:  # the trainer takes step `version`
            idle += t - trainer_free_at
            if pacing == "tickets":
                taken = adm.consume(version)
            else:
                taken, arrived = arrived[:groups_per_step], arrived[groups_per_step:]
            for g in taken:
                trained.append(g)
                stale.append(version - lease_of[g].version)
            busy_until = trainer_free_at = t + train_s
            heapq.heappush(events, (busy_until, order, "published", None))
            order += 1
    return {"trained": trained, "stale": stale, "lengths": lengths, "generated": generated,
            "idle": idle / trainer_free_at,
            "producer_idle": producer_idle / (producers * trainer_free_at), "max_pending": max_pending,
            "steps": version}


def ks_distance(a, b) -> float:
    """Two-sample Kolmogorov-Smirnov statistic: the largest gap between the empirical CDFs."""
    a, b = sorted(a), sorted(b)
    return max(abs(bisect.bisect_right(a, x) / len(a) - bisect.bisect_right(b, x) / len(b)) for x in a + b)


@pytest.mark.parametrize("eta", [0, 1, 2, 4])
def test_admission_bounds_staleness_and_loses_nothing(eta):
    run = simulate(eta)
    assert run["steps"] == 30
    assert max(run["stale"]) <= eta and min(run["stale"]) >= 0
    if eta:
        assert max(run["stale"]) == eta  # the bound is reached: producers run ahead as allowed
    assert sorted(run["trained"]) == list(range(30 * 8))  # every group trained once, none lost
    # nothing is dropped after generation: the trained lengths are the generated ones, exactly
    assert sorted(run["lengths"][g] for g in run["trained"]) == sorted(run["lengths"].values())
    assert run["max_pending"] <= (eta + 1) * 8  # the bounded buffer


def test_trained_lengths_match_the_generated_ones():
    """Tolerance: the trained lengths' mean within 2% of the generated lengths' (every generation,
    dropped ones included) and a KS distance under 0.02. The tickets meet it exactly (nothing is
    dropped); a buffer that drops samples arriving more than eta versions stale and generates their
    prompts again trains 8-21% shorter rollouts on average at eta = 1, 2 (the long tail is what
    arrives late), and lets staleness pass eta: the check sees the bias it guards against."""
    def gaps(run):
        trained = [run["lengths"][g] for g in run["trained"]]
        ratio = statistics.mean(trained) / statistics.mean(run["generated"])
        return abs(1 - ratio), ks_distance(trained, run["generated"])

    for eta in (0, 1, 2, 4):
        for seed in (0, 1):
            mean_gap, ks = gaps(simulate(eta, steps=60, seed=seed))
            assert mean_gap < 0.02 and ks < 0.02, (eta, seed, mean_gap, ks)
    for eta in (1, 2):
        for seed in (0, 1):
            dropped = simulate(eta, steps=60, seed=seed, pacing="drop")
            assert gaps(dropped)[0] > 0.02 and max(dropped["stale"]) > eta, (eta, seed, gaps(dropped))


def test_idle_time_falls_with_eta_as_predicted():
    """Prediction, from the latency model alone: at eta = 0 each of the 8 producers generates one of
    a step's 8 groups, so the trainer waits for the slowest, M = max of 8 latencies, every step
    (idle E[M] / (E[M] + train_s)) and a producer is busy E[L] of every E[M] + train_s. With eta = k a
    step's groups may start k training steps earlier, so the trainer waits at most about
    E[max(0, M - k train_s)] a step: an upper bound (producers start even earlier when free). Both
    idle fractions fall as eta grows."""
    rng = random.Random(123)  # Monte Carlo of the model, apart from the simulation's draws
    M = [max(rng.lognormvariate(*LATENCY) for _ in range(8)) for _ in range(50_000)]
    mean_latency = math.exp(LATENCY[0] + LATENCY[1] ** 2 / 2)
    runs = {eta: simulate(eta, steps=200) for eta in (0, 1, 2, 4)}
    mean_m = statistics.mean(M)
    assert runs[0]["idle"] == pytest.approx(mean_m / (mean_m + 1.5), abs=0.03)  # 0.668 against 0.673
    assert runs[0]["producer_idle"] == pytest.approx(1 - mean_latency / (mean_m + 1.5), abs=0.03)
    for eta in (1, 2, 4):
        wait = statistics.mean(max(0.0, m - eta * 1.5) for m in M)
        assert runs[eta]["idle"] <= wait / (wait + 1.5) + 0.02, (eta, runs[eta]["idle"])
    idle = [runs[eta]["idle"] for eta in (0, 1, 2, 4)]
    producer_idle = [runs[eta]["producer_idle"] for eta in (0, 1, 2, 4)]
    assert idle == sorted(idle, reverse=True) and idle[1] < 0.75 * idle[0], idle  # 0.67, 0.43, 0.27, 0.08
    assert producer_idle == sorted(producer_idle, reverse=True), producer_idle


def test_released_leases_are_admitted_again_once():
    adm = Admission(groups_per_step=2, eta=1, steps=2)
    a, b, c = (adm.admit("p0", 0) for _ in range(3))
    assert [x.ticket for x in (a, b, c)] == [0, 0, 1]
    assert adm.admit("p1", 0) == Lease(3, 1, 0)
    assert adm.admit("p1", 0) == "done"
    adm.submit("p0", a.group)
    assert adm.release("p0") == [1, 2]  # the dead producer's in-flight groups
    with pytest.raises(ValueError, match="not leased"):
        adm.submit("p0", b.group)  # a late answer of the dead one is refused
    again = [adm.admit("p2", 0), adm.admit("p2", 0)]
    assert [x.group for x in again] == [1, 2] and adm.admit("p2", 0) == "done"
    for x in again:
        adm.submit("p2", x.group)
    adm.submit("p1", 3)
    assert adm.consume(0) == [0, 1] and adm.consume(1) == [2, 3]
    with pytest.raises(ValueError, match="groups"):
        adm.consume(1)


def test_eta_zero_is_synchronous():
    adm = Admission(groups_per_step=3, eta=0, steps=3)
    assert all(isinstance(adm.admit("p", 0), Lease) for _ in range(3))
    assert adm.admit("p", 0) == "wait"  # step 1's prompts need version 1
    assert isinstance(adm.admit("p", 1), Lease)
    with pytest.raises(ValueError):
        Admission(0, 1, 1)


def test_version_spans():
    assert version_spans([3, 3, 4, 4, 4, 6]) == [(3, 0, 2), (4, 2, 5), (6, 5, 6)]
    assert version_spans([]) == []
    assert Completion([1, 2], [-0.1, -0.2], [0, 0]).spans == [(0, 0, 2)]
    with pytest.raises(ValueError, match="decrease"):
        version_spans([2, 1])
    with pytest.raises(ValueError, match="one entry per token"):
        Completion([1, 2], [-0.1], [0, 0])


def test_grpo_advantages_against_float64():
    g = torch.Generator().manual_seed(0)
    r = torch.rand(5, 7, generator=g)
    got = grpo_advantages(r)
    r64 = r.double()
    mean = r64.mean(1, keepdim=True)
    std = ((r64 - mean).square().sum(1, keepdim=True) / 6).sqrt()  # unbiased, as GRPO's torch.std
    torch.testing.assert_close(got.double(), (r64 - mean) / (std + 1e-6), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grpo_advantages(r, scale_by_std=False).double(), r64 - mean, rtol=1e-6, atol=1e-7)
    assert torch.all(grpo_advantages(torch.ones(2, 4)) == 0)  # all-equal groups: no signal
    with pytest.raises(ValueError, match="group_size"):
        grpo_advantages(torch.ones(3, 1))


def _group(i, rewards, prompt=(10, 1, 11)):
    comps = [Completion([j % 10] * (1 + j % 3), [-0.5] * (1 + j % 3), [i] * (1 + j % 3)) for j in range(len(rewards))]
    return Group(i, 0, list(prompt), comps, list(rewards))


def test_dynamic_sampling_and_batch_layout():
    groups = [_group(0, [1.0, 0.0, 0.5]), _group(1, [0.5, 0.5, 0.5]), _group(2, [0.0, 0.0, 1.0], prompt=(10, 11))]
    kept = informative(groups)
    assert [g.group for g in kept] == [0, 2]
    batch, versions = to_batch(kept, pad_id=12)
    assert batch.input_ids.shape == (6, 6)
    row = 4  # group 2's second completion: prompt (10, 11), 2 tokens, then padding
    assert batch.input_ids[row].tolist() == [10, 11, 1, 1, 12, 12]
    assert batch.loss_mask[row].tolist() == [False, False, True, True, False, False]
    assert versions[row].tolist() == [-1, -1, 2, 2, -1, -1]
    assert torch.all(batch.sampler_logprobs[batch.loss_mask] == -0.5)
    want = grpo_advantages(torch.tensor([[1.0, 0.0, 0.5], [0.0, 0.0, 1.0]])).reshape(-1)
    torch.testing.assert_close(batch.advantages[:, 0], want)
    batch.check()


def test_launch_config_is_typed_and_refuses_unknown_keys(tmp_path):
    import json

    from bumblebee.runtime.pipeline import CopyDigits, PipelineConfig
    from bumblebee.runtime.pipeline.launch import load_config
    raw = {"model": "qwen3-tiny", "model_overrides": {"vocab_size": 16}, "task": {"name": "copy_digits", "length": 2},
           "pipeline": {"steps": 3, "eta": 2, "sampling": {"max_new_tokens": 2}, "objective": {"behave_mode": "mask"}},
           "log": "run.jsonl"}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(raw))
    cfg = load_config(path)
    assert isinstance(cfg.pipeline, PipelineConfig) and cfg.pipeline.eta == 2
    assert cfg.pipeline.sampling.max_new_tokens == 2 and cfg.pipeline.objective.behave_mode == "mask"
    assert cfg.task == CopyDigits(length=2) and cfg.model["vocab_size"] == 16 and cfg.model["model_type"] == "qwen3"
    for bad, match in (({**raw, "pipline": {}}, "pipline"),
                       ({**raw, "pipeline": {**raw["pipeline"], "objective": {"cap": 2}}}, "pipeline.objective"),
                       ({**raw, "pipeline": {**raw["pipeline"], "eta": -1}}, "eta"),
                       ({**raw, "task": {"name": "sort"}}, "task.name")):
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=match):
            load_config(path)


@pytest.mark.parametrize("kw,named", [(dict(trainer_ranks=2, expert_parallel=3), "expert_parallel must divide"),
                                      (dict(expert_parallel=0), "expert_parallel must be an int > 0"),
                                      (dict(producer_gpus=-1), "producer_gpus must be >= 0"),
                                      (dict(trainer_gpus=-0.5), "trainer_gpus must be >= 0"),
                                      (dict(weights="p2p", restarts=0, trainer_gpus=1), "both whole GPUs"),
                                      (dict(weights="p2p", restarts=0, producer_gpus=0.5, trainer_gpus=0.5),
                                       r"producer_gpus=0\.5, trainer_gpus=0\.5"),
                                      (dict(weights="p2p", restarts=0, producer_gpus=1.5, trainer_gpus=1),
                                       "cannot share a GPU"),
                                      (dict(publish_in_background="yes"), "publish_in_background must be a bool")])
def test_parallel_and_device_options_are_checked(kw, named):
    from bumblebee.runtime.pipeline import PipelineConfig
    with pytest.raises(ValueError, match=named):
        PipelineConfig(steps=1, **kw)
    PipelineConfig(steps=1, weights="p2p", restarts=0, trainer_ranks=2)  # several trainer ranks over p2p
    PipelineConfig(steps=1, weights="p2p", restarts=0, trainer_ranks=4, expert_parallel=2)  # and with EP
    PipelineConfig(steps=1, weights="p2p", restarts=0, producer_gpus=1, trainer_gpus=1.0)  # NCCL: a GPU each


def test_the_local_mode_refuses_ray_s_gpu_options():
    from bumblebee.runtime.pipeline import PipelineConfig
    from bumblebee.runtime.pipeline.local import LocalPipeline
    with pytest.raises(ValueError, match="trainer_gpus asks Ray for GPUs: the local mode takes trainer_device"):
        LocalPipeline(PipelineConfig(steps=1, trainer_gpus=1), {}, None)
