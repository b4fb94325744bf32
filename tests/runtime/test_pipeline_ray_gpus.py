"""Actors asking Ray for GPUs (`producer_gpus`, `trainer_gpus`), on a local Ray that declares one GPU
on this CPU-only machine: the request reaches Ray (it assigns the actor GPU id 0), and the actor,
whose torch sees no CUDA, refuses with an error naming the option; a request larger than the
cluster's GPUs is refused before any actor starts. Skipped without Ray (the `rl` extra)."""
from __future__ import annotations

import time

import pytest
import torch

ray = pytest.importorskip("ray", reason="the RL pipeline needs Ray: pip install -e '.[rl]'")

from bumblebee import models  # noqa: E402
from bumblebee.runtime.pipeline import CopyDigits, Pipeline, PipelineConfig, Sampling  # noqa: E402

TASK = CopyDigits(length=2)
CONFIG = {**models.NAMED["qwen3-tiny"], "vocab_size": 16, "bos_token_id": TASK.bos_id, "pad_token_id": TASK.pad_id,
          "eos_token_id": None}
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


@pytest.fixture(scope="module")
def ray_with_a_declared_gpu():
    ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _cfg(**kw):
    return PipelineConfig(steps=1, groups_per_step=2, group_size=2, producer_cpus=0.5, trainer_cpus=0.5,
                          call_timeout_s=120.0, sampling=Sampling(max_new_tokens=TASK.length), **kw)


@pytest.mark.parametrize("option", ["producer_gpus", "trainer_gpus"])
def test_a_gpu_request_reaches_ray_and_is_refused_without_cuda(ray_with_a_declared_gpu, option):
    with pytest.raises(ray.exceptions.RayActorError, match=rf"{option}=1(\.0)? asks for a GPU.*GPU ids \['0'\]"):
        Pipeline(_cfg(**{option: 1.0}), CONFIG, TASK)
    deadline = time.monotonic() + 60  # the failed start killed its actors: Ray gets the GPU back, soon
    while ray.available_resources().get("GPU") != 1:
        assert time.monotonic() < deadline, "the failed start kept its GPU"
        time.sleep(0.2)


def test_more_gpus_than_the_cluster_has_are_refused_at_once(ray_with_a_declared_gpu):
    with pytest.raises(ValueError, match=r"producer_gpus=2(\.0)? per actor, but the Ray cluster has 1 GPUs"):
        Pipeline(_cfg(producer_gpus=2.0), CONFIG, TASK)
