"""RL smoke level 0 on one GPU: BumblebeeEngine on CUDA (NCCL, fp32) against float64 transformers,
with verl's parameter and optimizer offload on: its train/eval contexts bring the state to the GPU
and put it back on the CPU after each call."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("verl")

from tests.e2e.test_verl_actor_update import check_log_probs, check_update, one_update  # noqa: E402
from tests.primitives.test_state_sharding import spawn  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def offloaded_update(mesh, out):
    return one_update(mesh, out, param_offload=True, optimizer_offload=True)


def test_update_on_gpu_with_offload_matches_transformers(tmp_path):
    res = spawn(1, "offloaded_update", tmp_path, module=__name__, backend="nccl")[0]
    assert res["param_device"] == "cpu"  # offloaded again after the update
    check_log_probs(res, tmp_path, tol=1e-4)
    check_update(res, tmp_path, rel=1e-4)


def offloaded_export(mesh, out):
    """One rank, param and optimizer offload on: the devices of the Adam moments while verl's full and
    sharded weight syncs run, and of the parameters after them."""
    from bumblebee.runtime.offload import _optimizer_entries
    from tests.e2e import verl_cases as vc
    res = {}
    for sharding in ("fsdp2", "zero1"):
        engine, actor = vc.make_engine(vc.tiny_checkpoint(out), param_offload=True, optimizer_offload=True,
                                       state_sharding=sharding)
        vc.update(engine, actor, vc.prepare(engine, vc.rollout(1024, seed=0), shift_seed=1))  # moments exist
        seen, out_dev = set(), set()
        for gen in (engine.get_per_tensor_param()[0], (t for _, t, _ in engine.get_per_tensor_param_shard()[0])):
            for item in gen:
                t = item[1] if isinstance(item, tuple) else item
                out_dev.add(t.device.type)
                seen |= {st[k].device.type for st, k in _optimizer_entries(engine.runtime.state.optimizer)}
        res[sharding] = {"moments": seen, "exported": out_dev,
                         "param_after": next(engine.model.parameters()).device.type}
    return res


def test_weight_sync_never_brings_offloaded_optimizer_state_to_the_gpu(tmp_path):
    res = spawn(1, "offloaded_export", tmp_path, module=__name__, backend="nccl")[0]
    for sharding, r in res.items():
        assert r["moments"] == {"cpu"}, sharding
        assert r["exported"] == {"cuda"} and r["param_after"] == "cpu", sharding
