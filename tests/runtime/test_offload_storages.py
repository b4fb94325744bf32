"""Offload leaves nothing behind: after `Runtime.to("cpu", copy=True)` no tensor storage that existed
before is alive (apart from the non-fused AdamW's step counters, which live on the CPU anyway), for
both `state_sharding` twins, dense and MoE, on one gloo rank. On a GPU every such storage would be
device memory the offload failed to free (what `test_rl_gpu.py` measures with the allocator)."""
from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from bumblebee import models, registry
from bumblebee.runtime import Batch, Runtime
from tests.primitives.test_state_sharding import spawn

CASES = [(impl, name) for impl in ("fsdp2", "zero1") for name in ("qwen3-tiny", "qwen3-moe-tiny")]


def _train(rt, name, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, models.NAMED[name]["vocab_size"], (4, 8), generator=g)
    batch = Batch(ids, advantages=torch.randn(4, 8, generator=g), sampler_logprobs=torch.full((4, 8), -3.0))
    rt.forward_backward(batch, "ppo", loss_agg_mode="token-mean", micro_batch_tokens=16)


def _storages(exclude):
    """StorageWeakRef of every live tensor storage holding bytes, by storage address."""
    out = {}
    for o in gc.get_objects():
        if not isinstance(o, torch.Tensor):
            continue
        t = o._local_tensor if hasattr(o, "_local_tensor") else o
        if t.is_meta or t.layout != torch.strided:
            continue
        s = t.untyped_storage()
        if s.nbytes() and s.data_ptr() not in exclude:
            out[s.data_ptr()] = (StorageWeakRef(s), f"{type(o).__name__}{tuple(o.shape)} {o.dtype}")
    return out


def offload_storages(mesh, out: Path):
    res = {}
    for impl, name in CASES:
        gc.collect()
        kept = set(_storages(set()))  # the process's own (the mesh's), not the runtime's
        dispatch = {"moe_dispatch": "local"} if models.NAMED[name].get("num_experts") else None
        model = models.build(name, impl=dispatch, seed=0)
        state = registry.resolve("state_sharding", impl)(model, mesh, lr=1e-3, grad_clip=1.0)
        rt = Runtime(model, state)
        _train(rt, name, 0)
        rt.optim_step()
        _train(rt, name, 1)  # gradients (and router counts) present
        gc.collect()
        steps = {st["step"].data_ptr() for st in state.optimizer.state.values() if not st["step"].is_cuda}
        before = _storages(steps | kept)
        rt.to("cpu", copy=True)
        gc.collect()
        res[(impl, name)] = {"before": len(before),
                             "alive": [desc for ref, desc in before.values() if not ref.expired()]}
        del rt, model, state
        gc.collect()
    return res


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return spawn(1, "offload_storages", tmp_path_factory.mktemp("offload"), module=__name__)[0]


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_offload_leaves_no_storage_behind(runs, case):
    res = runs[case]
    assert res["before"] > 0
    assert res["alive"] == [], case
