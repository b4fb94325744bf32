"""kernels/linear_attention_gdn_backward.py (the gated DeltaNet chunk's dq/dk/dw/dg, in place of fla's
on Hopper) against an autograd float64 reference written from the forward math: the torch path on the CPU, the Triton
kernel under TRITON_INTERPRET=1 in fp32 (this file run as a script in a subprocess), and on the GPU
in bf16 at Qwen3.5 head sizes, against fla's own kernel where fla trusts it, and inside fla's
backward where fla would refuse its own."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bumblebee.kernels import linear_attention_gdn_backward as gb
from tests.interpreter import run_under_interpreter
from tests.limits import SUBPROCESS_TIMEOUT_S

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def bounds(B, T, cu):
    return list(range(0, B * T + 1, T)) if cu is None else [int(c) for c in cu]


def make(B, T, H, HV, K, V, *, cu=None, chunk=64, state_v_first=False, dtype=torch.float32, device="cpu", seed=0):
    """Inputs as fla's gated backward hands them over: g a chunk-local cumsum of log decays (log2 units),
    one state and state gradient per chunk (any values: the function is defined for all)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k = r(B, T, H, K), r(B, T, H, K) / K ** 0.5
    v, do, dv, w = r(B, T, HV, V), r(B, T, HV, V), r(B, T, HV, V), r(B, T, HV, K) / K ** 0.5
    step = -torch.rand(B * T, HV, generator=gen) * 0.15 / math.log(2)
    g = torch.empty(B * T, HV)
    n = 0
    for a, b in zip(bounds(B, T, cu)[:-1], bounds(B, T, cu)[1:]):
        for s in range(a, b, chunk):
            g[s:min(s + chunk, b)] = step[s:min(s + chunk, b)].cumsum(0)
            n += 1
    n_chunks = n if cu is not None else n // B
    shape = (B if cu is None else 1, n_chunks, HV, *((V, K) if state_v_first else (K, V)))
    h, dh = r(*shape) / K ** 0.5, r(*shape)
    ins = dict(q=q, k=k, v=v, do=do, h=h, dh=dh, w=w, g=g.view(B, T, HV), dv=dv)
    ins = {n: t.to(device=device, dtype=torch.float32 if n == "g" else dtype) for n, t in ins.items()}
    return dict(ins, scale=K ** -0.5, state_v_first=state_v_first, chunk_size=chunk,
                cu_seqlens=None if cu is None else torch.tensor(cu, device=device))


def reference(q, k, v, do, h, dh, w, g, dv, scale, state_v_first=False, cu_seqlens=None, chunk_size=64,
              dtype=torch.float64):
    """Autograd of, per chunk and value head, L = sum(dO * o) + sum(dS * S_end) - sum(dV * (W @ S)):
    o = scale * (exp(G) * (Q @ S) + ((Q @ K^T) * causal(exp(G_i - G_j))) @ V), S_end = exp(g_last) S +
    (K * exp(g_last - G))^T @ V, with G = g ln 2 (natural log) the leaf for dg. Key heads are read by
    HV / H value heads, so dq and dk sum over them."""
    B, T, H, K = k.shape
    rep = v.shape[2] // H
    q, k, w = (t.to(dtype).requires_grad_() for t in (q, k, w))
    gn = (g.double() * math.log(2)).to(dtype).requires_grad_()
    S, dS = (t.to(dtype).flatten(0, 1) for t in (h, dh))
    if state_v_first:
        S, dS = S.transpose(-1, -2), dS.transpose(-1, -2)
    flat = lambda x: x.reshape(B * T, *x.shape[2:])  # noqa: E731
    fq, fk, fw, fg = flat(q), flat(k), flat(w), flat(gn)
    fv, fdo, fdv = (flat(t.to(dtype)) for t in (v, do, dv))
    loss, c = 0, 0
    for a, b in zip(bounds(B, T, cu_seqlens)[:-1], bounds(B, T, cu_seqlens)[1:]):
        for s in range(a, b, chunk_size):
            t = slice(s, min(s + chunk_size, b))
            Q, Kc = fq[t].repeat_interleave(rep, 1), fk[t].repeat_interleave(rep, 1)  # [L, HV, K]
            G = fg[t]                                                                     # [L, HV]
            L = G.shape[0]
            causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()[..., None]
            decay = torch.where(causal, G[:, None] - G[None, :], -math.inf).exp()         # [i, j, HV]
            A = torch.einsum("ihk,jhk->ijh", Q, Kc) * decay
            o = scale * (G.exp()[..., None] * torch.einsum("lhk,hkv->lhv", Q, S[c])
                         + torch.einsum("ijh,jhv->ihv", A, fv[t]))
            S_end = G[-1].exp()[:, None, None] * S[c] + torch.einsum("lhk,lhv->hkv", Kc * (G[-1] - G).exp()[..., None],
                                                                      fv[t])
            loss = loss + (fdo[t] * o).sum() + (dS[c] * S_end).sum() \
                - (fdv[t] * torch.einsum("lhk,hkv->lhv", fw[t], S[c])).sum()
            c += 1
    return torch.autograd.grad(loss, [q, k, w, gn])


