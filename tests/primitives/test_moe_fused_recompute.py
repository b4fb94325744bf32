"""The chunked dispatch under the models' full recompute (`bumblebee.recompute`): the recomputed
forward skips fc2, the combine and the un-permute, the backward weights the experts' rows itself.
Against the same call without recompute and against the twin, fp32 on 1, 2 and 4 gloo ranks, within
1e-6 relative (outputs of the first forward and every gradient); and the exchanges of each pass.
"""
from __future__ import annotations

import datetime
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.checkpoint import checkpoint

from bumblebee import recompute, registry
from bumblebee.primitives import moe_dispatch as chunked_mod
from tests.primitives.test_moe_dispatch import TOL_TWIN, D, I, _free_port, full_experts, local_shard, rel, routes

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


def scenarios(group):
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
            x, w = torch.randn(N, D, generator=g), torch.rand(N, K, generator=g)
            idx, g_out = routes(pattern, N, E, K, W, r, g), torch.randn(N, D, generator=g)
            shard = local_shard(full_experts(E, s, "never", D, I), group)
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
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        torch.save(scenarios(dist.group.WORLD), Path(out_dir) / f"fused-{world}-{rank}.pt")
    finally:
        dist.destroy_process_group()


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
