"""The chunked dispatch under the models' full recompute (`bumblebee.recompute`): the recomputed
forward skips fc2, the combine and the un-permute, the backward weights the experts' rows itself.
Against the same call without recompute and against the twin, fp32 on 1, 2 and 4 gloo ranks, within
1e-6 relative (outputs of the first forward and every gradient); and the exchanges of each pass.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.checkpoint import checkpoint

from bumblebee import recompute, registry
from bumblebee.primitives import moe_dispatch as chunked_mod
from tests.primitives.test_moe_dispatch import (TOL_TWIN, D, I, _free_port, full_experts, local_shard, process_group,
                                               rel, routes)

CHUNKS = [1, 2, (1, 2)]
CASES = [("random", 0), ("rank_gets_nothing", 0), ("zero_experts", 0), ("random", "empty odd ranks")]


def run(mode, x, w, idx, shard, E, chunks, g_out):
    """[y, dx, dw, d gate_up, d down] of `chunked` with mode "plain" (no recompute), "fused" (the
    models' checkpoint with recompute.contexts), "checkpoint" (plain torch checkpoint), or the twin."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    shard.zero_grad(set_to_none=True)
    name = "all_to_all" if mode == "twin" else "chunked"
    kw = {} if mode == "twin" else {"chunks": chunks}
    f = lambda a, b: registry.resolve("moe_dispatch", name)(a, b, idx, shard, E, **kw)  # noqa: E731
    if mode == "fused":
        y = checkpoint(f, x, w, use_reentrant=False, context_fn=recompute.contexts)
    elif mode == "checkpoint":
        y = checkpoint(f, x, w, use_reentrant=False)
    else:
        y = f(x, w)
    (y * g_out).sum().backward()
    grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in (x, w)]
    wg = [p.grad if p.grad is not None else torch.zeros_like(p) for p in (shard.gate_up_proj, shard.down_proj)]
    return [y.detach(), *grads, *wg]


def scenarios(group, device="cpu", dtype=torch.float32):
    """{case: max rel error of fused vs plain and vs the twin}, {chunks: exchanges per pass}."""
    W, r = dist.get_world_size(group), dist.get_rank(group)
    E, K = 4 * W, 2
    errs, passes = {}, {}
    calls = {}
    orig = chunked_mod._Schedule.all_to_all

    def counted(self, *a, **k):
        calls[recompute.phase()] = calls.get(recompute.phase(), 0) + 1
        return orig(self, *a, **k)
    chunked_mod._Schedule.all_to_all = counted
    try:
        for s, (pattern, empty) in enumerate(CASES):
            N = 0 if empty and r % 2 else 17 + 3 * r
            g = torch.Generator().manual_seed(100 * s + r)
            x, w = torch.randn(N, D, generator=g).to(device, dtype), torch.rand(N, K, generator=g).to(device)
            idx, g_out = routes(pattern, N, E, K, W, r, g).to(device), torch.randn(N, D, generator=g).to(device, dtype)
            shard = local_shard(full_experts(E, s, "never", D, I).to(device, dtype), group)
            twin = run("twin", x, w, idx, shard, E, None, g_out)
            for chunks in CHUNKS:
                for wgrad in ("gather", "add"):
                    chunked_mod.WGRAD = wgrad
                    plain = run("plain", x, w, idx, shard, E, chunks, g_out)
                    calls.clear()
                    fused = run("fused", x, w, idx, shard, E, chunks, g_out)
                    if s == 0 and wgrad == "add":
                        passes[str(chunks)] = dict(calls)
                    label = f"{pattern}{'/' + empty if empty else ''}/chunks={chunks}/{wgrad}"
                    errs[label] = max(max(rel(a, b) for a, b in zip(fused, plain)),
                                      max(rel(a, b) for a, b in zip(fused, twin)))
        chunked_mod.FUSED_RECOMPUTE, calls_off = "off", None
        calls.clear()
        off = run("fused", x, w, idx, shard, E, 2, g_out)
        calls_off = dict(calls)
        errs["switch off"] = max(rel(a, b) for a, b in zip(off, run("plain", x, w, idx, shard, E, 2, g_out)))
    finally:
        chunked_mod._Schedule.all_to_all, chunked_mod.WGRAD, chunked_mod.FUSED_RECOMPUTE = orig, "auto", "on"
    return errs, passes, calls_off


def _worker(rank, world, port, out_dir):
    with process_group("gloo", rank, world, port) as group:
        torch.save(scenarios(group), Path(out_dir) / f"fused-{world}-{rank}.pt")


def _nccl_worker(rank, world, port, out_dir):
    with process_group("nccl", rank, world, port) as group:
        torch.save(scenarios(group, "cuda", torch.bfloat16), Path(out_dir) / f"nccl-{rank}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe_fused_recompute")
    out = {}
    for world in (1, 2, 4):
        mp.spawn(_worker, args=(world, _free_port(), str(d)), nprocs=world, join=True)
        out[world] = [torch.load(d / f"fused-{world}-{r}.pt", weights_only=False) for r in range(world)]
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_fused_recompute_matches_no_recompute_and_twin(runs, world):
    for r, (errs, _, _) in enumerate(runs[world]):
        bad = {k: v for k, v in errs.items() if not v < TOL_TWIN}
        assert not bad, (r, bad)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_recompute_skips_the_combine(runs, world):
    """Per chunk: first forward x, weights and combine (3); recompute x and weights only (2);
    backward combine-backward, dispatch-backward and the weights' gradient (3, outside any phase).
    With the switch off: 2 / 2 / 2."""
    for r, (_, passes, off) in enumerate(runs[world]):
        for chunks, calls in passes.items():
            C = 1 if chunks == "1" else 2
            assert calls == {"forward": 3 * C, "recompute": 2 * C, None: 3 * C}, (r, chunks, calls)
        assert off == {"forward": 4, "recompute": 4, None: 4}, (r, off)


def test_switches_read_from_the_environment(monkeypatch):
    monkeypatch.setattr(chunked_mod, "FUSED_RECOMPUTE", "maybe")
    with recompute._running("forward"), pytest.raises(ValueError, match="FUSED_RECOMPUTE"):
        chunked_mod._fused_recompute_phase()
    monkeypatch.setattr(chunked_mod, "FUSED_RECOMPUTE", "on")
    assert chunked_mod._fused_recompute_phase() is None  # outside any recompute region
    with recompute._running("recompute"):
        assert chunked_mod._fused_recompute_phase() == "recompute"
    monkeypatch.setenv("BUMBLEBEE_EP_SM_CARVEOUT", " 32 ")
    assert chunked_mod._carveout_from_env() == 32
    monkeypatch.setenv("BUMBLEBEE_EP_SM_CARVEOUT", "Auto")
    assert chunked_mod._carveout_from_env() == "auto"
    monkeypatch.setenv("BUMBLEBEE_EP_SM_CARVEOUT", "lots")
    with pytest.raises(ValueError, match="BUMBLEBEE_EP_SM_CARVEOUT"):
        chunked_mod._carveout_from_env()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_bf16_two_gpus_fused_recompute(tmp_path):
    """EP = 2 over NCCL, streams on, bf16: fused recompute vs no recompute and vs the twin."""
    mp.spawn(_nccl_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    for r in range(2):
        errs, passes, _ = torch.load(tmp_path / f"nccl-{r}.pt", weights_only=False)
        bad = {k: v for k, v in errs.items() if not v < 2e-2}
        assert not bad, (r, bad)
        assert passes["2"] == {"forward": 6, "recompute": 4, None: 6}, (r, passes)
