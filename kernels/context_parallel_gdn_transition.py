"""The transition map of a gated delta rule segment, for context parallelism's chain pass.

A rank that holds a segment of a sequence summarizes it as an affine map of the state entering it:
S_out = M @ S_in + S_local (forward), and the same for the state gradient in reverse. fla 0.6's CP
kernels (`chunk_cp_fwd_kernel_h` / `chunk_cp_bwd_kernel_dh`) compute M by composing each chunk's
full [K, K] transform, `M = (g_l I - K~^T W) @ M`, in tf32x3 with three [K, K] fp32 tiles per
program. In a CP = 2 layer at 128K tokens on an H200 (Qwen3.5's 32 value heads of 128) those two
kernels took 28 of a rank's 71 ms (`probe_gdn_profile.py`); over one 32K part, 5.4 ms forward and
5.0 backward against 0.74 ms for fla's plain state scan (`probe_cp_transition.py`).

Here M's columns are carried like a state with K value columns, in blocks of BV: per chunk of BT
tokens, with W, K [BT, K] the chunk's rows, G [BT] its chunk-local cumulative gate (log2 units),
d = exp2(g_l - G) each row's decay to the chunk's end and g_l = G[BT-1],

    forward:  T = d * (W @ M);   M = exp2(g_l) M - K^T @ T
    backward: T = d * (K @ M);   M = exp2(g_l) M - W^T @ T      (chunks in reverse)

two [BT, K] x [K, BV] products a chunk instead of a [K, K] x [K, K] one, and no [K, K] tile; W and
K enter as they are (bf16: exact operands). `precision`, what M and T are rounded to before each
product (fp32 accumulation throughout): "fp32" none (tf32x3 products, as fla's); "bf16x2" a hi + lo
pair of bf16 (two products each, ~16 significant bits); "bf16" one bf16, the arithmetic of fla's own
state scan (the single layer's state carries that rounding too). Measured over a 32K part on an
H200: fp32 4.4 / 5.6 ms (forward / backward), bf16 0.82 / 1.06 ms. Shapes as fla's: k [1, T, H, K], w [1, T, HV, K], g [1, T, HV]
fp32; `cu_seqlens` [2] (the segment's start and end); out [HV, K, K] (a strided view is fine: the
`[..., V:]` columns of fla's [HV, K, V + K] summary). On CUDA (or under TRITON_INTERPRET=1) the
Triton kernel runs; elsewhere `transition_torch`, the same per-chunk algorithm.
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
PRECISIONS = ("fp32", "bf16x2", "bf16")  # the kernel's MODE 0, 1, 2


def use_triton(t: torch.Tensor) -> bool:
    return triton is not None and (t.is_cuda or INTERPRET)


if triton is not None:
    @triton.jit
    def _transition_kernel(k, w, g, out, cu_seqlens, stride_oh, stride_ok, H: tl.constexpr, HV: tl.constexpr,
                           K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                           REVERSE: tl.constexpr, MODE: tl.constexpr):
        i_c, i_h = tl.program_id(0), tl.program_id(1).to(tl.int64)
        bos = tl.load(cu_seqlens).to(tl.int64)
        T = (tl.load(cu_seqlens + 1).to(tl.int64) - bos).to(tl.int32)
        NT = tl.cdiv(T, BT)
        k += (bos * H + i_h // (HV // H)) * K
        w += (bos * HV + i_h) * K
        g += bos * HV + i_h
        o_k = tl.arange(0, BK)
        m_k = o_k < K
        o_c = i_c * BV + tl.arange(0, BV)
        b_m = tl.where(o_k[:, None] == o_c[None, :], 1.0, 0.0)  # [BK, BV]: the identity's columns
        for s in range(NT):
            i_t = NT - 1 - s if REVERSE else s
            o_t = i_t * BT + tl.arange(0, BT)
            m_t = o_t < T
            last = tl.minimum((i_t + 1) * BT, T) - 1
            b_k = tl.load(k + o_t[:, None] * (H * K) + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
            b_w = tl.load(w + o_t[:, None] * (HV * K) + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
            b_gl = tl.load(g + last * HV).to(tl.float32)
            b_g = tl.load(g + o_t * HV, mask=m_t, other=0.0).to(tl.float32)
            b_d = tl.where(m_t, tl.exp2(b_gl - b_g), 0.0)  # each row's decay to the chunk's end
            # T = d * (X @ M), M = exp2(g_l) M - Y^T @ T: X, Y = W, K forward; K, W backward
            b_x = b_k if REVERSE else b_w
            b_y = b_w if REVERSE else b_k
            if MODE == 0:  # tf32x3 on fp32 operands
                b_t = tl.dot(b_x.to(tl.float32), b_m, input_precision="tf32x3") * b_d[:, None]
                b_u = tl.dot(tl.trans(b_y.to(tl.float32)), b_t, input_precision="tf32x3")
            else:  # bf16 operands (the inputs' own, exact), M and T rounded once (MODE 2) or as hi + lo (MODE 1)
                b_hi = b_m.to(b_x.dtype)
                b_t = tl.dot(b_x, b_hi)
                if MODE == 1:
                    b_t = tl.dot(b_x, (b_m - b_hi.to(tl.float32)).to(b_x.dtype), b_t)
                b_t = b_t * b_d[:, None]
                b_thi = b_t.to(b_y.dtype)
                b_u = tl.dot(tl.trans(b_y), b_thi)
                if MODE == 1:
                    b_u = tl.dot(tl.trans(b_y), (b_t - b_thi.to(tl.float32)).to(b_y.dtype), b_u)
            b_m = b_m * tl.exp2(b_gl) - b_u
        p = out + i_h * stride_oh + o_k[:, None] * stride_ok + o_c[None, :]
        tl.store(p, b_m.to(out.dtype.element_ty), mask=m_k[:, None] & (o_c < K)[None, :])


def _check(k, w, g, cu_seqlens, out, chunk_size, precision):
    if precision not in PRECISIONS:
        raise ValueError(f"transition_map: precision must be one of {PRECISIONS}; got {precision!r}")
    if k.dim() != 4 or k.shape[0] != 1 or w.dim() != 4 or w.shape[:2] != k.shape[:2] or w.shape[3] != k.shape[3]:
        raise ValueError(f"transition_map: k [1, T, H, K] and w [1, T, HV, K] expected; got {tuple(k.shape)}, "
                         f"{tuple(w.shape)}")
    H, HV, K = k.shape[2], w.shape[2], k.shape[3]
    if HV % H:
        raise ValueError(f"transition_map: value heads ({HV}) must be a multiple of key heads ({H})")
    if g.shape != w.shape[:3]:
        raise ValueError(f"transition_map: g must be [1, T, HV] = {tuple(w.shape[:3])}; got {tuple(g.shape)}")
    if out.shape != (HV, K, K) or out.stride(2) != 1:
        raise ValueError(f"transition_map: out must be [HV, K, K] = {(HV, K, K)} with unit last stride; got "
                         f"{tuple(out.shape)} strides {out.stride()}")
    if cu_seqlens.numel() != 2:
        raise ValueError(f"transition_map: cu_seqlens must hold the segment's [start, end]; got {cu_seqlens.numel()}")
    if not (isinstance(chunk_size, int) and chunk_size >= 16 and chunk_size & (chunk_size - 1) == 0):
        raise ValueError(f"transition_map: chunk_size must be a power of two >= 16; got {chunk_size!r}")


def transition_map(k, w, g, cu_seqlens, out, *, chunk_size: int = 64, reverse: bool = False,
                   precision: str = "fp32") -> torch.Tensor:
    """Write the segment `cu_seqlens` = [start, end]'s transition map into `out` [HV, K, K]
    (forward: the entering state's map to the leaving one; `reverse`: the backward's, the leaving
    state gradient's to the entering one) and return it."""
    _check(k, w, g, cu_seqlens, out, chunk_size, precision)
    if not use_triton(k):
        out.copy_(transition_torch(k, w, g, cu_seqlens, chunk_size=chunk_size, reverse=reverse, precision=precision))
        return out
    K, HV = k.shape[3], w.shape[2]
    BK = triton.next_power_of_2(K)
    BV = 32 if K <= 64 else 64
    _transition_kernel[(triton.cdiv(K, BV), HV)](
        k, w, g, out, cu_seqlens, out.stride(0), out.stride(1), H=k.shape[2], HV=HV, K=K,
        BT=chunk_size, BK=BK, BV=BV, REVERSE=reverse, MODE=PRECISIONS.index(precision), num_warps=4,
        num_stages=2)
    return out


def transition_torch(k, w, g, cu_seqlens, *, chunk_size: int = 64, reverse: bool = False,
                     precision: str = "fp32") -> torch.Tensor:
    """The kernel's algorithm in torch (CPU): [HV, K, K] fp32, M and T rounded as the kernel's `precision`
    rounds them (bf16: once; bf16x2: to a hi + lo pair)."""
    lo, hi = (int(x) for x in cu_seqlens.tolist())
    H, HV, K = k.shape[2], w.shape[2], k.shape[3]
    kk = k[0, lo:hi].float().repeat_interleave(HV // H, dim=1).transpose(0, 1)  # [HV, L, K]
    ww, gg = w[0, lo:hi].float().transpose(0, 1), g[0, lo:hi].float().transpose(0, 1)  # [HV, L, K], [HV, L]

    def rnd(t):
        if precision == "fp32":
            return t
        top = t.bfloat16().float()
        return top if precision == "bf16" else top + (t - top).bfloat16().float()
    m = torch.eye(K, device=k.device).expand(HV, K, K).clone()
    x, y = (kk, ww) if reverse else (ww, kk)
    starts = range(0, hi - lo, chunk_size)
    for s in (reversed(starts) if reverse else starts):
        gc = gg[:, s:s + chunk_size]
        gl = gc[:, -1:]
        t = (x[:, s:s + chunk_size] @ rnd(m)) * torch.exp2(gl - gc)[..., None]
        m = m * torch.exp2(gl)[..., None] - y[:, s:s + chunk_size].transpose(1, 2) @ rnd(t)
    return m
