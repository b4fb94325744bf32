"""kernels/moe_dispatch_fused_permute.py (fused un-permute, its gradients, sum over copies, the grouped
backward's add_group_copies) against float64 references and against the torch functions of common/moe_dispatch_permute.py, and the chunked primitive
with `fused_permute` on against its twin; where the kernels are off the primitive takes their `*_torch`
algorithms, never common/'s.

The Triton kernels run under TRITON_INTERPRET=1 in fp32 and fp16 (this file run as a script in a
subprocess, `--interpret`): odd N, K in {1, 2, 8}, D not a multiple of the block (and several
blocks per row), `out=` row slices of a poisoned buffer, need_w False, empty inputs. The same
subprocess spawns 2 gloo ranks (the interpreter covers CPU tensors, so the primitive picks the fused
kernels there) and runs the chunked primitive with C = 2 and unequal chunks against the all_to_all
twin, counting the fused calls (the experts' fused SwiGLU of kernels/moe_dispatch_swiglu.py and the
row indices of kernels/moe_dispatch_regroup.py included). Tolerances: the fused error vs float64 at most 2x the torch path's
own error plus a small floor. bf16 runs on the GPU only (the interpreter computes bf16 wrongly), except
in add_group_copies, which only loads and widens it. add_group_copies is checked against index_add_ in
float64 within the fp32 rounding bound of its sums (`group_cases`).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bumblebee.common import moe_dispatch_permute as ref_mod
from bumblebee.kernels import moe_dispatch_fused_permute as fused
from bumblebee.primitives.moe_dispatch_local import expert_groups
from bumblebee.primitives.moe_dispatch_options import ChunkedDispatch, permute_fns
from tests.interpreter import interpreted_fixture
from tests.limits import PROCESS_GROUP_TIMEOUT
from tests.ranks import leave_group

FLOOR = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def rel(a, b):
    return ((a.double() - b.double()).norm() / (b.double().norm() + 1e-30)).item()


def make(N, K, D, dtype, seed, extra_rows=0):
    """y in sorted order [M, D], weights [N, K], a random permutation inv (copy id -> sorted row),
    the sorted-order token and weight of each row, and g [N, D]."""
    gen = torch.Generator().manual_seed(seed)
    M = N * K
    y = torch.randn(M + extra_rows, D, generator=gen)[extra_rows:]  # a row-offset view
    w = torch.rand(N, K, generator=gen)
    inv = torch.randperm(M, generator=gen)
    order = torch.empty_like(inv).scatter_(0, inv, torch.arange(M))
    g = torch.randn(N, D, generator=gen)
    return dict(y=y.to(dtype), w=w, inv=inv, order=order, token=order // K, w_sorted=w.reshape(-1)[order],
                g=g.to(dtype))


def ref_unpermute(c):
    N, K = c["w"].shape
    return (c["y"].double()[c["inv"]].view(N, K, -1) * c["w"].double()[..., None]).sum(1)


def ref_grads(c):
    g = c["g"].double()[c["token"]]
    return g * c["w_sorted"].double()[:, None], (g * c["y"].double()).sum(-1)


def ref_sum(c):
    N, K = c["w"].shape
    return c["y"].double()[c["inv"]].view(N, K, -1).sum(1)


def check(name, got, torch_got, want, dtype, fails):
    """fused error <= 2 x torch's error + floor, both against the float64 reference."""
    e, e_t = rel(got, want), rel(torch_got, want)
    if not (e <= 2 * e_t + FLOOR[dtype]) or not torch.isfinite(got).all():
        fails.append(f"{name}: fused {e:.3g} vs torch {e_t:.3g}")
    return e


