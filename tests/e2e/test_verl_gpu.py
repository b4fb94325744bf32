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