def check(got, want, tol, label=""):
    names = ("dq", "dk", "dw", "dg")
    for n, a, b in zip(names, got, want):
        assert a is not None and a.shape == b.shape, (label, n)
        assert torch.isfinite(a).all(), (label, n)
        e = rel_err(a, b)
        assert e < tol, (label, n, e)


CASES = [  # B, T, H, HV, K, V, cu_seqlens, chunk, state_v_first
    (2, 77, 2, 4, 24, 20, None, 64, False),                     # odd T, 2 value heads per key head
    (1, 150, 1, 3, 16, 40, [0, 5, 70, 71, 150], 64, True),      # packed, a one-token sequence, [V, K] states
    (1, 45, 2, 2, 136, 24, [0, 33, 45], 16, False),             # K > 128: two key blocks
]


@pytest.mark.parametrize("case", CASES, ids=["odd-T-GVA", "packed-vfirst", "two-k-blocks"])
def test_torch_path_matches_autograd_reference(case):
    B, T, H, HV, K, V, cu, chunk, svf = case
    ins = make(B, T, H, HV, K, V, cu=cu, chunk=chunk, state_v_first=svf, dtype=torch.float64)
    check(gb.chunk_bwd_dqkwg(**ins), reference(**ins), 1e-12)
    got = gb.chunk_bwd_dqkwg(**{**ins, "w": None, "dv": None})
    assert got[2] is None


def test_contract_and_bad_input():
    ins = make(1, 10, 1, 2, 8, 8)
    dq, dk, dw, dg = gb.chunk_bwd_dqkwg(**ins)
    assert dq.shape == dk.shape == ins["q"].shape and dw.shape == ins["w"].shape and dg.shape == ins["g"].shape
    assert dg.dtype == torch.float32 and dq.dtype == ins["q"].dtype
    assert list(gb.SIGNATURE.parameters) == ["q", "k", "v", "do", "h", "dh", "w", "g", "g_gamma", "dv", "scale",
                                             "state_v_first", "cu_seqlens", "chunk_size", "chunk_indices"]
    with pytest.raises(ValueError, match="gated"):
        gb.chunk_bwd_dqkwg(**{**ins, "g": None})
    with pytest.raises(ValueError, match="together"):
        gb.chunk_bwd_dqkwg(**{**ins, "dv": None})
    cu = torch.tensor([0, 5, 70, 71, 150])
    assert gb.chunk_indices_for(cu, 64).tolist() == [[0, 0], [1, 0], [1, 1], [2, 0], [3, 0], [3, 1]]


# ---- the Triton kernel under the interpreter (fp32) ---------------------------------------------

def _interpret_main():
    assert gb.INTERPRET and gb.triton is not None
    errs = []
    for i, (B, T, H, HV, K, V, cu, chunk, svf) in enumerate(CASES):
        ins = make(B, T, H, HV, K, V, cu=cu, chunk=chunk, state_v_first=svf, seed=10 + i)
        want = reference(**ins)
        got = gb.chunk_bwd_dqkwg(**ins)
        check(got, want, 2e-5, f"case {i}")
        errs.append([rel_err(a, b) for a, b in zip(got, want)])
        if i == 0:  # without w / dv (USE_DW off), and a precomputed chunk_indices
            got = gb.chunk_bwd_dqkwg(**{**ins, "w": None, "dv": None})
            assert got[2] is None
            check([got[0], got[1], want[2], got[3]], want, 2e-5, "no dw")
        if cu is not None:
            got = gb.chunk_bwd_dqkwg(**ins, chunk_indices=gb.chunk_indices_for(ins["cu_seqlens"], chunk))
            check(got, want, 2e-5, "chunk_indices given")
    print(json.dumps({"ok": True, "rel_err": errs}))


def test_kernel_under_triton_interpreter():
    pytest.importorskip("triton")
    run_under_interpreter(__file__)


# ---- the hook into fla's backward (CPU tensors: fla's dispatch reaches our torch path) ------------

