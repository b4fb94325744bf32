"""kernels/mla_rope.py (MLA's fused Q/K assembly) against a float64 reference built from the
primitive's torch assembly (`rope_pairs` + cat), and FlashMLA with option fused_rope on against off.

The Triton kernels run under TRITON_INTERPRET=1 in fp32 (this file run as a script in a subprocess,
`--interpret`): odd B, T, H, nope and R (R / 2 odd too), interleaved and half-split pairs, q, k_nope
and k_rope as strided views of bigger buffers (as the projections give them), a transposed upstream
gradient (as SDPA's backward gives it), [1, T, R] and [B, T, R] cos/sin, one and several head blocks
per token, outputs poisoned with NaN before the kernels write them. The same subprocess runs FlashMLA
with the option on and off (lean backward on and off, packed sequences), counting the fused calls.
Tolerances: the fused error vs float64 at most 2x the torch path's own error plus a small floor.
bf16/fp16 run on the GPU only (the interpreter computes bf16 wrongly).
"""
from __future__ import annotations

import json
import sys
from unittest import mock

import pytest
import torch

from bumblebee.kernels import mla_rope as fused
from bumblebee.primitives import mla as mla_mod
from bumblebee.primitives.mla import FlashMLAConfig, rope_pairs
from tests.interpreter import interpreted_fixture

FLOOR = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}
CASES = [  # B, T, H, nope, R, interleave, cos/sin shared by the batch ([1, T, R])
    (2, 5, 3, 16, 8, True, False), (2, 5, 3, 16, 8, False, True), (1, 7, 5, 12, 6, True, True),
    (2, 3, 9, 20, 4, False, False), (1, 4, 2, 0, 2, True, False)]
NAMES = ("q_out", "k_out", "dq", "dk_nope", "dk_rope")
_EMPTY = torch.empty


def rel(a, b):
    return ((a.double() - b.double()).norm() / (b.double().norm() + 1e-30)).item()


def make(B, T, H, nope, R, interleave, shared, seed, device="cpu"):
    """float64 buffers shaped like the projections' outputs, cos/sin at random positions, and
    upstream gradients (gk transposed in memory, as SDPA's backward returns it)."""
    gen = torch.Generator().manual_seed(seed)
    D = nope + R
    pos = torch.randint(0, 4000, (1 if shared else B, T), generator=gen).double()
    f = pos[..., None] / (10000 ** (torch.arange(0, R, 2).double() / R))
    emb = torch.cat([f, f], -1)
    c = dict(q_buf=torch.randn(B, T + 1, H, D + 3, generator=gen, dtype=torch.float64),  # q: [:, 1:, :, 3:]
             kv_buf=torch.randn(B, T, H, nope + 5, generator=gen, dtype=torch.float64),  # k_nope: [..., :nope]
             ka_buf=torch.randn(B, T, 7 + R, generator=gen, dtype=torch.float64),  # k_rope: [..., 7:]
             cos=emb.cos(), sin=emb.sin(), gq=torch.randn(B, T, H, D, generator=gen, dtype=torch.float64),
             gk=torch.randn(B, H, T, D, generator=gen, dtype=torch.float64).transpose(1, 2))
    c = {k: v.to(device) for k, v in c.items()}
    return dict(c, nope=nope, interleave=interleave)


def torch_assembly(q, k_nope, k_rope, cos, sin, interleave):
    """The primitive's torch code (`FlashMLA._core` with fused_rope off)."""
    B, T, H, _ = q.shape
    nope, R = k_nope.shape[-1], k_rope.shape[-1]
    q_out = torch.cat((q[..., :nope], rope_pairs(q[..., nope:], cos, sin, interleave)), dim=-1)
    k_out = torch.cat((k_nope, rope_pairs(k_rope[:, :, None], cos, sin, interleave).expand(B, T, H, R)), dim=-1)
    return q_out, k_out


def forward_backward(c, dtype, fn):
    """(q_out, k_out, dq_buf, dkv_buf, dka_buf): fn on views of leaf buffers in dtype."""
    leaves = [c[k].detach().to(dtype).requires_grad_(True) for k in ("q_buf", "kv_buf", "ka_buf")]
    q, kv, ka = leaves
    nope = c["nope"]
    q_out, k_out = fn(q[:, 1:, :, 3:], kv[..., :nope], ka[..., 7:], c["cos"].to(dtype), c["sin"].to(dtype),
                      c["interleave"])
    loss = (q_out * c["gq"].to(dtype)).sum() + (k_out * c["gk"].to(dtype)).sum()
    return [q_out.detach(), k_out.detach()] + list(torch.autograd.grad(loss, leaves))


