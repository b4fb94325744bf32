"""kernels/moe_dispatch_swiglu.py (the experts' fused SwiGLU elementwise) against float64 references
and against the torch ops of kernels/moe_dispatch_expert_gemm.py (without `swiglu=`, what the twins
run).

The Triton kernels run under TRITON_INTERPRET=1 in fp32 and fp16 (this file as a script in a
subprocess, `--interpret`): odd row counts, widths that are not a multiple of the block (and several
column blocks per row), outputs into row slices of poisoned buffers, empty inputs; then the expert
GEMMs' forward and dgrad with the fused functions passed in against the torch ops. The chunked primitive with the switch on
runs under the interpreter in tests/primitives/test_moe_dispatch_fused_permute.py. The weighted backward (the fused
recompute) is checked the same way, and expert_dgrad_weighted with it against the torch ops. bf16 runs on the GPU only.
Tolerance: the fused error vs float64 at most 2x the torch path's own error plus a small floor.
"""
from __future__ import annotations

import json
import sys

import pytest
import torch
import torch.nn.functional as F

from bumblebee.kernels import moe_dispatch_expert_gemm as expert_gemm
from bumblebee.kernels import moe_dispatch_swiglu as fused
from bumblebee.primitives.moe_dispatch_options import ChunkedDispatch, swiglu_fns
from tests.interpreter import interpreted_fixture

FLOOR = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}
CASES = [(1, 3), (37, 8), (5, 100), (129, 17), (3, 1500)]  # (M, I)


def rel(a, b):
    return ((a.double() - b.double()).norm() / (b.double().norm() + 1e-30)).item()


def inputs(M, I, dtype, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(M, 2 * I, generator=g) * 2).to(device, dtype)
    da = torch.randn(M, I, generator=g).to(device, dtype)
    return h, da


def reference(h, da):
    gate, up = h.double().chunk(2, dim=-1)
    d = da.double()
    sig = torch.sigmoid(gate)
    a = gate * sig * up
    return a, torch.cat([d * up * sig * (1 + gate * (1 - sig)), d * gate * sig], dim=-1)


def reference_weighted(h, du, w):
    a, dh = reference(h, du.double() * w.double()[:, None])
    a_plain = reference(h, du)[0]
    return a * w.double()[:, None], dh, (du.double() * a_plain).sum(1)


def torch_path(h, da):
    """The twins' ops (kernels/moe_dispatch_expert_gemm.py without `swiglu=`)."""
    gate, up = h.chunk(2, dim=-1)
    silu = F.silu(gate)
    a = silu * up
    dh = torch.empty_like(h)
    I = gate.shape[-1]
    torch.mul(da, silu, out=dh[:, I:])
    torch.ops.aten.silu_backward.grad_input(da * up, gate, grad_input=dh[:, :I])
    return a, dh


def check(name, got, torch_got, want, dtype, fails):
    e, e_t = rel(got, want), rel(torch_got, want)
    if not (e <= 2 * e_t + FLOOR[dtype]) or not torch.isfinite(got).all():
        fails.append(f"{name}: fused {e:.3g} vs torch {e_t:.3g}")
    return e


