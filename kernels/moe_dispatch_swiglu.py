"""Fused SwiGLU elementwise for the expert GEMMs (Triton): one pass forward, one pass backward.

`kernels/moe_dispatch_expert_gemm.py` computes h = x @ w1.T = [gate | up] ([M, 2I], one row per routed copy)
and a = silu(gate) * up for the second GEMM; its backward needs a again (w2's wgrad) and
dh = [dgate | dup] from da = g @ w2:

  swiglu(h, out=None)                 a = silu(gate) * up                                [M, I]
  swiglu_grads(h, da, dh_out, a_out)  a, dup = da * silu(gate),
                                      dgate = da * up * sig(gate) * (1 + gate (1 - sig(gate)))
  swiglu_grads_weighted(h, du, w, ...) the same for rows whose routing weight w [M] is applied on
                                      the expert side (the fused recompute): da = w du, returns
                                      (w a, dh, gw = rowsum(du a) in fp32) in the same one pass

The torch path (`expert_gemm` without `swiglu=`, what the twins run) spends two kernels forward and
five backward, each a full pass over [M, I] (the gate/up halves are strided views, so PyTorch takes
its slow non-vectorized elementwise path for them). In elements of [M, I]: forward 5 (silu reads
gate and writes s; the product reads s and up and writes a), backward ~16 (silu, a, two products,
silu_backward). Fused: forward reads 2 and writes 1; backward reads 3 (h, da) and writes 3 (a, dh). The weighted
backward's torch ops take ~5 more fp32 passes over [M, I] (w du, du a, its row sum, w a); fused they
cost one [M] read and one [M] write.
At 16K tokens/rank of Qwen3.5-35B-A3B (M ~ 131072, I = 512, bf16) that is 0.40 + 0.81 GB per layer.

Precision: everything in fp32 (fp64 for fp64 inputs: those take the torch fallback), one rounding
per output. The torch path rounds silu(gate) and da * up to the input dtype before the next
product, so in bf16 the fused values are closer to the exact ones. On CUDA (or under
TRITON_INTERPRET=1) fp32/fp16/bf16 tensors run the kernels; elsewhere `*_torch`, the same math.
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is absent on some CPU-only installs
    triton = None

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_ELEMS = 4096  # elements of one [BLOCK_M, BLOCK_I] tile: 32 per thread at 4 warps
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def use_triton(t: torch.Tensor) -> bool:
    return triton is not None and (t.is_cuda or INTERPRET) and t.dtype in _KERNEL_DTYPES


if triton is not None:
    @triton.jit
    def _swiglu_fwd_kernel(h_ptr, a_ptr, M, I, s_h, s_a, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr):
        rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None]
        cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)[None, :]
        ok = (rows < M) & (cols < I)
        g = tl.load(h_ptr + rows * s_h + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(h_ptr + rows * s_h + I + cols, mask=ok, other=0.0).to(tl.float32)
        a = g * tl.sigmoid(g) * u
        tl.store(a_ptr + rows * s_a + cols, a.to(a_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _swiglu_bwd_kernel(h_ptr, d_ptr, w_ptr, a_ptr, dh_ptr, gw_ptr, M, I, s_h, s_d, s_a, s_dh,
                           BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, WEIGHTED: tl.constexpr,
                           ATOMIC: tl.constexpr):
        """d = da; WEIGHTED: d = du of rows weighted by w [M] after fc2 (writes w a, dh from w du and
        gw = rowsum(du a)); w_ptr / gw_ptr are unused otherwise."""
        rows1 = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        rows = rows1[:, None]
        cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)[None, :]
        ok = (rows < M) & (cols < I)
        g = tl.load(h_ptr + rows * s_h + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(h_ptr + rows * s_h + I + cols, mask=ok, other=0.0).to(tl.float32)
        d = tl.load(d_ptr + rows * s_d + cols, mask=ok, other=0.0).to(tl.float32)
        sig = tl.sigmoid(g)
        silu = g * sig
        a = silu * u
        if WEIGHTED:
            w = tl.load(w_ptr + rows1, mask=rows1 < M, other=0.0).to(tl.float32)[:, None]
            gw = tl.sum(d * a, axis=1)  # masked columns load 0
            d = d * w
            a = a * w
        tl.store(a_ptr + rows * s_a + cols, a.to(a_ptr.dtype.element_ty), mask=ok)
        tl.store(dh_ptr + rows * s_dh + cols, (d * u * sig * (1.0 + g * (1.0 - sig))).to(dh_ptr.dtype.element_ty),
                 mask=ok)
        tl.store(dh_ptr + rows * s_dh + I + cols, (d * silu).to(dh_ptr.dtype.element_ty), mask=ok)
        if WEIGHTED:
            if ATOMIC:  # several column blocks per row: partial sums into a zeroed gw
                tl.atomic_add(gw_ptr + rows1, gw, mask=rows1 < M)
            else:
                tl.store(gw_ptr + rows1, gw, mask=rows1 < M)


def _acc(t):
    return t.to(torch.promote_types(t.dtype, torch.float32))


def swiglu_torch(h: torch.Tensor, out=None) -> torch.Tensor:
    gate, up = _acc(h).chunk(2, dim=-1)
    a = (torch.nn.functional.silu(gate) * up).to(h.dtype)
    return a if out is None else out.copy_(a)


def swiglu_grads_torch(h, da, dh_out=None, a_out=None, w=None):
    """The kernels' backward math in fp32. With row weights w: (w a, dh from w da, rowsum(da a)),
    as `swiglu_grads_weighted`; without: (a, dh)."""
    gate, up = _acc(h).chunk(2, dim=-1)
    d = _acc(da)
    sig = torch.sigmoid(gate)
    silu = gate * sig
    a32 = silu * up
    if w is not None:
        w1 = _acc(w).unsqueeze(1)
        gw = (d * a32).sum(1)
        d, a32 = d * w1, a32 * w1
    I = gate.shape[-1]
    a = a_out if a_out is not None else h.new_empty(h.shape[0], I)
    dh = dh_out if dh_out is not None else torch.empty_like(h)
    a.copy_(a32)
    dh[:, :I].copy_(d * up * sig * (1 + gate * (1 - sig)))
    dh[:, I:].copy_(d * silu)
    return (a, dh) if w is None else (a, dh, gw)


def _check(h, da=None, outs=()):
    if h.dim() != 2 or h.shape[1] % 2 or h.stride(-1) != 1:
        raise ValueError(f"h must be [M, 2I] with unit last stride, got {tuple(h.shape)} strides {h.stride()}")
    M, I = h.shape[0], h.shape[1] // 2
    for name, t, shape in [("da", da, (M, I))] + list(outs):
        if t is not None and (tuple(t.shape) != shape or t.stride(-1) != 1 or t.dtype != h.dtype
                              or t.device != h.device):
            raise ValueError(f"{name} must be {shape} {h.dtype} on {h.device} with unit last stride, "
                             f"got {tuple(t.shape)} {t.dtype} on {t.device} strides {t.stride()}")
    return M, I


def _grid(M, I):
    block_i = min(triton.next_power_of_2(max(I, 1)), 1024)
    block_m = max(1, BLOCK_ELEMS // block_i)
    return block_m, block_i, (triton.cdiv(M, block_m), triton.cdiv(I, block_i))


def swiglu(h: torch.Tensor, out=None) -> torch.Tensor:
    """a [M, I] = silu(gate) * up of h [M, 2I] = [gate | up] (into `out` if given)."""
    M, I = _check(h, outs=[("out", out, (h.shape[0], h.shape[1] // 2))])
    if not use_triton(h):
        return swiglu_torch(h, out)
    a = out if out is not None else h.new_empty(M, I)
    if M and I:
        bm, bi, grid = _grid(M, I)
        _swiglu_fwd_kernel[grid](h, a, M, I, h.stride(0), a.stride(0), BLOCK_M=bm, BLOCK_I=bi)
    return a


def swiglu_grads(h: torch.Tensor, da: torch.Tensor, dh_out=None, a_out=None):
    """(a [M, I], dh [M, 2I] = [dgate | dup]) from h = [gate | up] and da = dL/da, in one pass;
    `dh_out` / `a_out`: where to write them (e.g. row slices of buffers shared by chunks)."""
    M, I = _check(h, da, outs=[("dh_out", dh_out, tuple(h.shape)), ("a_out", a_out, (h.shape[0], h.shape[1] // 2))])
    if not use_triton(h):
        return swiglu_grads_torch(h, da, dh_out, a_out)
    a = a_out if a_out is not None else h.new_empty(M, I)
    dh = dh_out if dh_out is not None else torch.empty_like(h)
    if M and I:
        bm, bi, grid = _grid(M, I)
        _swiglu_bwd_kernel[grid](h, da, h, a, dh, h, M, I, h.stride(0), da.stride(0), a.stride(0), dh.stride(0),
                                 BLOCK_M=bm, BLOCK_I=bi, WEIGHTED=False, ATOMIC=False)
    return a, dh


def swiglu_grads_weighted(h: torch.Tensor, du: torch.Tensor, w: torch.Tensor, dh_out=None, a_out=None):
    """`swiglu_grads` for rows weighted after fc2 (out = w * (a @ w2.T)), in one pass: du [M, I] is
    the fc2 dgrad of the unweighted rows, w [M] the routing weights. Returns (w a [M, I] for w2's
    wgrad, dh [M, 2I] from da = w du, gw [M] fp32 = rowsum(du a), the weights' gradient)."""
    M, I = _check(h, du, outs=[("dh_out", dh_out, tuple(h.shape)), ("a_out", a_out, (h.shape[0], h.shape[1] // 2))])
    if w.shape != (M,) or w.device != h.device or not w.is_floating_point():
        raise ValueError(f"w must be a floating [M={M}] tensor on {h.device}, got {tuple(w.shape)} {w.dtype} "
                         f"on {w.device}")
    if not use_triton(h):
        return swiglu_grads_torch(h, du, dh_out, a_out, w=w)
    a = a_out if a_out is not None else h.new_empty(M, I)
    dh = dh_out if dh_out is not None else torch.empty_like(h)
    if M and I:
        bm, bi, grid = _grid(M, I)
        atomic = grid[1] > 1
        gw = (torch.zeros if atomic else torch.empty)(M, dtype=torch.float32, device=h.device)
        _swiglu_bwd_kernel[grid](h, du, w.contiguous(), a, dh, gw, M, I, h.stride(0), du.stride(0), a.stride(0),
                                 dh.stride(0), BLOCK_M=bm, BLOCK_I=bi, WEIGHTED=True, ATOMIC=atomic)
    else:
        gw = torch.zeros(M, dtype=torch.float32, device=h.device)
    return a, dh, gw
