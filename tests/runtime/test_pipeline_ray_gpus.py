"""Actors asking Ray for GPUs (`producer_gpus`, `trainer_gpus`), on a local Ray that declares one GPU
on a CPU-only machine: the request reaches Ray (it assigns the actor GPU id 0), and the actor,
whose torch sees no CUDA, refuses with an error naming the option; a request larger than the
cluster's GPUs is refused before any actor starts. On two GPUs (`gpu` mark): the p2p weight channel
over NCCL, trainer and producer a GPU each. Skipped without Ray (the `rl` extra)."""
from __future__ import annotations

import time

import pytest
import torch

ray = pytest.importorskip("ray", reason="the RL pipeline needs Ray: pip install -e '.[rl]'")

from bumblebee import models  # noqa: E402
from bumblebee.runtime.pipeline import CopyDigits, Pipeline, PipelineConfig, Sampling  # noqa: E402
from tests.limits import SUBPROCESS_TIMEOUT_S  # noqa: E402

TASK = CopyDigits(length=2)
CONFIG = {**models.NAMED["qwen3-tiny"], "vocab_size": 16, "bos_token_id": TASK.bos_id, "pad_token_id": TASK.pad_id,
          "eos_token_id": None}
without_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


@pytest.fixture(scope="module")
def ray_with_a_declared_gpu():
    ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _cfg(**kw):
    return PipelineConfig(steps=1, groups_per_step=2, group_size=2, producer_cpus=0.5, trainer_cpus=0.5,
                          call_timeout_s=120.0, sampling=Sampling(max_new_tokens=TASK.length), **kw)


@without_cuda
@pytest.mark.parametrize("option", ["producer_gpus", "trainer_gpus"])
def test_a_gpu_request_reaches_ray_and_is_refused_without_cuda(ray_with_a_declared_gpu, option):
    with pytest.raises(ray.exceptions.RayActorError, match=rf"{option}=1(\.0)? asks for a GPU.*GPU ids \['0'\]"):
        Pipeline(_cfg(**{option: 1.0}), CONFIG, TASK)
    deadline = time.monotonic() + 60  # the failed start killed its actors: Ray gets the GPU back, soon
    while ray.available_resources().get("GPU") != 1:
        assert time.monotonic() < deadline, "the failed start kept its GPU"
        time.sleep(0.2)


@without_cuda
def test_more_gpus_than_the_cluster_has_are_refused_at_once(ray_with_a_declared_gpu):
    with pytest.raises(ValueError, match=r"producer_gpus=2(\.0)? per actor, but the Ray cluster has 1 GPUs"):
        Pipeline(_cfg(producer_gpus=2.0), CONFIG, TASK)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the trainer and the producer take a whole GPU each: needs 2")
def test_p2p_weights_over_nccl_reach_the_producer_s_gpu_exactly():
    """weights='p2p' with the trainer on one GPU and the producer on the other (cpu:gloo,cuda:nccl):
    at eta = 0 each step trains on the previous step's publish, and after the run the producer's
    engine, on the last version, holds bitwise the trainer's gathered fp32 export (the object-store
    channel's payload), loaded into a fresh engine."""
    from bumblebee.runtime.pipeline.engine import TransformersEngine
    cfg = PipelineConfig(steps=3, eta=0, groups_per_step=4, group_size=4, groups_per_call=4, lr=5e-3, seed=0,
                         weights="p2p", restarts=0, producer_gpus=1, trainer_gpus=1, call_timeout_s=120.0,
                         sampling=Sampling(max_new_tokens=TASK.length))

    def last_version(producer):  # the run ends before the producer takes the last update
        version = producer.channel.wait_newer(producer.engine, float(SUBPROCESS_TIMEOUT_S))
        params = producer.engine.model.named_parameters()
        return version, str(producer.device), {n: t.detach().cpu() for n, t in params}

    def gathered(trainer):
        return str(trainer.device), {n: t.cpu() for n, t in trainer.rt.export_weights(dtype=torch.float32)}

    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with Pipeline(cfg, CONFIG, TASK) as p:
            log = p.run(on_step=None)
            where, export = ray.get(p.trainer.__ray_call__.remote(gathered), timeout=SUBPROCESS_TIMEOUT_S)
            version, device, got = ray.get(p.producers[0].__ray_call__.remote(last_version),
                                           timeout=SUBPROCESS_TIMEOUT_S)
    finally:
        ray.shutdown()
    assert where.startswith("cuda") and device.startswith("cuda")
    assert [m["step"] for m in log] == [0, 1, 2] and all(m["staleness_max"] == 0 for m in log)
    fresh = TransformersEngine(CONFIG, pad_token_id=TASK.pad_id)
    fresh.load_weights(export.items(), version)
    want = dict(fresh.model.named_parameters())
    assert version == cfg.steps and got.keys() == want.keys()
    for name, t in want.items():
        assert torch.equal(got[name], t), name