def kernel_cases(fails, dtypes=(torch.float32, torch.float16), device="cpu"):
    errs = {}
    for dtype in dtypes:
        for i, (M, I) in enumerate(CASES):
            tag = f"{str(dtype)[6:]}/M{M}I{I}"
            h, da = inputs(M, I, dtype, seed=i, device=device)
            a_r, dh_r = reference(h, da)
            a_t, dh_t = torch_path(h, da)
            errs[f"{tag}/a"] = check(f"{tag} a", fused.swiglu(h), a_t, a_r, dtype, fails)
            # into row slices of poisoned buffers, as the chunked primitive's shared wgrad buffers
            big_a = torch.full((M + 4, I), float("nan"), dtype=dtype, device=device)
            big_dh = torch.full((M + 4, 2 * I), float("nan"), dtype=dtype, device=device)
            a, dh = fused.swiglu_grads(h, da, dh_out=big_dh[1:1 + M], a_out=big_a[3:3 + M])
            if a.data_ptr() != big_a[3:3 + M].data_ptr() or dh.data_ptr() != big_dh[1:1 + M].data_ptr():
                fails.append(f"{tag}: outputs not written into the given slices")
            if not (big_a[:3].isnan().all() and big_a[3 + M:].isnan().all() and big_dh[0].isnan().all()
                    and big_dh[1 + M:].isnan().all()):
                fails.append(f"{tag}: wrote outside the given slices")
            errs[f"{tag}/a_bwd"] = check(f"{tag} a (backward)", a, a_t, a_r, dtype, fails)
            errs[f"{tag}/dh"] = check(f"{tag} dh", dh, dh_t, dh_r, dtype, fails)
            # the weighted backward (the fused recompute): w a, dh from w du, gw = rowsum(du a)
            w = torch.rand(M, generator=torch.Generator().manual_seed(i)).to(device) + 0.1
            wants = reference_weighted(h, da, w)
            tors = expert_gemm._swiglu_grads_weighted(h, da, w)
            big_a.fill_(float("nan"))
            big_dh.fill_(float("nan"))
            gots = fused.swiglu_grads_weighted(h, da, w, dh_out=big_dh[1:1 + M], a_out=big_a[3:3 + M])
            if gots[0].data_ptr() != big_a[3:3 + M].data_ptr() or gots[1].data_ptr() != big_dh[1:1 + M].data_ptr():
                fails.append(f"{tag}: weighted outputs not written into the given slices")
            if gots[2].dtype != torch.float32 or gots[2].shape != (M,):
                fails.append(f"{tag}: gw must be fp32 [M], got {gots[2].dtype} {tuple(gots[2].shape)}")
            for name, got, tor, want in zip(("wa", "dh_w", "gw"), gots, tors, wants):
                errs[f"{tag}/{name}"] = check(f"{tag} {name}", got, tor, want, dtype, fails)
            out = torch.full((M, I), float("nan"), dtype=dtype, device=device)
            if fused.swiglu(h, out=out).data_ptr() != out.data_ptr() or out.isnan().any():
                fails.append(f"{tag}: swiglu out= not filled")
    for M, I in ((0, 8), (4, 0)):  # no rows, no width
        h, da = inputs(M, I, torch.float32, seed=0, device=device)
        a, dh = fused.swiglu_grads(h, da)
        if fused.swiglu(h).shape != (M, I) or a.shape != (M, I) or dh.shape != (M, 2 * I):
            fails.append(f"empty M={M} I={I}: shapes")
        a, dh, gw = fused.swiglu_grads_weighted(h, da, torch.ones(M, device=device))
        if a.shape != (M, I) or dh.shape != (M, 2 * I) or gw.shape != (M,) or gw.any():
            fails.append(f"empty M={M} I={I}: weighted shapes or a nonzero gw")
    return errs


def expert_cases(fails):
    """expert_forward / expert_dgrad / expert_wgrad with the fused functions against the torch ops (fp32)."""
    g = torch.Generator().manual_seed(5)
    L, M, D, I = 3, 19, 12, 8
    x, gy = torch.randn(M, D, generator=g), torch.randn(M, D, generator=g)
    w1, w2 = torch.randn(L, 2 * I, D, generator=g) * 0.3, torch.randn(L, D, I, generator=g) * 0.3
    w = torch.rand(M, generator=g) + 0.1  # routing weights for expert_dgrad_weighted
    tpe = expert_gemm.TokensPerExpert(torch.tensor([7, 0, 12]), [7, 0, 12])
    outs = {}
    for f in (False, True):
        y, saved = expert_gemm.expert_forward(x, tpe, w1, w2, "never", swiglu=fused.swiglu if f else None)
        dx, job = expert_gemm.expert_dgrad(gy, saved, w1, w2, swiglu_grads=fused.swiglu_grads if f else None)
        outs[f] = [y, dx, *expert_gemm.expert_wgrad(job)]
        dx, gw, job = expert_gemm.expert_dgrad_weighted(
            gy, saved, w1, w2, w, swiglu_grads_weighted=fused.swiglu_grads_weighted if f else None)
        outs[f] += [dx, gw, *expert_gemm.expert_wgrad(job)]
    errs = [rel(a, b) for a, b in zip(outs[True], outs[False])]
    if max(errs) > 1e-6:
        fails.append(f"expert GEMMs fused vs torch: {errs}")
    return errs


