"""The chunked dispatch under the models' full recompute (`bumblebee.recompute`): the recomputed
forward skips fc2, the combine and the un-permute, the backward weights the experts' rows itself (at
one rank: `primitives/moe_dispatch_local.py`, the recompute computes nothing and the backward walks
expert groups). Against the same call without recompute and against the twin, fp32 on 1, 2 and 4 gloo
ranks, within 1e-6 relative (outputs of the first forward and every gradient); and the exchanges of
each pass.
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
from bumblebee.primitives.moe_dispatch_local import expert_groups
from bumblebee.primitives.moe_dispatch_options import ChunkedDispatch, fused_recompute_phase
from tests.primitives.test_moe_dispatch import (TOL_TWIN, D, I, full_experts, local_shard, process_group, rel,
                                               routes)
from tests.ranks import free_port

CHUNKS = [1, 2, (1, 2)]
CASES = [("random", 0), ("rank_gets_nothing", 0), ("zero_experts", 0), ("random", "empty odd ranks")]


def run(mode, x, w, idx, shard, E, chunks, g_out, config=ChunkedDispatch()):
    """[y, dx, dw, d gate_up, d down] of `chunked` with mode "plain" (no recompute), "fused" (the
    models' checkpoint with recompute.contexts), "checkpoint" (plain torch checkpoint), or the twin."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    shard.zero_grad(set_to_none=True)
    name = "all_to_all" if mode == "twin" else config
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
                # rows: one expert group / several at one rank, in the backward and in the first forward
                for wgrad, rows, forward_rows in (("gather", 65536, 262144), ("add", 7, 5)):
                    cfg = ChunkedDispatch(wgrad=wgrad, group_rows=rows, forward_group_rows=forward_rows)
                    plain = run("plain", x, w, idx, shard, E, chunks, g_out, cfg)
                    calls.clear()
                    fused = run("fused", x, w, idx, shard, E, chunks, g_out, cfg)
                    if s == 0 and wgrad == "add":
                        passes[str(chunks)] = dict(calls)
                    label = f"{pattern}{'/' + empty if empty else ''}/chunks={chunks}/{wgrad}"
                    errs[label] = max(max(rel(a, b) for a, b in zip(fused, plain)),
                                      max(rel(a, b) for a, b in zip(fused, twin)))
        calls.clear()
        off_cfg = ChunkedDispatch(fused_recompute=False)
        off = run("fused", x, w, idx, shard, E, 2, g_out, off_cfg)
        calls_off = dict(calls)
        errs["switch off"] = max(rel(a, b) for a, b in zip(off, run("plain", x, w, idx, shard, E, 2, g_out, off_cfg)))
    finally:
        chunked_mod._Schedule.all_to_all = orig
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
        mp.spawn(_worker, args=(world, free_port(), str(d)), nprocs=world, join=True)
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
    With the switch off: 2 / 2 / 2. One rank: the grouped path exchanges nothing."""
    for r, (_, passes, off) in enumerate(runs[world]):
        for chunks, calls in passes.items():
            C = 1 if chunks == "1" else 2
            want = {} if world == 1 else {"forward": 3 * C, "recompute": 2 * C, None: 3 * C}
            assert calls == want, (r, chunks, calls)
        assert off == {"forward": 4, "recompute": 4, None: 4}, (r, off)


def test_config_fields_validate_and_select_the_phase():
    with pytest.raises(ValueError, match="fused_recompute"):
        ChunkedDispatch(fused_recompute="maybe")
    with pytest.raises(ValueError, match="sm_carveout"):
        ChunkedDispatch(sm_carveout=-1)
    with pytest.raises(ValueError, match="chunks"):
        ChunkedDispatch(chunks="1/x")
    with pytest.raises(ValueError, match="group_rows"):
        ChunkedDispatch(group_rows=0)
    with pytest.raises(ValueError, match="forward_group_rows"):
        ChunkedDispatch(forward_group_rows=0)
    assert fused_recompute_phase(ChunkedDispatch()) is None  # outside any recompute region
    with recompute._Pass("recompute"):
        assert fused_recompute_phase(ChunkedDispatch()) == "recompute"
        assert fused_recompute_phase(ChunkedDispatch(fused_recompute=False)) is None


def test_expert_groups_cover_every_row_once():
    """Contiguous expert ranges, each row in exactly one, about group_rows rows each, no expert split."""
    g = torch.Generator().manual_seed(0)
    for case in range(30):
        tpe = torch.randint(0, 9, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g)
        tpe[torch.rand(tpe.shape, generator=g) < 0.3] = 0
        tpe = tpe.tolist()
        rows = int(torch.randint(1, 30, (1,), generator=g))
        groups = expert_groups(tpe, rows)
        starts = [0] + [sum(tpe[:e]) for e in range(1, len(tpe) + 1)]
        covered = [r for _, _, r0, r1 in groups for r in range(r0, r1)]
        assert covered == list(range(sum(tpe))), (case, tpe, rows, groups)
        for e0, e1, r0, r1 in groups:
            assert (starts[e0], starts[e1]) == (r0, r1) and r1 > r0, (case, groups)
            assert r1 - r0 <= rows + max(tpe), (case, groups)
        if sum(tpe):
            assert len(groups) >= min(-(-sum(tpe) // rows), sum(1 for n in tpe if n)) // 2, (case, groups)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_bf16_two_gpus_fused_recompute(tmp_path):
    """EP = 2 over NCCL, streams on, bf16: fused recompute vs no recompute and vs the twin."""
    mp.spawn(_nccl_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    for r in range(2):
        errs, passes, _ = torch.load(tmp_path / f"nccl-{r}.pt", weights_only=False)
        bad = {k: v for k, v in errs.items() if not v < 2e-2}
        assert not bad, (r, bad)
        assert passes["2"] == {"forward": 6, "recompute": 4, None: 6}, (r, passes)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("group_rows", [65536, 300])
def test_bf16_one_gpu_grouped_path(group_rows):
    """One GPU, bf16, grouped_mm and the fused kernels: the one-rank grouped path (one expert group, and
    several) under the fused recompute against no recompute and against the twin; the input gradient,
    summed over each token's copies group by group, is bitwise the same on a second run."""
    torch.manual_seed(0)
    E, K, N, d, i = 16, 4, 999, 128, 64  # widths that take torch._grouped_mm
    x, w = torch.randn(N, d, device="cuda", dtype=torch.bfloat16), torch.rand(N, K, device="cuda")
    idx = torch.stack([torch.randperm(E - 1)[:K] for _ in range(N)]).cuda()  # the last expert gets nothing
    g_out = torch.randn(N, d, device="cuda", dtype=torch.bfloat16)
    full = full_experts(E, 0, "auto", d, i).cuda().bfloat16()
    cfg = ChunkedDispatch(group_rows=group_rows)
    twin = run("twin", x, w, idx, full, E, None, g_out)
    plain = run("plain", x, w, idx, full, E, None, g_out, cfg)
    fused = run("fused", x, w, idx, full, E, None, g_out, cfg)
    for a, b, c in zip(fused, plain, twin):
        assert rel(a, b) < 2e-2 and rel(a, c) < 2e-2
    assert fused[3][-1].abs().max() == 0 and fused[4][-1].abs().max() == 0  # no rows: zero weight gradient
    assert torch.equal(fused[1], run("fused", x, w, idx, full, E, None, g_out, cfg)[1])
