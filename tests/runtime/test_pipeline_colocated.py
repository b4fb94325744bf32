"""The colocated synchronous loop (`runtime/pipeline/colocated.py`), the anchor an asynchronous pipeline
on the same GPUs must beat: with one rank it makes the plain synchronous loop's samples and updates
(with and without the warm-up); over two gloo ranks each rank generates its share of the step's
engine calls, every rank trains the gathered groups data-parallel, and the first step (same weights,
same calls, same seeds) equals one rank's; rank 0's stop decision ends every rank at the same step. The
two-rank case runs on two GPUs too (`gpu`, shard 5: NCCL beside gloo, as the bench's `--colocated`)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bumblebee import models
from bumblebee.runtime.pipeline import CopyDigits, Objective, PipelineConfig, Sampling
from bumblebee.runtime.pipeline.colocated import colocated_run
from bumblebee.runtime.pipeline.engine import TransformersEngine
from bumblebee.runtime.pipeline.trainer import synchronous_run
from tests.limits import PROCESS_GROUP_TIMEOUT
from tests.ranks import free_port, leave_group

TASK = CopyDigits(length=2)
CONFIG = {**models.NAMED["qwen3-tiny"], "vocab_size": 16, "bos_token_id": TASK.bos_id, "pad_token_id": TASK.pad_id,
          "eos_token_id": None}


def _cfg(**kw):
    base = dict(steps=3, groups_per_step=4, group_size=4, groups_per_call=2, eta=0, lr=5e-3, seed=0,
                impl={"cross_entropy": "linear_ce"}, sampling=Sampling(max_new_tokens=TASK.length),
                objective=Objective(entropy_coef=1e-3))
    return PipelineConfig(**{**base, **kw})


def _engine_on(device: str):
    return TransformersEngine(CONFIG, device=device, pad_token_id=TASK.pad_id)


def _same_updates(a: dict, b: dict, rel: float) -> None:
    assert a["reward"] == b["reward"] and a["lengths"] == b["lengths"] and a["group_ids"] == b["group_ids"]
    assert a["loss"] == pytest.approx(b["loss"], rel=rel, abs=1e-9)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=rel)


@pytest.mark.parametrize("warmup", [False, True])
def test_one_rank_makes_the_synchronous_loops_updates(one_process, warmup):
    cfg = _cfg(warmup=warmup)
    log = colocated_run(cfg, CONFIG, TASK, _engine_on("cpu"))
    plain = synchronous_run(cfg, CONFIG, TASK, _engine_on("cpu"))
    assert len(log) == len(plain) == cfg.steps
    for a, b in zip(log, plain):
        assert a["staleness_max"] == 0 and sorted(a["group_ids"]) == a["group_ids"]
        assert a["reward"] == b["reward"] and a["lengths"] == b["lengths"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=1e-9)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6)
    for m in log:  # a step is generation, then training and the weights' load: the two shares make it up
        assert m["trainer_idle"] + m["producer_idle"] == pytest.approx(1.0, abs=1e-6)
    assert not dist.is_initialized()  # the one-rank group made inside went with the run


def test_refuses_a_staleness_bound(one_process):
    with pytest.raises(ValueError, match="eta must be 0, got 2"):
        colocated_run(_cfg(eta=2), CONFIG, TASK, _engine_on("cpu"))


def _rank(rank: int, world: int, port: int, out: str, device_type: str = "cpu") -> None:
    torch.set_num_threads(1)
    device = f"cuda:{rank}" if device_type == "cuda" else "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=PROCESS_GROUP_TIMEOUT)
    try:
        log = colocated_run(_cfg(steps=4), CONFIG, TASK, _engine_on(device), group=dist.group.WORLD, device=device,
                            until=lambda log: log[-1]["step"] == 1)  # rank 0's call decides for both
        Path(out, f"rank{rank}.json").write_text(json.dumps(log))
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_group()


@pytest.mark.parametrize("device_type", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_two_ranks_share_generation_and_train_the_gathered_groups(one_process, tmp_path, device_type):
    """On two GPUs: NCCL beside gloo, as the bench's `--colocated` runs it."""
    if device_type == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    mp.spawn(_rank, args=(2, free_port(), str(tmp_path), device_type), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    one_device = "cuda:0" if device_type == "cuda" else "cpu"
    one = colocated_run(_cfg(steps=1), CONFIG, TASK, _engine_on(one_device), device=one_device)
    for log in ranks:
        assert [m["step"] for m in log] == [0, 1]  # both stopped after rank 0's until held
        _same_updates(log[0], one[0], rel=1e-5)  # the same calls on the same weights: the same groups
        assert log[0]["group_ids"] == list(range(4))
    for a, b in zip(*ranks):  # every rank trained the same gathered groups: the same metrics
        _same_updates(a, b, rel=0.0)
