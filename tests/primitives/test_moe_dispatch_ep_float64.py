"""Expert parallelism in float64: a tiny DeepSeek-V3 (MLA, aux-free sigmoid router with moved biases,
an MTP depth with experts) and Qwen3-MoE at EP = 2 (gloo, each rank its own rows) against one process
on the whole batch with the `local` dispatch, over two steps (plain SGD between them, so no AdamW eps
amplifies rounding; the router biases moved by both steps' loads). Losses and every gradient must
agree to float64 rounding: a path that computes in fp32 under float64 inputs (the routing weights'
gradient was one) shows up at ~1e-8 relative, ~1e5 above the bound.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from bumblebee import models
from bumblebee.models import moe
from bumblebee.parallelize import shard_experts
from tests.primitives.context_parallel_ranks import spawn

MODELS = {"deepseek-v3": {**models.NAMED["deepseek-v3-tiny"], "num_nextn_predict_layers": 1},
          "qwen3-moe": "qwen3-moe-tiny"}
DISPATCH = {  # name -> (moe_dispatch, full recompute: the chunked path's fused recompute under EP)
    "all_to_all": ("all_to_all", False),
    "chunked": ("chunked", False),
    "chunked_recompute": ("chunked", True),
}
B, T, STEPS, LR = 2, 19, 2, 0.5
EPS64 = torch.finfo(torch.float64).eps
BOUND = 256 * EPS64  # relative to each tensor's largest entry: float64 rounding of these sums, with room


def _batches(vocab):
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab, (B, T), generator=g) for _ in range(STEPS)]


def _run(name, group=None, dispatch="local", recompute=False):
    """Per step: the loss over the whole batch and every parameter's gradient of it (experts: this
    rank's); then an SGD step and the router biases moved by the step's loads."""
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    model = models.build(MODELS[name], impl={"moe_dispatch": dispatch}, seed=0, dtype=torch.float64)
    model.set_recompute(recompute)
    if group is not None:
        shard_experts(model, group)
        for block in model.modules():  # two unequal chunks on the chunked path
            if isinstance(block, moe.MoEBlock):
                block.dispatch_chunks = (1, 2)
    out = []
    for ids in _batches(model.config.vocab_size):
        rows = ids[rank * B // world:(rank + 1) * B // world]
        loss = model(rows, labels=rows).loss
        loss.backward()
        grads = {}
        for n, p in model.named_parameters():
            g = p.grad
            if group is not None:
                g = g.clone()  # dense: the mean of the ranks' gradients; experts: their ep group's sum / EP
                if ".experts." not in n:
                    dist.all_reduce(g, group=group)
                g /= world
            grads[n] = g
        total = loss.detach().clone()
        if group is not None:
            dist.all_reduce(total, group=group)
        out.append({"loss": total / world, "grads": grads})
        with torch.no_grad():
            for n, p in model.named_parameters():
                p -= LR * grads[n]
                p.grad = None
        moe.update_router_bias(model, rate=0.05, group=group)
    return out


def ep_float64(group):
    rank = dist.get_rank(group)
    res = {}
    for name in MODELS:
        ref = _run(name)
        for case, (dispatch, recompute) in DISPATCH.items():
            got = _run(name, group, dispatch, recompute)
            errs = []
            for s, (a, b) in enumerate(zip(got, ref)):
                errs.append((f"step {s} loss", (a["loss"] - b["loss"]).abs().item() / b["loss"].abs().item()))
                for n, g in a["grads"].items():
                    want = b["grads"][n]
                    if g.shape != want.shape:  # this rank's experts
                        want = want[rank * g.shape[0]:(rank + 1) * g.shape[0]]
                    scale = want.abs().max().item() or 1.0
                    errs.append((f"step {s} {n}", (g - want).abs().max().item() / scale))
            res[(name, case)] = errs
    return res


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return spawn(2, __name__, "ep_float64", tmp_path_factory.mktemp("ep-float64"))


@pytest.mark.parametrize("case", list(DISPATCH))
@pytest.mark.parametrize("name", list(MODELS))
def test_ep2_equals_one_process_to_float64_rounding(runs, name, case):
    errs = [e for rank in runs for e in rank[(name, case)]]
    worst = max(errs, key=lambda e: e[1])
    print(name, case, "worst relative error", worst)
    assert worst[1] <= BOUND, worst