def kernel_cases(fails, dtypes=(torch.float32, torch.float16)):
    """Every case; the torch functions of common/moe_dispatch_permute.py beside the fused ones."""
    errs = {}
    cases = [(13, 1, 37), (7, 2, 100), (9, 8, 45), (1, 8, 3), (5, 2, 64)]
    for dtype in dtypes:
        for i, (N, K, D) in enumerate(cases):
            tag = f"{str(dtype)[6:]}/N{N}K{K}D{D}"
            c = make(N, K, D, dtype, seed=i, extra_rows=i % 2)
            # un-permute into a row slice of a poisoned buffer (the chunked primitive's `out=`)
            big = torch.full((N + 5, D), float("nan"), dtype=dtype)
            got = fused.unpermute(c["y"], c["w"], c["inv"], out=big[2:2 + N])
            if got.data_ptr() != big[2:2 + N].data_ptr() or not (big[:2].isnan().all() and big[2 + N:].isnan().all()):
                fails.append(f"{tag}: unpermute wrote outside its out= slice or returned another tensor")
            errs[f"{tag}/unpermute"] = check(f"{tag} unpermute", got, ref_mod.unpermute(c["y"], c["w"], c["inv"]),
                                             ref_unpermute(c), dtype, fails)
            got = fused.unpermute(c["y"], c["w"], c["inv"], dtype=torch.float32)  # a wider output dtype
            if got.dtype != torch.float32:
                fails.append(f"{tag}: dtype= ignored")
            check(f"{tag} unpermute fp32 out", got, ref_mod.unpermute(c["y"], c["w"], c["inv"], dtype=torch.float32),
                  ref_unpermute(c), torch.float32 if dtype == torch.float32 else dtype, fails)
            # gradients, with and without the routing-weight gradient
            gy, gw = fused.unpermute_grads(c["g"], c["y"], c["w_sorted"], c["token"])
            gy_t, gw_t = ref_mod.unpermute_grads(c["g"], c["y"], c["w_sorted"], c["token"])
            gy_r, gw_r = ref_grads(c)
            if gy.dtype != dtype or gw.dtype != torch.float32:
                fails.append(f"{tag}: grads dtypes {gy.dtype}, {gw.dtype}")
            errs[f"{tag}/gy"] = check(f"{tag} gy", gy, gy_t, gy_r, dtype, fails)
            errs[f"{tag}/gw"] = check(f"{tag} gw", gw, gw_t, gw_r, dtype, fails)
            gy2, gw2 = fused.unpermute_grads(c["g"], c["y"], c["w_sorted"], c["token"], need_w=False)
            if gw2 is not None or not torch.equal(gy2, gy):
                fails.append(f"{tag}: need_w=False changed gy or returned gw")
            # sum over copies, into a poisoned slice
            big = torch.full((N + 3, D), float("nan"), dtype=dtype)
            got = fused.sum_copies(c["y"], c["inv"], K, out=big[3:])
            if not big[:3].isnan().all():
                fails.append(f"{tag}: sum_copies wrote outside its out= slice")
            errs[f"{tag}/sum_copies"] = check(f"{tag} sum_copies", got, ref_mod.sum_copies(c["y"], c["inv"], K),
                                              ref_sum(c), dtype, fails)
    # empty inputs: no tokens, no width
    for N, D in ((0, 8), (3, 0)):
        c = make(N, 2, D, torch.float32, seed=99)
        if fused.unpermute(c["y"], c["w"], c["inv"]).shape != (N, D) or \
                fused.sum_copies(c["y"], c["inv"], 2).shape != (N, D):
            fails.append(f"empty N={N} D={D}: unpermute/sum_copies shape")
        gy, gw = fused.unpermute_grads(c["g"], c["y"], c["w_sorted"], c["token"])
        if gy.shape != (2 * N, D) or gw.shape != (2 * N,) or (gw.numel() and gw.abs().max() != 0):
            fails.append(f"empty N={N} D={D}: grads")
    return errs


# ---- add_group_copies: the one-rank grouped backward's input-gradient accumulation ----------------