def _poisoned_empty(*args, **kwargs):
    t = _EMPTY(*args, **kwargs)
    return t.fill_(float("nan")) if t.is_floating_point() else t


def kernel_cases(fails, dtypes=(torch.float32,), device="cpu", cases=CASES):
    """Every case: assemble_qk (kernels, or the torch fallback off CUDA without the interpreter)
    beside the primitive's torch assembly in the same dtype, both against float64."""
    errs = {}
    for dtype in dtypes:
        for i, case in enumerate(cases):
            tag = f"{str(dtype)[6:]}/{case}"
            c = make(*case, seed=i, device=device)
            want = forward_backward(c, torch.float64, torch_assembly)
            ref = forward_backward(c, dtype, torch_assembly)
            with mock.patch.object(torch, "empty", _poisoned_empty):
                got = forward_backward(c, dtype, fused.assemble_qk)
            if any(t.dtype != dtype for t in got) or not got[0].is_contiguous() or not got[1].is_contiguous():
                fails.append(f"{tag}: outputs must be contiguous in the input dtype")
            for name, g, r, w in zip(NAMES, got, ref, want):
                e, e_t = rel(g, w), rel(r, w)
                errs[f"{tag}/{name}"] = e
                if not (e <= 2 * e_t + FLOOR[dtype]) or not torch.isfinite(g).all():
                    fails.append(f"{tag} {name}: fused {e:.3g} vs torch {e_t:.3g}")
    return errs


# ---- FlashMLA with fused_rope on against off ---------------------------------------------------------

