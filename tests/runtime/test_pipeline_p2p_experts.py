"""A tiny Qwen3-MoE trainer with its experts split over its ranks (expert_parallel = 2) sends its
weights to a producer through the pipeline's p2p channel (the weight-transfer primitive, async):
the trainer's (efsdp, ep) mesh is made of subgroups of the channel's group (which also holds the
producer), each rank publishes its own shards (its experts, its FSDP2 rows) and the producer's
transformers engine holds, after every update, bitwise what the broadcast path (the gathered
export into `load_weights`) gives it; the training is the one-rank loop's, checked as
tests/runtime/test_pipeline_trainer_ranks.py checks EP over the default group. Gloo ranks in
processes, no Ray (the Ray pipeline over p2p with EP: tests/runtime/test_pipeline_ray.py)."""
from __future__ import annotations

import dataclasses
import datetime
import os
import sys
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bumblebee.runtime.pipeline import Objective, PipelineConfig
from tests.limits import SUBPROCESS_TIMEOUT_S
from tests.ranks import free_port
from tests.runtime.test_pipeline_trainer_ranks import KEYS, MOE, _groups

STEPS = ((0, 1), (1, 3), (2, 4))  # (step, informative groups): at step 0 rank 1 holds no kept group
# the channel's groups' limit and the trainer ranks' own groups' (told apart)
LIMITS = (SUBPROCESS_TIMEOUT_S, SUBPROCESS_TIMEOUT_S + 1)


def _cfg(trainers: int, ep: int, sharding: str) -> PipelineConfig:
    return PipelineConfig(steps=len(STEPS), lr=1e-2, objective=Objective(entropy_coef=1e-3, behave_cap=1.5),
                          trainer_ranks=trainers, expert_parallel=ep, state_sharding=sharding, weights="p2p",
                          restarts=0)


def _rank(rank: int, trainers: int, address: str, sharding: str, out: str) -> None:
    """Trainer rank `rank` (< trainers) or the producer: publish, train a step, publish, ... and,
    after each publish, meet the producer (WORLD barrier) once it took that version."""
    from bumblebee.runtime.pipeline.engine import TransformersEngine
    from bumblebee.runtime.pipeline.trainer import build_runtime, grpo_step
    from bumblebee.runtime.pipeline.weights_p2p import P2PChannel
    from torch.distributed.distributed_c10d import _world

    from tests.runtime.test_pipeline_group_timeouts import _timeout
    torch.set_num_threads(1)
    cfg = _cfg(trainers, 2, sharding)
    channel = P2PChannel(1, address, LIMITS[0], trainers=trainers, trainer_timeout_s=LIMITS[1], expert_parallel=2)
    result = {}
    if rank < trainers:
        channel.attach(rank)
        assert channel.ep_mesh is not None and channel.ep_mesh["ep"].size() == 2
        own = (channel.trainer_group, channel.ep_mesh["efsdp"].get_group(), channel.ep_mesh["ep"].get_group())
        result["limits"] = {_timeout(g) for g in own}, {_timeout(g) for g in _world.pg_names}
        rt, ref = build_runtime(MOE, cfg, group=channel.trainer_group, ep_mesh=channel.ep_mesh)
        result["split"] = [m.num_local_experts for m in rt.model.modules() if hasattr(m, "num_local_experts")]
        full, log = [], []
        for version in range(len(STEPS) + 1):
            if version:
                step, informative = STEPS[version - 1]
                log.append(grpo_step(rt, _groups(step, informative), cfg.objective, version=step, pad_id=12,
                                     ref=ref, rank=rank, world=trainers, group=channel.trainer_group))
            channel.publish(version, rt)
            full.append({n: t.clone() for n, t in rt.export_weights(dtype=torch.float32)})  # the broadcast path
            dist.barrier()
        result.update(log=log, full=full if rank == 0 else None)
    else:
        engine = TransformersEngine(MOE, pad_token_id=12)
        channel.attach(1, engine)
        assert channel.ep_mesh is None
        got = []
        for version in range(len(STEPS) + 1):
            assert channel.wait_newer(engine, SUBPROCESS_TIMEOUT_S) == version
            got.append({n: p.detach().clone() for n, p in engine.model.named_parameters()})
            dist.barrier()
        result["got"] = got
    torch.save(result, Path(out) / f"{rank}.pt")
    dist.barrier()  # no rank leaves while another's transfer service may still read from it


