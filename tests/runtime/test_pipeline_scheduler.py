"""The pipeline's logic without Ray: admission control in a deterministic simulation with heavy-
tailed generation latencies (staleness bound, none lost or duplicated, trained lengths = generated
lengths, bounded buffer, idle time against eta), restarts, version spans, GRPO advantages against
float64, dynamic sampling and the trainer's batch layout."""
from __future__ import annotations

import heapq
import random

import pytest
import torch

from bumblebee.runtime.pipeline import (Admission, Completion, Group, Lease, grpo_advantages, informative, to_batch,
                                        version_spans)


def simulate(eta, *, producers=8, groups_per_step=8, steps=30, train_s=1.5, seed=0):
    """Event-driven run of the real Admission: each producer leases one group at a time on the newest
    weights; a group's generation takes a log-normal time (sigma 1: heavy-tailed, the slowest of a step several times its mean) and its length grows with
    it; the trainer trains step k for `train_s` once all its groups are in, then publishes k + 1."""
    rng = random.Random(seed)
    adm = Admission(groups_per_step, eta, steps)
    version, t = 0, 0.0
    events = [(0.0, 0, "ask", p) for p in range(producers)]  # (time, order, kind, who)
    order = producers
    waiting, lengths, lease_of = [], {}, {}
    trained, stale, idle, busy_until, max_pending = [], [], 0.0, None, 0
    trainer_free_at = 0.0
    while events:
        t, _, kind, who = heapq.heappop(events)
        if kind == "ask":
            got = adm.admit(who, version)
            if got == "wait":
                waiting.append(who)
            elif isinstance(got, Lease):
                latency = rng.lognormvariate(-0.5, 1.0)
                lengths[got.group] = 1 + int(20 * latency)
                lease_of[got.group] = got
                heapq.heappush(events, (t + latency, order, "submit", (who, got.group)))
                order += 1
        elif kind == "submit":
            p, group = who
            adm.submit(p, group)
            heapq.heappush(events, (t, order, "ask", p))
            order += 1
        elif kind == "published":
            version += 1
            busy_until = None
            for p in waiting:
                heapq.heappush(events, (t, order, "ask", p))
                order += 1
            waiting = []
        max_pending = max(max_pending, adm.pending())
        if busy_until is None and version < steps and adm.ready(version):  # the trainer takes step `version`
            idle += t - trainer_free_at
            for g in adm.consume(version):
                trained.append(g)
                stale.append(version - lease_of[g].version)
            busy_until = trainer_free_at = t + train_s
            heapq.heappush(events, (busy_until, order, "published", None))
            order += 1
    return {"trained": trained, "stale": stale, "lengths": lengths, "idle": idle / trainer_free_at,
            "max_pending": max_pending, "steps": version}


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


def test_idle_time_falls_with_eta():
    """Prediction: at eta = 0 the trainer waits for every step's slowest group, the producers for
    every step; with eta >= 1 generation of the next steps overlaps training, so the trainer's idle
    fraction falls, and falls further as more steps may be generated ahead of the tail."""
    idle = {eta: simulate(eta)["idle"] for eta in (0, 1, 2, 4)}
    assert idle[0] > 0.5  # measured 0.64, then 0.39, 0.25, 0.08 at eta = 1, 2, 4
    assert idle[1] < 0.75 * idle[0] and idle[2] < idle[1] and idle[4] < idle[2], idle


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
