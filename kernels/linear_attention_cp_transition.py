"""The transition map of a gated delta rule segment, for context parallelism's chain pass.

A rank that holds a segment of a sequence summarizes it as an affine map of the state entering it:
S_out = M @ S_in + S_local (forward), and the same for the state gradient in reverse. fla 0.6's CP
kernels (`chunk_cp_fwd_kernel_h` / `chunk_cp_bwd_kernel_dh`) compute M by composing each chunk's
full [K, K] transform, `M = (g_l I - K~^T W) @ M`, in tf32x3 with three [K, K] fp32 tiles per
program: on an H200 at 64K tokens a rank (Qwen3.5's 32 value heads of 128) that scan takes 6.6 ms a
call against 0.8 ms for fla's state scan over the same chunks, and the forward and backward maps
were 40% of a CP = 2 layer's time (`benchmarks/context_parallel/probes/probe_gdn_profile.py`).

Here M's columns are carried like a state with K value columns, in blocks of BV: per chunk of BT
tokens, with W, K [BT, K] the chunk's rows, G [BT] its chunk-local cumulative gate (log2 units) and
g_l = G[BT-1] (the decay over the chunk is exp2(g_l)),

    forward:  T = W @ M;                        M = exp2(g_l) M - (exp2(g_l - G) * K)^T @ T
    backward: T = (exp2(g_l - G) * K) @ M;      M = exp2(g_l) M - W^T @ T      (chunks in reverse)

two [BT, K] x [K, BV] products a chunk instead of a [K, K] x [K, K] one, and no [K, K] tile.
`precision`: "fp32" keeps M in fp32 through tf32x3 products (fla's promise: the chain in fp32);
"bf16" rounds M and T to bf16 before each product, the arithmetic of fla's own state scan (the single
layer's state carries that rounding too). Shapes as fla's: k [1, T, H, K], w [1, T, HV, K], g [1, T, HV]
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
PRECISIONS = ("fp32", "bf16")


def use_triton(t: torch.Tensor) -> bool:
    return triton is not None and (t.is_cuda or INTERPRET)


if triton is not None:
    @triton.jit(do_not_specialize=["T"])
    def _transition_kernel(k, w, g, out, cu_seqlens, stride_oh, stride_ok, T, H: tl.constexpr, HV: tl.constexpr,
                           K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                           REVERSE: tl.constexpr, FP32: tl.constexpr):
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
            if FP32:
                b_kd = b_k.to(tl.float32) * b_d[:, None]
                b_wf = b_w.to(tl.float32)
                if REVERSE:
                    b_t = tl.dot(b_kd, b_m, input_precision="tf32x3")
                    b_m = b_m * tl.exp2(b_gl) - tl.dot(tl.trans(b_wf), b_t, input_precision="tf32x3")
                else:
                    b_t = tl.dot(b_wf, b_m, input_precision="tf32x3")
                    b_m = b_m * tl.exp2(b_gl) - tl.dot(tl.trans(b_kd), b_t, input_precision="tf32x3")
            else:  # fla's state scan: the decay on the [BT, BV] product, bf16 operands, fp32 accumulation
                if REVERSE:
                    b_t = tl.dot((b_k.to(tl.float32) * b_d[:, None]).to(b_w.dtype), b_m.to(b_w.dtype))
                    b_m = b_m * tl.exp2(b_gl) - tl.dot(tl.trans(b_w), b_t.to(b_w.dtype))
                else:
                    b_t = tl.dot(b_w, b_m.to(b_w.dtype)) * b_d[:, None]
                    b_m = b_m * tl.exp2(b_gl) - tl.dot(tl.trans(b_k), b_t.to(b_k.dtype))
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
        k, w, g, out, cu_seqlens, out.stride(0), out.stride(1), k.shape[1], H=k.shape[2], HV=HV, K=K,
        BT=chunk_size, BK=BK, BV=BV, REVERSE=reverse, FP32=precision == "fp32", num_warps=4, num_stages=2)
    return out


def transition_torch(k, w, g, cu_seqlens, *, chunk_size: int = 64, reverse: bool = False,
                     precision: str = "fp32") -> torch.Tensor:
    """The kernel's algorithm in torch (CPU): [HV, K, K] fp32 ("bf16": M and T rounded as the kernel does)."""
    lo, hi = (int(x) for x in cu_seqlens.tolist())
    H, HV, K = k.shape[2], w.shape[2], k.shape[3]
    kk = k[0, lo:hi].float().repeat_interleave(HV // H, dim=1).transpose(0, 1)  # [HV, L, K]
    ww, gg = w[0, lo:hi].float().transpose(0, 1), g[0, lo:hi].float().transpose(0, 1)  # [HV, L, K], [HV, L]
    rnd = (lambda t: t.bfloat16().float()) if precision == "bf16" else (lambda t: t)
    m = torch.eye(K, device=k.device).expand(HV, K, K).clone()
    starts = range(0, hi - lo, chunk_size)
    for s in (reversed(starts) if reverse else starts):
        kc, wc, gc = kk[:, s:s + chunk_size], ww[:, s:s + chunk_size], gg[:, s:s + chunk_size]
        gl = gc[:, -1:]
        kd = kc * torch.exp2(gl - gc)[..., None]
        if reverse:
            t = rnd(kd) @ rnd(m)
            m = m * torch.exp2(gl)[..., None] - wc.transpose(1, 2) @ rnd(t)
        else:
            t = (wc @ rnd(m)) * torch.exp2(gl - gc)[..., None] if precision == "bf16" else wc @ m
            m = m * torch.exp2(gl)[..., None] - (kc if precision == "bf16" else kd).transpose(1, 2) @ rnd(t)
    return m
