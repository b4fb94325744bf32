"""Every process group the pipeline makes for the trainer waits at most the configured limit
(`PipelineConfig.trainer_timeout_s`), not torch's default 30 minutes, and a trainer rank whose peer
stalls in a collective raises a PipelineTimeout naming the limit. The stall is on the expert-parallel
path: `build_runtime` makes the (efsdp, ep) mesh over the default group (the object-store path's
layout; the p2p channel makes the same mesh with the same `trainer_expert_mesh`), and state
sharding's expert view reuses its groups; here the default group's own limit is the harness's long
one, so the wait that ends is the EP group's. The stalled peer arrives once the other rank gave up,
or after 20 limits: a group left at torch's default then completes the collective and the test
fails instead of hanging. Gloo ranks, no Ray."""
from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

from bumblebee.runtime.pipeline import PipelineConfig
from tests.primitives.test_state_sharding import spawn
from tests.ranks import free_port
from tests.runtime.test_pipeline_trainer_ranks import MOE

CFG = PipelineConfig(steps=1, trainer_ranks=2, expert_parallel=2, take_timeout_s=0.5, call_timeout_s=0.25)
LIMIT = datetime.timedelta(seconds=CFG.trainer_timeout_s)  # 0.5 + 2 x 0.25 = 1 s


def _timeout(group) -> datetime.timedelta:
    return group._get_backend(torch.device("cpu")).options._timeout


def stalled_ep_peer(mesh, out):
    from torch.distributed.distributed_c10d import _world

    from bumblebee.runtime.pipeline.config import PipelineTimeout
    from bumblebee.runtime.pipeline.trainer import build_runtime, collective_limit
    rank = dist.get_rank()
    rt, _ = build_runtime(MOE, CFG, group=dist.group.WORLD)
    ep = {m.ep_group for m in rt.model.modules() if getattr(m, "ep_group", None) is not None}
    # every group made for the trainer (efsdp, ep; none by state sharding) carries the limit
    made = [_timeout(g) for g in _world.pg_names if g is not dist.group.WORLD]
    result = {"ep_groups": len(ep), "made": made, "in_ep": {_timeout(g) for g in ep}}
    (group,) = ep
    rt.export_weights(dtype=torch.float32)  # the export gathers experts over those groups: both ranks here
    dist.barrier()  # the default group, the harness's long limit
    raised = out / "raised"
    if rank == 0:
        t0, error = time.monotonic(), None
        try:
            with collective_limit(CFG, "trainer rank 0"):
                dist.all_reduce(torch.ones(1), group=group)  # as the MoE dispatch's all_to_all waits on rank 1
        except PipelineTimeout as e:
            error = str(e)
        result.update(elapsed=time.monotonic() - t0, error=error)
        raised.touch()
    else:  # the stalled peer
        deadline = time.monotonic() + 20 * CFG.trainer_timeout_s
        while not raised.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        if not raised.exists():
            dist.all_reduce(torch.ones(1), group=group)
    return result


def test_a_stalled_expert_parallel_peer_raises_within_the_trainer_limit(tmp_path):
    first, second = spawn(2, "stalled_ep_peer", tmp_path, module=__name__)
    for r in (first, second):
        assert r["ep_groups"] == 1 and r["in_ep"] == {LIMIT}, r
        assert len(r["made"]) >= 2 and set(r["made"]) == {LIMIT}, r["made"]  # its efsdp group and its ep group
    assert first["error"] is not None, f"the collective waited {first['elapsed']:.1f} s for the late peer: no limit"
    assert "trainer rank 0" in first["error"] and "trainer_timeout_s = 1 s" in first["error"], first["error"]
    assert 0.5 * CFG.trainer_timeout_s <= first["elapsed"] < 10 * CFG.trainer_timeout_s, first


def test_the_trainer_ranks_group_and_a_one_rank_trainer_carry_the_limit():
    from bumblebee.runtime.pipeline.trainer import build_runtime, collective_limit, join_trainer_ranks
    from tests.runtime.test_pipeline_trainer_ranks import CONFIG
    if dist.is_initialized():
        pytest.skip("this process already has a default group")
    address = f"127.0.0.1:{free_port()}"
    one = PipelineConfig(steps=1, take_timeout_s=3.0, call_timeout_s=2.0)
    try:  # the trainer ranks' own group (Trainer.attach on the object-store path), here of one rank
        join_trainer_ranks(one, address, 0, "cpu")
        assert _timeout(dist.group.WORLD) == datetime.timedelta(seconds=7)
    finally:
        dist.destroy_process_group()
    try:  # the group build_runtime makes for a lone trainer
        build_runtime(CONFIG, one)
        assert _timeout(dist.group.WORLD) == datetime.timedelta(seconds=7)
    finally:
        dist.destroy_process_group()
    with pytest.raises(ValueError, match="bad arity"):  # other errors pass through as they are
        with collective_limit(one, "x"):
            raise ValueError("bad arity")