def routed(N, K, E, seed):
    """A random routing (K distinct experts per token), its rows sorted by expert: (order, inv, tpe)."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.rand(N, E, generator=gen).argsort(1)[:, :K].reshape(-1)
    order = idx.argsort(stable=True)
    inv = torch.empty_like(order).scatter_(0, order, torch.arange(N * K))
    return order, inv, torch.bincount(idx, minlength=E).tolist()


def group_bounds(kind, M, tpe, gen):
    """Row ranges covering [0, M): one, about three (whole experts, as the backward cuts them), or
    several cut at random rows with a repeated cut (an empty group)."""
    if kind == "one":
        return [(0, M)]
    if kind == "three":
        return [(r0, r1) for _, _, r0, r1 in expert_groups(tpe, max(1, -(-M // 3)))]
    cuts = torch.randint(0, M + 1, (4,), generator=gen).tolist()
    b = [0] + sorted(cuts + cuts[:1]) + [M]
    return list(zip(b[:-1], b[1:]))


GROUP_CASES = [  # N, K, E, D, groups
    (1, 1, 4, 64, "one"), (1, 8, 16, 1000, "several"), (37, 2, 4, 1000, "three"), (37, 8, 16, 64, "several"),
    (37, 1, 16, 2048, "three"), (37, 8, 16, 2048, "several"), (256, 2, 16, 64, "several"),
    (256, 8, 16, 1000, "one"),
]


def group_cases(fails, dtypes, fn=None, device="cpu", max_n=None):
    """fn (the wrapper by default) over every group of each case against index_add_ in float64: within
    the fp32 rounding bound 2 K u sum |terms|; rows of tokens left out stay as they were, bitwise.
    Covers a skipped group (K <= 2: tokens without any copy stay zero), a gx with a padded row
    stride, a transposed gx. max_n: only the cases of at most that many tokens."""
    fn = fn or fused.add_group_copies
    u = 2.0 ** -24
    for dtype in dtypes:
        for i, (N, K, E, D, kind) in enumerate(GROUP_CASES):
            if max_n is not None and N > max_n:
                continue
            tag = f"{str(dtype)[6:]}/N{N}K{K}E{E}D{D}/{kind}"
            gen = torch.Generator().manual_seed(100 + i)
            order, inv, tpe = routed(N, K, E, seed=i)
            bounds = group_bounds(kind, N * K, tpe, gen)
            dx = torch.randn(N * K, D, generator=gen).to(dtype)
            token = order // K
            variants = [("zeros", bounds)]
            if K <= 2 and len(bounds) > 1:
                variants.append(("skip", bounds[:1] + bounds[2:]))
            if i == 3 and dtype == torch.float32:
                variants += [("padded", bounds), ("transposed", bounds)]
            for var, groups in variants:
                gx0 = torch.zeros(N, D) if var in ("zeros", "skip") else torch.randn(N, D, generator=gen)
                if var == "padded":  # rows D + 5 apart in a NaN-poisoned buffer
                    buf = torch.full((N, D + 5), float("nan"))
                    gx = buf[:, 2:2 + D].copy_(gx0)
                elif var == "transposed":
                    gx = gx0.t().contiguous().t()
                else:
                    gx = gx0.clone()
                gx, dx_d, inv_d = gx.to(device), dx.to(device), inv.to(device)
                want, mag = gx0.double(), gx0.double().abs()
                for r0, r1 in groups:
                    if fn(gx, dx_d[r0:r1], inv_d, r0, r1) is not gx:
                        fails.append(f"{tag}/{var}: did not return gx")
                    want = want.index_add(0, token[r0:r1], dx[r0:r1].double())
                    mag = mag.index_add(0, token[r0:r1], dx[r0:r1].double().abs())
                got = gx.cpu().double()
                if not ((got - want).abs() <= 2 * K * u * mag + 1e-30).all():
                    fails.append(f"{tag}/{var}: max err {(got - want).abs().max().item():.3g}")
                touched = torch.zeros(N, dtype=torch.bool)
                for r0, r1 in groups:
                    touched[token[r0:r1]] = True
                if not torch.equal(got[~touched], gx0.double()[~touched]):
                    fails.append(f"{tag}/{var}: rows of tokens without a copy changed")
                if var == "padded" and not (buf[:, :2].isnan().all() and buf[:, 2 + D:].isnan().all()):
                    fails.append(f"{tag}: wrote outside gx's columns")
    # shape errors and empty inputs
    try:
        fn(torch.zeros(3, 4), torch.zeros(2, 4), torch.arange(6), 0, 3)
        fails.append("dx rows != r1 - r0 accepted")
    except ValueError:
        pass
    empty = torch.zeros(0, 4)
    if fn(empty, torch.zeros(0, 4), torch.zeros(0, dtype=torch.long), 0, 0) is not empty:
        fails.append("N = 0")


# ---- the chunked primitive with FUSED_PERMUTE = "on" over 2 gloo ranks ----------------------------

def _ep_worker(rank, world, port, out_dir):
    from tests.primitives import test_moe_dispatch as tmd
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=PROCESS_GROUP_TIMEOUT)
    from bumblebee.kernels import moe_dispatch_regroup as moe_regroup, moe_dispatch_swiglu as swiglu
    calls = {"unpermute": 0, "unpermute_grads": 0, "sum_copies": 0, "regroup": 0, "swiglu": 0, "swiglu_grads": 0,
             "swiglu_grads_weighted": 0}

    def counted(name, fn):
        def f(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return f

    for name in calls:
        mod = swiglu if name.startswith("swiglu") else moe_regroup if name == "regroup" else fused
        setattr(mod, name, counted(name, getattr(mod, name)))
    try:
        g = dist.group.WORLD
        res = {}
        res.update(tmd.compare_case(g, "random", 23 + 4 * rank, 4 * world, 2, [2, (1, 3)], seed=0))
        res.update(tmd.compare_case(g, "rank_gets_nothing", 17 + 3 * rank, 4 * world, 2, [2], seed=1))
        res.update({f"few_tokens/{k}": v for k, v in  # a rank without tokens: empty fused calls
                    tmd.compare_case(g, "random", [3, 0][rank], 4 * world, 2, [2], seed=2).items()})
        res.update(fused_recompute_case(g, rank, world))
        torch.save({"errs": res, "calls": calls}, Path(out_dir) / f"fused-ep-{rank}.pt")
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_group()


def fused_recompute_case(g, rank, world):
    """The models' recompute through the chunked dispatch (expert-side weighting in the fused SwiGLU
    backward) against the same call without recompute and against the twin."""
    from tests.primitives import test_moe_dispatch as tmd
    from tests.primitives.test_moe_dispatch_fused_recompute import run
    E, K, N = 4 * world, 2, 19 + 2 * rank
    gen = torch.Generator().manual_seed(7 + rank)
    x, w = torch.randn(N, tmd.D, generator=gen), torch.rand(N, K, generator=gen)
    idx, g_out = tmd.routes("random", N, E, K, world, rank, gen), torch.randn(N, tmd.D, generator=gen)
    shard = tmd.local_shard(tmd.full_experts(E, 3, "never", tmd.D, tmd.I), g)
    twin = run("twin", x, w, idx, shard, E, None, g_out)
    errs = {}
    for chunks in (2, (1, 3)):
        fused_out, plain = (run(m, x, w, idx, shard, E, chunks, g_out) for m in ("fused", "plain"))
        errs[f"fused_recompute/chunks={chunks}"] = max(max(tmd.rel(a, b) for a, b in zip(fused_out, plain)),
                                                       max(tmd.rel(a, b) for a, b in zip(fused_out, twin)))
    return errs


def ep_case(out_dir):
    from tests.ranks import free_port
    mp.spawn(_ep_worker, args=(2, free_port(), str(out_dir)), nprocs=2, join=True)
    return [torch.load(Path(out_dir) / f"fused-ep-{r}.pt") for r in range(2)]


def _interpret_main():
    import tempfile
    assert fused.INTERPRET and fused.triton is not None
    fails = []
    fused.MAX_BLOCK_D = 32  # several D blocks per row (and a partial last one) at these small widths
    errs = kernel_cases(fails)
    fused.MAX_BLOCK_D = 1024
    kernel_cases(fails, dtypes=(torch.float32,))  # one block per row
    group_fails = []
    group_cases(group_fails, (torch.float32,))
    fused.MAX_BLOCK_D_GROUP = 512  # several column blocks, a partial last one at D = 1000
    group_cases(group_fails, (torch.float16, torch.bfloat16), max_n=37)  # bf16 is only loaded and widened
    fused.MAX_BLOCK_D_GROUP = 2048
    with tempfile.TemporaryDirectory() as d:
        ep = ep_case(d)
    print(json.dumps({"ok": True, "kernel_failures": fails, "kernel_errs": errs, "group_failures": group_fails,
                      "ep": [r["errs"] for r in ep], "ep_calls": [r["calls"] for r in ep]}))


interpreted = interpreted_fixture(__file__)


def test_kernels_under_triton_interpreter(interpreted):
    assert not interpreted["kernel_failures"], interpreted["kernel_failures"]


def test_add_group_copies_under_triton_interpreter(interpreted):
    assert not interpreted["group_failures"], interpreted["group_failures"]


def test_chunked_ep2_fused_matches_twin_under_interpreter(interpreted):
    """gloo EP = 2, C = 2 and chunks (1, 3), with the fused kernels (run by the interpreter), the
    fused SwiGLU of the experts included, and under the models' recompute (its weighted backward)."""
    for r, (errs, calls) in enumerate(zip(interpreted["ep"], interpreted["ep_calls"])):
        bad = {k: v for k, v in errs.items() if v > (1e-5 if "local" in k else 1e-6)}
        assert not bad, (r, bad)
        assert all(n >= 4 for n in calls.values()), (r, calls)  # the primitive really took the fused path