def module_cases():
    """Output and every gradient of FlashMLA, option on vs off, with the fused calls counted."""
    from tests.primitives.test_mla import make_pair, rope_inputs, run, with_options

    calls = {"forward": 0, "backward": 0}

    def counted(name, fn):
        def f(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return f

    fused._assemble, fused._grads = counted("forward", fused._assemble), counted("backward", fused._grads)
    errs, counts = {}, {}
    for lean in (True, False):
        for v, variant in enumerate(({}, {"rope_interleave": False, "q_lora_rank": None})):
            for packed in (False, True):
                tag = f"lean={lean}/variant={v}/packed={packed}"
                _, prim = make_pair(torch.float32, seed=v, config=FlashMLAConfig(lean_backward=lean), **variant)
                B, T = (1, 23) if packed else (2, 9)
                cu = torch.tensor([0, 4, 15, 16, 23], dtype=torch.int32) if packed else None
                pos = torch.cat([torch.arange(n) for n in (4, 11, 1, 7)])[None] if packed else None
                cos, sin = rope_inputs(B, T, 6, torch.float32, positions=pos)
                x = torch.randn(B, T, 40)
                want, g = run(with_options(prim, fused_rope=False), x, cos, sin, cu)
                before = dict(calls)
                got, _ = run(prim, x, cos, sin, cu, g)
                errs[tag] = max(rel(a, b) for a, b in zip(got, want))
                counts[tag] = {k: calls[k] - before[k] for k in calls}
    return errs, counts


def _interpret_main():
    assert fused.INTERPRET and fused.triton is not None
    fails = []
    fused.MAX_TILE = 32  # several head blocks per token (and a partial last one) at these widths
    errs = kernel_cases(fails)
    fused.MAX_TILE = 2048
    kernel_cases(fails)  # all heads in one block
    module_errs, counts = module_cases()
    print(json.dumps({"ok": True, "kernel_failures": fails, "kernel_errs": errs, "module_errs": module_errs,
                      "module_calls": counts}))


interpreted = interpreted_fixture(__file__)


def test_kernels_under_triton_interpreter(interpreted):
    assert not interpreted["kernel_failures"], interpreted["kernel_failures"]
    assert len(interpreted["kernel_errs"]) == len(CASES) * len(NAMES)


def test_flash_mla_fused_matches_unfused_under_interpreter(interpreted):
    """fp32, lean backward (selective checkpoint) on and off, padded and packed batches."""
    bad = {k: v for k, v in interpreted["module_errs"].items() if v > 2e-6}
    assert not bad, bad
    for tag, n in interpreted["module_calls"].items():  # the lean backward reruns the forward
        assert n["forward"] == (2 if "lean=True" in tag else 1) and n["backward"] == 1, (tag, n)


# ---- without the interpreter -----------------------------------------------------------------------

def test_torch_fallback_is_the_same_algorithm():
    """CPU tensors without the interpreter: assemble_qk runs `assemble_torch` / `grads_torch`."""
    if fused.INTERPRET:
        pytest.skip("this process runs the interpreter")
    fails = []
    kernel_cases(fails, dtypes=(torch.float32, torch.bfloat16))
    assert not fails, fails


def test_option():
    x = torch.zeros(1)
    on, off = FlashMLAConfig(), FlashMLAConfig(fused_rope=False)
    assert on.fused_rope  # the default
    assert not mla_mod._use_fused_rope(off, x)
    assert mla_mod._use_fused_rope(on, x) == fused.INTERPRET  # CPU tensors: only under the interpreter
    cs = torch.zeros(1, 2, 4)
    assert mla_mod._use_fused_rope(on, x, cs, cs) == fused.INTERPRET
    assert not mla_mod._use_fused_rope(on, x, cs.requires_grad_(), cs)  # the torch path gives cos its gradient
    with pytest.raises(ValueError, match="FlashMLAConfig.fused_rope must be True or False; got 'yes'"):
        FlashMLAConfig(fused_rope="yes")


def test_bad_input():
    q, kn, kr = torch.randn(2, 3, 4, 10), torch.randn(2, 3, 4, 6), torch.randn(2, 3, 4)
    cs = torch.randn(2, 3, 4)
    ok = dict(q=q, k_nope=kn, k_rope=kr, cos=cs, sin=cs, interleave=True)
    bad = [("q", dict(q=q[0])), ("k_nope", dict(k_nope=kn[:, :, :3])), ("rope dim", dict(k_nope=kn[..., :5])),
           ("k_rope", dict(k_rope=kr[..., :2])), ("k_nope", dict(k_nope=kn.double())),
           ("k_rope", dict(k_rope=kr.half())), ("cos", dict(cos=cs[..., :2])), ("sin", dict(sin=cs[:, :2])),
           ("cos", dict(cos=cs.long())), ("sin", dict(sin=cs.clone().requires_grad_(True)))]
    for name, change in bad:
        with pytest.raises(ValueError, match=name):
            fused.assemble_qk(**{**ok, **change})
    fused.assemble_qk(**{**ok, "cos": cs[:1], "sin": cs[:1]})  # a table shared by the batch is fine


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_kernels(dtype):
    """The compiled kernels, bf16 included, at odd shapes and at DeepSeek-V3's head dims."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    fails = []
    kernel_cases(fails, dtypes=(dtype,), device="cuda",
                 cases=CASES + [(1, 257, 16, 128, 64, True, True), (2, 100, 128, 128, 64, False, False)])
    assert not fails, fails


@pytest.mark.gpu
@pytest.mark.parametrize("lean", [True, False])
def test_cuda_flash_mla_fused_bf16(lean):
    """FlashMLA in bf16 with the option on: within 2x the torch path's error of a float64 run."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from tests.primitives.test_mla import make_pair, rope_inputs, run, with_options

    kw = dict(dim=256, n_heads=8, q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=128, qk_rope_head_dim=64,
              v_head_dim=128)
    _, prim64 = make_pair(torch.float64, "cuda", seed=4, **kw)
    _, prim16 = make_pair(torch.bfloat16, "cuda", seed=4, config=FlashMLAConfig(lean_backward=lean), **kw)
    cos, sin = rope_inputs(2, 157, 64, torch.float64, "cuda")
    x = torch.randn(2, 157, 256, device="cuda", dtype=torch.float64)
    ref, g = run(prim64, x, cos, sin)
    lo = [t.bfloat16() for t in (x, cos, sin)]
    unfused, _ = run(with_options(prim16, fused_rope=False), *lo, g=g.bfloat16())
    ours, _ = run(prim16, *lo, g=g.bfloat16())
    for r, t, o in zip(ref, unfused, ours):
        assert rel(o, r) <= 2 * rel(t, r) + 2e-3


if __name__ == "__main__" and "--interpret" in sys.argv:
    _interpret_main()
