"""GPU: offloading the runtime's parts to the CPU frees the static GPU memory (parameters, gradients,
optimizer state) of both `state_sharding` twins, the round trip is bitwise, and the next step equals
that of a runtime that never moved."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bumblebee import models, registry
from bumblebee.runtime import Batch, Runtime
from tests.primitives.test_state_sharding import spawn

pytestmark = pytest.mark.gpu
CONFIG = {**models.NAMED["qwen3-moe-tiny"], "hidden_size": 256, "intermediate_size": 512,
          "moe_intermediate_size": 128, "vocab_size": 8192, "num_attention_heads": 8, "head_dim": 32}


def _runtime(mesh, impl):
    model = models.build(CONFIG, impl={"moe_dispatch": "local"}, seed=0, device="cuda")
    state = registry.resolve("state_sharding", impl)(model, mesh, lr=1e-3, grad_clip=1.0)
    return Runtime(model, state)


def _train(rt, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CONFIG["vocab_size"], (4, 64), generator=g).cuda()
    adv = torch.randn(4, 64, generator=g).cuda()
    batch = Batch(ids, advantages=adv, sampler_logprobs=torch.full((4, 64), -9.0, device="cuda"))
    return rt.forward_backward(batch, "ppo", loss_agg_mode="token-mean", micro_batch_tokens=128)


def offload_on_gpu(mesh, out: Path):
    res = {}
    for impl in ("fsdp2", "zero1"):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        a = _runtime(mesh, impl)
        _train(a, 0)
        a.optim_step()
        _train(a, 1)  # gradients present: every part holds memory
        torch.cuda.synchronize()
        static = torch.cuda.memory_allocated() - base
        before = {p: [t.cpu() for t in ts] for p, ts in a.placement.tensors().items()}
        a.to("cpu")
        torch.cuda.synchronize()
        left = torch.cuda.memory_allocated() - base
        on_gpu = [p for p, ts in a.placement.tensors().items() for t in ts if t.is_cuda]
        a.to("cuda")
        after = {p: [t.cpu() for t in ts] for p, ts in a.placement.tensors().items()}
        bitwise = all(torch.equal(x, y) for p in before for x, y in zip(before[p], after[p]))
        b = _runtime(mesh, impl)
        _train(b, 0)
        b.optim_step()
        _train(b, 1)
        steps = [x.optim_step()["grad_norm"] for x in (a, b)]
        # the expert dispatch's atomics may round differently between two runs: Adam moves an entry by at
        # most about lr per step whatever its gradient, so the weights may differ by that much, no more
        diff = max(float((x.float() - y.float()).abs().max()) for x, y in
                   zip(a.placement.tensors()["model"], b.placement.tensors()["model"]) if x.numel())
        res[impl] = {"static": static, "left": left, "on_gpu": on_gpu, "bitwise": bitwise, "norms": steps,
                     "max_weight_diff": diff}
        del a, b
    return res


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offload_frees_gpu_memory_and_round_trips(tmp_path):
    res = spawn(1, "offload_on_gpu", tmp_path, module=__name__, backend="nccl")[0]
    for impl, r in res.items():
        assert r["static"] > 0 and r["on_gpu"] == [], impl
        assert r["left"] <= 0.05 * r["static"], (impl, r["left"], r["static"])
        assert r["bitwise"], impl
        assert r["norms"][0] == pytest.approx(r["norms"][1], rel=1e-3) and r["max_weight_diff"] <= 2e-3, impl