def _interpret_main():
    assert fused.INTERPRET and fused.triton is not None
    fails = []
    fused.BLOCK_ELEMS = 64  # several row and column blocks at these small sizes
    errs = kernel_cases(fails)
    fused.BLOCK_ELEMS = 4096
    kernel_cases(fails, dtypes=(torch.float32,))
    expert_cases(fails)
    print(json.dumps({"ok": True, "failures": fails, "errs": errs}))


interpreted = interpreted_fixture(__file__)


def test_kernels_under_triton_interpreter(interpreted):
    assert not interpreted["failures"], interpreted["failures"]


def test_torch_fallback_and_expert_gemms():
    """CPU tensors without the interpreter: the wrappers run `*_torch` (the same math)."""
    if fused.INTERPRET:
        pytest.skip("this process runs the interpreter")
    fails = []
    kernel_cases(fails, dtypes=(torch.float32, torch.bfloat16))
    expert_cases(fails)
    assert not fails, fails


def test_bad_input():
    h = torch.randn(4, 6)
    with pytest.raises(ValueError, match="h must be"):
        fused.swiglu(torch.randn(4, 5))
    with pytest.raises(ValueError, match="da must be"):
        fused.swiglu_grads(h, torch.randn(4, 2))
    with pytest.raises(ValueError, match="a_out must be"):
        fused.swiglu_grads(h, torch.randn(4, 3), a_out=torch.empty(4, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="w must be"):
        fused.swiglu_grads_weighted(h, torch.randn(4, 3), torch.ones(3))


def test_config_picks_functions():
    x = torch.zeros(1)
    none = (None, None, None)
    assert swiglu_fns(ChunkedDispatch(fused_swiglu=False), x) == none
    fns = (fused.swiglu, fused.swiglu_grads, fused.swiglu_grads_weighted)
    # CPU tensors: the fused kernels only under the interpreter
    assert swiglu_fns(ChunkedDispatch(), x) == (fns if fused.INTERPRET else none)
    assert swiglu_fns(ChunkedDispatch(), x.double()) == none  # fp64 takes the torch path
    with pytest.raises(ValueError, match="fused_swiglu"):
        ChunkedDispatch(fused_swiglu="1")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_kernels(dtype):
    fails = []
    kernel_cases(fails, dtypes=(dtype,), device="cuda")
    h, da = inputs(131072 // 8, 512, dtype, seed=9, device="cuda")  # a layer-like width
    a_r, dh_r = reference(h, da)
    a_t, dh_t = torch_path(h, da)
    a, dh = fused.swiglu_grads(h, da)
    check("layer a", a, a_t, a_r, dtype, fails)
    check("layer dh", dh, dh_t, dh_r, dtype, fails)
    w = torch.rand(h.shape[0], device="cuda") + 0.1
    for name, got, tor, want in zip(("wa", "dh_w", "gw"), fused.swiglu_grads_weighted(h, da, w),
                                    expert_gemm._swiglu_grads_weighted(h, da, w), reference_weighted(h, da, w)):
        check(f"layer {name}", got, tor, want, dtype, fails)
    assert not fails, fails


if __name__ == "__main__" and "--interpret" in sys.argv:
    _interpret_main()