def _fla_hook_main():
    """Pretend to be fla's refusing configuration (Hopper, Triton 3.6), then call chunk_bwd_dqkwg by the
    name fla's gated delta rule calls it: refused before the primitive's first use, ours after."""
    import fla.ops.common.chunk_o as co
    import fla.ops.gated_delta_rule.chunk as gdr
    import fla.utils as fu

    for mod in (fu, co):
        mod.IS_NVIDIA_HOPPER, mod.TRITON_ABOVE_3_4_0, mod.TRITON_ABOVE_3_7_1 = True, True, False
    from bumblebee.primitives import linear_attention as la

    ins = make(1, 150, 1, 3, 16, 40, cu=[0, 5, 70, 71, 150], dtype=torch.float64)
    try:
        gdr.chunk_bwd_dqkwg(**ins)
        raise AssertionError("fla's guard did not refuse")
    except RuntimeError as e:
        assert "incorrect results" in str(e)
    assert la.fla_refuses_gated_backward() and la.fla_ops() is not None
    assert la.fla_backward_ok() and la.DQKWG_HOOK
    check(gdr.chunk_bwd_dqkwg(**ins), reference(**ins), 1e-12)
    print(json.dumps({"ok": True, "hook": la.DQKWG_HOOK}))


@pytest.mark.parametrize("dispatch", ["registry", "no-dispatch"])
def test_fla_backward_finds_this_kernel(dispatch):
    if importlib.util.find_spec("fla") is None:
        pytest.skip("flash-linear-attention is not installed")
    env = {**os.environ, "FLA_DISABLE_BACKEND_DISPATCH": "1" if dispatch == "no-dispatch" else "0"}
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, __file__, "--fla-hook"], env=env, cwd=root, capture_output=True,
                          text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    hook = json.loads(proc.stdout.strip().splitlines()[-1])["hook"]
    assert ("registry" in hook) == (dispatch == "registry"), hook


# ---- GPU: bf16 at Qwen3.5-35B-A3B head sizes; against fla; inside fla's backward -----------------

QWEN = dict(H=16, HV=32, K=128, V=128)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("packed", [False, True])
def test_kernel_bf16_gpu_within_torch_error(packed):
    """bf16 inputs: within 4x plain PyTorch's own bf16 error (the reference run in bf16) of float64."""
    cu = [0, 1000, 1001, 2900, 4133] if packed else None
    B, T = (1, 4133) if packed else (2, 2085)
    ins = make(B, T, **QWEN, cu=cu, dtype=torch.bfloat16, device="cuda", seed=3)
    want = reference(**ins)
    torch_bf16 = reference(**ins, dtype=torch.bfloat16)
    got = gb.chunk_bwd_dqkwg(**ins)
    for n, a, t, r in zip(("dq", "dk", "dw", "dg"), got, torch_bf16, want):
        e, e_torch = rel_err(a, r), rel_err(t, r)
        assert e <= 4 * e_torch + 1e-3, (n, e, e_torch)  # a wrong mask, gate or head map gives O(1)


@pytest.mark.gpu
@gpu
def test_kernel_fp32_gpu():
    ins = make(1, 1111, **QWEN, cu=[0, 77, 1111], device="cuda", seed=4)
    check(gb.chunk_bwd_dqkwg(**ins), reference(**ins), 5e-3, "fp32 (tf32 dots)")


def _fla_refuses():
    try:
        from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1
    except ImportError:
        pytest.skip("flash-linear-attention is not installed")
    return IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1


@pytest.mark.gpu
@gpu
def test_kernel_matches_fla_where_fla_is_trusted_gpu():
    if _fla_refuses():
        pytest.skip("fla's gated chunk_bwd_dqkwg is refused here (Hopper, Triton in [3.4, 3.7.1)); "
                    "the float64 tests above cover this kernel")
    import fla.ops.common.chunk_o as fo

    ins = make(1, 3000, **QWEN, cu=[0, 1000, 1001, 3000], dtype=torch.bfloat16, device="cuda", seed=5)
    want = reference(**ins)
    theirs = fo.chunk_bwd_dqkwg(**ins)
    ours = gb.chunk_bwd_dqkwg(**ins)
    for n, a, b, r in zip(("dq", "dk", "dw", "dg"), ours, theirs, want):
        assert rel_err(a, r) <= 2 * rel_err(b, r) + 1e-3, n


@pytest.mark.gpu
@gpu
def test_fla_gated_backward_runs_this_kernel_gpu(monkeypatch):
    """Where fla refuses its own, the primitive's backward goes through this kernel (and trains)."""
    from bumblebee.primitives import linear_attention as la

    if not _fla_refuses():
        pytest.skip("fla's own gated backward is usable here")
    assert la.fla_ops() is not None and la.fla_backward_ok() and la.DQKWG_HOOK, la.DQKWG_HOOK
    calls = []
    real = gb.chunk_bwd_dqkwg
    monkeypatch.setattr(gb, "chunk_bwd_dqkwg", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    layer = la.FLAGatedDeltaNet(la.FLAConfig(), 256, 2, 4, 64, 64).cuda().bfloat16()
    x = torch.randn(1, 300, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    layer(x).sum().backward()
    assert calls == [1] and torch.isfinite(x.grad).all()


if __name__ == "__main__" and "--interpret" in sys.argv:
    _interpret_main()
if __name__ == "__main__" and "--fla-hook" in sys.argv:
    _fla_hook_main()