# ---- without the interpreter -----------------------------------------------------------------------

def test_torch_fallback_is_the_same_algorithm():
    """CPU tensors without the interpreter: the wrappers run `*_torch` (fp32 products and sums)."""
    if fused.INTERPRET:
        pytest.skip("this process runs the interpreter")
    fails = []
    kernel_cases(fails, dtypes=(torch.float32, torch.bfloat16))
    assert not fails, fails


def test_add_group_copies_torch_fallback():
    if fused.INTERPRET:
        pytest.skip("this process runs the interpreter")
    fails = []
    group_cases(fails, (torch.float32, torch.float16, torch.bfloat16))
    assert not fails, fails


def test_config_picks_functions():
    """The fused kernels, or their algorithms in torch (never common/'s, the twins' functions)."""
    from bumblebee.primitives.moe_dispatch_rows import regroup_rows

    x = torch.zeros(1)
    torch_path = (fused.unpermute_torch, fused.unpermute_grads_torch, fused.sum_copies_torch, regroup_rows,
                  fused.add_group_copies_torch)
    assert permute_fns(ChunkedDispatch(fused_permute=False), x) == torch_path
    assert (permute_fns(ChunkedDispatch(), x)[4] is fused.add_group_copies) == fused.use_triton(x)
    # CPU tensors: the fused kernels only under the interpreter
    assert permute_fns(ChunkedDispatch(), x)[2] is (fused.sum_copies if fused.INTERPRET else fused.sum_copies_torch)
    g = torch.Generator().manual_seed(3)  # the torch entry points: the torch fallback's bits, out= rows too
    y, w, inv = torch.randn(12, 5, generator=g), torch.rand(4, 3, generator=g), torch.randperm(12, generator=g)
    out = torch.full((6, 5), float("nan"))
    fused.unpermute_torch(y, w, inv, out=out[1:5])
    assert torch.equal(out[1:5], fused._gather_sum_torch(y, w, inv, 3, torch.float32)) and out[[0, 5]].isnan().all()
    assert torch.equal(fused.sum_copies_torch(y, inv, 3), fused._gather_sum_torch(y, None, inv, 3, torch.float32))
    with pytest.raises(ValueError, match="fused_permute"):
        ChunkedDispatch(fused_permute="yes")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_kernels(dtype):
    """The compiled kernels on the GPU, bf16 included, at a layer-like width and odd sizes."""
    fails = []
    for i, (N, K, D) in enumerate([(301, 8, 2048), (77, 2, 1000), (5, 1, 4100)]):
        c = {k: v.cuda() for k, v in make(N, K, D, dtype, seed=i, extra_rows=1).items()}
        big = torch.full((N + 2, D), float("nan"), dtype=dtype, device="cuda")
        check("unpermute", fused.unpermute(c["y"], c["w"], c["inv"], out=big[1:1 + N]),
              ref_mod.unpermute(c["y"], c["w"], c["inv"]), ref_unpermute(c), dtype, fails)
        assert big[0].isnan().all() and big[-1].isnan().all()
        gy, gw = fused.unpermute_grads(c["g"], c["y"], c["w_sorted"], c["token"])
        gy_t, gw_t = ref_mod.unpermute_grads(c["g"], c["y"], c["w_sorted"], c["token"])
        gy_r, gw_r = ref_grads(c)
        check("gy", gy, gy_t, gy_r, dtype, fails)
        check("gw", gw, gw_t, gw_r, dtype, fails)
        check("sum_copies", fused.sum_copies(c["y"], c["inv"], K), ref_mod.sum_copies(c["y"], c["inv"], K),
              ref_sum(c), dtype, fails)
    assert not fails, fails