def _worker(rank, trainers, address, sharding, out):
    code = 1
    try:
        _rank(rank, trainers, address, sharding, out)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:  # the async transfer's service threads never join: end the process here, with its status
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def spawn(trainers: int, sharding: str, out: Path) -> list[dict]:
    """Trainer ranks 0..trainers-1 and the producer; a rank that fails ends the others (mp.spawn)."""
    address = f"127.0.0.1:{free_port()}"
    mp.spawn(_worker, args=(trainers, address, sharding, str(out)), nprocs=trainers + 1, join=True)
    return [torch.load(out / f"{r}.pt", weights_only=False) for r in range(trainers + 1)]


def _one_rank(sharding: str):
    """The one-rank loop on the same groups, in this process (its one-rank group put back after)."""
    from bumblebee.runtime.pipeline.trainer import build_runtime, grpo_step
    threads, had_group = torch.get_num_threads(), dist.is_initialized()
    torch.set_num_threads(1)
    try:
        cfg = dataclasses.replace(_cfg(2, 2, sharding), trainer_ranks=1, expert_parallel=1, weights="object_store")
        rt, ref = build_runtime(MOE, cfg)
        full = [{n: t.clone() for n, t in rt.export_weights(dtype=torch.float32)}]
        log = []
        for step, informative in STEPS:
            log.append(grpo_step(rt, _groups(step, informative), cfg.objective, version=step, pad_id=12, ref=ref))
            full.append({n: t.clone() for n, t in rt.export_weights(dtype=torch.float32)})
        return log, full
    finally:
        torch.set_num_threads(threads)
        if dist.is_initialized() and not had_group:
            dist.destroy_process_group()


@pytest.mark.parametrize("ranks,sharding", [(4, "fsdp2"), (2, "zero1")])
def test_expert_parallel_trainer_sends_its_shards_bitwise(ranks, sharding, tmp_path):
    from bumblebee.runtime.pipeline.engine import TransformersEngine
    *trainers, producer = spawn(ranks, sharding, tmp_path)
    one_log, one_full = _one_rank(sharding)
    assert [m["groups_kept"] for m in one_log] == [1, 3, 4]
    # the producer got every version, each bitwise what the gathered export loads into a fresh engine
    broadcast = TransformersEngine(MOE, pad_token_id=12)
    assert len(producer["got"]) == len(trainers[0]["full"]) == len(STEPS) + 1
    for version, (got, full) in enumerate(zip(producer["got"], trainers[0]["full"])):
        broadcast.load_weights(full.items(), version)
        want = dict(broadcast.model.named_parameters())
        assert got.keys() == want.keys() and any("experts" in n for n in got)
        for name, t in want.items():
            assert torch.equal(got[name], t), (version, name)
    # the training is the one-rank loop's (as EP over the default group: metrics, then update norms)
    for t in trainers:  # no group of the channel waits torch's default 30 minutes
        assert t["limits"] == ({datetime.timedelta(seconds=LIMITS[1])}, {datetime.timedelta(seconds=s) for s in LIMITS})
        assert t["split"] == [4, 4]  # each rank holds half of each layer's experts (EP = 2)
        for a, b in zip(t["log"], one_log):
            for key in KEYS:
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-8), (a["version"], key)
    w0, w1, w2 = one_full[0], one_full[-1], trainers[0]["full"][-1]
    assert w2.keys() == w1.keys()
    assert any((w1[n] - w0[n]).norm() > 0 for n in w1 if ".experts." in n)  # the experts trained
    for name in w1:  # Adam moves an element whose gradient is rounding noise by up to lr: compare update norms
        assert torch.equal(trainers[0]["full"][0][name], w0[name]), name
        update = (w1[name] - w0[name]).norm()
        assert (w2[name] - w1[name]).norm() <= 1e-3 * update + 1e-7, (name, float(update))


def test_the_trainer_expert_mesh_and_build_runtime_check_their_arguments():
    from bumblebee.runtime.pipeline.trainer import build_runtime, trainer_expert_mesh
    with pytest.raises(ValueError, match="ep must be an int > 0 dividing trainers=3"):
        trainer_expert_mesh(3, 2)  # checked before any group is made
    with pytest.raises(ValueError, match="ep must be an int > 0"):
        trainer_expert_mesh(2, 0)
    had_group = dist.is_initialized()
    try:  # a one-rank trainer cannot take an EP = 2 mesh (nor make one)
        with pytest.raises(ValueError, match="expert_parallel=2 needs the trainer's ranks"):
            build_runtime(MOE, dataclasses.replace(_cfg(2, 2, "fsdp2"), trainer_ranks=2))
    finally:
        if dist.is_initialized() and not had_group:
            dist.destroy_process_group()