if __name__ == "__main__" and "--interpret" in sys.argv:
    _interpret_main()


@pytest.mark.gpu
def test_cuda_add_group_copies():
    """The compiled kernel: the small cases in every dtype, then a Qwen3.5-35B-A3B layer's backward in
    bf16 (N = 131072, K = 8, D = 2048, 16 groups) against index_put_ accumulating in fp32 (two fp32
    sums in different orders: within 2 x 2 K u sum |terms|)."""
    fails = []
    group_cases(fails, (torch.bfloat16, torch.float16, torch.float32), device="cuda")
    assert not fails, fails
    N, K, E, D = 131072, 8, 256, 2048
    order, inv, tpe = (t.cuda() if torch.is_tensor(t) else t for t in routed(N, K, E, seed=0))
    token = order // K
    groups = expert_groups(tpe, -(-N * K // 16))
    assert len(groups) == 16
    dx = torch.randn(N * K, D, device="cuda", dtype=torch.bfloat16)
    gx, want, mag = (torch.zeros(N, D, device="cuda") for _ in range(3))
    for _, _, r0, r1 in groups:
        fused.add_group_copies(gx, dx[r0:r1], inv, r0, r1)
        want.index_put_((token[r0:r1],), dx[r0:r1].float(), accumulate=True)
        mag.index_put_((token[r0:r1],), dx[r0:r1].float().abs(), accumulate=True)
    assert ((gx - want).abs() <= 4.5 * K * 2.0 ** -24 * mag).all(), (gx - want).abs().max().item()
